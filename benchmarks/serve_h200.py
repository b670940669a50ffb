"""The whole model served by real vLLM + vllm-ling, measured: batch-1 TPOT, MTP iteration, memory, start-up.

``run`` serves one composition with ``vllm-ling serve`` (CUDA graphs, torch.compile, strict startup
verification) and measures it through the OpenAI API, as a user's client sees it:

- the full-size Ling-3.0-flash-fp4 architecture (``vllm_ling/data/ling3_flash_fp4_config.json``) with
  ``--load-format dummy`` and a tiny tokenizer (prompts are token ids), or ``--model DIR``;
- ``--composition ours`` (vllm-ling's defaults) or ``upstream`` (every ``VLLM_LING_*`` switch at its
  opt-out: :func:`vllm_ling.options.upstream_composition`, BF16 head, vLLM's kernels);
- per context (a short prompt and a 32K one), greedy streamed completions with ``ignore_eos``: TPOT is
  (last token time - first token time) / (tokens - 1) per request, median over the repeats; with MTP
  the iteration time is the same span over the drafts counted by vLLM's ``/metrics`` in it, so the TPOT
  at an accept length L is iteration / L (dummy weights accept almost nothing: the measured TPOT is
  the iteration);
- the device copy bandwidth measured in the same process before the server starts (the floor's
  bandwidth), the start-up split read from vLLM's and vllm-ling's own log lines and report, memory
  (weights, KV cache bytes and tokens), the server's exit code after SIGTERM.

``render`` turns the ``run`` JSON files into ``benchmarks/results/serve_h200.md``: each TPOT beside the
byte-model floor (``vllm-ling plan`` bytes at the measured copy bandwidth), the fraction of the copy
bandwidth, and the ratio to the upstream composition of the same session.

On the H200 (vLLM from ``../shared/tools/device-vllm.sh``)::

    python3 -m benchmarks.serve_h200 run --composition ours --mtp --json $OUT/ours-mtp.json --logs $OUT
    python3 -m benchmarks.serve_h200 run --composition ours --dspark --json $OUT/ours-dspark.json --logs $OUT
    python3 -m benchmarks.serve_h200 run --composition ours --json $OUT/ours.json --logs $OUT
    python3 -m benchmarks.serve_h200 run --composition upstream --json $OUT/upstream.json --logs $OUT
    python3 -m benchmarks.serve_h200 render $OUT/*.json --out benchmarks/results/serve_h200.md
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FULL_CONFIG = REPO / "vllm_ling" / "data" / "ling3_flash_fp4_config.json"
LONG_CONTEXT = 32768
SHORT_CONTEXT = 64
ACCEPT_LENGTHS = (2.68, 3.90)  # the study's GSM8K and synthetic accept lengths (BRIEF.md)
# DSpark: the target point, the drafter's model-card mean and GSM8K figure, SGLang's B200 run
DSPARK_ACCEPT_LENGTHS = (4.0, 5.29, 6.22, 6.40)
DSPARK_CONFIG = REPO / "vllm_ling" / "data" / "ling3_flash_dspark_config.json"

# vLLM's and vllm-ling's own start-up log lines -> seconds (the last match wins)
STARTUP_PATTERNS = {
    "load_weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_load_s": r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}
VLLM_TIMESTAMP = r"(\d\d-\d\d \d\d:\d\d:\d\d)"  # vLLM's log lines: "INFO 12-06 16:51:04 [file.py:line] ..."
WARMUP_LINE = VLLM_TIMESTAMP + r" \[kernel_warmup\.py"
CAPTURE_LINE = VLLM_TIMESTAMP + r" \[[^\]]*\] " + STARTUP_PATTERNS["graph_capture_s"]
WEIGHTS_GIB = r"Model loading took ([\d.]+) GiB memory"
# vLLM's JIT monitor: a Triton kernel compiled while serving requests (a latency spike the user sees)
JIT_DURING_INFERENCE = r"Triton kernel JIT compilation during inference: (\w+)"
KV_TOKENS = r"GPU KV cache size: ([\d,]+) tokens"


def slice_config(layers: int | None) -> bytes:
    """The full-size config, or a full-width slice of its first ``layers`` decoder layers in the real
    pattern (KDA, every sixth MLA, two dense-MLP layers first) whose last layer keeps the last full
    layer's SwiGLU limits, so the slice runs a limited MoE layer too: for iterating on one op class
    in minutes instead of the full size's 6-7 (its timings are per slice, not the model's)."""
    if layers is None:
        return FULL_CONFIG.read_bytes()
    cfg = json.loads(FULL_CONFIG.read_text())
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"--layers must be 1..{cfg['num_hidden_layers']}, got {layers}")
    cfg["num_hidden_layers"] = layers
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        cfg[key] = cfg[key][:layers - 1] + cfg[key][-1:]
    return (json.dumps(cfg, indent=2) + "\n").encode()


def dummy_checkpoint(out: Path, layers: int | None = None) -> Path:
    """The full-size architecture (or a slice of it, :func:`slice_config`) with no weights (served
    with --load-format dummy) and a tiny tokenizer with the Ling-3 chat template (the start-up chat
    round trip needs one)."""
    from vllm_ling.models.tiny_checkpoint import make_tiny

    config = slice_config(layers)
    model = out / ("ling3-flash-fp4-dummy" + (f"-L{layers}" if layers else ""))
    if (model / "config.json").is_file() and (model / "config.json").read_bytes() == config:
        return model  # made by an earlier run (what follows writes config.json last)
    shutil.rmtree(model, ignore_errors=True)
    shutil.rmtree(out / "tokenizer-source", ignore_errors=True)
    tiny = make_tiny(out / "tokenizer-source", seed=0)
    model.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy(f, model / f.name)
    (model / "config.json").write_bytes(config)
    return model


def dummy_drafter(out: Path) -> Path:
    """The full-size DSpark drafter with no weights (vLLM loads the drafter with the target's
    --load-format dummy): its config.json alone (``vllm_ling/data/ling3_flash_dspark_config.json``)."""
    drafter = out / "ling3-flash-dspark-dummy"
    drafter.mkdir(parents=True, exist_ok=True)
    shutil.copy(DSPARK_CONFIG, drafter / "config.json")
    return drafter


def copy_bandwidth() -> tuple[float | None, str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return None, "no CUDA device"
        from benchmarks.lm_head import copy_bandwidth_gbs

        gbs, how = copy_bandwidth_gbs()
        torch.cuda.empty_cache()
        return gbs, how
    except Exception as exc:  # the measurement is reported, the run goes on
        return None, f"copy bandwidth not measured: {type(exc).__name__}: {exc}"


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception as exc:  # the name is a label: the run goes on
        return f"unknown ({type(exc).__name__})"


def parse_startup(log: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, pattern in STARTUP_PATTERNS.items():
        found = re.findall(pattern, log)
        out[key] = float(found[-1]) if found else None
    out["warmup_steps_s"] = warmup_steps_s(log)
    return out


def warmup_steps_s(log: str) -> float | None:
    """vLLM's scheduler-realistic warm-up steps before the graph capture (v1/worker/gpu/warmup.py, which
    logs nothing: the kernels a first prefill and decode build): from the kernel warm-up's last line to
    the end of the capture, less the capture. Whole seconds (vLLM's timestamps)."""
    last_warmup = None
    for line in log.splitlines():
        if (m := re.search(WARMUP_LINE, line)):
            last_warmup = m.group(1)
        elif last_warmup and (c := re.search(CAPTURE_LINE, line)):
            span = datetime.strptime(c.group(1), "%m-%d %H:%M:%S") - datetime.strptime(last_warmup, "%m-%d %H:%M:%S")
            return max(span.total_seconds() - float(c.group(2)), 0.0)
    return None


def jit_during_inference(log: str) -> dict[str, int]:
    """Kernel name -> how often vLLM's JIT monitor saw it compiled while requests were served."""
    return dict(collections.Counter(re.findall(JIT_DURING_INFERENCE, log)))


def metric_sum(base: str, prefix: str) -> float:
    from vllm_ling.launcher.local_server import scrape

    return sum(v for k, v in scrape(base).items() if k.startswith(prefix))


def stream_once(base: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One greedy streamed completion: first/last token times and token counts (usage per chunk)."""
    import requests

    drafts0 = metric_sum(base, "vllm:spec_decode_num_drafts_total")
    accepted0 = metric_sum(base, "vllm:spec_decode_num_accepted_tokens_total")
    t_send = time.perf_counter()
    first = last = None
    first_tokens = tokens = 0
    with requests.post(base + "/v1/completions", stream=True, timeout=900, json={
            "model": "ling", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        r.raise_for_status()
        for raw in r.iter_lines():
            if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                continue
            chunk = json.loads(raw[6:])
            usage = chunk.get("usage") or {}
            count = int(usage.get("completion_tokens") or 0)
            if count > tokens:
                now = time.perf_counter()
                if first is None:
                    first, first_tokens = now, count
                last, tokens = now, count
    drafts = metric_sum(base, "vllm:spec_decode_num_drafts_total") - drafts0
    accepted = metric_sum(base, "vllm:spec_decode_num_accepted_tokens_total") - accepted0
    decode_s = (last - first) if first is not None else 0.0
    return {"ttft_s": (first - t_send) if first else None, "tokens": tokens, "decode_tokens": tokens - first_tokens,
            "decode_s": decode_s, "drafts": drafts, "accepted": accepted}


def measure(base: str, context: int, max_tokens: int, repeats: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed + context)
    runs = []
    for _ in range(repeats):
        prompt = [rng.randrange(100, 2000) for _ in range(context)]
        runs.append(stream_once(base, prompt, max_tokens))
    tpots = [1e3 * r["decode_s"] / r["decode_tokens"] for r in runs if r["decode_tokens"] > 0]
    out: dict[str, Any] = {"context": context, "max_tokens": max_tokens, "runs": runs, "run_tpots_ms": tpots,
                           "tpot_ms": statistics.median(tpots) if tpots else None}
    drafts = sum(r["drafts"] for r in runs)
    if drafts:
        # the draft counted at the prefill step has no decode span: iterations in the span = drafts - 1
        iters = [1e3 * r["decode_s"] / max(r["drafts"] - 1, 1) for r in runs if r["drafts"] > 1]
        out["iteration_ms"] = statistics.median(iters) if iters else None
        out["accept_length"] = 1 + sum(r["accepted"] for r in runs) / drafts
    return out


def measure_ttft(base: str, contexts: list[int], repeats: int, seed: int) -> list[dict[str, Any]]:
    """Time to the first token per prompt length (one token asked for; 2048-token prefill chunks as served)."""
    out = []
    for context in contexts:
        rng = random.Random(seed + 7 * context)
        runs = [stream_once(base, [rng.randrange(100, 2000) for _ in range(context)], 1) for _ in range(repeats)]
        ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
        out.append({"context": context, "ttft_s": ttfts, "median_s": statistics.median(ttfts) if ttfts else None})
    return out


PROFILE_DECODE_ITERATIONS = 24


def profile_windows(base: str, trace_dir: Path, out_dir: Path, prefills: list[int],
                    decode_context: int) -> dict[str, Any]:
    """vLLM's torch profiler over named windows (the server runs with --profiler-config): one prefill of
    each length in ``prefills`` (max_tokens 1) and PROFILE_DECODE_ITERATIONS decode iterations of a
    request at ``decode_context`` tokens, each trace compacted into ``out_dir``
    (benchmarks/vllm_profile.py reads them)."""
    import threading

    import requests

    from benchmarks.vllm_profile import write_compact

    def start(name: str, **kw) -> None:
        requests.post(base + "/start_profile", json={"profile_prefix": name, **kw}, timeout=600).raise_for_status()

    def stop() -> None:
        requests.post(base + "/stop_profile", timeout=600).raise_for_status()

    rng = random.Random(11)
    done: dict[str, Any] = {}
    for n in prefills:
        name = f"prefill-{n}"
        prompt = [rng.randrange(100, 2000) for _ in range(n)]
        stream_once(base, prompt, 1)  # the same length once unprofiled: first-use work stays out
        start(name)
        t0 = time.perf_counter()
        stream_once(base, [rng.randrange(100, 2000) for _ in range(n)], 1)
        done[name] = {"request_s": time.perf_counter() - t0}
        stop()
    # decode: profile iterations of a running 32K-context request (its prefill is over before the start)
    name = f"decode-{decode_context}"
    first = threading.Event()
    box: dict[str, Any] = {}

    def decode() -> None:
        prompt = [rng.randrange(100, 2000) for _ in range(decode_context)]
        import requests as rq
        with rq.post(base + "/v1/completions", stream=True, timeout=900, json={
                "model": "ling", "prompt": prompt, "max_tokens": 256, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            for raw in r.iter_lines():
                if raw.startswith(b"data: ") and raw != b"data: [DONE]":
                    # the first chunk: the prefill is over (vLLM may put several tokens in one chunk,
                    # so counting chunks cannot say how many decode steps are left)
                    box["chunks"] = box.get("chunks", 0) + 1
                    first.set()
        first.set()

    t = threading.Thread(target=decode)
    t.start()
    first.wait(timeout=600)
    start(name, max_iterations=PROFILE_DECODE_ITERATIONS)
    t.join()
    stop()
    done[name] = {"chunks": box.get("chunks")}
    for w in done:
        for _ in range(60):  # the worker writes the trace after the stop returns
            out = write_compact(trace_dir, w, out_dir)
            if out:
                break
            time.sleep(2)
        done[w]["compact"] = str(out) if out else None
    return done


def run(args) -> int:
    from vllm_ling.options import upstream_composition
    from vllm_ling.launcher.local_server import ServerError, free_port, log_tail, start_server

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{args.composition}{'-mtp' if args.mtp else '-dspark' if args.dspark else ''}"
    name += f"-L{args.layers}" if args.layers else ""
    name += "".join(f"-{k[len('VLLM_LING_'):].lower()}={v}" for k, v in dict(args.switch).items())  # once each
    name += f"-{args.tag}" if args.tag else ""
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    # one path for every run: vLLM's torch.compile cache is keyed by the model path, so a second
    # start of the same composition on the machine loads its compiled graphs instead of recompiling
    model = Path(args.model) if args.model else dummy_checkpoint(Path(tempfile.gettempdir()) / "vllm-ling-serve-bench",
                                                                args.layers)
    copy_gbs, copy_how = copy_bandwidth()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    if args.composition == "upstream":
        env.update(upstream_composition())
    env["VLLM_LING_MTP"] = "1" if args.mtp or args.dspark else "0"
    env.update(args.switch)  # an A/B run's one switch (the caller's own VLLM_LING_* are not passed on)
    if args.dspark:  # vllm-ling's default speculation with the DSpark drafter (its block_size tokens)
        env["VLLM_LING_DSPARK_MODEL"] = str(dummy_drafter(Path(tempfile.gettempdir()) / "vllm-ling-serve-bench"))
    if not args.model:  # dummy weights accept (almost) no draft: the launcher's smoke check would refuse
        env["VLLM_LING_SMOKE"] = "0"
    port = free_port()
    report_path = work / "report.json"
    cmd = [sys.executable, "-m", "vllm_ling.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "ling", "--report-path", str(report_path),
           "--max-model-len", str(max(args.contexts) + 2 * max(args.tokens, args.long_tokens)), "--max-num-seqs", "2",
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--"]
    if args.device == "cuda":
        cmd += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    if not args.model:
        cmd += ["--load-format", "dummy"]
    cmd += ["--seed", "0", *args.vllm_arg]
    trace_dir = None
    if args.profile_dir:
        trace_dir = Path(tempfile.mkdtemp(prefix="vllm-traces-"))
        cmd += ["--profiler-config", json.dumps({
            "profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False,
            "ignore_frontend": True,
            "torch_profiler_activities": ["CPU", "CUDA"] if args.device == "cuda" else ["CPU"]})]
    log_path = logs / f"{name}.log"
    result: dict[str, Any] = {"name": name, "layers": args.layers, "composition": args.composition, "mtp": args.mtp,
                              "dspark": args.dspark,
                              "command": cmd,
                              "switches": {k: v for k, v in env.items() if k.startswith("VLLM_LING_")},
                              "copy_gbs": copy_gbs, "copy_how": copy_how, "device": device_name(),
                              "block_fp8_env": {k: os.environ.get(k) for k in (
                                  "VLLM_USE_DEEP_GEMM", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER")}}
    t0 = time.perf_counter()
    try:
        server = start_server(cmd, env, log_path, port, timeout=args.startup_timeout, stall_s=args.stall_timeout or None)
    except ServerError as exc:
        result.update(error=str(exc)[-4000:], startup_s=time.perf_counter() - t0)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"{name}: the server did not start:\n{log_tail(log_path, 40)}", file=sys.stderr)
        return 1
    result["startup_s"] = time.perf_counter() - t0
    try:
        report = json.loads(report_path.read_text())
        log = server.log()
        result["startup"] = parse_startup(log)
        result["startup"]["kernel_checks_s"] = (report.get("kernel_checks") or {}).get("seconds")
        result["startup"]["humming_jit_compile_s"] = (report.get("startup") or {}).get("humming_jit_compile_s")
        weights = re.findall(WEIGHTS_GIB, log)
        kv_tokens = re.findall(KV_TOKENS, log)
        result["memory"] = {"weights_gib": float(weights[-1]) if weights else None,
                            "kv_cache_bytes": (report.get("memory") or {}).get("kv_cache_bytes"),
                            "kv_cache_tokens": int(kv_tokens[-1].replace(",", "")) if kv_tokens else None}
        result["verification"] = {"passed": report["passed"], "policy": report["policy"],
                                  "failed": [c for c in report["checks"] if not c["passed"]],
                                  "optimizations": {n: o["active"] for n, o in report["optimizations"].items()},
                                  "kernels": (report.get("kernel_checks") or {}).get("summary"),
                                  "dense_fp8": ((report.get("kernel_checks") or {}).get("dense_fp8") or {}).get("kernels"),
                                  # what MLA decode ran on (an --attention-backend A/B shows it took)
                                  "attention_backends": report.get("attention_backends")}
        short, long = min(args.contexts), max(args.contexts)
        if args.healthy_file:
            Path(args.healthy_file).touch()
        if args.wait_for:  # other GPU work of the same session ends first: the timings are this server's
            deadline = time.monotonic() + args.wait_for_s
            waiting = [Path(f) for f in args.wait_for.split(",")]
            while not all(f.exists() for f in waiting) and time.monotonic() < deadline:
                time.sleep(1)
            result["waited_for"] = {"files": args.wait_for, "found": all(f.exists() for f in waiting)}
        stream_once(server.base_url, [7] * short, 8)  # warm-up: first-request work stays out of the numbers
        result["contexts"] = [measure(server.base_url, short, args.tokens, args.repeats, 0),
                              measure(server.base_url, long, args.long_tokens, args.long_repeats, 0)]
        if args.ttft_contexts:
            result["ttft"] = measure_ttft(server.base_url, args.ttft_contexts, args.ttft_repeats, 0)
        if trace_dir is not None:
            out_dir = Path(args.profile_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            result["profile"] = profile_windows(server.base_url, trace_dir, out_dir, args.profile_prefills, long)
    except Exception as exc:  # what was measured is kept
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        result["stop_rc"] = server.stop(timeout=120)
        result["jit_during_inference"] = jit_during_inference(log_path.read_text(errors="replace")
                                                              if log_path.exists() else "")
        if args.done_file:
            Path(args.done_file).touch()
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("name", "startup_s", "startup", "memory", "stop_rc", "error")}))
    for c in result.get("contexts", []):
        runs = [round(t, 3) for t in c["run_tpots_ms"]]
        print(f"{name} context {c['context']}: TPOT {c['tpot_ms']} ms (runs {runs}), iteration "
              f"{c.get('iteration_ms')} ms, accept length {c.get('accept_length')}")
    for t in result.get("ttft", []):
        print(f"{name} TTFT at {t['context']} tokens: {t['ttft_s']}")
    return 0 if "error" not in result else 1


def plan_bytes(context: int) -> dict[str, Any]:
    """``vllm-ling plan``'s byte model for the full-size model at ``context`` tokens."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "vllm_ling.cli", "plan", "--device", "h200", "--context", str(context),
                        "--drafter", "dspark", "--no-study", "--json", f.name], check=True, capture_output=True)
        return json.loads(Path(f.name).read_text())


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def role(run: dict) -> str:
    """What a run is, whatever switches its name carries: ``ours``, ``ours-mtp``, ``ours-dspark`` or
    ``upstream``, with ``-L<n>`` for a slice (a lease serves a failed cut switched off under a longer name)."""
    kind = run["composition"] + ("-mtp" if run.get("mtp") else "") + ("-dspark" if run.get("dspark") else "")
    return kind + _slice_suffix(run)


def _slice_suffix(run: dict) -> str:
    return f"-L{run['layers']}" if run.get("layers") else ""


def by_role(runs: list[dict]) -> dict[str, dict]:
    """Role -> the first run of that role."""
    out: dict[str, dict] = {}
    for r in runs:
        out.setdefault(role(r), r)
    return out


def same_size_upstream(run: dict, roles: dict[str, dict]) -> dict | None:
    """The upstream composition's run of the same model size (a slice compares with its own)."""
    return roles.get("upstream" + _slice_suffix(run))


def ttft_medians(run: dict) -> dict[int, float]:
    """Prompt length -> median time to the first token: the TTFT measurement, else the first token of the
    TPOT requests (runs before the TTFT measurement existed; the same prompt, more tokens asked for)."""
    out = {}
    for c in run.get("contexts", []):
        got = [r["ttft_s"] for r in c.get("runs", []) if r.get("ttft_s") is not None]
        if got:
            out[c["context"]] = statistics.median(got)
    out.update({t["context"]: t["median_s"] for t in run.get("ttft", []) if t.get("median_s") is not None})
    return out


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render(args) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.files]
    roles = by_role(runs)
    copy = [r["copy_gbs"] for r in runs if r.get("copy_gbs")]
    copy_gbs = statistics.median(copy) if copy else None
    plans = {c: plan_bytes(c) for c in sorted({c["context"] for r in runs for c in r.get("contexts", [])})}
    devices = sorted({r.get("device") or "unknown device" for r in runs})
    lines = [f"# Ling-3.0-flash served by real vLLM 0.32 + vllm-ling on {', '.join(devices)} (full-size, dummy weights)",
             "",
             f"Produced by `benchmarks/serve_h200.py` (`run` per composition, then `render`). Batch 1, CUDA graphs "
             f"and torch.compile, strict startup verification. Copy bandwidth measured in the same runs: "
             f"{copy_gbs:.0f} GB/s ({runs[0].get('copy_how')})." if copy_gbs else "Copy bandwidth not measured.", "",
             "vLLM's block-FP8 selection environment in these runs: "
             + ", ".join(f"{k}={v}" for k, v in (runs[0].get("block_fp8_env") or {}).items()) + " (unset: vLLM's default)."
             if runs[0].get("block_fp8_env") else "", "",
             "Floor: `vllm-ling plan`'s bytes per step (FP8 head for ours, BF16 head for upstream; the verify "
             "window 4 tokens plus 3 draft steps for an MTP iteration) at the measured copy bandwidth.", "",
             "| composition | context | TPOT ms (1 token) | floor ms | TPOT / floor | fraction of copy bw | "
             "upstream / this |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.get("mtp") or r.get("dspark"):
            continue
        head = "bf16" if r["composition"] == "upstream" else "fp8"
        peer = same_size_upstream(r, roles)
        for c in r.get("contexts", []):
            # the plan's floor is the whole model's: a slice (--layers) has none
            floor = plans[c["context"]]["heads"][head]["bytes_per_token_batch1"] / (copy_gbs * 1e9) * 1e3 \
                if copy_gbs and not r.get("layers") else None
            up = next((u["tpot_ms"] for u in (peer or {}).get("contexts", []) if u["context"] == c["context"]), None)
            t = c["tpot_ms"]
            lines.append(f"| {r['name']} | {c['context']} | {_ms(t)} | {_ms(floor)} | "
                         f"{t / floor:.2f}x | {floor / t:.2f} | " if t and floor else
                         f"| {r['name']} | {c['context']} | {_ms(t)} | {_ms(floor)} | - | - | ")
            lines[-1] += f"{up / t:.2f}x |" if up and t else "- |"
    ttft = {r["name"]: ttft_medians(r) for r in runs}
    ttft_lengths = sorted({n for r in runs if not r.get("mtp") for n in ttft[r["name"]]})
    if ttft_lengths:

        lines += ["", "Time to the first token (one request at a time, 2048-token prefill chunks; median of the "
                  "repeats, seconds) and the upstream composition's over this one (below 1.00x: slower than "
                  "upstream):", "",
                  "| composition | " + " | ".join(f"TTFT s at {n} tokens" for n in ttft_lengths) + " | "
                  + " | ".join(f"upstream / this at {n}" for n in ttft_lengths) + " |",
                  "|---|" + "---|" * (2 * len(ttft_lengths))]
        for r in runs:
            mine = ttft[r["name"]]
            if not mine:
                continue
            up_ttft = ttft.get((same_size_upstream(r, roles) or {}).get("name"), {})
            lines.append(f"| {r['name']} | " + " | ".join(_s(mine.get(n)) for n in ttft_lengths) + " | "
                         + " | ".join(f"{up_ttft[n] / mine[n]:.2f}x" if mine.get(n) and up_ttft.get(n) else "-"
                                      for n in ttft_lengths) + " |")
    mtp = roles.get("ours-mtp")
    plain = roles.get("ours")
    if mtp:
        lines += ["", "MTP (3 draft tokens): one draft + verify iteration, and the TPOT it gives at the study's "
                  "accept lengths (iteration / L). Dummy weights accept almost nothing, so the measured TPOT is the "
                  "iteration time.", "",
                  "| context | iteration ms | floor ms | iteration / 1-token step | measured accept length | "
                  + " | ".join(f"TPOT ms at AL {a}" for a in ACCEPT_LENGTHS) + " |",
                  "|---|---|---|---|---|" + "---|" * len(ACCEPT_LENGTHS)]
        for c in mtp.get("contexts", []):
            p = plans[c["context"]]
            step_bytes = p["heads"]["fp8"]["bytes_per_verify_step"] + p["draft_tokens"] * (
                p["mtp_draft_step_bytes_without_head"] + p["heads"]["fp8"]["head_bytes"])
            floor = step_bytes / (copy_gbs * 1e9) * 1e3 if copy_gbs else None
            it = c.get("iteration_ms")
            one = next((x["tpot_ms"] for x in (plain or {}).get("contexts", []) if x["context"] == c["context"]), None)
            lines.append(f"| {c['context']} | {_ms(it)} | {_ms(floor)} | "
                         + (f"{it / one:.2f}x" if it and one else "-") + " | "
                         + (f"{c['accept_length']:.2f}" if c.get("accept_length") else "-") + " | "
                         + " | ".join(_ms(it / a if it else None) for a in ACCEPT_LENGTHS) + " |")
    lines += dspark_lines(roles, plans, copy_gbs)
    lines += ["", "Start-up (seconds, from launch to /health; parts from vLLM's and vllm-ling's own log lines and "
              "report) and memory:", "",
              "| composition | to /health | load weights | torch.compile | warm-up steps | graph capture | engine init | "
              "known-answer checks | humming JIT | weights GiB | KV cache tokens | exit after SIGTERM |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s, m = r.get("startup") or {}, r.get("memory") or {}
        cells = [r.get("startup_s"), s.get("load_weights_s"), s.get("torch_compile_s"), s.get("warmup_steps_s"),
                 s.get("graph_capture_s"), s.get("engine_init_s"), s.get("kernel_checks_s"),
                 s.get("humming_jit_compile_s")]
        lines.append(f"| {r['name']} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells)
                     + f" | {m.get('weights_gib', '-')} | {m.get('kv_cache_tokens', '-')} | {r.get('stop_rc')} |")
    lines += ["", "Verification per run:", ""]
    for r in runs:
        v = r.get("verification") or {}
        lines.append(f"- {r['name']}: passed {v.get('passed')} ({v.get('policy')}); active: "
                     + ", ".join(n for n, a in (v.get("optimizations") or {}).items() if a)
                     + (f"; failed: {[c['name'] for c in v.get('failed', [])]}" if v.get("failed") else "")
                     + (f"; error: {r['error'][:300]}" if r.get("error") else ""))
        if v.get("dense_fp8"):
            lines.append(f"  - dense block-FP8 linears: {v['dense_fp8']}")
        if r.get("jit_during_inference"):
            lines.append("  - Triton kernels JIT-compiled while serving requests (vLLM's JIT monitor): "
                         + ", ".join(f"{k} x{n}" for k, n in sorted(r["jit_during_inference"].items())))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def dspark_lines(roles: dict[str, Any], plans: dict[int, Any], copy_gbs: float | None) -> list[str]:
    """The DSpark iteration (draft cycle + verify of draft tokens + 1) beside its byte floor, and the
    TPOT it gives at the published accept lengths, against NEXTN MTP's at the study's GSM8K 2.68
    (the issue's target: DSpark at 4.0 at most half of NEXTN at 2.68)."""
    run = roles.get("ours-dspark")
    if not run:
        return []
    mtp, plain = roles.get("ours-mtp"), roles.get("ours")
    lines = ["", "DSpark (the drafter's block of 8 draft tokens, verify 9): one draft + verify iteration and the TPOT "
             "it gives at the published accept lengths (iteration / L); dummy weights accept almost nothing, so "
             "the measured TPOT is the iteration time.", "",
             "| context | iteration ms | floor ms | iteration / 1-token step | measured accept length | "
             + " | ".join(f"TPOT ms at AL {a}" for a in DSPARK_ACCEPT_LENGTHS) + " | AL 4.0 / NEXTN at 2.68 |",
             "|---|---|---|---|---|" + "---|" * (len(DSPARK_ACCEPT_LENGTHS) + 1)]
    for c in run.get("contexts", []):
        d = plans[c["context"]].get("dspark") or {}
        floor = ((d.get("verify_step_bytes", 0) + d.get("draft_cycle_bytes", 0)) / (copy_gbs * 1e9) * 1e3
                 if copy_gbs and d else None)
        it = c.get("iteration_ms")
        one = next((x["tpot_ms"] for x in (plain or {}).get("contexts", []) if x["context"] == c["context"]), None)
        mtp_it = next((x.get("iteration_ms") for x in (mtp or {}).get("contexts", []) if x["context"] == c["context"]),
                      None)
        ratio = (it / 4.0) / (mtp_it / 2.68) if it and mtp_it else None
        lines.append(f"| {c['context']} | {_ms(it)} | {_ms(floor)} | " + (f"{it / one:.2f}x" if it and one else "-")
                     + " | " + (f"{c['accept_length']:.2f}" if c.get("accept_length") else "-") + " | "
                     + " | ".join(_ms(it / a if it else None) for a in DSPARK_ACCEPT_LENGTHS) + " | "
                     + (f"{ratio:.2f}" if ratio else "-") + " |")
    return lines


def _switch(text: str) -> tuple[str, str]:
    from vllm_ling.options import BY_NAME, read

    name, _, value = text.partition("=")
    if name not in BY_NAME:
        raise argparse.ArgumentTypeError(f"unknown vllm-ling switch {name!r}")
    try:
        read(name, {name: value})
    except ValueError as exc:  # a malformed value: the option table's message, naming the variable
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="serve one composition and measure it")
    r.add_argument("--composition", choices=("ours", "upstream"), required=True)
    spec = r.add_mutually_exclusive_group()
    spec.add_argument("--mtp", action="store_true", help="NEXTN MTP x3 on (vllm-ling's default)")
    spec.add_argument("--dspark", action="store_true",
                      help="DSpark on: a full-size drafter with dummy weights (vllm_ling/data/ling3_flash_dspark_config.json)")
    r.add_argument("--layers", type=int, default=None,
                   help="serve a full-width slice of this many decoder layers (dummy weights; no byte floor)")
    r.add_argument("--model", default=None, help="a checkpoint dir instead of the full-size dummy architecture")
    r.add_argument("--switch", type=_switch, action="append", default=[], metavar="VLLM_LING_NAME=VALUE",
                   help="one vllm-ling switch for this run (repeatable; named in the run's name)")
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the harness")
    r.add_argument("--json", required=True)
    r.add_argument("--logs", required=True, help="folder for the server log")
    r.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",")],
                   default=[SHORT_CONTEXT, LONG_CONTEXT], help="short,long prompt lengths (tokens)")
    # lease 2026-12-08a: runs of 127 / 63 decode tokens differed by up to 8 % (3.35 against 3.63 ms), more than the
    # cuts being compared: longer runs, more of them, the median (a few seconds of a phase)
    r.add_argument("--tokens", type=int, default=256, help="tokens per short-context request")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--long-tokens", type=int, default=128)
    r.add_argument("--long-repeats", type=int, default=3)
    r.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    r.add_argument("--kv-cache-gib", type=float, default=3.0)
    r.add_argument("--startup-timeout", type=float, default=540)
    # vLLM's longest silences in a healthy full-size start so far: ~150 s (torch.compile, the warm-up steps)
    r.add_argument("--stall-timeout", type=float, default=300,
                   help="stop a start whose log has not grown for this long, with its stacks in its log (0: never)")
    r.add_argument("--vllm-arg", action="append", default=[], help="one more vllm serve argument (repeatable)")
    r.add_argument("--tag", default=None, help="appended to the run's name (an A/B run's vLLM argument)")
    r.add_argument("--ttft-contexts", type=lambda v: [int(x) for x in v.split(",")] if v else [],
                   default=[512, 8192, LONG_CONTEXT], help="prompt lengths whose time to first token is measured")
    r.add_argument("--ttft-repeats", type=int, default=3)
    r.add_argument("--profile-dir", default=None,
                   help="profile named windows with vLLM's torch profiler; compact traces land here")
    r.add_argument("--profile-prefills", type=lambda v: [int(x) for x in v.split(",")],
                   default=[64, 2048, LONG_CONTEXT], help="prompt lengths of the profiled prefill windows")
    r.add_argument("--wait-for", default=None, help="measure only once this file exists (other GPU jobs done)")
    r.add_argument("--wait-for-s", type=float, default=300)
    r.add_argument("--healthy-file", default=None, help="touched once the server is healthy")
    r.add_argument("--done-file", default=None, help="touched once the server has stopped")
    g = sub.add_parser("render", help="the Markdown table from run JSON files")
    g.add_argument("files", nargs="+")
    g.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    return run(args) if args.cmd == "run" else render(args)


if __name__ == "__main__":
    sys.exit(main())
