// Warp-level selection helpers of the router top-k kernels (grouped_topk.cu, grouped_topk_ranks.cu):
// kernel.py puts them after the #define lines and before a kernel's text.

#ifndef NEG_INF
#define NEG_INF (-__int_as_float(0x7f800000))
#endif

// (value, index) pairs: the larger value wins, then the lower index
__device__ __forceinline__ void better(float &v, int &i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

__device__ __forceinline__ void warp_argmax(float &v, int &i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, off);
    int oi = __shfl_xor_sync(0xffffffffu, i, off);
    better(v, i, ov, oi);
  }
}

// the best two values of the warp (duplicates count twice, as a sorted top-2 does)
__device__ __forceinline__ void warp_top2(float &a, float &b) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    float oa = __shfl_xor_sync(0xffffffffu, a, off);
    float ob = __shfl_xor_sync(0xffffffffu, b, off);
    float na = fmaxf(a, oa);
    b = fmaxf(fminf(a, oa), fmaxf(b, ob));
    a = na;
  }
}

// this thread's expert for token t: returns its choice (score + bias), its score in `score`. The bias, a
// constant, is read before the wait for the kernel that wrote the logits: with programmatic dependent
// launch this grid starts while the gate GEMV finishes, and lets the routed experts' kernel (which waits
// for this grid) start while it runs. expf, not __expf: the same float as torch.sigmoid, so a near-tie
// picks what the reference picks
__device__ __forceinline__ float expert_choice(const float *__restrict__ logits, const float *__restrict__ bias,
                                               int t, int e, int logits_stride, float &score) {
  const float expert_bias = bias[e];
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the logits are the previous kernel's output
#endif
  score = 1.f / (1.f + expf(-logits[(long)t * logits_stride + e]));
  return score + expert_bias;
}

#define WARPS (E_ / 32)
#define WARPS_PER_GROUP (E_ / NG / 32)

// s_keep[g] = 1 for the TG groups of the best scores (a group's score: the sum of its two best choices,
// a group being WARPS_PER_GROUP whole warps), else 0. Every thread of the CTA calls it with its expert's
// choice: it synchronizes (s_top1, s_top2: WARPS floats each)
__device__ __forceinline__ void keep_groups(float choice, int lane, int warp, float *s_top1, float *s_top2,
                                            int *s_keep) {
  float a = choice, b = NEG_INF;
  warp_top2(a, b);
  if (lane == 0) { s_top1[warp] = a; s_top2[warp] = b; }
  __syncthreads();
  if (warp == 0) {  // group scores, then the TG best groups (lane g holds group g)
    float gs = NEG_INF;
    if (lane < NG) {
      float ga = NEG_INF, gb = NEG_INF;
      for (int w = lane * WARPS_PER_GROUP; w < (lane + 1) * WARPS_PER_GROUP; ++w) {
        float oa = s_top1[w], ob = s_top2[w];
        float na = fmaxf(ga, oa);
        gb = fmaxf(fminf(ga, oa), fmaxf(gb, ob));
        ga = na;
      }
      gs = ga + gb;
    }
    int keep = 0;
    for (int r = 0; r < TG; ++r) {
      float v = (lane < NG && !keep) ? gs : NEG_INF;
      int i = lane;
      warp_argmax(v, i);
      if (lane == i) keep = 1;
    }
    if (lane < NG) s_keep[lane] = keep;
  }
  __syncthreads();
}

// The K_ best choices among the kept groups' experts, best first (ties to the lower expert), from
// K_ block-wide argmax rounds; their weights, the unbiased scores divided by their sum (RENORM 1) times
// `scale`, and ids go to row t of `weights` and `ids`. Every thread of the CTA (thread e: expert e) calls it
// after keep_groups with its expert's choice and score: it synchronizes (s_val, s_idx: WARPS entries;
// s_w, s_ids: K_)
__device__ __forceinline__ void pick_top_k(float choice, float score, int e, int lane, int warp, const int *s_keep,
                                           float *s_val, int *s_idx, float *s_w, int *s_ids,
                                           float *__restrict__ weights, int *__restrict__ ids, long t, float scale) {
  float masked = s_keep[e / (E_ / NG)] ? choice : NEG_INF;
  for (int k = 0; k < K_; ++k) {
    float v = masked;
    int i = e;
    warp_argmax(v, i);
    if (lane == 0) { s_val[warp] = v; s_idx[warp] = i; }
    __syncthreads();
    if (warp == 0) {
      v = lane < WARPS ? s_val[lane] : NEG_INF;
      i = lane < WARPS ? s_idx[lane] : 0x7fffffff;
      warp_argmax(v, i);
      if (lane == 0) s_ids[k] = i;
    }
    __syncthreads();
    if (e == s_ids[k]) { s_w[k] = score; masked = NEG_INF; }
  }
  __syncthreads();
  if (e < K_) {
    float w = s_w[e];
#if RENORM
    float sum = 0.f;
    for (int k = 0; k < K_; ++k) sum += s_w[k];
    w = w / sum;
#endif
    weights[t * K_ + e] = w * scale;
    ids[t * K_ + e] = s_ids[e];
  }
}
