"""Loggers for vllm-ling.

Loggers live under vLLM's ``vllm`` namespace (``vllm.ling.*``) so our lines use vLLM's
handler, format and ``VLLM_LOGGING_LEVEL`` in every process, without importing vLLM
(the ops/ modules must stay vLLM-free).
"""

from __future__ import annotations

import logging
import os
import traceback

ROOT = "vllm.ling"
_once: set[tuple[str, str]] = set()


def get_logger(name: str = "") -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def log_once(logger: logging.Logger, level: int, key: str, msg: str, *args) -> bool:
    """Log ``msg`` once per process for ``key``; returns True when it logged."""
    if (logger.name, key) in _once:
        return False
    _once.add((logger.name, key))
    logger.log(level, msg, *args, stacklevel=2)
    return True


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line: a kernel's JIT build can put pages of compiler output in its
    exception, and the refusal must stay one line (the whole text is in the DEBUG traceback)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += f" ... {lines[-1]}" if len(lines) > 2 else f" {lines[-1]}"
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def raised(exc: BaseException) -> str:
    """``Type: message at file.py:line in function``: :func:`one_line` plus where it was raised, so an
    exception with no message (a bare ``StopIteration``) still names its place."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return one_line(exc)
    last = frames[-1]
    return f"{one_line(exc)} at {os.path.basename(last.filename)}:{last.lineno} in {last.name}"
