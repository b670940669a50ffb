"""Refusals: input vllm-ling will not start with, said in one line that names what to fix.

:class:`Refusal` marks the exceptions raised for input the user must change (a flag, a
variable, a file). Under ``vllm serve`` they are raised inside vLLM's CLI (config hooks, the
checkpoint check) and nothing there catches them, so Python would print a traceback through
vLLM's frames and ``vllm-ling serve`` would end on vLLM's exit code. The plugin installs
:func:`excepthook` in every vLLM process: for an uncaught refusal (or an error caused by one)
it prints the one line, keeps the traceback at DEBUG (``VLLM_LOGGING_LEVEL=DEBUG``), and writes
the line to the file ``vllm-ling serve`` names in :data:`REFUSAL_FILE_ENV`; the launcher prints
it again as its last line once vLLM has exited (:func:`take`).

Standard library only: the launcher imports it without vLLM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vllm_ling.log import get_logger
from vllm_ling.processes import SERVER_MARKER_ENV, new_marker

# Set by vllm-ling serve in vLLM's environment; not a VLLM_LING_* setting (nothing to configure).
REFUSAL_FILE_ENV = "_VLLM_LING_REFUSAL_FILE"
logger = get_logger("refusal")


class Refusal(Exception):
    """Marker base of vllm-ling's expected refusals: the message names the flag, variable or
    file to fix, so no traceback is shown for it."""


def _wrapped(exc: BaseException) -> list[BaseException]:
    """Errors pydantic wrapped in ``exc`` (vLLM's configs are pydantic dataclasses: a ValueError
    raised in their ``__post_init__``, where vLLM runs the config hooks, arrives as one
    ValidationError holding it, with no cause chain)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors) or type(exc).__name__ != "ValidationError":
        return []
    try:
        return [e["ctx"]["error"] for e in errors() if isinstance(e.get("ctx", {}).get("error"), BaseException)]
    except Exception:  # noqa: BLE001 - not pydantic's shape after all
        return []


def find(exc: BaseException | None) -> BaseException | None:
    """The refusal ``exc`` is, was raised from (its cause / context chain) or wraps (pydantic), else None."""
    seen: set[int] = set()
    todo = [exc] if exc is not None else []
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        if isinstance(exc, Refusal):
            return exc
        seen.add(id(exc))
        todo += [exc.__cause__ or exc.__context__, *_wrapped(exc)]
    return None


def record(message: str) -> bool:
    """Write ``message`` to the launcher's refusal file (False when no launcher asked for one)."""
    path = os.environ.get(REFUSAL_FILE_ENV)
    if not path:
        return False
    try:
        Path(path).write_text(message)
    except OSError:
        return False
    return True


def recorded() -> str | None:
    """The refusal a process of this server recorded so far (None: none, or no file)."""
    path = os.environ.get(REFUSAL_FILE_ENV)
    try:
        return (Path(path).read_text().strip() or None) if path else None
    except OSError:
        return None


def ensure_file() -> None:
    """Under plain ``vllm serve`` nobody named a refusal file: the first vLLM process names one
    before it spawns the others (they inherit it), so a refusal raised in a worker reaches the
    API server's last line too (:func:`excepthook`); that process removes it at exit. It also
    gives the server its marker (:data:`vllm_ling.processes.SERVER_MARKER_ENV`). Only in
    ``vllm serve``'s own process (not a program that merely registers the plugin, whose servers
    would then share one file)."""
    import multiprocessing

    if multiprocessing.parent_process() is not None or sys.argv[1:2] != ["serve"]:
        return
    # its processes are known by this marker (vllm_ling.processes; a launcher may have set it)
    os.environ.setdefault(SERVER_MARKER_ENV, new_marker())
    if os.environ.get(REFUSAL_FILE_ENV):
        return
    import atexit
    import tempfile

    fd, path = tempfile.mkstemp(prefix="vllm-ling-refusal-", suffix=".txt")
    os.close(fd)
    os.environ[REFUSAL_FILE_ENV] = path
    atexit.register(lambda: Path(path).unlink(missing_ok=True))


def take(path: str | os.PathLike) -> str | None:
    """The refusal a child recorded in ``path`` (None: none), removing the file."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return text or None


_previous_hook = None


def excepthook(exc_type, exc, tb) -> None:
    refusal = find(exc)
    # vLLM's "engine core initialization failed" after a worker's refusal: the refusal is the cause
    message = str(refusal) if refusal is not None else recorded()
    if message is None:
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    logger.debug("traceback of the refusal below", exc_info=(exc_type, exc, tb))
    print(f"vllm-ling: error: {message}", file=sys.stderr, flush=True)
    record(message)


def install_excepthook() -> None:
    """Take over ``sys.excepthook`` for refusals (idempotent; other errors go to the previous hook)."""
    global _previous_hook
    if sys.excepthook is not excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = excepthook


class _LogFilter:
    """On one of vLLM's handlers: a record with a traceback whose error is a refusal, or that
    comes after a refusal this server recorded (vLLM's engine core and API server report the
    worker's failure again), is shown at DEBUG only (still shown at ``VLLM_LOGGING_LEVEL=DEBUG``)."""

    def __init__(self, handler) -> None:
        self.handler = handler

    def filter(self, record) -> bool:
        if not record.exc_info or record.levelno <= 10:
            return True
        if find(record.exc_info[1]) is None and recorded() is None:
            return True
        record.levelno, record.levelname = 10, "DEBUG"
        return self.handler.level <= 10


def install_log_filter() -> None:
    """Add :class:`_LogFilter` to the handlers of vLLM's ``vllm`` logger (idempotent)."""
    import logging

    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, _LogFilter) for f in handler.filters):
            handler.addFilter(_LogFilter(handler))
