"""The launcher's supervisor against stand-in servers (small Python processes): a stop signal
is forwarded and vLLM's code passed on, a server that exits by itself is a failure, and
nothing of its process tree is left, including orphans that escaped its process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_ling.launcher.supervisor import EXIT_SERVER_DIED

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process tree")

# Runs the supervisor over `python -c SERVER` and prints its exit code.
RUNNER = textwrap.dedent("""
    import os, sys
    from vllm_ling.launcher.supervisor import Supervisor
    sup = Supervisor([sys.executable, "-c", sys.argv[1]], os.environ, shutdown_timeout=float(sys.argv[2]),
                     teardown_margin=2.0)
    sup.start()
    print("started", flush=True)
    sys.exit(sup.run())
""")


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: nobody will reap it but it holds nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def supervise(tmp_path: Path, server: str, shutdown_timeout: float = 5.0) -> subprocess.Popen:
    env = {**os.environ, "PIDS": str(tmp_path / "pids")}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, textwrap.dedent(server), str(shutdown_timeout)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def wait_for_pids(tmp_path: Path, count: int, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = tmp_path / "pids"
        if path.exists():
            pids = [int(x) for x in path.read_text().split()]
            if len(pids) >= count:
                return pids
        time.sleep(0.05)
    raise AssertionError(f"stand-in server did not write {count} pids")


# A server with one worker in its group and one that escaped into its own session (as a
# double fork would); both ignore SIGTERM, so only a SIGKILL removes them.
TREE = """
    import os, signal, subprocess, sys, time
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    worker = subprocess.Popen([sys.executable, "-c", stubborn])
    escaped = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
    with open(os.environ["PIDS"], "w") as f:
        f.write(f"{os.getpid()} {worker.pid} {escaped.pid}")
"""


def test_sigterm_is_forwarded_and_the_servers_code_passed_on(tmp_path):
    server = """
        import os, signal, sys, time
        def drain(*_):
            time.sleep(0.5)  # finishing in-flight requests
            sys.exit(0)
        signal.signal(signal.SIGTERM, drain)
        open(os.environ["PIDS"], "w").write(str(os.getpid()))
        time.sleep(300)
    """
    proc = supervise(tmp_path, server)
    [server_pid] = wait_for_pids(tmp_path, 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, proc.stderr.read()
    assert "received SIGTERM" in proc.stderr.read()
    assert not alive(server_pid)


def test_server_exiting_by_itself_is_a_failure_and_its_tree_is_removed(tmp_path):
    """vLLM's API server exits 0 when its EngineCore dies: the launcher must not."""
    proc = supervise(tmp_path, TREE + "\n    time.sleep(0.5)\n    sys.exit(0)\n")
    pids = wait_for_pids(tmp_path, 3)
    assert proc.wait(timeout=30) == EXIT_SERVER_DIED
    assert "exited by itself" in proc.stderr.read()
    assert [p for p in pids if alive(p)] == []


def test_nonzero_exit_is_passed_on(tmp_path):
    proc = supervise(tmp_path, "import sys; sys.exit(7)")
    assert proc.wait(timeout=20) == 7


def test_server_that_ignores_the_stop_is_killed_after_the_drain_window(tmp_path):
    server = TREE + "\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(300)\n"
    proc = supervise(tmp_path, server, shutdown_timeout=1.0)
    pids = wait_for_pids(tmp_path, 3)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    assert code == 128 + signal.SIGKILL
    assert time.monotonic() - start < 1.0 + 2.0 + 10  # drain window + margin + cleanup
    assert [p for p in pids if alive(p)] == []


def test_signal_before_the_server_started_is_not_lost(tmp_path):
    """Handlers are installed before vLLM starts: a SIGTERM in that window still stops it."""
    # The signal arrives while the server process is being created.
    runner = RUNNER.replace("sup.start()\n", textwrap.dedent("""
        import signal, subprocess
        real_popen = subprocess.Popen
        def popen_after_a_signal(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return real_popen(*args, **kwargs)
        subprocess.Popen = popen_after_a_signal
        sup.start()
    """))
    server = "import time; time.sleep(300)"  # dies of the forwarded SIGTERM
    proc = subprocess.run([sys.executable, "-c", runner, textwrap.dedent(server), "5"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "exit code 143" in proc.stderr  # it got the signal


def test_stop_before_start_starts_nothing(tmp_path):
    """A SIGTERM during the launcher's checks (handlers installed first): vLLM never starts."""
    runner = RUNNER.replace("sup.start()\n", "import signal; sup.install_handlers(); "
                            "os.kill(os.getpid(), signal.SIGTERM); assert sup.start() is None\n")
    marker = tmp_path / "started"
    proc = subprocess.run([sys.executable, "-c", runner, f"open({str(marker)!r}, 'w')", "5"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "before vLLM started" in proc.stderr and not marker.exists()


def test_stop_file_is_written_before_the_signal_reaches_the_server(tmp_path):
    """vLLM's processes read it to tell a requested stop from an engine failure (runtime.clean_stop)."""
    runner = RUNNER.replace("teardown_margin=2.0)", "teardown_margin=2.0, stop_file=os.environ['STOP'])")
    server = """
        import os, signal, sys, time
        from vllm_ling.options import STOP_FILE_ENV
        def drain(*_):
            with open(os.environ["PIDS"], "a") as f:
                f.write(" " + (open(os.environ[STOP_FILE_ENV]).read() or "empty"))
            sys.exit(0)
        signal.signal(signal.SIGTERM, drain)
        open(os.environ["PIDS"], "w").write(str(os.getpid()))
        time.sleep(300)
    """
    stop = tmp_path / "stop"
    stop.write_text("")
    from vllm_ling.options import STOP_FILE_ENV

    env = {**os.environ, "PIDS": str(tmp_path / "pids"), "STOP": str(stop), STOP_FILE_ENV: str(stop)}
    proc = subprocess.Popen([sys.executable, "-c", runner, textwrap.dedent(server), "5"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    wait_for_pids(tmp_path, 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, proc.stderr.read()
    assert (tmp_path / "pids").read_text().split()[1] == "SIGTERM"
