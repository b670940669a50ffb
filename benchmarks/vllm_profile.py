"""The real vLLM step, kernel by kernel: profile windows of a serving ``vllm-ling serve``, read back here.

``benchmarks/serve_h200.py run --profile-dir DIR`` starts the server with vLLM's own torch profiler
(``--profiler-config``; CPU + CUDA activity, no stacks) and, after its measurements, records named
windows through ``/start_profile`` and ``/stop_profile``: a prefill of 64, 2048 and 32K tokens (one
request each, ``max_tokens`` 1) and a window of decode iterations at 32K context (the profiler stops
itself after ``max_iterations``). :func:`compact` keeps of each trace only what the analysis reads
(kernels, their launch calls, vLLM's per-step ``execute_*`` annotations, long host calls), small
enough to bring back from the device. ``analyse`` and ``render`` run anywhere, from the compact files:

    python -m benchmarks.vllm_profile render DIR/*.compact.json.gz --out benchmarks/results/vllm_step_profile_h200.md

Each kernel belongs to the step whose ``execute_*`` annotation encloses its launch call (a CUDA-graph
replay's kernels carry the graph launch's correlation id); an *iteration* runs from a step's first
kernel to the next step's first kernel, so sampling and the MTP drafter's kernels count with the step
that produced them. Op classes are read from kernel names (:data:`CLASS_RULES`), plus one position
rule: the GEMMs after a step's last routed-MoE kernel are the LM head. Under CUDA graphs there is no
module name to read, so the per-kernel table is printed too: it is the ground truth the classes sum.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks.timeline import covered_us, wall_shares

# (op class, regex on the kernel name); the first match wins. Classes with a byte floor in the plan
# are named as in FLOOR_COMPONENTS.
CLASS_RULES: tuple[tuple[str, str], ...] = (
    ("moe_routed", r"ling_moe|moe_align|fused_moe|moe_sum|count_and_sort|moe_permute|moe_unpermute|"
                   r"topk_weight|expert|humming(?!.*157184)"),
    ("head", r"157184"),
    ("router", r"grouped_topk|topk|router|ling_small_gemv_router|noaux"),
    # before dense_fp8: FlashMLA's template names carry CUTLASS's ScaledBasis, the KV-cache write its
    # Fp8KVCacheDataType argument (lease 2026-12-07g counted both as dense FP8)
    ("mla_attention", r"mla|flash_fwd|flashattn|fmha|attention|merge_attn|paged|decode_attention|"
                      r"concat_and_cache"),
    ("dense_fp8", r"ling_dense_w8a16|e4m3|fp8|blockwise|deep_gemm|w8a8|scaled_mm|per_token_group|"
                  r"cutlass.*(block|scale)"),
    ("kda_recurrent", r"kda|recurrent|delta|chunk_|solve_tril|wy_fast|cumsum|gla|l2norm|fused_gdn"),
    ("kda_conv", r"causal_conv1d|conv1d"),
    ("norms_residual", r"rms|norm|rsqrt|fused_add"),
    ("sampling", r"argmax|sample|softmax|top_p|top_k|penalt|gumbel|exponential|logit"),
    ("small_bf16", r"ling_small_gemv"),
    # cuBLAS's fp32 SIMT GEMM (no tensor cores): in Ling's step the MoE router gates above the router
    # GEMV's 16 tokens (vLLM's GateLinear casts to fp32 and runs F.linear on sm_90 / sm_121)
    ("fp32_gemm", r"f32f32_f32f32|sgemm"),
    ("bf16_gemm", r"gemm|gemv|nvjet|xmma|cutlass|sm90_|splitk|cublas"),
    ("memcpy", r"^Memcpy|^Memset|memcpy|memset"),
)
GEMM_LIKE = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|sm90_|humming|ling_dense|ling_small_gemv", re.I)
# op class -> `vllm-ling plan` components whose bytes that class moves (the floor column)
FLOOR_COMPONENTS = {
    "moe_routed": ("routed experts MXFP4",),
    "router": ("routers fp32 + expert bias",),
    "dense_fp8": ("shared expert FP8", "dense MLP FP8", "KDA projections FP8 (+BF16 b_proj)",
                  "MLA projections FP8 (+BF16 W_UK/W_UV)"),
    "kda_recurrent": ("KDA recurrent state fp32 (read)", "KDA recurrent state fp32 (write)"),
    "kda_conv": ("KDA conv/gate params fp32", "KDA conv state BF16 (read+write)"),
    "mla_attention": ("MLA KV cache BF16 @ {context} tokens",),
    "norms_residual": ("norms BF16",),
}
STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
LONG_HOST_US = 200.0  # host calls at least this long are kept (synchronisations, blocking copies)


def classify(name: str) -> str:
    for cls, pattern in CLASS_RULES:
        if re.search(pattern, name, re.I):
            return cls
    return "other"


# --- on the device: traces -> compact files ---------------------------------------------------------

def compact(trace_path: Path) -> dict:
    """What the analysis reads from one torch-profiler trace (chrome JSON, gzipped or not)."""
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels, launches, steps, host = [], {}, [], []
    for e in events:
        cat, args = e.get("cat"), e.get("args") or {}
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append([e["name"], float(e["ts"]), float(e.get("dur", 0)), args.get("stream", e.get("tid")),
                            args.get("correlation")])
        elif cat in ("cuda_runtime", "cuda_driver"):
            if args.get("correlation") is not None:
                launches[args["correlation"]] = [e["name"], float(e["ts"]), float(e.get("dur", 0))]
            if float(e.get("dur", 0)) >= LONG_HOST_US:
                host.append([e["name"], float(e["ts"]), float(e["dur"])])
        elif cat == "user_annotation" and str(e.get("name", "")).startswith("execute_"):
            steps.append([e["name"], float(e["ts"]), float(e.get("dur", 0))])
    used = {k[4] for k in kernels}
    return {"source": trace_path.name, "kernels": kernels, "steps": steps, "host": host,
            "launches": {str(c): v for c, v in launches.items() if c in used}}


def write_compact(trace_dir: Path, window: str, out_dir: Path) -> Path | None:
    """The newest trace of ``window`` (vLLM names it ``<prefix>_<rank>...``) as ``<window>.compact.json.gz``."""
    found = sorted(trace_dir.glob(f"{window}_*.json*"), key=lambda p: p.stat().st_mtime)
    if not found:
        return None
    data = compact(found[-1])
    data["window"] = window
    out = out_dir / f"{window}.compact.json.gz"
    with gzip.open(out, "wt") as f:
        json.dump(data, f)
    return out


# --- anywhere: compact files -> per-step and per-class figures ---------------------------------------

def steps_of(data: dict) -> list[dict]:
    """Kernels grouped by the vLLM step whose annotation encloses their launch call, in GPU order."""
    ann = sorted(data["steps"], key=lambda s: s[1])
    starts = [s[1] for s in ann]
    per_step: dict[int, list] = collections.defaultdict(list)
    calls: dict[int, dict] = collections.defaultdict(dict)  # step -> {correlation: (API, launch ts, kernel)}
    unowned = []
    for name, ts, dur, stream, corr in data["kernels"]:
        launch = data["launches"].get(str(corr))
        i = bisect.bisect_right(starts, launch[1]) - 1 if launch else -1
        k = {"name": name, "ts": ts, "dur": dur, "stream": stream}
        if i >= 0 and launch[1] <= ann[i][1] + ann[i][2]:
            per_step[i].append(k)
            calls[i].setdefault(corr, (launch[0], launch[1], name))
        else:
            unowned.append(k)
    out = []
    for i in sorted(per_step):
        m = STEP.match(ann[i][0])
        ks = sorted(per_step[i], key=lambda k: k["ts"])
        out.append({"annotation": ann[i][0], "context_tokens": int(m.group(2)) if m else None,
                    "generation_tokens": int(m.group(4)) if m else None, "first_ts": ks[0]["ts"], "kernels": ks,
                    "launch_calls": dict(collections.Counter(api for api, _, _ in calls[i].values())),
                    "syncs": _syncs_in(data.get("host", []), ann[i], sorted(calls[i].values(), key=lambda c: c[1]))})
    # an iteration: from a step's first kernel to the next step's; kernels launched outside any step
    # (sampling, the drafter) join the step whose iteration they fall in
    firsts = [s["first_ts"] for s in out]
    for k in unowned:
        i = bisect.bisect_right(firsts, k["ts"]) - 1
        if i >= 0:
            out[i]["kernels"].append(k)
    for i, s in enumerate(out):
        s["kernels"].sort(key=lambda k: k["ts"])
        last_end = max(k["ts"] + k["dur"] for k in s["kernels"])
        s["iteration_us"] = (out[i + 1]["first_ts"] - s["first_ts"]) if i + 1 < len(out) else last_end - s["first_ts"]
    return out


def label_classes(kernels: list[dict]) -> list[str]:
    classes = [classify(k["name"]) for k in kernels]
    moe = [i for i, c in enumerate(classes) if c == "moe_routed"]
    if moe:  # the LM head: GEMMs after the step's last routed-MoE kernel
        for i in range(moe[-1] + 1, len(kernels)):
            if classes[i] in ("bf16_gemm", "dense_fp8", "other") and GEMM_LIKE.search(kernels[i]["name"]):
                classes[i] = "head"
    return classes


def _syncs_in(host: list, step: list, calls: list[tuple]) -> list[tuple[float, str]]:
    """The step's long host synchronisations (each drains the GPU's queue: the launches after it start
    with the GPU idle): (us waited, the kernel launched just before it, past the copy that synchronises),
    in order."""
    _, t0, dur = step
    out = []
    for call, ts, wait in host:
        if "Synchronize" in call and t0 <= ts <= t0 + dur:
            before = [c for c in calls if c[1] < ts and not c[2].startswith("Memcpy")]
            out.append((wait, before[-1][2] if before else "-"))
    return out


def busy_and_gaps(kernels: list[dict]) -> tuple[float, float]:
    """Time covered by at least one kernel, and the idle time between the first start and last end."""
    busy = covered_us(kernels)
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    return busy, span - busy


def step_figures(step: dict) -> dict:
    ks = step["kernels"]
    classes = label_classes(ks)
    walls = wall_shares(ks)
    per_class = collections.Counter()
    per_class_wall = collections.Counter()
    launches = collections.Counter()
    for k, c, w in zip(ks, classes, walls):
        per_class[c] += k["dur"]
        per_class_wall[c] += w
        launches[c] += 1
    busy, gaps = busy_and_gaps(ks)
    by_name = collections.defaultdict(lambda: [0, 0.0, "", 0.0])
    classes_of = collections.defaultdict(collections.Counter)
    for k, c, w in zip(ks, classes, walls):
        row = by_name[k["name"]]
        row[0] += 1
        row[1] += k["dur"]
        row[3] += w
        classes_of[k["name"]][c] += 1
    for name, seen in classes_of.items():  # one kernel can serve two classes (a dense GEMM after the last MoE layer)
        by_name[name][2] = "+".join(c for c, _ in seen.most_common())
    return {"annotation": step["annotation"], "context_tokens": step["context_tokens"],
            "generation_tokens": step["generation_tokens"], "iteration_us": step["iteration_us"],
            "kernels": len(ks), "busy_us": busy, "gaps_us": gaps, "classes": dict(per_class),
            "wall": dict(per_class_wall), "streams": len({k.get("stream") for k in ks}),
            "launches": dict(launches), "by_name": {n: v for n, v in by_name.items()},
            "launch_calls": step.get("launch_calls", {}), "syncs": step.get("syncs", [])}


def analyse(data: dict) -> dict:
    steps = [step_figures(s) for s in steps_of(data)]
    host = collections.Counter()
    for name, _, dur in data.get("host", []):
        host[name] += dur
    return {"window": data.get("window") or data.get("source"), "steps": steps,
            "long_host_calls_us": dict(host.most_common(8))}


def _median_step(steps: list[dict]) -> dict:
    """Per-class and per-kernel medians over decode steps of one kind (same kernel count)."""
    keyed = collections.Counter(s["kernels"] for s in steps)
    common = keyed.most_common(1)[0][0]
    same = [s for s in steps if s["kernels"] == common]
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    classes = {c: med([s["classes"].get(c, 0.0) for s in same]) for c in {c for s in same for c in s["classes"]}}
    wall = {c: med([s.get("wall", {}).get(c, 0.0) for s in same]) for c in classes}
    names = {n for s in same for n in s["by_name"]}
    by_name = {n: [same[0]["by_name"].get(n, [0, 0, ""])[0], med([s["by_name"].get(n, [0, 0.0])[1] for s in same]),
                   next(s["by_name"][n][2] for s in same if n in s["by_name"]),
                   med([_wall_of(s["by_name"].get(n)) for s in same])] for n in names}
    return {"steps": len(same), "of": len(steps), "kernels": common,
            "iteration_us": med([s["iteration_us"] for s in same]), "busy_us": med([s["busy_us"] for s in same]),
            "gaps_us": med([s["gaps_us"] for s in same]), "classes": classes, "wall": wall,
            "streams": max(s.get("streams", 1) for s in same),
            "launches": same[len(same) // 2]["launches"], "by_name": by_name}


def _wall_of(row) -> float:
    """A by-name row's wall share (rows of traces analysed before the column existed have none)."""
    return row[3] if row and len(row) > 3 else 0.0


def class_floor_us(plan: dict | None, context: int, copy_gbs: float | None, generation_tokens: int,
                   head: str = "fp8") -> dict:
    if not plan or not copy_gbs:
        return {}
    comps = {c["name"]: c for c in plan["components"]}
    key = "batch1_bytes" if generation_tokens <= 1 else "verify_bytes"
    out = {}
    for cls, names in FLOOR_COMPONENTS.items():
        b = sum(comps[n.format(context=context)][key] for n in names if n.format(context=context) in comps)
        out[cls] = (b, b / (copy_gbs * 1e3))
    b = plan["heads"][head]["head_bytes"]
    return out | {"head": (b, b / (copy_gbs * 1e3))}


def render_window(result: dict, floors: dict | None = None, top: int = 25) -> list[str]:
    steps = result["steps"]
    lines = [f"## `{result['window']}`", ""]
    if not steps:
        return lines + ["No annotated vLLM steps in this trace.", ""]
    lines += ["| step | context tokens | generation tokens | iteration us | kernels | busy us | gaps us |",
              "|---|---|---|---|---|---|---|"]
    for i, s in enumerate(steps[:40]):
        lines.append(f"| {i} | {s['context_tokens']} | {s['generation_tokens']} | {s['iteration_us']:.0f} | "
                     f"{s['kernels']} | {s['busy_us']:.0f} | {s['gaps_us']:.0f} |")
    if len(steps) > 40:
        lines.append(f"| ... {len(steps) - 40} more | | | | | | |")
    decode = [s for s in steps if not s["context_tokens"]]
    prefill = [s for s in steps if s["context_tokens"]]
    groups = []
    if decode:
        groups.append(("decode steps (median over steps with the most common kernel count)", _median_step(decode)))
    if prefill:
        tot = collections.Counter()
        for s in prefill:
            tot.update(s["classes"])
        wall = collections.Counter()
        for s in prefill:
            wall.update(s.get("wall", {}))
        names = collections.defaultdict(lambda: [0, 0.0, "", 0.0])
        for s in prefill:
            for n, row in s["by_name"].items():
                names[n][0] += row[0]
                names[n][1] += row[1]
                names[n][2] = row[2]
                names[n][3] += _wall_of(row)
        groups.append(("prefill steps (summed)", {
            "steps": len(prefill), "of": len(steps), "iteration_us": sum(s["iteration_us"] for s in prefill),
            "busy_us": sum(s["busy_us"] for s in prefill), "gaps_us": sum(s["gaps_us"] for s in prefill),
            "classes": dict(tot), "wall": dict(wall), "by_name": dict(names),
            "streams": max(s.get("streams", 1) for s in prefill),
            "launches": dict(sum((collections.Counter(s["launches"]) for s in prefill), collections.Counter()))}))
    for title, g in groups:
        wall = g.get("wall") or {}
        total = sum(wall.values()) or 1.0
        lines += ["", f"**{title}**: {g['steps']} of {len(steps)} steps; iteration {g['iteration_us']:.0f} us, "
                  f"kernels busy {g['busy_us']:.0f} us, idle between kernels {g['gaps_us']:.0f} us, "
                  f"{g.get('streams', 1)} stream(s)", "",
                  "*kernel us* sums the kernels' durations; *wall us* is what they add to the time covered by "
                  "kernels (an overlapping kernel, launched early by programmatic dependent launch or on another "
                  "stream, counts once): the wall column sums to the busy time and is the one to cut.", "",
                  "| op class | kernel us | wall us | share | launches | MB | floor us | x floor |",
                  "|---|---|---|---|---|---|---|---|"]
        for cls, us in sorted(g["classes"].items(), key=lambda t: -wall.get(t[0], 0.0)):
            w = wall.get(cls, 0.0)
            b, f = (floors or {}).get(cls, (0, 0)) if "decode" in title else (0, 0)
            lines.append(f"| {cls} | {us:.0f} | {w:.0f} | {w / total:.2f} | {g['launches'].get(cls, 0)} | "
                         + (f"{b / 1e6:.0f} | {f:.0f} | {w / f:.1f} |" if f else "- | - | - |"))
        lines += ["", "| kernel | class | launches | us | wall us | mean us |", "|---|---|---|---|---|---|"]
        for name, row in sorted(g["by_name"].items(), key=lambda t: -t[1][1])[:top]:
            n, us, cls = row[:3]
            short = name if len(name) <= 100 else name[:97] + "..."
            lines.append(f"| `{short.replace('|', '/')}` | {cls} | {n} | {us:.0f} | {_wall_of(row):.0f} | "
                         f"{us / max(n, 1):.2f} |")
    if any(s.get("launch_calls") or s.get("syncs") for s in steps):
        lines += ["", "Host side per step: the launch calls behind its kernels (one graph launch runs many "
                  "kernels; every other call is a kernel launched from Python), and its long host "
                  "synchronisations (each drains the GPU's queue) with the kernel launched just before:", "",
                  "| step | graph launches | other launch calls | syncs | us waited | launched before them |",
                  "|---|---|---|---|---|---|"]
        for i, s in enumerate(steps[:40]):
            calls, syncs = s.get("launch_calls", {}), s.get("syncs", [])
            before = collections.Counter(name for _, name in syncs).most_common(2)
            lines.append(f"| {i} | {calls.get('cudaGraphLaunch', 0)} | "
                         f"{sum(n for api, n in calls.items() if api != 'cudaGraphLaunch')} | {len(syncs)} | "
                         f"{sum(w for w, _ in syncs):.0f} | "
                         + ("; ".join(f"`{n[:60]}` x{c}" for n, c in before) or "-") + " |")
    if result.get("long_host_calls_us"):
        lines += ["", "Host calls of 200 us or more (summed us): "
                  + ", ".join(f"`{n}` {us:.0f}" for n, us in result["long_host_calls_us"].items())]
    return lines + [""]


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compact", help="compact the traces of named windows (on the device)")
    c.add_argument("trace_dir")
    c.add_argument("windows", nargs="+")
    c.add_argument("--out", required=True)
    r = sub.add_parser("render", help="the Markdown profile from compact files")
    r.add_argument("files", nargs="+")
    r.add_argument("--out", default=None)
    r.add_argument("--title", default="The real vLLM step, kernel by kernel")
    r.add_argument("--plan-json", default=None, help="`vllm-ling plan --json` output, for the byte floors")
    r.add_argument("--context", type=int, default=32768)
    r.add_argument("--copy-gbs", type=float, default=None)
    r.add_argument("--head", choices=("fp8", "bf16"), default="fp8", help="the head the composition serves")
    args = parser.parse_args(argv)
    if args.cmd == "compact":
        for w in args.windows:
            out = write_compact(Path(args.trace_dir), w, Path(args.out))
            print(f"{w}: {out or 'no trace'}")
        return 0
    plan = json.loads(Path(args.plan_json).read_text()) if args.plan_json else None
    lines = [f"# {args.title}", ""]
    for f in args.files:
        result = analyse(load(Path(f)))
        gen = max((s["generation_tokens"] or 0 for s in result["steps"]), default=1)
        lines += [f"<!-- {f} -->"] + render_window(result, class_floor_us(plan, args.context, args.copy_gbs, gen, args.head))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
