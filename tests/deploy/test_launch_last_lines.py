"""`vllm-ling serve`'s own behaviour around a server, with vLLM replaced by a stand-in that does
what vLLM's API server does at the edges the launcher sees (tests/deploy/fake_vllm.py): the smoke
check's verdict, a clean stop without third-party leak reports, vLLM's refusal of an unknown flag,
and in each case the launcher's last line on a line of its own (issue 46). The real servers' side is
in test_entrypoint_server.py and test_serve_lifecycle.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_ling.models.names import TINY_WEIGHTS_KEY
from vllm_ling.launcher.local_server import free_port

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")
LAUNCH = ("import sys\n"
          "from vllm_ling.cli import serve\n"
          "serve.vllm_command = lambda: ['fake-vllm']\n"
          f"serve.vllm_launcher = lambda program: [sys.executable, {str(FAKE_VLLM)!r}]\n"
          "sys.exit(serve.serve_main(sys.argv[1:]))\n")


def _soft_open_files(soft: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


class Launch:
    def __init__(self, tmp_path: Path, model: Path, *argv: str, env: dict[str, str] | None = None,
                 open_files: int | None = None):
        self.port = free_port()
        self.err_path = tmp_path / "launcher.err"
        base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
        base.update({"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                     "VLLM_LING_REPORT_PATH": str(tmp_path / "report.json"), **(env or {})})
        self._err = open(self.err_path, "w")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(model), "--device", "cpu", "--host",
                                      "127.0.0.1", "--port", str(self.port), *argv], env=base,
                                     stdout=subprocess.DEVNULL, stderr=self._err, start_new_session=True,
                                     preexec_fn=None if open_files is None else lambda: _soft_open_files(open_files))

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert self.proc.poll() is None, self.stderr()[-3000:]
            assert time.monotonic() < deadline, self.stderr()[-3000:]
            time.sleep(0.2)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self._err.close()

    def last_line(self) -> str:
        return self.stderr().rstrip("\n").split("\n")[-1]


def test_a_random_tiny_checkpoint_serves_with_a_note_instead_of_a_refusal(tmp_path, tiny_checkpoint):
    """3cb2263 stopped it with exit 3 after the smoke check: 'accept length 1.00 ... (is it
    sharing the target's head module?)', the wrong reason for random weights."""
    assert json.loads((tiny_checkpoint / "config.json").read_text())[TINY_WEIGHTS_KEY] == "random"
    launch = Launch(tmp_path, tiny_checkpoint, env={"FAKE_ACCEPTED": "0"})
    launch.wait_for("smoke check: accept length 1.00 over 10 drafts, as expected here: ")
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert launch.wait() == 0, launch.stderr()[-3000:]
    err = launch.stderr()
    assert "is a random-weight tiny checkpoint (vllm-ling make-tiny without --agreeing or --script)" in err
    assert "FAILED" not in err and "refus" not in err


def test_a_failed_smoke_check_is_the_last_line(tmp_path, tiny_checkpoint):
    """A checkpoint whose draft should be accepted (no random-weights mark) and is not: exit 3, and
    the reason, with what to do, is the launcher's last line, after vLLM's shutdown output."""
    unmarked = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, unmarked)
    config = json.loads((unmarked / "config.json").read_text())
    del config[TINY_WEIGHTS_KEY]
    (unmarked / "config.json").write_text(json.dumps(config))
    launch = Launch(tmp_path, unmarked, env={"FAKE_ACCEPTED": "0"})
    assert launch.wait() == 3, launch.stderr()[-3000:]
    assert launch.last_line() == (
        "vllm-ling serve: error: smoke check FAILED: accept length 1.00 over 10 drafts is below "
        "VLLM_LING_SMOKE_MIN_ACCEPT=1.5: the NEXTN draft does not predict the target (a draft that does not "
        "share the target's head module, or draft weights that do not belong to these target weights). "
        "VLLM_LING_VERIFY=warn serves anyway; VLLM_LING_SMOKE=0 skips the check"), launch.stderr()[-2000:]


def test_make_tiny_marks_how_its_weights_were_made(tmp_path):
    from vllm_ling.models.tiny_checkpoint import make_tiny

    made = make_tiny(tmp_path / "agree", agreeing=True)
    assert json.loads((made / "config.json").read_text())[TINY_WEIGHTS_KEY] == "agreeing"


def test_the_note_is_for_random_weights_only(tmp_path, tiny_checkpoint):
    from vllm_ling.launcher.smoke import SmokeResult, judged

    failed = SmokeResult(1.0, 63, 1.5, False)
    noted = judged(failed, tiny_checkpoint)
    assert noted.passed is None and "random-weight tiny checkpoint" in noted.note
    assert noted.as_report()["note"] == noted.note and noted.as_report()["accept_length"] == 1.0
    (tmp_path / "config.json").write_text(json.dumps({TINY_WEIGHTS_KEY: "agreeing"}))
    assert judged(failed, tmp_path) == failed  # an agreeing draft must be accepted
    assert judged(failed, tmp_path / "missing") == failed
    passed = SmokeResult(4.0, 16, 1.5, True)
    assert judged(passed, tiny_checkpoint) == passed


def test_a_clean_stop_ends_with_our_line_and_no_leak_reports(tmp_path, tiny_checkpoint):
    """3cb2263 ended every stop with ~30 lines of nanobind's report, its last line glued to ours:
    'See https://nanobind.readthedocs.io/en/latest/refleaks.htmlvllm-ling serve: vLLM stopped ...'."""
    launch = Launch(tmp_path, tiny_checkpoint, env={"VLLM_LING_SMOKE": "0"})
    launch.wait_for("vllm-ling serve: run ")
    time.sleep(2)  # the stand-in listens
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert launch.wait() == 0
    err = launch.stderr()
    assert launch.last_line() == "vllm-ling serve: vLLM stopped (exit code 0) after SIGTERM", err[-2000:]
    assert "nanobind" not in err and "leaked semaphore" not in err, err[-2000:]


def test_the_leak_reports_are_kept_at_debug(tmp_path, tiny_checkpoint):
    launch = Launch(tmp_path, tiny_checkpoint, env={"VLLM_LING_SMOKE": "0", "VLLM_LOGGING_LEVEL": "DEBUG"})
    launch.wait_for("vllm-ling serve: run ")
    time.sleep(2)
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert launch.wait() == 0
    err = launch.stderr()
    assert "nanobind: leaked 514 functions!" in err and "leaked semaphore objects" in err
    assert "See https://nanobind.readthedocs.io/en/latest/refleaks.html\n" in err  # and ours below it
    assert launch.last_line() == "vllm-ling serve: vLLM stopped (exit code 0) after SIGTERM"


def test_an_unknown_vllm_side_flag_ends_with_what_to_fix(tmp_path, tiny_checkpoint):
    """3cb2263's last line was `vLLM exited with code 2`, after vLLM's usage text."""
    launch = Launch(tmp_path, tiny_checkpoint, "--ling-moe-backend", "vllm", env={"VLLM_LING_SMOKE": "0"})
    assert launch.wait() == 2
    assert launch.last_line() == (
        "vllm-ling serve: error: vllm serve refused the command line: unrecognized arguments: "
        "--ling-moe-backend vllm; --ling-moe-backend: did you mean --moe-backend? "
        "(`vllm-ling serve --help` lists its own flags; `vllm serve --help` vLLM's)"), launch.stderr()[-2000:]


def test_the_relay_drops_only_the_exit_reports(tmp_path):
    """Unit: the nanobind block (also when another process's line is glued to its last line) and
    the resource tracker's two lines go; everything else passes, each line ending on a newline."""
    from .fake_vllm import NANOBIND, SEMAPHORE

    text = ("Traceback (most recent call last):\n  File x\nValueError: boom\n" + SEMAPHORE + NANOBIND
            + "(EngineCore pid=2) INFO shutting down\n - an ordinary dash line\nvllm: error: bad flag")
    out, relay = _relay(text, refused=None)
    assert out == ("Traceback (most recent call last):\n  File x\nValueError: boom\n"
                                       "(EngineCore pid=2) INFO shutting down\n - an ordinary dash line\n"
                                       "vllm: error: bad flag\n")
    assert relay.last_error == "vllm: error: bad flag" and relay.dropped == 12


def test_vllm_starts_with_the_open_files_limit_raised(tmp_path, tiny_checkpoint):
    """vLLM's 'Found ulimit of N and failed to automatically increase' comes when it cannot get 65535
    open files: the launcher raises the limit before vLLM starts, as far as this machine allows (the
    hard limit too where the user may), so vLLM inherits it."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    launch = Launch(tmp_path, tiny_checkpoint, env={"VLLM_LING_SMOKE": "0"}, open_files=256)
    launch.wait_for("fake-vllm: open files soft limit ")
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert launch.wait() == 0
    got = int(launch.stderr().split("fake-vllm: open files soft limit ")[1].split()[0])
    assert got >= min(65535, hard) and got > 256, got


def _relay(text: str, refused: bool | None) -> tuple[str, object]:
    """What the relay forwards of ``text`` (``refused`` None: the relay's own default)."""
    import io

    from vllm_ling.launcher.stderr_relay import StderrRelay

    kwargs = {} if refused is None else {"refused": lambda: refused}
    relay = StderrRelay(io.BytesIO(text.encode()), **kwargs)
    out = io.BytesIO()

    class Err:
        buffer = out

    real, sys.stderr = sys.stderr, Err()
    try:
        relay._run()
    finally:
        sys.stderr = real
    return out.getvalue().decode(), relay


ENGINE_CORE_FAILED = ("Process EngineCore:\nTraceback (most recent call last):\n"
                      '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap\n'
                      "    self.run()\n"
                      "RuntimeError: Engine core initialization failed. See root cause above.\n"
                      "\nThe above exception was the direct cause of the following exception:\n\n"
                      "Traceback (most recent call last):\n  File \"x\", line 1\n"
                      "pydantic_core.ValidationError: 1 validation error\n  Value error, more\n")


def test_after_a_refusal_the_engine_cores_traceback_is_not_shown():
    """The one multiprocessing traceback ("Process EngineCore:") that preceded the strict refusal on
    3cb2263: printed by multiprocessing, outside vLLM's loggers, as a consequence of the refusal."""
    text = "(APIServer pid=1) INFO before\n" + ENGINE_CORE_FAILED + "vllm-ling: error: refused\n"
    shown, relay = _relay(text, refused=True)
    assert shown == "(APIServer pid=1) INFO before\nvllm-ling: error: refused\n"
    kept, _ = _relay(text, refused=False)  # no refusal: a traceback is news, shown whole
    assert kept == text
    process_line, _ = _relay("Process list: 3\nnext\n", refused=True)
    assert process_line == "Process list: 3\nnext\n"
