"""KDA problem: chunked prefill and recurrent decode on a state pool vs a float64 token loop."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check


KDA_ROW_RTOL = 1e-3  # fp32 chunked algebra vs float64 recurrence; a wrong decay/beta/state is O(1)


def _l2norm64(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_answer(q, k, v, g, beta, state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token, per head, float64: S <- S*exp(g); u = beta*(v - S k);
    S <- S + u k^T; o = S q (q, k L2-normalised, q scaled). ``state`` [H, V, K]."""
    q, k = _l2norm64(q.double()) * scale, _l2norm64(k.double())
    v, g, beta, S = v.double(), g.double(), beta.double(), state.double().clone()
    out = torch.zeros(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):  # all heads at once: S [H, V, K]
        S = S * torch.exp(g[t])[:, None, :]
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S = S + u[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", S, q[t])
    return out, S


@dataclasses.dataclass
class KdaProblem:
    """Two sequences in a 4-slot state pool: prefill (lengths 5 and 21: inside and across
    16-token chunks; the second starts from a stored state), then one decode token each.
    Key channels alternate strong decay (g = -20), none (g = 0) and random; beta is 0, 1 or
    random per head and token."""

    scale: float
    pool: torch.Tensor  # float32 [4, H, V, K], slot 0 is vLLM's null block
    slots: torch.Tensor  # int32 [2]
    has_initial_state: torch.Tensor  # bool [2]
    cases: list[KnownAnswerCase]


def kda_problem(heads: int = 2, head_dim: int = 16, lengths=(5, 21), seed: int = 0) -> KdaProblem:
    g_ = torch.Generator().manual_seed(seed)
    H, D = heads, head_dim
    scale = D ** -0.5
    pool = torch.zeros(4, H, D, D)
    pool[3] = torch.randn(H, D, D, generator=g_) * 0.5
    slots = torch.tensor([2, 3], dtype=torch.int32)
    has_init = torch.tensor([False, True])

    def tokens(n):
        q, k, v = (torch.randn(n, H, D, generator=g_) for _ in range(3))
        g = -torch.rand(n, H, D, generator=g_)
        g[..., 0::3] = -20.0
        g[..., 1::3] = 0.0
        beta = torch.rand(n, H, generator=g_)
        beta[0::3] = 0.0
        beta[1::3] = 1.0
        return q, k, v, g, beta

    prefill = [tokens(n) for n in lengths]
    decode = [tokens(1) for _ in lengths]
    ref_prefill, ref_decode = [], []
    for i, n in enumerate(lengths):
        start = pool[int(slots[i])] if bool(has_init[i]) else torch.zeros(H, D, D)
        o, S = kda_answer(*prefill[i], start, scale)
        ref_prefill.append(o)
        ref_decode.append(kda_answer(*decode[i], S, scale)[0])
    cat = lambda parts, j: torch.cat([p[j] for p in parts])  # noqa: E731
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    prefill_in = {f: cat(prefill, j) for j, f in enumerate(("q", "k", "v", "g", "beta"))}
    decode_in = {f: cat(decode, j) for j, f in enumerate(("q", "k", "v", "g", "beta"))}
    flat = lambda o: o.reshape(o.shape[0], -1)  # noqa: E731
    cases = [
        KnownAnswerCase(f"prefill of {lengths[0]} + {lengths[1]} tokens (chunked; 2nd from a stored state)",
                        {"phase": "prefill", "cu_seqlens": cu, **prefill_in},
                        flat(torch.cat(ref_prefill)), KDA_ROW_RTOL, per_row=True),
        KnownAnswerCase("1 decode token per sequence (from the prefill's states)",
                        {"phase": "decode", "cu_seqlens": torch.tensor([0, 1, 2], dtype=torch.int32), **decode_in},
                        flat(torch.cat(ref_decode)), KDA_ROW_RTOL, per_row=True),
    ]
    return KdaProblem(scale, pool, slots, has_init, cases)


def check_kda(prefill: Callable, decode: Callable, kernel: str) -> KernelCheckResult:
    """``prefill`` / ``decode`` with the signatures of :func:`vllm_ling.ops.kda.kda_prefill_pooled`
    and :func:`~vllm_ling.ops.kda.kda_decode_pooled` (what the CPU KDA layer calls), run on
    :func:`kda_problem` in order, sharing one state pool."""
    p = kda_problem()
    pool = p.pool.clone()

    def forward(inp):
        args = [inp[f] for f in ("q", "k", "v", "g", "beta")]
        if inp["phase"] == "prefill":
            return prefill(*args, pool, inp["cu_seqlens"], p.slots, p.has_initial_state, p.scale)
        return decode(*args, pool, inp["cu_seqlens"], p.slots, p.scale)

    return run_check("kda", kernel, p.cases, forward)
