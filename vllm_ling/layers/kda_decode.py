"""Ling-3.0's KDA decode step as one launch (CUDA): vllm-ling's Triton kernel
(:mod:`vllm_ling.ops.kda_decode`) in place of vLLM's fused conv, ``fused_kda_gate`` and
``fused_recurrent_kda`` kernels, for batches of plain decodes and batches of verify windows.

The layer's fused op (:func:`vllm_ling.layers.kda_fused_conv.kda_attention`) takes the raw gate
projection and beta logits, so the gate and beta are computed where they are used: inside this launch
at decode, by vLLM's kernels in the op for the batches it hands to them (prefills, and where this
feature is off). The launch writes the core output straight into the caller's ``core_attn_out``.

Each layer records its selection (:func:`~vllm_ling.models.kda_decode.select_kda_decode`) at
construction; :data:`READER` reads back what the op will run, and the known answers run
:func:`launch` (what the op calls) on scratch pools (:mod:`vllm_ling.ops.known_answer.kda_decode`).
"""

from __future__ import annotations

import importlib.util

import torch

from vllm_ling.layers.selection_said import say_selection
from vllm_ling.log import get_logger
from vllm_ling.models.kda_decode import DECODE_DESCRIPTION, OPTION, KdaDecode, select_kda_decode
from vllm_ling.models.kda_fused_conv import WEIGHT_ATTR
from vllm_ling.models.layer_kinds import is_kda_module, kda_layers
from vllm_ling.ops.kda_decode import MIN_BLOCK_V, KdaDecodeCall, OutputNorm, kda_decode, reserve_reader_counts
from vllm_ling.options import LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Platform, Reader, Selection, Served, record

logger = get_logger("kda")

KERNEL_LABEL = "vllm-ling's Triton KDA decode step (conv + gate + beta + L2 norms + delta rule, one launch)"
ACTIVE_ATTR = "ling_kda_decode"  # on the layer: True where its op runs the one launch at decode


def kernel_problems(layer) -> list[str]:
    """Why the kernel cannot serve the layer (empty when it can), from what vLLM built."""
    problems = []
    head_dim = getattr(layer, "head_dim", 0)
    if head_dim < MIN_BLOCK_V or head_dim & (head_dim - 1):
        problems.append(f"head_dim {head_dim} is not a power of 2 of at least {MIN_BLOCK_V}")
    conv = getattr(layer, "q_conv1d", None)
    if conv is None or conv.weight.shape[-1] < 2:
        problems.append("the layer has no causal conv of width 2 or more")
    b_proj = getattr(layer, "b_proj", None)
    heads = getattr(layer, "local_num_heads", None)
    if b_proj is None or getattr(b_proj, "output_size_per_partition", None) != heads:
        problems.append("beta is not one logit per head from a separate b_proj")
    from vllm.config import get_current_vllm_config

    model_config = get_current_vllm_config().model_config
    if model_config is not None and model_config.dtype != torch.bfloat16:
        problems.append(f"activations in {model_config.dtype}: the kernel rounds as BF16 stores do")
    if importlib.util.find_spec("triton") is None:
        problems.append("Triton is not installed")
    return problems


def decide(layer, fused_conv: bool, platform: Platform) -> Selection:
    """The layer's selection, said once (:func:`~vllm_ling.layers.selection_said.say_selection`)."""
    enabled = LingOptions.current().kda_decode
    selection = select_kda_decode(enabled, platform, fused_conv, kernel_problems(layer))
    return say_selection(
        logger, "kda-decode", selection, selection.choice is KdaDecode.LING, enabled, platform,
        f"KDA decode: {DECODE_DESCRIPTION}.",
        f"KDA one-launch decode is OFF by explicit choice ({opt_out_setting(OPTION)}): vLLM's conv, gate and "
        "recurrence kernels per layer and step; the startup report marks kda_decode inactive.",
        f"KDA one-launch decode off for {layer.prefix} and similar layers: {{reason}}; vLLM's kernels serve them "
        "(the startup check kda_decode reports it).")


def install(layer, fused_conv: bool, platform: Platform) -> Selection:
    """Decide and record; the op reads :data:`ACTIVE_ATTR`. Where it serves, the split heads' counters
    for the largest batch are made now, before any CUDA graph is captured."""
    selection = record(layer, decide(layer, fused_conv, platform))
    setattr(layer, ACTIVE_ATTR, selection.choice is KdaDecode.LING)
    device = layer.A_log.device  # where vLLM builds the layer's parameters, the pools' device
    if selection.choice is KdaDecode.LING and device.type != "meta":
        from vllm.config import get_current_vllm_config

        max_seqs = get_current_vllm_config().scheduler_config.max_num_seqs
        reserve_reader_counts(device, max_seqs * layer.local_num_heads)
    return selection


def launch(call: KdaDecodeCall, out: torch.Tensor) -> torch.Tensor:
    """What the op runs for a decode or verify-window batch (the known answers run it too)."""
    return kda_decode(call, out)


def step(layer, md, x: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, conv_state: torch.Tensor,
         recurrent_state: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, verify: bool,
         output_norm: OutputNorm | None = None) -> None:
    """One decode (``verify`` False) or verify-window batch of ``layer`` into ``out`` [tokens, heads,
    head_dim], from vLLM's GDN metadata ``md`` (slots, windows, accepted counts), the rows' raw
    projections and the layer's pools; ``output_norm``: the layer's gated output norm applied in the launch."""
    if verify:
        slots, cu, accepted = md.spec_state_indices_tensor, md.spec_query_start_loc, md.num_accepted_tokens
        num = md.num_spec_decodes
        slots, cu, accepted = slots[:num], cu[:num + 1], accepted[:num]
    else:
        slots, cu, accepted = md.non_spec_state_indices_tensor[:md.num_decodes], None, None
    launch(KdaDecodeCall(x, f, beta_logits, weight, conv_state, layer.A_log, layer.dt_bias, recurrent_state, slots,
                         layer.head_dim ** -0.5, layer.lower_bound if layer.safe_gate else None, cu, accepted,
                         output_norm), out)


def served(layer) -> Served:
    """What a KDA layer's op runs at decode, read from the layer: the one launch where the op will take
    it (the flag it reads, on a layer whose convolutions are fused), else vLLM's kernels."""
    if not getattr(layer, ACTIVE_ATTR, False):
        return Served.of(KdaDecode.VLLM)
    if getattr(layer, WEIGHT_ATTR, None) is None:
        return Served.of(None, label="the one-launch decode on a layer whose convolutions are not fused")
    return Served.of(KdaDecode.LING)


READER = Reader(
    Feature.KDA_DECODE, "kda_decode", "KDA layers' decode steps", is_kda_module, served,
    f"see the WARNING naming the layer, or set {opt_out_setting(OPTION)}; a layer serving other than its "
    "selection is a defect: report it",
    expected=kda_layers, optimization="kda_decode", optimizing=frozenset({KdaDecode.LING}),
    known_answers="kda_decode")
