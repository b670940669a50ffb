"""The startup INFO table: one row per check, the known-answer kernel checks, the notes, and one
line per rank."""

from __future__ import annotations

from typing import Any


def known_answer_lines(section: dict[str, Any]) -> list[str]:
    """Rows for the known-answer kernel checks (the report's ``kernel_checks``)."""
    lines = [f"known-answer kernel checks ({section['seconds']:.2f} s):"]
    for r in section["results"]:
        if r["skipped"]:
            verdict = f"not checked: {r['skipped']}"
        else:
            err = "inf" if r["max_error"] is None else f"{r['max_error']:.3g}"
            verdict = (f"{'ok' if r['passed'] else 'FAILED'}, max rel. error {err} "
                       f"(tol {r['tolerance']:.3g}), {r['cases']} cases, {r['seconds']:.2f} s")
            if not r["passed"]:
                verdict += "; failing: " + "; ".join(r["failing_inputs"])
        lines.append(f"  {r['name']} [{r['kernel']}]: {verdict}")
    dense = section["dense_fp8"]
    if dense["kernels"]:
        lines.append("  dense block-FP8 linears: " + ", ".join(f"{n} x {k}" for k, n in sorted(dense["kernels"].items()))
                     + (f" ({dense['path_choice']['reason']})" if dense["path_choice"] else ""))
    return lines


def format_table(report: dict[str, Any]) -> str:
    rows = [("check", "ok", "expected", "actual")]
    rows += [(c["name"], "yes" if c["passed"] else "NO", c["expected"], c["actual"]) for c in report["checks"]]
    widths = [min(max(len(r[i]) for r in rows), 60) for i in range(3)]
    lines = [f"vllm-ling startup verification ({report['platform']}, policy {report['policy']}"
             f"{', runner ' + report['model_runner'] if report.get('model_runner') else ''}): "
             f"{'PASSED' if report['passed'] else 'FAILED'}"]
    for r in rows:
        lines.append("  " + "  ".join(r[i][:60].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    if report.get("kernel_checks"):
        lines += ["  " + line for line in known_answer_lines(report["kernel_checks"])]
    for note in report.get("notes", []):
        lines.append("  note: " + note)
    return "\n".join(lines)


def format_ranks(ranks: list[dict[str, Any]]) -> str:
    lines = []
    for r in ranks:
        failed = [c["name"] for c in r["checks"] if not c["passed"]]
        lines.append(f"  rank {r['rank']} (tp {r['tp_rank']}, pp {r['pp_rank']}) on {r['node_ip']} "
                     f"pid {r['pid']}: {'PASSED' if r['passed'] else 'FAILED ' + ', '.join(failed)}; "
                     f"head {r['head_dtype']}")
    return "\n".join(lines)
