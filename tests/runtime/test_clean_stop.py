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
