"""``vllm-ling bench compare A B``: B minus A with bootstrap CIs, McNemar on any scored run
(GSM8K or a replay with ``expected`` answers), and what differed between the two servers.

A and B are ``results.json`` files or folders holding one. An ablation folder (``ablation.json``)
alone compares each configuration with its first (the baseline); two ablation folders compare
configuration by configuration (the "measure baseline, upgrade, compare" workflow).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ling.bench.json_file import read_json
from vllm_ling.bench.runner import READABLE_SCHEMAS, RESULTS_SCHEMA, SCORED_FIELDS, BenchError
from vllm_ling.bench.server_facts import diff_facts
from vllm_ling.bench.stats import STATISTICS, bootstrap_delta, mcnemar_exact

# (name in the table, per-request value, statistics). Decode tok/s is compared through TPOT.
LATENCY_METRICS = (
    ("TTFT (s)", lambda r: r["ttft_s"], ("mean", "p50", "p95", "p99")),
    ("TPOT (ms)", lambda r: None if r["tpot_s"] is None else r["tpot_s"] * 1e3, ("mean", "p50", "p95", "p99")),
    ("E2E (s)", lambda r: r["e2e_s"], ("mean", "p50", "p95", "p99")),
    ("output tokens", lambda r: r["output_tokens"], ("mean",)),
)


def load_results(path: str) -> dict[str, Any]:
    data = read_json(path, path, BenchError)
    if not isinstance(data, dict) or data.get("schema") not in READABLE_SCHEMAS:
        raise BenchError(f"{path}: not a vllm-ling bench results.json (schema {RESULTS_SCHEMA})")
    return data


def resolve(path: str) -> tuple[str, Any]:
    """("results", results.json path) or ("ablation", [(name, results.json path), ...])."""
    p = Path(path)
    if p.is_dir():
        if (p / "ablation.json").is_file():
            try:
                ablation = json.loads((p / "ablation.json").read_text())
            except json.JSONDecodeError as exc:
                raise BenchError(f"{p / 'ablation.json'}: not JSON ({exc})") from exc
            runs = [(r["name"], str(p / r["name"] / "results.json")) for r in ablation.get("rows", [])]
            if not runs:
                raise BenchError(f"{path}: the ablation holds no finished configuration")
            return "ablation", runs
        if (p / "results.json").is_file():
            return "results", str(p / "results.json")
        raise BenchError(f"{path}: a folder without results.json or ablation.json")
    return "results", path


def pairs(a: str, b: str | None) -> list[tuple[str, str, str]]:
    """(title, A results.json, B results.json) for each comparison the arguments ask for."""
    kind_a, ref_a = resolve(a)
    if b is None:
        if kind_a != "ablation":
            raise BenchError(f"{a}: comparing one argument needs an ablation folder; give A and B otherwise")
        (base_name, base), rest = ref_a[0], ref_a[1:]
        return [(f"{name} vs {base_name}", base, path) for name, path in rest]
    kind_b, ref_b = resolve(b)
    if kind_a == kind_b == "results":
        return [("", ref_a, ref_b)]
    if kind_a == kind_b == "ablation":
        by_name = dict(ref_b)
        common = [(name, path) for name, path in ref_a if name in by_name]
        if not common:
            raise BenchError(f"{a} and {b} share no configuration")
        return [(name, path, by_name[name]) for name, path in common]
    raise BenchError(f"{a} and {b}: compare a results file/folder with another, or an ablation folder with another")


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
    if a.get("accuracy") and b.get("accuracy") and a["config"]["workload"] == b["config"]["workload"]:
        out["scores"] = compare_scores(a, b, kw)
    sa, sb = a.get("spec_decode"), b.get("spec_decode")
    out["accept_length"] = {"a": sa["accept_length"] if sa else None, "b": sb["accept_length"] if sb else None}
    out["facts_differ"] = diff_facts(a["server"].get("facts"), b["server"].get("facts"))
    out["config_differs"] = _config_diff(a["config"], b["config"])
    out["kv_cache_usage"] = {side: _kv_max(r) for side, r in (("a", a), ("b", b))}
    return out


# Config fields that always differ between runs and say nothing about the workload.
_RUN_ONLY = ("out_dir", "label", "progress", "plots", "base_url", "extra", "launch_to_ready_s")


def _config_diff(a: dict, b: dict) -> list[dict[str, Any]]:
    keys = sorted((set(a) | set(b)) - set(_RUN_ONLY))
    return [{"setting": k, "a": a.get(k), "b": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def _kv_max(results: dict) -> float | None:
    usage = ((results["server"].get("facts") or {}).get("usage") or {}).get("kv_cache_usage")
    return usage["max"] if usage else None


def _stat(x: list[float], stat: str) -> float | None:
    return float(STATISTICS[stat](np.asarray(x))) if x else None


def compare_scores(a: dict, b: dict, kw: dict) -> dict[str, Any]:
    """Per scored field: accuracy A and B, paired bootstrap CI of B - A, exact McNemar.

    Requests are paired by ``request_id`` (GSM8K question, replay line id); a request scored
    in only one run is left out. Failed requests count as wrong.
    """
    fields = SCORED_FIELDS[a["config"]["workload"]]
    res: dict[str, Any] = {"workload": a["config"]["workload"], "modes": {}}
    for mode, field in fields.items():
        ra = {r["request_id"]: r[field] for r in a["requests"] if r.get(field) is not None}
        rb = {r["request_id"]: r[field] for r in b["requests"] if r.get(field) is not None}
        common = sorted(set(ra) & set(rb))
        if not common:
            continue
        ca = [bool(ra[q]) for q in common]
        cb = [bool(rb[q]) for q in common]
        ci = bootstrap_delta([float(x) for x in ca], [float(x) for x in cb], "mean", paired=True, **kw)
        res["modes"][mode] = {"scored_a": len(ra), "scored_b": len(rb), "paired": len(common),
                              "a": sum(ca) / len(ca), "b": sum(cb) / len(cb), **ci,
                              "mcnemar": mcnemar_exact(ca, cb)}
    return res


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else f"`{v}`"


def format_markdown(c: dict[str, Any]) -> str:
    lines = [f"## B vs A: B = {c['b']}; A = {c['a']}", "",
             "Deltas are B - A with 95% percentile-bootstrap intervals over requests "
             "(paired by request id when both runs hold the same requests).", "",
             "| metric | stat | A | B | B - A | 95% CI | relative |", "|---|---|---|---|---|---|---|"]
    for m in c["metrics"]:
        rel = "-" if m["relative"] is None else f"{m['relative']:+.1%}"
        ci = "-" if m["low"] is None or m["high"] is None else f"[{m['low']:+.4g}, {m['high']:+.4g}]"
        fa = "-" if m["a"] is None else f"{m['a']:.4g}"
        fb = "-" if m["b"] is None else f"{m['b']:.4g}"
        fd = "-" if m["delta"] is None else f"{m['delta']:+.4g}"
        lines.append(f"| {m['metric']} | {m['statistic']} | {fa} | {fb} | {fd} | {ci} | {rel} |")
    al = c["accept_length"]
    if al["a"] is not None or al["b"] is not None:
        fa = "-" if al["a"] is None else f"{al['a']:.3f}"
        fb = "-" if al["b"] is None else f"{al['b']:.3f}"
        lines += ["", f"Accept length: A {fa}, B {fb}."]
    sc = c.get("scores")
    if sc and sc["modes"]:
        lines += ["", f"Scores ({sc['workload']}) on the requests scored in both runs, paired by request id "
                      "(exact two-sided McNemar test on discordant pairs; failed requests count as wrong):", "",
                  "| score | paired | A | B | B - A | 95% CI | A-only right | B-only right | McNemar p |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for mode, x in sc["modes"].items():
            lines.append(f"| {mode} | {x['paired']} | {x['a']:.2%} | {x['b']:.2%} | {x['delta']:+.2%} | "
                         f"[{x['low']:+.2%}, {x['high']:+.2%}] | {x['mcnemar']['a_only']} | "
                         f"{x['mcnemar']['b_only']} | {x['mcnemar']['p_value']:.4g} |")
    kv = c.get("kv_cache_usage") or {}
    if kv.get("a") is not None or kv.get("b") is not None:
        fa = "-" if kv.get("a") is None else f"{kv['a']:.1%}"
        fb = "-" if kv.get("b") is None else f"{kv['b']:.1%}"
        lines += ["", f"Peak KV-cache usage during the run: A {fa}, B {fb}."]
    differ = c.get("facts_differ", []) + [{"fact": f"bench setting {d['setting']}", "a": d["a"], "b": d["b"]}
                                          for d in c.get("config_differs", [])]
    lines += ["", "What differed besides the numbers (server facts and bench settings):", ""]
    if differ:
        lines += ["| fact | A | B |", "|---|---|---|"]
        lines += [f"| {d['fact']} | {_fmt_value(d['a'])} | {_fmt_value(d['b'])} |" for d in differ]
    else:
        lines.append("nothing recorded differs.")
    for n in c["notes"]:
        lines += ["", f"> note: {n}"]
    return "\n".join(lines) + "\n"
