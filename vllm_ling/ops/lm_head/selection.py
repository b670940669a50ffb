"""Whether the LM head is quantized to FP8 (:func:`select_fp8_head`) and which FP8 kernel runs it
(:func:`select_head_kernel`): per GPU architecture from ``HEAD_KERNEL_BY_ARCH``, or forced with
``VLLM_LING_LM_HEAD_KERNEL``; a forced or chosen kernel that cannot run is an error or a WARNING
naming the reason, never a silent switch. Each is the one place its choice is decided: the quant
config and the head method record the answers on the head, warm-up compiles the kernel, and the
startup verification proves the head serves what it recorded."""

from __future__ import annotations

import importlib.util
import logging

import torch

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import Choice, HeadKernel, LingOptions, opt_out_setting, read
from vllm_ling.ops.lm_head.triton_kernel import triton_available
from vllm_ling.selection import Feature, Selection
from vllm_ling.versions import TESTED_HUMMING_VERSION

logger = get_logger("ops.lm_head.selection")

KERNELS = tuple(HeadKernel)  # declared with the option
HUMMING, TRITON, SCALED_MM, TORCH = HeadKernel.HUMMING, HeadKernel.TRITON, HeadKernel.SCALED_MM, HeadKernel.TORCH
KERNEL_ENV = "VLLM_LING_LM_HEAD_KERNEL"

# Per GPU architecture (compute capability): kernels in order of preference and the
# measurement behind it (Ling head 157,184 x 2,560, CUDA-graph medians from
# benchmarks/lm_head.py; the numbers are in benchmarks/results/lm_head_h200.md). Architectures
# without a row were not measured: they get _UNMEASURED_ORDER and the reason says so.
HEAD_KERNEL_BY_ARCH: dict[tuple[int, int], tuple[tuple[HeadKernel, ...], str]] = {
    # H200: humming is fastest at 1 and 4 rows and within 2 % at 16, with no input-range caveat.
    (9, 0): (
        (HUMMING, TRITON, SCALED_MM),
        "sm_90 (H200) measured at 1..16 rows: humming W8A16 (tuned) fastest, then Triton, then "
        "torch._scaled_mm row-wise (benchmarks/results/lm_head_h200.md)",
    ),
}
# Unmeasured GPUs: humming first (supports sm_80+ with BF16 activations), then Triton
# (FP8 conversion needs sm_89+), then _scaled_mm (row-wise FP8 needs sm_89+).
_UNMEASURED_ORDER = (HUMMING, TRITON, SCALED_MM)
_MIN_CAPABILITY = {HUMMING: (8, 0), TRITON: (8, 9), SCALED_MM: (8, 9)}


class Fp8Head(Choice):
    """What holds the LM head's weight (the report's ``head_dtype`` says its dtype)."""

    FP8 = "fp8"    # vllm-ling's per-row FP8 head (Fp8LmHeadMethod)
    VLLM = "vllm"  # opted out: vLLM's method on the checkpoint's head


def select_fp8_head(options: LingOptions) -> Selection:
    if options.fp8_head:
        return Selection(Feature.FP8_HEAD, Fp8Head.FP8, "vllm-ling's per-row FP8 head (VLLM_LING_FP8_HEAD=1)")
    return Selection(Feature.FP8_HEAD, Fp8Head.VLLM, f"opted out ({opt_out_setting('VLLM_LING_FP8_HEAD')})")


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def parse_head_kernel(name: HeadKernel | str) -> HeadKernel | None:
    """The kernel a name (an option value, a benchmark's word) stands for; None if none."""
    try:
        return HeadKernel(name)
    except ValueError:
        return None


def kernel_unavailable_reason(kernel: HeadKernel | str, device: torch.device | str | None = None) -> str | None:
    """None when ``kernel`` can run on ``device``; otherwise why not (cheap: no JIT, no
    humming import)."""
    if parse_head_kernel(kernel) is None:
        return f"unknown LM-head kernel {kernel!r}; choose one of {', '.join(KERNELS)}"
    kernel = HeadKernel(kernel)
    device = torch.device(device) if device is not None else default_device()
    if kernel is TORCH:
        return None
    if device.type != "cuda":
        return f"{kernel} needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return f"{kernel} needs CUDA, but torch.cuda.is_available() is False"
    cap = torch.cuda.get_device_capability(device)
    need = _MIN_CAPABILITY[kernel]
    if cap < need:
        return f"{kernel} needs compute capability >= {need[0]}.{need[1]}, this GPU is {cap[0]}.{cap[1]}"
    if kernel is HUMMING and not _module_available("humming"):
        return f"humming-kernels is not installed (pip install humming-kernels=={TESTED_HUMMING_VERSION})"
    if kernel is TRITON and not triton_available():
        return "triton is not installed"
    if kernel is SCALED_MM and not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def select_head_kernel(device: torch.device | str | None = None, preferred: HeadKernel | str | None = None) -> Selection:
    """The head's :class:`~vllm_ling.selection.Selection` (a ``HeadKernel`` and why). ``preferred``
    (a kernel, or a word parsed here; or env ``VLLM_LING_LM_HEAD_KERNEL``) forces a
    kernel and raises ``ValueError`` if it cannot run. Otherwise the arch table's first
    runnable kernel; skipping a better one logs a WARNING once with why."""
    device = torch.device(device) if device is not None else default_device()
    forced = preferred or read(KERNEL_ENV) or None
    forced = None if forced is None else str(forced)
    if forced:
        why_not = kernel_unavailable_reason(forced, device)
        if why_not is not None:
            source = "preferred=" if preferred else f"{KERNEL_ENV}="
            raise ValueError(f"LM-head kernel {source}{forced!r} cannot run on {device}: {why_not}")
        return Selection(Feature.HEAD_KERNEL, HeadKernel(forced), f"forced by {'argument' if preferred else KERNEL_ENV}")
    if device.type != "cuda":
        return Selection(Feature.HEAD_KERNEL, TORCH, f"no CUDA device ({device}): chunked fp32 dequantize path, "
                         "for correctness only")
    cap = torch.cuda.get_device_capability(device)
    order, evidence = HEAD_KERNEL_BY_ARCH.get(
        cap, (_UNMEASURED_ORDER, f"sm_{cap[0]}{cap[1]} not measured; default order {', '.join(_UNMEASURED_ORDER)}")
    )
    skipped = []
    for kernel in order:
        why_not = kernel_unavailable_reason(kernel, device)
        if why_not is None:
            reason = evidence
            if skipped:
                reason = f"{evidence}; skipped " + "; ".join(skipped)
                log_once(logger, logging.WARNING, f"lm_head_kernel_{cap}_{kernel}",
                         "FP8 LM head uses the %s kernel instead of the faster %s: %s",
                         kernel, order[0], "; ".join(skipped))
            return Selection(Feature.HEAD_KERNEL, kernel, reason)
        skipped.append(f"{kernel}: {why_not}")
    raise RuntimeError(f"no FP8 LM-head kernel can run on {device}: " + "; ".join(skipped))
