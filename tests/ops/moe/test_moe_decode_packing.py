"""Packing of the fused MXFP4 decode kernels' weight layout, checked on CPU.

The CUDA kernels decode each packed 32-bit word with fixed rotations and masks; here the
same rotations and masks run in plain PyTorch (``decode_words_emulated``) and the inverse
index map puts every value back at (row, k). Comparing with an independent dequantization
of the original vLLM-layout tensors (e2m1 lookup table x 2**(s-127)) checks the bit
placement, the MMA fragment permutation and the scale layout exactly (tolerance 0: every
value is a power of two times a short mantissa, exact in float32).
"""

import pytest
import torch

from vllm_ling.ops.moe.decode import packing, shapes
from vllm_ling.ops.mxfp4 import E2M1_VALUES

E, H, I = 3, 128, 64  # smallest shapes with two 64-k chunks and several 16-row tiles


def _dequant(codes_u8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Independent dequantization: uint8 [E, R, K/2] (low nibble first) -> float32 [E, R, K]."""
    lut = torch.tensor(E2M1_VALUES)
    lo, hi = codes_u8 & 0xF, codes_u8 >> 4
    vals = torch.stack((lut[lo.long()], lut[hi.long()]), dim=-1).flatten(-2)
    factor = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, dim=-1)
    return vals * factor


def _random(seed: int, rows: int, k: int, scale_choices=(0, 1, 100, 127, 140, 228)):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, rows, k // 2), dtype=torch.uint8, generator=g)
    pick = torch.randint(0, len(scale_choices), (E, rows, k // 32), generator=g)
    scales = torch.tensor(scale_choices, dtype=torch.uint8)[pick]
    return codes, scales


def test_every_bit_of_a_word_is_used_once():
    flat = sorted(p for pair in packing.STORED_POS for elem in pair for p in elem)
    assert flat == list(range(32))


def test_decode_of_each_code_in_each_slot():
    # one code at a time in each of the 8 slots of a word: decode must give exactly its value
    for pair in range(4):
        for elem in range(2):
            for code in range(16):
                word = 0
                for b in range(4):
                    word |= ((code >> (3 - b)) & 1) << packing.STORED_POS[pair][elem][b]
                w = torch.tensor([word - (1 << 32) if word >= 1 << 31 else word], dtype=torch.int32)
                vals = packing.decode_words_emulated(w)[0]  # [4 pairs, 2 elems]
                expect = torch.zeros(4, 2)
                expect[pair, elem] = E2M1_VALUES[code]
                assert torch.equal(vals, expect), (pair, elem, code)


def test_gate_up_round_trip_is_exact():
    codes, scales = _random(0, 2 * I, H)
    words, packed_scales = packing.pack_gate_up(codes, scales)
    assert words.shape == (E, I // 16, H // 64, 2, 32, 4) and words.dtype == torch.int32
    assert packed_scales.shape == (E, I // 16, H // 64, 8, 8)
    expect = _dequant(codes, scales)
    gate = packing.unpack_emulated(words[:, :, :, 0], packed_scales[..., :4], I, H)
    up = packing.unpack_emulated(words[:, :, :, 1], packed_scales[..., 4:], I, H)
    assert torch.equal(gate, expect[:, :I])
    assert torch.equal(up, expect[:, I:])


def test_down_round_trip_is_exact():
    codes, scales = _random(1, H, I)
    words, packed_scales = packing.pack_down(codes, scales)
    assert words.shape == (E, H // 16, I // 64, 32, 4)
    got = packing.unpack_emulated(words, packed_scales, H, I)
    assert torch.equal(got, _dequant(codes, scales))


def test_packing_in_expert_steps_equals_one_step():
    codes, _ = _random(2, H, I)
    assert torch.equal(packing._pack_matrix(codes, experts_per_step=1),
                       packing._pack_matrix(codes, experts_per_step=64))


def test_bad_shapes_and_scales_are_refused_by_name():
    codes, scales = _random(3, 2 * I, H)
    w2, s2 = _random(4, H, I)
    with pytest.raises(ValueError, match="divisible by 64"):
        packing.check_shapes(codes[:, :, :48], scales[:, :, :3], w2[:, :96], s2[:, :96])
    with pytest.raises(ValueError, match="w2_weight must have shape"):
        packing.check_shapes(codes, scales, w2[:, :, :16], s2)
    bad = s2.clone()
    bad[0, 0, 0] = 229
    with pytest.raises(ValueError, match="w2_weight_scale has E8M0 exponent 229"):
        packing.check_shapes(codes, scales, w2, bad)


# -- humming's W4A16 layout (our reading of it; the GPU test compares with humming itself) --

def test_humming_layout_decode_is_exact():
    codes, _ = _random(5, 128, 64)
    words = packing.humming_layout_pack(codes)  # [E, K/16, 2N]
    assert words.shape == (E, 64 // 16, 2 * 128) and words.dtype == torch.int32
    lanes = words.view(E, 4, 128 // 64, 32, 4)  # [E, slab, block, lane, J]
    vals = packing.hl_decode_emulated(lanes)  # [E, S, B, 32, 4 J, 4 pair, 2 elem]
    row, k, _ = packing.humming_layout_positions()
    got = torch.zeros(E, 4, 2, 64, 16)
    got[..., row, k] = vals
    got = got.permute(0, 2, 3, 1, 4).reshape(E, 128, 64)
    lut = torch.tensor(E2M1_VALUES)
    expect = torch.stack((lut[(codes & 0xF).long()], lut[(codes >> 4).long()]), -1).flatten(-2)
    assert torch.equal(got, expect)


def test_humming_layout_scale_bytes_per_lane():
    _, scales = _random(6, 128, 64)
    hs = packing.humming_layout_scales(scales)  # [E, K/32, N]
    for blk in range(2):
        for g in range(8):
            for J in range(4):
                lo, hi = 64 * blk + 8 * g + 2 * J, 64 * blk + 8 * g + 2 * J + 1
                assert torch.equal(hs[:, :, lo], scales[:, 64 * blk + 16 * J + g, :])
                assert torch.equal(hs[:, :, hi], scales[:, 64 * blk + 16 * J + 8 + g, :])


def test_humming_launch_shapes():
    cfgs = shapes.default_humming_decode_configs(2560, 768)  # Ling: the measured fastest
    for key, down_groups in (("one", 3), ("many", 4)):
        assert cfgs[key].gate_up == shapes.StreamedGateUp(cluster=8, blocks_per_cta=4, groups_per_stage=1, stages=4)
        assert cfgs[key].down.groups_per_warp == down_groups and isinstance(cfgs[key].down, shapes.RegisterDown)
    smem = 227 * 1024
    for H, I in ((2560, 768), (256, 128), (2560 + 32, 768), (7168, 2048), (4096, 1536), (64, 64 * 7)):
        for c in shapes.default_humming_decode_configs(H, I).values():  # every size gets a shape that runs
            assert c.problems(H, I, 8, smem) == [], (H, I, c)
    bad = shapes.HummingDecodeConfig(gate_up=shapes.StreamedGateUp(blocks_per_cta=5, stages=40),
                                     down=shapes.RegisterDown(groups_per_warp=5))
    problems = " ".join(bad.problems(2560, 768, 8, smem))
    assert "blocks_per_cta 5 does not divide 12" in problems and "shared memory" in problems
    assert "groups_per_warp 5 does not divide 24" in problems
    assert "cluster * groups_per_stage does not divide 80" in " ".join(shapes.StreamedGateUp(cluster=3).problems(2560, 768, 8, smem))
    assert shapes.RegisterDown(groups_per_warp=1).problems(2560, 768 * 2, 8, smem) == ["1536 threads per CTA"]


def test_streamed_shared_memory_fits_two_ctas_per_sm_for_ling():
    """The default streamed gate_up shape leaves room for its min_blocks CTAs per H200 SM
    (228 KB, 1 KB reserved per CTA)."""
    shape = shapes.default_humming_decode_configs(2560, 768)["many"].gate_up
    assert shape.min_blocks * (shape.smem(2560, 768, 8) + 1024) <= 228 * 1024


def test_decode_batch_limit_is_checked_before_anything_loads():
    """One grid row per (token, slot): a threshold past CUDA's 65535 rows is refused up front."""
    from vllm_ling.ops.moe import humming

    w = torch.zeros(1, 128, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="decode_max_tokens 8192 x top_k 8 exceeds"):
        humming.HummingMxfp4Experts(w, w[..., :4], w, w[..., :4], top_k=8, decode_max_tokens=8192)
