#!/usr/bin/env python3
"""Triton MXFP4 decode experts vs humming, one Ling MoE layer at 1 and 4 tokens (H200).

In one run: the device copy bandwidth (benchmarks/moe.py's probe), humming W4A16
(``HummingMxfp4Experts``) and each Triton decode variant (``TritonMxfp4DecodeExperts``,
modes x block configs), all as CUDA-graph medians:
- "single": one layer per graph, R different routings replayed round-robin (one graph each)
  so consecutive replays do not find the previous routing's 25 MB in L2;
- "stacked": N distinct layers (own weights and routing) captured back to back in one graph,
  per-layer time = graph median / N (as benchmarks/moe_stacked.py), the decode-step setting.
Bytes touched = distinct experts x MXFP4 bytes per expert (weights + E8M0 scales); error =
relative Frobenius error vs the float32 reference (vllm_ling.ops.moe.experts_reference) on
the same MXFP4 weights. Writes benchmarks/results/moe_decode_triton_h200.md. No vLLM import.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from moe import copy_bandwidth_gbs, log, make_routings, stacked_time_us, time_fn  # noqa: E402  (same probes as benchmarks/moe.py)

from vllm_ling.ops import moe  # noqa: E402
from vllm_ling.ops.moe_decode_triton import TritonMxfp4DecodeExperts  # noqa: E402

E, H, I, K = 512, 2560, 768, 8
PER_EXPERT_BYTES = 3 * H * I // 2 + 3 * H * I // 32
TARGET_US = {1: 20.0, 4: 45.0}
# (block_i, block_h, block_k_gate_up, block_k_down, num_warps, num_stages)
# block_h = rows per expert in the down tile (the tile holds top_k * block_h rows).
CONFIGS = [(16, 4, 256, 256, 4, 3), (32, 4, 256, 256, 4, 3), (16, 8, 512, 256, 4, 3),
           (16, 2, 256, 256, 4, 2), (32, 8, 512, 256, 8, 3), (16, 4, 256, 128, 2, 3),
           (16, 4, 512, 256, 4, 3)]


def rel_err(fn, weights, inputs) -> float:
    errs = []
    for x, w, ids in inputs[:2]:
        ref = moe.experts_reference(x, weights["w13_weight"], weights["w2_weight"], w, ids,
                                    w13_scale=weights["w13_weight_scale"],
                                    w2_scale=weights["w2_weight_scale"])
        errs.append(((fn(x, w, ids).float() - ref).norm() / ref.norm()).item())
    return max(errs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--routings", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="stop sweeping Triton configs after this many seconds")
    ap.add_argument("--configs", default="all", help="'all' or comma-separated indices into CONFIGS")
    ap.add_argument("--modes", default="words_fma")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/moe_decode_triton_h200.md"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    bw = copy_bandwidth_gbs(dev)
    log(f"copy bandwidth {bw:,.0f} GB/s; {torch.cuda.get_device_name(dev)}; torch {torch.__version__}")
    import triton
    log(f"triton {triton.__version__}")
    weights = [moe.random_mxfp4_experts(E, H, I, dev, seed=i) for i in range(args.layers)]
    inputs = {T: [make_routings(T, args.routings, 100 * T + l, dev) for l in range(args.layers)] for T in (1, 4)}
    touched = {T: statistics.mean(torch.unique(ids).numel() for _, _, ids in inputs[T][0]) * PER_EXPERT_BYTES
               for T in (1, 4)}

    results = []  # dicts: path, T, single, stacked, err
    variants = {}  # label -> (block_i, block_h, bk_gate_up, bk_down, warps, stages, mode)
    splits = []  # (T, label, gate_up us, down us)

    def measure(label, layers_fns):
        """layers_fns: one callable (x, w, ids) per layer."""
        for T in (1, 4):
            try:
                err = rel_err(layers_fns[0], weights[0], inputs[T][0])
                single = time_fn(layers_fns[0], inputs[T][0], args.iters)
                stacked = stacked_time_us(
                    [lambda f=f, a=inputs[T][l][0]: f(*a) for l, f in enumerate(layers_fns)], args.iters)
                results.append(dict(path=label, T=T, single=single, stacked=stacked, err=err))
                log(f"{label} T={T}: single {single:.1f} us, stacked {stacked:.1f} us/layer, err {err:.2e}")
            except Exception as exc:  # keep measuring the other variants
                traceback.print_exc()
                results.append(dict(path=label, T=T, single=None, stacked=None, err=None,
                                    failure=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
                log(f"{label} T={T}: FAILED {exc!r}"[:300])

    # humming baseline
    try:
        from vllm_ling.ops.humming_cache import configure_humming_cache
        configure_humming_cache()
        humming = [moe.HummingMxfp4Experts(**w) for w in weights]
        measure("humming W4A16", [h.forward for h in humming])
        del humming
        torch.cuda.empty_cache()
    except Exception as exc:
        traceback.print_exc()
        log(f"humming unavailable: {exc!r}")

    configs = CONFIGS if args.configs == "all" else [CONFIGS[int(i)] for i in args.configs.split(",")]
    for cfg in configs:
        for mode in args.modes.split(","):
            if time.perf_counter() - t_start > args.budget_s:
                log(f"budget reached, skipping {mode} {cfg}")
                continue
            bi, bh, bk1, bk2, nw, ns = cfg
            label = f"triton {mode} bi{bi} bh{bh} bk{bk1}/{bk2} w{nw} s{ns}"
            try:
                layers = [TritonMxfp4DecodeExperts(**w, mode=mode, block_i=bi, block_h=bh,
                                                   block_k_gate_up=bk1, block_k_down=bk2,
                                                   num_warps=nw, num_stages=ns) for w in weights]
            except Exception as exc:
                log(f"{label}: construction failed {exc!r}")
                continue
            variants[label] = cfg + (mode,)
            measure(label, [l.forward for l in layers])
            write(args, bw, touched, results, splits)
    # Where the time goes: each launch of the best variant alone, stacked over the layers.
    for T in (1, 4):
        ok = [r for r in results if r["T"] == T and r["path"] in variants and r["stacked"]]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["stacked"])
        bi, bh, bk1, bk2, nw, ns, mode = variants[best["path"]]
        try:
            layers = [TritonMxfp4DecodeExperts(**w, mode=mode, block_i=bi, block_h=bh, block_k_gate_up=bk1,
                                               block_k_down=bk2, num_warps=nw, num_stages=ns) for w in weights]
            ins = [inputs[T][l][0] for l in range(len(layers))]
            acts = [l.gate_up(x, ids, None) for l, (x, _, ids) in zip(layers, ins)]
            t_gu = stacked_time_us([lambda l=l, a=a: l.gate_up(a[0], a[2], None) for l, a in zip(layers, ins)],
                                   args.iters)
            t_dn = stacked_time_us([lambda l=l, a=a, act=act: l.down(act, a[1], a[2])
                                    for l, a, act in zip(layers, ins, acts)], args.iters)
            splits.append((T, best["path"], t_gu, t_dn))
            log(f"split T={T} {best['path']}: gate_up {t_gu:.1f} us, down {t_dn:.1f} us")
        except Exception as exc:
            traceback.print_exc()
            log(f"split T={T} failed: {exc!r}")
    write(args, bw, touched, results, splits)
    return 0


def write(args, bw, touched, results, splits=()) -> None:
    base = {r["T"]: r for r in results if r["path"] == "humming W4A16" and r["stacked"]}
    best = {}
    for r in results:
        if r["path"].startswith("triton") and r["stacked"] and (r["T"] not in best or r["stacked"] < best[r["T"]]["stacked"]):
            best[r["T"]] = r
    lines = ["# Triton MXFP4 decode experts vs humming, one Ling MoE layer (H200)", "",
             f"512 experts, top-8, hidden 2560, intermediate 768, MXFP4 weights, BF16 activations. "
             f"Copy bandwidth in this run: {bw:,.0f} GB/s. CUDA-graph medians ({args.iters} replays): "
             f"'single' = one layer per graph, {args.routings} routings round-robin; 'stacked' = "
             f"{args.layers} distinct layers in one graph, per-layer time = median / {args.layers}. "
             f"Bytes touched = distinct experts x {PER_EXPERT_BYTES / 1e6:.3f} MB (weights + E8M0 scales); "
             "error = ||out - ref|| / ||ref|| vs the float32 reference on the same MXFP4 weights.", "",
             "| path | tokens | single (us) | stacked (us/layer) | MB touched | fraction of copy BW (stacked) "
             "| humming / this (stacked) | rel. error | target (us) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        T = r["T"]
        mb = touched[T] / 1e6
        if not r["stacked"]:
            lines.append(f"| {r['path']} | {T} | failed: {r.get('failure', '')} | | {mb:.1f} | | | | {TARGET_US[T]:.0f} |")
            continue
        frac = touched[T] / (r["stacked"] * 1e-6) / (bw * 1e9)
        ratio = f"{base[T]['stacked'] / r['stacked']:.2f}" if T in base else "-"
        lines.append(f"| {r['path']} | {T} | {r['single']:.1f} | {r['stacked']:.1f} | {mb:.1f} | {frac:.2f} "
                     f"| {ratio} | {r['err']:.1e} | {TARGET_US[T]:.0f} |")
    lines += ["", "Best Triton variant per token count (stacked):", ""]
    for T, r in sorted(best.items()):
        verdict = "meets" if r["stacked"] <= TARGET_US[T] else "misses"
        vs = f", {base[T]['stacked'] / r['stacked']:.2f}x humming ({base[T]['stacked']:.1f} us)" if T in base else ""
        lines.append(f"- {T} token(s): {r['path']}: {r['stacked']:.1f} us/layer{vs}; {verdict} the "
                     f"{TARGET_US[T]:.0f} us target.")
    if splits:
        lines += ["", "Each launch of the best variant alone (stacked graph, us per layer; bytes: w13 is 2/3, "
                  "w2 1/3 of the layer's):", "", "| tokens | variant | gate_up + SwiGLU | down + weighted sum |",
                  "|---|---|---|---|"]
        lines += [f"| {T} | {label} | {gu:.1f} | {dn:.1f} |" for T, label, gu, dn in splits]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
