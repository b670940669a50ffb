"""Ling-3.0-flash's MoE router GEMV at decode sizes on one GPU: vllm-ling's kernel
(``vllm_ling.ops.router``) against what vLLM 0.32's ``GateLinear`` runs for this gate on sm_90
and on DGX Spark (no specialized tier matches hidden 2560 x 512 experts with an fp32 weight:
``x.to(float32)`` then ``F.linear``, i.e. a cast launch and cuBLAS's fp32 GEMM).

For each row count: CUDA-graph median time per call with the gate rotated over more than the L2
(each call reads another copy), bytes moved (fp32 weight + BF16 x + fp32 logits), the fraction
of the device copy bandwidth measured in the same run, a device copy of the same bytes timed the
same way, and the ratio to the upstream path. ``--sweep`` also times other CTA widths and tokens
per pass. Every output is checked against the float64 reference first.

    python -m benchmarks.router --sweep --out benchmarks/results/router_h200.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us
from vllm_ling.ops.router import magnitude_bound, reference_router_logits, router_logits

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_ling", "data",
                      "ling3_flash_fp4_config.json")
ROTATE_BYTES = 240 << 20  # > 4x the H200's 60 MB L2
SWEEP = [(w, tb) for w in (1, 2, 4, 8) for tb in (1, 2, 4)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default="router_bench.md")
    p.add_argument("--json")
    args = p.parse_args(argv)

    cfg = json.load(open(CONFIG))
    e, h = cfg["num_experts"], cfg["hidden_size"]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_gbs, copy_how = copy_bandwidth_gbs()
    wbytes = e * h * 4
    copies = -(-ROTATE_BYTES // wbytes)
    w0 = torch.randn((e, h), device=dev, generator=gen) * h**-0.5
    ws = [w0] + [w0.clone() for _ in range(copies - 1)]
    half = wbytes // 2
    cp_src = [torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(copies)]
    cp_dst = [torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(copies)]
    same_copy_us = stacked_time_us([(lambda i=i: cp_dst[i].copy_(cp_src[i])) for i in range(copies)], args.replays)
    del cp_src, cp_dst
    head = (f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"L2 {props.L2_cache_size >> 20} MB; copy bandwidth {copy_gbs:.0f} GB/s ({copy_how}); "
            f"torch {torch.__version__}; gate {e} x {h} fp32 ({wbytes / 1e6:.2f} MB), {copies} copies rotated; "
            f"a device copy moving the same bytes: {same_copy_us:.2f} us")
    print(head, flush=True)

    def timed(fn):
        return stacked_time_us([(lambda i=i: fn(i)) for i in range(copies)], args.replays)

    results, notes = [], []
    for rows in args.rows:
        x = torch.randn((rows, h), device=dev, generator=gen).to(torch.bfloat16)
        ref, mag = reference_router_logits(x, w0), magnitude_bound(x, w0)
        err = float(((router_logits(x, w0).double() - ref).abs() / mag).max())
        if not err <= 2.0**-16:
            notes.append(f"rows {rows}: kernel error {err:.3g} S exceeds 2**-16 S")
        up_err = float(((F.linear(x.float(), w0).double() - ref).abs() / mag).max())
        row = dict(rows=rows, bytes=wbytes + rows * h * 2 + rows * e * 4, err=err, up_err=up_err,
                   us_ours=timed(lambda i: router_logits(x, ws[i])),
                   us_no_pdl=timed(lambda i: router_logits(x, ws[i], pdl=False)),
                   us_upstream=timed(lambda i: F.linear(x.to(torch.float32), ws[i])))
        if args.sweep:
            row["sweep"] = {f"w{w} tb{tb}": timed(lambda i, w=w, tb=tb: router_logits(x, ws[i], warps=w,
                                                                                   tokens_per_pass=tb))
                            for w, tb in SWEEP}
        print(row, flush=True)
        results.append(row)

    def frac(nbytes, us):
        return nbytes / (us * 1e-6) / (copy_gbs * 1e9)

    lines = [f"# Ling's MoE router GEMV at decode sizes ({datetime.date.today()})", "",
             f"`python -m benchmarks.router {' '.join(argv) if argv else ''}`".replace(" `", "`"), "", head, "",
             "Times: CUDA-graph median per call. `frac`: bytes over time as a fraction of the copy bandwidth. "
             "`upstream`: vLLM 0.32 GateLinear's path for this gate (cast to fp32 + cuBLAS fp32 F.linear). "
             "`err`: largest |out - ref| / S (S = |x| @ |w|.T, float64).", "",
             "| rows | MB | ours us | frac | err | ours no PDL us | upstream us | upstream frac | upstream err | "
             "vs upstream | same-bytes copy us |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['rows']} | {r['bytes'] / 1e6:.2f} | {r['us_ours']:.2f} | {frac(r['bytes'], r['us_ours']):.2f}"
                     f" | {r['err']:.1e} | {r['us_no_pdl']:.2f} | {r['us_upstream']:.2f} | "
                     f"{frac(r['bytes'], r['us_upstream']):.2f} | {r['up_err']:.1e} | "
                     f"{r['us_upstream'] / r['us_ours']:.2f}x | {same_copy_us:.2f} |")
    if args.sweep:
        keys = list(results[0]["sweep"])
        lines += ["", "Sweep (us per call; `w` expert rows per CTA, `tb` tokens per pass; default w4 tb2):", "",
                  "| rows | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for r in results:
            lines.append(f"| {r['rows']} | " + " | ".join(f"{r['sweep'][k]:.2f}" for k in keys) + " |")
    lines += [""] + [f"- {n}" for n in notes]
    write_outputs("\n".join(lines) + "\n", args.out, args.json, dict(head=head, results=results))
    return 1 if notes else 0


if __name__ == "__main__":
    raise SystemExit(main())
