"""Ling-3.0's KDA layer with its five block-FP8 input projections as one launch.

vLLM 0.32's ``BailingMoeV3KimiDeltaAttention`` runs three linears that all read the layer's
input: ``qkv_proj`` (q, k, v), ``f_proj`` and ``g_proj`` (``b_proj`` stays BF16 and separate).
:class:`MergedInProjection` (a mixin placed before the in-tree class) replaces them with one
column-parallel ``MergedColumnParallelLinear`` ``qkvfg_proj`` = [q, k, v, f, g], each its own
shard of ``heads * head_dim / tp`` rows, built with the layer's quant config: the dense
block-FP8 method that serves any other linear (vllm-ling's W8A16 kernel on CUDA, the dequantized
path on CPU, or vLLM's method when ``VLLM_LING_DENSE_FP8=vllm``) serves it unchanged, and the
block scales concatenate like the rows because every shard is a whole number of 128-row blocks
(vLLM's own ``qkv_proj`` already requires that of q and k; the merge adds nothing). Loading is
:mod:`vllm_ling.models.kda_merged_in_proj_loading`. ``VLLM_LING_KDA_MERGED_IN_PROJ=0`` keeps vLLM's three linears.

Each layer records its selection (:func:`~vllm_ling.models.kda_merged_in_proj.select_kda_merged_in_proj`:
left unmerged, with one WARNING, where the members differ in precision or vLLM builds ``qkvb_proj``)
and builds from it; its forward takes the merged linear wherever the layer holds one, which is what
:data:`READER` reads back for the startup verification.

:func:`merged_in_projections` gives (q, k, v, beta logits, f, g) for either form;
:class:`VllmKdaMergedInProj` (every platform but CPU) is vLLM's forward on those parts, with
vLLM's Triton kernels. q, k, v and g stay row-strided views, as q, k, v are in vLLM; ``f`` is
made contiguous because ``fused_kda_gate`` indexes rows as packed (a no-op at one token).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from vllm_ling.layers import kda_decode, kda_fused_conv, kda_output_norm
from vllm_ling.layers.out_of_tree import install_out_of_tree
from vllm_ling.log import get_logger, log_once
from vllm_ling.models.kda_fused_conv import KdaConv
from vllm_ling.models.kda_merged_in_proj import (MEMBERS, MERGED_DESCRIPTION, MERGED_NAME, OPTION, KdaInProj,
                                                 select_kda_merged_in_proj)
from vllm_ling.models.layer_kinds import is_kda_module, kda_layers
from vllm_ling.options import LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Reader, Selection, Served, record, serving_platform

logger = get_logger("kda")

IN_TREE_NAME = "BailingMoeV3KimiDeltaAttention"


def selection(layer: torch.nn.Module, quant_config, prefix: str) -> Selection:
    """The layer's selection (:func:`~vllm_ling.models.kda_merged_in_proj.select_kda_merged_in_proj`),
    from the option and what vLLM built: whether b_proj is separate, which members stay BF16."""
    from vllm.model_executor.models.bailing_moe_v3 import _is_fp8_module_excluded

    bf16 = tuple(m for m in MEMBERS if _is_fp8_module_excluded(quant_config, f"{prefix}.{m}"))
    return select_kda_merged_in_proj(LingOptions.current().kda_merged_in_proj, layer.separate_b_proj, bf16)


class MergedInProjection:
    """Mixin for subclasses of vLLM's ``BailingMoeV3KimiDeltaAttention``: builds ``qkvfg_proj``
    in place of ``qkv_proj``, ``f_proj`` and ``g_proj`` where its recorded selection says so (see
    the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        arguments = inspect.signature(super().__init__).bind(*args, **kwargs)
        arguments.apply_defaults()
        quant_config, prefix = arguments.arguments["quant_config"], arguments.arguments["prefix"]
        chosen = record(self, selection(self, quant_config, prefix))
        platform = serving_platform()
        conv = kda_fused_conv.install(self, chosen.choice is KdaInProj.MERGED, platform)
        decode = kda_decode.install(self, conv.choice is KdaConv.FUSED, platform)
        kda_output_norm.install(self, decode, platform)
        if chosen.choice is not KdaInProj.MERGED:
            log_once(logger, logging.WARNING, f"kda-unmerged-{chosen.reason}",
                     "KDA in-projections NOT merged (%s and similar layers): %s; vLLM's qkv_proj, f_proj and "
                     "g_proj run as separate linears (the startup report marks kda_merged_in_proj inactive).",
                     prefix, chosen.reason)
            return
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear
        from vllm.model_executor.models.bailing_moe_v3 import _is_fp8_module_excluded

        # all members share one precision (the selection): BF16 members build an unquantized linear
        quantized = not _is_fp8_module_excluded(quant_config, f"{prefix}.{MEMBERS[0]}")
        width = self.head_dim * self.num_heads
        merged = MergedColumnParallelLinear(self.hidden_size, [width] * len(MEMBERS), bias=False,
                                            quant_config=quant_config if quantized else None,
                                            prefix=f"{prefix}.{MERGED_NAME}")
        # vLLM's three are dropped before any weight loads (their storage with them)
        self.qkv_proj = self.f_proj = self.g_proj = None
        setattr(self, MERGED_NAME, merged)
        log_once(logger, logging.INFO, "kda-merged", "KDA in-projections: %s.", MERGED_DESCRIPTION)


def merged_in_projections(layer: torch.nn.Module, hidden_states: torch.Tensor):
    """(q, k, v, beta_logits, f, g) of ``hidden_states``, each [tokens, width per rank] (beta
    logits [tokens, heads per rank]), from the merged linear or from vLLM's modules."""
    width = layer.projection_size_per_partition
    merged = getattr(layer, MERGED_NAME, None)
    if merged is not None:
        q, k, v, f, g = merged(hidden_states)[0].split(width, dim=-1)
        return q, k, v, layer.b_proj(hidden_states)[0], f, g
    if layer.separate_b_proj:
        q, k, v = layer.qkv_proj(hidden_states)[0].split(width, dim=-1)
        beta_logits = layer.b_proj(hidden_states)[0]
    else:
        q, k, v, beta_logits = layer.qkvb_proj(hidden_states)[0].split(
            [width, width, width, layer.local_num_heads], dim=-1)
    return q, k, v, beta_logits, layer.f_proj(hidden_states)[0], layer.g_proj(hidden_states)[0]


@functools.cache
def vllm_merged_class():
    """vLLM's KDA layer with the merged in-projection and vLLM's own (Triton) computation."""
    from einops import rearrange
    from vllm.model_executor.models import bailing_moe_v3

    class VllmKdaMergedInProj(MergedInProjection, bailing_moe_v3.BailingMoeV3KimiDeltaAttention):
        """vLLM's forward on the parts of the merged projection (with the fused convolutions where
        recorded: :mod:`vllm_ling.layers.kda_fused_conv`)."""

        def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, output: torch.Tensor) -> None:
            """vLLM's signature: the output copied into the decoder layer's buffer."""
            if getattr(self, MERGED_NAME, None) is None:
                return super().forward(hidden_states, positions, output)
            output[:] = self.attention_output(hidden_states)

        def attention_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """The layer's output [tokens, hidden] as a value (:mod:`vllm_ling.models.kda_direct_output`;
            vLLM's forward into a buffer of its own where the in-projection is not merged)."""
            if getattr(self, MERGED_NAME, None) is None:
                output = torch.zeros_like(hidden_states)
                super().forward(hidden_states, None, output)
                return output
            num_tokens = hidden_states.size(0)
            width = self.projection_size_per_partition
            fused = getattr(self, kda_fused_conv.WEIGHT_ATTR, None) is not None
            shape = (1, num_tokens, self.local_num_heads, self.head_dim)
            if fused:  # q, k, v stay one [tokens, 3 P] view; the op takes the raw gate and beta logits
                qkv, f, g = getattr(self, MERGED_NAME)(hidden_states)[0].split([3 * width, width, width], dim=-1)
                # the op writes every row (the padding's zeros too), normed where kda_output_norm serves
                core_attn_out = torch.empty(shape, dtype=hidden_states.dtype, device=hidden_states.device)
                torch.ops.vllm_ling.kda_attention(qkv, f, self.b_proj(hidden_states)[0], g, core_attn_out,
                                                  self.prefix)
                if kda_output_norm.active(self):
                    return self.o_proj(rearrange(core_attn_out, "1 n h d -> n (h d)"))[0]
            else:
                q, k, v, beta_logits, f, g = merged_in_projections(self, hidden_states)
                g1, beta = kda_fused_conv.gate_and_beta(self, f, beta_logits)
                core_attn_out = torch.zeros(shape, dtype=hidden_states.dtype, device=hidden_states.device)
                torch.ops.vllm.bailing_v3_kda_attention(q, k, v, g1, beta, core_attn_out, self.prefix)
            g2 = rearrange(g, "... (h d) -> ... h d", d=self.head_dim)
            core_attn_out = self.o_norm(core_attn_out, g2)
            return self.o_proj(rearrange(core_attn_out, "1 n h d -> n (h d)"))[0]

    VllmKdaMergedInProj.__qualname__ = "VllmKdaMergedInProj"
    return VllmKdaMergedInProj


def register_merged_kda() -> list[str]:
    """Off the CPU platform (where :mod:`vllm_ling.layers.kda_cpu` carries the merge): vLLM's KDA
    layer with the merged in-projection and vLLM's kernels. With the option off the layer still
    installs and builds vLLM's three linears (the WARNING comes from the layer, reported)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return []
    what = (MERGED_DESCRIPTION if LingOptions.current().kda_merged_in_proj
            else f"vLLM's three in-projection linears ({opt_out_setting(OPTION)})")
    return install_out_of_tree(IN_TREE_NAME, vllm_merged_class(), f"KDA: {what} (vLLM's kernels)")


def served(layer) -> Served:
    """What a KDA layer's in-projections are, read from the modules its forward calls: one merged
    linear of five equal shards with vLLM's three gone and every checkpoint shard loaded into it (the
    loader records them, :mod:`vllm_ling.models.kda_merged_in_proj_loading`), or vLLM's linears."""
    from vllm_ling.models.kda_merged_in_proj_loading import missing_shards

    linear = getattr(layer, MERGED_NAME, None)
    if linear is None:
        return Served.of(KdaInProj.VLLM, label="vLLM's in-projection linears")
    sizes = list(getattr(linear, "output_partition_sizes", None) or [])
    leftovers = [a for a in ("qkv_proj", "f_proj", "g_proj") if getattr(layer, a, None) is not None]
    problems = leftovers + missing_shards(linear)
    if sizes != [layer.projection_size_per_partition] * len(MEMBERS) or problems:
        return Served.of(None, label=f"a malformed {MERGED_NAME} ({'; '.join(problems) or sizes})")
    return Served.of(KdaInProj.MERGED, label=f"one {MERGED_NAME} linear ({sum(sizes)}x{linear.input_size_per_partition}"
                     f" = {len(MEMBERS)} x {sizes[0]} rows; {type(linear.quant_method).__name__})")


READER = Reader(
    Feature.KDA_MERGED_IN_PROJ, "kda_merged_in_proj", "KDA layers", is_kda_module, served,
    f"see the WARNING naming the layer, or set {opt_out_setting(OPTION)}; a layer serving other than its "
    "selection is a defect: report it",
    expected=kda_layers, optimization="kda_merged_in_proj", optimizing=frozenset({KdaInProj.MERGED}))
