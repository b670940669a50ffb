"""The MoE router GEMV problem: fp32 logits of BF16 tokens against an fp32 gate, judged per
logit against the float64 reference with the tolerance the kernel's own tests use.

Tolerance: ``|out - ref| <= 2**-16 * S`` with ``S = |x| @ |w|.T`` (float64): any fp32 summation
order stays below ``2**-16.9 S`` up to H = 4096, while a wrong pairing of weights and tokens, a
lost term or a wrong output row is off by ``O(S / H) >= 2**-12 S`` (tests/ops/small_gemv/test_router_gemv_gpu.py). The runner
judges ``|out - ref| / (|ref| + floor)``; ``floor = S - |ref|`` makes that denominator S.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check
from vllm_ling.ops.small_gemv.router import MAX_ROWS, magnitude_bound, reference_router_logits
from vllm_ling.ops.small_gemv.kernel import launch_row_counts

ROUTER_RTOL = 2.0 ** -16
ROUTER_EXPERTS = 13  # not a multiple of the kernel's expert rows per CTA: a partial last CTA
# Expert rows with a special content: scaled far up, far down, all zero.
SPECIAL_EXPERTS = {0: ("x2^40", 2.0 ** 40), 1: ("x2^-40", 2.0 ** -40), 2: ("zero", 0.0)}


@dataclasses.dataclass
class RouterProblem:
    weight: torch.Tensor  # float32 [E, H]
    cases: list[KnownAnswerCase]


def _tokens(rows: int, hidden: int, gen: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """BF16 tokens: row 0 random; then a one-hot row (output = one weight column, exact), a row
    scaled by 2^30 and one by 2^-30; the rest random."""
    x = torch.randn((rows, hidden), generator=gen, dtype=torch.float64)
    kinds = ["random"] * rows
    if rows > 1:
        x[1] = 0.0
        x[1, hidden - 1] = 1.0  # the last column: the end of a lane's last chunk
        kinds[1] = "one-hot"
    if rows > 2:
        x[2] *= 2.0 ** 30
        kinds[2] = "x2^30"
    if rows > 3:
        x[3] *= 2.0 ** -30
        kinds[3] = "x2^-30"
    return x.to(torch.bfloat16), kinds


def _listed(items: list[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def router_gemv_problem(hidden: int, experts: int = ROUTER_EXPERTS, seed: int = 0) -> RouterProblem:
    """An fp32 [experts, hidden] gate (random rows ~ N(0, 1/H), plus ``SPECIAL_EXPERTS``) and one
    case per launch shape the kernel picks for ``experts`` rows
    (:func:`~vllm_ling.ops.small_gemv.kernel.launch_row_counts`), answers in float64."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((experts, hidden), generator=gen, dtype=torch.float64) * hidden ** -0.5
    for row, (_, scale) in SPECIAL_EXPERTS.items():
        if row < experts:
            w[row] *= scale
    w = w.to(torch.float32)
    cases = []
    for rows in launch_row_counts(experts):
        x, kinds = _tokens(rows, hidden, gen)
        ref = reference_router_logits(x, w)
        bound = magnitude_bound(x, w)
        # |ref| + floor = S; where S = 0 (the zero expert row) an absolute 2^-16 instead of 0/0
        floor = torch.where(bound > 0, (bound - ref.abs()).clamp_min(0.0), torch.ones_like(bound))

        def explain(bad: torch.Tensor, kinds=kinds) -> str:
            tokens = sorted({int(t) for t in bad.nonzero()[:, 0]})
            exps = sorted({int(e) for e in bad.nonzero()[:, 1]})
            names = [f"{e} ({SPECIAL_EXPERTS[e][0]})" if e in SPECIAL_EXPERTS else str(e) for e in exps]
            return (f"{int(bad.sum())} of {bad.numel()} logits off by more than 2^-16 of |x|.|w|: tokens "
                    f"{_listed([f'{t} ({kinds[t]})' for t in tokens])}; experts {_listed(names)}")

        cases.append(KnownAnswerCase(f"{rows} token{'s' if rows > 1 else ''} x {experts} experts x {hidden}",
                                     {"x": x}, ref, ROUTER_RTOL, floor=floor, explain=explain))
    return RouterProblem(w, cases)


def check_router_gemv(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], label: str, hidden: int,
                      device: torch.device | str = "cpu", experts: int = ROUTER_EXPERTS) -> KernelCheckResult:
    """``forward(x, weight)`` -> fp32 [T, E] logits, on :func:`router_gemv_problem` at ``hidden`` and
    ``experts`` (a served gate's own count, so every launch shape it is served with runs)."""
    problem = router_gemv_problem(hidden, experts)
    weight = problem.weight.to(device)
    return run_check("router_gemv", label, problem.cases, lambda inp: forward(inp["x"].to(device), weight))
