// MoE router logits: out[t, e] = sum_k x[t, k] * w[e, k] for BF16 x [T, H] (row stride SX) and
// the fp32 gate weight w [E, H]; fp32 out [T, E]. Defines (router/kernel.py): H_ (a multiple of
// 128), WARPS (expert rows per CTA, one per warp), TB (tokens per pass).
//
// A warp owns one expert row: lane l holds w[e, 4 (l + 32 j) .. + 3] for j < H / 128 in registers,
// loaded before it waits for the previous kernel (griddepcontrol.wait). The gate weight is
// constant, so with programmatic dependent launch the whole weight streams while the previous
// kernel finishes; only the activations are read after the wait (L1-cached: the CTA's warps share
// them). BF16 -> fp32 is exact, products and sums are fp32 as in vLLM's F.linear on the fp32
// weight; only the summation order differs (per lane over j, then a warp butterfly).

typedef unsigned int u32;

#define NJ (H_ / 128)

__device__ __forceinline__ float4 ld_weights(const float4* p) {
  float4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

extern "C" __global__ void __launch_bounds__(WARPS * 32)
ling_router_gemv(const float4* __restrict__ w, const unsigned short* __restrict__ x, float* __restrict__ out,
                 int E, int T, int SX) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * WARPS + warp;
  float4 wr[NJ];
  if (e < E) {
    const float4* p = w + (long long)e * (H_ / 4) + lane;
#pragma unroll
    for (int j = 0; j < NJ; ++j) wr[j] = ld_weights(p + 32 * j);
  }
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
#endif
  if (e >= E) return;
  for (int t0 = 0; t0 < T; t0 += TB) {
    uint2 xv[TB][NJ];  // every load of the pass in flight before the FMAs
#pragma unroll
    for (int b = 0; b < TB; ++b) {
      const uint2* xr = reinterpret_cast<const uint2*>(x + (long long)min(t0 + b, T - 1) * SX) + lane;
#pragma unroll
      for (int j = 0; j < NJ; ++j) xv[b][j] = xr[32 * j];
    }
    float acc[TB];
#pragma unroll
    for (int b = 0; b < TB; ++b) {
      acc[b] = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        acc[b] = fmaf(bf16_lo(xv[b][j].x), wr[j].x, acc[b]);
        acc[b] = fmaf(bf16_hi(xv[b][j].x), wr[j].y, acc[b]);
        acc[b] = fmaf(bf16_lo(xv[b][j].y), wr[j].z, acc[b]);
        acc[b] = fmaf(bf16_hi(xv[b][j].y), wr[j].w, acc[b]);
      }
    }
#pragma unroll
    for (int b = 0; b < TB; ++b) {
#pragma unroll
      for (int o = 16; o; o >>= 1) acc[b] += __shfl_xor_sync(0xFFFFFFFFu, acc[b], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < TB; ++b)
        if (t0 + b < T) out[(long long)(t0 + b) * E + e] = acc[b];
    }
  }
}
