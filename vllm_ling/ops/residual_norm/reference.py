"""Plain-PyTorch residual add + RMSNorm: what :func:`vllm_ling.ops.residual_norm.kernel.add_rms_norm_cuda`
computes, with its rounding steps (the sum kept in fp32 for the variance and rounded to the input dtype for the
residual stream; the normalised row rounded before the weight multiplies it, as vLLM's native op rounds)."""

from __future__ import annotations

import torch


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` for rows of ``x`` and ``residual`` [..., H] and ``weight`` [H]."""
    total = x.float() + residual.float()
    rstd = torch.rsqrt(total.square().mean(dim=-1, keepdim=True) + eps)
    normed = (total * rstd).to(weight.dtype) * weight
    return normed.to(x.dtype), total.to(x.dtype)
