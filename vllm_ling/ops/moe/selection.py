"""Which backend serves Ling's routed MXFP4 experts, and with which kernel switches: decided once.

:func:`select_moe` is the only place the decision is made. The quant config builds the layer's
method from its answer and records it on the layer, ``vllm-ling warmup`` compiles for it, and the
startup verification proves each layer runs what was recorded. No vLLM import: vLLM's
``--moe-backend`` arrives as the word vLLM parsed, and the platform as :class:`Platform`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, VLLM_ROUTED_EXPERT_CLAMP, SwigluClamp
from vllm_ling.ops.moe.humming import HummingUnavailable
from vllm_ling.options import Choice, LingOptions, MoeBackend, MoeDecode, MoeRouting, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection

# vLLM's --moe-backend words that leave the routed experts to vllm-ling ("humming" is vLLM's own
# name for the humming backend; any other word is an explicit choice of one of vLLM's backends)
VLLM_BACKENDS_LEAVING_US_IN_CHARGE = ("auto", "humming")
DECODE_TILE = 64  # the packed-copy decode kernels tile hidden and expert intermediate by 64


class MoePath(Choice):
    """What serves a Ling routed-expert layer (the report's ``moe_backend``): not an option."""

    HUMMING = "humming"
    REFERENCE = "reference"  # plain PyTorch, CPU platform only
    VLLM = "vllm"            # opted out: vLLM's own MXFP4 backend


@dataclasses.dataclass(frozen=True)
class MoeShape:
    hidden: int
    intermediate: int  # per tensor-parallel rank


@dataclasses.dataclass(frozen=True)
class MoeSelection(Selection):
    """The backend (``choice``: a :class:`MoePath`), the humming kernel switches it runs with and
    the SwiGLU clamp mode it computes (ours: after the SiLU; vLLM 0.32's methods: before it)."""

    w4a8: bool = False
    decode: MoeDecode = MoeDecode.OFF
    decode_max_tokens: int = 0  # 0 where decode is OFF: no decode kernels to build
    clamp: SwigluClamp = ROUTED_EXPERT_CLAMP
    # humming's routing metadata above the Triton kernel's limit (prefill); TORCH where humming
    # does not serve (nothing to align)
    routing: MoeRouting = MoeRouting.TORCH

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.clamp, SwigluClamp):
            raise TypeError(f"MoeSelection needs a SwigluClamp, got {self.clamp!r}")
        if not isinstance(self.routing, MoeRouting):
            raise TypeError(f"MoeSelection needs a MoeRouting, got {self.routing!r}")

    def served_as(self) -> tuple:
        """What a layer serving this selection runs: compared with
        :func:`vllm_ling.layers.moe_method.served` of the layer."""
        return (self.choice, self.w4a8, self.decode, self.decode_max_tokens, self.clamp, self.routing)

    def kernel_kwargs(self) -> dict:
        """The switches humming's experts take (the layer's method and warm-up's kernels alike)."""
        return {"w4a8": self.w4a8, "decode": self.decode, "decode_max_tokens": self.decode_max_tokens,
                "clamp": self.clamp}


def select_moe(options: LingOptions, platform: Platform, shape: MoeShape, prefix: str,
               vllm_moe_backend: str | None = "auto",
               humming_status: Callable[[bool], tuple[bool, str]] | None = None) -> MoeSelection:
    """The selection for one routed-expert layer of ``shape``.

    ``humming_status(w4a8) -> (ok, reason)`` says whether humming runs here (default: ask humming;
    warm-up passes its own: building the kernels is how it finds out). Raises
    :class:`HummingUnavailable` where an explicit request cannot run.
    """
    opted_out = opt_out_reason(options, vllm_moe_backend)
    if opted_out is not None:
        return MoeSelection(Feature.MOE, MoePath.VLLM, f"opted out: {opted_out}", clamp=VLLM_ROUTED_EXPERT_CLAMP)
    if options.moe_decode is MoeDecode.COPY:
        _refuse_packed_copy(shape, prefix, options.moe_w4a8, platform)
    if platform is Platform.CPU:
        if options.moe_w4a8:
            raise HummingUnavailable("VLLM_LING_MOE_W4A8=1 needs humming on an sm_89+ GPU; the CPU "
                                     "platform runs the BF16 reference. Unset VLLM_LING_MOE_W4A8.")
        return MoeSelection(Feature.MOE, MoePath.REFERENCE, "CPU platform: no humming, the plain-PyTorch reference")
    if humming_status is None:
        from vllm_ling.ops import moe as moe_ops

        ok, why = moe_ops.humming_status(w4a8=options.moe_w4a8)
    else:
        ok, why = humming_status(options.moe_w4a8)
    if not ok:
        raise HummingUnavailable(
            f"Humming MXFP4 MoE cannot run for {prefix}: {why}. Install humming-kernels "
            "(it comes with vllm==0.32.0) on an sm_75+ GPU" + (", or set VLLM_LING_MOE_W4A8=0 (W4A8 "
            "needs sm_89+)" if options.moe_w4a8 else "") + ", or opt out explicitly with "
            f"{opt_out_setting('VLLM_LING_MOE_BACKEND')} (or vLLM's --moe-backend).")
    decode = options.moe_decode
    return MoeSelection(Feature.MOE, MoePath.HUMMING, f"CUDA, humming runs ({why})" if why else "CUDA, humming runs",
                        w4a8=options.moe_w4a8, decode=decode,
                        decode_max_tokens=0 if decode is MoeDecode.OFF else options.moe_decode_max_tokens,
                        routing=options.moe_routing)


def opt_out_reason(options: LingOptions, vllm_moe_backend: str | None) -> str | None:
    """Which explicit choice hands the routed experts to vLLM's MXFP4 backends (None: they are
    ours). Also what the CPU config hook refuses before loading (vLLM-CPU has no such backend)."""
    if options.moe_backend is MoeBackend.VLLM:
        return opt_out_setting("VLLM_LING_MOE_BACKEND")
    vllm_backend = vllm_moe_backend or "auto"
    if vllm_backend not in VLLM_BACKENDS_LEAVING_US_IN_CHARGE:
        return f"--moe-backend {vllm_backend}"
    return None


def _refuse_packed_copy(shape: MoeShape, prefix: str, w4a8: bool, platform: Platform) -> None:
    """VLLM_LING_MOE_DECODE=copy is an explicit request: refuse it before weights load where it
    cannot run instead of silently serving without it."""
    why = None
    if platform is Platform.CPU:
        why = "the CPU platform runs the plain-PyTorch reference (the decode kernels are CUDA-only)"
    elif w4a8:
        why = "the packed-copy kernels use BF16 activations and VLLM_LING_MOE_W4A8=1 asks for FP8"
    elif shape.hidden % DECODE_TILE or shape.intermediate % DECODE_TILE:
        why = f"hidden {shape.hidden} / expert intermediate {shape.intermediate} per GPU are not multiples of 64"
    if why is not None:
        raise HummingUnavailable(f"VLLM_LING_MOE_DECODE=copy cannot run for {prefix}: {why}. "
                                 "Use VLLM_LING_MOE_DECODE=auto (or off).")
