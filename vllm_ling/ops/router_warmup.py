"""Compile, ahead of serving, every router GEMV kernel the server launches for a gate shape
(``vllm-ling warmup``). No vLLM import.

The server runs :func:`vllm_ling.ops.router.router_logits` for 1..``MAX_ROWS`` tokens; the
compiled kernel depends on the hidden size and the tokens per pass its row count resolves to (one
for a single token, two above), so each distinct one runs once on random weights and is compared
with the float64 reference. The kernels land in humming's JIT cache, which the server shares.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_ling.ops.router import MAX_ROWS, magnitude_bound, reference_router_logits, router_logits, shape_problems
from vllm_ling.ops.router.kernel import default_tokens_per_pass

TOLERANCE = 2.0 ** -16  # of |x| @ |w|.T, as the kernel's tests and known-answer check


def warmup_kernels(hidden_size: int, num_experts: int, device: torch.device | str | None = None) -> dict[str, Any]:
    """Run each distinct kernel the server launches for an fp32 [num_experts, hidden_size] gate."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise RuntimeError(f"router GEMV warmup needs a CUDA device, got {device}")
    problems = shape_problems(num_experts, hidden_size)
    if problems:
        raise ValueError(f"router GEMV warmup: the kernel cannot hold {num_experts} x {hidden_size}: "
                         + "; ".join(problems))
    started = time.perf_counter()
    rows_per_variant: dict[int, int] = {}
    for rows in range(1, MAX_ROWS + 1):
        rows_per_variant.setdefault(default_tokens_per_pass(rows), rows)
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn((num_experts, hidden_size), device=device, generator=gen) * hidden_size ** -0.5
    for tokens_per_pass, rows in rows_per_variant.items():
        x = torch.randn((rows, hidden_size), device=device, generator=gen).to(torch.bfloat16)
        out = router_logits(x, weight).double()
        if not ((out - reference_router_logits(x, weight)).abs() <= TOLERANCE * magnitude_bound(x, weight)).all():
            raise RuntimeError(f"router GEMV warmup: wrong logits for {num_experts} x {hidden_size} at {rows} rows "
                               f"({tokens_per_pass} tokens per pass)")
    torch.cuda.synchronize(device)
    return {"kernel": f"{len(rows_per_variant)} x ling_router_gemv (tokens per pass "
                      f"{', '.join(map(str, sorted(rows_per_variant)))}; {num_experts} x {hidden_size})",
            "build_seconds": round(time.perf_counter() - started, 1)}
