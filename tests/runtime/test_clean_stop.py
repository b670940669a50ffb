"""A requested stop does not log vLLM's EngineDeadError at ERROR; an engine that dies by itself
still does. Through vLLM's own loggers and exception class (vllm_ling.runtime.clean_stop); the
real server's SIGTERM is tests/deploy/test_serve_lifecycle.py."""

from __future__ import annotations

import logging

import pytest

from vllm_ling.runtime import clean_stop
from vllm_ling.options import STOP_FILE_ENV

pytest.importorskip("vllm")


class Capture(logging.Handler):
    def __init__(self, level):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def loggers(monkeypatch):
    """vLLM's output-handler and launcher loggers with a fresh filter and INFO / DEBUG captures."""
    monkeypatch.delenv(STOP_FILE_ENV, raising=False)
    handler_log = logging.getLogger(clean_stop.OUTPUT_HANDLER_LOGGER)
    launcher_log = logging.getLogger(clean_stop.LAUNCHER_LOGGER)
    fresh = clean_stop.CleanStopFilter()
    saved = {lg: (lg.filters[:], lg.level) for lg in (handler_log, launcher_log)}
    info, debug = Capture(logging.INFO), Capture(logging.DEBUG)
    for lg in saved:
        lg.filters = [fresh]
        lg.setLevel(logging.DEBUG)
    handler_log.addHandler(info)
    handler_log.addHandler(debug)
    yield handler_log, launcher_log, info, debug
    handler_log.removeHandler(info)
    handler_log.removeHandler(debug)
    for lg, (filters, level) in saved.items():
        lg.filters = filters
        lg.setLevel(level)


def _engine_dead(log: logging.Logger) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        raise EngineDeadError()
    except EngineDeadError:
        log.exception("AsyncLLM output_handler failed.")  # what vLLM's output handler logs


def test_engine_death_without_a_stop_is_still_an_error(loggers):
    handler_log, _, info, _ = loggers
    _engine_dead(handler_log)
    assert [r.levelname for r in info.records] == ["ERROR"]
    assert info.records[0].exc_info is not None


def test_after_the_api_servers_shutdown_line_it_is_debug(loggers):
    handler_log, launcher_log, info, debug = loggers
    launcher_log.info("[shutdown] API server: shutdown triggered")  # vLLM's launcher, on SIGTERM
    _engine_dead(handler_log)
    assert info.records == []
    assert [r.levelname for r in debug.records] == ["DEBUG"]
    assert debug.records[0].exc_info is not None  # the traceback stays there, at DEBUG
    handler_log.error("some other error")  # only EngineDeadError is demoted
    assert [r.levelname for r in info.records] == ["ERROR"]


def test_the_supervisors_stop_file_demotes_it_at_any_level(loggers, tmp_path, monkeypatch):
    handler_log, _, info, _ = loggers
    stop = tmp_path / "stop"
    stop.write_text("")
    monkeypatch.setenv(STOP_FILE_ENV, str(stop))
    _engine_dead(handler_log)  # file empty: no stop requested yet
    assert [r.levelname for r in info.records] == ["ERROR"]
    stop.write_text("SIGTERM")
    _engine_dead(handler_log)
    assert [r.levelname for r in info.records] == ["ERROR"]


def test_the_plugin_installs_it():
    from vllm_ling.plugin import register

    register()
    for name in (clean_stop.OUTPUT_HANDLER_LOGGER, clean_stop.LAUNCHER_LOGGER):
        assert any(isinstance(f, clean_stop.CleanStopFilter) for f in logging.getLogger(name).filters)


def _call(app, method: str, path: str = "/v1/completions") -> tuple[int, dict | None]:
    """One request through an ASGI app: (status, JSON body or None)."""
    import asyncio
    import json

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": []}, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if body else None


def test_requests_after_a_requested_stop_get_503_with_the_reason(tmp_path, monkeypatch):
    """Issue 46: a request 1 s after SIGTERM got HTTP 500 'cannot schedule new futures after
    shutdown' and a traceback; now the API server answers 503 and says why, before vLLM sees it."""
    async def served(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    stop = tmp_path / "stop"
    stop.write_text("")
    monkeypatch.setenv(STOP_FILE_ENV, str(stop))
    app = clean_stop.RefuseWhileStopping(served, clean_stop.CleanStopFilter())
    assert _call(app, "POST") == (200, None)  # not stopping: vLLM serves it
    stop.write_text("SIGTERM")
    status, body = _call(app, "POST")
    assert status == 503 and body["error"]["code"] == 503
    assert body["error"]["message"] == (
        "the server is stopping (SIGTERM received): requests already running finish, new ones are not "
        "accepted; retry against another replica or once it is back")
    assert _call(app, "GET", "/health") == (200, None)  # health and metrics still answer
    # plain `vllm serve`: vLLM's own shutdown line is the sign
    monkeypatch.delenv(STOP_FILE_ENV)
    plain = clean_stop.CleanStopFilter()
    app = clean_stop.RefuseWhileStopping(served, plain)
    assert _call(app, "POST")[0] == 200
    plain.filter(logging.LogRecord(clean_stop.LAUNCHER_LOGGER, logging.INFO, "", 0,
                                   "[shutdown] API server: shutdown triggered", None, None))
    assert _call(app, "POST") == (503, {"error": {
        "message": clean_stop.stopping_message("shutdown triggered"), "type": "ServiceUnavailableError",
        "param": None, "code": 503}})


def test_the_report_plugin_adds_the_middleware():
    from fastapi import FastAPI

    from vllm_ling.runtime.report_endpoint import make_plugin

    app = FastAPI()
    make_plugin().attach_router(app)
    assert any(m.cls is clean_stop.RefuseWhileStopping for m in app.user_middleware)
