"""The MoE router top-k problem: which experts a token goes to, and with what weights, for Ling's
routing (sigmoid scores, an expert bias added for the choice only, groups scored by the sum of
their two best choices, the kept groups' best experts, weights renormalised and scaled).

The answer is the plain-PyTorch reference (:func:`vllm_ling.ops.moe.routing.grouped_topk`, checked
by brute force in tests/ops/moe) run in float64 on the same fp32 logits. A kernel's picks are
judged as a dense [T, E] weight matrix (zero where an expert is not picked), row by row: a wrong
expert moves a whole weight (>= 2 % of the row here), fp32 rounding moves 1e-6.

Besides random tokens (redrawn until every decision has a margin of ``MARGIN``: no near-tie can
decide), two tokens are built so each misreading of the routing picks other experts:

- ``decoy group``: the best single expert sits in a group whose two best sum less than the kept
  groups' (a router ignoring the groups, or scoring a group by its best expert, picks it);
- ``bias flips``: a kept group holds the best unbiased score with a bias of ``-FLIP`` (out) and a
  poor one with ``+FLIP`` (in): a router ignoring the bias picks the first; one weighting by the
  biased score gives the second three times its weight.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check
from vllm_ling.ops.moe.routing import grouped_topk

TOPK_RTOL = 1e-5  # per row ||out - ref|| / ||ref||: fp32 sigmoid and sum give ~3e-7
MARGIN = 1e-3     # the least gap, in choice score, at any group or expert decision of a random token
FLIP = 0.6        # the bias that moves the bias-flip token's two experts across the cut
RANDOM_TOKENS = (1, 67)  # one CTA, and more CTAs than a decode batch


@dataclasses.dataclass(frozen=True)
class Routing:
    """One router's configuration, as vLLM's router holds it."""

    num_experts: int
    n_group: int
    topk_group: int
    top_k: int
    renormalize: bool = True
    scale: float = 1.0


@dataclasses.dataclass
class RouterTopkProblem:
    bias: torch.Tensor  # float32 [E]
    cases: list[KnownAnswerCase]


def dense_weights(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] weights and ids -> float64 [T, E], zero where an expert is not picked (an id picked
    twice adds up: it shows as a wrong row)."""
    out = torch.zeros((weights.shape[0], num_experts), dtype=torch.float64)
    return out.scatter_add_(1, ids.detach().to("cpu", torch.int64), weights.detach().to("cpu", torch.float64))


def _reference(logits: torch.Tensor, bias: torch.Tensor, r: Routing) -> torch.Tensor:
    w, ids = grouped_topk(logits.double(), r.top_k, r.n_group, r.topk_group, bias.double(), r.renormalize, r.scale)
    return dense_weights(w, ids, r.num_experts)


def decision_margins(logits: torch.Tensor, bias: torch.Tensor, r: Routing) -> torch.Tensor:
    """Per token, the least gap at its group cut and at its expert cut (inf where nothing is cut)."""
    t, per = logits.shape[0], r.num_experts // r.n_group
    choice = logits.double().sigmoid() + bias.double()
    groups = choice.view(t, r.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
    ranked = groups.sort(dim=-1, descending=True)[0]
    gap = (ranked[:, r.topk_group - 1] - ranked[:, r.topk_group] if r.topk_group < r.n_group
           else torch.full((t,), math.inf, dtype=torch.float64))
    kept = groups.topk(r.topk_group, dim=-1)[1]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, kept, True).repeat_interleave(per, dim=1)
    best = choice.masked_fill(~mask, -math.inf).sort(dim=-1, descending=True)[0]
    if r.top_k < r.topk_group * per:
        gap = torch.minimum(gap, best[:, r.top_k - 1] - best[:, r.top_k])
    return gap


def _random_tokens(count: int, bias: torch.Tensor, r: Routing, gen: torch.Generator) -> torch.Tensor:
    """fp32 logits ~ 3 N(0, 1), each token redrawn until its decisions have ``MARGIN``."""
    rows = []
    while len(rows) < count:
        batch = (torch.randn((4 * count, r.num_experts), generator=gen) * 3).float()
        rows += [row for row, m in zip(batch, decision_margins(batch, bias, r)) if m > MARGIN]
    return torch.stack(rows[:count])


def _logit(u: torch.Tensor) -> torch.Tensor:
    return (u / (1 - u)).log()


def _decoy_layout(g: int, tg: int, flip_group: int) -> tuple[list[int], int]:
    """The decoy token's kept groups and its decoy group (never kept). The flip group stays out of
    both where a third group allows; where only one group is left out (two groups keeping one, as in
    the routable tiny model) the flip group is kept and the other group is the decoy."""
    others = [x for x in range(g) if x != flip_group]
    if g - tg >= 2:
        return others[:tg], others[tg]
    decoy = others[-1]
    return [x for x in range(g) if x != decoy][:tg], decoy


def _designed_tokens(bias: torch.Tensor, flips: tuple[int, int], r: Routing,
                     gen: torch.Generator) -> torch.Tensor | None:
    """The decoy-group and bias-flip tokens (None where the configuration has no group to leave out
    or fewer than two experts a group). Unbiased scores: background 0.02-0.10, top_k or more of the
    kept groups' experts 0.60-0.85, the decoy 0.97; the flip experts 0.95 (out) and 0.30 (in). A kept
    flip group's ``+FLIP`` expert (0.62-0.70 with its bias) may take the last pick from a 0.60 one: the
    reference says so, with a margin of 0.02."""
    g, tg, per = r.n_group, r.topk_group, r.num_experts // r.n_group
    if tg >= g or per < 2 or g < 2:
        return None
    flip_group = flips[0] // per
    decoy_kept, decoy_group = _decoy_layout(g, tg, flip_group)
    flip_kept = [flip_group] + [x for x in range(g) if x != flip_group][:tg - 1]
    tokens = []
    for kept, decoy in ((decoy_kept, decoy_group), (flip_kept, None)):
        u = 0.02 + 0.08 * torch.rand((r.num_experts,), generator=gen, dtype=torch.float64)
        # round robin over the kept groups (two or more each), the flip experts left to the bias
        highs = [e for j in range(per) for x in kept if (e := x * per + j) not in flips][:max(r.top_k, 2 * tg)]
        u[highs] = torch.linspace(0.85, 0.60, len(highs), dtype=torch.float64)
        if decoy is None:  # the bias decides: best unbiased score out, a poor one in
            u[flips[0]], u[flips[1]] = 0.95, 0.30
        else:
            u[decoy * per] = 0.97
        tokens.append(_logit(u).float())
    return torch.stack(tokens)


def router_topk_problem(r: Routing, seed: int = 0) -> RouterTopkProblem:
    """A bias (random within +-0.01, and ``-FLIP`` / ``+FLIP`` on the two flip experts of group 1)
    and the cases: ``RANDOM_TOKENS`` random tokens each, and the two designed tokens."""
    gen = torch.Generator().manual_seed(seed)
    per = r.num_experts // r.n_group
    flips = (min(1, r.n_group - 1) * per, min(1, r.n_group - 1) * per + 1)  # group 1's first two experts
    bias = (torch.rand((r.num_experts,), generator=gen) - 0.5) * 0.02
    bias[flips[0]], bias[flips[1]] = -FLIP, FLIP
    cases = [(f"{n} random token{'s' if n > 1 else ''}", _random_tokens(n, bias, r, gen)) for n in RANDOM_TOKENS]
    designed = _designed_tokens(bias, flips, r, gen)
    if designed is not None:
        cases.append(("decoy group and bias flips (2 tokens)", designed))
    shape = f"{r.num_experts} experts, {r.n_group} groups keep {r.topk_group}, top {r.top_k}"
    out = []
    for label, logits in cases:
        def explain(bad: torch.Tensor) -> str:
            return f"{int(bad.sum())} of {bad.numel()} tokens routed to other experts or weights"
        out.append(KnownAnswerCase(f"{label} x {shape}", {"logits": logits}, _reference(logits, bias, r),
                                   TOPK_RTOL, per_row=True, explain=explain))
    return RouterTopkProblem(bias, out)


def check_router_topk(route: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                      label: str, r: Routing, device: torch.device | str = "cpu") -> KernelCheckResult:
    """``route(logits, bias)`` -> (weights [T, k], ids [T, k]) on :func:`router_topk_problem` for the
    served router's configuration ``r``."""
    problem = router_topk_problem(r)
    bias = problem.bias.to(device)

    def forward(inputs: dict) -> torch.Tensor:
        weights, ids = route(inputs["logits"].to(device), bias)
        return dense_weights(weights, ids, r.num_experts)

    return run_check("router_topk", label, problem.cases, forward)
