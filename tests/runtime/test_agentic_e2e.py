"""A real tool call through the real server: the scripted tiny checkpoint (hybrid KDA + MLA,
NEXTN MTP x3 whose draft predicts every token) answers an OpenAI ``tools`` request; vLLM's
``ling3`` parsers turn its output into ``message.tool_calls`` and ``reasoning``, streamed and
not, while speculation runs. One server start for the whole module."""

from __future__ import annotations

import json

import pytest
import requests

from vllm_ling.cli.agent_defaults import LING_PARSER_ARGS
from vllm_ling.runtime.local_server import scrape, serve_cpu

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

PARSER_ARGS = list(LING_PARSER_ARGS)  # what `vllm-ling serve` adds
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "How is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_SCRIPT
    from vllm_ling.models.tiny_checkpoint import make_tiny

    tmp = tmp_path_factory.mktemp("agentic")
    ckpt = make_tiny(tmp / "tiny_scripted", seed=0, script=EXAMPLE_SCRIPT)
    report = tmp / "report.json"
    server = serve_cpu(ckpt, tmp / "server.log", extra_args=PARSER_ARGS,
                       env={"VLLM_LING_REPORT_PATH": str(report), "VLLM_PLUGINS": "vllm_ling,vllm_ling_report"})
    yield server, report
    server.stop()


def _chat(base: str, stream: bool, **extra):
    return requests.post(base + "/v1/chat/completions", timeout=600, stream=stream, json={
        "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
        "temperature": 0, "max_tokens": 100, "stream": stream, **extra})


def _accept_counters(base: str) -> tuple[float, float]:
    m = scrape(base)
    drafts = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    return drafts, accepted


def test_tool_call_and_reasoning_parsed_non_streamed(scripted_server):
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_REASONING, EXAMPLE_TOOL_CALL

    server, _ = scripted_server
    d0, a0 = _accept_counters(server.base_url)
    r = _chat(server.base_url, stream=False)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    message = choice["message"]
    call = message["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == EXAMPLE_TOOL_CALL
    assert message["reasoning"].strip() == EXAMPLE_REASONING  # vLLM 0.32 names it `reasoning`
    assert not (message["content"] or "").strip()
    assert choice["finish_reason"] == "tool_calls"
    d1, a1 = _accept_counters(server.base_url)
    assert d1 > d0, "no speculative drafts: MTP is not on"
    # The draft predicts every scripted token; only the last step (the end of turn) wastes drafts.
    assert 1 + (a1 - a0) / (d1 - d0) > 3.0


def test_tool_call_and_reasoning_parsed_streamed(scripted_server):
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_REASONING, EXAMPLE_TOOL_CALL

    server, _ = scripted_server
    reasoning, content, name, arguments, finish = "", "", "", "", None
    with _chat(server.base_url, stream=True) as r:
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


def test_thinking_switched_off_per_request(scripted_server):
    """enable_thinking=false: the generation prompt closes the reasoning block, the scripted
    model continues after </think>, so the same tool call comes back with no reasoning."""
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_TOOL_CALL

    server, _ = scripted_server
    r = _chat(server.base_url, stream=False, chat_template_kwargs={"enable_thinking": False})
    r.raise_for_status()
    message = r.json()["choices"][0]["message"]
    call = message["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == EXAMPLE_TOOL_CALL
    assert message.get("reasoning") is None


def test_roundtrip_check_reported_and_exported(scripted_server):
    server, report_path = scripted_server
    report = json.loads(report_path.read_text())
    assert report["chat_roundtrip"]["status"] == "passed", report["chat_roundtrip"]
    row = next(c for c in report["checks"] if c["name"] == "chat_roundtrip")
    assert row["passed"] and report["passed"]
    assert "chat round-trip check passed" in server.log()
    metrics = scrape(server.base_url)
    assert metrics.get('vllm_ling:chat_roundtrip{model_name="tiny",status="passed"}') == 1.0


def test_replay_scores_a_real_tool_call(scripted_server, tmp_path):
    """`vllm-ling bench --workload replay` against the real server: a tool-using request whose
    `expected` is the scripted tool call is parsed, counted and matched; a plain request is sent
    and not scored (issue 19's replay on the real tiny server, with a real tool call)."""
    from vllm_ling.bench import run_benchmark
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_TOOL_CALL

    server, report = scripted_server
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
    r = run_benchmark(base_url=server.base_url, workload="replay", requests_file=str(path),
                      out_dir=str(tmp_path / "out"), progress=False, plots=False, model="tiny",
                      server_report=str(report))
    by_id = {x["request_id"]: x for x in r["requests"]}
    assert all(x["ok"] for x in by_id.values())
    assert by_id["tool"]["correct"] is True and by_id["wrong-expectation"]["correct"] is False
    acc = r["accuracy"]
    assert acc["tool_requests"] == 2 and acc["tool_call_fraction"] == 1.0
    assert acc["tool_match_fraction"] == pytest.approx(0.5)
    assert r["server"]["facts"]["report"]["passed"] is True
