// Sigmoid grouped top-k, one CTA per token and one thread per expert:
// score = sigmoid(logit), choice = score + bias; each group's score is the sum of its two best
// choices; the TG best groups are kept; the K_ best choices among their experts are picked, best
// first; their weights are the unbiased scores, divided by their sum (RENORM 1), times `scale`.
// Defines (router_topk/kernel.py): E_ experts (a multiple of 32, at most 1024: the CTA's threads),
// NG groups (E_ / NG a multiple of 32, NG <= 32), TG kept groups, K_ picks (at most 32).
//
// Why: vLLM 0.32's grouped_topk_fused_kernel takes 12.5 us per MoE layer for one token of Ling's
// 512 experts on an H100 (benchmarks/results/step_profile_real_h100.md), 0.5 ms of a 4.2 ms step;
// the work is 2 KB of logits. Here a token's experts sit one per thread: the group scores come
// from warp shuffles (a group is E_ / NG / 32 whole warps), the picks from K_ block-wide argmax
// rounds. Ties go to the lower expert index, as in a stable sort. The selection helpers are select.cuh's.

extern "C" __global__ void __launch_bounds__(E_) ling_grouped_topk(
    const float *__restrict__ logits, const float *__restrict__ bias, float *__restrict__ weights,
    int *__restrict__ ids, int logits_stride, float scale) {
  __shared__ float s_top1[WARPS], s_top2[WARPS], s_val[WARPS], s_w[K_];
  __shared__ int s_idx[WARPS], s_keep[NG], s_ids[K_];
  const int t = blockIdx.x, e = threadIdx.x, lane = e & 31, warp = e >> 5;

  float score;
  const float choice = expert_choice(logits, bias, t, e, logits_stride, score);

  keep_groups(choice, lane, warp, s_top1, s_top2, s_keep);

  pick_top_k(choice, score, e, lane, warp, s_keep, s_val, s_idx, s_w, s_ids, weights, ids, t, scale);
}
