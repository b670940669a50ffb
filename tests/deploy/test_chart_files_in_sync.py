"""deploy/ is the single source of the dashboards and alert rules; the chart's files/ must be
an exact copy (scripts/sync_chart_files.py)."""

from __future__ import annotations

import importlib.util
import shutil

from ._tools import REPO

spec = importlib.util.spec_from_file_location("sync_chart_files", REPO / "scripts" / "sync_chart_files.py")
sync_chart_files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sync_chart_files)


def test_chart_copies_equal_deploy():
    problems = sync_chart_files.differences()
    assert problems == [], "run: python scripts/sync_chart_files.py\n" + "\n".join(problems)
    assert sync_chart_files.expected_copies(), "nothing to sync: deploy/ lost its files"


def test_check_detects_edits_missing_and_stale_copies(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "deploy", repo / "deploy")
    chart_files = repo / "helm" / "vllm-ling" / "files"
    assert sync_chart_files.sync(repo, chart_files)  # first sync writes everything
    assert sync_chart_files.differences(repo, chart_files) == []

    alerts = repo / "deploy" / "prometheus" / "alerts.yml"
    alerts.write_text(alerts.read_text() + "\n# edited\n")
    (chart_files / "dashboards" / "old.json").write_text("{}")
    dashboard = next((chart_files / "dashboards").glob("vllm-ling*.json"))
    dashboard.unlink()
    problems = "\n".join(sync_chart_files.differences(repo, chart_files))
    assert "prometheus/alerts.yml differs" in problems
    assert "stale helm/vllm-ling/files/dashboards/old.json" in problems
    assert f"missing helm/vllm-ling/files/dashboards/{dashboard.name}" in problems

    sync_chart_files.sync(repo, chart_files)
    assert sync_chart_files.differences(repo, chart_files) == []
