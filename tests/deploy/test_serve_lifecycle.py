"""`vllm-ling serve` when vLLM's engine dies under load (real vLLM-CPU server, tiny
checkpoint): the launcher exits non-zero within seconds and leaves no process behind, so a
restart policy that acts on failure brings the server back. (The SIGTERM drain is the last
test of test_entrypoint_server.py, on that module's server.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

pytestmark = pytest.mark.slow


def test_engine_death_under_load_exits_non_zero_and_leaves_nothing(tmp_path):
    pytest.importorskip("vllm")
    from vllm_ling.cli.serve import EXIT_SERVER_DIED
    from vllm_ling.launcher.local_server import cpu_env, free_port, start_server
    from vllm_ling.launcher.supervisor import descendants

    model = tmp_path / "tiny"
    made = subprocess.run([sys.executable, "-m", "vllm_ling.cli.main", "make-tiny", str(model),
                           "--all-mla", "--agreeing"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    port = free_port()
    env = cpu_env({"VLLM_LING_PORT": str(port), "VLLM_LING_HOST": "127.0.0.1", "VLLM_LING_SMOKE": "0",
                   "XDG_CACHE_HOME": str(tmp_path / "cache")})
    running = start_server([sys.executable, "-m", "vllm_ling.cli.main", "serve", str(model),
                            "--device", "cpu", "--max-num-seqs", "8"],
                           env, tmp_path / "server.log", port, timeout=600)
    try:
        outcomes: list[str] = []

        def stream(i: int) -> None:
            try:
                with requests.post(running.base_url + "/v1/completions",
                                   json={"model": "tiny", "prompt": f"client {i}", "max_tokens": 300,
                                         "ignore_eos": True, "stream": True}, stream=True,
                                   timeout=60) as response:
                    lines = [line.decode() for line in response.iter_lines() if line]
                outcomes.append(lines[-1] if lines else "empty")
            except requests.RequestException as exc:
                outcomes.append(type(exc).__name__)

        clients = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
        for client in clients:
            client.start()
        time.sleep(3)
        below = descendants(running.proc.pid)
        titles = {pid: open(f"/proc/{pid}/cmdline", "rb").read() for pid in below}
        engines = [pid for pid, title in titles.items() if title.startswith(b"VLLM::EngineCore")]
        assert len(engines) == 1, titles
        start = time.monotonic()
        os.kill(engines[0], signal.SIGKILL)
        code = running.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        log = running.log()
        assert code == EXIT_SERVER_DIED, log[-3000:]
        assert elapsed < 10, elapsed
        assert "exited by itself" in log
        assert [p for p in below if os.path.exists(f"/proc/{p}")] == []
        for client in clients:
            client.join(timeout=60)
        assert len(outcomes) == 8  # every client got an answer or an error; none hangs
    finally:
        running.stop()
