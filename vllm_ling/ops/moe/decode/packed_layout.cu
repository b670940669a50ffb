
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
