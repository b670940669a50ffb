"""``vllm-ling bench compare A.json B.json``: B minus A with bootstrap CIs and McNemar on GSM8K."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ling.bench.runner import RESULTS_SCHEMA, BenchError
from vllm_ling.bench.stats import STATISTICS, bootstrap_delta, mcnemar_exact

# (name in the table, per-request value, statistics). Decode tok/s is compared through TPOT.
LATENCY_METRICS = (
    ("TTFT (s)", lambda r: r["ttft_s"], ("mean", "p50", "p95", "p99")),
    ("TPOT (ms)", lambda r: None if r["tpot_s"] is None else r["tpot_s"] * 1e3, ("mean", "p50", "p95", "p99")),
    ("E2E (s)", lambda r: r["e2e_s"], ("mean", "p50", "p95", "p99")),
    ("output tokens", lambda r: r["output_tokens"], ("mean",)),
)


def load_results(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"{path}: file not found")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise BenchError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("schema") != RESULTS_SCHEMA:
        raise BenchError(f"{path}: not a vllm-ling bench results.json (schema {RESULTS_SCHEMA})")
    return data


def _values(rows: list[dict], fn) -> dict[str, float]:
    out = {}
    for r in rows:
        if r["ok"]:
            v = fn(r)
            if v is not None:
                out[r["request_id"]] = float(v)
    return out


def compare(a: dict[str, Any], b: dict[str, Any], *, seed: int | None = None) -> dict[str, Any]:
    kw = {} if seed is None else {"seed": seed}
    out: dict[str, Any] = {"a": a["label"], "b": b["label"], "metrics": [], "notes": []}
    if a["config"]["workload"] != b["config"]["workload"]:
        out["notes"].append(f"different workloads: {a['config']['workload']} vs {b['config']['workload']}")
    for name, fn, stats in LATENCY_METRICS:
        va, vb = _values(a["requests"], fn), _values(b["requests"], fn)
        common = sorted(set(va) & set(vb))
        paired = bool(common) and len(common) == len(va) == len(vb)
        xa = [va[k] for k in common] if paired else list(va.values())
        xb = [vb[k] for k in common] if paired else list(vb.values())
        for stat in stats:
            ci = bootstrap_delta(xa, xb, stat, paired=paired, **kw)
            out["metrics"].append({"metric": name, "statistic": stat, "paired": paired,
                                   "a": _stat(xa, stat), "b": _stat(xb, stat), **ci})
    # Decode tok/s = 1000 / mean TPOT; its CI maps the TPOT-mean delta CI through that monotone
    # function, holding A's mean fixed.
    tp = next(m for m in out["metrics"] if m["metric"] == "TPOT (ms)" and m["statistic"] == "mean")
    if tp["a"] and tp["b"] and tp["low"] is not None:
        ra, rb = 1e3 / tp["a"], 1e3 / tp["b"]
        out["metrics"].append({"metric": "decode tok/s", "statistic": "1000/mean TPOT",
                               "paired": tp["paired"], "a": ra, "b": rb, "delta": rb - ra,
                               "low": 1e3 / (tp["a"] + tp["high"]) - ra if tp["a"] + tp["high"] > 0 else None,
                               "high": 1e3 / (tp["a"] + tp["low"]) - ra if tp["a"] + tp["low"] > 0 else None,
                               "relative": rb / ra - 1})
    if a.get("accuracy") and b.get("accuracy"):
        out["gsm8k"] = _compare_accuracy(a, b, kw)
    sa, sb = a.get("spec_decode"), b.get("spec_decode")
    out["accept_length"] = {"a": sa["accept_length"] if sa else None, "b": sb["accept_length"] if sb else None}
    return out


def _stat(x: list[float], stat: str) -> float | None:
    return float(STATISTICS[stat](np.asarray(x))) if x else None


def _compare_accuracy(a: dict, b: dict, kw: dict) -> dict[str, Any]:
    ra = {r["question_id"]: r for r in a["requests"] if r.get("question_id") is not None}
    rb = {r["question_id"]: r for r in b["requests"] if r.get("question_id") is not None}
    common = sorted(set(ra) & set(rb), key=lambda q: (len(q), q))
    res: dict[str, Any] = {"questions_a": len(ra), "questions_b": len(rb), "paired_questions": len(common)}
    for mode in ("strict", "flexible"):
        ca = [bool(ra[q][f"correct_{mode}"]) for q in common]
        cb = [bool(rb[q][f"correct_{mode}"]) for q in common]
        ci = bootstrap_delta([float(x) for x in ca], [float(x) for x in cb], "mean", paired=True, **kw)
        res[mode] = {"a": sum(ca) / len(ca) if ca else None, "b": sum(cb) / len(cb) if cb else None,
                     **ci, "mcnemar": mcnemar_exact(ca, cb)}
    return res


def format_markdown(c: dict[str, Any]) -> str:
    lines = [f"## B vs A: B = {c['b']}; A = {c['a']}", "",
             "Deltas are B - A with 95% percentile-bootstrap intervals over requests "
             "(paired by request id when both runs hold the same requests).", "",
             "| metric | stat | A | B | B - A | 95% CI | relative |", "|---|---|---|---|---|---|---|"]
    for m in c["metrics"]:
        rel = "-" if m["relative"] is None else f"{m['relative']:+.1%}"
        ci = "-" if m["low"] is None else f"[{m['low']:+.4g}, {m['high']:+.4g}]"
        fa = "-" if m["a"] is None else f"{m['a']:.4g}"
        fb = "-" if m["b"] is None else f"{m['b']:.4g}"
        fd = "-" if m["delta"] is None else f"{m['delta']:+.4g}"
        lines.append(f"| {m['metric']} | {m['statistic']} | {fa} | {fb} | {fd} | {ci} | {rel} |")
    al = c["accept_length"]
    if al["a"] is not None or al["b"] is not None:
        fa = "-" if al["a"] is None else f"{al['a']:.3f}"
        fb = "-" if al["b"] is None else f"{al['b']:.3f}"
        lines += ["", f"Accept length: A {fa}, B {fb}."]
    g = c.get("gsm8k")
    if g:
        lines += ["", f"GSM8K on {g['paired_questions']} questions present in both runs "
                      "(exact two-sided McNemar test on discordant pairs):", "",
                  "| extraction | A | B | B - A | 95% CI | A-only right | B-only right | McNemar p |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode in ("strict", "flexible"):
            x = g[mode]
            if x["a"] is None:
                continue
            lines.append(f"| {mode} | {x['a']:.2%} | {x['b']:.2%} | {x['delta']:+.2%} | "
                         f"[{x['low']:+.2%}, {x['high']:+.2%}] | {x['mcnemar']['a_only']} | "
                         f"{x['mcnemar']['b_only']} | {x['mcnemar']['p_value']:.4g} |")
    for n in c["notes"]:
        lines += ["", f"> note: {n}"]
    return "\n".join(lines) + "\n"
