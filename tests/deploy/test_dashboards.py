"""Static checks of the Grafana dashboards, the scrape config and the alert rules.

That every queried metric is exported by a *running* server is checked in
tests/runtime/test_prometheus_e2e.py (it shares that module's one tiny server).
Here: the JSON is the generator's output, well formed, covers the overview's topics,
and every metric it or an alert queries is defined by vLLM's source or by our logger.
promtool (Debian package ``prometheus``) is required: without it these tests fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from .monitoring_queries import (
    ALERTS_FILE,
    PROMETHEUS_SERIES,
    REPO,
    SCRAPE_CONFIG,
    alert_rules,
    all_queries,
    dashboard_queries,
    dashboards,
    family_name,
    grafana_to_promql,
    queried_metrics,
    walk_panels,
)

PROMTOOL_HINT = "apt-get update && apt-get install -y --no-install-recommends prometheus"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, f"promtool not found: install Debian's prometheus package ({PROMTOOL_HINT})"
    return path


def test_dashboards_are_the_generators_output():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "make_dashboards.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_dashboard_is_well_formed(name):
    dashboard = dashboards()[name]
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(walk_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    occupied: set[tuple[int, int]] = set()
    for panel in panels:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}"
        for t in panel["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"


def test_overview_covers_the_required_topics():
    exprs = " ".join(expr for _, expr in dashboard_queries(dashboards()["vllm-ling-overview.json"]))
    for metric in ("vllm:time_to_first_token_seconds_bucket",  # TTFT
                   "vllm:request_time_per_output_token_seconds_bucket",  # TPOT
                   "vllm:inter_token_latency_seconds_bucket",  # ITL
                   "vllm:generation_tokens_total",  # throughput
                   "vllm_ling:accept_length", "vllm_ling:accept_rate_per_position",
                   "vllm_ling:optimization_active", "vllm_ling:verification_passed",
                   "vllm_ling:info", "vllm:kv_cache_usage_perc"):
        assert metric in exprs, metric


def test_every_vllm_metric_queried_is_defined_in_vllms_source():
    import vllm

    source = "\n".join(p.read_text(errors="ignore") for p in Path(vllm.__file__).parent.rglob("*.py"))
    missing = {name: where for name, where in queried_metrics().items()
               if name.startswith("vllm:") and f'"{family_name(name)}"' not in source}
    assert not missing, f"queried but not defined by vLLM {vllm.__version__}: {missing}"


def test_every_vllm_ling_metric_queried_is_registered_by_our_logger(monkeypatch, tmp_path):
    from prometheus_client import REGISTRY

    from vllm_ling.runtime import stat_logger as metrics

    monkeypatch.setenv(metrics.ENV_REPORT_PATH, str(tmp_path / "none.json"))
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3, method="mtp"),
                             model_config=SimpleNamespace(served_model_name="m"))
    metrics.LingStatLogger(config, [0])
    try:
        exported = set()
        for collector in list(REGISTRY._collector_to_names):
            name = getattr(collector, "_name", "")
            if name.startswith(metrics.METRIC_PREFIX):
                exported.add(name + "_total" if collector._type == "counter" else name)
    finally:
        metrics.unregister_vllm_ling_metrics()
    missing = {n: w for n, w in queried_metrics().items() if n.startswith("vllm_ling:") and n not in exported}
    assert not missing, f"queried but not exported by LingStatLogger: {missing}"


def test_only_known_series_are_queried():
    for where, expr in all_queries():
        bare = set(re.findall(r"(?<![A-Za-z0-9_:\"'$])([A-Za-z_][A-Za-z0-9_]*)\s*\{", expr))
        assert bare <= PROMETHEUS_SERIES, f"{where}: unexpected series {bare - PROMETHEUS_SERIES} in {expr}"


def test_alert_rules_pass_promtool_and_cover_the_conditions():
    proc = subprocess.run([promtool(), "check", "rules", str(ALERTS_FILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_name = {r["alert"]: r for r in alert_rules()}
    assert {"VllmLingOptimizationInactive", "VllmLingVerificationFailed", "VllmLingAcceptCollapse",
            "VllmLingEngineDown"} <= set(by_name)
    for rule in by_name.values():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_scrape_config_passes_promtool_as_committed(tmp_path):
    """`promtool check config` on the committed file, from the repository: the rule file is
    named relative to the config, so it resolves here and under /etc/prometheus alike."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    [job] = config["scrape_configs"]
    assert job["job_name"] == "vllm-ling" and job["static_configs"][0]["targets"] == ["vllm-ling:8000"]
    assert config["rule_files"] == [ALERTS_FILE.name]
    proc = subprocess.run([promtool(), "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True,
                          cwd=tmp_path)  # not the config's directory: resolution is relative to the file
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout + proc.stderr


def test_every_dashboard_query_parses(tmp_path):
    """promtool parses each panel's PromQL (as a recording rule) with Grafana's variables filled in."""
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(all_queries()) if not expr.startswith("label_values(")]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
