"""Ling-3.0's KDA gated output norm inside the one-launch decode (CUDA): the layer's selection
(:func:`~vllm_ling.models.kda_output_norm.select_kda_output_norm`), what its op runs, and the reader.

Where it serves, the layer's op (:func:`vllm_ling.layers.kda_fused_conv.kda_attention`) hands back the
normed output: the one launch applies the norm at decode and in verify windows (:func:`output_norm`), the
other batches run vLLM's norm kernel on the core's output inside the op (:func:`normed`), and the layer's
forward skips its own norm. :data:`READER` reads back what the op and the forward will do; the known answers
of ``kda_decode`` run the launch with the layer's norm.
"""

from __future__ import annotations


import torch

from vllm_ling.layers import kda_decode
from vllm_ling.layers.selection_said import say_selection
from vllm_ling.log import get_logger
from vllm_ling.models.kda_decode import KdaDecode
from vllm_ling.models.kda_output_norm import GATE_ACTIVATION, NORM_DESCRIPTION, OPTION, KdaOutputNorm, \
    select_kda_output_norm
from vllm_ling.models.layer_kinds import is_kda_module, kda_layers
from vllm_ling.ops.kda_decode import OutputNorm
from vllm_ling.options import LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Platform, Reader, Selection, Served, record

logger = get_logger("kda")

ACTIVE_ATTR = "ling_kda_output_norm"  # on the layer: True where its op hands back the normed output


def norm_problems(layer) -> list[str]:
    """Why the launch cannot compute the layer's output norm (empty when it can), from what vLLM built."""
    norm = getattr(layer, "o_norm", None)
    if norm is None:
        return ["the layer has no o_norm"]
    problems = []
    if getattr(norm, "activation", None) != GATE_ACTIVATION:
        problems.append(f"the output gate's activation is {getattr(norm, 'activation', None)!r}, not "
                        f"{GATE_ACTIVATION!r}")
    weight = getattr(norm, "weight", None)
    if weight is None or weight.numel() != getattr(layer, "head_dim", -1):
        problems.append("the norm has no weight of one value per head channel")
    if getattr(norm, "bias", None) is not None:
        problems.append("the norm has a bias")
    return problems


def decide(layer, decode: Selection, platform: Platform) -> Selection:
    """The layer's selection, said once (:func:`~vllm_ling.layers.selection_said.say_selection`)."""
    enabled = LingOptions.current().kda_output_norm
    selection = select_kda_output_norm(enabled, platform, decode.choice is KdaDecode.LING, norm_problems(layer))
    return say_selection(
        logger, "kda-output-norm", selection, selection.choice is KdaOutputNorm.LING, enabled, platform,
        f"KDA output norm: {NORM_DESCRIPTION}.",
        f"KDA output norm inside the decode launch is OFF by explicit choice ({opt_out_setting(OPTION)}): vLLM's "
        "norm kernel after each KDA layer's core; the startup report marks kda_output_norm inactive.",
        f"KDA output norm inside the decode launch off for {layer.prefix} and similar layers: {{reason}}; vLLM's "
        "norm serves them (the startup check kda_output_norm reports it).")


def install(layer, decode: Selection, platform: Platform) -> Selection:
    """Decide and record; the op and the layer's forward read :data:`ACTIVE_ATTR`."""
    selection = record(layer, decide(layer, decode, platform))
    setattr(layer, ACTIVE_ATTR, selection.choice is KdaOutputNorm.LING)
    return selection


def active(layer) -> bool:
    return bool(getattr(layer, ACTIVE_ATTR, False))


def output_norm(layer, gate: torch.Tensor) -> OutputNorm:
    """The layer's norm as the launch applies it, with the rows' raw gate projection ``gate`` [tokens, P]."""
    return OutputNorm(gate, layer.o_norm.weight, float(layer.o_norm.eps))


def normed(layer, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """vLLM's norm of the core's rows ``core`` [tokens, heads, head_dim] with the raw gate rows ``gate``
    [tokens, P], for the batches the launch does not serve (prefills): its CUDA kernel
    (``FusedRMSNormGated.forward_cuda``, one launch), as vLLM's compiled forward would compute it with Inductor
    (``forward_native``) up to the kernels' fp32 order."""
    return layer.o_norm.forward_cuda(core, gate.unflatten(-1, (-1, layer.head_dim)))


def served(layer) -> Served:
    """What computes a KDA layer's output norm at decode, read from the layer: the one launch where its op
    hands back the normed output (the flag the op and the forward read) and the launch serves the layer."""
    if not active(layer):
        return Served.of(KdaOutputNorm.VLLM)
    if kda_decode.served(layer).key[0] is not KdaDecode.LING:
        return Served.of(None, label="the norm left to a decode launch that does not serve the layer")
    return Served.of(KdaOutputNorm.LING)


READER = Reader(
    Feature.KDA_OUTPUT_NORM, "kda_output_norm", "KDA layers' output norms", is_kda_module, served,
    f"see the WARNING naming the layer, or set {opt_out_setting(OPTION)}; a layer serving other than its "
    "selection is a defect: report it",
    expected=kda_layers, optimization="kda_output_norm", optimizing=frozenset({KdaOutputNorm.LING}),
    known_answers="kda_decode")
