"""MoE decode kernels: routed MXFP4 experts for small batches in two fused CUDA kernels.

Why: at 1-8 tokens a Ling MoE layer is a set of GEMVs over 8 experts per token. humming's
indexed GEMM needs five launches (routing metadata, gate_up, SwiGLU, down, top-k sum) and
spends ~30 us per layer at 1 token on 25 MB of weights (0.20 of the H200 copy bandwidth).
These kernels index the experts straight from ``topk_ids`` (no routing metadata), fuse
SwiGLU (+ the per-layer clamp) into gate_up and the weighted top-k sum into down, and let
the down kernel load its weights while gate_up finishes (programmatic dependent launch,
sm_90+). Measured in benchmarks/results/moe_decode_h200.md.

Two weight layouts, same math:

- :class:`HummingLayoutDecode` (the default, ``VLLM_LING_MOE_DECODE=auto``) reads humming's
  own transformed W4A16 tensors, so there is no second copy. In a k16 "slab" row of
  humming's weight ([E, K/16, 2N] int32) the 16 bytes of lane (g, t) for a block of 64
  output rows hold four ints, and int J is exactly the MMA A fragment of rows 16J..16J+15
  (checked bit for bit against humming's transform on the GPU). A 64-row block is the
  smallest unit a warp can read, so gate_up splits K over a cluster of CTAs that reduce in
  distributed shared memory and streams its weights through shared-memory stages filled
  by bulk copies (:class:`StreamedGateUp`); down runs one CTA per top-k slot in a cluster
  and loads its weights into registers (:class:`RegisterDown`). sm_90+.
- :class:`PackedLayoutDecode` (``VLLM_LING_MOE_DECODE=copy``) repacks the checkpoint's
  codes once into a layout made for GEMV (:func:`pack_gate_up`, :func:`pack_down`: each
  lane's 16 bytes are its fragments of 16 rows x 64 k, and 8 codes decode in 9 integer
  instructions). Faster, but humming still needs its copy for larger batches: twice the
  routed-expert memory.

Math (``mma.m16n8k16`` BF16 -> FP32, weights as A, the token as B column 0): an MXFP4 code
becomes a BF16 bit pattern worth ``v * 2**-126`` by moving its sign to bit 15 and its
exponent/mantissa bits to bits 8..6 (codes +-0.5 become BF16 subnormals, which the tensor
cores keep: a GPU test uses only those codes); activations are multiplied by 2**100 (exact)
so products stay normal FP32 numbers; each group's E8M0 scale ``2**(s-127)`` times the
``2**(126-100)`` correction is applied once per row and 32-k group to the FP32 result.
Numerics: FP32 accumulation, SwiGLU output rounded to BF16 (as vLLM's intermediate cache),
routed sum in FP32, output BF16. E8M0 exponents up to 228 are exact.

The kernels are CUDA C++ compiled by humming-kernels' JIT runtime (NVRTC, humming's cache
directory and file locks; :class:`humming.jit.runtime.KernelRuntime` is subclassed, no
humming code is copied). No vLLM import. Limits: BF16 activations, hidden and intermediate
multiples of 64, top_k <= 8 (cluster size), int32 top-k ids (others are converted).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from typing import ClassVar

import torch

from vllm_ling.log import get_logger
from vllm_ling.ops.moe import _CLAMP_MODES, CLAMP_GATE_OUTPUT, _effective_limit

logger = get_logger("ops.moe_decode")

MXFP4_GROUP = 32
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


def _check_shapes(w13, s13, w2, s2) -> tuple[int, int, int]:
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
# CUDA kernels
# ---------------------------------------------------------------------------------------

_HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void decode_word(u32 q, u32 (&a)[4]) {
  const u32 M = 0x81C081C0u;
  a[0] = q & M;
  a[1] = __funnelshift_l(q, q, 4) & M;
  a[2] = __funnelshift_l(q, q, 10) & M;
  a[3] = (__funnelshift_l(q, q, 14) & 0x81808180u) | (__funnelshift_l(q, q, 6) & 0x00400040u);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                         float c0, float c1, float c2, float c3) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
        "f"(c0), "f"(c1), "f"(c2), "f"(c3));
}

// x * 2**100 on a BF16 pair (exact): products stay normal FP32 inside the MMA
__device__ __forceinline__ u32 scale_up(u32 v) {
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x71807180u), "r"(0x80008000u));
  return r;
}

// E8M0 byte s -> 2**(s-127) * 2**(126-100)
__device__ __forceinline__ float group_factor(u32 s) {
  return __int_as_float((int)((s + 26u) << 23));
}

// byte j of w as that factor: one byte permute (ALU) and one IMAD
__device__ __forceinline__ float byte_factor(u32 w, int j) {
  return __int_as_float((int)(__byte_perm(w, 0u, 0x4440u + j) * (1u << 23) + (26u << 23)));
}

// vLLM's routed-expert SwiGLU with the per-layer clamp: CLAMP_GATE_OUTPUT 0 clamps the gate
// input (silu(min(g, L)) * clamp(u)), 1 clamps the gate output (min(silu(g), L) * clamp(u))
__device__ __forceinline__ float swiglu(float g, float u, float limit, int has_limit) {
  if (has_limit) {
    u = fminf(fmaxf(u, -limit), limit);
    if (!CLAMP_GATE_OUTPUT) g = fminf(g, limit);
  }
  float y = g / (1.f + expf(-g));
  if (has_limit && CLAMP_GATE_OUTPUT) y = fminf(y, limit);
  return y * u;
}

__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

"""

# Kernels on vllm-ling's own packed layout (pack_gate_up / pack_down).
_OWN_LAYOUT_KERNELS = r"""
#define CH_A (H_ / 64)
#define CH_B (I_ / 64)
#define CPW_A ((CH_A + KS_A - 1) / KS_A)
#define CPW_B ((CH_B + KS_B - 1) / KS_B)
#define TILES_A (I_ / 16)
#define TILES_B (H_ / 16)
// B fragments of one 64-k chunk: lanes g == 0 (column 0) hold 8 contiguous activations per
// scale group, the other columns are zero.
__device__ __forceinline__ void load_x(const uint4* __restrict__ row, int c, int g, int t,
                                       u32 (&xb)[8]) {
  uint4 v0 = make_uint4(0u, 0u, 0u, 0u), v1 = v0;
  if (g == 0) {
    v0 = row[8 * c + t];
    v1 = row[8 * c + 4 + t];
  }
  xb[0] = scale_up(v0.x); xb[1] = scale_up(v0.y); xb[2] = scale_up(v0.z); xb[3] = scale_up(v0.w);
  xb[4] = scale_up(v1.x); xb[5] = scale_up(v1.y); xb[6] = scale_up(v1.z); xb[7] = scale_up(v1.w);
}

// one lane's 16 bytes of a 16 x 64 chunk times the activation column; adds the two scale
// groups' results of rows g (acc_lo) and g + 8 (acc_hi) (meaningful on lanes t == 0)
__device__ __forceinline__ void chunk_mma(const uint4 w, const u32 (&xb)[8], u32 s4,
                                          float& acc_lo, float& acc_hi) {
  u32 a[4][4];
  decode_word(w.x, a[0]);
  decode_word(w.y, a[1]);
  decode_word(w.z, a[2]);
  decode_word(w.w, a[3]);
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
    float d[4];
    mma_bf16(d, a[2 * grp], xb[4 * grp], xb[4 * grp + 1], 0.f, 0.f, 0.f, 0.f);
    mma_bf16(d, a[2 * grp + 1], xb[4 * grp + 2], xb[4 * grp + 3], d[0], d[1], d[2], d[3]);
    acc_lo = fmaf(group_factor((s4 >> (8 * grp)) & 0xFFu), d[0], acc_lo);
    acc_hi = fmaf(group_factor((s4 >> (8 * (grp + 2))) & 0xFFu), d[2], acc_hi);
  }
}

// grid (I/16 row tiles, T * TOPK assignments), KS_A warps: warp w owns chunks
// [w * CPW_A, (w+1) * CPW_A) of the gate and up rows of its tile.
extern "C" __global__ void __launch_bounds__(KS_A * 32, MINB_A)
ling_moe_decode_gate_up(const uint4* __restrict__ w13, const u64* __restrict__ s13,
                        const u16* __restrict__ x, const int* __restrict__ topk_ids,
                        u16* __restrict__ act, float limit, int has_limit) {
  const int tile = blockIdx.x, a = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long e = topk_ids[a];
  const long long tile_base = (e * TILES_A + tile) * CH_A;
  uint4 wg[CPW_A], wu[CPW_A];
  u64 sc[CPW_A];
#pragma unroll
  for (int i = 0; i < CPW_A; ++i) {
    const int c = warp * CPW_A + i;
    if (c < CH_A) {
      const uint4* p = w13 + (tile_base + c) * 64 + lane;
      wg[i] = ld_stream(p);
      wu[i] = ld_stream(p + 32);
      sc[i] = s13[(tile_base + c) * 8 + g];
    }
  }
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)(a / TOPK) * H_);
  float g_lo = 0.f, g_hi = 0.f, u_lo = 0.f, u_hi = 0.f;
#pragma unroll
  for (int i = 0; i < CPW_A; ++i) {
    const int c = warp * CPW_A + i;
    if (c < CH_A) {
      u32 xb[8];
      load_x(xr, c, g, t, xb);
      chunk_mma(wg[i], xb, (u32)sc[i], g_lo, g_hi);
      chunk_mma(wu[i], xb, (u32)(sc[i] >> 32), u_lo, u_hi);
    }
  }
  __shared__ float red[KS_A][2][16];
  if (t == 0) {
    red[warp][0][g] = g_lo; red[warp][0][g + 8] = g_hi;
    red[warp][1][g] = u_lo; red[warp][1][g + 8] = u_hi;
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int w = 0; w < KS_A; ++w) { gs += red[w][0][threadIdx.x]; us += red[w][1][threadIdx.x]; }
    const float y = swiglu(gs, us, limit, has_limit);
    act[(long long)a * I_ + tile * 16 + threadIdx.x] = to_bf16(y);
  }
}

// grid (H/16 row tiles, T tokens), TOPK * KS_B warps: warp = (slot, K slice)
extern "C" __global__ void __launch_bounds__(TOPK * KS_B * 32, MINB_B)
ling_moe_decode_down(const uint4* __restrict__ w2, const u32* __restrict__ s2,
                     const u16* __restrict__ act, const int* __restrict__ topk_ids,
                     const float* __restrict__ topk_w, u16* __restrict__ out) {
  const int tile = blockIdx.x, tok = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int slot = warp / KS_B, ks = warp % KS_B;
  const int a = tok * TOPK + slot;
  const long long e = topk_ids[a];
  const long long tile_base = (e * TILES_B + tile) * CH_B;
  uint4 w[CPW_B];
  u32 sc[CPW_B];
#pragma unroll
  for (int i = 0; i < CPW_B; ++i) {
    const int c = ks * CPW_B + i;
    if (c < CH_B) {
      w[i] = ld_stream(w2 + (tile_base + c) * 32 + lane);
      sc[i] = s2[(tile_base + c) * 8 + g];
    }
  }
#if __CUDA_ARCH__ >= 900
  // the weights above depend only on topk_ids (written before the gate_up kernel started);
  // the activations below are the gate_up kernel's output
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const uint4* ar = reinterpret_cast<const uint4*>(act + (long long)a * I_);
  float lo = 0.f, hi = 0.f;
#pragma unroll
  for (int i = 0; i < CPW_B; ++i) {
    const int c = ks * CPW_B + i;
    if (c < CH_B) {
      u32 xb[8];
      load_x(ar, c, g, t, xb);
      chunk_mma(w[i], xb, sc[i], lo, hi);
    }
  }
  __shared__ float red[TOPK * KS_B][16];
  if (t == 0) { red[warp][g] = lo; red[warp][g + 8] = hi; }
  __syncthreads();
  if (threadIdx.x < 16) {
    float s = 0.f;
#pragma unroll
    for (int sl = 0; sl < TOPK; ++sl) {
      float p = 0.f;
#pragma unroll
      for (int k = 0; k < KS_B; ++k) p += red[sl * KS_B + k][threadIdx.x];
      s = fmaf(topk_w[tok * TOPK + sl], p, s);
    }
    out[(long long)tok * H_ + tile * 16 + threadIdx.x] = to_bf16(s);
  }
}
"""

# Kernels on humming's own transformed layout (HummingMxfp4Experts.tensors, W4A16 on sm_80..90:
# repacked nibbles, interleave mode 3, E8M0 scales transposed to [E, K/32, N] and permuted inside
# each block of 64 output rows). In one k16 "slab" row of the weight ([E, K/16, 2N] int32), the
# 16 bytes of lane (g, t) for a block of 64 output rows hold four ints; int J is exactly the MMA
# A fragment of rows 16J..16J+15 (nibble pairs (0,4), (1,5), (2,6), (3,7) = a0, a2, a1, a3).
# Scales of rows 16J+g / 16J+8+g of a block are the bytes 8g + 2J / 8g + 2J + 1.
# A warp's unit of work is one 64-row block x some scale groups (hl_group_mma per group).
_HUMMING_LAYOUT_HELPERS = r"""
__device__ __forceinline__ void hl_decode(u32 q, u32 (&a)[4]) {
  // nibble pair (p, p + 4) -> BF16x2 worth v * 2**-126 (sign to 15/31, e1 e0 m to 8..6 / 24..22).
  // Plain shifts (no wrap is needed): the left shifts can go to the FMA pipe (IMAD.SHL), which
  // leaves the ALU pipe two LOP3 per pair.
  const u32 S = 0x80008000u, M = 0x01C001C0u;
  a[0] = ((q << 12) & S) | ((q << 6) & M);
  a[2] = ((q << 8) & S) | ((q << 2) & M);
  a[1] = ((q << 4) & S) | (__umulhi(q, 1u << 30) & M);  // q >> 2 on the FMA pipe
  a[3] = (q & S) | (__umulhi(q, 1u << 26) & M);          // q >> 6
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// store v into float slot `idx` of `arr` in the shared memory of the cluster's CTA `rank`
__device__ __forceinline__ void st_rank(float* arr, int idx, u32 rank, float v) {
  u32 local = smem_u32(arr + idx), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}

// B fragments of slabs 2G and 2G+1 (k = 32G .. 32G+31): lanes g == 0 only
__device__ __forceinline__ void hl_load_x(const u32* __restrict__ row, int G, int g, int t,
                                          u32 (&xb)[4]) {
  u32 v0 = 0u, v1 = 0u, v2 = 0u, v3 = 0u;
  if (g == 0) {
    v0 = row[16 * G + t]; v1 = row[16 * G + 4 + t];
    v2 = row[16 * G + 8 + t]; v3 = row[16 * G + 12 + t];
  }
  xb[0] = scale_up(v0); xb[1] = scale_up(v1); xb[2] = scale_up(v2); xb[3] = scale_up(v3);
}

// acc[J][0 | 1] (rows 16J+g | 16J+8+g of the block) += scale * (W[rows, group] . x[group])
__device__ __forceinline__ void hl_group_mma(const uint4 w0, const uint4 w1, const u32 (&xb)[4],
                                             u64 sc, float (&acc)[4][2]) {
  const u32 q0[4] = {w0.x, w0.y, w0.z, w0.w};
  const u32 q1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
  for (int J = 0; J < 4; ++J) {
    u32 a[4];
    float d[4];
    hl_decode(q0[J], a);
    mma_bf16(d, a, xb[0], xb[1], 0.f, 0.f, 0.f, 0.f);
    hl_decode(q1[J], a);
    mma_bf16(d, a, xb[2], xb[3], d[0], d[1], d[2], d[3]);
    const u32 half = J < 2 ? (u32)sc : (u32)(sc >> 32);
    acc[J][0] = fmaf(byte_factor(half, 2 * (J & 1)), d[0], acc[J][0]);
    acc[J][1] = fmaf(byte_factor(half, 2 * (J & 1) + 1), d[2], acc[J][1]);
  }
}

"""

_HL_DOWN_KERNEL = r"""
// down + weighted top-k sum, weights loaded straight into registers (a warp: one 64-row block x
// GPW_B groups, the loads of all its groups in flight at once). grid (TOPK * H/64, T), cluster
// (TOPK, 1, 1): CTA rank = top-k slot; WPB warps split K; slots reduce into rank 0 through
// distributed shared memory.
extern "C" __global__ void __launch_bounds__(WPB * 32, MINB_B)
ling_moe_hl_down(const uint4* __restrict__ w2, const u64* __restrict__ s2,
                 const u16* __restrict__ act, const int* __restrict__ topk_ids,
                 const float* __restrict__ topk_w, u16* __restrict__ out) {
  const int slot = (int)cluster_rank();
  const int blk = blockIdx.x / TOPK, tok = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int a = tok * TOPK + slot;
  const int G0 = warp * GPW_B;
  const long long e = topk_ids[a];
  uint4 w[GPW_B][2];
  u64 sc[GPW_B];
#pragma unroll
  for (int i = 0; i < GPW_B; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      w[i][h] = ld_stream(w2 + (e * (I_ / 16) + 2 * (G0 + i) + h) * (H_ / 2) + 32 * blk + lane);
    sc[i] = s2[((e * (I_ / 32) + G0 + i) * H_ + 64 * blk + 8 * g) / 8];
  }
#if __CUDA_ARCH__ >= 900
  // the weights above depend only on topk_ids (written before the gate_up kernel started);
  // the activations below are the gate_up kernel's output
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const u32* ar = reinterpret_cast<const u32*>(act + (long long)a * I_);
  float acc[4][2] = {{0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
  for (int i = 0; i < GPW_B; ++i) {
    u32 xb[4];
    hl_load_x(ar, G0 + i, g, t, xb);
    hl_group_mma(w[i][0], w[i][1], xb, sc[i], acc);
  }
  __shared__ float red[WPB][64];
  __shared__ float cl_red[TOPK][64];
  if (t == 0) {
#pragma unroll
    for (int J = 0; J < 4; ++J) {
      red[warp][16 * J + g] = acc[J][0];
      red[warp][16 * J + 8 + g] = acc[J][1];
    }
  }
  __syncthreads();
  const float slot_weight = topk_w[a];
  for (int f = threadIdx.x; f < 64; f += blockDim.x) {  // CTAs may have < 64 threads
    float p = 0.f;
#pragma unroll
    for (int k = 0; k < WPB; ++k) p += red[k][f];
    st_rank(&cl_red[0][0], slot * 64 + f, 0, p * slot_weight);
  }
  cluster_sync();
  if (slot == 0) {
    for (int f = threadIdx.x; f < 64; f += blockDim.x) {
      float s = 0.f;
#pragma unroll
      for (int r = 0; r < TOPK; ++r) s += cl_red[r][f];
      out[(long long)tok * H_ + 64 * blk + f] = to_bf16(s);
    }
  }
}
"""


# gate_up on humming's layout with its weights streamed through shared memory: a producer warp
# copies pieces of slab rows (cp.async.bulk, one instruction per piece, completion counted on an
# mbarrier; sm_90+) into a ring of ST_S stages while consumer warps decode from shared memory, so
# a CTA keeps ST_S stages in flight while it computes (loading every weight of a warp into
# registers up front, as the down kernel does, measured 3-4 us slower at 4 tokens and 13 us at
# 16). Consumer warp (b, kw): gate and up rows of block b, group kw of every stage. Partial
# sums go straight to the cluster rank that owns their rows (distributed shared memory).
_STREAM_HELPERS = r"""
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}

// global -> this CTA's shared memory, completion counted in bytes on `bar`
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;" :: "r"(threads) : "memory");
}

#define ALIGN128(n) (((n) + 127) / 128 * 128)
"""

_HS_GATE_UP_KERNEL = r"""
// gate_up: grid (CL_S * I/64/BPC_S, T * TOPK), cluster (CL_S, 1, 1); rank = K part, a CTA
// owns BPC_S consecutive 64-row blocks of the gate and of the up rows
#define NB_S (I_ / 64)
#define CONS_S (BPC_S * GPS_S)
#define GPC_S (H_ / 32 / CL_S)
#define NS_S (GPC_S / GPS_S)
#define SLAB_S (N1 * 8)
#define PIECE_S (BPC_S * 512)
#define STW_S (GPS_S * 4 * PIECE_S)
#define STS_S (GPS_S * 2 * BPC_S * 64)
#define STAGE_S ALIGN128(STW_S + STS_S)
#define ROWS_S (BPC_S * 64)
#define RPR_S ((ROWS_S + CL_S - 1) / CL_S)
#define RED_S ALIGN128(CL_S * GPS_S * 2 * RPR_S * 4)
#define XS_S ALIGN128(GPC_S * 64)

extern "C" __global__ void __launch_bounds__(32 * (CONS_S + 1), MINB_S)
ling_moe_hs_gate_up(const unsigned char* __restrict__ w13, const unsigned char* __restrict__ s13,
                    const u32* __restrict__ x, const int* __restrict__ topk_ids,
                    u16* __restrict__ act, float limit, int has_limit) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  float* red = reinterpret_cast<float*>(smem + ST_S * STAGE_S);
  u32* xs = reinterpret_cast<u32*>(smem + ST_S * STAGE_S + RED_S);
  u64* full = reinterpret_cast<u64*>(smem + ST_S * STAGE_S + RED_S + XS_S);
  u64* empty = full + ST_S;
  const u32 rank = cluster_rank();
  const int b0 = (blockIdx.x / CL_S) * BPC_S, a = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long e = topk_ids[a];
  const int G0 = (int)rank * GPC_S;
  if (threadIdx.x == 0) {
    for (int s = 0; s < ST_S; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CONS_S); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // every CTA of the cluster must run before others write into its shared memory
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  __syncthreads();
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  if (warp == CONS_S) {
    if (lane == 0) {
      for (int i = 0; i < NS_S; ++i) {
        const int s = i % ST_S;
        if (i >= ST_S) mbar_wait(&empty[s], ((i / ST_S) - 1) & 1);
        unsigned char* st = ring + s * STAGE_S;
        mbar_expect_tx(&full[s], STW_S + STS_S);
#pragma unroll
        for (int q = 0; q < GPS_S; ++q) {
          const long long G = G0 + i * GPS_S + q;
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int m = 0; m < 2; ++m)  // gate rows, up rows
              bulk_load(st + ((4 * q + 2 * h + m) * PIECE_S),
                        w13 + (e * (H_ / 16) + 2 * G + h) * SLAB_S + (m * NB_S + b0) * 512, PIECE_S, &full[s]);
#pragma unroll
          for (int m = 0; m < 2; ++m)
            bulk_load(st + STW_S + (2 * q + m) * BPC_S * 64, s13 + (e * (H_ / 32) + G) * N1 + 64 * (m * NB_S + b0),
                      BPC_S * 64, &full[s]);
        }
      }
    }
    __syncwarp();
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  } else {
    // consumer warp: gate and up rows of block b, group kw of each stage
    const int b = warp % BPC_S, kw = warp / BPC_S;
    const u32* xr = x + (long long)(a / TOPK) * (H_ / 2) + G0 * 16;
    for (int i = threadIdx.x; i < GPC_S * 16; i += CONS_S * 32) xs[i] = xr[i];
    consumers_sync(CONS_S * 32);
    float ag[4][2] = {}, au[4][2] = {};
#pragma unroll 1
    for (int i = 0; i < NS_S; ++i) {
      const int s = i % ST_S;
      mbar_wait(&full[s], (i / ST_S) & 1);
      // stage layout: weights [group][slab 0: gate, up][slab 1: gate, up], scales [group][gate, up]
      const uint4* wv = reinterpret_cast<const uint4*>(ring + s * STAGE_S + kw * 4 * PIECE_S) + 32 * b + lane;
      const uint4 g0 = wv[0], u0 = wv[PIECE_S / 16], g1 = wv[2 * PIECE_S / 16], u1 = wv[3 * PIECE_S / 16];
      const unsigned char* sv = ring + s * STAGE_S + STW_S + kw * 2 * BPC_S * 64 + 64 * b + 8 * g;
      const u64 sg = *reinterpret_cast<const u64*>(sv);
      const u64 su = *reinterpret_cast<const u64*>(sv + BPC_S * 64);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
      u32 xb[4];
      hl_load_x(xs, i * GPS_S + kw, g, t, xb);
      hl_group_mma(g0, g1, xb, sg, ag);
      hl_group_mma(u0, u1, xb, su, au);
    }
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    if (t == 0) {  // partial sums to the rank that owns their rows
      const int part = (int)rank * GPS_S + kw;
#pragma unroll
      for (int J = 0; J < 4; ++J) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = 64 * b + 16 * J + 8 * hh + g;
          const u32 owner = row / RPR_S;
          st_rank(red, (part * 2) * RPR_S + row % RPR_S, owner, ag[J][hh]);
          st_rank(red, (part * 2 + 1) * RPR_S + row % RPR_S, owner, au[J][hh]);
        }
      }
    }
  }
  cluster_sync();
  for (int f = threadIdx.x; f < RPR_S; f += blockDim.x) {
    const int row = (int)rank * RPR_S + f;
    if (row < ROWS_S) {
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int p = 0; p < CL_S * GPS_S; ++p) { gs += red[(2 * p) * RPR_S + f]; us += red[(2 * p + 1) * RPR_S + f]; }
      act[(long long)a * I_ + 64 * b0 + row] = to_bf16(swiglu(gs, us, limit, has_limit));
    }
  }
}

"""



def _defines(**values: int) -> str:
    return "".join(f"#define {k} {int(v)}\n" for k, v in values.items())


_ARGS_GATE_UP = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                 ctypes.c_void_p, ctypes.c_float, ctypes.c_int)
_ARGS_DOWN = (ctypes.c_void_p,) * 6
_KERNEL_NAMES = ("ling_moe_decode_gate_up", "ling_moe_decode_down", "ling_moe_hs_gate_up", "ling_moe_hl_down")
_KERNEL_CLASSES: dict[str, type] = {}


def _kernel(name: str, source: str, device: torch.device):
    """A compiled kernel of ``source`` (cached per source by humming's KernelRuntime)."""
    if not _KERNEL_CLASSES:
        from humming.jit.runtime import KernelRuntime

        @dataclasses.dataclass(kw_only=True)
        class _LingDecodeKernel(KernelRuntime):
            disable_fast_math: ClassVar[bool] = True
            source: str

            def init_kernel(self):
                self.code = self.source
                self.kernel_expr = None
                self.prepare()

        for kname in _KERNEL_NAMES:
            _KERNEL_CLASSES[kname] = dataclasses.make_dataclass(
                kname, [], bases=(_LingDecodeKernel,), kw_only=True,
                namespace={"name": kname})
    with torch.cuda.device(device):
        return _KERNEL_CLASSES[name](source=source)


_DYNAMIC_SMEM_SET: dict[int, int] = {}  # CUfunction handle -> dynamic shared memory allowed


def _allow_dynamic_smem(func, nbytes: int) -> None:
    import cuda.bindings.driver as cbd

    key = int(func)
    if _DYNAMIC_SMEM_SET.get(key, 48 * 1024) >= nbytes:
        return
    (err,) = cbd.cuFuncSetAttribute(
        func, cbd.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    if err != cbd.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot allow {nbytes} bytes of dynamic shared memory: {err}")
    _DYNAMIC_SMEM_SET[key] = nbytes


def _launch(kernel, grid: tuple[int, int], threads: int, args, arg_types, stream: int,
            cluster: int = 1, pdl: bool = False, smem: int = 0) -> None:
    import cuda.bindings.driver as cbd

    func = kernel.load_cubin()
    if smem:
        _allow_dynamic_smem(func, smem)
    cfg = cbd.CUlaunchConfig()
    cfg.sharedMemBytes = smem
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid[0], grid[1], 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.hStream = stream
    attrs = []
    if cluster > 1:
        attr = cbd.CUlaunchAttribute()
        attr.id = cbd.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        attrs.append(attr)
    if pdl:
        attr = cbd.CUlaunchAttribute()
        attr.id = cbd.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    cfg.attrs, cfg.numAttrs = attrs, len(attrs)
    (err,) = cbd.cuLaunchKernelEx(cfg, func, (args, arg_types), 0)
    if err != cbd.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{kernel.name} launch failed: {err}")


def _clamp_flag(clamp: str) -> int:
    if clamp not in _CLAMP_MODES:
        raise ValueError(f"clamp must be one of {_CLAMP_MODES}, got {clamp!r}")
    return int(clamp == CLAMP_GATE_OUTPUT)


def _limit(swiglu_limit: float | None) -> tuple[float, int]:
    limit = _effective_limit(swiglu_limit)
    return (0.0, 0) if limit is None else (float(limit), 1)


class _TwoKernelDecode:
    """Shared forward of both decode variants: gate_up (+SwiGLU) then down (+top-k sum)."""

    hidden_size: int
    intermediate_size: int
    top_k: int

    def _check(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        H, K = self.hidden_size, self.top_k
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"hidden states must be bfloat16 [T, {H}], got {x.dtype} {tuple(x.shape)}")
        if tuple(topk_ids.shape) != (x.shape[0], K):
            raise ValueError(f"topk_ids must be [{x.shape[0]}, {K}], got {tuple(topk_ids.shape)}")

    def gate_up(self, x: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        """SwiGLU(x @ w13[e].T) per assignment: BF16 [T * top_k, I] (row = token * k + slot)."""
        self._check(x, topk_ids)
        x = x.contiguous()
        if x.data_ptr() % 16:
            x = x.clone()
        ids = topk_ids.to(torch.int32).contiguous()
        act = torch.empty(x.shape[0] * self.top_k, self.intermediate_size, dtype=torch.bfloat16,
                          device=x.device)
        if x.shape[0]:
            self._launch_gate_up(x, ids, act, *_limit(swiglu_limit),
                                 torch.cuda.current_stream(x.device).cuda_stream)
        return act

    def down(self, act: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """sum over slots of topk_weights * (act @ w2[e].T): BF16 [T, H]."""
        ids = topk_ids.to(torch.int32).contiguous()
        w = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(ids.shape[0], self.hidden_size, dtype=torch.bfloat16, device=act.device)
        if ids.shape[0]:
            self._launch_down(act, w, ids, out, torch.cuda.current_stream(act.device).cuda_stream)
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        ids = topk_ids.to(torch.int32).contiguous()
        return self.down(self.gate_up(x, ids, swiglu_limit), topk_weights, ids)

    __call__ = forward


# ---------------------------------------------------------------------------------------
# Variant 1: vllm-ling's own packed copy of the weights
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PackedDecodeConfig:
    """Launch shape of the packed-layout kernels (benchmark levers)."""

    k_split_gate_up: int = 8   # warps per gate_up CTA, each owns H/64/k_split chunks
    k_split_down: int = 1      # warps per slot in a down CTA
    min_blocks_gate_up: int = 3
    min_blocks_down: int = 2
    use_pdl: bool = True


class PackedLayoutDecode(_TwoKernelDecode):
    """Routed MXFP4 experts for decode-sized batches on a packed copy of the weights made for
    GEMV (:func:`pack_gate_up` / :func:`pack_down`: each lane's 16 bytes are its MMA
    fragments of 16 rows x 64 k; 8 codes decode in 9 integer instructions).

    The copy is as large as the checkpoint's expert weights; humming keeps its own copy for
    larger batches, so this doubles the routed-expert memory (the ``copy`` decode mode).
    Inputs are vLLM-layout tensors (uint8 codes [E, 2I, H/2] / [E, H, I/2], E8M0 scales).
    """

    def __init__(self, w13_weight: torch.Tensor, w13_weight_scale: torch.Tensor,
                 w2_weight: torch.Tensor, w2_weight_scale: torch.Tensor, *, top_k: int,
                 clamp: str = "gate_input", config: PackedDecodeConfig | None = None):
        if w13_weight.device.type != "cuda":
            raise ValueError(f"expert weights must be on a CUDA device, got {w13_weight.device}")
        E, H, I = _check_shapes(w13_weight, w13_weight_scale, w2_weight, w2_weight_scale)
        self.num_experts, self.hidden_size, self.intermediate_size, self.top_k = E, H, I, top_k
        self.device, self.clamp = w13_weight.device, clamp
        self.w13, self.s13 = pack_gate_up(w13_weight, w13_weight_scale)
        self.w2, self.s2 = pack_down(w2_weight, w2_weight_scale)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))
        self._build(config or PackedDecodeConfig())

    def _build(self, config: PackedDecodeConfig) -> None:
        self.config = config
        self.use_pdl = config.use_pdl and torch.cuda.get_device_capability(self.device)[0] >= 9
        src = (_defines(H_=self.hidden_size, I_=self.intermediate_size, TOPK=self.top_k,
                        KS_A=config.k_split_gate_up, KS_B=config.k_split_down,
                        MINB_A=config.min_blocks_gate_up, MINB_B=config.min_blocks_down,
                        CLAMP_GATE_OUTPUT=_clamp_flag(self.clamp))
               + _HELPERS + _OWN_LAYOUT_KERNELS)
        self._gate_up = _kernel("ling_moe_decode_gate_up", src, self.device)
        self._down = _kernel("ling_moe_decode_down", src, self.device)

    def with_config(self, config: PackedDecodeConfig) -> "PackedLayoutDecode":
        """The same packed weights with other launch shapes (benchmark levers)."""
        other = object.__new__(PackedLayoutDecode)
        other.__dict__.update(self.__dict__)
        other._build(config)
        return other

    def _launch_gate_up(self, x, ids, act, limit, has_limit, stream):
        c = self.config
        _launch(self._gate_up, (self.intermediate_size // TILE_ROWS, ids.numel()), c.k_split_gate_up * 32,
                (self.w13.data_ptr(), self.s13.data_ptr(), x.data_ptr(), ids.data_ptr(),
                 act.data_ptr(), limit, has_limit), _ARGS_GATE_UP, stream)

    def _launch_down(self, act, w, ids, out, stream):
        _launch(self._down, (self.hidden_size // TILE_ROWS, ids.shape[0]),
                self.top_k * self.config.k_split_down * 32,
                (self.w2.data_ptr(), self.s2.data_ptr(), act.data_ptr(), ids.data_ptr(),
                 w.data_ptr(), out.data_ptr()), _ARGS_DOWN, stream, pdl=self.use_pdl)


# ---------------------------------------------------------------------------------------
# Variant 2 (default): humming's own transformed weights, no copy
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


def _align128(n: int) -> int:
    return (n + 127) // 128 * 128


class _KernelShape:
    """Launch shape of one decode kernel on humming's layout; subclasses say how to build
    and launch it. ``problems`` lists why a shape cannot run given sizes (empty: it can)."""

    kernel_name: ClassVar[str]
    kernel_source: ClassVar[str]  # helpers beyond _HELPERS + _HUMMING_LAYOUT_HELPERS, then the kernel

    def source(self, hidden: int, intermediate: int, top_k: int, clamp_flag: int) -> str:
        return (_defines(H_=hidden, I_=intermediate, TOPK=top_k, N1=2 * intermediate,
                         CLAMP_GATE_OUTPUT=clamp_flag, **self._defines(hidden, intermediate))
                + _HELPERS + _HUMMING_LAYOUT_HELPERS + self.kernel_source)

    def smem(self, hidden: int, intermediate: int, top_k: int) -> int:
        return 0

    def _defines(self, hidden: int, intermediate: int) -> dict[str, int]:
        raise NotImplementedError

    def problems(self, hidden: int, intermediate: int, top_k: int, smem_limit: int) -> list[str]:
        out = []
        threads, smem = self.threads(hidden, intermediate), self.smem(hidden, intermediate, top_k)
        if threads > 1024:
            out.append(f"{threads} threads per CTA")
        if smem > smem_limit:
            out.append(f"{smem} bytes of shared memory per CTA (> {smem_limit})")
        return out


@dataclasses.dataclass(frozen=True)
class StreamedGateUp(_KernelShape):
    """gate_up + SwiGLU, weights streamed through ``stages`` shared-memory stages by a producer
    warp (bulk copies): a CTA owns ``blocks_per_cta`` 64-row blocks of the gate and of the up
    rows (one consumer warp per block and group of a stage), a cluster of ``cluster`` CTAs
    splits K. ``blocks_per_cta`` divides intermediate / 64, ``cluster * groups_per_stage``
    divides hidden / 32."""

    kernel_name: ClassVar[str] = "ling_moe_hs_gate_up"
    kernel_source: ClassVar[str] = _STREAM_HELPERS + _HS_GATE_UP_KERNEL
    cluster: int = 8
    blocks_per_cta: int = 4
    groups_per_stage: int = 1
    stages: int = 4
    min_blocks: int = 4

    def _defines(self, hidden, intermediate):
        return dict(CL_S=self.cluster, BPC_S=self.blocks_per_cta, GPS_S=self.groups_per_stage,
                    ST_S=self.stages, MINB_S=self.min_blocks)

    def threads(self, hidden, intermediate):
        return 32 * (self.blocks_per_cta * self.groups_per_stage + 1)

    def grid_x(self, hidden, intermediate, top_k):
        return self.cluster * (intermediate // 64 // self.blocks_per_cta)

    def cluster_size(self, top_k):
        return self.cluster

    def smem(self, hidden, intermediate, top_k):
        # the kernel's layout: ST_S stages of STAGE_S, RED_S, XS_S, then 2 x ST_S mbarriers
        bpc, gps, cl = self.blocks_per_cta, self.groups_per_stage, self.cluster
        stage = _align128(gps * 4 * bpc * 512 + gps * 2 * bpc * 64)
        red = _align128(cl * gps * 2 * -(-bpc * 64 // cl) * 4)
        return self.stages * stage + red + _align128(hidden // 32 // cl * 64) + 16 * self.stages

    def problems(self, hidden, intermediate, top_k, smem_limit):
        out = super().problems(hidden, intermediate, top_k, smem_limit)
        if (intermediate // 64) % self.blocks_per_cta:
            out.append(f"blocks_per_cta {self.blocks_per_cta} does not divide {intermediate // 64} blocks")
        if (hidden // 32) % (self.cluster * self.groups_per_stage):
            out.append(f"cluster * groups_per_stage does not divide {hidden // 32} groups")
        return out


@dataclasses.dataclass(frozen=True)
class RegisterDown(_KernelShape):
    """down + weighted top-k sum, weights straight into registers: one CTA per top-k slot in a
    cluster, a warp reads one 64-row block x ``groups_per_warp`` groups (divides
    intermediate / 32)."""

    kernel_name: ClassVar[str] = "ling_moe_hl_down"
    kernel_source: ClassVar[str] = _HL_DOWN_KERNEL
    groups_per_warp: int = 4
    min_blocks: int = 4

    def _defines(self, hidden, intermediate):
        return dict(GPW_B=self.groups_per_warp, WPB=(intermediate // 32) // self.groups_per_warp,
                    MINB_B=self.min_blocks)

    def threads(self, hidden, intermediate):
        return 32 * ((intermediate // 32) // self.groups_per_warp)

    def grid_x(self, hidden, intermediate, top_k):
        return top_k * (hidden // 64)

    def cluster_size(self, top_k):
        return top_k

    def problems(self, hidden, intermediate, top_k, smem_limit):
        out = super().problems(hidden, intermediate, top_k, smem_limit)
        if (intermediate // 32) % self.groups_per_warp:
            out.append(f"groups_per_warp {self.groups_per_warp} does not divide {intermediate // 32} groups")
        return out


@dataclasses.dataclass(frozen=True)
class HummingDecodeConfig:
    """The two kernels' launch shapes on humming's layout (benchmark levers) and whether the
    down kernel may start while gate_up finishes (programmatic dependent launch)."""

    gate_up: StreamedGateUp = StreamedGateUp()
    down: RegisterDown = RegisterDown()
    use_pdl: bool = True

    def problems(self, hidden: int, intermediate: int, top_k: int, smem_limit: int) -> list[str]:
        return [f"{name}: {p}" for name, shape in (("gate_up", self.gate_up), ("down", self.down))
                for p in shape.problems(hidden, intermediate, top_k, smem_limit)]


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, cap + 1) if n % d == 0)


def default_humming_decode_configs(hidden: int, intermediate: int) -> dict[str, HummingDecodeConfig]:
    """Launch shapes for 1 token ("one") and for more ("many"). Ling (2560 / 768) gets the
    shapes measured fastest on the H200 (benchmarks/results/moe_decode_h200.md): streamed
    gate_up, 4 blocks per CTA, cluster 8; register down, 3 groups per warp for 1 token and 4
    for more. Other sizes get the nearest shapes that divide them."""
    g1, g2 = hidden // 32, intermediate // 32
    gate_up = StreamedGateUp(cluster=_divisor_at_most(g1, 8), blocks_per_cta=_divisor_at_most(intermediate // 64, 4))

    def down_groups(prefer: int) -> int:  # a divisor of g2, near `prefer`, <= 32 warps per CTA
        small = _divisor_at_most(g2, prefer)
        return small if g2 // small <= 32 else min(d for d in range(prefer, g2 + 1) if g2 % d == 0 and g2 // d <= 32)

    return {"one": HummingDecodeConfig(gate_up=gate_up, down=RegisterDown(groups_per_warp=down_groups(3), min_blocks=2)),
            "many": HummingDecodeConfig(gate_up=gate_up, down=RegisterDown(groups_per_warp=down_groups(4)))}


def humming_decode_support(experts, top_k: int) -> tuple[bool, str]:
    """Can the decode kernels read this HummingMxfp4Experts' tensors? (reason if not)"""
    if experts.w4a8:
        return False, "W4A8 layer (FP8 activations use humming's fused-scale layout)"
    if not 1 <= top_k <= 8:
        return False, f"top_k {top_k} outside 1..8 (one cluster CTA per slot, portable cluster size 8)"
    H, I = experts.hidden_size, experts.intermediate_size
    if H % 64 or I % 64:
        return False, f"hidden {H} / intermediate {I} not multiples of 64"
    major, minor = torch.cuda.get_device_capability(experts.device)
    if major < 9:
        return False, f"sm_{major}{minor} has no thread-block clusters (the kernels need sm_90+)"
    for sub, (n, k) in (("w13", (2 * I, H)), ("w2", (H, I))):
        cfg, t = experts.configs[sub], experts.tensors[sub]
        odd = [name for name in ("use_raw_weight", "use_flat_weight", "use_native_dequant",
                                 "use_packed_k_layout", "use_fused_e8m0_scale", "use_ldmatrix_dequant",
                                 "use_block_scaled_mma", "should_apply_bs_on_c", "use_int_weight_scale")
               if getattr(cfg, name)]
        if odd or cfg.pad_shape_n or cfg.pad_shape_k or "weight_scale_2" in t:
            return False, f"{sub}: humming chose another layout ({', '.join(odd) or 'padding or a secondary scale'})"
        E = experts.num_experts
        if tuple(t["weight"].shape) != (E, k // 16, 2 * n) or tuple(t["weight_scale"].shape) != (E, k // 32, n):
            return False, (f"{sub}: unexpected humming tensor shapes {tuple(t['weight'].shape)} / "
                           f"{tuple(t['weight_scale'].shape)}")
        for name in ("weight", "weight_scale"):  # read as raw rows, bulk-copied in 16-byte units
            if not t[name].is_contiguous() or t[name].data_ptr() % 16:
                return False, f"{sub} {name} is not a contiguous, 16-byte aligned tensor"
    limit = torch.cuda.get_device_properties(experts.device).shared_memory_per_block_optin
    for key, cfg in default_humming_decode_configs(H, I).items():
        problems = cfg.problems(H, I, top_k, limit)
        if problems:
            return False, f"launch shape for {key} token(s): {'; '.join(problems)}"
    return True, "fused decode kernels on humming's W4A16 layout"


class HummingLayoutDecode(_TwoKernelDecode):
    """Decode-sized batches of a :class:`~vllm_ling.ops.moe.HummingMxfp4Experts` layer in two
    fused kernels that read humming's own transformed weights (no second copy): gate_up +
    SwiGLU (a cluster of CTAs splits K and reduces in distributed shared memory), then down
    + weighted top-k sum (one CTA per top-k slot in a cluster). Each kernel comes in two
    forms (weights into registers, or streamed through shared memory); ``configs`` picks them
    per token count ("one", "many"). CUDA-graph capturable."""

    def __init__(self, experts, top_k: int, configs: dict[str, HummingDecodeConfig] | None = None):
        ok, reason = humming_decode_support(experts, top_k)
        if not ok:
            raise ValueError(f"humming-layout decode kernels cannot run: {reason}")
        self.experts, self.top_k = experts, top_k
        self.hidden_size, self.intermediate_size = experts.hidden_size, experts.intermediate_size
        self.device = experts.device
        self._has_pdl = torch.cuda.get_device_capability(self.device)[0] >= 9
        self._smem_limit = torch.cuda.get_device_properties(self.device).shared_memory_per_block_optin
        w13, w2 = experts.tensors["w13"], experts.tensors["w2"]
        self._w13, self._s13 = w13["weight"], w13["weight_scale"]
        self._w2, self._s2 = w2["weight"], w2["weight_scale"]
        self.configs = configs or default_humming_decode_configs(self.hidden_size, self.intermediate_size)
        self._kernels = {key: self._build(c) for key, c in self.configs.items()}

    def _build(self, c: HummingDecodeConfig):
        H, I, K = self.hidden_size, self.intermediate_size, self.top_k
        problems = c.problems(H, I, K, self._smem_limit)
        if problems:
            raise ValueError(f"launch shape {c} cannot run hidden {H} / intermediate {I}: {'; '.join(problems)}")
        clamp = _clamp_flag(self.experts.clamp)
        return (c, *(_kernel(shape.kernel_name, shape.source(H, I, K, clamp), self.device)
                     for shape in (c.gate_up, c.down)))

    def with_config(self, config: "HummingDecodeConfig | dict[str, HummingDecodeConfig]") -> "HummingLayoutDecode":
        """Other launch shapes on the same weights (benchmark levers): one config for every
        token count, or a {"one": ..., "many": ...} dict."""
        configs = config if isinstance(config, dict) else {"one": config, "many": config}
        return HummingLayoutDecode(self.experts, self.top_k, configs)

    def _pick(self, num_tokens: int):
        return self._kernels["one" if num_tokens == 1 else "many"]

    def _launch_shape(self, shape: _KernelShape, kernel, rows: int, args, arg_types, stream, pdl: bool):
        H, I, K = self.hidden_size, self.intermediate_size, self.top_k
        _launch(kernel, (shape.grid_x(H, I, K), rows), shape.threads(H, I), args, arg_types, stream,
                cluster=shape.cluster_size(K), pdl=pdl, smem=shape.smem(H, I, K))

    def _launch_gate_up(self, x, ids, act, limit, has_limit, stream):
        c, gate_up, _ = self._pick(x.shape[0])
        self._launch_shape(c.gate_up, gate_up, ids.numel(),
                           (self._w13.data_ptr(), self._s13.data_ptr(), x.data_ptr(), ids.data_ptr(),
                            act.data_ptr(), limit, has_limit), _ARGS_GATE_UP, stream, pdl=False)

    def _launch_down(self, act, w, ids, out, stream):
        c, _, down = self._pick(ids.shape[0])
        self._launch_shape(c.down, down, ids.shape[0],
                           (self._w2.data_ptr(), self._s2.data_ptr(), act.data_ptr(), ids.data_ptr(),
                            w.data_ptr(), out.data_ptr()), _ARGS_DOWN, stream, pdl=c.use_pdl and self._has_pdl)
