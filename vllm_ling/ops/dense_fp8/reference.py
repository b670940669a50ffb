"""Plain-PyTorch reference for the W8A16 block-FP8 linear (the kernels' test oracle).

Dequantize the e4m3 weight with its 128 x 128 block scales (``vllm_ling.ops.fp8``) and
multiply in fp32 (or float64): ``out = x @ (w * scale).T``. No vLLM import; any device.
"""

from __future__ import annotations

import torch

from vllm_ling.ops.fp8 import block_fp8_dequantize


def reference_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[M, K] activations, [N, K] e4m3 weight, [ceil(N/128), ceil(K/128)] scales -> [M, N] ``dtype``."""
    w = block_fp8_dequantize(weight, scale, dtype=dtype)
    return x.to(dtype) @ w.t()


def magnitude_bound(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``|x| @ |w * scale|.T`` in float64: the sum of the terms' magnitudes, which bounds the
    error of any fp32 summation order (tolerances in the tests are fractions of it)."""
    w = block_fp8_dequantize(weight, scale, dtype=torch.float64).abs()
    return x.to(torch.float64).abs() @ w.t()


# Per-output tolerance of a W8A16 kernel (its GPU tests' and the warm-up's): half a BF16 step of
# the output (rounded once from fp32) plus fp32 summation of up to a few thousand exact products,
# as fractions of |ref| and of ``magnitude_bound`` (tests/ops/dense_fp8/test_dense_fp8_gpu.py).
OUTPUT_RTOL = 2.0 ** -8
SUM_TOL = 2.0 ** -14


def output_errors(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|got - ref|, tolerance) per output of ``got`` [M, N] against the float64 reference; an
    output is wrong unless its error is within the tolerance (NaN is wrong)."""
    ref = reference_linear(x, weight, scale, dtype=torch.float64)
    return (got.double() - ref).abs(), OUTPUT_RTOL * ref.abs() + SUM_TOL * magnitude_bound(x, weight, scale)
