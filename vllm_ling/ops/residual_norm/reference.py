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


# BF16 outputs: the new residual is exact (one rounding of an fp32 sum); the normalised row may differ by one
# rounding of rsqrt's last bit (one BF16 step, 2**-7 relative)
NORM_RTOL, NORM_ATOL = 2.0 ** -7, 1e-6


def mismatch(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """How the kernel's ``(normed, new_residual)`` differs from the reference's beyond the tolerances (None:
    it does not)."""
    problems = []
    if not torch.equal(got[1], want[1]):
        problems.append("wrong residual")
    if not torch.allclose(got[0].float(), want[0].float(), rtol=NORM_RTOL, atol=NORM_ATOL):
        problems.append(f"normalised rows off by up to {(got[0].float() - want[0].float()).abs().max().item():.3g}")
    return "; ".join(problems) or None
