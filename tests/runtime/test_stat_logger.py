"""The stat-logger plugin fed with vLLM's real SchedulerStats / SpecDecodingStats.

References are computed here from per-draft data (each draft's accepted-prefix length),
independently of the logger's step-level running sums.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from types import SimpleNamespace

import known_answer_faults as faults  # tests/known_answer_faults.py
import pytest
from prometheus_client import REGISTRY
from vllm.v1.metrics.loggers import StatLoggerBase, load_stat_logger_plugin_factories
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_ling.runtime import stat_logger as metrics
from vllm_ling.runtime.acceptance import AcceptWindow
from vllm_ling.runtime.report import REPORT_JSON_SCHEMA, ReportReader
from vllm_ling.runtime.stat_logger import LingStatLogger

MODEL = "tiny"
K = 3  # num_speculative_tokens


def sample_report(**overrides) -> dict:
    """The report schema the startup verification writes (the lead's writer produces this)."""
    report = {
        "passed": False,
        "policy": "warn",
        "platform": "cpu",
        "gpu_arch": None,
        "versions": {"vllm": "0.32.0", "humming": "0.1.17"},
        "optimizations": {
            "moe_humming": {"requested": True, "active": False,
                            "detail": "CPU platform: plain-PyTorch reference MoE"},
            "fp8_head": {"requested": True, "active": True,
                         "detail": "lm_head float8_e4m3fn, 128x128 block scales"},
            "mtp": {"requested": True, "active": True,
                    "detail": "mtp, 3 tokens, draft shares the target's lm_head module"},
        },
        "moe_backend": "reference",
        "head_dtype": "float8_e4m3fn",
        "spec_method": "mtp",
        "num_speculative_tokens": K,
        "checks": [
            {"name": "moe_method", "passed": False, "expected": "humming on 2 layers",
             "actual": "reference on 2 layers", "fix": "run on CUDA sm_75+ with humming-kernels"},
        ],
        "smoke": {"accept_length": 3.5, "threshold": 1.5, "passed": True},
    }
    report.update(overrides)
    return report


def fake_config(num_spec_tokens: int | None = K):
    """The two VllmConfig fields the logger reads (a full VllmConfig needs a model)."""
    spec = None if num_spec_tokens is None else SimpleNamespace(
        num_speculative_tokens=num_spec_tokens, method="mtp")
    return SimpleNamespace(speculative_config=spec,
                           model_config=SimpleNamespace(served_model_name=MODEL))


def step_stats(accepted_per_draft: list[int], num_spec_tokens: int = K) -> SchedulerStats:
    """One scheduler step's stats, built by vLLM's own SpecDecodingStats.observe_draft."""
    spec = SpecDecodingStats.new(num_spec_tokens)
    for n in accepted_per_draft:
        spec.observe_draft(num_draft_tokens=num_spec_tokens, num_accepted_tokens=n)
    return SchedulerStats(spec_decoding_stats=spec)


def value(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": MODEL, **labels})


def reference_window(steps: list[list[int]], size: int) -> list[int]:
    """Per-draft accepted counts of the shortest suffix of whole steps holding >= size drafts."""
    kept: list[list[int]] = []
    for step in reversed(steps):
        if sum(len(s) for s in kept) >= size:
            break
        kept.insert(0, step)
    return [n for s in kept for n in s]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def captured():
    """Our log records, whether or not vLLM's 'vllm' logger propagates to the root."""
    ours = logging.getLogger("vllm.ling")
    handler, old_level = _Records(), ours.level
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    yield handler
    ours.removeHandler(handler)
    ours.setLevel(old_level)


@pytest.fixture
def make_logger(monkeypatch, tmp_path):
    monkeypatch.setenv(metrics.ENV_REPORT_PATH, str(tmp_path / "report.json"))
    created = []

    def make(window: int = 8, break_even: float = 2.26, num_spec_tokens: int | None = K,
             engines=(0,)):
        monkeypatch.setenv(metrics.ENV_ACCEPT_WINDOW, str(window))
        monkeypatch.setenv(metrics.ENV_BREAK_EVEN, str(break_even))
        stat_logger = LingStatLogger(fake_config(num_spec_tokens), list(engines))
        created.append(stat_logger)
        return stat_logger

    yield make
    metrics.unregister_vllm_ling_metrics()


def collapse_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and "accept length collapsed" in r.getMessage()]


def test_entry_point_is_loaded_by_vllm_plugin_loader():
    factories = load_stat_logger_plugin_factories()
    assert LingStatLogger in factories
    assert issubclass(LingStatLogger, StatLoggerBase)


def test_window_matches_per_draft_reference_and_per_position_sums():
    rng = random.Random(7)
    size = 20
    stat_logger_window = AcceptWindow(size, K)
    steps: list[list[int]] = []
    for _ in range(60):
        step = [rng.choice([0, 0, 1, 2, 3]) for _ in range(rng.randint(1, 6))]
        steps.append(step)
        s = step_stats(step).spec_decoding_stats
        stat_logger_window.add(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                               s.num_accepted_tokens_per_pos)
        drafts = reference_window(steps, size)
        assert stat_logger_window.drafts == len(drafts)
        assert stat_logger_window.accept_length == pytest.approx(1 + sum(drafts) / len(drafts))
        rates = stat_logger_window.per_position_rates()
        for pos in range(K):
            assert rates[pos] == pytest.approx(sum(n > pos for n in drafts) / len(drafts))
        assert 1 + sum(rates) == pytest.approx(stat_logger_window.accept_length)


def test_record_exports_windowed_accept_length_and_per_position(make_logger):
    stat_logger = make_logger(window=6)
    assert value("vllm_ling:accept_length", engine="0") is None  # no draft yet
    assert value("vllm_ling:accept_break_even") == pytest.approx(2.26)
    steps = [[3, 3], [0, 1, 2], [3], [0, 0, 0, 0]]
    for step in steps:
        stat_logger.record(step_stats(step), None)
    drafts = reference_window(steps, 6)  # [3] + [0, 0, 0, 0] is only 5 drafts -> also [0, 1, 2]
    assert drafts == [0, 1, 2, 3, 0, 0, 0, 0]
    assert value("vllm_ling:accept_length", engine="0") == pytest.approx(1 + 6 / 8)
    assert value("vllm_ling:accept_window_drafts", engine="0") == 8
    for pos, expected in enumerate([3 / 8, 2 / 8, 1 / 8]):
        assert value("vllm_ling:accept_rate_per_position", engine="0",
                     position=str(pos)) == pytest.approx(expected)
    # Steps without drafts (prefill-only) and without spec stats change nothing.
    stat_logger.record(SchedulerStats(), None)
    stat_logger.record(SchedulerStats(spec_decoding_stats=SpecDecodingStats.new(K)), None)
    stat_logger.record(None, None)
    assert value("vllm_ling:accept_window_drafts", engine="0") == 8


def test_one_warning_per_collapse_episode_and_counter(make_logger, captured):
    stat_logger = make_logger(window=4, break_even=2.26)
    counter = lambda: value("vllm_ling:accept_collapse_total", engine="0")  # noqa: E731
    assert counter() == 0

    stat_logger.record(step_stats([0, 0, 0]), None)  # window not full yet: no verdict
    assert counter() == 0 and not collapse_warnings(captured)

    assert value("vllm_ling:accept_collapse_active", engine="0") == 0
    stat_logger.record(step_stats([0]), None)  # full, accept length 1.0
    assert counter() == 1
    assert value("vllm_ling:accept_collapse_active", engine="0") == 1
    [warning] = collapse_warnings(captured)
    message = warning.getMessage()
    for fragment in ("1.000 over the last 4 drafts", "0 of 12 draft tokens accepted",
                     "break-even 2.26", "VLLM_LING_ACCEPT_BREAK_EVEN", "episode 1"):
        assert fragment in message, message

    for _ in range(5):  # still collapsed: no new warning, no new count
        stat_logger.record(step_stats([1]), None)
    assert counter() == 1 and len(collapse_warnings(captured)) == 1

    stat_logger.record(step_stats([3, 3, 3, 3]), None)  # window 4.0: recovered
    assert any(r.levelno == logging.INFO and "recovered" in r.getMessage() for r in captured.records)
    assert counter() == 1
    assert value("vllm_ling:accept_collapse_active", engine="0") == 0

    stat_logger.record(step_stats([0, 0, 0, 1]), None)  # second episode
    assert counter() == 2
    assert len(collapse_warnings(captured)) == 2
    assert "episode 2" in collapse_warnings(captured)[-1].getMessage()


def test_accept_length_at_break_even_is_not_a_collapse(make_logger, captured):
    stat_logger = make_logger(window=4, break_even=2.5)
    stat_logger.record(step_stats([1, 2, 1, 2]), None)  # exactly 2.5
    assert value("vllm_ling:accept_collapse_total", engine="0") == 0
    assert not collapse_warnings(captured)


def test_engines_have_separate_windows_and_episodes(make_logger):
    stat_logger = make_logger(window=2, engines=(0, 1))
    stat_logger.record(step_stats([0, 0]), None, engine_idx=0)
    stat_logger.record(step_stats([3, 3]), None, engine_idx=1)
    assert value("vllm_ling:accept_length", engine="0") == pytest.approx(1.0)
    assert value("vllm_ling:accept_length", engine="1") == pytest.approx(4.0)
    assert value("vllm_ling:accept_collapse_total", engine="0") == 1
    assert value("vllm_ling:accept_collapse_total", engine="1") == 0


def test_no_speculation_exports_no_accept_metrics(make_logger):
    stat_logger = make_logger(num_spec_tokens=None)
    stat_logger.record(SchedulerStats(), None)
    assert value("vllm_ling:accept_length", engine="0") is None
    assert value("vllm_ling:accept_break_even") is None


@pytest.mark.parametrize("name,raw", [
    (metrics.ENV_ACCEPT_WINDOW, "0"), (metrics.ENV_ACCEPT_WINDOW, "lots"),
    (metrics.ENV_BREAK_EVEN, "-1"), (metrics.ENV_BREAK_EVEN, "nan"), (metrics.ENV_BREAK_EVEN, "x"),
])
def test_bad_env_values_name_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        LingStatLogger(fake_config(), [0])


def test_report_metrics_appear_when_the_report_does(make_logger, tmp_path):
    stat_logger = make_logger()
    stat_logger.log_engine_initialized()
    assert value("vllm_ling:verification_passed") is None  # not written yet

    report = sample_report()
    (tmp_path / "report.json").write_text(json.dumps(report))
    stat_logger.log()
    assert value("vllm_ling:verification_passed") == 0
    for name, entry in report["optimizations"].items():
        assert value("vllm_ling:optimization_active", optimization=name) == float(entry["active"])
        assert value("vllm_ling:optimization_requested", optimization=name) == float(entry["requested"])
    assert value("vllm_ling:info", vllm_version="0.32.0", humming_version="0.1.17",
                  moe_backend="reference", head_dtype="float8_e4m3fn", spec_method="mtp",
                  gpu_arch="none", platform="cpu", policy="warn") == 1

    # A rewritten report replaces the old values (and the old info series).
    fixed = sample_report(passed=True, policy="strict", platform="cuda", gpu_arch="sm_90",
                          moe_backend="humming")
    fixed["optimizations"]["moe_humming"]["active"] = True
    path = tmp_path / "report.json"
    path.write_text(json.dumps(fixed))
    os.utime(path, (time.time() + 5, time.time() + 5))  # mtime changes even on a coarse clock
    stat_logger.log()
    assert value("vllm_ling:verification_passed") == 1
    assert value("vllm_ling:optimization_active", optimization="moe_humming") == 1
    assert value("vllm_ling:info", vllm_version="0.32.0", humming_version="0.1.17",
                  moe_backend="reference", head_dtype="float8_e4m3fn", spec_method="mtp",
                  gpu_arch="none", platform="cpu", policy="warn") is None
    assert value("vllm_ling:info", vllm_version="0.32.0", humming_version="0.1.17",
                  moe_backend="humming", head_dtype="float8_e4m3fn", spec_method="mtp",
                  gpu_arch="sm_90", platform="cuda", policy="strict") == 1


def test_chat_roundtrip_status_is_exported_from_the_report(make_logger, tmp_path):
    stat_logger = make_logger()
    path = tmp_path / "report.json"
    report = sample_report(chat_roundtrip={"status": "off by request", "reasoning_parser": None,
                                           "tool_parser": None, "template": "t", "detail": "d", "fix": ""})
    path.write_text(json.dumps(report))
    stat_logger.log()
    assert value("vllm_ling:chat_roundtrip", status="off_by_request") == 1
    report["chat_roundtrip"]["status"] = "failed"
    path.write_text(json.dumps(report))
    os.utime(path, (time.time() + 5, time.time() + 5))
    stat_logger.log()
    assert value("vllm_ling:chat_roundtrip", status="failed") == 1
    assert value("vllm_ling:chat_roundtrip", status="off_by_request") is None  # one status at a time


def test_report_reader_ignores_stale_half_written_and_malformed_files(tmp_path, captured):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(sample_report()))
    old = time.time() - 3600
    os.utime(path, (old, old))
    reader = ReportReader(str(path), not_before=time.time() - 60)
    assert reader.read() is None  # a previous run's report
    assert any("written before this server started" in r.getMessage() for r in captured.records)

    path.write_text(json.dumps(sample_report(passed=True)))
    assert reader.read()["passed"] is True

    path.write_text('{"passed": tr')  # caught mid-write: keep the last good report
    os.utime(path, (time.time() + 1, time.time() + 1))
    assert reader.read()["passed"] is True
    assert any("cannot parse" in r.getMessage() for r in captured.records)

    path.write_text(json.dumps({"passed": "yes", "optimizations": {"mtp": {"active": 1}}}))
    os.utime(path, (time.time() + 2, time.time() + 2))
    assert reader.read()["passed"] is True
    [schema_warning] = [r for r in captured.records if "not usable" in r.getMessage()]
    assert '"passed" is not true/false' in schema_warning.getMessage()
    assert "optimizations.mtp" in schema_warning.getMessage()


def test_sample_report_matches_the_published_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(sample_report(), REPORT_JSON_SCHEMA)
    broken = sample_report()
    del broken["optimizations"]["fp8_head"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, REPORT_JSON_SCHEMA)


def test_a_failure_inside_record_is_logged_once_and_does_not_raise(make_logger, captured, monkeypatch):
    stat_logger = make_logger()

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(stat_logger, "observe_spec_decoding", broken)
    for _ in range(3):
        stat_logger.record(step_stats([1]), None)  # must not raise into vLLM's output handler
    failures = [r for r in captured.records if "failed to record" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.WARNING
    assert "RuntimeError: boom" in failures[0].getMessage()


def test_kernel_check_metric_per_checked_kernel(make_logger, tmp_path):
    """vllm_ling:kernel_check_passed{kernel,impl} from the report's kernel_checks (real results
    of a passing head kernel and of one with a planted fault; skipped checks export nothing)."""
    from vllm_ling.ops import known_answer as ka

    ok = ka.check_fp8_head_kernel("torch", "cpu")
    bad = ka.check_fp8_head_kernel("torch", "cpu", plant=faults.plant_head_zero_code_fault)
    bad.name = "fp8_head_planted"
    skipped = ka.skipped_result("moe_mxfp4", "vllm:SomeMethod", "no runner")
    report = sample_report(kernel_checks={
        "passed": False, "summary": bad.message(), "seconds": 0.1,
        "results": [r.as_dict() for r in (ok, bad, skipped)],
        "dense_fp8": {"kernels": {}, "path_choice": None}})
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, REPORT_JSON_SCHEMA)
    stat_logger = make_logger()
    (tmp_path / "report.json").write_text(json.dumps(report))
    stat_logger.log()
    assert value("vllm_ling:kernel_check_passed", kernel="fp8_head", impl="torch") == 1
    assert value("vllm_ling:kernel_check_passed", kernel="fp8_head_planted", impl="torch") == 0
    assert value("vllm_ling:kernel_check_passed", kernel="moe_mxfp4", impl="vllm:SomeMethod") is None


def test_startup_seconds_is_this_process_age_when_the_engine_is_ready(make_logger):
    import psutil

    stat_logger = make_logger()
    age_before = time.time() - psutil.Process().create_time()
    stat_logger.log_engine_initialized()
    age_after = time.time() - psutil.Process().create_time()
    value = REGISTRY.get_sample_value("vllm_ling:startup_seconds", {"model_name": "tiny"})
    assert age_before <= value <= age_after


def test_memory_and_startup_facts_are_exported_from_the_report(make_logger, tmp_path):
    """The worker's KV-cache bytes and humming JIT facts (runtime/startup_facts) as gauges; the
    CPU section says humming is not applicable with zero counts, not nothing."""
    jsonschema = pytest.importorskip("jsonschema")
    from vllm_ling.runtime.startup_facts import startup_section

    stat_logger = make_logger()
    path = tmp_path / "report.json"
    report = sample_report(memory={"weights_bytes": 123456, "kv_cache_bytes": 1073741824},
                           startup=startup_section(applicable=False))
    jsonschema.validate(report, REPORT_JSON_SCHEMA)
    path.write_text(json.dumps(report))
    stat_logger.log()
    assert value("vllm_ling:weights_bytes") == 123456
    assert value("vllm_ling:kv_cache_bytes") == 1073741824
    assert value("vllm_ling:humming_jit_applicable") == 0
    assert value("vllm_ling:humming_jit_compiled_kernels") == 0
    assert value("vllm_ling:humming_jit_cache_hits") == 0
    assert value("vllm_ling:humming_jit_compile_seconds") == 0

    report["startup"] = {"humming_jit_applicable": True, "humming_jit_compiled_kernels": 12,
                         "humming_jit_cache_hits": 30, "humming_jit_compile_s": 41.5,
                         "humming_jit_detail": "d", "rank": 0}
    jsonschema.validate(report, REPORT_JSON_SCHEMA)
    path.write_text(json.dumps(report))
    os.utime(path, (time.time() + 5, time.time() + 5))
    stat_logger.log()
    assert value("vllm_ling:humming_jit_applicable") == 1
    assert (value("vllm_ling:humming_jit_compiled_kernels"), value("vllm_ling:humming_jit_cache_hits"),
            value("vllm_ling:humming_jit_compile_seconds")) == (12, 30, 41.5)
