// The MoE router in one launch: the fp32 gate GEMV and the sigmoid grouped top-k of grouped_topk.cu.
// Defines (router_topk/fused.py): E_ experts (one thread each in a CTA of E_ threads), NG, TG, K_, RENORM
// as grouped_topk.cu; H_ the hidden size, WPE warps per expert row (H_ / WPE / 128 float4 per lane),
// TMAX the most tokens. GRID = 32 * WPE CTAs, each E_ / 32 / WPE experts for every token.
//
// Why: served as two kernels, the gate GEMV (small_gemv) and the top-k, the router took about 9 us per MoE
// layer on the critical path of the H200's decode step (lease 2026-12-07e: 294 us per step), where the
// top-k alone takes 5 us and the GEMV 2: the second launch and its wait on the first cost as much as either.
// Here each CTA reads its experts' gate rows (constants) before it waits for the previous kernel, computes
// their logits for every token, writes them, and counts itself in; the last `tokens` CTAs to arrive each
// route one token once every CTA has arrived (a spin on the counter, which never resets: each launch adds
// GRID, a power of two, so a launch's arrivals are one residue class of the unsigned counter). Every CTA
// has started before the next kernel launches (griddepcontrol.launch_dependents fires when all have run
// it), so the few spinning CTAs never wait on a CTA without a place to run.

#define EPC (WARPS / WPE)   // experts per CTA
#define GRID (32 * WPE)     // = E_ / EPC
#define KP (H_ / WPE)       // a warp's share of an expert's row
#define CH (KP / 128)       // float4 per lane

__device__ __forceinline__ float bf16_low(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_high(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

extern "C" __global__ void __launch_bounds__(E_) ling_router_fused(
    const unsigned short *__restrict__ x, const float *__restrict__ w, const float *__restrict__ bias,
    float *__restrict__ logits, float *__restrict__ weights, int *__restrict__ ids, unsigned *__restrict__ counter,
    int tokens, int x_stride, float scale) {
  __shared__ float s_part[WARPS][TMAX];
  __shared__ float s_top1[WARPS], s_top2[WARPS], s_val[WARPS], s_w[K_];
  __shared__ int s_idx[WARPS], s_keep[NG], s_ids[K_];
  __shared__ unsigned s_prev;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int part = warp % WPE, expert = blockIdx.x * EPC + warp / WPE;

  // this warp's part of its expert's gate row, and this thread's expert's bias: constants, read while the
  // previous kernel finishes
  const uint4 *row = reinterpret_cast<const uint4 *>(w + (long)expert * H_ + part * KP);
  uint4 wv[CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) wv[c] = ld_stream(row + lane + 32 * c);
  const float expert_bias = bias[tid];
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
#endif

  for (int t = 0; t < tokens; ++t) {
    const uint2 *xr = reinterpret_cast<const uint2 *>(x + (long)t * x_stride + part * KP);
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const uint2 xv = xr[lane + 32 * c];
      acc = fmaf(bf16_low(xv.x), __uint_as_float(wv[c].x), acc);
      acc = fmaf(bf16_high(xv.x), __uint_as_float(wv[c].y), acc);
      acc = fmaf(bf16_low(xv.y), __uint_as_float(wv[c].z), acc);
      acc = fmaf(bf16_high(xv.y), __uint_as_float(wv[c].w), acc);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) s_part[warp][t] = acc;
  }
  __syncthreads();
  if (tid < EPC * tokens) {  // one thread per (expert, token): the expert's parts added in order
    const int local = tid % EPC, t = tid / EPC;
    float sum = 0.f;
#pragma unroll
    for (int p = 0; p < WPE; ++p) sum += s_part[local * WPE + p][t];
    logits[(long)t * E_ + blockIdx.x * EPC + local] = sum;
    __threadfence();  // the logit is visible on the whole GPU before this CTA counts itself in
  }
  __syncthreads();
  if (tid == 0) s_prev = atomicAdd(counter, 1u);
  __syncthreads();
  const unsigned prev = s_prev, arrival = prev % GRID;
  const int t = GRID - 1 - (int)arrival;  // the last CTA to arrive routes token 0, the one before it token 1, ...
  if (t >= tokens) return;
  if (tid == 0) {
    const unsigned all = prev - arrival + GRID;  // the counter once every CTA of this launch arrived
    while ((int)(ld_acquire(counter) - all) < 0) {
    }
    __threadfence();
  }
  __syncthreads();

  // the served top-k's selection (select.cuh, as grouped_topk.cu), for token t, on the logits every CTA wrote
  // (read from L2)
  const float score = 1.f / (1.f + expf(-__ldcg(logits + (long)t * E_ + tid)));
  const float choice = score + expert_bias;
  keep_groups(choice, lane, warp, s_top1, s_top2, s_keep);
  pick_top_k(choice, score, tid, lane, warp, s_keep, s_val, s_idx, s_w, s_ids, weights, ids, t, scale);
}
