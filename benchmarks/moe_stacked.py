"""Per-layer time of the humming MoE path when several layers share one CUDA graph (H200).

benchmarks/moe.py times one layer per graph, so each figure includes ~10 us of graph
launch. A decode step replays one graph over all 40 MoE layers; this captures N distinct
layers (own weights, own routing) back to back in one graph and reports graph time / N,
next to the single-layer graph, with the copy bandwidth measured in the same run.
Output: benchmarks/results/moe_stacked_h200.md. No vLLM import.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from moe import copy_bandwidth_gbs  # noqa: E402  (same probe as benchmarks/moe.py)
from timing import stacked_time_us  # noqa: E402

from vllm_ling.ops.moe import HummingMxfp4Experts, random_mxfp4_experts  # noqa: E402

E, H, I, K = 512, 2560, 768, 8


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/moe_stacked_h200.md"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth_gbs(dev)
    layers = [HummingMxfp4Experts(**random_mxfp4_experts(E, H, I, dev, seed=i)) for i in range(args.layers)]
    rows = []
    for tokens in (1, 4, 16):
        gen = torch.Generator(device=dev).manual_seed(tokens)
        xs = [torch.randn(tokens, H, device=dev, dtype=torch.bfloat16, generator=gen) for _ in layers]
        ids = [torch.stack([torch.randperm(E, device=dev, generator=gen)[:K] for _ in range(tokens)]).to(torch.int32)
               for _ in layers]
        ws = [torch.rand(tokens, K, device=dev, generator=gen) for _ in layers]
        single = stacked_time_us([lambda: layers[0].forward(xs[0], ws[0], ids[0])], args.iters)
        stacked = stacked_time_us([functools.partial(l.forward, x, w, i) for l, x, w, i in zip(layers, xs, ws, ids)],
                                  args.iters)
        touched = min(E, tokens * K) * (3 * H * I) * (0.5 + 1 / 32) / 1e6  # distinct experts, upper bound
        rows.append((tokens, single, stacked, touched, touched * 1e3 / stacked / bw))
    lines = ["# Humming MoE layer time inside a multi-layer CUDA graph (H200)", "",
             f"{args.layers} distinct MoE layers (512 experts, top-8, 2560/768, W4A16) captured back to back in one "
             f"graph; per-layer time = graph median / {args.layers}. Copy bandwidth in this run: {bw:,.0f} GB/s.", "",
             "| tokens | one layer per graph (us) | per layer, stacked graph (us) | MB touched (upper bound) | fraction of copy BW (stacked) | target (us) |",
             "|---|---|---|---|---|---|"]
    targets = {1: "20", 4: "45", 16: "-"}
    for t, single, stacked, mb, frac in rows:
        lines.append(f"| {t} | {single:.1f} | {stacked:.1f} | {mb:.1f} | {frac:.2f} | {targets[t]} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
