"""A requested stop of vLLM's API server does not log an engine failure.

When vLLM 0.32's API server stops on SIGTERM/SIGINT, ``MPClient.shutdown`` (run by the
launcher's ``handle_shutdown``) cancels the task that reads the engine core's output socket;
that task answers the cancellation by queueing an ``EngineDeadError``, and when
``AsyncLLM``'s output handler wakes before its own cancellation reaches it, it logs
``AsyncLLM output_handler failed.`` at ERROR with the EngineDeadError's traceback: a clean
stop that reads like an engine crash (the process still exits 0; seen about one stop in two
on the tiny CPU server).

:func:`install` adds a filter to that one logger (``vllm.v1.engine.async_llm``) which demotes a
record carrying an ``EngineDeadError`` to DEBUG, only while a requested stop is in progress:

- ``vllm-ling serve``'s supervisor wrote its stop file (:data:`STOP_FILE_ENV`) when it got the
  signal, before forwarding it (any log level);
- or this process logged vLLM's ``[shutdown] API server: shutdown triggered`` line (plain
  ``vllm serve``, at the default INFO level or below).

An engine that dies by itself (no stop requested) is still logged at ERROR, traceback included.

:class:`RefuseWhileStopping` (an ASGI middleware the report endpoint plugin adds to the API
server's app) answers every request that arrives once the same stop is known with HTTP 503 and
the reason: vLLM 0.32 keeps accepting requests while it drains, but its engine client has shut its
renderer's executor down, so each got HTTP 500 ``cannot schedule new futures after shutdown`` and
a 41-frame traceback in the log. Requests already running drain as before.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vllm_ling.options import STOP_FILE_ENV

OUTPUT_HANDLER_LOGGER = "vllm.v1.engine.async_llm"
LAUNCHER_LOGGER = "vllm.entrypoints.launchers.launcher"
SHUTDOWN_TRIGGERED = "[shutdown] API server: shutdown triggered"


def _is_engine_dead(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return any(cls.__name__ == "EngineDeadError" for cls in type(exc).__mro__) if exc is not None else False


class CleanStopFilter(logging.Filter):
    """Observes the launcher's shutdown line and demotes EngineDeadError records after it."""

    def __init__(self) -> None:
        super().__init__("vllm-ling-clean-stop")
        self.stop_seen = False

    def stop_requested(self) -> bool:
        return self.stop_reason() is not None

    def stop_reason(self) -> str | None:
        """Why the server is stopping (``SIGTERM received``, ...), None while it is not."""
        path = os.environ.get(STOP_FILE_ENV)
        try:
            signal_name = Path(path).read_text().strip() if path else ""
        except OSError:
            signal_name = ""
        if signal_name:
            return f"{signal_name} received"
        return "shutdown triggered" if self.stop_seen else None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == LAUNCHER_LOGGER and str(record.msg).startswith(SHUTDOWN_TRIGGERED):
            self.stop_seen = True
        elif record.levelno > logging.DEBUG and _is_engine_dead(record) and self.stop_requested():
            # The handlers compare the level after this filter: at INFO it is dropped, at
            # VLLM_LOGGING_LEVEL=DEBUG it is shown (traceback included) as DEBUG.
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.msg = f"{record.msg} (during a requested stop: not an engine failure)"
        return True


_filter: CleanStopFilter | None = None


def install() -> CleanStopFilter:
    """Add the filter to the two vLLM loggers (idempotent); returns it."""
    global _filter
    if _filter is None:
        _filter = CleanStopFilter()
    for name in (LAUNCHER_LOGGER, OUTPUT_HANDLER_LOGGER):
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)
    return _filter


def stopping_message(reason: str) -> str:
    return (f"the server is stopping ({reason}): requests already running finish, new ones are "
            "not accepted; retry against another replica or once it is back")


class RefuseWhileStopping:
    """ASGI middleware: once a stop is requested, HTTP requests other than GETs (the inference
    routes) are answered 503 with the reason, in vLLM's error format, without reaching vLLM."""

    def __init__(self, app, stop: CleanStopFilter | None = None) -> None:
        self.app = app
        self.stop = stop or install()

    async def __call__(self, scope, receive, send) -> None:
        reason = (self.stop.stop_reason() if scope.get("type") == "http"
                  and scope.get("method", "GET") not in ("GET", "HEAD", "OPTIONS") else None)
        if reason is None:
            await self.app(scope, receive, send)
            return
        import json

        body = json.dumps({"error": {"message": stopping_message(reason), "type": "ServiceUnavailableError",
                                     "param": None, "code": 503}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
