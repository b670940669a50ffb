"""scripts/record_verified.py: the verified-pairs record (verified.csv) that the suites append to."""

from __future__ import annotations

import csv
import importlib.util
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_verified", REPO / "scripts" / "record_verified.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)


def test_cpu_isa_names_the_path_vllm_cpu_takes():
    assert R.cpu_isa({"avx2", "avx512f", "amx_bf16"}) == "amx_bf16"
    assert R.cpu_isa({"avx2", "avx512f"}) == "avx512"
    assert R.cpu_isa({"avx2"}) == "avx2"
    assert R.cpu_isa(set()) == "other"


def test_rows_append_under_one_header(tmp_path):
    f = tmp_path / "verified.csv"
    R.main(["--suite", "cpu", "--result", "3 passed in 1.00s", "--file", str(f)])
    R.main(["--suite", "gpu", "--result", "1 failed, 2 passed in 2.00s", "--file", str(f)])
    rows = list(csv.DictReader(f.open()))
    assert [r["suite"] for r in rows] == ["cpu", "gpu"]
    assert rows[1]["result"] == "1 failed, 2 passed in 2.00s"
    assert list(rows[0]) == R.COLUMNS and rows[0]["vllm"] != "absent" and rows[0]["torch"] != "absent"
    assert f.read_text().count("date,vllm_ling_commit") == 1


def test_the_committed_record_has_the_columns():
    with (REPO / "verified.csv").open() as f:
        assert next(csv.reader(f)) == R.COLUMNS


SIDE = "tests/deploy/test_docker_image.py"  # one of run_tests.sh's side process's files (the whole suite only)


def _fake_clone(tmp_path: Path, summary: str, side_summary: str = "2 passed, 1 skipped in 5.00s",
                side_rc: int = 0) -> Path:
    """A git checkout holding run_tests.sh, record_verified.py and a committed verified.csv, whose
    `.venv/bin/python -m pytest` prints ``summary``, or ``side_summary`` (exit ``side_rc``) when it runs the
    side process's tests (the suite itself is not what is tested)."""
    import os
    import subprocess
    import sys

    clone = tmp_path / "vllm-ling"
    (clone / "scripts").mkdir(parents=True)
    for name in ("run_tests.sh", "record_verified.py"):
        (clone / "scripts" / name).write_text((REPO / "scripts" / name).read_text())
    (clone / "verified.csv").write_text((REPO / "verified.csv").read_text())
    venv_bin = clone / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1 $2" = "-m pytest" ] && [[ " $* " == *" {SIDE} "* ]]; then echo "=== {side_summary} ==="; '
        f'exit {side_rc}; fi\n'
        f'if [ "$1 $2" = "-m pytest" ]; then echo "=== {summary} ==="; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (venv_bin / "python").chmod(0o755)
    (clone / ".gitignore").write_text(".venv/\n")
    git = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "clone"]):
        subprocess.run(["git", *args], cwd=clone, env=git, check=True, capture_output=True)
    return clone


def _run_tests(clone: Path, **env: str):
    import os
    import subprocess

    base = {k: v for k, v in os.environ.items() if k not in ("VLLM_LING_RECORD_VERIFIED", "CI")}
    return subprocess.run(["bash", "scripts/run_tests.sh"], cwd=clone, env={**base, **env},
                          capture_output=True, text=True, timeout=300)


def test_a_test_run_leaves_the_checkout_clean_unless_a_record_is_asked_for(tmp_path):
    """Issue 46: `make test` appended a row to the tracked verified.csv on every run."""
    import subprocess

    clone = _fake_clone(tmp_path, "3 passed in 1.00s")
    done = _run_tests(clone)
    assert done.returncode == 0, done.stderr
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert status == "", status
    asked = _run_tests(clone, VLLM_LING_RECORD_VERIFIED="1")
    assert asked.returncode == 0, asked.stderr
    rows = list(csv.DictReader((clone / "verified.csv").open()))
    # the whole suite: the side process's counts added, the wall time
    assert rows[-1]["suite"] == "cpu" and re.fullmatch(r"5 passed, 1 skipped in \d+s \(0:\d\d, two processes\)",
                                                       rows[-1]["result"]), rows[-1]
    one = _run_tests(clone, VLLM_LING_RECORD_VERIFIED="1", VLLM_LING_TESTS_SIDE="0")
    assert one.returncode == 0, one.stderr
    assert list(csv.DictReader((clone / "verified.csv").open()))[-1]["result"] == "3 passed in 1.00s"


def test_a_failing_side_process_fails_the_run_and_its_record(tmp_path):
    clone = _fake_clone(tmp_path, "3 passed in 1.00s", side_summary="1 failed, 1 passed in 2.00s", side_rc=1)
    done = _run_tests(clone, VLLM_LING_RECORD_VERIFIED="1")
    beside = re.search(r"^==== (.*), run beside the rest:$", done.stdout, re.M)
    assert done.returncode == 1 and beside and SIDE in beside.group(1).split(), done.stdout[-2000:]
    assert list(csv.DictReader((clone / "verified.csv").open()))[-1]["result"].startswith("1 failed, 4 passed in ")
    # a run of some tests (a path given) has no side process
    some = subprocess.run(["bash", "scripts/run_tests.sh", "scripts"], cwd=clone, capture_output=True, text=True,
                          timeout=300)
    assert some.returncode == 0 and "run beside the rest" not in some.stdout, some.stdout


def test_a_test_run_that_changes_the_checkout_says_so_and_fails_under_ci(tmp_path):
    clone = _fake_clone(tmp_path, "3 passed in 1.00s")
    python = clone / ".venv" / "bin" / "python"
    python.write_text(python.read_text().replace('then echo', 'then echo x > stray.txt; echo'))
    local = _run_tests(clone)
    assert local.returncode == 0 and "?? stray.txt" in local.stderr, local.stderr
    (clone / "stray.txt").unlink()
    ci = _run_tests(clone, CI="true")
    assert ci.returncode == 1 and "the test run changed the checkout" in ci.stderr, ci.stderr
