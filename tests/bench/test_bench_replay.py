"""Replay files, length distributions and server facts, without a server."""

from __future__ import annotations

import json
import random
from collections import Counter
from importlib import resources

import pytest

from vllm_ling.bench import lengths
from vllm_ling.bench.replay import ReplayError, load_replay, replay_requests, schedule
from vllm_ling.bench.server_facts import diff_facts, facts_from_metrics, facts_from_report
from vllm_ling.bench.workloads import synthetic_requests

EXAMPLE = str(resources.files("vllm_ling") / "data" / "replay_example.jsonl")


def write(tmp_path, rows) -> str:
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def chat(i, **kw):
    return {"messages": [{"role": "user", "content": f"q{i}"}], **kw}


def test_packaged_example_loads_with_plain_and_tool_requests():
    lines = load_replay(EXAMPLE)
    assert len(lines) >= 6
    assert any(line.has_tools for line in lines) and any(not line.has_tools for line in lines)
    kinds = {line.expected.kind for line in lines if line.expected}
    assert kinds == {"string", "number", "regex", "tool_call"}  # every scorer case is shown


def test_fields_not_sent_and_set_by_the_harness(tmp_path):
    path = write(tmp_path, [chat(0, id="a", expected="x", usage={"prompt_tokens": 3}, model="gpt",
                                 stream=False, temperature=0.2, max_tokens=9)])
    [req] = replay_requests(path, num_requests=None, shuffle=False, seed=0)
    assert req.chat and req.request_id == "a"
    assert req.params == {"messages": [{"role": "user", "content": "q0"}], "temperature": 0.2, "max_tokens": 9}
    assert req.meta["expected"] == "x" and req.expected.kind == "string"


@pytest.mark.parametrize("row,message", [
    ("{not json", "r.jsonl:1: not JSON"),
    ("[1, 2]", "one JSON object"),
    ({"prompt": "hi"}, "not a completion"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"content": "x"}]}, "needs a 'role'"),
    (chat(0, tools={"a": 1}), "'tools' must be a list"),
    (chat(0, max_tokens=0), "'max_tokens' must be a whole number >= 1"),
    (chat(0, expected={"regex": "("}), "r.jsonl:1: expected: expected.regex"),
    (chat(0, expected={"tool_call": {"name": "f"}}), "declares no 'tools'"),
    (chat(0, id=[1]), "'id' must be"),
    (chat(0, usage={"prompt_tokens": -1}), "'usage' must hold"),
])
def test_bad_lines_name_file_and_line(tmp_path, row, message):
    with pytest.raises(ReplayError, match=message):
        load_replay(write(tmp_path, [row]))


def test_duplicate_ids_and_missing_or_empty_file(tmp_path):
    with pytest.raises(ReplayError, match="r.jsonl:2: id 'a' already used on line 1"):
        load_replay(write(tmp_path, [chat(0, id="a"), chat(1, id="a")]))
    with pytest.raises(ReplayError, match="file not found"):
        load_replay(str(tmp_path / "none.jsonl"))
    with pytest.raises(ReplayError, match="no requests"):
        load_replay(write(tmp_path, [""]))


def test_order_cut_repeat_and_shuffle(tmp_path):
    path = write(tmp_path, [chat(i, id=f"r{i}") for i in range(5)])
    lines = load_replay(path)
    ids = lambda sched: [line.request_id for line, _ in sched]  # noqa: E731
    assert ids(schedule(lines, None, False, 0)) == ["r0", "r1", "r2", "r3", "r4"]
    assert ids(schedule(lines, 3, False, 0)) == ["r0", "r1", "r2"]
    repeated = schedule(lines, 12, False, 0)
    assert ids(repeated) == [f"r{i % 5}" for i in range(12)]
    assert [p for _, p in repeated] == [1] * 5 + [2] * 5 + [3] * 2
    shuffled = schedule(lines, 12, True, 7)
    assert ids(shuffled) == ids(schedule(lines, 12, True, 7))  # seeded
    assert ids(shuffled) != ids(schedule(lines, 12, True, 8))
    # each pass is a permutation of the file
    assert sorted(ids(shuffled)[:5]) == sorted(ids(shuffled)[5:10]) == [f"r{i}" for i in range(5)]
    sampled = ids(schedule(lines, 3, True, 1))
    assert len(set(sampled)) == 3  # a sample without repeats
    reqs = replay_requests(path, num_requests=7, shuffle=False, seed=0)
    assert [r.request_id for r in reqs][4:] == ["r4", "r0#2", "r1#2"]  # repeats are named apart


def test_shuffle_is_uniform_over_positions(tmp_path):
    # Each of 4 lines lands first about a quarter of the time over 4000 seeded passes
    # (binomial sd 27; allowed +-120, i.e. > 4 sd).
    lines = load_replay(write(tmp_path, [chat(i, id=f"r{i}") for i in range(4)]))
    sched = schedule(lines, 4000 * 4, True, 3)
    first = Counter(sched[4 * k][0].request_id for k in range(4000))
    assert all(abs(first[f"r{i}"] - 1000) < 120 for i in range(4)), first


def test_length_list_and_weights():
    d = lengths.parse_length_spec("128:3,1024:1", "input", "--input-len-dist")
    assert d.values == (128, 1024) and d.weights == (3.0, 1.0)
    drawn = Counter(d.sample(8000, random.Random(0)))
    # P(128) = 0.75; binomial sd over 8000 draws is 0.5%; allow 2%.
    assert drawn[128] / 8000 == pytest.approx(0.75, abs=0.02)
    assert lengths.parse_length_spec("64, 64,32", "input", "x").weights == (1.0, 2.0)


@pytest.mark.parametrize("spec,message", [
    ("0,5", "lengths must be >= 1"), ("5:0", "weights must be > 0"), ("/no/such/file", "neither a list"),
])
def test_bad_length_specs(spec, message):
    with pytest.raises(lengths.LengthSpecError, match=message):
        lengths.parse_length_spec(spec, "input", "--input-len-dist")


def test_lengths_from_a_replay_file_and_a_results_file(tmp_path):
    path = write(tmp_path, [chat(0, usage={"prompt_tokens": 100, "completion_tokens": 7}),
                            chat(1, max_tokens=20, usage={"prompt_tokens": 100}),
                            {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 20}])
    ind = lengths.parse_length_spec(path, "input", "--input-len-dist")
    assert dict(zip(ind.values, ind.weights)) == {100: 2.0, 10: 1.0} and ind.estimated  # 40 chars / 4
    outd = lengths.parse_length_spec(path, "output", "--output-len-dist")
    assert dict(zip(outd.values, outd.weights)) == {7: 1.0, 20: 2.0} and not outd.estimated
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"schema": "vllm-ling-bench/2", "requests": [
        {"ok": True, "prompt_tokens": 50, "output_tokens": 9}, {"ok": False, "prompt_tokens": 1, "output_tokens": 0},
        {"ok": True, "prompt_tokens": 50, "output_tokens": 4}]}))
    assert lengths.parse_length_spec(str(results), "input", "x").values == (50,)
    assert lengths.parse_length_spec(str(results), "output", "x").values == (4, 9)


def test_synthetic_requests_follow_the_distribution_and_keep_prompts():
    d = lengths.parse_length_spec("8,16", "input", "x")
    ins, outs = lengths.draw(d, None, 400, seed=2)
    assert outs is None and ins == lengths.draw(d, None, 400, seed=2)[0]  # seeded
    reqs = synthetic_requests(num_requests=400, input_len=4, output_len=3, seed=2, input_lens=ins)
    sent = Counter(len(r.prompt) for r in reqs)
    assert set(sent) == {8, 16} and abs(sent[8] - 200) < 50  # binomial sd 10
    assert all(r.params["max_tokens"] == 3 for r in reqs)
    fixed = synthetic_requests(num_requests=2, input_len=4, output_len=3, seed=2)
    assert [len(r.prompt) for r in fixed] == [4, 4]


def test_histogram_bins():
    assert lengths.histogram([3, 3, 5]) == [{"low": 3, "high": 3, "count": 2}, {"low": 5, "high": 5, "count": 1}]
    rows = lengths.histogram(list(range(1, 100)))  # too many values: powers of two
    assert sum(r["count"] for r in rows) == 99 and rows[0] == {"low": 1, "high": 1, "count": 1}
    assert rows[-1] == {"low": 64, "high": 127, "count": 36}


REPORT = {"passed": True, "policy": "strict", "platform": "cpu", "gpu_arch": None,
          "versions": {"vllm": "0.32.0", "humming": "0.1.17"},
          "optimizations": {"fp8_head": {"requested": True, "active": True, "detail": ""},
                            "mtp": {"requested": True, "active": True, "detail": ""}},
          "checks": [{"name": "lm_head", "passed": True}], "moe_backend": "reference",
          "head_dtype": "float8_e4m3fn", "spec_method": "mtp", "num_speculative_tokens": 3,
          "smoke": {"accept_length": 3.9}}


def test_facts_diff_names_what_changed():
    a = {"report": facts_from_report(REPORT), "sources": {"report": "x"}, "usage": {"samples": [1]}}
    changed = json.loads(json.dumps(REPORT))
    changed["versions"]["vllm"] = "0.33.0"
    changed["optimizations"]["mtp"]["active"] = False
    b = {"report": facts_from_report(changed), "sources": {"report": "y"}, "usage": {"samples": [2]}}
    diff = {d["fact"]: (d["a"], d["b"]) for d in diff_facts(a, b)}
    assert diff == {"report.versions.vllm": ("0.32.0", "0.33.0"), "report.optimizations.mtp": (True, False)}
    assert diff_facts(a, a) == []


def test_facts_from_metrics():
    text = "\n".join([
        'vllm_ling:info{model_name="m",vllm_version="0.32.0",platform="cpu"} 1.0',
        'vllm_ling:optimization_active{model_name="m",optimization="mtp"} 0.0',
        'vllm_ling:kernel_check_passed{kernel="fp8_linear"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="99"} 1.0',
        "process_resident_memory_bytes 1.5e9",
        "vllm_ling:startup_seconds 42.0",
    ])
    f = facts_from_metrics(text)
    assert f["info"] == {"vllm_version": "0.32.0", "platform": "cpu"}
    assert f["optimizations_active"] == {"mtp": False} and f["kernel_checks"] == {"fp8_linear": True}
    assert f["cache_config"] == {"block_size": "16", "num_gpu_blocks": "99"}
    assert f["api_server_resident_bytes"] == 1.5e9 and f["launch_to_ready_s"] == 42.0


def test_facts_from_report_read_the_known_answer_section():
    """The verification report's kernel_checks section (runtime/verification/known_answers): per kernel and
    implementation, skipped checks left out."""
    from vllm_ling.bench.server_facts import facts_from_report

    report = {"passed": True, "kernel_checks": {"passed": False, "summary": "", "seconds": 0.4, "dense_fp8": {},
                                                "results": [
        {"name": "fp8_head", "kernel": "torch", "passed": True, "skipped": None},
        {"name": "moe_mxfp4", "kernel": "humming", "passed": False, "skipped": None},
        {"name": "kda", "kernel": "vllm", "passed": False, "skipped": "no KDA layer"}]}}
    assert facts_from_report(report)["kernel_checks"] == {"fp8_head[torch]": True, "moe_mxfp4[humming]": False}


def test_memory_and_jit_facts_are_compared_and_printed():
    """KV-cache bytes and humming JIT counts (report sections, or the gauges) reach `bench compare`
    and results.md; CPU says "not applicable" rather than nothing."""
    from vllm_ling.bench.results_files import facts_lines

    cold = json.loads(json.dumps(REPORT))
    cold["memory"] = {"weights_bytes": 3 * 2**20, "kv_cache_bytes": 2**30}
    cold["startup"] = {"humming_jit_applicable": True, "humming_jit_compiled_kernels": 12,
                       "humming_jit_cache_hits": 0, "humming_jit_compile_s": 40.0, "humming_jit_detail": "d",
                       "rank": 0}
    warm = json.loads(json.dumps(cold))
    warm["memory"]["kv_cache_bytes"] = 2**29
    warm["startup"].update(humming_jit_compiled_kernels=0, humming_jit_cache_hits=12, humming_jit_compile_s=0.0,
                           humming_jit_detail="restates the numbers")
    a, b = {"report": facts_from_report(cold)}, {"report": facts_from_report(warm)}
    diff = {d["fact"]: (d["a"], d["b"]) for d in diff_facts(a, b)}
    assert diff == {"report.memory.kv_cache_bytes": (2**30, 2**29),
                    "report.startup.humming_jit_compiled_kernels": (12, 0),
                    "report.startup.humming_jit_cache_hits": (0, 12),
                    "report.startup.humming_jit_compile_s": (40.0, 0.0)}
    text = "\n".join(facts_lines({**a, "sources": {}}))
    assert "- humming JIT: 12 kernel(s) compiled in 40.0 s, 0 loaded from the cache (worker rank 0)" in text
    assert "kv_cache 1024.0 MiB" in text and "weights 3.0 MiB" in text

    metrics = facts_from_metrics("\n".join([
        'vllm_ling:kv_cache_bytes{model_name="m"} 1.073741824e+09',
        'vllm_ling:humming_jit_applicable{model_name="m"} 0.0',
        'vllm_ling:humming_jit_compiled_kernels{model_name="m"} 0.0',
        'vllm_ling:humming_jit_cache_hits{model_name="m"} 0.0',
        'vllm_ling:humming_jit_compile_seconds{model_name="m"} 0.0']))
    assert metrics == {"kv_cache_bytes": 2**30, "humming_jit_applicable": 0.0, "humming_jit_compiled_kernels": 0.0,
                       "humming_jit_cache_hits": 0.0, "humming_jit_compile_s": 0.0}
    text = "\n".join(facts_lines({"report": None, "metrics": metrics, "sources": {"report": "none"}}))
    assert "- humming JIT: not applicable" in text and "kv_cache 1024.0 MiB" in text
