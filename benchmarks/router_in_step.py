"""Ling's router between its real neighbours: the gate GEMV, the grouped top-k and the routed experts (the
decode kernels on humming's layout) as the decode step runs them, over distinct MoE layers in one CUDA
graph, against the same chain with the picks precomputed (no top-k): what the top-k adds to the step.

Why: in the real step's profiles the top-k holds the critical path 7.3-7.6 us past its GEMV's end in every
MoE layer (``benchmarks/results/gpu_serving_h200.md``, per layer), where ``benchmarks/router_topk.py``'s stack
of top-k launches gives 5.1 us. This chain has the top-k's real neighbours (the GEMV releasing it early, the
experts' gate_up launched early and waiting on its picks), so it tells a cost of the chain from a cost of the
kernel, before any new selection kernel is written.

    python -m benchmarks.router_in_step --out benchmarks/results/router_in_step_h100.md   # on the GPU

No vLLM import.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.router_topk import tokens_off
from benchmarks.timing import stacked_time_us
from vllm_ling.ops.known_answer.router_topk import Routing

E, H, I, K = 512, 2560, 768, 8        # Ling-3.0-flash's routed experts: experts, hidden, intermediate, picks
N_GROUP, TOPK_GROUP, SCALE = 8, 4, 2.5  # its grouped top-k
ROUTING = Routing(E, N_GROUP, TOPK_GROUP, K, True, SCALE)


def chain_rows(token_counts: list[int], layers: int, iters: int) -> list[dict]:
    from vllm_ling.ops.moe.decode.layouts import HummingLayoutDecode
    from vllm_ling.ops.moe.humming import HummingMxfp4Experts
    from vllm_ling.ops.moe.routing import grouped_topk
    from vllm_ling.ops.moe.warmup import random_mxfp4_experts
    from vllm_ling.ops.router_topk.kernel import grouped_topk_cuda
    from vllm_ling.ops.small_gemv.router import router_logits

    dev = torch.device("cuda")
    experts = [HummingLayoutDecode(HummingMxfp4Experts(**random_mxfp4_experts(E, H, I, dev, seed=i), decode="off"), K)
               for i in range(layers)]
    gates = [torch.randn(E, H, device=dev) * H ** -0.5 for _ in range(layers)]
    biases = [torch.randn(E, device=dev) * 0.1 for _ in range(layers)]
    rows = []
    for t in token_counts:
        xs = [torch.randn(t, H, device=dev).bfloat16() for _ in range(layers)]
        logits = [torch.empty(t, E, device=dev) for _ in range(layers)]
        picks = [(torch.empty(t, K, device=dev), torch.empty(t, K, dtype=torch.int32, device=dev)) for _ in range(layers)]

        def gemv(i):
            router_logits(xs[i], gates[i], out=logits[i])

        def topk(i):
            grouped_topk_cuda(logits[i], biases[i], K, N_GROUP, TOPK_GROUP, True, SCALE,
                              weights=picks[i][0], ids=picks[i][1])

        def moe(i):
            experts[i].forward(xs[i], picks[i][0], picks[i][1])

        def stack(*parts):
            return stacked_time_us([functools.partial(p, i) for i in range(layers) for p in parts], iters) * len(parts)

        # every part once, so each layer's picks exist, then the reference's picks on the same logits
        for i in range(layers):
            gemv(i), topk(i), moe(i)
        torch.cuda.synchronize()
        want = [grouped_topk(lg, K, N_GROUP, TOPK_GROUP, b, True, SCALE)[1] for lg, b in zip(logits, biases)]
        off, near = tokens_off([p[1] for p in picks], want, logits, biases, ROUTING)
        row = {"tokens": t, "chain_us": stack(gemv, topk, moe), "no_topk_us": stack(gemv, moe),
               "gemv_topk_us": stack(gemv, topk), "topk_us": stack(topk), "moe_us": stack(moe),
               "gemv_us": stack(gemv), "picks_off": off, "near_tie": near}
        row["topk_in_chain_us"] = row["chain_us"] - row["no_topk_us"]
        rows.append(row)
        print(f"T={t}: chain {row['chain_us']:.2f} us/layer, without the top-k {row['no_topk_us']:.2f}, top-k alone "
              f"{row['topk_us']:.2f}", file=sys.stderr)
    return rows


def table(rows: list[dict], device: str, bw: float, how: str, layers: int, iters: int) -> str:
    lines = [f"# Ling's router between its real neighbours ({device})", "",
             f"Per MoE layer (us): {layers} distinct layers ({E} experts of {H} x {I} MXFP4, top-{K}, {N_GROUP} groups "
             f"keep {TOPK_GROUP}) in one CUDA graph, CUDA-graph medians of {iters} replays. The chain is the router "
             "GEMV, vllm-ling's grouped top-k and the routed experts' decode kernels (humming's layout); without the "
             "top-k the experts read picks made beforehand. Copy bandwidth in this run: "
             f"{bw:,.0f} GB/s ({how}).", "",
             "| tokens | chain | chain without the top-k | top-k in the chain (difference) | GEMV + top-k | top-k alone "
             "| experts alone | GEMV alone | tokens picking other experts than the reference, of layers x tokens (at a "
             "near tie) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['chain_us']:.2f} | {r['no_topk_us']:.2f} | {r['topk_in_chain_us']:.2f} | "
                     f"{r['gemv_topk_us']:.2f} | {r['topk_us']:.2f} | {r['moe_us']:.2f} | {r['gemv_us']:.2f} | "
                     f"{r['picks_off']} ({r['near_tie']}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4])
    parser.add_argument("--layers", type=int, default=8, help="distinct MoE layers (1.6 GB of experts each)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("router_in_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    bw, how = copy_bandwidth_gbs()
    rows = chain_rows(args.tokens, args.layers, args.iters)
    write_outputs(table(rows, torch.cuda.get_device_name(), bw, how, args.layers, args.iters), args.out)
    # a pick that differs away from a near tie is a wrong kernel; at a tie either side is right
    return 0 if all(r["picks_off"] == r["near_tie"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
