"""Dense block-FP8 linears of Ling-3.0-flash at decode sizes on one GPU: vllm-ling's W8A16
kernels (the CUDA decode kernel up to 32 rows, the Triton kernel as its fallback) against the
upstream-equivalent W8A8 path and BF16 cuBLAS, every shape, 1..32 rows.

Shapes: every dense block-FP8 linear vLLM 0.32 builds for the full config (merged as vLLM
merges them, KDA q|k|v|f|g as one linear while VLLM_LING_KDA_MERGED_IN_PROJ is on; TP=1; target and NEXTN
layers), from ``vllm_ling.models.dense_linears``. For each
shape and row count: CUDA-graph median time per call with the weights rotated over more than
the L2 (each call in the graph reads another copy), bytes moved, the fraction of the device
copy bandwidth measured in the same run, and the ratio to the upstream-equivalent kernel
(``benchmarks/upstream_fp8.py`` says what stands in for vLLM's DeepGEMM path and why).
Every kernel's output is checked against the float64 reference first (``err``: the largest
``|out - ref| / (2**-8 |ref| + 2**-14 S)``, S = sum of the terms' magnitudes; <= 1 passes).

    python -m benchmarks.dense_fp8                  # table with the tuned configs
    python -m benchmarks.dense_fp8 --sweep          # also sweep Triton launch configs; prints TUNED
    python -m benchmarks.dense_fp8 --sweep-decode   # also sweep the CUDA decode kernel; prints TUNED_DECODE

Prints a Markdown table and writes it to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us
from benchmarks.upstream_fp8 import ScaledMmBlockFp8, TritonW8A8BlockFp8
from vllm_ling.models.dense_linears import dense_fp8_linears
from vllm_ling.ops.dense_fp8 import kernel as K
from vllm_ling.ops.dense_fp8.decode_kernel import DecodeConfig
from vllm_ling.ops.dense_fp8.linear import device_facts, effective_config, launch_config, w8a16_linear
from vllm_ling.ops.dense_fp8.reference import magnitude_bound, reference_linear
from vllm_ling.ops.dense_fp8.tuned_configs import W8A16Config, select_config
from vllm_ling.ops.fp8 import block_fp8_dequantize, block_fp8_quantize

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_ling", "data",
                      "ling3_flash_fp4_config.json")
ROTATE_BYTES = 240 << 20  # > 4x the H200's 60 MB L2


def error_ratio(out: torch.Tensor, ref64: torch.Tensor, mag: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    tol = 2.0**-8 * ref64.abs() + 2.0**-14 * mag
    return float(((out - ref64).abs() / tol.clamp_min(1e-300)).max())


def sweep_candidates(rows: int, n: int, k: int, sm_count: int) -> list[W8A16Config]:
    kb = k // 128
    out = []

    def add(**kw):
        c = W8A16Config(**kw)
        progs = -(-n // c.block_n) * -(-rows // c.block_m) * c.split_k
        if not c.problems(n, k) and progs <= 16 * sm_count:
            out.append(c)

    splits = [s for s in (1, 2, 4, 8) if kb % s == 0]
    bm = 1 if rows == 1 else max(16, 1 << (rows - 1).bit_length())
    for pf in (False, True):
        if rows == 1:
            for bn, warps, ks in ((8, 2, 4), (16, 4, 4), (32, 4, 2), (32, 8, 2), (32, 8, 4)):
                for sk in splits:
                    add(block_n=bn, k_steps=ks, num_warps=warps, num_stages=2, split_k=sk, prefetch_l2=pf)
        elif rows == 2:
            for bn, warps, ks in ((16, 4, 4), (32, 8, 4)):
                for sk in splits:
                    add(block_n=bn, k_steps=ks, num_warps=warps, num_stages=2, block_m=2, split_k=sk, prefetch_l2=pf)
        # tensor cores, BF16 (first H200 run's winners are in TUNED) and FP16 inputs
        for bn, warps in ((64, 4), (128, 8)):
            for sk in splits:
                add(block_n=bn, k_steps=1, num_warps=warps, num_stages=3, block_m=max(16, bm), use_dot=True,
                    split_k=sk, prefetch_l2=pf, dot_f16=True)
                if rows > 2:
                    add(block_n=bn, k_steps=1, num_warps=warps, num_stages=3, block_m=max(16, bm), use_dot=True,
                        split_k=sk, prefetch_l2=pf)
    return out


def decode_sweep_candidates(rows: int, n: int, k: int) -> list[DecodeConfig]:
    """The CUDA decode kernel's shapes worth timing: one wave with 2..12 k-steps per warp and 1 or
    2 tiles per CTA (1 or 2 CTAs per SM planned); the streaming kernel with 2..8 k-steps per warp
    and 1..4 CTAs per SM."""
    out = []
    for ksplit in range(1, k // 64 + 1):
        steps = k // 64 // ksplit if (k // 64) % ksplit == 0 else 0
        for warps_n in (1, 2):
            for min_blocks in (1, 2):
                c = DecodeConfig(ksplit=ksplit, warps_n=warps_n, min_blocks=min_blocks)
                if not c.problems(n, k, rows) and 2 <= steps <= 12:
                    out.append(c)
        for ctas in (1, 2, 3, 4):
            c = DecodeConfig(ksplit=ksplit, stream=True, ctas_per_sm=ctas, min_blocks=min(ctas, 2))
            if not c.problems(n, k, rows) and 2 <= steps <= 8 and ctas * c.threads() <= 2048:
                out.append(c)
    return out


def describe(config) -> str:
    if isinstance(config, DecodeConfig):
        return (f"cuda{' stream x' + str(config.ctas_per_sm) if config.stream else ''} ks{config.ksplit} "
                f"wn{config.warps_n} minb{config.min_blocks}{' pdl' if config.pdl else ''}")
    c = dataclasses.asdict(config)
    return (f"{'dot' if c['use_dot'] else 'fma'} m{c['block_m']} n{c['block_n']} ks{c['k_steps']} "
            f"sk{c['split_k']} w{c['num_warps']} s{c['num_stages']}"
            f"{' pdl' if c['pdl'] else ''}{' pf' if c['prefetch_l2'] else ''}")


def config_record(config) -> dict:
    """A config as JSON: its fields and which kernel (``load_config`` reads it back)."""
    return {"kernel": "cuda" if isinstance(config, DecodeConfig) else "triton", **dataclasses.asdict(config)}


def load_config(record: dict):
    fields = {k: v for k, v in record.items() if k != "kernel"}
    return DecodeConfig(**fields) if record.get("kernel") == "cuda" else W8A16Config(**fields)


def precompile(configs: list[W8A16Config], x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
    """Compile every config once, in threads (Triton compiles in ptxas subprocesses)."""
    def one(c):
        try:
            w8a16_linear(x, w, s, config=c)
            return None
        except Exception as exc:  # noqa: BLE001 - reported by the caller's run
            return f"{type(exc).__name__}: {exc}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(one, configs))
    torch.cuda.synchronize()


@dataclasses.dataclass
class Shape:
    module: str
    n: int
    k: int
    layers: int


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="with --sweep: the row counts to sweep (others use the table)")
    parser.add_argument("--sweep-decode", action="store_true",
                        help="sweep the CUDA decode kernel's configs at --sweep-rows")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NxK",
                        help="only these weight shapes (the model's or others, e.g. 20480x2560)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "dense_fp8_h200.md"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    capability, sm_count = device_facts(dev)
    gen = torch.Generator(device=dev).manual_seed(1234)
    cfg = json.load(open(CONFIG))
    linears = [d for d in dense_fp8_linears(cfg) if d.decode]
    by_shape: dict[tuple[int, int], Shape] = {}
    for d in linears:
        sh = by_shape.setdefault(d.shape, Shape(d.module, d.out_features, d.in_features, 0))
        sh.layers += len(d.layers)
        if d.module not in sh.module:
            sh.module += " / " + d.module
    shapes = sorted(by_shape.values(), key=lambda s: -s.n * s.k)
    if args.shapes:  # e.g. a merge of linears that share their input, next to the parts
        wanted = [tuple(map(int, x.split("x"))) for x in args.shapes]
        shapes = [by_shape.get(nk) or Shape("(not in the model: a merge)", nk[0], nk[1], 0) for nk in wanted]
    copy_gbs, copy_how = copy_bandwidth_gbs()
    feats = K.triton_features()
    head = (f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"L2 {props.L2_cache_size >> 20} MB; copy bandwidth {copy_gbs:.0f} GB/s ({copy_how}); "
            f"torch {torch.__version__}, triton {K.triton.__version__}, triton features {feats}")
    print(head, flush=True)

    results, sweep_best, notes = [], {}, []
    for sh in shapes:
        n, k = sh.n, sh.k
        wbytes = n * k + 4 * (-(-n // 128)) * (k // 128)
        copies = max(2, min(256, -(-ROTATE_BYTES // wbytes)))
        w32 = torch.randn((n, k), device=dev, generator=gen) * 0.02
        q0, s0 = block_fp8_quantize(w32)
        wq = [q0] + [q0.clone() for _ in range(copies - 1)]
        ws = [s0] + [s0.clone() for _ in range(copies - 1)]
        bf16_copies = max(2, min(256, -(-ROTATE_BYTES // (2 * n * k))))
        wb0 = block_fp8_dequantize(q0, s0, dtype=torch.bfloat16)
        wb = [wb0] + [wb0.clone() for _ in range(bf16_copies - 1)]
        up_mm = up_tr = None
        try:
            up_mm = [ScaledMmBlockFp8(q, s) for q, s in zip(wq, ws)]
        except Exception as exc:  # noqa: BLE001
            notes.append(f"scaled_mm stand-in unavailable: {exc}")
        up_tr = [TritonW8A8BlockFp8(q, s) for q, s in zip(wq, ws)]
        # the same bytes moved by a device copy (half read, half written), rotated the same way:
        # what a kernel of this size reaches in this graph setting, launch and ramp included
        half = max(16, wbytes // 2)
        cp_src = [torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(copies)]
        cp_dst = [torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(copies)]
        same_copy_us = stacked_time_us([(lambda i=i: cp_dst[i].copy_(cp_src[i])) for i in range(copies)],
                                       args.replays)
        del cp_src, cp_dst
        print(f"shape {n}x{k} ({sh.module}, {sh.layers} layers): {wbytes / 1e6:.1f} MB, {copies} copies; "
              f"a copy moving the same bytes {same_copy_us:.2f} us", flush=True)
        for rows in args.rows:
            x = torch.randn((rows, k), device=dev, generator=gen).to(torch.bfloat16)
            ref = reference_linear(x, q0, s0, dtype=torch.float64)
            mag = magnitude_bound(x, q0, s0)
            nbytes = wbytes + rows * k * 2 + rows * n * 2

            def timed(fn_for_copy, count=copies):
                return stacked_time_us([(lambda i=i: fn_for_copy(i)) for i in range(count)], args.replays)

            row = dict(n=n, k=k, module=sh.module, layers=sh.layers, rows=rows, bytes=nbytes,
                       us_same_bytes_copy=same_copy_us)
            table_cfg, _ = select_config(n, k, rows, capability, sm_count)
            chosen = launch_config(n, k, rows, capability, sm_count)
            source = "selected (decode kernel table/heuristic)" if isinstance(chosen, DecodeConfig) else "selected"
            sweeps = []
            if args.sweep and rows in args.sweep_rows:
                sweeps.append(sweep_candidates(rows, n, k, sm_count) + [table_cfg])
            if args.sweep_decode and rows in args.sweep_rows:
                sweeps.append(decode_sweep_candidates(rows, n, k)
                              + ([chosen] if isinstance(chosen, DecodeConfig) else []))
            if sweeps:
                cands = list(dict.fromkeys(c for group in sweeps for c in group))
                t0 = time.perf_counter()
                precompile(cands, x, q0, s0)
                best = None
                for c in cands:
                    try:
                        out = w8a16_linear(x, q0, s0, out=torch.full((rows, n), float("nan"), dtype=torch.bfloat16,
                                                                      device=dev), config=c)
                        err = error_ratio(out, ref, mag)
                        if err > 1.0:
                            notes.append(f"sweep {n}x{k} rows {rows} {c}: error ratio {err:.3g} (FAILED)")
                            continue
                        us = timed(lambda i, c=c: w8a16_linear(x, wq[i], ws[i], config=c))
                    except Exception as exc:  # noqa: BLE001
                        notes.append(f"sweep {n}x{k} rows {rows} {c}: {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    if best is None or us < best[0]:
                        best = (us, c)
                print(f"  rows {rows}: swept {len(cands)} configs in {time.perf_counter() - t0:.1f} s; best "
                      f"{best[0]:.2f} us {describe(best[1])}", flush=True)
                chosen = best[1]
                source = "sweep best (this run)"
                sweep_best[(n, k, rows)] = (best[1], best[0])
            out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=dev)
            w8a16_linear(x, q0, s0, out=out, config=chosen)
            row["err_ours"] = error_ratio(out, ref, mag)
            if not isinstance(chosen, DecodeConfig):
                chosen = effective_config(chosen, capability)
            row["config"] = describe(chosen)
            row["config_source"] = source
            row["us_ours"] = timed(lambda i: w8a16_linear(x, wq[i], ws[i], config=chosen))
            if rows in (1, 4):  # what PDL is worth
                row["us_no_pdl"] = timed(lambda i: w8a16_linear(x, wq[i], ws[i],
                                                                config=dataclasses.replace(chosen, pdl=False)))
            triton_cfg = effective_config(table_cfg, capability)
            out.fill_(float("nan"))
            w8a16_linear(x, q0, s0, out=out, config=triton_cfg)
            row["err_triton"] = error_ratio(out, ref, mag)
            row["us_triton"] = timed(lambda i: w8a16_linear(x, wq[i], ws[i], config=triton_cfg))
            for key, objs in (("scaled_mm", up_mm), ("triton_w8a8", up_tr)):
                if objs is None:
                    continue
                try:
                    got = objs[0](x)
                    rel = float((got.double() - ref).norm() / ref.norm())
                    row[f"relerr_{key}"] = rel
                    row[f"us_{key}"] = timed(lambda i, o=objs: o[i](x))
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    notes.append(f"{key} at {n}x{k} rows {rows}: {type(exc).__name__}: {str(exc)[:200]}")
            row["us_bf16"] = timed(lambda i: F.linear(x, wb[i]), bf16_copies)
            results.append(row)
            up = row.get("us_scaled_mm")
            print(f"  rows {rows:2d}: ours {row['us_ours']:7.2f} us ({nbytes / row['us_ours'] / 1e3 / copy_gbs:.2f} of copy) "
                  f"err {row['err_ours']:.3f} {row['config']} | triton {row['us_triton']:7.2f} | scaled_mm {up if up else float('nan'):7.2f} | triton_w8a8 "
                  f"{row.get('us_triton_w8a8', float('nan')):7.2f} | bf16 {row['us_bf16']:7.2f}", flush=True)
        del wq, ws, wb, up_mm, up_tr
        torch.cuda.empty_cache()

    write_outputs(render(results, head, copy_gbs, notes, sweep_best, args), args.out, args.json,
                  {"copy_gbs": copy_gbs, "head": head, "results": results, "notes": notes,
                   "sweep_best": {f"{n}x{k}x{r}": [config_record(c), us]
                                  for (n, k, r), (c, us) in sweep_best.items()}})
    return 0


def render(results, head, copy_gbs, notes, sweep_best, args) -> str:
    def frac(nbytes, us):
        return nbytes / (us * 1e-6) / 1e9 / copy_gbs

    lines = [f"# Dense block-FP8 linears at decode sizes ({datetime.date.today().isoformat()})", "",
             f"`python -m benchmarks.dense_fp8 {' '.join(sys.argv[1:])}`", "", head, "",
             "Times: CUDA-graph median per call, weights rotated over > 4x L2. `frac`: bytes (FP8 weight + fp32 "
             "scales + BF16 x + BF16 out; BF16 weight for cuBLAS) over time, as a fraction of the copy bandwidth "
             "above. `vs up`: upstream-equivalent time / ours (> 1: ours faster). Upstream-equivalent = "
             f"{ScaledMmBlockFp8.name}; also {TritonW8A8BlockFp8.name}; and BF16 cuBLAS (`F.linear`). "
             "`err` <= 1 passes (see the script's docstring).", "",
             "`same-bytes copy`: a device copy moving the weight's bytes (half read, half written) in the same "
             "graph setting, i.e. what any kernel of this size reaches here, launch and ramp included.", "",
             "| shape N x K | module (layers) | rows | MB | ours us | frac | err | kernel config | up us | vs up | "
             "Triton W8A16 us | triton w8a8 us | bf16 us | ours no PDL | same-bytes copy us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        up = r.get("us_scaled_mm")
        up_cells = f"{up:.2f} | {up / r['us_ours']:.2f}" if up else "- | -"
        tw = r.get("us_triton_w8a8")
        nopdl = f"{r['us_no_pdl']:.2f}" if "us_no_pdl" in r else ""
        lines.append(
            f"| {r['n']} x {r['k']} | {r['module']} ({r['layers']}) | {r['rows']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['us_ours']:.2f} | {frac(r['bytes'], r['us_ours']):.2f} | {r['err_ours']:.2f} | {r['config']} | "
            f"{up_cells} | {r['us_triton']:.2f} | {f'{tw:.2f}' if tw else '-'} | {r['us_bf16']:.2f} | {nopdl} | "
            f"{r['us_same_bytes_copy']:.2f} |")
    # per-token sum over the model's layers at 1 and 4 rows
    lines += ["", "Per decode step (sum over every layer that runs each shape):", ""]
    for rows in (1, 4):
        sel = [r for r in results if r["rows"] == rows]
        if not sel:
            continue
        ours = sum(r["us_ours"] * r["layers"] for r in sel)
        tri = sum(r["us_triton"] * r["layers"] for r in sel)
        up = sum(r.get("us_scaled_mm", float("nan")) * r["layers"] for r in sel)
        bf = sum(r["us_bf16"] * r["layers"] for r in sel)
        by = sum(r["bytes"] * r["layers"] for r in sel)
        floor = by / (copy_gbs * 1e9) * 1e6
        lines.append(f"- {rows} row(s): ours {ours:.0f} us (Triton W8A16 alone {tri:.0f} us), upstream-equivalent "
                     f"{up:.0f} us, BF16 {bf:.0f} us; "
                     f"bytes {by / 1e6:.0f} MB, copy-bandwidth floor {floor:.0f} us (ours {floor / ours:.2f} of it)")
    if sweep_best:
        lines += ["", "Sweep winners (paste into `TUNED` / `TUNED_DECODE` in vllm_ling/ops/dense_fp8/tuned_configs.py):",
                  "", "```python"]
        for (n, k, rows), (c, us) in sorted(sweep_best.items()):
            lines.append(f"# {n}x{k} rows {rows}: {us:.2f} us")
            lines.append(f"(({n}, {k}), {rows}, {c!r}),")
        lines.append("```")
    if notes:
        lines += ["", "Notes:", ""] + [f"- {x}" for x in notes]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
