"""The bench harness end to end against the stand-in OpenAI-compatible server (a subprocess).

The stand-in's behaviour that these tests check against is fixed and independent of the
harness: it answers a GSM8K question correctly unless crc32("<salt>:<question>") % 4 == 0,
streams several tokens per chunk when MTP is on, and advances vLLM's spec-decode counters.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
import zlib
from importlib import resources

import pytest

from vllm_ling.bench import main as bench_main
from vllm_ling.bench import run_benchmark
from vllm_ling.bench.ablation import free_port
from vllm_ling.bench.client import ServerError
from vllm_ling.bench.gsm8k import load_questions
from vllm_ling.bench.runner import BenchError
from vllm_ling.bench.standin import running_standin

DATASET = str(resources.files("vllm_ling") / "data" / "gsm8k_test.jsonl")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def scrape_counters(base_url: str) -> tuple[float, float, dict[str, float]]:
    """The test's own reading of /metrics (a regex, not the harness's parser)."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=5).read().decode()
    drafts = float(re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    acc = float(re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    per_pos = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"\} (\S+)$', text, re.M)}
    return drafts, acc, per_pos


def standin_correct(question: str, salt: str) -> bool:
    return zlib.crc32(f"{salt}:{question}".encode()) % 4 != 0


@pytest.fixture(scope="module")
def mtp_server():
    with running_standin("--gsm8k-dataset", DATASET, "--initial-drafts", "1000",
                         env={"VLLM_LING_MTP": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def plain_server():
    with running_standin("--gsm8k-dataset", DATASET, "--salt", "other", "--api-key", "sekret",
                         env={"VLLM_LING_MTP": "0"}) as url:
        yield url


def test_gsm8k_end_to_end_every_output_file(mtp_server, tmp_path):
    n = 16
    before = scrape_counters(mtp_server)
    results = run_benchmark(base_url=mtp_server, workload="gsm8k", num_requests=n, concurrency=4,
                            max_tokens=64, out_dir=str(tmp_path), progress=False)
    after = scrape_counters(mtp_server)

    for name in ("results.json", "results.md", "latency.png", "acceptance.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "latency.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "acceptance.png").read_bytes()[:8] == PNG_MAGIC
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["summary"] == results["summary"]
    assert on_disk["server"]["model"] == "standin"  # discovered from /v1/models

    # accept length and per-position rates equal the counters' deltas over the run
    drafts, acc = after[0] - before[0], after[1] - before[1]
    assert drafts > 0
    spec = results["spec_decode"]
    assert spec["drafts"] == drafts
    assert spec["accept_length"] == pytest.approx(1 + acc / drafts)
    assert spec["per_position_accept_rate"] == pytest.approx(
        [(after[2][p] - before[2][p]) / drafts for p in ("0", "1", "2")])

    # accuracy equals the stand-in's fixed rule, per question
    questions = load_questions(DATASET)[:n]
    expected = {q.qid: standin_correct(q.question, "") for q in questions}
    got = {r["question_id"]: r["correct_strict"] for r in results["requests"]}
    assert got == expected
    assert results["accuracy"]["strict"] == pytest.approx(sum(expected.values()) / n)
    assert results["accuracy"]["flexible"] == results["accuracy"]["strict"]

    # per-request timings are consistent with their definitions
    s = results["summary"]
    assert s["num_ok"] == n and s["num_errors"] == 0
    for r in results["requests"]:
        assert r["output_tokens"] == 9  # the stand-in's GSM8K answer is 9 words
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 8)
        assert 0 < r["ttft_s"] < r["e2e_s"]
        # MTP streams several tokens per chunk: fewer ITL gaps than tokens - 1
        assert len(r["itl_s"]) < r["output_tokens"] - 1
    assert s["decode_tokens_per_s"] == pytest.approx(1e3 / s["tpot_ms"]["mean"])
    md = (tmp_path / "results.md").read_text()
    assert "accept length" in md and "GSM8K accuracy" in md


def test_synthetic_without_speculation_and_api_key(plain_server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sekret")  # picked up when --api-key is not given
    results = run_benchmark(base_url=plain_server, workload="synthetic", input_len=100, output_len=24,
                            num_requests=3, concurrency=2, out_dir=str(tmp_path), progress=False)
    assert results["spec_decode"] is None
    # no acceptance plot without speculation; KV usage sampled once at the start at least
    assert results["files"] == ["results.json", "results.md", "latency.png", "lengths.png", "kv_cache_usage.png"]
    assert results["lengths"]["input"]["histogram"] == [{"low": 100, "high": 100, "count": 3}]
    for r in results["requests"]:
        assert r["ok"] and r["output_tokens"] == 24 and r["prompt_tokens"] == 100
        assert r["prompt_len"] == 100
        assert len(r["itl_s"]) == 23  # one token per chunk
    assert "api_key" not in results["config"]
    assert "none observed" in (tmp_path / "results.md").read_text()
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(ServerError, match="401"):
        run_benchmark(base_url=plain_server, num_requests=1, input_len=4, output_len=2, progress=False)


def test_compare_mcnemar_matches_the_two_servers_rules(mtp_server, plain_server, tmp_path):
    n = 40
    common = dict(workload="gsm8k", num_requests=n, concurrency=8, max_tokens=32, progress=False)
    run_benchmark(base_url=mtp_server, out_dir=str(tmp_path / "a"), **common)
    run_benchmark(base_url=plain_server, api_key="sekret", out_dir=str(tmp_path / "b"), **common)
    questions = load_questions(DATASET)[:n]
    a_only = sum(standin_correct(q.question, "") and not standin_correct(q.question, "other") for q in questions)
    b_only = sum(standin_correct(q.question, "other") and not standin_correct(q.question, "") for q in questions)
    out_json = tmp_path / "cmp.json"
    rc = bench_main(["compare", str(tmp_path / "a/results.json"), str(tmp_path / "b/results.json"),
                     "--json", str(out_json), "--md", str(tmp_path / "cmp.md")])
    assert rc == 0
    cmp = json.loads(out_json.read_text())
    mc = cmp["scores"]["modes"]["strict"]["mcnemar"]
    assert (mc["a_only"], mc["b_only"]) == (a_only, b_only)
    assert a_only + b_only > 0  # the two rules do disagree on these questions
    assert cmp["scores"]["modes"]["strict"]["paired"] == n
    assert cmp["scores"]["modes"]["strict"]["delta"] == pytest.approx((b_only - a_only) / n)
    tpot = next(m for m in cmp["metrics"] if m["metric"] == "TPOT (ms)" and m["statistic"] == "mean")
    assert tpot["paired"] and tpot["low"] <= tpot["delta"] <= tpot["high"]
    assert cmp["accept_length"]["b"] is None and cmp["accept_length"]["a"] > 1
    assert "McNemar" in (tmp_path / "cmp.md").read_text()


def test_cli_run_prints_table(mtp_server, tmp_path, capsys):
    rc = bench_main(["run", "--base-url", mtp_server, "--workload", "synthetic", "--input-len", "8",
                     "--output-len", "5", "--num-requests", "2", "--out-dir", str(tmp_path), "--no-progress",
                     "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TPOT (ms)" in out and "accept length" in out
    assert not (tmp_path / "latency.png").exists()


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--base-url", "localhost:8000"], "--base-url must start with http"),
    (["--workload", "gsm8k", "--dataset", "/nonexistent/q.jsonl"], "--dataset '/nonexistent/q.jsonl': file not found"),
    (["--workload", "gsm8k", "--fewshot", "/nonexistent/f.jsonl"], "--fewshot"),
])
def test_cli_bad_input_exit_2(args, message, capsys, tmp_path):
    assert bench_main(["run", "--out-dir", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--workload", "nope"], ["--token-id-range", "5:2"], ["--concurrency", "x"]])
def test_cli_argparse_errors(args, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_main(["run", "--out-dir", str(tmp_path), *args])
    assert exc.value.code == 2


def test_cli_unreachable_server_exit_1(capsys, tmp_path):
    port = free_port()  # nobody listens here
    rc = bench_main(["--base-url", f"http://127.0.0.1:{port}", "--num-requests", "1", "--out-dir", str(tmp_path),
                     "--no-progress"])
    assert rc == 1
    assert f"cannot use the server at --base-url http://127.0.0.1:{port}" in capsys.readouterr().err


def test_compare_bad_files(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    assert bench_main(["compare", str(tmp_path / "missing.json"), str(bad)]) == 2
    assert "missing.json: file not found" in capsys.readouterr().err
    assert bench_main(["compare", str(bad), str(bad)]) == 2
    assert "not a vllm-ling bench results.json" in capsys.readouterr().err


def test_run_benchmark_rejects_unknown_workload():
    with pytest.raises(BenchError, match="unknown workload"):
        run_benchmark(workload="mmlu")


def test_bench_and_plan_import_neither_vllm_nor_torch():
    code = ("import sys; from vllm_ling.cli.main import main; "
            "import vllm_ling.bench, vllm_ling.bench.ablation, vllm_ling.bench.compare, "
            "vllm_ling.bench.results_files, vllm_ling.bench.standin; "
            "assert main(['plan', '--no-study']) == 0; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _tool(name: str, *params: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in params}}}}


WEATHER_TOOLS = [_tool("get_weather", "city", "unit"), _tool("get_time", "zone")]


def _replay_rows() -> list[dict]:
    """Requests whose stand-in answers follow its documented chat rules (see standin.py)."""
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return [
        # tool named in the message, key=value words as arguments: matches
        {"id": "t-match", "messages": user("get_weather city=Paris unit=c"), "tools": WEATHER_TOOLS,
         "expected": {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}},
        # a call is returned, but with other arguments than expected
        {"id": "t-args", "messages": user("get_weather city=Oslo"), "tools": WEATHER_TOOLS,
         "expected": {"tool_call": {"name": "get_weather", "arguments": {"city": "Berlin"}}}},
        # tool_choice none: no call; expected a call
        {"id": "t-none", "messages": user("get_time zone=UTC"), "tools": WEATHER_TOOLS, "tool_choice": "none",
         "expected": {"tool_call": {"name": "get_time"}}},
        # tools but nothing expected: counts for the tool-call fraction only
        {"id": "t-free", "messages": user("anything"), "tools": WEATHER_TOOLS},
        # plain chat: the stand-in answers "echo: <message>"
        {"id": "s-ok", "messages": user("Hello World"), "expected": "echo: hello world"},
        {"id": "n-ok", "messages": user("so 3/4 of it"), "expected": 0.75,
         "chat_template_kwargs": {"enable_thinking": True}},
        {"id": "r-miss", "messages": user("abc"), "expected": {"regex": "^xyz"}},
        {"id": "plain", "messages": user("no expectation"), "max_tokens": 2},
    ]


EXPECTED_CORRECT = {"t-match": True, "t-args": False, "t-none": False, "s-ok": True, "n-ok": True,
                    "r-miss": False}


def test_replay_scores_and_tool_calls_against_the_standin(mtp_server, tmp_path):
    path = tmp_path / "replay.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _replay_rows()) + "\n")
    out = tmp_path / "out"
    r = run_benchmark(base_url=mtp_server, workload="replay", requests_file=str(path), out_dir=str(out),
                      progress=False, metrics_interval_s=0.02)
    rows = {x["request_id"]: x for x in r["requests"]}
    assert all(x["ok"] for x in rows.values())
    assert {k: rows[k]["correct"] for k in EXPECTED_CORRECT} == EXPECTED_CORRECT
    assert rows["plain"]["correct"] is None and rows["t-free"]["correct"] is None
    assert rows["t-match"]["tool_calls"][0]["name"] == "get_weather"  # assembled from streamed deltas
    assert json.loads(rows["t-match"]["tool_calls"][0]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert rows["n-ok"]["reasoning"] == "Thinking it over." and rows["n-ok"]["text"] == "echo: so 3/4 of it"
    acc = r["accuracy"]
    assert acc["n"] == 6 and acc["correct"] == pytest.approx(3 / 6)
    assert acc["tool_requests"] == 4 and acc["tool_call_fraction"] == pytest.approx(3 / 4)
    assert acc["tool_expected"] == 3 and acc["tool_match_fraction"] == pytest.approx(1 / 3)
    # usage tokens per request; one request at a time, so each has its own accept length
    assert rows["plain"]["output_tokens"] == 2
    assert all(x["accept_length"] and x["accept_length"] >= 1 for x in rows.values())
    facts = r["server"]["facts"]
    assert facts["report"]["optimizations"]["mtp"] is True and facts["report"]["passed"] is True
    assert facts["metrics"]["cache_config"]["num_gpu_blocks"] == "1024"
    assert facts["usage"]["samples"] and facts["usage"]["kv_cache_usage"]["max"] <= 1.0
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.png", "kv_cache_usage.png", "latency.png",
                                                     "lengths.png", "results.json", "results.md"]
    md = (out / "results.md").read_text()
    assert "Scored against `expected`: **50.00%** of 6" in md and "Server facts:" in md
    assert "returned parsed `tool_calls`: **75.00%**" in md


def test_request_rate_sends_on_the_seeded_poisson_schedule(plain_server):
    from vllm_ling.bench.arrivals import arrival_offsets

    r = run_benchmark(base_url=plain_server, api_key="sekret", workload="synthetic", input_len=4, output_len=2,
                      num_requests=8, request_rate=20.0, seed=4, progress=False, metrics_interval_s=0)
    sent = [x["send_offset_s"] for x in r["requests"]]
    # Each request leaves at its scheduled time, never early; event-loop scheduling adds a little
    # (the median lag stays small; one late wake-up on a loaded 2-core box must not fail the test).
    lags = sorted(got - want for got, want in zip(sent, arrival_offsets(8, 20.0, 4)))
    assert lags[0] >= 0 and lags[len(lags) // 2] < 0.05 and lags[-1] < 1.0, lags
    assert r["config"]["concurrency"] is None  # unbounded: arrivals alone pace the run
    assert "Poisson arrivals at 20 requests/s" in __import__("vllm_ling.bench.results_files",
                                                              fromlist=["markdown"]).markdown(r)


def test_compare_scored_replay_mcnemar_and_what_differed(mtp_server, plain_server, tmp_path):
    n = 30
    questions = load_questions(DATASET)[:n]
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps({
        "id": f"q{i}", "messages": [{"role": "user", "content": f"Question: {q.question}\nAnswer:"}],
        "max_tokens": 32, "expected": {"number": q.answer}}) for i, q in enumerate(questions)) + "\n")
    common = dict(workload="replay", requests_file=str(path), concurrency=6, progress=False, plots=False)
    run_benchmark(base_url=mtp_server, out_dir=str(tmp_path / "a"), **common)
    run_benchmark(base_url=plain_server, api_key="sekret", out_dir=str(tmp_path / "b"), seed=1, **common)
    a_only = sum(standin_correct(q.question, "") and not standin_correct(q.question, "other") for q in questions)
    b_only = sum(standin_correct(q.question, "other") and not standin_correct(q.question, "") for q in questions)
    out_json = tmp_path / "cmp.json"
    assert bench_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(out_json),
                       "--md", str(tmp_path / "cmp.md")]) == 0  # folders are accepted
    cmp = json.loads(out_json.read_text())
    mode = cmp["scores"]["modes"]["expected"]
    assert (mode["mcnemar"]["a_only"], mode["mcnemar"]["b_only"]) == (a_only, b_only) and a_only + b_only > 0
    assert mode["paired"] == n and mode["delta"] == pytest.approx((b_only - a_only) / n)
    differ = {d["fact"]: (d["a"], d["b"]) for d in cmp["facts_differ"]}
    assert differ["report.optimizations.mtp"] == (True, False)
    assert {d["setting"] for d in cmp["config_differs"]} == {"seed"}
    md = (tmp_path / "cmp.md").read_text()
    assert "McNemar" in md and "| report.optimizations.mtp | `True` | `False` |" in md


@pytest.mark.parametrize("args,message", [
    (["--workload", "replay"], "--workload replay needs --requests"),
    (["--requests", "x.jsonl"], "--requests is for --workload replay"),
    (["--workload", "replay", "--requests", "/nonexistent/r.jsonl"], "--requests '/nonexistent/r.jsonl': file not found"),
    (["--workload", "gsm8k", "--input-len-dist", "8,16"], "shape the synthetic workload only"),
    (["--input-len-dist", "8:0"], "weights must be > 0"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--server-report", "/nonexistent/report.json"], "--server-report '/nonexistent/report.json': file not found"),
])
def test_cli_replay_and_rate_bad_input_exit_2(args, message, capsys, tmp_path):
    assert bench_main(["run", "--out-dir", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_bad_replay_line_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": "hi"}\n')
    assert bench_main(["run", "--workload", "replay", "--requests", str(path), "--out-dir", str(tmp_path)]) == 2
    assert f"{path}:2: 'messages' must be a non-empty list" in capsys.readouterr().err


def test_streamed_reasoning_keeps_its_spaces_at_every_chunk_boundary(mtp_server):
    # the stand-in groups pieces by its server-wide draft-acceptance cycle, so which words share a
    # chunk depends on the requests before; one request per phase of the cycle covers every split
    from vllm_ling.bench.standin import ACCEPT_PATTERN

    body = {"model": "standin", "stream": True, "messages": [{"role": "user", "content": "hi there"}],
            "chat_template_kwargs": {"enable_thinking": True}}
    for _ in range(len(ACCEPT_PATTERN)):
        req = urllib.request.Request(f"{mtp_server}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        reasoning, content = "", ""
        with urllib.request.urlopen(req, timeout=30) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        reasoning += choice.get("delta", {}).get("reasoning") or ""
                        content += choice.get("delta", {}).get("content") or ""
        assert reasoning == "Thinking it over." and content == "echo: hi there"
