"""Ling's router top-k, decode batches and prefill chunks: vllm-ling's one-CTA-per-token kernel
(``vllm_ling.ops.router_topk``) against vLLM 0.32's ``grouped_topk_fused_kernel`` (the kernel vLLM's
``GroupedTopk`` runs for Ling: 12.5 us per MoE layer for one token in the real decode step,
``benchmarks/results/step_profile_real_h100.md``), in CUDA graphs of 40 distinct layers (a step's),
plus the tokens whose picked experts differ from the plain-PyTorch reference's, and how many of those
sit at a near tie (where either pick is right).

    python -m benchmarks.router_topk --out benchmarks/results/router_topk_h100.md   # on the GPU
    python -m benchmarks.router_topk --json rows.json ...   # the rows, machine-readable
    python -m benchmarks.router_topk --candidate-wins rows.json   # exit 0: the candidate variant
                                                                  # was right and faster at decode sizes

The whole router in one launch (gate GEMV + top-k, a candidate until lease 2026-12-07g) lost to the
served pair: ``benchmarks/results/serve_h200_runs/lease-2026-12-07g/router-bench/router-topk.md``.

The work reads 2 KB of logits and 2 KB of bias per layer: the copy-bandwidth column shows how far
from a memory-bound op this is (the time is launch and synchronisation, not bytes). Ours launches with
programmatic dependent launch on sm_90+ (as in serving, where the gate GEMV before it releases it
early), so in the stack each layer's launch overlaps the previous one; vLLM's does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

import torch

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us
from vllm_ling.ops.known_answer.router_topk import Routing, decision_margins
from vllm_ling.ops.router_topk.kernel import CANDIDATE_VARIANT

CONFIG = json.loads(resources.files("vllm_ling").joinpath("data/ling3_flash_fp4_config.json").read_text())
LAYERS = 40
NEAR_TIE = 1e-6  # fp32 sigmoid and sums round at ~6e-8 near 1: a margin below this is a tie either way
# the candidate replaces the served kernel only where it is this much faster at every decode size timed (a
# lease's run to run spread of one kernel's median is about 2%)
DECODE_TOKENS = (1, 4, 16)
CANDIDATE_MARGIN = 0.95


def candidate_wins(rows: list[dict]) -> tuple[bool, str]:
    """Whether the candidate variant (``CANDIDATE_VARIANT``) should serve, from :func:`main`'s JSON rows, and why:
    right at every
    size (no pick off the reference away from a near tie), and faster than the served kernel by
    ``CANDIDATE_MARGIN`` at every decode size in ``DECODE_TOKENS`` that was timed (at least one)."""
    rows = [r for r in rows if "candidate_us" in r]
    wrong = [r["tokens"] for r in rows if r["candidate_off"] != r["candidate_near_tie"]]
    if wrong:
        return False, f"{CANDIDATE_VARIANT} picked other experts than the reference at {wrong} tokens"
    decode = [r for r in rows if r["tokens"] in DECODE_TOKENS]
    if not decode:
        return False, f"no decode size ({', '.join(map(str, DECODE_TOKENS))} tokens) was timed"
    slower = [r for r in decode if r["candidate_us"] > CANDIDATE_MARGIN * r["ours_us"]]
    said = ", ".join(f"{r['tokens']}: {r['candidate_us']:.2f} vs {r['ours_us']:.2f} us" for r in decode)
    if slower:
        return False, f"{CANDIDATE_VARIANT} is not {1 - CANDIDATE_MARGIN:.0%} faster at every decode size ({said})"
    return True, f"{CANDIDATE_VARIANT} is right and faster ({said})"


def ling_routing() -> Routing:
    """The full-size model's router configuration (the packaged config)."""
    return Routing(CONFIG["num_experts"], CONFIG["n_group"], CONFIG["topk_group"], CONFIG["num_experts_per_tok"],
                   True, CONFIG["routed_scaling_factor"])


def vllm_kernel():
    """vLLM's fused grouped top-k (None where this vLLM has none)."""
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - kernel-only device bundles carry no vLLM
        return None
    if not hasattr(ops, "grouped_topk"):
        return None

    def run(logits, bias, top_k, n_group, topk_group, scale):
        return ops.grouped_topk(logits, n_group, topk_group, top_k, True, scale, bias, 1)
    return run


def tokens_off(got: list[torch.Tensor], want: list[torch.Tensor], logits: list[torch.Tensor],
               biases: list[torch.Tensor], routing: Routing) -> tuple[int, int]:
    """Over every layer: tokens whose picked set differs from the reference's, and how many of them sit
    at a near tie (an fp32 rounding apart, where either pick is right)."""
    off = near = 0
    for g, w, lg, b in zip(got, want, logits, biases):
        bad = (g.sort(dim=-1).values != w.sort(dim=-1).values).any(dim=-1).cpu()
        off += int(bad.sum())
        if bad.any():
            near += int((decision_margins(lg.cpu()[bad], b.cpu(), routing) < NEAR_TIE).sum())
    return off, near


def _off(counts: tuple[int, int] | None) -> str:
    return "-" if counts is None else f"{counts[0]} ({counts[1]})"


def main(argv: list[str] | None = None) -> int:
    from vllm_ling.ops.moe.routing import grouped_topk
    from vllm_ling.ops.router_topk.kernel import grouped_topk_cuda

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 16, 256, 2048])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--candidate-wins", metavar="ROWS_JSON", default=None,
                        help="only judge an earlier run's rows: exit 0 where the candidate variant should serve")
    args = parser.parse_args(argv)
    if args.candidate_wins:
        wins, why = candidate_wins(json.loads(Path(args.candidate_wins).read_text()))
        print(why)
        return 0 if wins else 1
    routing = ling_routing()
    e, n_group, topk_group, top_k, scale = (routing.num_experts, routing.n_group, routing.topk_group,
                                            routing.top_k, routing.scale)
    bw, how = copy_bandwidth_gbs()
    theirs = vllm_kernel()
    rows = []
    for t in args.tokens:
        logits = [torch.randn(t, e, device="cuda") * 3 for _ in range(LAYERS)]
        biases = [torch.randn(e, device="cuda") * 0.1 for _ in range(LAYERS)]
        nbytes = 4 * (t * e + e + 2 * t * top_k)
        outs = [(torch.empty(t, top_k, device="cuda"), torch.empty(t, top_k, dtype=torch.int32, device="cuda"))
                for _ in range(LAYERS)]
        ours_us = stacked_time_us([lambda lg=lg, b=b, o=o: grouped_topk_cuda(lg, b, top_k, n_group, topk_group, True,
                                                                              scale, weights=o[0], ids=o[1])
                                   for lg, b, o in zip(logits, biases, outs)], args.iters)
        want = [grouped_topk(lg, top_k, n_group, topk_group, b, True, scale)[1] for lg, b in zip(logits, biases)]
        ours_off = tokens_off([o[1] for o in outs], want, logits, biases, routing)
        # the candidate variant (vllm_ling.ops.router_topk.kernel.VARIANTS), timed and checked alike
        cand_us = stacked_time_us([lambda lg=lg, b=b, o=o: grouped_topk_cuda(lg, b, top_k, n_group, topk_group, True,
                                                                             scale, weights=o[0], ids=o[1],
                                                                             variant=CANDIDATE_VARIANT)
                                  for lg, b, o in zip(logits, biases, outs)], args.iters)
        cand_off = tokens_off([o[1] for o in outs], want, logits, biases, routing)
        their_us, their_off = None, None
        if theirs is not None:
            their_us = stacked_time_us([lambda lg=lg, b=b: theirs(lg, b, top_k, n_group, topk_group, scale)
                                        for lg, b in zip(logits, biases)], args.iters)
            got = [theirs(lg, b, top_k, n_group, topk_group, scale)[1] for lg, b in zip(logits, biases)]
            their_off = tokens_off(got, want, logits, biases, routing)
        rows.append((t, ours_us, their_us, nbytes, ours_off, their_off, cand_us, cand_off))
        print(f"T={t}: ours {ours_us:.2f} us, vLLM {their_us if their_us is None else f'{their_us:.2f}'} us",
              file=sys.stderr)
    lines = [f"# Ling's router top-k, one MoE layer ({torch.cuda.get_device_name()})", "",
             f"{e} experts, {n_group} groups, {topk_group} kept, top-{top_k}, sigmoid with a correction bias, "
             f"renormalised x {scale}. CUDA-graph medians ({args.iters} replays) of {LAYERS} distinct layers, "
             f"us per layer. Copy bandwidth in this run: {bw:,.0f} GB/s ({how}).", "",
             "| tokens | vllm-ling kernel (us) | vLLM grouped_topk (us) | vLLM / ours | bytes | fraction of copy BW (ours) "
             f"| tokens picking other experts than the reference, of {LAYERS} x tokens (ours / vLLM; in brackets "
             f"those at a near tie, decision margin < {NEAR_TIE:g}) | candidate `{CANDIDATE_VARIANT}` (us) "
             "| candidate: tokens picking other experts |", "|---|---|---|---|---|---|---|---|---|"]
    for t, ours_us, their_us, nbytes, ours_off, their_off, cand_us, cand_off in rows:
        ratio = f"{their_us / ours_us:.2f}x" if their_us else "-"
        frac = nbytes / (ours_us * 1e-6) / (bw * 1e9)
        lines.append(f"| {t} | {ours_us:.2f} | {'-' if their_us is None else f'{their_us:.2f}'} | {ratio} | {nbytes:,} "
                     f"| {frac:.4f} | {_off(ours_off)} / {_off(their_off)} | {cand_us:.2f} | {_off(cand_off)} |")
    write_outputs("\n".join(lines) + "\n", args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"tokens": t, "ours_us": ours_us, "vllm_us": their_us, "ours_off": ours_off[0],
                        "ours_near_tie": ours_off[1], "candidate": CANDIDATE_VARIANT, "candidate_us": cand_us,
                        "candidate_off": cand_off[0], "candidate_near_tie": cand_off[1]}
                       for t, ours_us, their_us, _, ours_off, _, cand_us, cand_off in rows], f, indent=1)
    # a pick that differs away from a near tie is a wrong kernel; at a tie either side is right
    right = all(off == near and cand[0] == cand[1] for _, _, _, _, (off, near), _, _, cand in rows)
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
