"""benchmarks/router_topk.py's correctness column on the CPU: a token whose picks differ from the
reference counts as off, and as a near tie only where its decision margin is an fp32 rounding."""

from __future__ import annotations

import torch

from benchmarks import router_topk as B
from vllm_ling.ops.known_answer.router_topk import Routing, decision_margins
from vllm_ling.ops.moe.routing import grouped_topk

ROUTING = Routing(64, 2, 1, 2, True, 2.5)


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((8, 64), generator=gen) * 3
    bias = torch.zeros(64)
    # token 0: its two best experts of group 0 tie with a third (equal logits, equal bias) at the cut
    logits[0] = -4.0
    logits[0, [3, 5, 7]] = torch.tensor([3.0, 2.0, 2.0])
    ids = grouped_topk(logits, ROUTING.top_k, ROUTING.n_group, ROUTING.topk_group, bias, True, ROUTING.scale)[1]
    return logits, bias, ids


def test_a_pick_at_a_tie_is_off_and_near_one_away_from_it_is_off_only():
    logits, bias, want = _case(0)
    assert decision_margins(logits[:1], bias, ROUTING)[0] < B.NEAR_TIE
    got = want.clone()
    tied = 7 if 5 in want[0].tolist() else 5  # the other expert of the tie
    got[0] = torch.tensor([3, tied])
    far = int((decision_margins(logits, bias, ROUTING) > 1e-2).nonzero()[0])
    got[far, 1] = (set(range(64)) - set(want[far].tolist())).pop()
    assert B.tokens_off([got], [want], [logits], [bias], ROUTING) == (2, 1)
    assert B.tokens_off([want], [want], [logits], [bias], ROUTING) == (0, 0)


def test_picks_in_another_order_are_not_off():
    logits, bias, want = _case(1)
    assert B.tokens_off([want.flip(-1)], [want], [logits], [bias], ROUTING) == (0, 0)
