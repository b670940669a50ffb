// Weight-only FP8 decode linear: out[m, n] = sum_k x[m, k] * w[n, k] * scale[n / 128, k / 128].
// Defines (decode_kernel.py): WARPS_N row tiles of 16 rows per CTA, KSPLIT warps along K per
// tile, STEPS 64-wide k-steps per warp (K = 64 * KSPLIT * STEPS), TG groups of 8 activation
// rows, MINB CTAs per SM for the register allocator. Two kernels: ling_dense_w8a16_wave (one wave of
// tiles) and ling_dense_w8a16_stream (persistent CTAs, two register buffers).
//
// A warp owns 16 output rows x (K / KSPLIT) and loads all of its weight bytes into registers
// before it waits for the previous kernel (griddepcontrol.wait): the weights are constants, so
// with programmatic dependent launch they stream while the previous kernel finishes. Lane
// (g, t) holds 16 bytes of rows g and g + 8 at k-offset 16 t of each 64-wide step. Each group of
// four bytes feeds one mma.m16n8k16 (BF16, fp32 accumulate); the MMA's k order is a permutation
// of the physical one, applied alike to weights (A) and activations (B), which a dot product
// does not see: bytes (b0, b2) form the A pair of logical k (2t, 2t+1), bytes (b1, b3) that of
// (2t + 8, 2t + 9), and the activations are paired the same way with one byte permute each.
//
// e4m3 -> BF16 by bit moves (two shifts and one LOP3 per two weights): sign to bit 15, the
// seven exponent/mantissa bits to bits 10..4. The BF16 value is w * 2**-120 for every finite
// code, subnormals included (BF16 subnormals enter the MMA unflushed); the NaN codes 0x7F/0xFF
// read as +-480 (the layer refuses checkpoints that contain them). Activations are multiplied
// by 2**64 (exact) so products stay normal in fp32; the block scale carries 2**56 back. Exact
// for |x| < 2**64 and block scales < 2**72.

typedef unsigned int u32;
typedef unsigned short u16;

#define K_ (64 * KSPLIT * STEPS)
#define THREADS (32 * WARPS_N * KSPLIT)

// bytes (b0, b2) of q as a BF16 pair of w * 2**-120
__device__ __forceinline__ u32 e4m3_pair_even(u32 q) {
  return ((q << 8) & 0x80008000u) | ((q << 4) & 0x07F007F0u);
}

// bytes (b1, b3) of q as a BF16 pair of w * 2**-120
__device__ __forceinline__ u32 e4m3_pair_odd(u32 q) {
  return (q & 0x80008000u) | ((q >> 4) & 0x07F007F0u);
}

// a BF16 pair times 2**64 (exact below 2**64)
__device__ __forceinline__ u32 times_2_64(u32 v) {
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x5F805F80u), "r"(0x80008000u));
  return r;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ u32 word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// the weights (and block scales * 2**56) of one 16-row tile for this warp's part of K
__device__ __forceinline__ void load_tile(uint4 (&wr)[STEPS][2], float (&sc)[STEPS], const uint4* __restrict__ w,
                                          const float* __restrict__ scale, int n0, int ks, int g, int t,
                                          int scale_stride) {
  const uint4* row_lo = w + (long long)(n0 + g) * (K_ / 16) + ks * STEPS * 4 + t;
  const uint4* row_hi = row_lo + 8LL * (K_ / 16);
  const float* srow = scale + (long long)(n0 / 128) * scale_stride;
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    wr[s][0] = ld_stream(row_lo + 4 * s);
    wr[s][1] = ld_stream(row_hi + 4 * s);
    sc[s] = srow[(ks * STEPS + s) >> 1] * 72057594037927936.f;  // * 2**56
  }
}

// acc[j] = this warp's partial sums of the tile for activation rows 8 j .. 8 j + 7
__device__ __forceinline__ void mma_tile(const uint4 (&wr)[STEPS][2], const float (&sc)[STEPS],
                                         const u16* __restrict__ x, int m, int x_stride, int ks, int g, int t,
                                         float (&acc)[TG][4]) {
#pragma unroll
  for (int j = 0; j < TG; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    u32 a[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 lo = word(wr[s][0], i), hi = word(wr[s][1], i);
      a[i][0] = e4m3_pair_even(lo);
      a[i][1] = e4m3_pair_even(hi);
      a[i][2] = e4m3_pair_odd(lo);
      a[i][3] = e4m3_pair_odd(hi);
    }
    const int k0 = (ks * STEPS + s) * 64 + 16 * t;
#pragma unroll
    for (int j = 0; j < TG; ++j) {
      const int row = 8 * j + g;
      uint4 xv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (row < m) {
        const uint4* xp = reinterpret_cast<const uint4*>(x + (long long)row * x_stride + k0);
        xv[0] = xp[0];
        xv[1] = xp[1];
      }
      float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 x01 = times_2_64(word(xv[i >> 1], 2 * (i & 1)));
        const u32 x23 = times_2_64(word(xv[i >> 1], 2 * (i & 1) + 1));
        mma_bf16(part, a[i][0], a[i][1], a[i][2], a[i][3],
                 __byte_perm(x01, x23, 0x5410), __byte_perm(x01, x23, 0x7632));
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[j][r] = fmaf(part[r], sc[s], acc[j][r]);
    }
  }
}

// lane (g, t) holds rows n0 + g (acc 0, 1) and n0 + g + 8 (acc 2, 3) of activation rows
// 8 j + 2 t (+1); the KSPLIT warps of a tile add up in shared memory (every warp of the CTA
// calls this: it synchronizes), warp ks == 0 writes
__device__ __forceinline__ void store_tile(float (&acc)[TG][4], float* red, u16* __restrict__ out, int n, int m,
                                           int n0, bool tile_ok, int wn, int ks, int lane, int g, int t) {
#if KSPLIT > 1
  float* mine = red + ((wn * KSPLIT + ks) * TG) * 128;
#pragma unroll
  for (int j = 0; j < TG; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) mine[(j * 4 + r) * 32 + lane] = acc[j][r];
  __syncthreads();
  if (ks == 0) {
#pragma unroll
    for (int j = 0; j < TG; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < KSPLIT; ++q) v += red[((wn * KSPLIT + q) * TG * 4 + j * 4 + r) * 32 + lane];
        acc[j][r] = v;
      }
  }
  __syncthreads();  // red is reused by the next tile
#endif
  if (ks != 0 || !tile_ok) return;
#pragma unroll
  for (int j = 0; j < TG; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 8 * j + 2 * t + (r & 1), col = n0 + g + 8 * (r >> 1);
      if (row < m) out[(long long)row * n + col] = to_bf16(acc[j][r]);
    }
}

__device__ __forceinline__ void pdl_start() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
#endif
}

#if KSPLIT > 1
#define RED_SMEM __shared__ float red[WARPS_N * KSPLIT * TG * 128];
#else
#define RED_SMEM float* red = nullptr;
#endif

// one wave of tiles: WARPS_N tiles per CTA, every weight of a warp in flight at once
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
ling_dense_w8a16_wave(const uint4* __restrict__ w, const float* __restrict__ scale, const u16* __restrict__ x,
                 u16* __restrict__ out, int n, int m, int scale_stride, int x_stride) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wn = warp / KSPLIT, ks = warp % KSPLIT;
  const int n0 = (blockIdx.x * WARPS_N + wn) * 16;
  const bool tile_ok = n0 < n;  // rows come in whole tiles of 16 (the launcher checks N % 16)
  RED_SMEM
  uint4 wr[STEPS][2];
  float sc[STEPS];
  if (tile_ok) load_tile(wr, sc, w, scale, n0, ks, g, t, scale_stride);
  pdl_start();
  float acc[TG][4];
  if (tile_ok) mma_tile(wr, sc, x, m, x_stride, ks, g, t, acc);
  store_tile(acc, red, out, n, m, n0, tile_ok, wn, ks, lane, g, t);
}

// persistent: a CTA (WARPS_N == 1) walks tiles blockIdx.x, + gridDim.x, ... with two register
// buffers, loading tile i + 2 while it computes tile i + 1, so its loads stream back to back
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
ling_dense_w8a16_stream(const uint4* __restrict__ w, const float* __restrict__ scale, const u16* __restrict__ x,
                        u16* __restrict__ out, int n, int m, int scale_stride, int x_stride) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ks = warp;
  const int tiles = n / 16, stride = gridDim.x;
  RED_SMEM
  uint4 wa[STEPS][2], wb[STEPS][2];
  float sa[STEPS], sb[STEPS];
  int ta = blockIdx.x, tb = blockIdx.x + stride;
  if (ta < tiles) load_tile(wa, sa, w, scale, 16 * ta, ks, g, t, scale_stride);
  if (tb < tiles) load_tile(wb, sb, w, scale, 16 * tb, ks, g, t, scale_stride);
  pdl_start();
  float acc[TG][4];
  while (ta < tiles) {
    mma_tile(wa, sa, x, m, x_stride, ks, g, t, acc);
    const int na = tb + stride;
    if (na < tiles) load_tile(wa, sa, w, scale, 16 * na, ks, g, t, scale_stride);
    store_tile(acc, red, out, n, m, 16 * ta, true, 0, ks, lane, g, t);
    ta = na;
    if (tb >= tiles) break;
    mma_tile(wb, sb, x, m, x_stride, ks, g, t, acc);
    const int nb = ta + stride;
    if (nb < tiles) load_tile(wb, sb, w, scale, 16 * nb, ks, g, t, scale_stride);
    store_tile(acc, red, out, n, m, 16 * tb, true, 0, ks, lane, g, t);
    tb = nb;
  }
}
