"""Routings and hidden states shared by the GPU MoE tests (humming GEMM and decode kernels)."""

from __future__ import annotations

import torch


def routing(kind: str, T: int, seed: int, device, num_experts: int, top_k: int):
    """(topk_weights fp32 [T, k] summing to 2.5, topk_ids int32 [T, k]) for a named routing."""
    E, K = num_experts, top_k
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "random":
        ids = torch.stack([torch.randperm(E, device=device, generator=g)[:K] for _ in range(T)])
    elif kind == "one_expert":  # every slot of every token on expert 7
        ids = torch.full((T, K), 7, device=device)
    elif kind == "edges":  # experts 0 and E-1 in every token
        rest = torch.stack([torch.randperm(E - 2, device=device, generator=g)[:K - 2] + 1 for _ in range(T)])
        ids = torch.cat([torch.zeros(T, 1, device=device, dtype=torch.long), rest,
                         torch.full((T, 1), E - 1, device=device)], dim=1)
    elif kind == "repeated":  # same experts for all tokens, each repeated within the row
        ids = torch.tensor([3, 3, 5, 5, 500, 500, 500, 0], device=device).expand(T, K)
    else:
        raise ValueError(kind)
    w = torch.rand(T, K, device=device, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True) * 2.5
    return w.float(), ids.to(torch.int32).contiguous()


def hidden(T: int, seed: int, hidden_size: int, device, scale: float = 1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(T, hidden_size, device=device, generator=g) * scale).to(torch.bfloat16)
