// Residual add + RMSNorm for BF16 rows, one CTA per token: s = x + residual (fp32), residual_out = bf16(s),
// out = bf16(bf16(s * rsqrt(mean(s^2) + eps)) * weight), the rounding steps of vLLM's native
// fused_add_rms_norm. With ADDENDS 2, x is itself a sum of two rows rounded to BF16 first, x = bf16(x + x2),
// as the graph computes it before the norm (the MoE's shared + routed outputs: one pointwise kernel less).
// Defines (residual_norm/kernel.py): H_ the hidden size, THREADS the CTA's threads, CH 16-byte chunks
// (8 values) per thread (H_ = 8 * CH * THREADS), ADDENDS 1 or 2.
//
// Why: in the decode step each norm is a separate Inductor reduction of 2-4.7 us that launches only once the
// kernel before it has finished, and the linear after it (vllm-ling's FP8 decode linear, the router's gate
// GEMV) streams its weights only once the norm has finished: about 80 norms a step, 0.24 ms of a 4 ms step
// (benchmarks/results/gpu_serving_h200.md). Here the norm lets the next kernel launch at once
// (griddepcontrol.launch_dependents), so that kernel's weights stream while the norm runs, and reads its own
// weight before it waits for the kernel that wrote x.

typedef unsigned int u32;

__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

// two floats as a BF16 pair, rounded to nearest even (low half: a)
__device__ __forceinline__ u32 pack_bf16(float a, float b) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}

__device__ __forceinline__ u32 word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void set_word(uint4& v, int i, u32 w) {
  if (i == 0) v.x = w; else if (i == 1) v.y = w; else if (i == 2) v.z = w; else v.w = w;
}

extern "C" __global__ void __launch_bounds__(THREADS) ling_add_rms_norm(
    const uint4 *__restrict__ x, const uint4 *__restrict__ residual, const uint4 *__restrict__ weight,
    uint4 *__restrict__ out, uint4 *__restrict__ residual_out, int x_stride, int residual_stride, int out_stride,
    int residual_out_stride, float eps, const uint4 *__restrict__ x2, int x2_stride) {
  __shared__ float s_part[THREADS / 32];
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint4 w[CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) w[c] = weight[tid + c * THREADS];  // a constant: read before the wait
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x and residual are earlier kernels' outputs
#endif
  const uint4 *xr = x + (long)t * (x_stride / 8), *rr = residual + (long)t * (residual_stride / 8);
  float s[CH][8];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const uint4 xv = xr[tid + c * THREADS], rv = rr[tid + c * THREADS];
#if ADDENDS == 2
    const uint4 x2v = x2[(long)t * (x2_stride / 8) + tid + c * THREADS];
#endif
    uint4 sum_bf16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u32 xw = word(xv, i);
#if ADDENDS == 2
      xw = pack_bf16(lo(xw) + lo(word(x2v, i)), hi(xw) + hi(word(x2v, i)));
#endif
      s[c][2 * i] = lo(xw) + lo(word(rv, i));
      s[c][2 * i + 1] = hi(xw) + hi(word(rv, i));
      set_word(sum_bf16, i, pack_bf16(s[c][2 * i], s[c][2 * i + 1]));
      ss = fmaf(s[c][2 * i], s[c][2 * i], ss);
      ss = fmaf(s[c][2 * i + 1], s[c][2 * i + 1], ss);
    }
    residual_out[(long)t * (residual_out_stride / 8) + tid + c * THREADS] = sum_bf16;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (lane == 0) s_part[warp] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < THREADS / 32; ++i) total += s_part[i];  // every thread adds the parts in one order
  const float rstd = rsqrtf(total / (float)H_ + eps);
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    uint4 o;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 normed = pack_bf16(s[c][2 * i] * rstd, s[c][2 * i + 1] * rstd);
      const u32 wv = word(w[c], i);
      set_word(o, i, pack_bf16(lo(normed) * lo(wv), hi(normed) * hi(wv)));
    }
    out[(long)t * (out_stride / 8) + tid + c * THREADS] = o;
  }
}
