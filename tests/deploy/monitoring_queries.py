"""The PromQL the committed dashboards and alert rules run, and the metric names in it.

Shared by tests/deploy/test_dashboards.py (static checks) and
tests/runtime/test_prometheus_e2e.py (checks against a running server), which loads it by path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING_DIR = REPO / "helm" / "vllm-ling" / "files"  # the only copy (chart + compose)
DASHBOARD_DIR = MONITORING_DIR / "dashboards"
ALERTS_FILE = MONITORING_DIR / "prometheus" / "alerts.yml"
SCRAPE_CONFIG = MONITORING_DIR / "prometheus" / "prometheus.yml"

# vLLM's and our metric names: prefix, colon, then the rest of a Prometheus name.
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])(vllm(?:_ling)?:[A-Za-z_][A-Za-z0-9_:]*)")
# Prometheus's own series the rules use (not exported by the server).
PROMETHEUS_SERIES = {"up", "ALERTS"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def walk_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query variable."""
    out = []
    for panel in walk_panels(dashboard.get("panels", [])):
        for t in panel.get("targets", []):
            out.append((f"panel {panel.get('title')!r} {t.get('refId')}", t["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            out.append((f"variable {var['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS_FILE.read_text())["groups"] for r in g["rules"]]


def alert_queries() -> list[tuple[str, str]]:
    return [(f"alert {r.get('alert') or r.get('record')}", r["expr"]) for r in alert_rules()]


def all_queries() -> list[tuple[str, str]]:
    out = [(f"{name}: {where}", expr) for name, d in dashboards().items()
           for where, expr in dashboard_queries(d)]
    return out + [(f"alerts.yml: {where}", expr) for where, expr in alert_queries()]


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def queried_metrics() -> dict[str, list[str]]:
    """Metric name -> where it is queried, over every dashboard and alert rule."""
    names: dict[str, list[str]] = {}
    for where, expr in all_queries():
        for name in metric_names(expr):
            names.setdefault(name, []).append(where)
    return names


def family_name(sample_name: str) -> str:
    """The defining name of a sample: histogram and counter suffixes removed."""
    for suffix in _HISTOGRAM_SUFFIXES + ("_total",):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def grafana_to_promql(expr: str, rate_interval: str = "1m", range_: str = "5m") -> str:
    """A dashboard expression with Grafana's variables replaced, runnable by Prometheus."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
            .replace("$model_name", ".*"))
