"""MXFP4 helpers: e2m1 codes, E8M0 scales, packing order, quantize/dequantize round trips.

Expected values are written out from the OCP MX spec (e2m1: 1 sign, 2 exponent, 1 mantissa
bit, bias 1; E8M0: 2**(e - 127), 255 = NaN), not computed with the code under test.
"""

import math

import pytest
import torch

from vllm_ling.ops import mxfp4

# code -> value from the spec: subnormal 0/0.5, then 2**(e-1) * (1 + m/2).
SPEC_E2M1 = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5,
    0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
}


def test_e2m1_decode_matches_spec_for_all_16_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    values = mxfp4.e2m1_decode(codes)
    for code in range(16):
        magnitude = SPEC_E2M1[code & 0b0111]
        expected = -magnitude if code & 0b1000 else magnitude
        assert values[code].item() == expected
        assert math.copysign(1.0, values[code].item()) == (-1.0 if code & 0b1000 else 1.0)


def test_e2m1_exactly_representable_values_round_trip():
    reps = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = mxfp4.e2m1_encode(reps)
    assert torch.equal(mxfp4.e2m1_decode(codes), reps)
    # +0 encodes to code 0 (not the -0 code 8)
    assert codes[0].item() == 0


@pytest.mark.parametrize("value, expected", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (0.26, 0.5), (5.01, 6.0), (7.0, 6.0), (1e9, 6.0), (-7.0, -6.0), (-0.74, -0.5),
])
def test_e2m1_rounding_ties_to_even_and_saturation(value, expected):
    got = mxfp4.e2m1_decode(mxfp4.e2m1_encode(torch.tensor([value]))).item()
    assert got == expected


def test_pack_order_low_nibble_first():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0xF]], dtype=torch.uint8)
    packed = mxfp4.pack_e2m1(codes)
    # element 0 -> low nibble of byte 0, element 1 -> high nibble
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(mxfp4.unpack_e2m1(packed), codes)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        mxfp4.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("exponent, expected", [
    (0, 2.0 ** -127), (1, 2.0 ** -126), (126, 0.5), (127, 1.0), (128, 2.0), (254, 2.0 ** 127),
])
def test_e8m0_edge_exponents(exponent, expected):
    value = mxfp4.e8m0_to_float(torch.tensor([exponent], dtype=torch.uint8)).item()
    assert value == expected
    assert mxfp4.float_to_e8m0(torch.tensor([expected])).item() == exponent


def test_e8m0_255_is_nan():
    assert math.isnan(mxfp4.e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())


def test_e8m0_accepts_float8_e8m0fnu_view():
    raw = torch.tensor([126, 127, 130], dtype=torch.uint8)
    assert torch.equal(mxfp4.e8m0_to_float(raw.view(torch.float8_e8m0fnu)),
                       torch.tensor([0.5, 1.0, 8.0]))


def test_float_to_e8m0_rounds_up_between_powers():
    assert mxfp4.float_to_e8m0(torch.tensor([3.0])).item() == 129  # 2**2 >= 3
    assert mxfp4.float_to_e8m0(torch.tensor([0.0])).item() == 0


def test_dequantize_hand_built_block():
    # one group of 32 values: codes 0..15 twice, scale 2**(129-127) = 4
    codes = torch.arange(32, dtype=torch.uint8) % 16
    packed = mxfp4.pack_e2m1(codes.unsqueeze(0))
    scale = torch.tensor([[129]], dtype=torch.uint8)
    got = mxfp4.mxfp4_dequantize(packed, scale)[0]
    expected = [4.0 * (-SPEC_E2M1[c & 7] if c & 8 else SPEC_E2M1[c & 7]) for c in codes.tolist()]
    assert got.tolist() == expected


def test_quantize_dequantize_exact_on_representable_grid():
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    idx = torch.randint(0, 8, (4, 64), generator=g)
    sign = torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0)
    w = grid[idx] * sign
    w[:, 0] = 6.0  # every group of 32 has amax 6 -> scale exactly 1
    w[:, 32] = -6.0
    scales = torch.tensor([0.25, 1.0, 8.0, 2.0 ** -10]).unsqueeze(1)
    w = w * scales
    packed, scale = mxfp4.mxfp4_quantize(w)
    assert packed.shape == (4, 32) and scale.shape == (4, 2)
    assert torch.equal(mxfp4.mxfp4_dequantize(packed, scale), w)


def test_quantize_error_bound_on_random_weights():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 256, generator=g)
    packed, scale = mxfp4.mxfp4_quantize(w)
    back = mxfp4.mxfp4_dequantize(packed, scale)
    # per group the step at the top of the range is 2 * scale (4 -> 6): error <= scale
    s = mxfp4.e8m0_to_float(scale).repeat_interleave(32, dim=1)
    assert torch.all((back - w).abs() <= s + 1e-7)
