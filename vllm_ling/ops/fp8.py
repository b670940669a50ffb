"""Block-scaled FP8 e4m3 helpers (the format of Ling-fp4's dense linears); no vLLM import.

A [N, K] weight is split into 128x128 blocks; each block b stores e4m3 values and one
float32 ``weight_scale_inv[b]`` such that ``w ~= fp8 * weight_scale_inv``. With
``scale_fmt == "ue8m0"`` every scale is a power of two (an E8M0 exponent kept in
float32), chosen as ``2**ceil(log2(amax / 448))`` so no value saturates.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
QUANT_BLOCK = 128  # rows and columns of one scale block (Ling's weight_block_size)
DEFAULT_BLOCK = (QUANT_BLOCK, QUANT_BLOCK)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def power_of_two_scale(amax: torch.Tensor, qmax: float = FP8_E4M3_MAX) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax; all-zero blocks get 1.0."""
    s = amax.float() / qmax
    m, e = torch.frexp(s)
    exp = torch.where(m == 0.5, e - 1, e)
    out = torch.ldexp(torch.ones_like(s), exp)
    return torch.where(s > 0, out, torch.ones_like(s))


def block_fp8_quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                       ue8m0: bool = True):
    """[N, K] real -> (float8_e4m3fn [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)])."""
    n, k = weight.shape
    bn, bk = block
    gn, gk = _ceil_div(n, bn), _ceil_div(k, bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.reshape(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    if ue8m0:
        scale = power_of_two_scale(amax)
    else:
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(gn * bn, gk * bk)[:n, :k].to(torch.float8_e4m3fn)
    return q, scale.float()


def block_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = DEFAULT_BLOCK, dtype=torch.float32):
    n, k = q.shape
    bn, bk = block
    expected = (_ceil_div(n, bn), _ceil_div(k, bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match "
                         f"weight {n}x{k} with {bn}x{bk} blocks (expected {expected})")
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * s).to(dtype)
