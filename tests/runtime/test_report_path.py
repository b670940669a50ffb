"""Where the report goes: a per-user default, checked before any weight loads, and written
through a private temporary file (never through a planted symlink)."""

from __future__ import annotations

import os
import stat

import pytest

from vllm_ling.runtime.report import (ReportPathError, check_report_path, default_report_path,
                                      write_report)


def test_default_is_per_user_never_a_shared_tmp_name(tmp_path):
    (tmp_path / "run").mkdir()
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "HOME": str(tmp_path / "home")}
    assert default_report_path("report-1.json", env) == str(tmp_path / "run" / "vllm-ling" / "report-1.json")
    del env["XDG_RUNTIME_DIR"]
    assert default_report_path("report-1.json", env) == str(tmp_path / "cache" / "vllm-ling" / "report-1.json")
    del env["XDG_CACHE_HOME"]
    assert default_report_path("report-1.json", env) == str(tmp_path / "home" / ".cache" / "vllm-ling" / "report-1.json")


@pytest.mark.parametrize("path,problem", [("/proc/x/report.json", "cannot be written"),
                                          ("{tmp}", "is a directory")])
def test_unwritable_path_names_the_variable(tmp_path, path, problem):
    path = path.format(tmp=tmp_path)
    with pytest.raises(ReportPathError) as err:
        check_report_path(path)
    assert f"VLLM_LING_REPORT_PATH={path}: " in str(err.value) and problem in str(err.value)


def test_check_creates_a_private_directory(tmp_path):
    check_report_path(str(tmp_path / "new" / "report.json"))
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert os.listdir(tmp_path / "new") == []  # the probe is gone


def test_write_is_private_and_does_not_follow_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "report.json"
    path.symlink_to(victim)
    write_report({"passed": True}, str(path))
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".report-")] == []


def test_plugin_refuses_a_bad_path_when_it_registers(monkeypatch):
    """In `vllm serve` (no launcher) the plugin's register() runs in the API server process
    before any engine starts: the same error, naming the variable."""
    from vllm_ling.plugin import _default_report_path

    monkeypatch.setenv("VLLM_LING_REPORT_PATH", "/proc/x/report.json")
    with pytest.raises(ReportPathError, match="VLLM_LING_REPORT_PATH=/proc/x/report.json"):
        _default_report_path()
