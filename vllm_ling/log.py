"""Loggers for vllm-ling.

Loggers live under vLLM's ``vllm`` namespace (``vllm.ling.*``) so our lines use vLLM's
handler, format and ``VLLM_LOGGING_LEVEL`` in every process, without importing vLLM
(the ops/ modules must stay vLLM-free).
"""

from __future__ import annotations

import logging

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
