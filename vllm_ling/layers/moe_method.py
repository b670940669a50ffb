"""vllm-ling's fused-MoE method for Ling's MXFP4 routed experts (target and NEXTN layers).

Parameters and loaders are vLLM's MXFP4 ones (``Mxfp4MoEMethod.create_weights``), so
checkpoints load exactly as upstream. The computation is ours:

- CUDA: :class:`vllm_ling.ops.moe.HummingMxfp4Experts` (humming indexed GEMM), W4A16 by
  default, with fused decode kernels for small batches (VLLM_LING_MOE_DECODE); if humming
  cannot run the server refuses to start, naming the cause;
- CPU: the plain-PyTorch reference :func:`vllm_ling.ops.moe.experts_reference`,
  logged once.

vLLM's runner does the routing (grouped sigmoid top-k with expert bias), the shared
expert and ``routed_scaling_factor``; ``apply`` returns the weighted routed sum.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import MoeBackend, MoeDecode, MoePath
from vllm_ling.ops import moe as moe_ops

logger = get_logger("moe")

HUMMING, REFERENCE = MoePath.HUMMING, MoePath.REFERENCE
BACKEND_DESCRIPTIONS = {
    HUMMING: "humming MXFP4 indexed GEMM (W4A16)",
    REFERENCE: "plain-PyTorch MXFP4 reference (CPU platform)",
}


class HummingUnavailable(RuntimeError):
    """Humming was requested (the default) but cannot run on this GPU."""


class LingMxfp4MoEMethod(Mxfp4MoEMethod):
    """MXFP4 experts through humming (CUDA) or the PyTorch reference (CPU)."""

    def __init__(self, moe, backend: MoePath, w4a8: bool = False, decode: MoeDecode = MoeDecode.AUTO,
                 decode_max_tokens: int = moe_ops.DEFAULT_DECODE_MAX_TOKENS):
        # Skip Mxfp4MoEMethod.__init__: it selects one of vLLM's backends, which is
        # exactly what this method replaces.
        FusedMoEMethodBase.__init__(self, moe)
        if not isinstance(backend, MoePath) or backend not in BACKEND_DESCRIPTIONS:
            raise ValueError(f"unknown Ling MoE backend {backend!r}")
        self.backend = backend
        self.w4a8 = w4a8
        self.decode = decode
        self.decode_max_tokens = decode_max_tokens
        self.humming_experts: moe_ops.HummingMxfp4Experts | None = None
        self.max_capture_size = getattr(moe, "max_capture_size", None)

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
                layer.w2_weight.data, layer.w2_weight_scale.data, w4a8=self.w4a8,
                top_k=layer.moe_config.experts_per_token, decode=self.decode,
                decode_max_tokens=self.decode_max_tokens)
        except Exception as exc:
            hint = (" (or drop the packed copy: VLLM_LING_MOE_DECODE=auto)"
                    if self.decode is MoeDecode.COPY else "")
            raise HummingUnavailable(
                f"humming could not prepare the MXFP4 experts of {getattr(layer, 'layer_name', layer)}: "
                f"{exc}. Fix the humming install/GPU, or opt out explicitly with "
                f"VLLM_LING_MOE_BACKEND=vllm{hint}") from exc
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
            w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)
        return out.to(x.dtype)


def choose_moe_method(layer, prefix: str, moe_backend_option: MoeBackend, w4a8: bool = False,
                      decode: MoeDecode = MoeDecode.AUTO, decode_max_tokens: int = moe_ops.DEFAULT_DECODE_MAX_TOKENS):
    """Our method for a Ling MXFP4 routed-expert layer, or None to let vLLM choose.

    Raises :class:`HummingUnavailable` (before any weight loads) when humming is the
    requested backend on CUDA and cannot run.
    """
    from vllm.platforms import current_platform

    vllm_backend = getattr(layer.moe_config, "moe_backend", "auto") or "auto"
    if moe_backend_option is MoeBackend.VLLM or vllm_backend not in ("auto", HUMMING):
        reason = ("VLLM_LING_MOE_BACKEND=vllm" if moe_backend_option is MoeBackend.VLLM
                  else f"--moe-backend {vllm_backend}")
        log_once(logger, logging.WARNING, "moe-opt-out",
                 "Humming MoE is OFF by explicit choice (%s): vLLM selects the MXFP4 MoE "
                 "backend; the startup report marks moe_humming inactive.", reason)
        return None
    if decode is MoeDecode.COPY:
        _check_packed_copy_request(layer.moe_config, prefix, w4a8, current_platform.is_cpu())
    if current_platform.is_cpu():
        if w4a8:
            raise HummingUnavailable("VLLM_LING_MOE_W4A8=1 needs humming on an sm_89+ GPU; the CPU "
                                     "platform runs the BF16 reference. Unset VLLM_LING_MOE_W4A8.")
        log_once(logger, logging.INFO, "moe-cpu",
                 "Routed MXFP4 experts: %s.", BACKEND_DESCRIPTIONS[REFERENCE])
        return LingMxfp4MoEMethod(layer.moe_config, REFERENCE)
    ok, reason = moe_ops.humming_status(w4a8=w4a8)
    if not ok:
        raise HummingUnavailable(
            f"Humming MXFP4 MoE cannot run for {prefix}: {reason}. Install humming-kernels "
            "(it comes with vllm==0.32.0) on an sm_75+ GPU" + (", or set VLLM_LING_MOE_W4A8=0 (W4A8 "
            "needs sm_89+)" if w4a8 else "") + ", or opt out explicitly with "
            "VLLM_LING_MOE_BACKEND=vllm (or vLLM's --moe-backend).")
    return LingMxfp4MoEMethod(layer.moe_config, HUMMING, w4a8=w4a8, decode=decode,
                              decode_max_tokens=decode_max_tokens)


def _check_packed_copy_request(moe_config, prefix: str, w4a8: bool, on_cpu: bool) -> None:
    """VLLM_LING_MOE_DECODE=copy is an explicit request: refuse it before weights load where it
    cannot run instead of silently serving without it."""
    hidden, inter = moe_config.hidden_dim, moe_config.intermediate_size_per_partition
    why = None
    if on_cpu:
        why = "the CPU platform runs the plain-PyTorch reference (the decode kernels are CUDA-only)"
    elif w4a8:
        why = "the packed-copy kernels use BF16 activations and VLLM_LING_MOE_W4A8=1 asks for FP8"
    elif hidden % 64 or inter % 64:
        why = f"hidden {hidden} / expert intermediate {inter} per GPU are not multiples of 64"
    if why is not None:
        raise HummingUnavailable(f"VLLM_LING_MOE_DECODE=copy cannot run for {prefix}: {why}. "
                                 "Use VLLM_LING_MOE_DECODE=auto (or off).")
