"""Start and stop real vLLM servers with the plugin on localhost (demo, ablation, tests).

Each server runs in its own session, so stopping it also stops vLLM's engine and worker
processes. Standard library only: ``vllm-ling bench`` uses it without vLLM installed.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from vllm_ling.processes import SERVER_MARKER_ENV, marked, new_marker

STARTUP_TIMEOUT_S = 900
# A server that never became healthy is stopped with its Python stacks in its log: every process of it
# runs with faulthandler on for fatal signals (PYTHONFAULTHANDLER), and SIGABRT makes each dump its
# threads, so a stalled start says where it stalled. Seconds given to the dumps before SIGTERM/SIGKILL.
STACKS_GRACE_S = 10.0
CPU_SERVE_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024",
                  "--max-num-seqs", "4", "--seed", "0"]
# A tiny checkpoint on a CUDA GPU, with CUDA graphs and torch.compile: a small share of the GPU
# (the fraction only gates vLLM's start-up check; a fixed KV cache also skips its memory profiling).
GPU_SERVE_ARGS = ["--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4", "--seed", "0",
                  "--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(1 << 30)]
SERVE_ARGS = {"cpu": CPU_SERVE_ARGS, "cuda": GPU_SERVE_ARGS}
VLLM_SERVE = [sys.executable, "-m", "vllm_ling.cli.vllm_entry", "serve"]
# vLLM only loads endpoint plugins (our GET /vllm_ling/report) when VLLM_PLUGINS names
# them, and then VLLM_PLUGINS is an allow-list for every plugin group.
PLUGIN_DISTRIBUTION = "vllm-ling"
# pyproject.toml's entry-point names; unioned with the installed metadata, which can be stale
# in an editable install. Naming a plugin that is not installed is harmless.
KNOWN_PLUGIN_NAMES = ("vllm_ling", "vllm_ling_report")


def plugin_names() -> list[str]:
    """Entry-point names vllm-ling registers in vLLM's plugin groups."""
    from importlib import metadata

    names = set(KNOWN_PLUGIN_NAMES)
    try:
        dist = metadata.distribution(PLUGIN_DISTRIBUTION)
        names |= {ep.name for ep in dist.entry_points if ep.group.startswith("vllm.")}
    except metadata.PackageNotFoundError:
        pass
    return sorted(names)



class ServerError(RuntimeError):
    """The server could not start or did not become healthy (the message has its log tail)."""


# Ports handed out below the kernel's ephemeral range: a port the OS gives to any bind(0) or connect() (Ray's
# and ZMQ's sockets among them) can be taken in the seconds before the server binds it, which is what the
# two-node Ray tests met with other servers starting beside them. From 20000: Ray refuses a head port inside
# its default worker-port range, 10002-19999.
PORT_FLOOR = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (32768, Linux's default, where unreadable)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port on ``host`` that nothing listens on now, picked at random between PORT_FLOOR and the
    ephemeral range (random: two test processes picking at once rarely agree); the OS's own choice
    where that range is empty or full."""
    low, pick = ephemeral_low(), random.SystemRandom()
    for _ in range(tries if low - PORT_FLOOR >= 1000 else 0):
        port = pick.randrange(PORT_FLOOR, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without stray vllm-ling switches, plus CPU settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    env.pop("VLLM_PLUGINS", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


def log_tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    _log: IO | None = field(default=None, repr=False)
    marker: str = ""  # SERVER_MARKER_ENV of every process of this server (vllm_ling.processes)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM the whole process group, SIGKILL after ``timeout``; return the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def stop_with_stacks(self, grace: float = STACKS_GRACE_S) -> int | None:
        """:func:`abort_with_stacks` this server's processes, then :meth:`stop` what is left."""
        if self.proc.poll() is None:
            abort_with_stacks(self.marker, grace, reap=self.proc.poll)
            try:  # whatever did not abort (a process without Python's faulthandler)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.stop()


def abort_with_stacks(marker: str, grace: float = STACKS_GRACE_S, reap: Callable[[], object] | None = None) -> None:
    """SIGABRT each process carrying ``marker``, youngest first and one at a time: with
    ``PYTHONFAULTHANDLER`` (set by :func:`start_server`) each Python process writes its threads'
    stacks into the server's log (all at once they would interleave there). ``reap``: the caller's
    poll of a child among them (a zombie's environ reads empty, so it no longer counts)."""
    for pid in sorted(marked(marker), key=_start_ticks, reverse=True):
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and marked(marker, among=[pid]):
            if reap is not None:
                reap()
            time.sleep(0.1)


def _start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot; 0: gone)."""
    try:
        # the fields after the command name, which may hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def group_alive(pgid: int, grace: float = 60.0) -> bool:
    """Whether any process of the group is still there after ``grace`` seconds.

    vLLM's engine-core and worker processes exit a few seconds after the API server."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.5)


def start_server(cmd: list[str], env: dict[str, str], log_path: Path, port: int, host: str = "127.0.0.1",
                 wait: bool = True, timeout: float = STARTUP_TIMEOUT_S, stall_s: float | None = None) -> Server:
    """Start ``cmd`` in its own session, logging to ``log_path``; OSError if it cannot start.
    ``stall_s``: see :func:`wait_healthy`."""
    marker = new_marker()
    env = {"PYTHONFAULTHANDLER": "1", **env, SERVER_MARKER_ENV: marker}
    log = open(log_path, "wb")  # noqa: SIM115 (closed by Server.stop)
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        log.close()
        raise
    server = Server(proc, f"http://{host}:{port}", log_path, log, marker)
    if wait:
        wait_healthy(server, timeout, stall_s=stall_s)
    return server


def wait_healthy(server: Server, timeout: float = STARTUP_TIMEOUT_S,
                 progress: Callable[[float], None] | None = None, every_s: float = 15.0,
                 stall_s: float | None = None) -> None:
    """Poll /health; ServerError (with the log tail) if the server exits or times out, or, with
    ``stall_s``, once its log has not grown for that long (a start that stalls is stopped with its
    stacks early, instead of holding a GPU until ``timeout``).
    ``progress(seconds waited)`` is called every ``every_s`` seconds while it waits."""
    start = time.monotonic()
    deadline = start + timeout
    next_progress = start + every_s
    log_size, grew_at = -1, start
    while True:
        if progress is not None and time.monotonic() >= next_progress:
            progress(time.monotonic() - start)
            next_progress += every_s
        if server.proc.poll() is not None:
            raise ServerError(f"server exited with code {server.proc.returncode} before it was healthy; "
                              f"last lines of {server.log_path}:\n{log_tail(server.log_path)}")
        try:
            if http_get(server.base_url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        if stall_s:
            size = server.log_path.stat().st_size if server.log_path.exists() else 0
            if size != log_size:
                log_size, grew_at = size, time.monotonic()
            elif time.monotonic() - grew_at > stall_s:
                _give_up(server, f"server log silent for {stall_s:g} s before it was healthy")
        if time.monotonic() > deadline:
            _give_up(server, f"server not healthy after {timeout:g} s")
        time.sleep(0.5)


def _give_up(server: Server, why: str) -> None:
    """Stop a start that will not become healthy, its stacks in its log, and raise ServerError."""
    server.stop_with_stacks()
    raise ServerError(f"{why} (its processes' Python stacks at that moment are in its log); last lines of "
                      f"{server.log_path}:\n{log_tail(server.log_path)}")


def serve_cpu(model: Path, log_path: Path, extra_args: list[str] | None = None,
              env: dict[str, str] | None = None, wait: bool = True) -> Server:
    """``vllm serve MODEL`` (vLLM's own CLI, plugin auto-loaded) on a free localhost port, on the CPU."""
    return serve_tiny(model, log_path, extra_args, env, wait, device="cpu")


def serve_tiny(model: Path, log_path: Path, extra_args: list[str] | None = None,
               env: dict[str, str] | None = None, wait: bool = True, device: str = "cpu") -> Server:
    """``vllm serve MODEL`` (vLLM's own CLI, plugin auto-loaded) on a free localhost port, with the
    arguments for a tiny checkpoint on ``device`` (``SERVE_ARGS``: cpu, or cuda)."""
    port = free_port()
    cmd = VLLM_SERVE + [str(model), "--host", "127.0.0.1", "--port", str(port),
                        "--served-model-name", "tiny"] + SERVE_ARGS[device] + (extra_args or [])
    return start_server(cmd, cpu_env(env), log_path, port, wait=wait)


def scrape(base_url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    status, body = http_get(base_url + "/metrics", timeout=10)
    if status != 200:
        raise ServerError(f"GET {base_url}/metrics returned HTTP {status}")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out
