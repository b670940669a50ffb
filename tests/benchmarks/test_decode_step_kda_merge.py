"""The decode-step benchmark's KDA in-projection (CPU side): vllm-ling's composition launches one
merged q|k|v|f|g weight, the upstream composition three row slices of that same weight, so both
read the same bytes and compute the same numbers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_upstream_parts_are_row_slices_of_the_merged_weight():
    from benchmarks.decode_step import Fp8Linear
    from vllm_ling.ops.fp8 import block_fp8_dequantize

    proj, hidden = 256, 256
    whole = Fp8Linear(5 * proj, hidden, torch.Generator().manual_seed(0), "cpu")
    parts = [Fp8Linear.rows(whole, a * proj, b * proj) for a, b in ((0, 3), (3, 4), (4, 5))]
    assert [p.q.shape[0] for p in parts] == [3 * proj, proj, proj]
    assert sum(p.bytes for p in parts) == whole.bytes  # same bytes in both compositions
    dense = block_fp8_dequantize(whole.q, whole.s, (128, 128), dtype=torch.float32)
    stacked = torch.cat([block_fp8_dequantize(p.q, p.s, (128, 128), dtype=torch.float32) for p in parts])
    assert torch.equal(stacked, dense)
    assert parts[1].q.data_ptr() == whole.q[3 * proj:].data_ptr()  # views: no second copy of the weight
    with pytest.raises(ValueError, match="128-row block grid"):
        Fp8Linear.rows(whole, 0, 100)
