"""FP8 e4m3 per-row quantization of the LM head (the rule and its error bound are in
:mod:`vllm_ling.ops.lm_head`), and the per-token activation quantization of the
``scaled_mm`` kernel."""

from __future__ import annotations

import torch

from vllm_ling.ops.fp8 import FP8_E4M3_MAX

FP8_DTYPE = torch.float8_e4m3fn

# Rows of the vocabulary handled at once by the chunked (CPU / reference) paths: 8192 x 2560
# fp32 is 84 MB, so a 157,184 x 2,560 head never needs its 1.6 GB fp32 copy.
DEFAULT_CHUNK_ROWS = 8192


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16-representable float32 >= x, for finite x >= 0 (bit trick: bf16 is
    the top 16 bits of fp32, so add 0xFFFF and clear the low half)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def fp8_row_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale rule: amax / 448 rounded up to a bfloat16 value; 1 for all-zero rows."""
    amax = amax.float()
    scale = round_up_to_bf16(amax / FP8_E4M3_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_fp8_per_channel(
    weight: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[V, H]`` real weight -> (``float8_e4m3fn [V, H]``, ``float32 [V]`` scale).

    ``w ~= q.float() * scale[:, None]``; see the module docstring for the rule and bound.
    Works on the weight's device, ``chunk_rows`` rows at a time, so the temporary fp32 copy
    is one chunk, never the whole head. Raises ``ValueError`` on NaN/inf weights.
    """
    if weight.dim() != 2:
        raise ValueError(f"LM head weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point() or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"LM head weight must be bf16/fp16/fp32 to quantize, got {weight.dtype}")
    rows, cols = weight.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=weight.device)
    for start in range(0, rows, chunk_rows):
        block = weight[start : start + chunk_rows].to(torch.float32, copy=True)  # divided in place below
        if not torch.isfinite(block).all():
            bad = start + int((~torch.isfinite(block)).any(dim=1).nonzero()[0, 0])
            raise ValueError(
                f"LM head weight has NaN/inf values (first in vocabulary row {bad}); "
                "the checkpoint's lm_head.weight is corrupt, refusing to quantize it to FP8"
            )
        s = fp8_row_scale(block.abs().amax(dim=1))
        block.div_(s[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        q[start : start + chunk_rows] = block.to(FP8_DTYPE)
        scale[start : start + chunk_rows] = s
    return q, scale


def dequantize_fp8_per_channel(
    weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * scale[:, None]`` as ``dtype`` (materialises the whole matrix: tests and
    small heads only; the logits paths dequantize chunk by chunk)."""
    check_fp8_pair(weight_fp8, scale)
    return (weight_fp8.float() * scale.float()[:, None]).to(dtype)


def check_fp8_pair(weight_fp8: torch.Tensor, scale: torch.Tensor) -> None:
    if weight_fp8.dtype != FP8_DTYPE or weight_fp8.dim() != 2:
        raise ValueError(
            f"expected a 2-D float8_e4m3fn head weight, got {weight_fp8.dtype} {tuple(weight_fp8.shape)}"
        )
    if scale.shape != (weight_fp8.shape[0],):
        raise ValueError(
            f"expected one scale per vocabulary row, shape ({weight_fp8.shape[0]},), got {tuple(scale.shape)}"
        )



def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row activation quantization: (e4m3 [M, K], fp32 [M, 1] scale)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (x32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE), scale
