"""benchmarks/kda_norm_in_chain.py on the CPU: its table reads the norm's cost in the chain as the chain less the
chain without a norm, and the fraction of copy bandwidth from the layer's bytes; the exit code needs a GPU. The
timed chain runs in the lease's norm-chain phase (scripts/h200_session.sh)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import kda_decode
from benchmarks import kda_norm_in_chain as B


def _row(window, inductor, inside, none, err=1e-3):
    return {"window": window, "inductor_us": inductor, "inside_us": inside, "none_us": none, "norm_err": err,
            "bytes": 30_000_000}


def test_the_table_shows_the_norms_cost_in_the_chain():
    text = B.table([_row(1, 16.0, 12.0, 11.0), _row(4, 30.0, 29.0, 28.0, err=0.5)], "H100", 3000.0, "copy kernel",
                   8, 200)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert rows[0][1:6] == ["16.00", "12.00", "11.00", "0.75", "5.00, 1.00"]
    assert rows[0][6] == f"{30_000_000 / 3e6 / 12.0:.2f}"  # 10 us of bytes at 3,000 GB/s over 12 us
    assert rows[1][-1] == "0.5 |"


def test_a_layers_bytes_are_the_kda_steps_the_gate_rows_and_the_out_projection():
    proj = kda_decode.HEADS * kda_decode.HEAD_DIM
    o_proj = B.H * proj + (B.H // 128) * (proj // 128) * 4  # FP8 weight, fp32 block scales
    assert B.layer_bytes(1) == kda_decode.step_bytes(1, 1) + proj * 2 + o_proj + B.H * 2  # + the gate's row
    # the verify window writes a state per position: 4 more written than one token's 1
    state = kda_decode.HEADS * kda_decode.HEAD_DIM ** 2 * 4
    assert B.layer_bytes(4) - B.layer_bytes(1) > 3 * state


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert B.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
