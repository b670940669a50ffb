"""Start and stop real vLLM servers with the plugin on localhost (demo, ablation, tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests  # noqa: E402  (a vLLM dependency)

STARTUP_TIMEOUT_S = 900
CPU_SERVE_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024",
                  "--max-num-seqs", "4", "--seed", "0"]
VLLM_SERVE = [sys.executable, "-m", "vllm_ling.serving.vllm_entry", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without stray vllm-ling switches, plus CPU settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    env.pop("VLLM_PLUGINS", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM the whole process group, SIGKILL after ``timeout``; return the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        return self.proc.returncode


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


def start_server(cmd: list[str], env: dict[str, str], log_path: Path, port: int,
                 wait: bool = True, timeout: float = STARTUP_TIMEOUT_S) -> Server:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    if wait:
        wait_healthy(server, timeout)
    return server


def wait_healthy(server: Server, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-6000:]}")
        try:
            if requests.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"no /health within {timeout}s:\n{server.log()[-6000:]}")
        time.sleep(1)


def serve_cpu(model: Path, log_path: Path, extra_args: list[str] | None = None,
              env: dict[str, str] | None = None, wait: bool = True) -> Server:
    """``vllm serve MODEL`` (vLLM's own CLI, plugin auto-loaded) on a free localhost port."""
    port = free_port()
    cmd = VLLM_SERVE + [str(model), "--host", "127.0.0.1", "--port", str(port),
                        "--served-model-name", "tiny"] + CPU_SERVE_ARGS + (extra_args or [])
    return start_server(cmd, cpu_env(env), log_path, port, wait=wait)


def scrape(base_url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    out = {}
    for line in requests.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out
