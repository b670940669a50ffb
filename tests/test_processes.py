"""A server's processes are known by the marker in their environment, not by a word in their
command line (issue 46: in a clone named ``vllm-ling`` the two-node Ray test counted Ray's own
``python -m ray.util.client.server`` as a leftover vLLM process, because its interpreter's path
held "vllm")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_ling.processes import SERVER_MARKER_ENV, marked, marker_of, new_marker, owner_pid

SLEEPER = "import time\ntime.sleep(60)\n"


def _start_from(clone: Path, name: str, env: dict[str, str]) -> subprocess.Popen:
    script = clone / name
    script.write_text(SLEEPER)
    return subprocess.Popen([sys.executable, str(script)], env=env)


def _wait_started(*procs: subprocess.Popen) -> None:
    """Until each child has exec'd (its environ is the new one, not the fork's)."""
    deadline = time.monotonic() + 30
    for proc in procs:
        while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] != sys.executable.encode():
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_leftover_check_counts_the_marked_server_only_in_a_clone_named_vllm(tmp_path):
    """What the two-node test asks after the worker node is lost, from a checkout whose path holds
    "vllm": Ray's daemons run from there too, and only the server's processes may count."""
    clone = tmp_path / "vllm-ling"  # the default clone directory name
    clone.mkdir()
    base = {k: v for k, v in os.environ.items() if k != SERVER_MARKER_ENV}
    marker = new_marker()
    ray_daemon = _start_from(clone, "ray_util_client_server.py", base)
    server = _start_from(clone, "vllm_api_server.py", {**base, SERVER_MARKER_ENV: marker})
    try:
        _wait_started(ray_daemon, server)
        for proc in (ray_daemon, server):  # both command lines name the clone: a word cannot tell them apart
            assert b"vllm" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert marked(among=[ray_daemon.pid, server.pid]) == [server.pid]
        assert marked(marker) == [server.pid]
        assert marker_of(ray_daemon.pid) is None and marker_of(server.pid) == marker
    finally:
        for proc in (ray_daemon, server):
            proc.kill()
            proc.wait()
    assert marked(marker) == []  # gone once stopped


def test_a_marker_names_its_owner():
    assert owner_pid(new_marker()) == os.getpid()
    assert owner_pid(new_marker(owner=123)) == 123
    assert owner_pid(None) is None and owner_pid("not-ours") is None


def test_the_supervisor_and_the_local_servers_mark_their_server(tmp_path, monkeypatch):
    """vllm-ling serve's supervisor and the local test/demo servers put a marker into the
    environment of the process they start (a harness's marker is kept by the supervisor)."""
    from vllm_ling.launcher import supervisor as module
    from vllm_ling.launcher.local_server import start_server
    from vllm_ling.launcher.supervisor import Supervisor

    # not in this test process: a subreaper's orphans would become its zombies, and the handlers
    # would take pytest's SIGINT
    monkeypatch.setattr(module, "become_subreaper", lambda: False)
    monkeypatch.setattr(Supervisor, "install_handlers", lambda self: None)

    env = {k: v for k, v in os.environ.items() if k != SERVER_MARKER_ENV}
    supervisor = Supervisor([sys.executable, "-c", SLEEPER], env, shutdown_timeout=1)
    supervisor.start()
    try:
        _wait_started(supervisor.child)
        assert owner_pid(marker_of(supervisor.child.pid)) == os.getpid()
    finally:
        supervisor.child.kill()
        supervisor.child.wait()
    kept = Supervisor([sys.executable, "-c", SLEEPER], {**env, SERVER_MARKER_ENV: "harness"}, shutdown_timeout=1)
    kept.start()
    try:
        _wait_started(kept.child)
        assert marker_of(kept.child.pid) == "harness"
    finally:
        kept.child.kill()
        kept.child.wait()
    server = start_server([sys.executable, "-c", SLEEPER], env, tmp_path / "log", port=1, wait=False)
    try:
        _wait_started(server.proc)
        assert server.marker and marked(server.marker) == [server.proc.pid]
    finally:
        server.stop(timeout=5)


def test_plain_vllm_serve_marks_its_own_children(monkeypatch):
    """refusal.ensure_file, in `vllm serve`'s own process: its children inherit a marker naming it."""
    from vllm_ling import refusal

    monkeypatch.delenv(SERVER_MARKER_ENV, raising=False)
    monkeypatch.setenv(refusal.REFUSAL_FILE_ENV, "/nonexistent/already-named")
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "model"])
    refusal.ensure_file()
    assert owner_pid(os.environ[SERVER_MARKER_ENV]) == os.getpid()


def test_a_report_is_this_servers_by_marker_not_by_a_parent_named_vllm(tmp_path):
    """ReportReader's 'not before' is this server's start: an unmarked parent whose command line
    holds "vllm" (a launcher script in a clone named vllm-ling) started earlier does not count;
    the process that owns the marker does."""
    clone = tmp_path / "vllm-ling"
    clone.mkdir()
    child = ("import os, time, psutil\n"
             "from vllm_ling.runtime.report import _server_start_time\n"
             "print(round(_server_start_time() - psutil.Process().create_time(), 2))\n")
    (clone / "child.py").write_text(child)
    parent = clone / "launcher.py"
    parent.write_text("import subprocess, sys, time\ntime.sleep(2)\n"
                      f"sys.exit(subprocess.call([sys.executable, {str(clone / 'child.py')!r}]))\n")
    env = {k: v for k, v in os.environ.items() if k != SERVER_MARKER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    unmarked = subprocess.run([sys.executable, str(parent)], env=env, capture_output=True, text=True, timeout=120)
    assert unmarked.returncode == 0, unmarked.stderr
    assert float(unmarked.stdout) == 0.0  # its own start: the parent is not this server's
    # the marker names the parent as its owner: the server started with the parent
    script = ("import os, subprocess, sys, time\n"
              f"os.environ[{SERVER_MARKER_ENV!r}] = f'{{os.getpid()}}-abc'\n"
              "time.sleep(2)\n"
              f"sys.exit(subprocess.call([sys.executable, {str(clone / 'child.py')!r}]))\n")
    parent.write_text(script)
    owned = subprocess.run([sys.executable, str(parent)], env=env, capture_output=True, text=True, timeout=120)
    assert owned.returncode == 0, owned.stderr
    assert float(owned.stdout) <= -1.5, owned.stdout


def test_no_check_finds_our_processes_by_a_word_in_their_command_line():
    """The scripts and tests find a server's processes by its marker or its process tree."""
    root = Path(__file__).resolve().parents[1]
    files = [p for d in ("tests", "scripts", "vllm_ling", "docker") for p in (root / d).rglob("*")
             if p.suffix in (".py", ".sh") and p.is_file() and p.name != Path(__file__).name]
    bad = []
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            low = line.lower()
            if ("pkill" in low or "pgrep" in low) and "vllm" in low:
                bad.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
            if "cmdline" in low and "vllm" in low:
                bad.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
            if '"vllm" in c' in low or '"vllm" not in " ".join' in low:
                bad.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert files and not bad, bad
