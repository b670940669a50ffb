"""The Docker engine the container tests start is stopped afterwards (issue 46: `make test` left
`dockerd` and `containerd` running): scripts/start_docker.sh records the engine it starts,
scripts/stop_docker.sh stops that one and what it started (its containerd), unless
VLLM_LING_KEEP_DOCKER=1, and leaves an engine someone else started alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ._tools import REPO

pytestmark = pytest.mark.docker


def _script(name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / name)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env})


def _below(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]]


@pytest.fixture
def no_engine_yet(tmp_path):
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        pytest.skip("needs root and dockerd (scripts/install_test_tools.sh)")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0:
        pytest.skip("a Docker engine already runs here: starting one is not what this machine can show")
    return {"VLLM_LING_DOCKERD_PIDFILE": str(tmp_path / "dockerd.pid"),
            "VLLM_LING_DOCKERD_LOG": str(tmp_path / "dockerd.log")}


def test_the_engine_the_tests_start_is_stopped_with_what_it_started(no_engine_yet):
    env = no_engine_yet
    started = _script("start_docker.sh", env)
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("started dockerd (pid "), started.stdout
    pid = int(Path(env["VLLM_LING_DOCKERD_PIDFILE"]).read_text())
    engine = [pid] + _below(pid)
    assert len(engine) >= 2, engine  # dockerd and the containerd it runs
    # told to keep it: it stays
    kept = _script("stop_docker.sh", {**env, "VLLM_LING_KEEP_DOCKER": "1"})
    assert kept.returncode == 0 and "kept running" in kept.stdout
    assert _alive(engine) == engine
    stopped = _script("stop_docker.sh", env)
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(engine) == [], engine
    assert subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0
    # nothing recorded any more: a second stop does nothing
    assert _script("stop_docker.sh", env).returncode == 0


def test_an_engine_someone_else_started_is_left_alone(no_engine_yet, tmp_path):
    env = no_engine_yet
    Path(env["VLLM_LING_DOCKERD_PIDFILE"]).write_text(str(os.getpid()))  # a pid that is not a dockerd
    assert _script("stop_docker.sh", env).returncode == 0
    assert Path(f"/proc/{os.getpid()}").exists()
