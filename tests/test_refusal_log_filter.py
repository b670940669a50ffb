"""vllm_ling.refusal when vLLM catches a refusal and logs it (a worker's strict verification,
issue 27): the traceback is shown at DEBUG only, later errors of the same server too, and the
API server's uncaught follow-on error ends on the recorded refusal."""

from __future__ import annotations

import logging

import pytest

from vllm_ling import refusal
from vllm_ling.runtime.verification.policy import LingVerificationError


@pytest.fixture
def handler(monkeypatch, tmp_path):
    path = tmp_path / "refusal.txt"
    path.write_text("")
    monkeypatch.setenv(refusal.REFUSAL_FILE_ENV, str(path))
    h = logging.Handler(logging.INFO)
    h.records = []
    h.emit = h.records.append
    h.addFilter(refusal._LogFilter(h))
    log = logging.getLogger("vllm.test_refusal_log_filter")
    log.addHandler(h)
    yield log, h, path
    log.removeHandler(h)


def _logged(log, exc):
    try:
        raise exc
    except Exception:
        log.exception("WorkerProc failed to start.")


def test_verification_error_is_a_refusal():
    assert refusal.find(RuntimeError("x")) is None
    assert isinstance(refusal.find(LingVerificationError("Set VLLM_LING_VERIFY=warn")), LingVerificationError)


def test_a_logged_refusal_is_debug_other_errors_stay(handler):
    log, h, _ = handler
    _logged(log, LingVerificationError("refused"))
    assert h.records == []
    _logged(log, RuntimeError("real failure"))
    assert [r.levelname for r in h.records] == ["ERROR"]


def test_after_a_recorded_refusal_follow_on_tracebacks_are_debug(handler):
    log, h, path = handler
    assert refusal.record("vllm-ling refuses to serve: ...")
    _logged(log, RuntimeError("WorkerProc initialization failed"))
    assert h.records == []


def test_excepthook_ends_on_the_recorded_refusal(handler, capsys):
    refusal.record("vllm-ling refuses to serve: fix X")
    refusal.excepthook(RuntimeError, RuntimeError("Engine core initialization failed"), None)
    assert capsys.readouterr().err.strip().splitlines()[-1] == "vllm-ling: error: vllm-ling refuses to serve: fix X"


def test_only_vllm_serves_own_process_names_a_file(monkeypatch):
    monkeypatch.delenv(refusal.REFUSAL_FILE_ENV, raising=False)
    monkeypatch.setattr("sys.argv", ["pytest", "tests"])
    refusal.ensure_file()
    import os

    assert refusal.REFUSAL_FILE_ENV not in os.environ
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "model"])
    refusal.ensure_file()
    assert os.path.exists(os.environ[refusal.REFUSAL_FILE_ENV])
    os.unlink(os.environ[refusal.REFUSAL_FILE_ENV])
