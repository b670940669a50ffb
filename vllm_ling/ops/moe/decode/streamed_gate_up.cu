
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
  const int G0 = (int)rank * GPC_S;
  if (threadIdx.x == 0) {
    for (int s = 0; s < ST_S; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CONS_S); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // every CTA of the cluster must run before others write into its shared memory
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  __syncthreads();
#if __CUDA_ARCH__ >= 900
  // launched with programmatic dependent launch: the setup above overlaps the previous kernel;
  // the expert ids and x are its outputs (or an earlier kernel's, complete before it finished).
  // The down kernel reads the ids before its own wait, so it may start only after this wait.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const long long e = topk_ids[a];
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

