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
