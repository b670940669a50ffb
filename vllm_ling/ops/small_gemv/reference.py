"""Plain-PyTorch oracle for the small GEMV: float64 products and the magnitude bound that
tolerances are fractions of. Any device, no vLLM import."""

from __future__ import annotations

import torch


def reference_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, K] activations, [N, K] weight -> [T, N] float64."""
    return x.to(torch.float64) @ weight.to(torch.float64).t()


def magnitude_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``|x| @ |w|.T`` in float64: bounds the error of any fp32 summation order."""
    return x.to(torch.float64).abs() @ weight.to(torch.float64).abs().t()
