"""The fused router candidate's refusals, on any machine (vllm_ling.ops.router_topk.fused): what it cannot
route is refused, naming why, before anything is compiled or launched. Its numerics are GPU tests
(tests/ops/test_router_topk_gpu.py); its source compiles for every target in test_kernels_compile.py."""

from __future__ import annotations

import pytest
import torch

from vllm_ling.ops.router_topk import fused


def test_lings_router_fits_and_the_grid_is_a_power_of_two():
    assert fused.shape_problems(512, 8, 4, 8, 2560) == []
    grid = fused.grid_size()
    experts_per_cta = (512 // 32) // fused.WARPS_PER_EXPERT  # the CTA's warps over its experts' rows
    assert grid & (grid - 1) == 0 and grid == 512 // experts_per_cta  # the counter's residue classes


@pytest.mark.parametrize("shape, why", [
    ((512, 8, 4, 8, 2000), "hidden size 2000 is not a multiple of 512"),
    ((96, 3, 1, 2, 2560), "3 warps"),
    ((48, 4, 2, 2, 2560), "48 experts is not a multiple of 32"),
])
def test_a_shape_it_cannot_hold_is_named(shape, why):
    assert any(why in p for p in fused.shape_problems(*shape)), fused.shape_problems(*shape)


def _inputs(tokens=1, hidden=2560, experts=512, x_dtype=torch.bfloat16):
    return (torch.zeros(tokens, hidden, dtype=x_dtype), torch.zeros(experts, hidden), torch.zeros(experts))


@pytest.mark.parametrize("change, why", [
    (dict(tokens=17), "17 tokens"),
    (dict(x_dtype=torch.float16), "needs BF16 x"),
    (dict(hidden=2000), "hidden size 2000"),
])
def test_route_fused_refuses_before_it_launches(change, why):
    with pytest.raises(ValueError, match=why):
        fused.route_fused(*_inputs(**change), 8, 8, 4, counter=fused.new_counter("cpu"))


def test_a_counter_that_is_not_one_int32_is_refused():
    with pytest.raises(ValueError, match="one int32 counter"):
        fused.route_fused(*_inputs(), 8, 8, 4, counter=torch.zeros(2, dtype=torch.int32))
