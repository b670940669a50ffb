// The sigmoid grouped top-k of grouped_topk.cu (same arguments, outputs, ties and rounding) by ranks instead
// of rounds: grouped_topk.cu picks the K_ experts in K_ rounds of two dependent warp butterflies and two
// barriers each; here every expert counts the experts that beat it, independently, and an expert whose count
// is below K_ writes itself at that place. A pick beats another by the larger choice, then the lower index.
//
//   groups: lane g of warp 0 holds group g's score and counts the groups that beat it (NG broadcasts);
//   level 1: a kept expert counts the experts of its own warp that beat it (32 broadcasts): those of rank
//            below KW = min(K_, 32) are the warp's candidates, at place rank of the warp's row of s_cv;
//   level 2: a candidate adds, for every other warp, how many of that warp's candidates beat it. An expert
//            of rank r < K_ is beaten by at most r others of any warp, all among that warp's KW best, so the
//            sum is its rank in the CTA wherever that rank is below K_ (and K_ or more elsewhere). The
//            experts of a warp are all below or all above this one's, so a tie needs no index: a lower
//            warp's equal choice beats it, a higher warp's does not.
//
// Three barriers and no dependent chain longer than one butterfly. Defines as grouped_topk.cu's; the group
// scores and the expert's choice are select.cuh's.
//
// Why: grouped_topk.cu takes 5.1 us per layer alone and 6.2 us of the served 32K step's chain after the gate
// GEMV (lease 2026-12-08a) for 2 KB of logits; its K_ rounds are about 4,000 dependent cycles, and the
// two-level variant (lease 2026-12-07g: 5.00 against 5.06 us) kept K_ rounds in each level.

#define KW (K_ < 32 ? K_ : 32)

extern "C" __global__ void __launch_bounds__(E_) ling_router_topk_ranks(
    const float *__restrict__ logits, const float *__restrict__ bias, float *__restrict__ weights,
    int *__restrict__ ids, int logits_stride, float scale) {
  __shared__ float s_top1[WARPS], s_top2[WARPS], s_cv[WARPS * KW], s_w[K_];
  __shared__ int s_keep[NG], s_ids[K_];
  const int t = blockIdx.x, e = threadIdx.x, lane = e & 31, warp = e >> 5;

  float score;
  const float choice = expert_choice(logits, bias, t, e, logits_stride, score);

  // the group scores (the sum of a group's two best choices), then the TG best groups by their ranks
  float a = choice, b = NEG_INF;
  warp_top2(a, b);
  if (lane == 0) { s_top1[warp] = a; s_top2[warp] = b; }
  __syncthreads();
  if (warp == 0) {
    float gs = NEG_INF;
    if (lane < NG) {
      float ga = NEG_INF, gb = NEG_INF;
      for (int w = lane * WARPS_PER_GROUP; w < (lane + 1) * WARPS_PER_GROUP; ++w) {
        const float oa = s_top1[w], ob = s_top2[w];
        const float na = fmaxf(ga, oa);
        gb = fmaxf(fminf(ga, oa), fmaxf(gb, ob));
        ga = na;
      }
      gs = ga + gb;
    }
    int beaten_by = 0;
#pragma unroll
    for (int h = 0; h < NG; ++h) {
      const float o = __shfl_sync(0xffffffffu, gs, h);
      beaten_by += (o > gs) || (o == gs && h < lane);
    }
    if (lane < NG) s_keep[lane] = beaten_by < TG;
  }
  __syncthreads();

  // level 1: the rank of this expert's choice in its warp (a group is whole warps: kept is warp-uniform)
  const bool kept = s_keep[e / (E_ / NG)];
  int in_warp = 32;
  if (kept) {
    in_warp = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float o = __shfl_sync(0xffffffffu, choice, j);
      in_warp += (o > choice) || (o == choice && j < lane);
    }
    if (in_warp < KW) s_cv[warp * KW + in_warp] = choice;
  } else if (lane < KW) {
    s_cv[warp * KW + lane] = NEG_INF;  // beats no kept choice
  }
  __syncthreads();

  // level 2: a candidate's rank in the CTA; those below K_ take their place
  if (in_warp < KW) {
    int rank = in_warp;
    for (int w = 0; w < WARPS; ++w) {
      if (w == warp) continue;
      const float *row = s_cv + w * KW;
      int beat = 0;
      if (w < warp) {
#pragma unroll
        for (int k = 0; k < KW; ++k) beat += row[k] >= choice;
      } else {
#pragma unroll
        for (int k = 0; k < KW; ++k) beat += row[k] > choice;
      }
      rank += beat;
    }
    if (rank < K_) { s_ids[rank] = e; s_w[rank] = score; }
  }
  __syncthreads();
  if (e < K_) {
    float w = s_w[e];
#if RENORM
    float sum = 0.f;
    for (int k = 0; k < K_; ++k) sum += s_w[k];  // in pick order, as grouped_topk.cu sums
    w = w / sum;
#endif
    weights[(long)t * K_ + e] = w * scale;
    ids[(long)t * K_ + e] = s_ids[e];
  }
}
