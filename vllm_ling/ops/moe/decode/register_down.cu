
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
