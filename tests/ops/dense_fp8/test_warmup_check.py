"""The dense FP8 warm-up's output check (CPU): a kernel's outputs are compared with the float64
reference at the kernels' tested tolerance; right outputs pass, wrong ones raise naming what ran.
The warm-up itself (compiling and running every served kernel) is tested on the GPU."""

from __future__ import annotations

import pytest
import torch

from vllm_ling.ops.dense_fp8.reference import reference_linear
from vllm_ling.ops.dense_fp8.warmup import check_outputs
from vllm_ling.ops.fp8 import block_fp8_quantize


def _problem(rows=3, n=256, k=384, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.tensor([4.0 ** (j % 3) for j in range(k // 128)]).repeat_interleave(128)  # unlike block scales
    weight, scale = block_fp8_quantize(torch.randn((n, k), generator=gen) * 0.02 * blocks)
    x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
    return x, weight, scale


def test_right_outputs_pass_in_bf16_and_fp32_summation():
    x, weight, scale = _problem()
    check_outputs(reference_linear(x, weight, scale).to(torch.bfloat16), x, weight, scale, "fp32 -> bf16")
    check_outputs(reference_linear(x, weight, scale, dtype=torch.float64).to(torch.bfloat16), x, weight, scale,
                  "float64 -> bf16")


@pytest.mark.parametrize("fault", ["one output", "block scale", "last column", "nan"])
def test_wrong_outputs_raise_naming_the_kernel(fault):
    x, weight, scale = _problem()
    if fault == "block scale":  # a kernel reading the next k-block's scale
        out = reference_linear(x, weight, scale.roll(-1, 1))
    elif fault == "last column":  # a kernel dropping the last k element
        out = reference_linear(x[:, :-1], weight[:, :-1], scale)
    else:
        out = reference_linear(x, weight, scale)
        out[1, 7] = out[1, 7] * 1.05 + 0.01 if fault == "one output" else float("nan")
    with pytest.raises(RuntimeError, match=r"256x384 at 3 rows \(kernel X\).*VLLM_LING_DENSE_FP8=vllm"):
        check_outputs(out.to(torch.bfloat16), x, weight, scale, "256x384 at 3 rows (kernel X)")
