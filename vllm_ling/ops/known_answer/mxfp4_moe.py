"""MXFP4 routed-experts problem (four scale/code regimes, decode- and GEMM-sized batches,
the SwiGLU clamp and its mode) and the ops-level check of any experts callable."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from vllm_ling.ops.known_answer.formats import E2M1_TABLE, MOE_ROW_RTOL, MOE_W4A8_ROW_RTOL, MXFP4_GROUP
from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check
from vllm_ling.ops.moe.activation import SwigluClamp


# Two experts per regime (a token's top-2 stay in one regime, so its output has one scale):
# name -> (codes, gate_up E8M0 exponent, down E8M0 exponent, label); each scale group varies
# +-2 around its exponent.
MOE_REGIMES = {
    "A": ("all", 0, -4, "all 16 e2m1 codes, scales ~2^0"),
    "B": ("all", -20, 26, "all codes, gate_up scales ~2^-20, down ~2^26"),
    "C": ("half", 0, -2, "codes +-0.5 only"),
    "D": ("all", 4, -22, "all codes, gate_up scales ~2^4 (SwiGLU clamp region), down ~2^-22"),
}
# W4A8 (FP8 per-token activations) is judged on A, C and D only: with regime B's tiny SwiGLU
# outputs (~1e-9, a range no real layer produces) humming 0.1.17's W4A8 GEMM missed the
# tolerance at GEMM sizes on the H200 (a finding in benchmarks/results/kernel_checks_h200.md).
W4A8_UNJUDGED_REGIMES = ("B",)
# Regime D keeps SwiGLU outputs below ~2^20 without the clamp: the fused decode kernels scale
# activations by 2^100 inside FP32 and overflow past ~2^27 (humming's GEMM does not); measured
# on the H200, benchmarks/results/kernel_checks_h200.md.
MOE_SWIGLU_LIMIT = 7.0
# The clamp *mode* (after or before the SiLU) changes a gate above L by at most L * sigmoid(-L):
# 0.09 % at Ling's 7, 1.8 % at its 4, under the 2 % row tolerance. At L = 1 it is 27 % (silu(1) =
# 0.73 vs 1) and most gates of regimes A, C and D exceed L: a kernel computing the other mode
# misses this case by ~27 % per row, 13x the W4A16 tolerance and 5x W4A8's (tests/ops/test_known_answer.py).
MOE_MODE_LIMIT = 1.0
# The answers are computed in the form Ling was trained with, written here and not read from
# what serves (ops.moe.activation.ROUTED_EXPERT_CLAMP): a server whose MoE computes another mode
# fails its startup check instead of agreeing with itself.
TRAINED_CLAMP = SwigluClamp.GATE_OUTPUT


@dataclasses.dataclass
class Mxfp4MoEProblem:
    w13_weight: torch.Tensor  # uint8 [E, 2I, H/2]
    w13_weight_scale: torch.Tensor  # uint8 [E, 2I, H/32]
    w2_weight: torch.Tensor  # uint8 [E, H, I/2]
    w2_weight_scale: torch.Tensor  # uint8 [E, H, I/32]
    top_k: int
    cases: list[KnownAnswerCase]

    def tensors(self, device=None) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).to(device) for k in
                ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")}


def _mxfp4_codes(rows: int, cols: int, kind: str, offset: int) -> torch.Tensor:
    idx = (torch.arange(rows)[:, None] * 5 + torch.arange(cols)[None, :] + offset) % 16
    if kind == "half":
        idx = torch.where(idx % 2 == 0, torch.full_like(idx, 0x1), torch.full_like(idx, 0x9))
    return idx.to(torch.uint8)


def _pack_low_nibble_first(codes: torch.Tensor) -> torch.Tensor:  # the format's order
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _e8m0_grid(rows: int, groups: int, center: int, offset: int) -> torch.Tensor:
    var = (torch.arange(rows)[:, None] + torch.arange(groups)[None, :] * 3 + offset) % 5 - 2
    return (127 + center + var).to(torch.uint8)


def _dequant(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    scale = torch.pow(2.0, exps.double() - 127).repeat_interleave(MXFP4_GROUP, -1)
    return E2M1_TABLE[codes.long()] * scale


def _fp8_per_token(v: torch.Tensor) -> torch.Tensor:
    """What a W4A8 kernel feeds its GEMM: the row rounded to e4m3 with scale amax/448."""
    scale = v.abs().max().clamp(min=1e-30) / 448.0
    return (v / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * scale


def _experts_answer(x, w13, w2, weights, ids, limit: float | None, fp8_activations: bool = False,
                    clamp: SwigluClamp = TRAINED_CLAMP) -> torch.Tensor:
    """float64; with ``fp8_activations`` both GEMM inputs are rounded per token to e4m3 as a
    W4A8 kernel does (the SwiGLU output first to BF16, as the kernel stores it). ``clamp``: where
    the limit bites the gate (written out here, independent of ``ops.moe.activation.swiglu``)."""
    xf = x.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ (_fp8_per_token(xf[t]) if fp8_activations else xf[t])
            gate, up = h[:inter], h[inter:]
            if limit is None:
                act = gate * torch.sigmoid(gate) * up
            elif clamp is SwigluClamp.GATE_OUTPUT:  # min(silu(g), L) * clamp(u, -L, L)
                act = (gate * torch.sigmoid(gate)).clamp(max=limit) * up.clamp(-limit, limit)
            else:  # silu(min(g, L)) * clamp(u, -L, L)
                gate = gate.clamp(max=limit)
                act = gate * torch.sigmoid(gate) * up.clamp(-limit, limit)
            if fp8_activations:
                act = _fp8_per_token(act.to(torch.bfloat16).double())
            out[t] += float(weights[t, j]) * (w2[e] @ act)
    return out


def mxfp4_moe_problem(hidden: int = 256, intermediate: int = 128, token_counts=(4, 40),
                      swiglu_limit: float = MOE_SWIGLU_LIMIT, w4a8: bool = False,
                      seed: int = 0, clamp: SwigluClamp = TRAINED_CLAMP) -> Mxfp4MoEProblem:
    """Eight experts in four regimes (``MOE_REGIMES``), top-2 within a regime; for each token
    count (default one decode-sized and one past the decode kernels' 32) one case without the
    SwiGLU clamp, one with it (``swiglu_limit``) and one at ``MOE_MODE_LIMIT``, where the clamp
    mode decides the answer. Gate/up rows, codes and scales vary so a swapped nibble, row or
    scale group shows. ``w4a8``: answers for FP8 per-token activations, wider tolerance.
    ``clamp``: the mode the answers are computed in (the trained one; the other for tests)."""
    row_rtol = MOE_W4A8_ROW_RTOL if w4a8 else MOE_ROW_RTOL
    names = list(MOE_REGIMES)
    E, H, I = 2 * len(names), hidden, intermediate
    c13, e13, c2, e2 = [], [], [], []
    for i in range(E):
        kind, g, d, _ = MOE_REGIMES[names[i // 2]]
        c13.append(_mxfp4_codes(2 * I, H, kind, i))
        e13.append(_e8m0_grid(2 * I, H // MXFP4_GROUP, g, i))
        c2.append(_mxfp4_codes(H, I, kind, 3 * i))
        e2.append(_e8m0_grid(H, I // MXFP4_GROUP, d, 2 * i))
    c13, e13, c2, e2 = (torch.stack(t) for t in (c13, e13, c2, e2))
    w13, w2 = _dequant(c13, e13), _dequant(c2, e2)
    g = torch.Generator().manual_seed(seed)
    cases = []
    for T in token_counts:
        regime = torch.arange(T) % len(names)
        first = (torch.arange(T) // len(names)) % 2  # which of the pair comes first
        ids = torch.stack([2 * regime + first, 2 * regime + 1 - first], dim=1).to(torch.int32)
        weights = (torch.rand(T, 2, generator=g) + 0.25).float()
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)

        def explain(bad: torch.Tensor, regime=regime) -> str:
            hit = sorted({names[int(r)] for r in regime[bad]})
            return "tokens on experts " + "; ".join(f"{n} ({MOE_REGIMES[n][3]})" for n in hit)

        size = "decode-sized" if T <= 32 else "GEMM-sized"
        judged = None
        if w4a8:
            judged = torch.tensor([names[int(r)] not in W4A8_UNJUDGED_REGIMES for r in regime])
        for limit in (None, swiglu_limit, MOE_MODE_LIMIT):
            label = f"{T} tokens ({size}), " + ("no clamp" if limit is None else f"SwiGLU clamp {limit:g}")
            if limit == MOE_MODE_LIMIT:
                label += f" {clamp.where}"
            cases.append(KnownAnswerCase(
                label, {"x": x, "topk_weights": weights, "topk_ids": ids, "swiglu_limit": limit},
                _experts_answer(x, w13, w2, weights, ids, limit, w4a8, clamp), row_rtol, per_row=True,
                explain=explain, judged_rows=judged))
    return Mxfp4MoEProblem(_pack_low_nibble_first(c13), e13, _pack_low_nibble_first(c2), e2, 2, cases)


def check_mxfp4_experts(build: Callable[[dict[str, torch.Tensor], int], Callable], kernel: str,
                        device: torch.device | str, w4a8: bool = False,
                        plant: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                        **problem_kwargs) -> KernelCheckResult:
    """``build(tensors, top_k)`` returns ``experts(x, topk_weights, topk_ids, swiglu_limit)``
    (e.g. a humming ``HummingMxfp4Experts``); it is run on :func:`mxfp4_moe_problem`
    (``problem_kwargs``: its sizes and token counts)."""
    problem = mxfp4_moe_problem(w4a8=w4a8, **problem_kwargs)
    tensors = problem.tensors(device)
    experts = build(tensors if plant is None else plant(tensors), problem.top_k)
    return run_check("moe_mxfp4", kernel, problem.cases, lambda inp: experts(
        inp["x"].to(device), inp["topk_weights"].to(device), inp["topk_ids"].to(device), inp["swiglu_limit"]))
