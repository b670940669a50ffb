"""Compile, ahead of serving, the grouped top-k kernel the server's MoE routers launch
(``vllm-ling warmup``). No vLLM import.

One kernel per routing configuration (experts, groups, kept groups, top-k, renormalisation: the
``#define`` lines of its source); it runs once on random logits and bias and its picks and weights
are compared with the plain-PyTorch reference. It lands in humming's JIT cache, which the server shares.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_ling.ops.moe.routing import grouped_topk
from vllm_ling.ops.router_topk.kernel import grouped_topk_cuda, shape_problems

TOKENS = 4


def warmup_kernels(num_experts: int, n_group: int, topk_group: int, top_k: int, renormalize: bool = True,
                   routed_scaling_factor: float = 1.0, device: torch.device | str | None = None) -> dict[str, Any]:
    """Build and check the kernel for one routing configuration."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise RuntimeError(f"router top-k warmup needs a CUDA device, got {device}")
    problems = shape_problems(num_experts, n_group, topk_group, top_k)
    if problems:
        raise ValueError(f"router top-k warmup: the kernel cannot route this configuration: {'; '.join(problems)}")
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn((TOKENS, num_experts), device=device, generator=gen) * 3
    bias = torch.randn((num_experts,), device=device, generator=gen) * 0.1
    weights, ids = grouped_topk_cuda(logits, bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor)
    want_w, want_ids = grouped_topk(logits, top_k, n_group, topk_group, bias, renormalize, routed_scaling_factor)
    if not (torch.equal(ids, want_ids) and torch.allclose(weights, want_w, rtol=1e-5, atol=1e-6)):
        raise RuntimeError(f"router top-k warmup: wrong picks or weights for {num_experts} experts, {n_group} groups "
                           f"keep {topk_group}, top-{top_k}")
    torch.cuda.synchronize(device)
    return {"kernel": f"ling_grouped_topk ({num_experts} experts, {n_group} groups keep {topk_group}, top-{top_k})",
            "build_seconds": round(time.perf_counter() - started, 1)}
