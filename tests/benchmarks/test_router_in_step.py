"""benchmarks/router_in_step.py on the CPU: its table reads the top-k's share of the chain as the chain
less the chain without it, and the exit code needs a GPU. The timed chain runs in the lease's router-bench
phase (scripts/h200_session.sh)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import router_in_step as B


def _row(tokens, chain, no_topk, off=0, near=0):
    return {"tokens": tokens, "chain_us": chain, "no_topk_us": no_topk, "topk_in_chain_us": chain - no_topk,
            "gemv_topk_us": 9.0, "topk_us": 5.1, "moe_us": 20.0, "gemv_us": 2.5, "picks_off": off, "near_tie": near}


def test_the_table_shows_the_top_ks_share_of_the_chain():
    text = B.table([_row(1, 38.5, 31.2), _row(4, 52.0, 45.0, off=1, near=1)], "H100", 3000.0, "copy kernel", 8, 200)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert rows[0][1:4] == ["38.50", "31.20", "7.30"]
    assert rows[1][-1] == "1 (1) |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert B.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
