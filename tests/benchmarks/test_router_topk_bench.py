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


def _row(tokens: int, ours_us: float, candidate_us: float, off: int = 0, near: int = 0) -> dict:
    return {"tokens": tokens, "ours_us": ours_us, "vllm_us": None, "ours_off": 0, "ours_near_tie": 0,
            "candidate": "ranks", "candidate_us": candidate_us, "candidate_off": off, "candidate_near_tie": near}


def test_the_candidate_serves_only_where_right_and_faster_at_every_decode_size():
    fast = [_row(1, 8.0, 5.0), _row(4, 8.5, 5.5), _row(16, 9.0, 6.0), _row(2048, 40.0, 60.0)]
    assert B.candidate_wins(fast)[0]  # prefill sizes do not decide
    # a pick off the reference away from a tie at any size
    assert not B.candidate_wins(fast[:3] + [_row(2048, 40.0, 30.0, off=2, near=1)])[0]
    # off only at near ties is right
    assert B.candidate_wins([_row(1, 8.0, 5.0, off=3, near=3)])[0]
    # within the margin at one decode size
    wins, why = B.candidate_wins([_row(1, 8.0, 5.0), _row(4, 8.0, 7.8)])
    assert not wins and "4: 7.80 vs 8.00 us" in why
    # nothing timed at decode sizes
    assert not B.candidate_wins([_row(256, 20.0, 10.0)])[0]


def test_candidate_wins_reads_the_rows_a_run_wrote(tmp_path):
    import json

    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([_row(1, 8.0, 5.0), _row(4, 8.0, 6.0)]))
    assert B.main(["--candidate-wins", str(rows)]) == 0
    rows.write_text(json.dumps([_row(1, 8.0, 9.0)]))
    assert B.main(["--candidate-wins", str(rows)]) == 1


def test_the_leases_switch_to_the_candidate_rewrites_the_served_variant(tmp_path):
    """scripts/h200_session.sh (phase cuts) serves a winning candidate in the lease's copy of the tree with
    one sed on kernel.py: that expression must still match the line that names the served variant."""
    import re
    import subprocess
    from pathlib import Path

    from vllm_ling.ops.router_topk import kernel

    root = Path(__file__).resolve().parents[2]
    script = (root / "scripts/h200_session.sh").read_text()
    expression = re.search(r"sed -i '(s/\^SERVED_VARIANT[^']*)' vllm_ling/ops/router_topk/kernel.py", script).group(1)
    copy = tmp_path / "kernel.py"
    copy.write_text(Path(kernel.__file__).read_text())
    subprocess.run(["sed", "-i", expression, str(copy)], check=True)
    served = re.findall(r'^SERVED_VARIANT = "(\w+)"$', copy.read_text(), re.M)
    assert served == [kernel.CANDIDATE_VARIANT] and kernel.CANDIDATE_VARIANT in kernel.VARIANTS
