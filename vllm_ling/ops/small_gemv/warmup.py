"""Compile, ahead of serving, every small-GEMV kernel the server launches (``vllm-ling warmup``):
the router gate's and the unquantized BF16 linears'. No vLLM import.

A compiled kernel depends on K, the weight and output dtypes and the launch shape a row count
resolves to (:func:`~vllm_ling.ops.small_gemv.kernel.default_launch`: CTA width and tokens per pass); each distinct one runs once on random
weights and is compared with the float64 reference. The kernels land in humming's JIT cache,
which the server shares.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_ling.ops.small_gemv.kernel import default_launch, shape_problems, small_gemv
from vllm_ling.ops.small_gemv.reference import magnitude_bound, reference_gemv

TOLERANCE = 2.0 ** -16  # of |x| @ |w|.T (plus half a BF16 step for BF16 outputs), as the kernel's tests


def warmup_kernels(n: int, k: int, weight_dtype: torch.dtype, out_dtype: torch.dtype, max_rows: int,
                   device: torch.device | str | None = None) -> dict[str, Any]:
    """Run each distinct kernel the server launches for an [n, k] weight at 1..``max_rows`` rows."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise RuntimeError(f"small GEMV warmup needs a CUDA device, got {device}")
    problems = shape_problems(n, k, weight_dtype)
    if problems:
        raise ValueError(f"small GEMV warmup: the kernel cannot hold {n} x {k} {weight_dtype}: " + "; ".join(problems))
    started = time.perf_counter()
    rows_per_variant: dict[tuple[int, int], int] = {}
    for rows in range(1, max_rows + 1):
        rows_per_variant.setdefault(default_launch(rows, n), rows)
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn((n, k), device=device, generator=gen) * k ** -0.5).to(weight_dtype)
    for (warps, tokens_per_pass), rows in rows_per_variant.items():
        x = torch.randn((rows, k), device=device, generator=gen).to(torch.bfloat16)
        ref = reference_gemv(x, weight)
        tol = TOLERANCE * magnitude_bound(x, weight) + (2.0 ** -8 * ref.abs() if out_dtype == torch.bfloat16 else 0)
        if not ((small_gemv(x, weight, out_dtype).double() - ref).abs() <= tol).all():
            raise RuntimeError(f"small GEMV warmup: wrong outputs for {n} x {k} {weight_dtype} at {rows} rows "
                               f"({warps} warps per CTA, {tokens_per_pass} tokens per pass)")
    torch.cuda.synchronize(device)
    dtypes = f"{str(weight_dtype).replace('torch.', '')} -> {str(out_dtype).replace('torch.', '')}"
    return {"kernel": f"{len(rows_per_variant)} x ling_small_gemv ({n} x {k}, {dtypes}; warps x tokens per pass "
                      f"{', '.join(f'{w}x{tb}' for w, tb in sorted(rows_per_variant))})",
            "build_seconds": round(time.perf_counter() - started, 1)}


def warmup_router(hidden_size: int, num_experts: int, device: torch.device | str | None = None) -> dict[str, Any]:
    """The router gate's kernels (fp32 weight and logits, up to the router's row limit)."""
    from vllm_ling.ops.small_gemv.router import MAX_ROWS

    return warmup_kernels(num_experts, hidden_size, torch.float32, torch.float32, MAX_ROWS, device)


def warmup_bf16_linears(out_rows: int, hidden_size: int,
                        device: torch.device | str | None = None) -> dict[str, Any]:
    """The unquantized BF16 linears' kernels (BF16 weight and output, up to their row limit)."""
    from vllm_ling.ops.small_gemv.kernel import BF16_MAX_ROWS

    return warmup_kernels(out_rows, hidden_size, torch.bfloat16, torch.bfloat16, BF16_MAX_ROWS, device)
