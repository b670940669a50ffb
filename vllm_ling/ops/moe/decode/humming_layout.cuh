
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

