"""Routings, hidden states, fixtures and the brute-force router shared by the MoE tests
(reference, routing, humming GEMM and decode kernels). Test modules import the fixtures by
name (``from moe_cases import no_tf32, weights``): a conftest.py here would shadow the
top-level ``conftest`` other tests import from."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

LING_E, LING_H, LING_I = 512, 2560, 768


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


@pytest.fixture(scope="module")
def no_tf32():
    """The float32 references must not run their matmuls in TF32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(scope="module")
def weights():
    """Random MXFP4 routed experts at Ling shapes in vLLM's layout, on the GPU."""
    from vllm_ling.ops.moe.warmup import random_mxfp4_experts

    return random_mxfp4_experts(LING_E, LING_H, LING_I, device=torch.device("cuda"), seed=1234)


def brute_force_route(logits_row, bias_row, top_k, n_group, topk_group, rsf, renorm=True):
    """Enumerate every set of topk_group groups; keep the one with the largest total group
    score (group score = sum of its two largest biased scores), then the top_k biased
    experts inside; weights are the unbiased sigmoid scores."""
    E = len(logits_row)
    per = E // n_group
    score = [1.0 / (1.0 + math.exp(-v)) for v in logits_row]
    biased = [s + b for s, b in zip(score, bias_row)]
    group_score = []
    for g in range(n_group):
        members = sorted(biased[g * per:(g + 1) * per], reverse=True)
        group_score.append(sum(members[:2]))
    best = max(itertools.combinations(range(n_group), topk_group),
               key=lambda groups: sum(group_score[g] for g in groups))
    candidates = [e for g in best for e in range(g * per, (g + 1) * per)]
    chosen = sorted(candidates, key=lambda e: biased[e], reverse=True)[:top_k]
    weights = [score[e] for e in chosen]
    if renorm:
        total = sum(weights)
        weights = [w / total for w in weights]
    return {e: w * rsf for e, w in zip(chosen, weights)}
