// The sigmoid grouped top-k of grouped_topk.cu (same arguments, outputs, ties and rounding) with three
// block-wide barriers instead of 2 K_ + 3: grouped_topk.cu picks its K_ experts in K_ block-wide argmax
// rounds, each two __syncthreads; here every warp of a kept group first picks its own K_ best choices with
// warp shuffles alone, then one warp picks the K_ best of those WARPS x K_ candidates. The K_ best of the
// CTA are among them (each is among its own warp's K_ best), and both levels order by (choice, lower
// index), so the picks and their order are grouped_topk.cu's. Defines as grouped_topk.cu's; the selection
// helpers and the group stage are select.cuh's.
//
// Why: the step profile puts grouped_topk.cu at 8.2 us per MoE layer in the served step (5.1 alone) for
// 2 KB of logits, a chain of barriers (benchmarks/router_topk.py measures both variants).

#define CANDIDATES (WARPS * K_)
#define PER_LANE ((CANDIDATES + 31) / 32)

extern "C" __global__ void __launch_bounds__(E_) ling_router_topk_two_level(
    const float *__restrict__ logits, const float *__restrict__ bias, float *__restrict__ weights,
    int *__restrict__ ids, int logits_stride, float scale) {
  __shared__ float s_top1[WARPS], s_top2[WARPS], s_score[E_], s_cv[CANDIDATES];
  __shared__ int s_ci[CANDIDATES], s_keep[NG], s_ids[K_];
  const int t = blockIdx.x, e = threadIdx.x, lane = e & 31, warp = e >> 5;

  float score;
  const float choice = expert_choice(logits, bias, t, e, logits_stride, score);
  s_score[e] = score;

  keep_groups(choice, lane, warp, s_top1, s_top2, s_keep);

  // level 1: this warp's K_ best choices, best first (a group is whole warps: `kept` is the warp's)
  if (s_keep[e / (E_ / NG)]) {
    float mine = choice;
    for (int k = 0; k < K_; ++k) {
      float v = mine;
      int i = e;
      warp_argmax(v, i);
      if (lane == 0) { s_cv[warp * K_ + k] = v; s_ci[warp * K_ + k] = i; }
      if (e == i) mine = NEG_INF;
    }
  } else if (lane < K_) {
    s_cv[warp * K_ + lane] = NEG_INF;
    s_ci[warp * K_ + lane] = 0x7fffffff;
  }
  __syncthreads();

  // level 2: warp 0 picks the K_ best candidates (lane l holds candidates l, l + 32, ...), best first
  if (warp == 0) {
    float cv[PER_LANE];
    int ci[PER_LANE];
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) {
      const int slot = lane + 32 * c;
      cv[c] = slot < CANDIDATES ? s_cv[slot] : NEG_INF;
      ci[c] = slot < CANDIDATES ? s_ci[slot] : 0x7fffffff;
    }
    for (int k = 0; k < K_; ++k) {
      float v = NEG_INF;
      int i = 0x7fffffff;
#pragma unroll
      for (int c = 0; c < PER_LANE; ++c) better(v, i, cv[c], ci[c]);
      warp_argmax(v, i);
      if (lane == 0) s_ids[k] = i;
#pragma unroll
      for (int c = 0; c < PER_LANE; ++c)
        if (ci[c] == i) cv[c] = NEG_INF;  // an expert is one candidate: exactly one lane drops it
    }
  }
  __syncthreads();
  if (e < K_) {
    float w = s_score[s_ids[e]];
#if RENORM
    float sum = 0.f;
    for (int k = 0; k < K_; ++k) sum += s_score[s_ids[k]];
    w = w / sum;
#endif
    weights[(long)t * K_ + e] = w * scale;
    ids[(long)t * K_ + e] = s_ids[e];
  }
}
