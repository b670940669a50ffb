"""Compile, ahead of serving, the residual add + RMSNorm kernel the server's decoder norms launch
(``vllm-ling warmup``). No vLLM import.

Two kernels per hidden size (the ``#define`` lines of their source: one addend, and two, the MoE sum folded in);
each runs once on random rows and is compared with the plain-PyTorch reference. It lands in humming's JIT cache, which the server shares.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_ling.ops.residual_norm.kernel import DTYPE, add_rms_norm_cuda, shape_problems
from vllm_ling.ops.residual_norm.reference import add2_rms_norm, add_rms_norm, mismatch

TOKENS = 4
EPS = 1e-6


def warmup_kernels(hidden: int, device: torch.device | str | None = None) -> dict[str, Any]:
    """Build and check the kernel for rows of ``hidden`` values."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise RuntimeError(f"residual norm warmup needs a CUDA device, got {device}")
    problems = shape_problems(hidden, DTYPE, DTYPE)
    if problems:
        raise ValueError(f"residual norm warmup: the kernel cannot normalise these rows: {'; '.join(problems)}")
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    x = (4 * torch.randn((TOKENS, hidden), device=device, generator=gen)).to(DTYPE)
    residual = torch.randn((TOKENS, hidden), device=device, generator=gen).to(DTYPE)
    weight = (1 + 0.1 * torch.randn((hidden,), device=device, generator=gen)).to(DTYPE)
    x2 = torch.randn((TOKENS, hidden), device=device, generator=gen).to(DTYPE)
    wrong = (mismatch(add_rms_norm_cuda(x, residual, weight, EPS), add_rms_norm(x, residual, weight, EPS))
             or mismatch(add_rms_norm_cuda(x, residual, weight, EPS, x2=x2), add2_rms_norm(x, x2, residual, weight, EPS)))
    if wrong:
        raise RuntimeError(f"residual norm warmup: wrong rows for hidden size {hidden} ({wrong})")
    torch.cuda.synchronize(device)
    return {"kernel": f"ling_add_rms_norm (hidden {hidden}, one and two addends)",
            "build_seconds": round(time.perf_counter() - started, 1)}
