"""Weight layouts of the decode kernels and their plain-PyTorch emulation (tests the
packing and our reading of humming's layout without a GPU).

- vllm-ling's own GEMV packing (:func:`pack_gate_up`, :func:`pack_down`; the ``copy`` mode):
  each lane's 16 bytes are its MMA A fragments of 16 rows x 64 k, and 8 codes decode in 9
  integer instructions (:func:`decode_words_emulated` does the same bit operations).
- humming's own transformed W4A16 layout (:func:`humming_layout_pack`,
  :func:`humming_layout_scales`: what humming's transform produces, checked bit for bit on the
  GPU; :func:`hl_decode_emulated` mirrors the kernels' decode of it).
"""

from __future__ import annotations

import torch

from vllm_ling.ops.mxfp4 import MXFP4_GROUP_SIZE as MXFP4_GROUP

CHUNK_K = 64          # k per lane-chunk (two scale groups)
TILE_ROWS = 16        # MMA M
LANES = 32
# activations are scaled by 2**X_SHIFT inside the kernels (see module docstring)
X_SHIFT = 100
# the kernels turn scale byte s into the float 2**(s - 127 + 126 - X_SHIFT), finite for s <= 228
MAX_SCALE_EXP = 254 - (126 - X_SHIFT)

# Bit positions of each (pair, element, bit) inside a packed 32-bit word. bit order is
# (sign, e1, e0, m) of the e2m1 code (code bits 3, 2, 1, 0). Target BF16 positions are
# sign 15, e1 8, e0 7, m 6 (+16 for the high element); pair p is decoded by
#   p0: q & M, p1: rotl(q, 4) & M, p2: rotl(q, 10) & M,
#   p3: (rotl(q, 14) & 0x81808180) | (rotl(q, 6) & 0x00400040),    M = 0x81C081C0
_TARGET = (15, 8, 7, 6)
_PAIR_ROT = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (14, 14, 14, 6))


def _stored_positions() -> list[list[list[int]]]:
    pos = []
    for pair in range(4):
        elems = []
        for elem in range(2):
            elems.append([(_TARGET[b] + 16 * elem - _PAIR_ROT[pair][b]) % 32 for b in range(4)])
        pos.append(elems)
    flat = [p for pair in pos for elem in pair for p in elem]
    assert sorted(flat) == list(range(32)), "packing must use every bit of the word once"
    return pos


STORED_POS = _stored_positions()


def _chunk_index_maps(device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, k) inside a 16 x 64 chunk for [lane, word, pair, elem] (the MMA A fragments).

    lane = 4g + t; word m: group m >> 1, half m & 1; pair j = A register a_j:
    row = g + 8 (j & 1), k = 32 group + 8 t + 4 half + 2 (j >> 1) + elem.
    """
    lane = torch.arange(LANES).view(LANES, 1, 1, 1)
    word = torch.arange(4).view(1, 4, 1, 1)
    pair = torch.arange(4).view(1, 1, 4, 1)
    elem = torch.arange(2).view(1, 1, 1, 2)
    g, t = lane // 4, lane % 4
    row = g + 8 * (pair & 1)
    k = 32 * (word >> 1) + 8 * t + 4 * (word & 1) + 2 * (pair >> 1) + elem
    shape = (LANES, 4, 4, 2)
    return row.expand(shape).to(device), k.expand(shape).to(device)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] (low nibble first) -> codes uint8 [..., K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, R/16, K/64, 16, 64] uint8 -> words int32 [N, R/16, K/64, 32 lanes, 4]."""
    row, k = _chunk_index_maps(codes.device)
    frag = codes[..., row, k].to(torch.int64)  # [..., 32, 4, 4, 2]
    words = torch.zeros(frag.shape[:-2], dtype=torch.int64, device=codes.device)
    for pair in range(4):
        for elem in range(2):
            c = frag[..., pair, elem]
            for b in range(4):  # code bit 3 - b is (sign, e1, e0, m)[b]
                words |= ((c >> (3 - b)) & 1) << STORED_POS[pair][elem][b]
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # u32 bits as int32
    return words.to(torch.int32)


def _pack_matrix(weight: torch.Tensor, experts_per_step: int = 16) -> torch.Tensor:
    """uint8 [E, R, K/2] -> int32 [E, R/16, K/64, 32, 4], a few experts at a time (the
    int64 temporaries of a whole Ling layer would need ~8 GB)."""
    return torch.cat([_pack_codes(_tile_codes(weight[i:i + experts_per_step]))
                      for i in range(0, weight.shape[0], experts_per_step)])


def _tile_codes(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [E, R, K/2] -> codes [E, R/16, K/64, 16, 64]."""
    E, R, half_k = weight.shape
    K = 2 * half_k
    codes = _unpack_nibbles(weight.view(torch.uint8))
    return codes.view(E, R // TILE_ROWS, TILE_ROWS, K // CHUNK_K, CHUNK_K).permute(0, 1, 3, 2, 4)


def _tile_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 uint8 [E, R, K/32] -> [E, R/16, K/64, 8 (g), 4]: per lane group g the bytes
    (row g, group 0), (row g, group 1), (row g+8, group 0), (row g+8, group 1)."""
    E, R, groups = scale.shape
    s = scale.view(torch.uint8).view(E, R // TILE_ROWS, 2, 8, groups // 2, 2)  # [E,T,hi,g,c,grp]
    return s.permute(0, 1, 4, 3, 2, 5).reshape(E, R // TILE_ROWS, groups // 2, 8, 4)


def check_shapes(w13, s13, w2, s2) -> tuple[int, int, int]:
    E, two_i, half_h = w13.shape
    H, I = 2 * half_h, two_i // 2
    if H % CHUNK_K or I % CHUNK_K:
        raise ValueError(f"fused MXFP4 decode needs hidden and intermediate sizes divisible by "
                         f"{CHUNK_K}, got hidden {H}, intermediate {I}")
    expect = {"w13_weight_scale": (s13, (E, two_i, H // MXFP4_GROUP)),
              "w2_weight": (w2, (E, H, I // 2)), "w2_weight_scale": (s2, (E, H, I // MXFP4_GROUP))}
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("w13_weight_scale", s13), ("w2_weight_scale", s2)):
        top = int(t.view(torch.uint8).max())
        if top > MAX_SCALE_EXP:
            raise ValueError(f"{name} has E8M0 exponent {top} (> {MAX_SCALE_EXP}, weights beyond "
                             f"2**{MAX_SCALE_EXP - 127}): outside the fused decode kernels' range")
    return E, H, I


def pack_gate_up(w13: torch.Tensor, s13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM w13 [E, 2I, H/2] (gate rows then up rows) + scales [E, 2I, H/32] ->
    words int32 [E, I/16, H/64, 2 (gate, up), 32, 4] and scales uint8 [E, I/16, H/64, 8, 8]
    (per lane group: 4 gate bytes then 4 up bytes)."""
    E, two_i, _ = w13.shape
    I = two_i // 2
    gate, up = _pack_matrix(w13[:, :I]), _pack_matrix(w13[:, I:])
    words = torch.stack((gate, up), dim=3).contiguous()
    scales = torch.cat((_tile_scales(s13[:, :I]), _tile_scales(s13[:, I:])), dim=-1).contiguous()
    return words, scales


def pack_down(w2: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM w2 [E, H, I/2] + scales [E, H, I/32] -> words int32 [E, H/16, I/64, 32, 4] and
    scales uint8 [E, H/16, I/64, 8, 4]."""
    return _pack_matrix(w2).contiguous(), _tile_scales(s2).contiguous()


# ---------------------------------------------------------------------------------------
# Plain-PyTorch emulation of the kernels' decode (tests the packing without a GPU)
# ---------------------------------------------------------------------------------------

def _rotl(q: torch.Tensor, r: int) -> torch.Tensor:
    return ((q << r) | (q >> (32 - r))) & 0xFFFFFFFF if r else q


def decode_words_emulated(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., 4] -> float32 [..., 4 (word), 4 (pair), 2 (elem)] with the same
    rotations and masks as the CUDA decode, times 2**126 (so: the e2m1 values)."""
    q = words.to(torch.int64) & 0xFFFFFFFF
    m = 0x81C081C0
    pairs = [q & m, _rotl(q, 4) & m, _rotl(q, 10) & m,
             (_rotl(q, 14) & 0x81808180) | (_rotl(q, 6) & 0x00400040)]
    bits = torch.stack(pairs, dim=-1)  # [..., 4 words, 4 pairs] u32 in int64
    halves = torch.stack((bits & 0xFFFF, bits >> 16), dim=-1)  # bf16 bit patterns
    as_f32 = (halves << 16).to(torch.int32).view(torch.float32)
    return as_f32.double().mul(2.0 ** 126).float()


def unpack_emulated(words: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Inverse of the packing for one matrix: words [E, R/16, K/64, 32, 4], scales
    [E, R/16, K/64, 8, 4] -> dequantized float32 [E, R, K] through the emulated decode."""
    E = words.shape[0]
    vals = decode_words_emulated(words)  # [E, T, C, 32, 4, 4, 2]
    row, kk = _chunk_index_maps(words.device)
    out = torch.zeros(E, rows // TILE_ROWS, k // CHUNK_K, TILE_ROWS, CHUNK_K, device=words.device)
    out[..., row, kk] = vals
    # scale bytes: [.., g, (g grp0, g grp1, g+8 grp0, g+8 grp1)]
    s = scales.view(torch.uint8).to(torch.int32).view(E, rows // TILE_ROWS, k // CHUNK_K, 8, 2, 2)
    s = s.permute(0, 1, 2, 4, 3, 5).reshape(E, rows // TILE_ROWS, k // CHUNK_K, TILE_ROWS, 2)
    factor = torch.pow(2.0, (s - 127).float())  # [E, T, C, 16 rows, 2 groups]
    out = out.view(E, rows // TILE_ROWS, k // CHUNK_K, TILE_ROWS, 2, MXFP4_GROUP) * factor[..., None]
    return out.permute(0, 1, 3, 2, 4, 5).reshape(E, rows, k)



# ---------------------------------------------------------------------------------------
# humming's transformed W4A16 layout (read in place by the default decode kernels)
# ---------------------------------------------------------------------------------------

def humming_layout_positions(device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For [lane, J, pair, elem] of one (k16 slab, 64-row block): (row in block, k in slab,
    nibble index in int J). Pair p of int J is MMA register a0, a2, a1, a3 for p = 0..3."""
    lane = torch.arange(LANES).view(LANES, 1, 1, 1)
    J = torch.arange(4).view(1, 4, 1, 1)
    p = torch.arange(4).view(1, 1, 4, 1)
    elem = torch.arange(2).view(1, 1, 1, 2)
    g, t = lane // 4, lane % 4
    shape = (LANES, 4, 4, 2)
    row = (16 * J + g + 8 * (p >> 1)).expand(shape)
    k = (2 * t + 8 * (p & 1) + elem).expand(shape)
    nibble = (p + 4 * elem).expand(shape)
    return row.to(device), k.to(device), nibble.to(device)


def humming_layout_pack(weight: torch.Tensor) -> torch.Tensor:
    """What humming's repack produces for W4A16 (interleave 3) from vLLM-layout codes
    uint8 [E, N, K/2]: int32 [E, K/16, 2N] (used to check our reading of the layout)."""
    E, N, half_k = weight.shape
    K = 2 * half_k
    codes = _unpack_nibbles(weight.view(torch.uint8)).to(torch.int64)
    codes = codes.view(E, N // 64, 64, K // 16, 16).permute(0, 3, 1, 2, 4)  # [E, S, B, 64, 16]
    row, k, nib = humming_layout_positions(weight.device)
    frag = codes[..., row, k]  # [E, S, B, 32, 4, 4, 2]
    words = (frag << (4 * nib)).sum(dim=(-2, -1))  # disjoint nibbles: sum == or
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.reshape(E, K // 16, 2 * N)


def humming_layout_scales(scale: torch.Tensor) -> torch.Tensor:
    """humming's E8M0 scale layout for group scales applied before the MMA: uint8
    [E, N, K/32] -> [E, K/32, N], inside each block of 64 rows position 8b + a holds row
    8a + b."""
    E, N, groups = scale.shape
    s = scale.view(torch.uint8).transpose(1, 2).reshape(E, groups, N // 64, 8, 8)
    return s.transpose(-1, -2).reshape(E, groups, N).contiguous()


def hl_decode_emulated(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., 4] (ints J) -> float32 [..., 4 (J), 4 (pair), 2 (elem)] e2m1 values, with
    the CUDA kernels' rotations and masks."""
    q = words.to(torch.int64) & 0xFFFFFFFF
    s_m, m_m = 0x80008000, 0x01C001C0
    pairs = [((q << 12) & s_m) | ((q << 6) & m_m), ((q << 8) & s_m) | ((q << 2) & m_m),
             ((q << 4) & s_m) | ((q >> 2) & m_m), (q & s_m) | ((q >> 6) & m_m)]
    bits = torch.stack(pairs, dim=-1)
    halves = torch.stack((bits & 0xFFFF, bits >> 16), dim=-1)
    return (halves << 16).to(torch.int32).view(torch.float32).double().mul(2.0 ** 126).float()


