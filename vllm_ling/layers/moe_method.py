"""vllm-ling's fused-MoE method for Ling's MXFP4 routed experts (target and NEXTN layers).

Parameters and loaders are vLLM's MXFP4 ones (``Mxfp4MoEMethod.create_weights``), so
checkpoints load exactly as upstream. The computation is ours:

- CUDA: :class:`vllm_ling.ops.moe.HummingMxfp4Experts` (humming indexed GEMM), W4A16 by
  default, with fused decode kernels for small batches (VLLM_LING_MOE_DECODE); if humming
  cannot run the server refuses to start, naming the cause;
- CPU: the plain-PyTorch reference :func:`vllm_ling.ops.moe.experts_reference`,
  logged once.

Both clamp the per-layer SwiGLU limit after the SiLU (``min(silu(g), L) * clamp(u, -L, L)``, as
Ling was trained), where vLLM 0.32's own MXFP4 methods clamp the gate before it: the mode is the
selection's ``clamp`` (:class:`vllm_ling.ops.moe.activation.SwigluClamp`).

vLLM's runner does the routing (grouped sigmoid top-k with expert bias), the shared
expert and ``routed_scaling_factor``; ``apply`` returns the weighted routed sum.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import LingOptions, MoeDecode, MoeRouting, opt_out_setting
from vllm_ling.ops import moe as moe_ops
from vllm_ling.ops.moe.activation import VLLM_ROUTED_EXPERT_CLAMP, SwigluClamp
from vllm_ling.ops.moe.humming import HummingUnavailable
from vllm_ling.ops.moe.selection import MoePath, MoeSelection, MoeShape, opt_out_reason, select_moe
from vllm_ling.selection import Feature, Platform, Reader, Served, record
from vllm_ling.versions import TESTED_HUMMING_VERSION

logger = get_logger("moe")

HUMMING, REFERENCE = MoePath.HUMMING, MoePath.REFERENCE
BACKEND_DESCRIPTIONS = {
    HUMMING: "humming MXFP4 indexed GEMM (W4A16)",
    REFERENCE: "plain-PyTorch MXFP4 reference (CPU platform)",
}
__all__ = ["READER", "HummingUnavailable", "LingMxfp4MoEMethod", "choose_moe_method", "served"]


def vllm_moe_align(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """vLLM's one-launch CUDA routing metadata (what its own humming backend runs), the layout
    :func:`vllm_ling.ops.moe.routing.moe_align_block_size_torch` builds in about 17 launches."""
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    return moe_align_block_size(topk_ids, block_size, num_experts)


class LingMxfp4MoEMethod(Mxfp4MoEMethod):
    """MXFP4 experts through humming (CUDA) or the PyTorch reference (CPU)."""

    def __init__(self, moe, selection: MoeSelection):
        # Skip Mxfp4MoEMethod.__init__: it selects one of vLLM's backends, which is
        # exactly what this method replaces.
        FusedMoEMethodBase.__init__(self, moe)
        if not isinstance(selection, MoeSelection) or selection.choice not in BACKEND_DESCRIPTIONS:
            raise ValueError(f"not a selection of a Ling MoE backend: {selection!r}")
        self.selection = selection  # what this method serves (verification compares it with the layer's)
        self.humming_experts: moe_ops.HummingMxfp4Experts | None = None
        self.max_capture_size = getattr(moe, "max_capture_size", None)

    @property
    def backend(self) -> MoePath:
        return self.selection.choice

    @property
    def w4a8(self) -> bool:
        return self.selection.w4a8

    @property
    def decode(self) -> MoeDecode:
        return self.selection.decode

    @property
    def decode_max_tokens(self) -> int:
        return self.selection.decode_max_tokens

    @property
    def clamp(self) -> SwigluClamp:
        """The SwiGLU clamp mode computed: the built humming kernels' own, else the selection's."""
        return self.humming_experts.clamp if self.humming_experts is not None else self.selection.clamp

    @property
    def routing(self) -> MoeRouting:
        """How humming's routing metadata is built above the Triton kernel's limit: read from the
        built experts (the aligner they hold), else the selection's."""
        if self.humming_experts is None:
            return self.selection.routing
        return MoeRouting.VLLM if self.humming_experts.prefill_align is vllm_moe_align else MoeRouting.TORCH

    @property
    def description(self) -> str:
        if self.backend is HUMMING and self.w4a8:
            return "humming MXFP4 indexed GEMM (W4A8, FP8 per-token activations)"
        return BACKEND_DESCRIPTIONS[self.backend]

    @property
    def decode_status(self) -> str | None:
        """How decode-sized batches run (None off CUDA / before loading)."""
        return self.humming_experts.decode_status if self.humming_experts is not None else None

    @property
    def decode_active(self) -> bool:
        return self.humming_experts is not None and self.humming_experts.decoder is not None

    @property
    def is_monolithic(self) -> bool:
        return False

    @property
    def supports_eplb(self) -> bool:
        return False

    @property
    def skip_forward_padding(self) -> bool:
        return False

    @property
    def has_unpadded_output(self) -> bool:
        return False

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype,
                            moe_parallel_config):
        return FusedMoEMethodBase.maybe_roundup_sizes(
            self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config)

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.backend is not HUMMING:
            return
        try:
            self.humming_experts = moe_ops.HummingMxfp4Experts(
                layer.w13_weight.data, layer.w13_weight_scale.data,
                layer.w2_weight.data, layer.w2_weight_scale.data,
                top_k=layer.moe_config.experts_per_token, **self.selection.kernel_kwargs(),
                prefill_align=vllm_moe_align if self.selection.routing is MoeRouting.VLLM else None)
        except Exception as exc:
            hint = (" (or drop the packed copy: VLLM_LING_MOE_DECODE=auto)"
                    if self.decode is MoeDecode.COPY else "")
            raise HummingUnavailable(
                f"humming could not prepare the MXFP4 experts of {getattr(layer, 'layer_name', layer)}: "
                f"{exc}. Fix the humming install/GPU, or opt out explicitly with "
                f"{opt_out_setting('VLLM_LING_MOE_BACKEND')}{hint}") from exc
        # humming holds its own transformed copy; drop the checkpoint-layout tensors.
        for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
            getattr(layer, name).data = torch.empty(0, dtype=torch.uint8,
                                                    device=layer.w13_weight.device)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        limit = getattr(layer, "swiglu_limit", None)
        if self.backend is HUMMING:
            assert self.humming_experts is not None, "process_weights_after_loading did not run"
            return self.humming_experts.forward(x, topk_weights, topk_ids, limit)
        out = moe_ops.experts_reference(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, limit,
            w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale, clamp=self.selection.clamp)
        return out.to(x.dtype)


def choose_moe_method(layer, prefix: str, options: LingOptions) -> LingMxfp4MoEMethod | None:
    """Our method for a Ling MXFP4 routed-expert layer, or None to let vLLM choose; the
    selection (:func:`~vllm_ling.ops.moe.selection.select_moe`) is recorded on ``layer``.

    Raises :class:`HummingUnavailable` (before any weight loads) when humming is the
    requested backend on CUDA and cannot run.
    """
    from vllm.platforms import current_platform

    config = layer.moe_config
    vllm_backend = getattr(config, "moe_backend", "auto")
    selection = record(layer, select_moe(
        options, Platform.CPU if current_platform.is_cpu() else Platform.CUDA,
        MoeShape(config.hidden_dim, config.intermediate_size_per_partition), prefix, vllm_moe_backend=vllm_backend))
    if selection.choice is MoePath.VLLM:
        log_once(logger, logging.WARNING, "moe-opt-out",
                 "Humming MoE is OFF by explicit choice (%s): vLLM selects the MXFP4 MoE "
                 "backend; the startup report marks moe_humming inactive.", opt_out_reason(options, vllm_backend))
        return None
    if selection.choice is REFERENCE:
        log_once(logger, logging.INFO, "moe-cpu", "Routed MXFP4 experts: %s.", BACKEND_DESCRIPTIONS[REFERENCE])
    return LingMxfp4MoEMethod(config, selection)


def served(layer) -> Served:
    """What a routed-expert layer serves: backend, kernel switches and SwiGLU clamp mode, read from its
    method (vLLM's methods: ``MoePath.VLLM``, named by their class, vLLM 0.32's clamp before the SiLU);
    the shape of :meth:`MoeSelection.served_as`."""
    qm = layer.quant_method
    if isinstance(qm, LingMxfp4MoEMethod):
        return Served.of(qm.backend, qm.w4a8, qm.decode, qm.decode_max_tokens, qm.clamp, qm.routing)
    return Served.of(MoePath.VLLM, False, MoeDecode.OFF, 0, VLLM_ROUTED_EXPERT_CLAMP, MoeRouting.TORCH,
                     label=f"vllm:{type(qm).__name__}")


def expected_layers(config, stage, draft_here: bool) -> int:
    """vLLM's BailingMoeV3 builds an MoE block for layer_id >= first_k_dense_replace; each NEXTN
    layer of the draft has one too."""
    moe = sum(1 for i in range(stage.start, stage.end) if i >= config.first_k_dense_replace)
    return moe + (config.num_nextn_predict_layers if draft_here else 0)


READER = Reader(
    Feature.MOE, "moe_layers", "routed-expert layers", lambda m: isinstance(m, RoutedExperts), served,
    f"install humming-kernels {TESTED_HUMMING_VERSION} on an sm_75+ GPU, or opt out with "
    f"{opt_out_setting('VLLM_LING_MOE_BACKEND')}; a layer serving other than its selection is a defect: report it",
    expected=expected_layers, uniform=True, optimization="moe_humming", optimizing=frozenset({MoePath.HUMMING}))
