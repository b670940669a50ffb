"""Prepare a quantized FP8 head for one kernel and compute logits with it."""

from __future__ import annotations

import torch

from vllm_ling.options import HeadKernel
from vllm_ling.ops.lm_head.humming import prepare_humming, humming_logits
from vllm_ling.ops.lm_head.quantize import check_fp8_pair, quantize_fp8_per_channel
from vllm_ling.ops.lm_head.reference import fp8_reference_logits
from vllm_ling.ops.lm_head.scaled_mm import scaled_mm_logits
from vllm_ling.ops.lm_head.selection import (HUMMING, SCALED_MM, TORCH, TRITON, kernel_unavailable_reason,
                                            select_head_kernel)
from vllm_ling.ops.lm_head.state import Fp8HeadState
from vllm_ling.ops.lm_head.triton_kernel import triton_logits


def prepare_fp8_head(
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    kernel: HeadKernel | str | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    humming_tuning: str = "table",
) -> Fp8HeadState:
    """Turn a quantized head (``quantize_fp8_per_channel`` output, on its target device) into
    the state of ``kernel`` (None: ``select_head_kernel``). For humming the returned state
    holds a repacked copy: drop your reference to ``weight_fp8`` afterwards to free it; it
    also JIT-compiles humming's kernels (seconds cold, cached on disk). ``humming_tuning``:
    "table" uses HUMMING_TUNING_BY_ARCH for small row counts, "heuristic" humming's own."""
    check_fp8_pair(weight_fp8, scale)
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if kernel is None:
        selection = select_head_kernel(weight_fp8.device)
        kernel, reason = selection.choice, selection.reason
    else:
        why_not = kernel_unavailable_reason(kernel, weight_fp8.device)
        if why_not is not None:
            raise ValueError(f"LM-head kernel {kernel!r} cannot run on {weight_fp8.device}: {why_not}")
        kernel = HeadKernel(kernel)
        reason = "requested by caller"
    vocab, hidden = weight_fp8.shape
    common = dict(kernel=kernel, vocab_size=vocab, hidden_size=hidden, out_dtype=out_dtype, reason=reason)
    if kernel is HUMMING:
        if humming_tuning not in ("table", "heuristic"):
            raise ValueError(f"humming_tuning must be 'table' or 'heuristic', got {humming_tuning!r}")
        return prepare_humming(weight_fp8, scale, common, humming_tuning)
    if kernel is SCALED_MM and (hidden % 16 or vocab % 16):
        raise ValueError(f"scaled_mm needs hidden and vocab sizes divisible by 16, got {vocab} x {hidden}")
    return Fp8HeadState(weight=weight_fp8.contiguous(), scale=scale.float().contiguous(), **common)


def fp8_head_logits(hidden: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., H]`` hidden states -> ``[..., V]`` logits in ``state.out_dtype``.

    GPU kernels read activations as bf16 (cast if given another dtype); the ``"torch"``
    path computes in fp32 and casts at the end. ``out`` (2-D ``[M, V]``, contiguous) is
    written in place when given (not for humming with a non-bf16 out_dtype)."""
    if hidden.shape[-1] != state.hidden_size:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the FP8 head's {state.hidden_size}")
    lead_shape = hidden.shape[:-1]
    x = hidden.reshape(-1, state.hidden_size)
    if state.kernel is TORCH:
        logits = fp8_reference_logits(x, state.weight, state.scale).to(state.out_dtype)
        if out is not None:
            out.copy_(logits)
            logits = out
    elif x.shape[0] == 0:
        logits = torch.empty((0, state.vocab_size), dtype=state.out_dtype, device=x.device)
    elif state.kernel is HUMMING:
        logits = humming_logits(x, state, out)
    elif state.kernel is TRITON:
        logits = triton_logits(x, state, out)
    elif state.kernel is SCALED_MM:
        logits = scaled_mm_logits(x, state, out)
    else:
        raise ValueError(f"unknown LM-head kernel {state.kernel!r}")
    return logits.reshape(*lead_shape, state.vocab_size)


class Fp8LmHead:
    """Convenience wrapper: ``Fp8LmHead.from_bf16(weight)(hidden) -> logits``."""

    def __init__(self, state: Fp8HeadState):
        self.state = state

    @classmethod
    def from_bf16(cls, weight: torch.Tensor, kernel: str | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> "Fp8LmHead":
        q, s = quantize_fp8_per_channel(weight)
        return cls(prepare_fp8_head(q, s, kernel, out_dtype=out_dtype))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return fp8_head_logits(hidden, self.state)
