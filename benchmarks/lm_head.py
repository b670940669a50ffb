"""LM-head logits on one GPU: BF16 cuBLAS, fp32, and every FP8 kernel of vllm_ling.ops.lm_head.

For each kernel and row count: CUDA-graph median time per call, bytes moved (weights + scales
read, activations read, logits written), the fraction of the device copy bandwidth measured
in the same run (one large device-to-device copy, read + write bytes), the speed-up over BF16
measured in the same run, and the error against fp32 logits of the original BF16 weights on
random vectors (max abs error, argmax agreement, argmax agreement where the fp32 top-1/top-2
margin exceeds 0.25). Prints a Markdown table and writes it to --out.

    python -m benchmarks.lm_head                 # Ling head 157,184 x 2,560, rows 1 4 16
    python -m benchmarks.lm_head --sweep         # also time humming tuning / Triton variants

``--sweep`` times hand-written humming tuning configs (derived from humming's own heuristic
for each row count) and Triton block configs, to fill HEAD_KERNEL_BY_ARCH, TRITON_CONFIGS
(vllm_ling/ops/lm_head/selection.py, triton_kernel.py) and HUMMING_TUNING_BY_ARCH
(vllm_ling/ops/lm_head/humming.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us
from vllm_ling.ops.lm_head.head import fp8_head_logits, prepare_fp8_head
from vllm_ling.ops.lm_head.humming import HUMMING_COMPUTE_CONFIG
from vllm_ling.ops.lm_head.quantize import quantize_fp8_per_channel
from vllm_ling.ops.lm_head.reference import fp8_reference_logits
from vllm_ling.ops.lm_head.selection import kernel_unavailable_reason
from vllm_ling.ops.lm_head.triton_kernel import TritonHeadConfig, triton_logits

MARGIN = 0.25


def cuda_graph_us(fn, calls_per_graph: int = 10, replays: int = 25) -> float:
    """Median microseconds per call over graph replays (each replay runs fn() calls_per_graph
    times back to back, so launch gaps vanish as in a captured decode step)."""
    return stacked_time_us([fn] * calls_per_graph, replays)


def eager_us(fn, calls: int = 50) -> float:
    """Wall time per call of back-to-back eager calls (host overhead shows when > graph)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> tuple[float, str]:
    """Device copy bandwidth (bytes read + written per second): the best of cudaMemcpy D2D
    timed eagerly with events and an elementwise copy kernel replayed in a CUDA graph (a
    memcpy node inside a graph ran at about 2.8 TB/s here, a kernel at about 4.3)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    memcpy = 2 * nbytes / (statistics.median(times) * 1e-6) / 1e9
    kernel = 2 * nbytes / (cuda_graph_us(lambda: torch.mul(src, 1.0, out=dst), 5, 15) * 1e-6) / 1e9
    how = f"cudaMemcpy D2D {memcpy:.0f} GB/s, copy kernel in a graph {kernel:.0f} GB/s"
    return max(memcpy, kernel), how


def error_stats(logits_fn, rows: int, hidden: torch.Tensor, ref: torch.Tensor) -> dict:
    outs = []
    for start in range(0, hidden.shape[0], rows):
        outs.append(logits_fn(hidden[start : start + rows]).float())
    got = torch.cat(outs)
    top2 = ref.topk(2, dim=1)
    confident = (top2.values[:, 0] - top2.values[:, 1]) > MARGIN
    agree = got.argmax(dim=1) == top2.indices[:, 0]
    return {
        "max_abs_err": (got - ref).abs().max().item(),
        "argmax_agree": agree.float().mean().item(),
        "argmax_agree_confident": agree[confident].float().mean().item() if confident.any() else float("nan"),
        "n_confident": int(confident.sum()),
        "finite": bool(torch.isfinite(got).all()),
    }


def diagnostics(states, q, scale, hidden) -> list[str]:
    """Each FP8 kernel against fp32 logits of the *same* dequantized weights: how far from the
    kernel-only error (BF16 output rounding) it is, and whether repeated calls are bitwise equal."""
    lines = []
    x = hidden[:16]
    ref8 = fp8_reference_logits(x, q, scale)
    mag = fp8_reference_logits(x.float().abs(), q.float().abs().to(torch.float8_e4m3fn), scale)
    for name, state in states.items():
        got = fp8_head_logits(x, state).float()
        again = fp8_head_logits(x, state).float()
        err = (got - ref8).abs()
        rel_out = (err / ref8.abs().clamp_min(1e-3))[ref8.abs() > 1.0]
        rel_mag = err / mag.clamp_min(1e-30)
        line = (f"{name} vs fp32 logits of the same FP8 weights (16 rows): max abs {err.max().item():.5f}, "
                f"max err/|ref| where |ref|>1 {rel_out.max().item():.5f} (2^-8 = {2**-8:.5f}), "
                f"max err/(|x|@|w|) {rel_mag.max().item():.2e}, repeat bitwise equal: {torch.equal(got, again)}")
        print(line, flush=True)
        lines.append(line)
    return lines


def humming_sweep_candidates(state, rows: int) -> list[tuple[str, dict]]:
    """Variants of humming's own heuristic config for this row count."""
    import humming.tune

    base = humming.tune.get_heuristics_config(state.extra["layer_config_obj"], shape_m=rows, gemm_type="dense",
                                              device=state.device)
    out = [("heuristic", {k: (list(v) if isinstance(v, tuple) else v) for k, v in base.items()})]
    mma = {"mma_type": "mma", "use_stream_k": False, "use_tma": False, "use_warp_spec": False}

    def cand(name, block, warp, stages, ctas, **extra):
        out.append((name, dict(mma, block_shape=list(block), warp_shape=list(warp), num_stages=stages,
                               num_ctas_per_sm=ctas, **extra)))

    cand("mma_16x64x256_w32x64_s4_c2", (16, 64, 256), (16, 32, 64), 4, 2)
    cand("mma_16x64x256_w32x64_s3_c3", (16, 64, 256), (16, 32, 64), 3, 3)
    cand("mma_16x64x256_w32x64_s2_c4", (16, 64, 256), (16, 32, 64), 2, 4)
    cand("mma_16x64x256_w32x64_s6_c1", (16, 64, 256), (16, 32, 64), 6, 1)
    cand("mma_16x64x256_w64x64_s4_c2", (16, 64, 256), (16, 64, 64), 4, 2)
    cand("mma_16x64x256_w32x128_s4_c2", (16, 64, 256), (16, 32, 128), 4, 2)
    cand("mma_16x64x512_w32x128_s2_c2", (16, 64, 512), (16, 32, 128), 2, 2)
    cand("mma_16x64x512_w32x64_s2_c2", (16, 64, 512), (16, 32, 64), 2, 2)
    # Block N 32 (16x32x256 s4 c3, 16x32x512 s3 c3) was tried once and left out: right after the
    # first of them ran, every later error check in that process read NaN (a stray write).
    cand("mma_16x128x256_w32x64_s3_c1", (16, 128, 256), (16, 32, 64), 3, 1)
    cand("mma_16x64x128_w32x64_s6_c2", (16, 64, 128), (16, 32, 64), 6, 2)
    cand("mma_16x64x256_w32x64_s4_c2_streamk", (16, 64, 256), (16, 32, 64), 4, 2)
    out[-1][1]["use_stream_k"] = True
    if rows <= 8:
        cand("mma_8x64x256_w32x64_s4_c2", (8, 64, 256), (8, 32, 64), 4, 2)
    return out


def triton_sweep_candidates(rows: int) -> list[TritonHeadConfig]:
    C = TritonHeadConfig
    out = []
    if rows == 1:
        for bn, bk, warps, stages in [(16, 512, 4, 3), (8, 1024, 4, 3), (16, 512, 2, 3), (16, 1024, 4, 2),
                                      (16, 512, 4, 4), (32, 512, 8, 3)]:
            out.append(C(1, bn, bk, False, warps, stages))
    bm = max(16, 1 << (rows - 1).bit_length())
    out.append(C(bm, 64, 128, True, 4, 4))  # best bf16 of the first sweep
    for bn, bk, warps, stages in [(64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (64, 64, 4, 6),
                                  (32, 256, 4, 3), (32, 128, 2, 4), (64, 128, 2, 4), (128, 128, 4, 4),
                                  (128, 64, 4, 6), (64, 256, 8, 3)]:
        out.append(C(bm, bn, bk, True, warps, stages, dot_fp16=True))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=157184)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--error-vectors", type=int, default=64)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--skip-main", action="store_true", help="with --sweep: only the sweep")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "lm_head_h200.md"))
    parser.add_argument("--json", default=None, help="also write raw results as JSON here")
    args = parser.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baseline is true fp32
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    gen = torch.Generator(device=dev).manual_seed(1234)
    V, H = args.vocab, args.hidden

    copy_gbs, copy_how = copy_bandwidth_gbs()
    print(f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs; "
          f"copy bandwidth {copy_gbs:.0f} GB/s (read+write; {copy_how})", flush=True)

    w_bf16 = (torch.randn((V, H), device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    w_fp32 = w_bf16.float()
    q, scale = quantize_fp8_per_channel(w_bf16)
    err_hidden = torch.randn((args.error_vectors, H), device=dev, generator=gen).to(torch.bfloat16)
    ref = err_hidden.float() @ w_fp32.t()

    states = {}
    notes = []
    for kernel in ("humming", "humming-heuristic", "triton", "scaled_mm"):
        why_not = kernel_unavailable_reason(kernel.split("-")[0], dev)
        if why_not:
            notes.append(f"{kernel}: not run ({why_not})")
            continue
        t0 = time.perf_counter()
        try:
            if kernel == "humming-heuristic":
                states[kernel] = prepare_fp8_head(q, scale, "humming", humming_tuning="heuristic")
            else:
                states[kernel] = prepare_fp8_head(q, scale, kernel)
            fp8_head_logits(err_hidden[:1], states[kernel])  # JIT
            for rows in args.rows:
                fp8_head_logits(err_hidden[:rows], states[kernel])
            torch.cuda.synchronize()
        except Exception as exc:  # report, keep benchmarking the others
            traceback.print_exc()
            notes.append(f"{kernel}: failed ({type(exc).__name__}: {exc})")
            states.pop(kernel, None)
            continue
        print(f"prepared {kernel} in {time.perf_counter() - t0:.1f} s", flush=True)

    if "humming" in states:
        import humming.tune

        for rows in args.rows:
            cfg = humming.tune.get_heuristics_config(states["humming"].extra["layer_config_obj"], shape_m=rows,
                                                     gemm_type="dense", device=dev)
            notes.append(f"humming heuristic tuning at {rows} rows: `{json.dumps(cfg)}`")
        notes.append(f"humming first-call compile (whole per-M table): "
                     f"{states['humming'].extra.get('compile_seconds')} s")
    variants = [
        ("BF16 cuBLAS (F.linear)", lambda x: F.linear(x, w_bf16), V * H * 2, None),
        ("fp32 cuBLAS (F.linear, no TF32)", lambda x: F.linear(x.float(), w_fp32), V * H * 4, None),
    ]
    labels = {"humming": "FP8 humming W8A16 (vllm-ling tuning table)",
              "humming-heuristic": "FP8 humming W8A16 (humming's heuristic tuning)",
              "triton": "FP8 Triton (table config)",
              "scaled_mm": "FP8 torch._scaled_mm row-wise + act quant"}
    for kernel, state in states.items():
        scale_bytes = state.scale.numel() * state.scale.element_size()
        variants.append((labels[kernel], (lambda s: lambda x: fp8_head_logits(x, s))(state),
                         V * H + scale_bytes, kernel))
    if "triton" in states:  # the lever left off by default (fp16 range), for the record
        fp16_cfg = TritonHeadConfig(16, 64, 128, True, 2, 4, dot_fp16=True)
        variants.append(("FP8 Triton, fp16 tensor-core inputs (not default)",
                         lambda x: triton_logits(x, states["triton"], None, fp16_cfg),
                         V * H + V * 4, "triton"))

    if not args.skip_main:
        notes += diagnostics(states, q, scale, err_hidden)
    results = []
    for rows in ([] if args.skip_main else args.rows):
        x = torch.randn((rows, H), device=dev, generator=gen).to(torch.bfloat16)
        for name, fn, weight_bytes, kernel in variants:
            out_bytes = rows * V * (4 if "fp32" in name else 2)
            nbytes = weight_bytes + rows * H * 2 + out_bytes
            try:
                us = cuda_graph_us(lambda: fn(x))
                eager = eager_us(lambda: fn(x))
                errs = error_stats(fn, rows, err_hidden, ref)
            except Exception as exc:
                traceback.print_exc()
                notes.append(f"{name} at {rows} rows: failed ({type(exc).__name__}: {exc})")
                continue
            results.append(dict(name=name, rows=rows, us=us, eager_us=eager, bytes=nbytes, kernel=kernel, **errs))
            print(f"{name:45s} rows={rows:3d} {us:8.1f} us  eager {eager:8.1f} us  "
                  f"max|err| {errs['max_abs_err']:.4f} argmax {errs['argmax_agree']:.3f}", flush=True)

    sweep_rows = []
    if args.sweep:
        sweep_rows = run_sweep(args, states, w_bf16, err_hidden, ref, gen)

    write_outputs(render(results, (copy_gbs, copy_how), props, notes, sweep_rows, args), args.out, args.json,
                  {"copy_gbs": copy_gbs, "results": results, "sweep": sweep_rows, "notes": notes})
    return 0


def run_sweep(args, states, w_bf16, err_hidden, ref, gen) -> list[dict]:
    H = args.hidden
    dev = w_bf16.device
    rows_out = []
    if "triton" in states:
        state = states["triton"]
        for rows in args.rows:
            x = torch.randn((rows, H), device=dev, generator=gen).to(torch.bfloat16)
            for cfg in triton_sweep_candidates(rows):
                fn = (lambda c: lambda inp: triton_logits(inp, state, None, c))(cfg)
                try:
                    us = cuda_graph_us(lambda: fn(x))
                    errs = error_stats(fn, rows, err_hidden[:16], ref[:16])
                except Exception as exc:
                    rows_out.append(dict(kind="triton", rows=rows, config=str(cfg), us=None,
                                         error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    continue
                rows_out.append(dict(kind="triton", rows=rows, config=str(cfg), us=us,
                                     max_abs_err=errs["max_abs_err"]))
                print(f"sweep triton rows={rows} {cfg} {us:.1f} us err {errs['max_abs_err']:.4f}", flush=True)
    if "humming" in states:
        import humming
        from humming.kernel.humming import HummingKernel

        state = states["humming"]
        jobs = []
        for rows in args.rows:
            for name, cfg in humming_sweep_candidates(state, rows):
                jobs.append((rows, name, json.dumps(cfg)))
        t0 = time.perf_counter()

        def compile_one(job):
            rows, name, tuning = job
            try:
                HummingKernel.prepare_kernels(state.extra["layer_config"], HUMMING_COMPUTE_CONFIG, tuning,
                                              dev.index or 0)
                return None
            except Exception as exc:
                return f"{type(exc).__name__}: {str(exc)[:300]}"

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
            compile_errors = list(pool.map(compile_one, jobs))
        print(f"humming sweep: compiled {len(jobs)} configs in {time.perf_counter() - t0:.1f} s", flush=True)
        for (rows, name, tuning), error in zip(jobs, compile_errors):
            if error:
                rows_out.append(dict(kind="humming", rows=rows, config=name, tuning=tuning, us=None, error=error))
                continue
            x = torch.randn((rows, H), device=dev, generator=gen).to(torch.bfloat16)

            def fn(inp, tuning=tuning):
                return humming.ops.humming_gemm(
                    layer_config=state.extra["layer_config"], compute_config=HUMMING_COMPUTE_CONFIG,
                    tuning_config=tuning, inputs=inp.contiguous(), weight=state.weight,
                    weight_scale=state.scale, locks=state.extra["locks"])

            try:
                us = cuda_graph_us(lambda: fn(x))
                errs = error_stats(fn, rows, err_hidden[:16], ref[:16])
            except Exception as exc:
                rows_out.append(dict(kind="humming", rows=rows, config=name, tuning=tuning, us=None,
                                     error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            rows_out.append(dict(kind="humming", rows=rows, config=name, tuning=tuning, us=us,
                                 max_abs_err=errs["max_abs_err"]))
            print(f"sweep humming rows={rows} {name} {us:.1f} us err {errs['max_abs_err']:.4f}", flush=True)
    return rows_out


def render(results, copy_bw, props, notes, sweep_rows, args) -> str:
    copy_gbs, copy_how = copy_bw
    versions = [f"torch {torch.__version__}"]
    try:
        import triton

        versions.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        versions.append(f"humming-kernels {version('humming-kernels')}")
    except Exception:
        pass
    lines = [
        f"# LM head {args.vocab} x {args.hidden}: BF16 vs FP8 kernels",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {props.name} "
        f"(sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), {', '.join(versions)}.",
        f"Device copy bandwidth measured in this run: **{copy_gbs:.0f} GB/s** (2 GiB device-to-device copy, "
        f"read + write bytes; {copy_how}). Times: median of 25 CUDA-graph replays of 10 back-to-back calls; "
        "'eager' is wall time per call of 50 eager calls (host overhead shows when it exceeds the graph time). "
        "Bytes: weights (+ scales) read, activations read, logits written. "
        f"Errors: against fp32 logits of the original BF16 weights on {args.error_vectors} random N(0,1) vectors "
        f"(weights N(0, 0.02^2)); 'argmax (margin)' counts only vectors whose fp32 top-1/top-2 margin exceeds {MARGIN}.",
        "",
        "| kernel | rows | time us | eager us | MB moved | GB/s | of copy BW | speed-up vs BF16 | max abs err | argmax agree | argmax (margin) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bf16_us = {r["rows"]: r["us"] for r in results if r["name"].startswith("BF16")}
    for r in results:
        gbs = r["bytes"] / (r["us"] * 1e-6) / 1e9
        speedup = bf16_us.get(r["rows"], float("nan")) / r["us"]
        lines.append(
            f"| {r['name']} | {r['rows']} | {r['us']:.1f} | {r['eager_us']:.1f} | {r['bytes'] / 1e6:.1f} | {gbs:.0f} | "
            f"{gbs / copy_gbs:.2f} | {speedup:.2f}x | {r['max_abs_err']:.4f} | {100 * r['argmax_agree']:.1f}% | "
            f"{100 * r['argmax_agree_confident']:.1f}% ({r['n_confident']}) |"
        )
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    if sweep_rows:
        lines += ["", "## Sweep (levers tried)", "", "| kind | rows | config | time us | max abs err / error |",
                  "|---|---:|---|---:|---|"]
        for r in sorted(sweep_rows, key=lambda r: (r["kind"], r["rows"], r["us"] or 1e9)):
            detail = f"{r['max_abs_err']:.4f}" if r.get("us") else r.get("error", "")
            cfg = r["config"] + (f" `{r['tuning']}`" if r.get("tuning") and r["config"] != "heuristic" else "")
            if r["config"] == "heuristic" and r.get("tuning"):
                cfg += f" `{r['tuning']}`"
            us = f"{r['us']:.1f}" if r.get("us") else "-"
            lines.append(f"| {r['kind']} | {r['rows']} | {cfg} | {us} | {detail} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
