"""Where the time of one decode step goes, kernel by kernel: busy time versus the gaps between launches.

``benchmarks/decode_step.py`` measures the step and each op class in its own graph. This script
captures the same step (vllm-ling composition, full-size random model) in one CUDA graph, replays
it under the torch profiler (CUPTI records each kernel node of a graph replay) and reads the
trace: per kernel name the launches and summed time; on the main stream the time covered by at
least one kernel versus the idle time between kernels; how much of the step the shared-expert
stream overlaps. Those numbers say whether a step is limited by the kernels' own durations
(inner loops, bytes) or by launch gaps (fusion, programmatic dependent launch).

Run on the GPU: ``python -m benchmarks.step_profile --tokens 1 4 --out benchmarks/results/step_profile_h200.md
--json benchmarks/results/step_profile_h200.json``; ``--from-json`` renders a saved run again (no GPU).
No vLLM import.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

from benchmarks.decode_step import CONFIG, Model, class_bytes, plan_bytes_ours, set_moe_path
from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timeline import covered_us
from benchmarks.timing import stacked_time_us

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def capture(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def trace_events(prof) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    return trace.get("traceEvents", [])


def kernels_of(trace: list[dict]) -> list[dict]:
    events = [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]),
               "stream": e.get("args", {}).get("stream", e.get("tid")),
               "corr": e.get("args", {}).get("correlation")}
              for e in trace if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def kernel_events(graph: torch.cuda.CUDAGraph, replays: int) -> list[list[dict]]:
    """Kernel events (name, ts, dur in us, stream) of each of ``replays`` profiled replays."""
    from torch.profiler import ProfilerActivity, profile

    per_replay = []
    for _ in range(replays):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        per_replay.append(kernels_of(trace_events(prof)))
    return per_replay


def class_sequences(step_with_op) -> list[tuple[str, str, bool]]:
    """Op class of each kernel, per stream in launch order, from one eager step whose ops run
    inside ``record_function("cls:<class>")`` ranges (a kernel's launch call carries the same
    correlation id as the kernel; the range around the launch names its class): a list of
    (kernel name, class, on the shared-expert stream) in start order."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def op(cls, fn):
        with record_function(f"cls:{cls}"):
            return fn()

    step_with_op(op)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_with_op(op)
        torch.cuda.synchronize()
    trace = trace_events(prof)
    ranges = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"][4:]) for e in trace
                    if e.get("ph") == "X" and str(e.get("name", "")).startswith("cls:"))
    launch_cls = {}
    for e in trace:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("args", {}).get("correlation") is not None:
            t = float(e["ts"])
            inner = [r for r in ranges if r[0] <= t <= r[1]]
            if inner:
                launch_cls[e["args"]["correlation"]] = min(inner, key=lambda r: r[1] - r[0])[2]
    kernels = kernels_of(trace)
    main_stream = collections.Counter(k["stream"] for k in kernels).most_common(1)[0][0]
    return [(k["name"], launch_cls.get(k["corr"], "unattributed"), k["stream"] != main_stream) for k in kernels]


def attribute(events: list[dict], sequence: list[tuple[str, str, bool]]) -> tuple[dict, str]:
    """Critical-path time per op class: the replay's kernels are matched to the eager run's by
    name and occurrence (the n-th launch of a kernel is the same op in both; a graph may map its
    branches to other streams than the eager run used). Over the kernels not on the shared-expert
    stream, in start order, each owns the time from the later of its start and the previous one's
    end to its own end (a kernel that PDL-launched early owns only what it adds); idle time between
    them is 'gaps' (launch latency and the wait for the shared-expert stream). Returns
    (class -> us, note)."""
    queue = collections.defaultdict(collections.deque)
    for name, cls, side in sequence:
        queue[name].append((cls, side))
    got = collections.Counter(e["name"] for e in events)
    want = collections.Counter(name for name, _, _ in sequence)
    if got != want:
        diff = {n: (got[n], want[n]) for n in got.keys() | want.keys() if got[n] != want[n]}
        return {}, f"graph replay and eager run launch different kernels {dict(list(diff.items())[:4])}; no attribution"
    out = collections.Counter()
    prev_end = None
    for e in sorted(events, key=lambda e: e["ts"]):
        cls, side = queue[e["name"]].popleft()
        if side:
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        if prev_end is not None and start > prev_end:
            out["gaps"] += start - prev_end
        out[cls] += max(0.0, end - (start if prev_end is None else max(start, prev_end)))
        prev_end = end if prev_end is None else max(prev_end, end)
    return dict(out), ("kernels matched to the eager run's by name and occurrence; shared-expert stream "
                       "excluded from the path")


def analyse(events: list[dict]) -> dict:
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    streams = collections.Counter(e["stream"] for e in events)
    main = streams.most_common(1)[0][0]
    main_ev = [e for e in events if e["stream"] == main]
    side_ev = [e for e in events if e["stream"] != main]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(main_ev, main_ev[1:])]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    return {
        "span_us": span, "kernels": len(events), "main_kernels": len(main_ev),
        "busy_any_us": covered_us(events), "busy_main_us": covered_us(main_ev),
        "sum_main_us": sum(e["dur"] for e in main_ev), "sum_side_us": sum(e["dur"] for e in side_ev),
        "gap_main_us": sum(g for g in gaps if g > 0), "overlap_main_us": -sum(g for g in gaps if g < 0),
        "gaps_over_2us": sum(1 for g in gaps if g > 2.0), "median_gap_us": sorted(gaps)[len(gaps) // 2] if gaps else 0,
        "by_name": {k: v for k, v in sorted(by_name.items(), key=lambda t: -t[1][1])},
    }


def median_replay(replays: list[list[dict]]) -> tuple[list[dict], dict]:
    """The replay whose span is the median (one real replay, not a blend) and its analysis."""
    done = sorted(((ev, analyse(ev)) for ev in replays), key=lambda t: t[1]["span_us"])
    return done[len(done) // 2]


BYTE_CLASSES = ("dense_fp8", "moe_routed", "head")  # the classes that move most of a step's bytes


def plan_floor_us(cfg: dict, context: int, tokens: int, copy_gbs: float) -> float:
    """The byte-model floor of the vllm-ling step (``decode_step``'s: target verify + NEXTN draft)."""
    from vllm_ling.models import cost_model as P

    return sum(plan_bytes_ours(P.build_plan(cfg, context=context, verify_tokens=tokens))) / (copy_gbs * 1e3)


def byte_classes_at_floor_us(row: dict, copy_gbs: float) -> float:
    """The critical path with the byte-moving classes at their own floors and every other class
    (and the gaps) as measured: a lower bound on the step without changing the other ops."""
    cls, nb = row["classes"], row["class_bytes"]
    return (sum(us for name, us in cls.items() if name not in BYTE_CLASSES)
            + sum(nb.get(name, 0.0) / (copy_gbs * 1e3) for name in BYTE_CLASSES))


def render(head: str, rows: list[dict], argv: list[str], copy_gbs: float) -> str:
    lines = [f"# One decode step, kernel by kernel (vllm-ling composition)", "",
             f"`python -m benchmarks.step_profile {' '.join(argv)}`", "", head, "",
             "One CUDA graph of the whole step (target + NEXTN draft step), replayed under the torch profiler; the "
             "replay with the median span is shown. `graph us`: the same graph timed with CUDA events (no "
             "profiler). `span`: first kernel start to last kernel end. `busy main`: time the main stream runs a "
             "kernel; `gaps main`: idle time between consecutive main-stream kernels (launch latency, ramp of the "
             "next launch, dependency waits); `PDL overlap`: main-stream time where a kernel started before the "
             "previous one ended (programmatic dependent launch). `side`: kernel time on the shared-expert stream. "
             "`serial shared us`: the graph timed with the shared expert on the main stream before top-k, as vLLM "
             "runs it with `VLLM_DISABLE_SHARED_EXPERTS_STREAM=1` (or above `VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD` "
             "tokens).",
             "",
             "| T | graph us | span us | kernels | busy main us | gaps main us | gaps > 2 us | median gap us | "
             "PDL overlap us | side us | serial shared us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["analysis"]
        lines.append(f"| {r['tokens']} | {r['graph_us']:.0f} | {a['span_us']:.0f} | {a['kernels']} | "
                     f"{a['busy_main_us']:.0f} | {a['gap_main_us']:.0f} | {a['gaps_over_2us']} | "
                     f"{a['median_gap_us']:.2f} | {a['overlap_main_us']:.0f} | {a['sum_side_us']:.0f} | "
                     f"{r['serial_shared_us']:.0f} |")
    lines += ["", "Critical path per op class (see `attribute`): time on the main stream each class adds, the "
              "bytes it must move (as `decode_step` counts them), the time those bytes take at the copy "
              f"bandwidth ({copy_gbs:.0f} GB/s, this run) and the ratio. `shared expert` kernels on the side "
              "stream are not on this path.", ""]
    for r in rows:
        cls, nb = r["classes"], r["class_bytes"]
        lines += [f"T={r['tokens']}: {r['attribution_note']}", "",
                  "| op class | critical-path us | share | MB | floor us | x floor |", "|---|---|---|---|---|---|"]
        total = sum(cls.values()) or 1.0
        for name, us in sorted(cls.items(), key=lambda t: -t[1]):
            b = nb.get(name, 0.0)
            floor = b / (copy_gbs * 1e3) if b else 0.0
            lines.append(f"| {name} | {us:.0f} | {us / total:.2f} | {b / 1e6:.0f} | "
                         + (f"{floor:.0f} | {us / floor:.1f} |" if floor else "- | - |"))
        lines.append("")
    lines += ["Lower bound without changing the other ops: the critical path with "
              f"{', '.join(BYTE_CLASSES)} at their own byte floors and every other class and the gaps as "
              "measured, against the byte-model floor of the step (`decode_step`'s, same bandwidth):", "",
              "| T | path us (measured) | bound us | floor us | path / floor | bound / floor |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if not r["classes"]:
            continue
        path, bound, floor = sum(r["classes"].values()), byte_classes_at_floor_us(r, copy_gbs), r["plan_floor_us"]
        lines.append(f"| {r['tokens']} | {path:.0f} | {bound:.0f} | {floor:.0f} | {path / floor:.2f} | "
                     f"{bound / floor:.2f} |")
    for r in rows:
        a = r["analysis"]
        lines += ["", f"Kernels by summed time, T={r['tokens']} (all streams):", "",
                  "| kernel | launches | sum us | mean us | share of span |", "|---|---|---|---|---|"]
        for name, (n, us) in list(a["by_name"].items())[:25]:
            short = name if len(name) <= 90 else name[:87] + "..."
            lines.append(f"| `{short.replace('|', '/')}` | {n} | {us:.0f} | {us / n:.2f} | "
                         f"{us / a['span_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "step_profile_h200.md"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--from-json", default=None,
                        help="render --out from a --json file of an earlier run (no GPU needed)")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        write_outputs(render(saved["head"], saved["rows"], saved["argv"], saved["copy_gbs"]), args.out, None, {})
        return 0
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    head = f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs; torch {torch.__version__}"
    copy_gbs, copy_how = copy_bandwidth_gbs()
    head += f"; copy bandwidth {copy_gbs:.0f} GB/s ({copy_how})"
    print(head, flush=True)
    cfg = json.load(open(CONFIG))
    model = Model(cfg, max(args.tokens), args.context, dev)
    set_moe_path(model, "ours")
    gen = torch.Generator(device=dev).manual_seed(5)
    rows = []
    for T in args.tokens:
        tokens = torch.randint(0, cfg["vocab_size"], (T,), device=dev, generator=gen)

        def run():
            return model.step(tokens, "ours", lambda cls, fn: fn())

        graph_us = stacked_time_us([run], 10)
        model.shared_stream = False
        serial_us = stacked_time_us([run], 10)
        model.shared_stream = True
        print(f"T={T}: shared expert on its own stream {graph_us:.0f} us, on the main stream {serial_us:.0f} us",
              flush=True)
        sequences = class_sequences(lambda op: model.step(tokens, "ours", op))
        graph = capture(run)
        replays = kernel_events(graph, args.replays)
        events, a = median_replay(replays)
        classes, note = attribute(events, sequences)
        rows.append({"tokens": T, "graph_us": graph_us, "serial_shared_us": serial_us, "analysis": a, "classes": classes,
                     "attribution_note": note, "class_bytes": class_bytes(model, T, "ours"),
                     "plan_floor_us": plan_floor_us(cfg, args.context, T, copy_gbs)})
        print(f"T={T}: graph {graph_us:.0f} us, span {a['span_us']:.0f}, busy main {a['busy_main_us']:.0f}, "
              f"gaps {a['gap_main_us']:.0f} ({a['main_kernels']} main kernels), side {a['sum_side_us']:.0f}",
              flush=True)
        del graph
    write_outputs(render(head, rows, argv, copy_gbs), args.out, args.json,
                  {"head": head, "copy_gbs": copy_gbs, "argv": argv, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
