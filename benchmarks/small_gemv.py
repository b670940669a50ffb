"""Ling-3.0-flash's small linears at decode sizes on one GPU: vllm-ling's small GEMV
(``vllm_ling.ops.small_gemv``) against what vLLM 0.32 runs for each.

- the MoE router gate (512 experts x 2560, fp32 weight, fp32 logits; 41 layers): vLLM's
  ``GateLinear`` has no specialized tier for this shape on sm_90 or DGX Spark, so it runs
  ``x.to(float32)`` then ``F.linear`` (a cast launch and cuBLAS's fp32 GEMM);
- the BF16 linears the checkpoint leaves unquantized (KDA ``b_proj`` 35 layers, MLA ``g_proj``
  8 layers: 32 x 2560 each, per tensor-parallel rank 32 / tp): vLLM's ``UnquantizedLinearMethod``,
  i.e. cuBLAS's BF16 GEMM.

For each linear and row count: CUDA-graph median time per call with the weights rotated over
more than the L2 (each call reads another copy), bytes moved, the fraction of the device copy
bandwidth measured in the same run, a device copy of the same bytes timed the same way, and the
ratio to the upstream path. ``--sweep`` also times other CTA widths and tokens per pass. Every
output is checked against the float64 reference first.

    python -m benchmarks.small_gemv --sweep --out benchmarks/results/small_gemv_h200.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us
from vllm_ling.ops.small_gemv import MAX_ROWS, magnitude_bound, reference_gemv, small_gemv

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_ling", "data",
                      "ling3_flash_fp4_config.json")
ROTATE_BYTES = 240 << 20  # > 4x the H200's 60 MB L2
SWEEP = [(w, tb) for w in (1, 2, 4, 8) for tb in (1, 2, 4)]


@dataclasses.dataclass
class Linear:
    name: str
    n: int
    k: int
    weight_dtype: torch.dtype
    out_dtype: torch.dtype
    layers: int

    def upstream(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight_dtype), w)  # GateLinear's cast (fp32) or a no-op (BF16)


def ling_linears(cfg: dict) -> list[Linear]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] + cfg["num_nextn_predict_layers"]
    mla_layers = cfg["num_hidden_layers"] // cfg["layer_group_size"] + cfg["num_nextn_predict_layers"]
    kda_layers = cfg["num_hidden_layers"] - cfg["num_hidden_layers"] // cfg["layer_group_size"]
    return [Linear("router gate (fp32)", cfg["num_experts"], h, torch.float32, torch.float32, moe_layers),
            Linear("b_proj / MLA g_proj (BF16)", heads, h, torch.bfloat16, torch.bfloat16, kda_layers + mla_layers),
            Linear("b_proj / MLA g_proj at TP=2 (BF16)", heads // 2, h, torch.bfloat16, torch.bfloat16, 0)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, MAX_ROWS])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default="small_gemv_bench.md")
    p.add_argument("--json")
    args = p.parse_args(argv)

    cfg = json.load(open(CONFIG))
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_gbs, copy_how = copy_bandwidth_gbs()
    head = (f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"L2 {props.L2_cache_size >> 20} MB; copy bandwidth {copy_gbs:.0f} GB/s ({copy_how}); "
            f"torch {torch.__version__}")
    print(head, flush=True)

    results, notes = [], []
    for lin in ling_linears(cfg):
        wbytes = lin.n * lin.k * torch.empty((), dtype=lin.weight_dtype).element_size()
        copies = -(-ROTATE_BYTES // wbytes)
        w0 = (torch.randn((lin.n, lin.k), device=dev, generator=gen) * lin.k**-0.5).to(lin.weight_dtype)
        ws = [w0] + [w0.clone() for _ in range(copies - 1)]
        half = max(16, wbytes // 2)
        cp_src = [torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(copies)]
        cp_dst = [torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(copies)]
        copy_us = stacked_time_us([(lambda i=i: cp_dst[i].copy_(cp_src[i])) for i in range(copies)], args.replays)
        del cp_src, cp_dst

        def timed(fn):
            return stacked_time_us([(lambda i=i: fn(i)) for i in range(copies)], args.replays)

        for rows in args.rows:
            x = torch.randn((rows, lin.k), device=dev, generator=gen).to(torch.bfloat16)
            ref, mag = reference_gemv(x, w0), magnitude_bound(x, w0)
            rel = 2.0**-8 * ref.abs() if lin.out_dtype == torch.bfloat16 else 0.0
            err = float(((small_gemv(x, w0, lin.out_dtype).double() - ref).abs() / (rel + 2.0**-16 * mag)).max())
            up_err = float(((lin.upstream(x, w0).double() - ref).abs() / (rel + 2.0**-16 * mag)).max())
            if not err <= 1:
                notes.append(f"{lin.name} rows {rows}: kernel error {err:.3g} of the tolerance")
            row = dict(linear=lin.name, n=lin.n, k=lin.k, layers=lin.layers, rows=rows,
                       bytes=wbytes + rows * lin.k * 2 + rows * lin.n * torch.empty((), dtype=lin.out_dtype).element_size(),
                       err=err, up_err=up_err, us_copy=copy_us,
                       us_ours=timed(lambda i: small_gemv(x, ws[i], lin.out_dtype)),
                       us_no_pdl=timed(lambda i: small_gemv(x, ws[i], lin.out_dtype, pdl=False)),
                       us_upstream=timed(lambda i: lin.upstream(x, ws[i])))
            if args.sweep:
                row["sweep"] = {f"w{w} tb{tb}": timed(lambda i, w=w, tb=tb: small_gemv(
                    x, ws[i], lin.out_dtype, warps=w, tokens_per_pass=tb)) for w, tb in SWEEP}
            print(row, flush=True)
            results.append(row)

    def frac(nbytes, us):
        return nbytes / (us * 1e-6) / (copy_gbs * 1e9)

    lines = [f"# Ling's small linears at decode sizes ({datetime.date.today()})", "",
             f"`python -m benchmarks.small_gemv {' '.join(argv)}`", "", head, "",
             "Times: CUDA-graph median per call, weights rotated over > 4x L2. `frac`: bytes over time as a "
             "fraction of the copy bandwidth. `upstream`: what vLLM 0.32 runs (router gate: GateLinear's cast to "
             "fp32 + cuBLAS fp32 F.linear; BF16 linears: cuBLAS BF16 F.linear). `err`: largest |out - ref| over "
             "the tolerance (2**-8 |ref| for BF16 outputs + 2**-16 S, S = |x| @ |w|.T; <= 1 passes).", "",
             "| linear (layers) | rows | MB | ours us | frac | err | ours no PDL us | upstream us | upstream err | "
             "vs upstream | same-bytes copy us |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['linear']} ({r['layers']}) | {r['rows']} | {r['bytes'] / 1e6:.3f} | {r['us_ours']:.2f} | "
                     f"{frac(r['bytes'], r['us_ours']):.2f} | {r['err']:.2f} | {r['us_no_pdl']:.2f} | "
                     f"{r['us_upstream']:.2f} | {r['up_err']:.2f} | {r['us_upstream'] / r['us_ours']:.2f}x | "
                     f"{r['us_copy']:.2f} |")
    per_step = {}
    for r in results:
        if r["layers"]:
            ours, up = per_step.get(r["rows"], (0.0, 0.0))
            per_step[r["rows"]] = (ours + r["us_ours"] * r["layers"], up + r["us_upstream"] * r["layers"])
    lines += ["", "Per decode step (sum over every layer that runs each linear):", ""]
    lines += [f"- {rows} row(s): ours {o:.0f} us, upstream {u:.0f} us" for rows, (o, u) in sorted(per_step.items())]
    if args.sweep:
        keys = [f"w{w} tb{tb}" for w, tb in SWEEP]
        lines += ["", "Sweep (us per call; `w` weight rows per CTA, `tb` tokens per pass; the defaults are "
                  "`vllm_ling.ops.small_gemv.kernel.default_launch`):", "", "| linear | rows | " + " | ".join(keys) + " |",
                  "|---|---|" + "---|" * len(keys)]
        for r in results:
            lines.append(f"| {r['linear']} | {r['rows']} | " + " | ".join(f"{r['sweep'][k]:.2f}" for k in keys) + " |")
    lines += [""] + [f"- {n}" for n in notes]
    write_outputs("\n".join(lines) + "\n", args.out, args.json, dict(head=head, results=results))
    return 1 if notes else 0


if __name__ == "__main__":
    raise SystemExit(main())
