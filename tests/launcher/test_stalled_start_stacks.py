"""A local server that never becomes healthy is stopped with its processes' Python stacks in its log
(a lease's stalled start said nothing for minutes: the full-size DSpark start of lease 2026-12-06d,
the tiny servers behind a 420 s pytest limit), and nothing of it is left running."""

from __future__ import annotations

import sys

import pytest

from vllm_ling.launcher.local_server import ServerError, free_port, start_server
from vllm_ling.processes import marked

# the API server and its engine child, each stuck in a function its stack names
SERVER = """
import subprocess, sys, time
CHILD = "import time\\ndef engine_stuck_in_compile():\\n    time.sleep(600)\\nengine_stuck_in_compile()\\n"
def api_server_waiting_for_engine():
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    print("started engine", child.pid, flush=True)
    time.sleep(600)
api_server_waiting_for_engine()
"""


def test_a_stalled_start_leaves_its_stacks_in_the_log_and_no_process(tmp_path):
    log = tmp_path / "server.log"
    port = free_port()
    with pytest.raises(ServerError, match="not healthy after 3 s") as info:
        start_server([sys.executable, "-c", SERVER], {"PATH": "/usr/bin:/bin"}, log, port, timeout=3)
    text = log.read_text()
    assert "started engine" in text
    # faulthandler's dump of each process: the leader's and its child's own frames
    assert "in api_server_waiting_for_engine" in text, text
    assert "in engine_stuck_in_compile" in text, text
    assert "in api_server_waiting_for_engine" in str(info.value)  # the error's log tail ends with the leader's
    child_pid = int(next(line for line in text.splitlines() if line.startswith("started engine")).split()[-1])
    assert not _alive(child_pid)


def test_the_callers_faulthandler_choice_is_kept(tmp_path):
    """PYTHONFAULTHANDLER is a default: a caller's own value wins."""
    log = tmp_path / "server.log"
    script = "import os\nprint('fh=' + os.environ.get('PYTHONFAULTHANDLER', 'unset'), flush=True)\n"
    for env, expected in (({}, "fh=1"), ({"PYTHONFAULTHANDLER": ""}, "fh=")):
        server = start_server([sys.executable, "-c", script], env, log, free_port(), wait=False)
        server.proc.wait(timeout=60)
        server.stop()
        assert log.read_text().strip() == expected
        assert marked(server.marker) == []


def _alive(pid: int) -> bool:
    from pathlib import Path

    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_the_lease_script_takes_the_stacks_of_a_stalled_test_server(tmp_path):
    """scripts/h200_session.sh's abort_stalled, run as the lease runs it when a tiny end-to-end test
    reaches its time limit: the servers started from that test's folder dump their stacks; another
    server is left alone."""
    import re
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = (repo / "scripts" / "h200_session.sh").read_text()
    function = re.search(r"^abort_stalled\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    stalled_dir, other_dir = tmp_path / "pt-cuts-e2e" / "t0", tmp_path / "pt-dspark" / "t0"
    servers = []
    for folder in (stalled_dir, other_dir):
        folder.mkdir(parents=True)
        # the launcher's command line names its model under the test's folder, as `vllm-ling serve` does
        servers.append(start_server([sys.executable, "-c", SERVER, str(folder / "tiny-model")],
                                    {"PATH": "/usr/bin:/bin"}, folder / "server.log", free_port(), wait=False))
    try:
        for server, folder in zip(servers, (stalled_dir, other_dir)):
            _wait_for(lambda: "started engine" in (folder / "server.log").read_text())
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo)}
        subprocess.run(["bash", "-c", f"{function}\nabort_stalled '{tmp_path / 'pt-cuts-e2e'}/'"],
                       env={**env, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}, check=True, timeout=120)
        stalled_log = (stalled_dir / "server.log").read_text()
        assert "in engine_stuck_in_compile" in stalled_log and "in api_server_waiting_for_engine" in stalled_log
        assert marked(servers[0].marker) == []
        assert servers[1].proc.poll() is None and "Fatal Python error" not in (other_dir / "server.log").read_text()
    finally:
        for server in servers:
            server.stop(timeout=5)  # the whole group: the engine child too


def _wait_for(condition, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_start_whose_log_stops_growing_is_stopped_early_with_its_stacks(tmp_path):
    """``stall_s``: the log grows for a while (a start making progress), then stays silent: stopped
    after ``stall_s`` of silence, long before ``timeout``, with the stacks of where it stalled."""
    import time

    talker = ("import sys, time\n"
              "def loading():\n    for i in range(6):\n        print('step', i, flush=True); time.sleep(0.5)\n"
              "def compiling_forever():\n    time.sleep(600)\n"
              "loading(); compiling_forever()\n")
    log = tmp_path / "server.log"
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="log silent for 2 s"):
        start_server([sys.executable, "-c", talker], {"PATH": "/usr/bin:/bin"}, log, free_port(), timeout=120,
                     stall_s=2)
    waited = time.monotonic() - t0
    text = log.read_text()
    assert "step 5" in text and "in compiling_forever" in text, text
    assert 4.5 < waited < 60, waited  # after the 3 s of steps and 2 s of silence; not the 120 s timeout
