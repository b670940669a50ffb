"""Which processes belong to one vLLM server: a marker in their environment, never a word in
their command line.

A command line says little: the path of a checkout named ``vllm-ling`` puts "vllm" into every
process started from it (Ray's own daemons, pytest, a shell), and vLLM's processes rename
themselves. So whoever starts a server puts :data:`SERVER_MARKER_ENV` into the environment of
the process it starts (``vllm-ling serve``'s supervisor, the local test/demo servers; plain
``vllm serve`` sets it for its own children, :func:`vllm_ling.refusal.ensure_file`); every
process below inherits it, and Ray's workers get it through the runtime env
(:mod:`vllm_ling.runtime.ray_env`). Its value names the server (``<owner pid>-<random hex>``):
:func:`marked` lists that server's processes from ``/proc/PID/environ`` (Linux; same user or root).

Standard library only: launchers and test harnesses import it without vLLM.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterable

# Not a VLLM_LING_* setting (nothing to configure): set by whoever starts a server.
SERVER_MARKER_ENV = "_VLLM_LING_SERVER"


def new_marker(owner: int | None = None) -> str:
    """A value naming one server: the pid of the process that owns it, and a random part."""
    return f"{os.getpid() if owner is None else owner}-{uuid.uuid4().hex[:12]}"


def owner_pid(marker: str | None) -> int | None:
    """The owner pid a marker names (None: none, or not one of ours)."""
    head = (marker or "").split("-", 1)[0]
    return int(head) if head.isdigit() else None


def environ_of(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (None: gone or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def marker_of(pid: int) -> str | None:
    """The server marker ``pid`` carries (None: none, or not readable)."""
    return (environ_of(pid) or {}).get(SERVER_MARKER_ENV)


def all_pids() -> list[int]:
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def marked(value: str | None = None, among: Iterable[int] | None = None) -> list[int]:
    """Live processes (of ``among``, default all) carrying a server marker: ``value``'s, or any
    when ``value`` is None. This process is never in the list."""
    me = os.getpid()
    found = []
    for pid in all_pids() if among is None else among:
        mark = marker_of(pid) if pid != me else None
        if mark is not None and (value is None or mark == value):
            found.append(pid)
    return found
