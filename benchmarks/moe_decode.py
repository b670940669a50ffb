#!/usr/bin/env python3
"""MoE decode kernels (vllm_ling.ops.moe.decode) vs humming's GEMM, one Ling MoE layer (on the GPU it runs on).

Per-layer time of the routed experts for 1, 2, 4, 8, 16 and 32 tokens (32 is the default
dispatch threshold, VLLM_LING_MOE_DECODE_MAX_TOKENS):
- "stacked": N distinct layers (own weights, own routing) captured back to back in one CUDA
  graph, time / N -- what a decode step sees, and the figure the targets apply to; "single":
  one layer per graph (adds the graph launch);
- humming W4A16 GEMM (five launches, HummingMxfp4Experts with decode="off") and the two-launch
  decode kernels: on humming's own weights (the default, "humming layout"; "default" = the
  per-token-count launch shapes the package picks) and on a GEMV-packed copy ("packed copy",
  VLLM_LING_MOE_DECODE=copy), with launch-shape variants as levers;
- bytes of weights + scales of the distinct experts touched, the device copy bandwidth
  measured in this run and the fraction of it reached, ratio to humming in this run;
- the error of both paths against the float32 reference on the same MXFP4 weights.
``--swiglu-limit L`` times a layer with a per-layer clamp (Ling-3.0-flash: 4 on layers 35-41) in
the mode ``--clamp`` (default: the one served, after the SiLU), so the two modes can be compared.
Writes benchmarks/results/moe_decode_h200.md. No vLLM import.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from benchmarks.moe import PER_EXPERT_BYTES, copy_bandwidth_gbs, log
from benchmarks.timing import stacked_time_us
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, SwigluClamp
from vllm_ling.ops.moe.decode.layouts import HummingLayoutDecode, PackedLayoutDecode
from vllm_ling.ops.moe.decode.shapes import (HummingDecodeConfig, PackedDecodeConfig, RegisterDown,
                                             StreamedGateUp)
from vllm_ling.ops.moe.humming import HummingMxfp4Experts
from vllm_ling.ops.moe.reference import experts_reference
from vllm_ling.ops.moe.warmup import random_mxfp4_experts

REPO = Path(__file__).resolve().parents[1]

E, H, I, K = 512, 2560, 768, 8
TARGET_US = {1: 20.0, 4: 45.0}
C, SG, RD = HummingDecodeConfig, StreamedGateUp, RegisterDown
HL_VARIANTS = {
    "default": None,  # the package's per-token-count shapes
    "no PDL": C(use_pdl=False),
    "gate_up cluster 4": C(gate_up=SG(cluster=4)),
    "gate_up 3 stages min 5 CTAs/SM": C(gate_up=SG(stages=3, min_blocks=5)),
    "gate_up 6 stages min 3 CTAs/SM": C(gate_up=SG(stages=6, min_blocks=3)),
    "gate_up 2 groups/stage": C(gate_up=SG(groups_per_stage=2, min_blocks=3)),
    "gate_up 2 blocks/CTA min 8 CTAs/SM": C(gate_up=SG(blocks_per_cta=2, min_blocks=8)),
    "gate_up 6 blocks/CTA min 3 CTAs/SM": C(gate_up=SG(blocks_per_cta=6, min_blocks=3)),
    "gate_up 12 blocks/CTA min 2 CTAs/SM": C(gate_up=SG(blocks_per_cta=12, min_blocks=2)),
    "down 3 groups/warp min 2 CTAs/SM": C(down=RD(groups_per_warp=3, min_blocks=2)),
    "down 6 groups/warp": C(down=RD(groups_per_warp=6)),
}
VARIANTS = {
    "default": PackedDecodeConfig(),
    "no PDL": PackedDecodeConfig(use_pdl=False),
    "gate_up 4 warps/CTA": PackedDecodeConfig(k_split_gate_up=4, min_blocks_gate_up=4),
    "gate_up 10 warps/CTA": PackedDecodeConfig(k_split_gate_up=10, min_blocks_gate_up=2),
    "gate_up min 2 CTAs/SM": PackedDecodeConfig(min_blocks_gate_up=2),
    "down 2 warps/slot": PackedDecodeConfig(k_split_down=2, min_blocks_down=1),
    "down 3 warps/slot": PackedDecodeConfig(k_split_down=3),
}


assert not any("," in name for name in (*HL_VARIANTS, *VARIANTS)), "--variants splits names on commas"


def routing(T: int, seed: int, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, device=dev, generator=g) + 0.1
    return x, (w / w.sum(-1, keepdim=True) * 2.5).float(), ids


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--hl-variants", default=",".join(HL_VARIANTS))
    ap.add_argument("--swiglu-limit", type=float, default=None, help="per-layer SwiGLU limit (default: none)")
    ap.add_argument("--clamp", default=ROUTED_EXPERT_CLAMP.value, choices=[m.value for m in SwigluClamp])
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/moe_decode_h200.md"))
    args = ap.parse_args()
    limit, clamp = args.swiglu_limit, SwigluClamp(args.clamp)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth_gbs(dev)
    log(f"copy bandwidth {bw:,.0f} GB/s; building {args.layers} layers")
    raw = [random_mxfp4_experts(E, H, I, dev, seed=i) for i in range(args.layers)]
    fused = [PackedLayoutDecode(**t, top_k=K, clamp=clamp) for t in raw]
    humming = [HummingMxfp4Experts(**t, decode="off", clamp=clamp) for t in raw]
    hl = [HummingLayoutDecode(h, K) for h in humming]
    ref_tensors = raw[0]
    del raw
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    hl_variants = [v for v in args.hl_variants.split(",") if v]
    rows, errors, steps = [], [], []
    for T in tokens:
        inputs = [(*routing(T, 1000 * T + i, dev), limit) for i in range(args.layers)]
        touched = sum(torch.unique(ids).numel() for _, _, ids, _ in inputs) / len(inputs) * PER_EXPERT_BYTES / 1e6

        def stacked(layers):
            return stacked_time_us([functools.partial(l.forward, *inp) for l, inp in zip(layers, inputs)],
                                   args.iters)

        def single(layer):
            return stacked_time_us([functools.partial(layer.forward, *inputs[0])], args.iters)

        h_st, h_si = stacked(humming), single(humming[0])
        rows.append(("humming W4A16", T, h_si, h_st, touched))
        for name in variants:
            layers = fused if name == "default" else [f.with_config(VARIANTS[name]) for f in fused]
            rows.append((f"decode kernels, packed copy, {name}", T, single(layers[0]), stacked(layers), touched))
            log(f"T={T} {name}: {rows[-1][3]:.1f} us/layer stacked (humming {h_st:.1f})")
        for name in hl_variants:
            layers = hl if HL_VARIANTS[name] is None else [d.with_config(HL_VARIANTS[name]) for d in hl]
            rows.append((f"decode kernels, humming layout, {name}", T, single(layers[0]), stacked(layers), touched))
            log(f"T={T} humming layout {name}: {rows[-1][3]:.1f} us/layer stacked (humming {h_st:.1f})")
        # each fused kernel alone (stacked), default configs
        for label, impl in (("packed copy", fused), ("humming layout", hl)):
            acts = [f.gate_up(x, ids, limit) for f, (x, _, ids, _) in zip(impl, inputs)]
            gu = stacked_time_us([functools.partial(f.gate_up, x, ids, limit)
                                  for f, (x, _, ids, _) in zip(impl, inputs)], args.iters)
            dn = stacked_time_us([functools.partial(f.down, a, w, ids)
                                  for f, a, (_, w, ids, _) in zip(impl, acts, inputs)], args.iters)
            steps.append((label, T, gu, dn))
        x, w, ids, _ = inputs[0]
        ref = experts_reference(x, ref_tensors["w13_weight"], ref_tensors["w2_weight"], w, ids, limit,
                                w13_scale=ref_tensors["w13_weight_scale"],
                                w2_scale=ref_tensors["w2_weight_scale"], clamp=clamp)
        for label, layer in (("humming W4A16", humming[0]), ("decode kernels, packed copy", fused[0]),
                             ("decode kernels, humming layout", hl[0])):
            errors.append((label, T, ((layer(x, w, ids, limit).float() - ref).norm() / ref.norm()).item()))
    lines = [f"# MoE decode kernels vs humming's GEMM, one Ling MoE layer ({torch.cuda.get_device_name()})", "",
             f"512 experts, top-8, hidden 2560, intermediate 768, MXFP4 weights, BF16 activations, routed experts "
             f"only, SwiGLU limit {'none' if limit is None else f'{limit:g}, {clamp.describe()}'}. "
             f"Copy bandwidth measured in this run: **{bw:,.0f} GB/s**. CUDA-graph medians ({args.iters} "
             f"replays); 'stacked' = {args.layers} distinct layers in one graph, time / {args.layers}; 'single' = "
             f"one layer per graph. MB = weights + E8M0 scales of the distinct experts touched.", "",
             "| path | tokens | single (us) | stacked (us/layer) | MB touched | fraction of copy BW (stacked) "
             "| speed-up vs humming (stacked) | target (us) |", "|---|---|---|---|---|---|---|---|"]
    h_by_t = {T: st for p, T, _, st, _ in rows if p == "humming W4A16"}
    for path, T, si, st, mb in rows:
        target = TARGET_US.get(T, "-") if path != "humming W4A16" else "-"
        lines.append(f"| {path} | {T} | {si:.1f} | {st:.1f} | {mb:.1f} | {mb * 1e3 / st / bw:.2f} | "
                     f"{h_by_t[T] / st:.2f}x | {target} |")
    lines += ["", "Each fused kernel alone (default launch shapes, stacked graph, us per layer):", "",
              "| kernels | tokens | gate_up + SwiGLU | down + top-k sum |", "|---|---|---|---|"]
    lines += [f"| {label} | {T} | {gu:.1f} | {dn:.1f} |" for label, T, gu, dn in steps]
    lines += ["", "Relative error ||out - ref|| / ||ref|| vs the float32 reference (same MXFP4 weights):", "",
              "| path | tokens | rel. error |", "|---|---|---|"]
    lines += [f"| {p} | {T} | {e:.1e} |" for p, T, e in errors]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
