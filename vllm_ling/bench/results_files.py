"""Writing benchmark results: ``results.json``, ``results.md`` and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_ling.log import get_logger, log_once

logger = get_logger("bench")


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    s = results["summary"]
    cfg = results["config"]
    lines = [f"## {results['label']}", ""]
    pacing = f"concurrency {cfg['concurrency'] or 'unbounded'}" + (
        f", Poisson arrivals at {cfg['request_rate']:g} requests/s (seed {cfg['seed']})"
        if cfg.get("request_rate") else "")
    lines.append(f"Server `{results['server']['base_url']}`, model `{results['server']['model']}`, "
                 f"workload **{cfg['workload']}**, {s['num_ok']}/{s['num_requests']} requests ok, "
                 f"{pacing}, started {results['started_at']}.")
    if cfg["workload"] == "synthetic":
        ins = cfg.get("input_len_dist") or cfg["input_len"]
        outs = cfg.get("output_len_dist") or cfg["output_len"]
        lines.append(f"Synthetic: random prompt tokens ({ins}), output tokens ({outs}), greedy, EOS ignored.")
    elif cfg["workload"] == "replay":
        order = f"shuffled with seed {cfg['seed']}" if cfg.get("shuffle") else "in file order"
        lines.append(f"Replay of `{cfg['requests_file']}` ({order}), chat requests as recorded.")
    else:
        lines.append(f"GSM8K: 5-shot chain of thought, temperature 0.6, top_p 0.95, top_k 29, "
                     f"max_tokens {cfg['max_tokens']}, seed {cfg['seed']}.")
    lines += ["", "| metric | mean | P50 | P95 | P99 |", "|---|---|---|---|---|"]
    for key, name, scale, digits in (("ttft_s", "TTFT (s)", 1, 3), ("tpot_ms", "TPOT (ms)", 1, 2),
                                     ("itl_ms", "ITL (ms)", 1, 2), ("e2e_s", "E2E latency (s)", 1, 2),
                                     ("output_tokens", "output tokens", 1, 0)):
        v = s[key]
        lines.append(f"| {name} | {_fmt(v['mean'], digits)} | {_fmt(v['p50'], digits)} | "
                     f"{_fmt(v['p95'], digits)} | {_fmt(v['p99'], digits)} |")
    lines += ["", "| throughput | value |", "|---|---|",
              f"| decode tok/s (1000 / mean TPOT) | {_fmt(s['decode_tokens_per_s'])} |",
              f"| output tok/s (all requests / wall time) | {_fmt(s['output_throughput_tokens_per_s'])} |",
              f"| requests/s | {_fmt(s['request_throughput_per_s'], 3)} |",
              f"| wall time (s) | {_fmt(s['duration_s'])} |"]
    spec = results.get("spec_decode")
    if spec:
        pos = ", ".join(f"{p:.3f}" for p in spec["per_position_accept_rate"])
        lines += ["", f"Speculative decoding (from `/metrics` deltas over the run): accept length "
                      f"**{spec['accept_length']:.3f}** over {spec['drafts']:.0f} drafts; acceptance "
                      f"per position: {pos}."]
    else:
        lines += ["", "Speculative decoding: none observed in `/metrics` over the run."]
    per_req = s.get("accept_length_per_request") or {}
    if per_req.get("n"):
        lines.append(f"Per request (one at a time, /metrics around each): accept length mean "
                     f"{per_req['mean']:.3f}, P50 {per_req['p50']:.3f}, min {per_req['min']:.3f}.")
    acc = results.get("accuracy")
    if acc and cfg["workload"] == "gsm8k":
        lines += ["", f"GSM8K accuracy over {acc['n']} questions: strict (`#### N`) "
                      f"**{acc['strict']:.2%}**, flexible (last number) **{acc['flexible']:.2%}** "
                      f"({acc['note']})."]
    elif acc:
        lines += _replay_lines(acc)
    lines += _length_lines(results.get("lengths"))
    lines += facts_lines(results["server"].get("facts"))
    for w in results.get("warnings", []):
        lines += ["", f"> warning: {w}"]
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _replay_lines(acc: dict[str, Any]) -> list[str]:
    lines = [""]
    if acc["n"]:
        kinds = ", ".join(f"{k} {_pct(v['correct'])} of {v['n']}" for k, v in acc["by_kind"].items())
        lines.append(f"Scored against `expected`: **{_pct(acc['correct'])}** of {acc['n']} requests "
                     f"({kinds}; {acc['note']}).")
    else:
        lines.append("No request carried an `expected` answer: nothing scored.")
    if acc["tool_requests"]:
        lines.append(f"Tool requests: {acc['tool_requests']}; returned parsed `tool_calls`: "
                     f"**{_pct(acc['tool_call_fraction'])}**" + (
                         f"; name and arguments match `expected`: **{_pct(acc['tool_match_fraction'])}** "
                         f"of {acc['tool_expected']}" if acc["tool_expected"] else "") + ".")
    return lines


def _length_lines(lengths: dict[str, Any] | None) -> list[str]:
    if not lengths:
        return []
    lines = ["", f"Lengths sent, {lengths['what']}:", "",
             "| | source | mean | P50 | P95 | min | max |", "|---|---|---|---|---|---|---|"]
    for side in ("input", "output"):
        x = lengths[side]
        v = x["summary"]
        lines.append(f"| {side} | {x['source']} | {_fmt(v['mean'], 1)} | {_fmt(v['p50'], 0)} | "
                     f"{_fmt(v['p95'], 0)} | {_fmt(v['min'], 0)} | {_fmt(v['max'], 0)} |")
    for side in ("input", "output"):
        bins = lengths[side]["histogram"]
        if bins:
            cells = ", ".join((f"{b['low']}" if b["low"] == b["high"] else f"{b['low']}-{b['high']}")
                              + f": {b['count']}" for b in bins)
            lines.append(f"\n{side.capitalize()} length histogram (tokens: requests): {cells}.")
    return lines


def facts_lines(facts: dict[str, Any] | None) -> list[str]:
    """The server-facts section of results.md."""
    if not facts:
        return []
    lines = ["", "Server facts:", ""]
    rep = facts.get("report")
    met = facts.get("metrics") or {}
    if rep:
        versions = ", ".join(f"{k} {v}" for k, v in rep["versions"].items())
        opts = ", ".join(f"{k}={'on' if v else 'off'}" for k, v in rep["optimizations"].items())
        failed = [k for k, v in rep["checks"].items() if not v]
        lines.append(f"- verification {'PASSED' if rep['passed'] else 'FAILED'} (policy {rep['policy']}, "
                     f"{rep['platform']}{', ' + rep['gpu_arch'] if rep.get('gpu_arch') else ''}); "
                     f"checks: {len(rep['checks']) - len(failed)}/{len(rep['checks'])} passed"
                     + (f", failed: {', '.join(failed)}" if failed else ""))
        lines.append(f"- optimizations active: {opts}")
        lines.append(f"- MoE backend {rep['moe_backend']}, head {rep['head_dtype']}, speculation "
                     f"{rep['spec_method'] or 'off'}"
                     + (f" x{rep['num_speculative_tokens']}" if rep["spec_method"] else ""))
        if rep.get("kernel_checks"):
            kc = rep["kernel_checks"]
            lines.append(f"- known-answer kernel checks: {sum(bool(v) for v in kc.values())}/{len(kc)} passed")
        lines.append(f"- versions: {versions}")
    else:
        lines.append(f"- no verification report ({facts['sources'].get('report')})")
    lines.append(f"- bench client: vllm-ling {facts.get('bench_vllm_ling_version')}")
    launch = facts.get("launch_to_ready_s") or met.get("launch_to_ready_s")
    lines.append("- startup: " + (f"launch to ready {launch:.1f} s" if launch is not None
                                  else "launch to ready not exposed by this server"))
    lines.append("- humming JIT: " + _jit_line({**{k: met[k] for k in met if k.startswith("humming_jit_")},
                                               **((rep or {}).get("startup") or {})}))
    memory = {**{k: met[k] for k in ("weights_bytes", "kv_cache_bytes") if k in met},
              **((rep or {}).get("memory") or {})}
    cache = met.get("cache_config") or {}
    mem = [f"{k.removesuffix('_bytes')} {v / 2**20:.1f} MiB" if k.endswith("_bytes") and isinstance(v, (int, float))
           else f"{k} {v}" for k, v in memory.items()] + [f"KV {k} {v}" for k, v in cache.items()]
    if met.get("api_server_resident_bytes"):
        mem.append(f"API server RSS {met['api_server_resident_bytes'] / 2**20:.0f} MiB")
    lines.append("- memory: " + ("; ".join(mem) or "not exposed by this server"))
    usage = facts.get("usage") or {}
    kv = usage.get("kv_cache_usage")
    if kv:
        lines.append(f"- KV-cache usage over the run ({kv['n']} samples every {usage['interval_s']:g} s): "
                     f"mean {kv['mean']:.1%}, max {kv['max']:.1%}; most requests running "
                     f"{usage['max_running']:.0f}, waiting {usage['max_waiting']:.0f}")
    else:
        lines.append("- KV-cache usage over the run: not sampled (no `vllm:kv_cache_usage_perc`)")
    return lines


def _jit_line(jit: dict[str, Any]) -> str:
    """The humming JIT facts of the reporting worker (report's startup section, else the gauges)."""
    if "humming_jit_applicable" not in jit:
        return "not exposed by this server"
    if not jit["humming_jit_applicable"]:
        return "not applicable" + (f" ({jit['humming_jit_detail']})" if jit.get("humming_jit_detail") else "")
    if jit.get("humming_jit_compiled_kernels") is None:
        return jit.get("humming_jit_detail") or "not observed"
    return (f"{jit['humming_jit_compiled_kernels']:.0f} kernel(s) compiled in {jit['humming_jit_compile_s']:.1f} s, "
            f"{jit['humming_jit_cache_hits']:.0f} loaded from the cache"
            + (f" (worker rank {jit['rank']})" if "rank" in jit else ""))


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """Latency distributions, and acceptance per position when speculation was observed."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        log_once(logger, 30, "no-matplotlib",
                 "matplotlib is not installed: no PNG plots written (pip install 'vllm-ling[bench]')")
        return []
    rows = [r for r in results["requests"] if r["ok"]]
    series = [
        ("TTFT (s)", [r["ttft_s"] for r in rows]),
        ("TPOT (ms)", [r["tpot_s"] * 1e3 for r in rows if r["tpot_s"] is not None]),
        ("ITL (ms)", [x * 1e3 for r in rows for x in r["itl_s"]]),
        ("E2E latency (s)", [r["e2e_s"] for r in rows]),
    ]
    files = []
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 2)), color="#4c72b0")
        ax.set_title(f"{name}, n={len(values)}")
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    fig.suptitle(results["label"])
    fig.tight_layout()
    path = out / "latency.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    files.append(path.name)
    lengths = results.get("lengths")
    if lengths:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, side in zip(axes, ("input", "output")):
            values = [b["count"] for b in lengths[side]["histogram"]]
            names = [str(b["low"]) if b["low"] == b["high"] else f"{b['low']}-{b['high']}"
                     for b in lengths[side]["histogram"]]
            ax.bar(range(len(values)), values, color="#8172b2")
            ax.set_xticks(range(len(values)), names, rotation=45, ha="right", fontsize=7)
            ax.set_title(f"{side} lengths sent ({lengths[side]['source']})"[:60], fontsize=9)
            ax.set_xlabel("tokens")
            ax.set_ylabel("requests")
        fig.tight_layout()
        path = out / "lengths.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path.name)
    usage = ((results["server"].get("facts") or {}).get("usage") or {}).get("samples") or []
    kv_points = [(u["t_s"], u["kv_cache_usage"]) for u in usage if u["kv_cache_usage"] is not None]
    if kv_points:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([t for t, _ in kv_points], [v * 100 for _, v in kv_points], color="#c44e52")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("KV-cache usage (%)")
        ax.set_ylim(0, 100)
        ax.set_title("KV-cache usage over the run")
        fig.tight_layout()
        path = out / "kv_cache_usage.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path.name)
    spec = results.get("spec_decode")
    if spec and spec["per_position_accept_rate"]:
        rates = spec["per_position_accept_rate"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(range(len(rates)), rates, color="#55a868")
        ax.set_xticks(range(len(rates)))
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / drafts")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"acceptance per position (accept length {spec['accept_length']:.2f})")
        fig.tight_layout()
        path = out / "acceptance.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path.name)
    return files


def write_all(results: dict[str, Any], out_dir: str, plots: bool = True) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ["results.json", "results.md"]
    if plots:
        files += write_plots(results, out)
    results["files"] = files
    (out / "results.md").write_text(markdown(results))
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return files
