"""Per process: how many humming JIT kernels were compiled here, how many were loaded from the
cache, and the seconds spent compiling.

humming-kernels 0.1.17 prepares every kernel through ``humming.jit.compiler.Compiler.compile``:
it makes the kernel's cache directory ``<HUMMING_CACHE_DIR>/<md5>``, takes the kernel's file
lock, returns ``<md5>/kernel.cubin`` when it exists (a cache hit), and otherwise runs the
compiler as a subprocess (its NVRTC helper or nvcc, writing ``<md5>/kernel_tmp.cubin``) and
publishes the cubin with ``os.replace(kernel_tmp.cubin, kernel.cubin)``. humming keeps no
count of this, and the cache directory alone cannot tell which process compiled a kernel
(workers share it). So this module watches this process's own operations on the cache
directory through Python's audit hooks (PEP 578, ``sys.addaudithook``), which see them
without wrapping any humming code:

- ``os.mkdir <cache>/<md5>``: the process prepares kernel ``<md5>`` (hit or compile);
- ``subprocess.Popen`` with ``<cache>/<md5>/kernel_tmp.cubin`` among its arguments: this
  process starts compiling it;
- ``os.rename`` (``os.replace``) to ``<cache>/<md5>/kernel.cubin``: this process published it.

A kernel prepared here but not compiled here was loaded from the cache (compiled earlier, or
by another process that held the lock first). ``compile_seconds`` is the wall time during
which at least one compile of this process ran (``compile_many`` compiles in threads, so the
sum of per-kernel times would count parallel compiles twice); ``compile_seconds_total`` is
that sum. Counting starts at :func:`observe`, which vllm-ling calls before it imports humming
(:func:`vllm_ling.ops.humming_cache.configure_humming_cache`) and, on CUDA, when the plugin
registers. An audit hook cannot be removed; this one returns at once for other events and
never raises (an exception would fail the audited operation).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any

_WATCHED = frozenset(("os.mkdir", "subprocess.Popen", "os.rename"))
_KERNEL_DIR = re.compile(r"[0-9a-f]{32}")
_TMP_CUBIN = "kernel_tmp.cubin"
_CUBIN = "kernel.cubin"


class JitCounter:
    """What the audit events of this process say about humming's JIT (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.since: float | None = None  # time.time() when observation started
        self.prepared: set[str] = set()
        self.started: dict[str, float] = {}  # md5 -> perf_counter at compiler start
        self.compiled: dict[str, tuple[float, float]] = {}  # md5 -> (start, end)
        self.hook_errors = 0

    # -- the audit hook ---------------------------------------------------------------------
    def on_event(self, event: str, args: tuple) -> None:
        if event not in _WATCHED:
            return
        try:
            self._on_watched(event, args)
        except Exception:  # noqa: BLE001 - must never fail the audited operation
            self.hook_errors += 1

    def _on_watched(self, event: str, args: tuple) -> None:
        cache = _humming_cache_dir()
        if cache is None:
            return
        if event == "os.mkdir":
            kernel = _kernel_of(os.fspath(args[0]), cache)
            if kernel:
                with self._lock:
                    self.prepared.add(kernel)
        elif event == "subprocess.Popen":
            argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            for arg in argv:
                arg = os.fsdecode(os.fspath(arg)) if isinstance(arg, (str, bytes, os.PathLike)) else ""
                if os.path.basename(arg) == _TMP_CUBIN:
                    kernel = _kernel_of(os.path.dirname(arg), cache)
                    if kernel:
                        with self._lock:  # the first: humming may post-process the cubin with another
                            self.started.setdefault(kernel, time.perf_counter())
        else:  # os.rename(src, dst, ...): humming's os.replace publishing a cubin
            dst = os.fsdecode(os.fspath(args[1]))
            if os.path.basename(dst) == _CUBIN:
                kernel = _kernel_of(os.path.dirname(dst), cache)
                with self._lock:
                    if kernel in self.started:
                        self.compiled[kernel] = (self.started.pop(kernel), time.perf_counter())

    # -- reading --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            intervals = sorted(self.compiled.values())
            prepared, compiled, running = set(self.prepared), set(self.compiled), set(self.started)
        wall = 0.0
        end = float("-inf")
        for a, b in intervals:  # union of the compile intervals
            if b > end:
                wall += b - max(a, end)
                end = b
        return {"compiled_kernels": len(compiled), "cache_hits": len(prepared - compiled - running),
                "compile_seconds": round(wall, 3),
                "compile_seconds_total": round(sum(b - a for a, b in intervals), 3),
                "compiling_now": len(running), "observed_since": self.since, "hook_errors": self.hook_errors}


def _humming_cache_dir() -> str | None:
    """humming's cache directory as humming resolves it, once humming is imported."""
    jit_utils = sys.modules.get("humming.utils.jit")
    if jit_utils is None:
        return None
    return os.path.normpath(jit_utils.get_humming_cache_dir())


def _kernel_of(directory: str, cache: str) -> str | None:
    """The kernel hash when ``directory`` is ``<cache>/<md5>``."""
    directory = os.path.normpath(os.fsdecode(directory))
    name = os.path.basename(directory)
    if _KERNEL_DIR.fullmatch(name) and os.path.dirname(directory) == cache:
        return name
    return None


COUNTER = JitCounter()
_installed = False
_install_lock = threading.Lock()


def observe() -> None:
    """Start counting in this process (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        COUNTER.since = time.time()
        sys.addaudithook(COUNTER.on_event)
        _installed = True


def observing() -> bool:
    return _installed


def jit_facts(applicable: bool, not_applicable_reason: str = "") -> dict[str, Any]:
    """The startup report's humming JIT facts for this process (flat keys, as the bench reads them).

    ``applicable`` is the caller's platform decision (humming runs on CUDA only); when False
    the counts are 0 and ``humming_jit_detail`` says why, rather than the facts being absent.
    """
    if not applicable:
        return {"humming_jit_applicable": False, "humming_jit_compiled_kernels": 0, "humming_jit_cache_hits": 0,
                "humming_jit_compile_s": 0.0, "humming_jit_detail": not_applicable_reason}
    if not _installed:  # nothing was watched: say so instead of reporting zeros
        return {"humming_jit_applicable": True, "humming_jit_compiled_kernels": None,
                "humming_jit_cache_hits": None, "humming_jit_compile_s": None,
                "humming_jit_detail": "not observed: the counter was not started in this process"}
    snap = COUNTER.snapshot()
    detail = (f"this process compiled {snap['compiled_kernels']} kernel(s) in {snap['compile_seconds']:.2f} s "
              f"(wall; {snap['compile_seconds_total']:.2f} s summed over parallel compiles) and loaded "
              f"{snap['cache_hits']} from the cache {_humming_cache_dir() or '(humming not imported)'}")
    if snap["compiling_now"]:
        detail += f"; {snap['compiling_now']} compile(s) unfinished"
    if snap["hook_errors"]:
        detail += f"; {snap['hook_errors']} event(s) could not be read"
    return {"humming_jit_applicable": True, "humming_jit_compiled_kernels": snap["compiled_kernels"],
            "humming_jit_cache_hits": snap["cache_hits"], "humming_jit_compile_s": snap["compile_seconds"],
            "humming_jit_compile_s_total": snap["compile_seconds_total"], "humming_jit_detail": detail}
