"""MXFP4 (OCP microscaling FP4) helpers in plain PyTorch; no vLLM import.

Format used by Ling-3.0-flash-fp4 routed experts:
- values are FP4 e2m1 (sign bit 3, 2 exponent bits, 1 mantissa bit), magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6};
- two values per uint8 byte, element ``2i`` in the low nibble and ``2i+1`` in the
  high nibble (the OCP / vLLM / humming convention);
- one E8M0 scale (uint8 biased exponent, value ``2**(e - 127)``, 255 is NaN) per
  32 consecutive inputs along the last (K) dimension.
"""

from __future__ import annotations

import torch

MXFP4_GROUP_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_MAX = 6.0

# Index = 4-bit code; codes 8..15 are the negatives of 0..7 (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive magnitudes; ties round to the even code.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_lut(device: torch.device | str | None = None, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """Round real values (already divided by their scale) to 4-bit codes (uint8, 0..15).

    Round to nearest, ties to even code; magnitudes above 6 saturate to 6.
    """
    v = values.float()
    mag = v.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=v.device)
    code = torch.bucketize(mag, bounds, right=False)  # mag == bound -> lower code
    # A tie (mag exactly on a bound) goes to the even code: bump odd lower codes.
    on_bound = (bounds.unsqueeze(0) == mag.reshape(-1, 1)).any(dim=1).reshape(mag.shape)
    code = torch.where(on_bound & (code % 2 == 1), code + 1, code)
    code = code.clamp(max=7).to(torch.uint8)
    sign = (torch.signbit(v) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return e2m1_lut(codes.device, dtype)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes along the last dim (even length) into uint8, low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension must be even to pack e2m1, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: uint8 [..., K/2] -> codes uint8 [..., K]."""
    p = packed.view(torch.uint8)
    out = torch.stack((p & 0xF, p >> 4), dim=-1)
    return out.reshape(*p.shape[:-1], p.shape[-1] * 2)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 (or float8_e8m0fnu) biased exponents -> float32 powers of two; 255 -> NaN."""
    if scale.dtype != torch.uint8:
        scale = scale.view(torch.uint8)
    e = scale.to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.full_like(out, float("nan")), out)


def float_to_e8m0(scale: torch.Tensor, round_up: bool = True) -> torch.Tensor:
    """Positive float scales -> uint8 biased exponents (ceil of log2 by default, so the
    quantized block never overflows). Zero maps to the smallest exponent (0)."""
    s = scale.float()
    if round_up:
        # frexp gives s = m * 2**e with m in [0.5, 1); ceil(log2 s) is e, or e-1 when m == 0.5.
        m, e = torch.frexp(s)
        exp = torch.where(m == 0.5, e - 1, e)
    else:
        exp = torch.floor(torch.log2(s)).to(torch.int32)
    exp = torch.where(s > 0, exp, torch.full_like(exp, -E8M0_BIAS))
    return (exp + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def mxfp4_quantize(weight: torch.Tensor, group_size: int = MXFP4_GROUP_SIZE):
    """Quantize [..., K] real weights to (packed uint8 [..., K/2], E8M0 uint8 [..., K/group]).

    The scale of each group is the power of two that maps the group's max |w| to at
    most 6 (the e2m1 max), i.e. ``2**ceil(log2(amax / 6))``.
    """
    *lead, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the MXFP4 group size {group_size}")
    w = weight.float().reshape(*lead, k // group_size, group_size)
    amax = w.abs().amax(dim=-1)
    scale_u8 = float_to_e8m0(amax / E2M1_MAX)
    scale = e8m0_to_float(scale_u8).unsqueeze(-1)
    codes = e2m1_encode(w / scale).reshape(*lead, k)
    return pack_e2m1(codes), scale_u8


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor,
                     group_size: int = MXFP4_GROUP_SIZE, dtype=torch.float32) -> torch.Tensor:
    """(packed uint8 [..., K/2], E8M0 [..., K/group]) -> real [..., K] in ``dtype``."""
    values = e2m1_decode(unpack_e2m1(packed))
    *lead, k = values.shape
    if scale.shape[-1] * group_size != k:
        raise ValueError(
            f"scale has {scale.shape[-1]} groups but the weight has K={k} "
            f"(expected {k // group_size} groups of {group_size})")
    scaled = values.reshape(*lead, k // group_size, group_size) * e8m0_to_float(scale).unsqueeze(-1)
    return scaled.reshape(*lead, k).to(dtype)
