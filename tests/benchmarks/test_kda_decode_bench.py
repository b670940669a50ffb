"""benchmarks/kda_decode.py: its byte count against the layer's tensors (CPU), and the whole benchmark on
the GPU (``gpu`` marker; the lease's ``cuts`` phase runs the benchmark itself)."""

from __future__ import annotations

import pytest

from benchmarks import kda_decode as B


def test_the_bytes_are_the_states_conv_states_and_rows_a_step_moves():
    state = B.HEADS * B.HEAD_DIM * B.HEAD_DIM * 4  # 2 MB at Ling's shape
    assert state == 2 << 20
    plain, verify = B.step_bytes(1, 1), B.step_bytes(1, 4)
    assert 2 * state < plain < 2 * state + (1 << 20)  # read and written once, plus KB of conv state and rows
    assert 5 * state < verify < 5 * state + (1 << 20)  # read once, one written per position
    assert B.step_bytes(8, 1) == 8 * plain


@pytest.mark.gpu
def test_the_benchmark_runs_on_the_gpu(tmp_path):
    out = tmp_path / "kda.md"
    assert B.main(["--cases", f"1x1,1x4,1x{B.DSPARK_WINDOW}", "--iters", "5", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 1 x 1 |" in text and "| 1 x 4 |" in text and f"| 1 x {B.DSPARK_WINDOW} |" in text
