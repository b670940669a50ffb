"""Run the vLLM server as a supervised child: drain on SIGTERM, fail loudly, leave nothing behind.

``vllm-ling serve`` does not exec vLLM; it stays as the parent (PID 1 in the image) and

- installs its SIGTERM/SIGINT handlers *before* starting vLLM and forwards each signal to
  vLLM's API server, which then drains in-flight requests for ``--shutdown-timeout`` seconds
  (vLLM ends each stream with its last tokens, or with an error event and ``[DONE]`` when the
  timeout cuts it) and exits 0;
- treats vLLM exiting while nobody asked it to stop as a failure: vLLM's API server exits 0
  when its EngineCore dies, so that case becomes ``EXIT_SERVER_DIED`` and restart policies
  that act on failure (compose ``restart: on-failure``, systemd ``Restart=on-failure``,
  Kubernetes) restart it; a non-zero code from vLLM is passed on as is;
- is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) and reaps every process that ends
  up as its child, so the workers of a dead EngineCore do not linger as zombies under PID 1;
- when vLLM's API server is gone, stops every process still below it (SIGTERM, then SIGKILL
  after ``CLEANUP_GRACE_S``), so no orphan keeps the GPU or the port;
- kills them all if vLLM has not exited ``TEARDOWN_MARGIN_S`` after the drain timeout;
- forwards vLLM's stderr (:mod:`vllm_ling.launcher.stderr_relay`): third-party leak reports at
  interpreter exit only at ``VLLM_LOGGING_LEVEL=DEBUG``, and our last line on a line of its own.

vLLM stays in our process group, so whoever stops the group (a terminal's Ctrl-C, a test
harness's killpg) reaches it even if we are gone; we find its processes through /proc.

Standard library only (no vLLM import).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping

from vllm_ling.processes import SERVER_MARKER_ENV, new_marker
from vllm_ling.refusal import REFUSAL_FILE_ENV
from vllm_ling.launcher.stderr_relay import StderrRelay, non_empty

EXIT_SERVER_DIED = 4  # vLLM exited 0 without a stop request: its engine died (documented in README)
# After the drain window, vLLM still tears down its engine processes; beyond this we kill.
TEARDOWN_MARGIN_S = 30.0
CLEANUP_GRACE_S = 5.0
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphaned descendants our children (Linux); False where the call is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_code_of(status: int) -> int:
    """waitpid status -> shell-style exit code (128 + signal for a killed process)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc, Linux; empty elsewhere), zombies excluded."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Supervisor:
    """One supervised vLLM server. ``run()`` returns the exit code the launcher should use."""

    def __init__(self, argv: list[str], env: Mapping[str, str], shutdown_timeout: float,
                 log: Callable[[str], None] | None = None,
                 teardown_margin: float = TEARDOWN_MARGIN_S, stop_file: str | None = None):
        self.argv = argv
        self.stop_file = stop_file  # written on a stop request (STOP_FILE_ENV of vllm_ling.options in vLLM's env)
        self.env = dict(env)
        self.shutdown_timeout = shutdown_timeout
        self.teardown_margin = teardown_margin
        self.log = log or (lambda msg: print(f"vllm-ling serve: {msg}", file=sys.stderr, flush=True))
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None   # the signal that asked us to stop
        self.stop_deadline: float | None = None
        self.override_code: int | None = None  # set by stop(code=...) (the smoke check)
        self.exited = threading.Event()        # vLLM's API server has exited
        self.relay: StderrRelay | None = None  # vLLM's stderr, forwarded
        self._lock = threading.Lock()

    # -------------------------------------------------------------- signals and stopping

    def _on_signal(self, signum, _frame) -> None:
        if self.child is None:
            self.log(f"received {signal.Signals(signum).name} before vLLM was running: stopping")
        else:
            self.log(f"received {signal.Signals(signum).name}: draining for up to "
                     f"{self.shutdown_timeout:g} s (--shutdown-timeout)")
        self._request_stop(signum)

    def _request_stop(self, signum: int) -> None:
        with self._lock:
            if self.stop_signal is None:
                self.stop_signal = signum
                self.stop_deadline = time.monotonic() + self.shutdown_timeout + self.teardown_margin
                self._mark_stop(signum)
            child = self.child
        if child is not None and not self.exited.is_set():
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

    def _mark_stop(self, signum: int) -> None:
        if self.stop_file:
            try:
                with open(self.stop_file, "w") as f:
                    f.write(signal.Signals(signum).name)
            except OSError:
                pass

    def stop(self, code: int) -> None:
        """Stop the server (drain as on SIGTERM) and make ``run()`` return ``code``."""
        self.override_code = code
        self._request_stop(signal.SIGTERM)

    # ------------------------------------------------------------------------- running

    def install_handlers(self) -> None:
        """Take over SIGTERM/SIGINT (idempotent). Call it as early as possible: a signal that
        comes before vLLM starts is recorded, and vLLM is then not started at all."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def start(self) -> subprocess.Popen | None:
        """Start vLLM (None when a stop was requested before: nothing to start)."""
        become_subreaper()
        self.install_handlers()
        with self._lock:
            if self.stop_signal is not None:
                return None
        # every process of this server carries it (a harness that started us may have named it)
        self.env.setdefault(SERVER_MARKER_ENV, new_marker())
        child = subprocess.Popen(self.argv, env=self.env, stderr=subprocess.PIPE)
        self.relay = StderrRelay(child.stderr, self.env.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG",
                                 refused=lambda: non_empty(self.env.get(REFUSAL_FILE_ENV))).start()
        with self._lock:
            self.child = child
            pending = self.stop_signal
        if pending is not None:  # arrived while vLLM was being created
            child.send_signal(pending)
        return child

    def run(self) -> int:
        child = self.child or self.start()
        if child is None:
            self.log(f"stopped by {signal.Signals(self.stop_signal).name} before vLLM started")
            return 0
        status = self._wait_for(child.pid)
        child.returncode = exit_code_of(status)
        self.exited.set()
        self._clean_up()
        if self.relay is not None:  # all of vLLM's output before our last words
            self.relay.join(CLEANUP_GRACE_S)
        return self._final_code(child.returncode)

    def _wait_for(self, pid: int) -> int:
        """Reap children (vLLM's, and orphans handed to us) until ``pid`` exits; its status."""
        while True:
            deadline = self.stop_deadline
            if deadline is not None and time.monotonic() > deadline:
                self.log(f"vLLM did not exit {self.teardown_margin:g} s after the drain timeout; "
                         "killing it")
                self._signal_all(signal.SIGKILL)
                self.stop_deadline = None
            try:
                reaped, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                raise RuntimeError("supervised vLLM process vanished without an exit status") from None
            if reaped == pid:
                return status
            if reaped == 0:
                time.sleep(0.2)

    def _signal_all(self, sig: int) -> None:
        """Signal vLLM and every process below us (orphans were reparented to us)."""
        targets = descendants(os.getpid())
        if self.child is not None and not self.exited.is_set():
            targets.append(self.child.pid)
        for pid in set(targets):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _clean_up(self) -> None:
        """Stop and reap whatever vLLM left below us."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + CLEANUP_GRACE_S
        killed = False
        while True:
            try:
                reaped, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return  # no children left
            if reaped:
                continue
            if time.monotonic() > deadline:
                if killed:
                    return
                self._signal_all(signal.SIGKILL)
                killed = True
                deadline = time.monotonic() + CLEANUP_GRACE_S
            time.sleep(0.1)

    def _final_code(self, code: int) -> int:
        if self.override_code is not None:
            return self.override_code
        if self.stop_signal is not None:
            self.log(f"vLLM stopped (exit code {code}) after {signal.Signals(self.stop_signal).name}")
            # Killed by the very signal we forwarded: it came before vLLM installed its
            # handlers, so nothing was being served; a requested stop, not a failure.
            return 0 if code == 128 + self.stop_signal else code
        if code == 0:
            self.log(f"ERROR: vLLM exited by itself with code 0 (its engine died; the log above "
                     f"says why); exiting with {EXIT_SERVER_DIED} so a restart policy restarts it")
            return EXIT_SERVER_DIED
        self.log(f"ERROR: vLLM exited with code {code}")
        return code
