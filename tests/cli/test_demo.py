"""`make demo`'s waiting: the time it announces is computed for the machine it runs on, and it
says what the server is doing while it waits (issue 46: it announced "2-3 minutes on 2 CPU
cores" and was healthy after 46 s)."""

from __future__ import annotations

import sys

from vllm_ling.cli.demo import IDLE_START_S, last_step, start_estimate
from vllm_ling.launcher.local_server import free_port, start_server, wait_healthy


def test_the_estimate_follows_the_cores_and_what_else_runs_on_them():
    idle = start_estimate("cpu", cores=2, load=0.0)
    assert idle == f"about {IDLE_START_S['cpu']:.0f} s here: 2 cores, load 0.0"
    busy = start_estimate("cpu", cores=2, load=12.0)  # the README's shared machine (3.6 min measured)
    assert busy.startswith("about 5 minutes here: 2 cores, load 12.0"), busy
    assert start_estimate("cpu", cores=16, load=6.0).startswith(f"about {IDLE_START_S['cpu']:.0f} s")
    assert "2-3 minutes" not in start_estimate("cpu")  # this machine's, whatever it is


def test_the_wait_says_what_the_server_is_doing(tmp_path):
    port = free_port()
    server_code = ("import http.server, time, sys\n"
                   "print('(APIServer pid=1) INFO 12-06 03:55:45 [model.py:733] Resolved architecture: X', flush=True)\n"
                   "time.sleep(1.5)\n"
                   "class H(http.server.BaseHTTPRequestHandler):\n"
                   "    def do_GET(self):\n"
                   "        self.send_response(200); self.end_headers()\n"
                   "    def log_message(self, *a): pass\n"
                   f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    log = tmp_path / "server.log"
    server = start_server([sys.executable, "-c", server_code], {}, log, port, wait=False)
    said = []
    try:
        wait_healthy(server, timeout=60, progress=lambda waited: said.append((waited, last_step(log))),
                     every_s=0.5)
    finally:
        server.stop(timeout=5)
    assert said and said[0][0] >= 0.5
    assert said[-1][1] == "Resolved architecture: X"
    assert last_step(tmp_path / "missing.log") == "(nothing logged yet)"
