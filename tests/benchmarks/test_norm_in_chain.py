"""benchmarks/norm_in_chain.py on the CPU: its table reads the norms' cost in the chain as the chain less the
linears alone, and the fraction of copy bandwidth from the layer's bytes; the exit code needs a GPU. The timed
chain runs in the lease's norm-chain phase (scripts/h200_session.sh)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import norm_in_chain as B


def _row(tokens, inductor, ling, none, exact=True, err=0.0):
    return {"tokens": tokens, "inductor_us": inductor, "ling_us": ling, "none_us": none, "exact_residual": exact,
            "norm_err": err, "inductor_alone_us": 2.5, "ling_alone_us": 2.0, "bytes": 60_000_000}


def test_the_table_shows_the_norms_cost_in_the_chain():
    text = B.table([_row(1, 30.0, 26.0, 25.0), _row(4, 32.0, 28.0, 26.0, exact=False, err=0.5)],
                   "H100", 3000.0, "copy kernel", 8, 200)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert rows[0][1:6] == ["30.00", "26.00", "25.00", "0.87", "5.00, 1.00"]
    assert rows[0][6] == f"{60_000_000 / 3e6 / 26.0:.2f}"  # 20 us of bytes at 3,000 GB/s over 26 us
    assert rows[0][7] == "5.00, 4.00"  # two norms alone per layer
    assert rows[1][-1] == "False, 0.5 |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert B.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_table_says_whether_the_input_norms_x_is_the_moes_sum():
    rows = [_row(1, 30.0, 26.0, 25.0)]
    assert "shared + routed outputs" in B.table(rows, "H100", 3000.0, "copy kernel", 8, 200)
    assert "x one tensor (--no-moe-sum)" in B.table(rows, "H100", 3000.0, "copy kernel", 8, 200, moe_sum=False)
