// Small-N GEMV with the weight held in registers: out[t, n] = sum_k x[t, k] * w[n, k] for BF16 x
// [T, K] (row stride SX) and w [N, K] in fp32 (W_BF16 0) or BF16 (W_BF16 1); out [T, N] in fp32
// (OUT_BF16 0) or BF16 rounded to nearest even (OUT_BF16 1). Defines (small_gemv/kernel.py): K_
// (a multiple of CHUNK_K), WARPS (weight rows per CTA, one per warp), TB (tokens per pass), XS_T
// (tokens staged in shared memory at a time).
//
// A warp owns one weight row: lane l holds its 16-byte chunks l, l + 32, ... in registers, loaded
// before it waits for the previous kernel (griddepcontrol.wait). The weights are constants, so
// with programmatic dependent launch the whole weight streams while the previous kernel
// finishes; only the activations are read after the wait. Up to TB tokens each warp loads its
// slices of x itself (one round trip to L2); more tokens are first staged XS_T at a time in
// shared memory by the whole CTA, so each round costs one L2 round trip instead of one per pass
// of TB tokens (a warp's pass otherwise waits for its own loads). BF16 -> fp32 is exact; products and sums are fp32 (one fused multiply-add per term), as
// cuBLAS's fp32 accumulation; only the summation order differs (per lane, then a warp butterfly).

typedef unsigned int u32;
typedef unsigned short u16;

#if W_BF16
#define CHUNK_K 8    // weights per 16-byte chunk
#else
#define CHUNK_K 4
#endif
#define NJ (K_ / (32 * CHUNK_K))

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

// one 16-byte weight chunk times its activations (the matching 8 or 16 bytes of x)
#if W_BF16
typedef uint4 xchunk;
__device__ __forceinline__ float chunk_dot(const uint4& w, const uint4& x, float acc) {
  acc = fmaf(bf16_lo(x.x), bf16_lo(w.x), acc);
  acc = fmaf(bf16_hi(x.x), bf16_hi(w.x), acc);
  acc = fmaf(bf16_lo(x.y), bf16_lo(w.y), acc);
  acc = fmaf(bf16_hi(x.y), bf16_hi(w.y), acc);
  acc = fmaf(bf16_lo(x.z), bf16_lo(w.z), acc);
  acc = fmaf(bf16_hi(x.z), bf16_hi(w.z), acc);
  acc = fmaf(bf16_lo(x.w), bf16_lo(w.w), acc);
  return fmaf(bf16_hi(x.w), bf16_hi(w.w), acc);
}
#else
typedef uint2 xchunk;
__device__ __forceinline__ float chunk_dot(const uint4& w, const uint2& x, float acc) {
  acc = fmaf(bf16_lo(x.x), __uint_as_float(w.x), acc);
  acc = fmaf(bf16_hi(x.x), __uint_as_float(w.y), acc);
  acc = fmaf(bf16_lo(x.y), __uint_as_float(w.z), acc);
  return fmaf(bf16_hi(x.y), __uint_as_float(w.w), acc);
}
#endif

#if OUT_BF16
typedef u16 out_t;
__device__ __forceinline__ u16 to_out(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
#else
typedef float out_t;
__device__ __forceinline__ float to_out(float v) { return v; }
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32)
ling_small_gemv(const uint4* __restrict__ w, const u16* __restrict__ x, out_t* __restrict__ out, int N, int T,
                int SX) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * WARPS + warp;
  uint4 wr[NJ];
  if (n < N) {
    const uint4* p = w + (long long)n * (K_ / CHUNK_K) + lane;
#pragma unroll
    for (int j = 0; j < NJ; ++j) wr[j] = ld_stream(p + 32 * j);
  }
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
#endif
  if (T <= TB) {  // one pass: each lane loads its slices of every token straight from global memory
    if (n >= N) return;
    xchunk xv[TB][NJ];  // every load of the pass in flight before the FMAs
#pragma unroll
    for (int b = 0; b < TB; ++b) {
      const xchunk* xr = reinterpret_cast<const xchunk*>(x + (long long)min(b, T - 1) * SX) + lane;
#pragma unroll
      for (int j = 0; j < NJ; ++j) xv[b][j] = xr[32 * j];
    }
    float acc[TB];
#pragma unroll
    for (int b = 0; b < TB; ++b) {
      acc[b] = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) acc[b] = chunk_dot(wr[j], xv[b][j], acc[b]);
#pragma unroll
      for (int o = 16; o; o >>= 1) acc[b] += __shfl_xor_sync(0xFFFFFFFFu, acc[b], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < TB; ++b)
        if (b < T) out[(long long)b * N + n] = to_out(acc[b]);
    }
    return;
  }
  // staged: every thread of the CTA takes part in the copies and barriers (a warp past N only copies)
  __shared__ __align__(16) u16 xs[XS_T * K_];
  constexpr int ROW_V = K_ / 8;  // 16-byte vectors per row of x
  for (int s0 = 0; s0 < T; s0 += XS_T) {
    const int ns = min(XS_T, T - s0);
    for (int i = threadIdx.x; i < ns * ROW_V; i += WARPS * 32) {  // every copy in flight at once
      const int r = i / ROW_V, c = i - r * ROW_V;
      const unsigned dst = (unsigned)__cvta_generic_to_shared(reinterpret_cast<uint4*>(xs) + i);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                   :: "r"(dst), "l"(reinterpret_cast<const uint4*>(x + (long long)(s0 + r) * SX) + c) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    if (n < N) {
      for (int t0 = 0; t0 < ns; t0 += TB) {
        float acc[TB];
#pragma unroll
        for (int b = 0; b < TB; ++b) {
          const xchunk* xr = reinterpret_cast<const xchunk*>(xs + min(t0 + b, ns - 1) * K_) + lane;
          acc[b] = 0.f;
#pragma unroll
          for (int j = 0; j < NJ; ++j) acc[b] = chunk_dot(wr[j], xr[32 * j], acc[b]);
        }
#pragma unroll
        for (int b = 0; b < TB; ++b) {
#pragma unroll
          for (int o = 16; o; o >>= 1) acc[b] += __shfl_xor_sync(0xFFFFFFFFu, acc[b], o);
        }
        if (lane == 0) {
#pragma unroll
          for (int b = 0; b < TB; ++b)
            if (t0 + b < ns) out[(long long)(s0 + t0 + b) * N + n] = to_out(acc[b]);
        }
      }
    }
    __syncthreads();  // the next round overwrites xs
  }
}
