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


def add2_rms_norm(x: torch.Tensor, x2: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` of ``x + x2`` rounded to the rows' dtype first, as a graph that adds two rows and then
    calls the norm computes it (the MoE's shared + routed outputs before the next layer's input norm)."""
    return add_rms_norm((x.float() + x2.float()).to(x.dtype), residual, weight, eps)


# BF16 outputs: the new residual is exact (one rounding of an fp32 sum). The normalised row is rounded before the
# weight multiplies it: where rsqrt's last bit differs (reduction order) that rounding may flip by one BF16 step
# and the product's rounding add one, so two steps (2**-6 relative) bound it; lease 2026-12-07h found 1 to 12
# values of 4 to 25 million two steps off at 2,048 random rows against one step's tolerance. A wrong weight, eps,
# row or residual is O(1) off.
NORM_RTOL, NORM_ATOL = 2.0 ** -6, 1e-6


def mismatch(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """How the kernel's ``(normed, new_residual)`` differs from the reference's beyond the tolerances (None:
    it does not)."""
    problems = []
    if not torch.equal(got[1], want[1]):
        problems.append("wrong residual")
    if not torch.allclose(got[0].float(), want[0].float(), rtol=NORM_RTOL, atol=NORM_ATOL):
        problems.append(f"normalised rows off by up to {(got[0].float() - want[0].float()).abs().max().item():.3g}")
    return "; ".join(problems) or None
