"""Bit-level facts of the formats (e4m3, e2m1, E8M0), message labels and the tolerances."""

from __future__ import annotations

import math

import torch

from vllm_ling.ops.mxfp4 import MXFP4_GROUP_SIZE as MXFP4_GROUP

# e4m3 (float8_e4m3fn): codes 0x7F and 0xFF are NaN; a checkpoint never holds them.
E4M3_NAN_CODES = (0x7F, 0xFF)
FINITE_E4M3_CODES = tuple(c for c in range(256) if c not in E4M3_NAN_CODES)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP MX spec, codes 0..7; 8..15 negative

# Tolerances (relative). One-hot inputs read single weights back: a correct kernel is exact
# up to its output rounding (BF16: half a step, 2**-9; humming rounds before and after the
# scale, one step). Random inputs accumulate in fp32 and round activations to BF16 between
# the GEMMs (~3e-3 per row); every planted fault is O(0.1) or more.
ONE_HOT_RTOL = 2.0 ** -7
DENSE_ROW_RTOL = 1e-2
MOE_ROW_RTOL = 2e-2
# W4A8 against answers with the same FP8 rounding of activations: codes near a rounding
# boundary can round the other way from the kernel's BF16 intermediates (one e4m3 step is 6-12 %).
MOE_W4A8_ROW_RTOL = 5e-2


def e4m3_value(code: int) -> float:
    """The real value of one float8_e4m3fn code, from its bits (bias 7, subnormals m/8*2**-6)."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_TABLE = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)
E2M1_TABLE = torch.tensor(list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES], dtype=torch.float64)


def code_ranges(codes) -> str:
    """{0, 1, 2, 7} -> '0x00-0x02 0x07'."""
    codes = sorted(set(int(c) for c in codes))
    parts, i = [], 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        parts.append(f"0x{codes[i]:02x}" if i == j else f"0x{codes[i]:02x}-0x{codes[j]:02x}")
        i = j + 1
    return " ".join(parts)


def pow2_label(value: float) -> str:
    if value == 0:
        return "0"
    m, e = math.frexp(value)
    return f"2^{e - 1}" if m == 0.5 else f"{value:.4g}"
