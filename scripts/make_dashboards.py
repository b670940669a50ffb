#!/usr/bin/env python3
"""Generate the Grafana dashboards, helm/vllm-ling/files/dashboards/*.json (the JSON files are
outputs; edit this script). The chart ships them and docker/compose.yaml mounts the same folder:
one copy.

    python scripts/make_dashboards.py          # rewrite the JSON files
    python scripts/make_dashboards.py --check  # exit 1 when they are out of date

Every metric a panel queries must be one the server exports (vLLM's ``vllm:*`` and our
``vllm_ling:*``); tests/deploy/test_dashboards.py and tests/runtime/test_prometheus_e2e.py
check that against vLLM's source and a running server.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # vllm_ling.options is standard-library only: no install needed
from vllm_ling.options import STUDY_VERIFY_COST_BATCH1  # noqa: E402

OUT_DIR = REPO / "helm" / "vllm-ling" / "files" / "dashboards"
SEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The study's break-even accept length at batch 1 (VLLM_LING_ACCEPT_BREAK_EVEN's default);
# the accept-length panel also plots the server's configured value.
BREAK_EVEN = STUDY_VERIFY_COST_BATCH1


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False,
           table: bool = False) -> dict:
    t = {"refId": ref, "datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        t["instant"] = True
        t["range"] = False
    if table:
        t["format"] = "table"
    return t


def thresholds(*steps: tuple[float | None, str]) -> dict:
    return {"mode": "absolute", "steps": [{"value": v, "color": c} for v, c in steps]}


def value_map(mapping: dict[str, tuple[str, str]]) -> list[dict]:
    return [{"type": "value", "options": {
        k: {"text": text, "color": color, "index": i} for i, (k, (text, color)) in enumerate(mapping.items())}}]


class Layout:
    """Places panels left to right in 24-column rows and numbers them."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.row_h = 0

    def _id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self.newline()
        self.panels.append({"id": self._id(), "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x = self.row_h = 0

    def add(self, panel: dict, w: int, h: int) -> None:
        if self.x + w > 24:
            self.newline()
        panel = {"id": self._id(), **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        panel.setdefault("datasource", DATASOURCE)
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def stat(title: str, description: str, targets: list[dict], *, unit: str = "none",
         steps=None, mappings=None, decimals: int | None = None) -> dict:
    defaults = {"unit": unit, "thresholds": steps or thresholds((None, "green")),
                "mappings": mappings or [], "color": {"mode": "thresholds"}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": description, "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "none", "textMode": "value_and_name",
                        "orientation": "auto", "justifyMode": "auto"}}


def timeseries(title: str, description: str, targets: list[dict], *, unit: str = "none",
               min_value: float | None = None, max_value: float | None = None,
               overrides: list[dict] | None = None) -> dict:
    defaults: dict = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                                               "spanNulls": True}}
    if min_value is not None:
        defaults["min"] = min_value
    if max_value is not None:
        defaults["max"] = max_value
    return {"type": "timeseries", "title": title, "description": description, "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}}}


def latency_quantiles(metric: str) -> list[dict]:
    """p50/p95/p99 and the mean of a vLLM latency histogram over the rate interval."""
    targets = [
        target(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
               f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.95, "B"), (0.99, "C"))
    ]
    targets.append(target(f"sum(rate({metric}_sum{{{SEL}}}[{RATE}])) / "
                          f"sum(rate({metric}_count{{{SEL}}}[{RATE}]))", "mean", "D"))
    return targets


def overview() -> dict:
    lay = Layout()

    lay.row("Startup verification and health")
    lay.add(stat("Verification", "vllm_ling:verification_passed: every startup check passed "
                 "(GET /vllm_ling/report has the details).",
                 [target(f"vllm_ling:verification_passed{{{SEL}}}", "{{model_name}}")],
                 steps=thresholds((None, "red"), (1, "green")),
                 mappings=value_map({"0": ("FAILED", "red"), "1": ("PASSED", "green")})), 4, 5)
    # One state per optimization: 2 * active + requested.
    lay.add(stat("Optimizations", "vllm_ling:optimization_active and vllm_ling:optimization_requested "
                 "per optimization, as the startup verification proved them.",
                 [target(f"2 * vllm_ling:optimization_active{{{SEL}}} + vllm_ling:optimization_requested{{{SEL}}}",
                         "{{optimization}}")],
                 steps=thresholds((None, "text")),
                 mappings=value_map({"0": ("off", "text"), "1": ("INACTIVE (requested)", "red"),
                                     "2": ("active (not requested)", "yellow"),
                                     "3": ("active", "green")})), 8, 5)
    lay.add(stat("Accept length (windowed)", "vllm_ling:accept_length: 1 + accepted/drafts over "
                 "the last VLLM_LING_ACCEPT_WINDOW drafts; red below the break-even.",
                 [target(f"vllm_ling:accept_length{{{SEL}}}", "engine {{engine}}")],
                 steps=thresholds((None, "red"), (BREAK_EVEN, "green")), decimals=2), 4, 5)
    lay.add(stat("Accept collapses (range)", "Collapse episodes (windowed accept length below "
                 "break-even) in the dashboard's time range.",
                 [target(f"sum(increase(vllm_ling:accept_collapse_total{{{SEL}}}[$__range]))",
                         "episodes")],
                 steps=thresholds((None, "green"), (1, "red")), decimals=0), 4, 5)
    lay.add(stat("Engine up", "Prometheus can scrape the server's /metrics (up{job=\"vllm-ling\"}).",
                 [target('up{job="vllm-ling"}', "{{instance}}")],
                 steps=thresholds((None, "red"), (1, "green")),
                 mappings=value_map({"0": ("DOWN", "red"), "1": ("UP", "green")})), 4, 5)
    lay.add({"type": "table", "title": "Build and configuration",
             "description": "vllm_ling:info labels, from the startup verification report.",
             "targets": [target(f"vllm_ling:info{{{SEL}}}", instant=True, table=True)],
             "transformations": [{"id": "organize", "options": {
                 "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True}}}],
             "fieldConfig": {"defaults": {}, "overrides": []},
             "options": {"showHeader": True}}, 14, 4)
    lay.add({"type": "table", "title": "Attention backends",
             "description": "vllm_ling:attention_backend_layers: the backend vLLM chose for each attention layer "
                            "class of the target and draft (MLA decode: FLASH_ATTN_MLA on sm_90 unless "
                            "--attention-backend says otherwise; prefill: the MLA prefill backend), and how many "
                            "layers hold it, read from the loaded layers.",
             "targets": [target(f"vllm_ling:attention_backend_layers{{{SEL}}}", instant=True, table=True)],
             "transformations": [{"id": "organize", "options": {
                 "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True,
                                   "model_name": True},
                 "renameByName": {"Value": "layers"}}}],
             "fieldConfig": {"defaults": {}, "overrides": []},
             "options": {"showHeader": True}}, 10, 4)

    lay.row("Startup and memory")
    lay.add(stat("Launch to ready", "vllm_ling:startup_seconds: this API server's start to the "
                 "engine being ready (weights, warm-up, checks).",
                 [target(f"vllm_ling:startup_seconds{{{SEL}}}", "{{model_name}}")], unit="s", decimals=0), 4, 5)
    lay.add(stat("Weights / KV cache", "vllm_ling:weights_bytes and vllm_ling:kv_cache_bytes: device "
                 "memory the reporting worker holds for weights and allocated for the KV cache (each "
                 "storage once).",
                 [target(f"vllm_ling:weights_bytes{{{SEL}}}", "weights", "A"),
                  target(f"vllm_ling:kv_cache_bytes{{{SEL}}}", "KV cache", "B")], unit="bytes"), 8, 5)
    lay.add(stat("humming JIT up to ready", "vllm_ling:humming_jit_compiled_kernels (compiled by this "
                 "worker), vllm_ling:humming_jit_cache_hits (loaded from the cache) and "
                 "vllm_ling:humming_jit_compile_seconds; after `vllm-ling warmup` a warm cache has 0 compiled. "
                 "CPU: not applicable (vllm_ling:humming_jit_applicable 0).",
                 [target(f"vllm_ling:humming_jit_compiled_kernels{{{SEL}}}", "compiled", "A"),
                  target(f"vllm_ling:humming_jit_cache_hits{{{SEL}}}", "cache hits", "B"),
                  target(f"vllm_ling:humming_jit_compile_seconds{{{SEL}}}", "compile s", "C"),
                  target(f"vllm_ling:humming_jit_applicable{{{SEL}}}", "applicable", "D")], decimals=0), 12, 5)

    lay.row("Latency")
    lay.add(timeseries("Time to first token (TTFT)", "vllm:time_to_first_token_seconds",
                       latency_quantiles("vllm:time_to_first_token_seconds"), unit="s", min_value=0), 12, 8)
    lay.add(timeseries("Time per output token (TPOT)", "vllm:request_time_per_output_token_seconds: "
                       "decode time / generated tokens, per request",
                       latency_quantiles("vllm:request_time_per_output_token_seconds"), unit="s",
                       min_value=0), 12, 8)
    lay.add(timeseries("Inter-token latency (ITL)", "vllm:inter_token_latency_seconds: time between "
                       "streamed outputs (with MTP one output can carry several tokens)",
                       latency_quantiles("vllm:inter_token_latency_seconds"), unit="s", min_value=0), 12, 8)
    lay.add(timeseries("End-to-end request latency", "vllm:e2e_request_latency_seconds",
                       latency_quantiles("vllm:e2e_request_latency_seconds"), unit="s", min_value=0), 12, 8)

    lay.row("Throughput and load")
    lay.add(timeseries("Token throughput", "Generated and prompt tokens per second",
                       [target(f"sum(rate(vllm:generation_tokens_total{{{SEL}}}[{RATE}]))", "generated", "A"),
                        target(f"sum(rate(vllm:prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt", "B")],
                       unit="tokens/s", min_value=0), 12, 8)
    lay.add(timeseries("Requests", "Finished requests per second by reason; running and waiting",
                       [target(f"sum by (finished_reason) (rate(vllm:request_success_total{{{SEL}}}[{RATE}]))",
                               "finished {{finished_reason}} /s", "A"),
                        target(f"sum(vllm:num_requests_running{{{SEL}}})", "running", "B"),
                        target(f"sum(vllm:num_requests_waiting{{{SEL}}})", "waiting", "C")],
                       min_value=0), 12, 8)

    lay.row("Speculative decoding (MTP)")
    lay.add(timeseries("Accept length", "Windowed (vllm_ling:accept_length, per engine), the same "
                       "from vLLM's counters over the rate interval, and the guard's break-even.",
                       [target(f"vllm_ling:accept_length{{{SEL}}}", "windowed, engine {{engine}}", "A"),
                        target(f"1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}])) / "
                               f"sum(rate(vllm:spec_decode_num_drafts_total{{{SEL}}}[{RATE}]))",
                               "vLLM counters, rate interval", "B"),
                        target(f"max(vllm_ling:accept_break_even{{{SEL}}})", "break-even", "C")],
                       min_value=1,
                       overrides=[{"matcher": {"id": "byName", "options": "break-even"},
                                   "properties": [{"id": "custom.lineStyle",
                                                   "value": {"fill": "dash", "dash": [10, 10]}},
                                                  {"id": "color", "value": {"mode": "fixed",
                                                                            "fixedColor": "red"}}]}]),
            12, 8)
    lay.add(timeseries("Acceptance per draft position", "vllm_ling:accept_rate_per_position: fraction "
                       "of the window's drafts whose token at each position was accepted (they sum "
                       "to accept length - 1).",
                       [target(f"vllm_ling:accept_rate_per_position{{{SEL}}}",
                               "position {{position}}, engine {{engine}}")],
                       unit="percentunit", min_value=0, max_value=1), 12, 8)
    lay.add(timeseries("Draft and accepted tokens", "vLLM's spec-decode counters as rates",
                       [target(f"sum(rate(vllm:spec_decode_num_draft_tokens_total{{{SEL}}}[{RATE}]))",
                               "drafted", "A"),
                        target(f"sum(rate(vllm:spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}]))",
                               "accepted", "B")],
                       unit="tokens/s", min_value=0), 12, 8)
    lay.add(timeseries("Collapse episodes", "vllm_ling:accept_collapse_active (1 while the windowed "
                       "accept length is below break-even) and vllm_ling:accept_window_drafts.",
                       [target(f"vllm_ling:accept_collapse_active{{{SEL}}}", "collapsed, engine {{engine}}", "A"),
                        target(f"vllm_ling:accept_window_drafts{{{SEL}}}", "window drafts, engine {{engine}}", "B")],
                       min_value=0,
                       overrides=[{"matcher": {"id": "byFrameRefID", "options": "B"},
                                   "properties": [{"id": "custom.axisPlacement", "value": "right"}]}]),
            12, 8)

    lay.row("KV cache")
    lay.add(timeseries("KV cache usage", "vllm:kv_cache_usage_perc (1 = full)",
                       [target(f"vllm:kv_cache_usage_perc{{{SEL}}}", "engine {{engine}}")],
                       unit="percentunit", min_value=0, max_value=1), 8, 8)
    lay.add(timeseries("Prefix cache hit rate", "vllm:prefix_cache_hits / vllm:prefix_cache_queries",
                       [target(f"sum(rate(vllm:prefix_cache_hits_total{{{SEL}}}[{RATE}])) / "
                               f"sum(rate(vllm:prefix_cache_queries_total{{{SEL}}}[{RATE}]))", "hit rate")],
                       unit="percentunit", min_value=0, max_value=1), 8, 8)
    lay.add(timeseries("Preemptions", "vllm:num_preemptions per second (KV cache pressure)",
                       [target(f"sum(rate(vllm:num_preemptions_total{{{SEL}}}[{RATE}]))", "preemptions/s")],
                       min_value=0), 8, 8)

    return {
        "title": "vllm-ling overview",
        "uid": "vllm-ling-overview",
        "description": "Ling-3.0 on vLLM with vllm-ling: startup verification, latency, throughput, "
                       "MTP acceptance and KV cache. Generated by scripts/make_dashboards.py.",
        "tags": ["vllm", "vllm-ling"],
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "model_name", "label": "Model", "type": "query", "datasource": DATASOURCE,
             "query": {"query": "label_values(vllm:num_requests_running, model_name)", "refId": "model_name"},
             "definition": "label_values(vllm:num_requests_running, model_name)",
             "includeAll": True, "allValue": ".*", "multi": True, "current": {}, "hide": 0,
             "refresh": 2, "sort": 1},
        ]},
        "panels": lay.panels,
    }


DASHBOARDS = {"vllm-ling-overview.json": overview}


def render(make) -> str:
    return json.dumps(make(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report out-of-date files")
    args = parser.parse_args(argv)
    stale = []
    for name, make in DASHBOARDS.items():
        path, text = OUT_DIR / name, render(make)
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    for name in stale:
        print(f"out of date: {OUT_DIR / name}; run python scripts/make_dashboards.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
