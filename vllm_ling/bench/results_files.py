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
    lines.append(f"Server `{results['server']['base_url']}`, model `{results['server']['model']}`, "
                 f"workload **{cfg['workload']}**, {s['num_ok']}/{s['num_requests']} requests ok, "
                 f"concurrency {cfg['concurrency']}, started {results['started_at']}.")
    if cfg["workload"] == "synthetic":
        lines.append(f"Synthetic: {cfg['input_len']} random prompt tokens, {cfg['output_len']} output "
                     "tokens, greedy, EOS ignored.")
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
    acc = results.get("accuracy")
    if acc:
        lines += ["", f"GSM8K accuracy over {acc['n']} questions: strict (`#### N`) "
                      f"**{acc['strict']:.2%}**, flexible (last number) **{acc['flexible']:.2%}** "
                      f"({acc['note']})."]
    for w in results.get("warnings", []):
        lines += ["", f"> warning: {w}"]
    return "\n".join(lines) + "\n"


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
