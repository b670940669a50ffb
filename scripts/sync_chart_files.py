#!/usr/bin/env python3
"""Copy the monitoring files from deploy/ into the Helm chart, or check that the copies match.

deploy/ is the single source of truth for the Grafana dashboards and the Prometheus alert
rules (docker/compose.yaml mounts it directly). Helm can only read files inside the chart,
so helm/vllm-ling/files/ holds copies; tests/deploy/test_chart_files_in_sync.py fails when
they differ. Run this after editing anything under deploy/:

    python scripts/sync_chart_files.py          # copy
    python scripts/sync_chart_files.py --check  # exit 1 listing the differences
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHART_FILES = REPO / "helm" / "vllm-ling" / "files"

# (source directory under the repo, glob, destination directory under the chart's files/)
MAPPINGS: tuple[tuple[str, str, str], ...] = (
    ("deploy/grafana/dashboards", "*.json", "dashboards"),
    ("deploy/prometheus", "alerts.yml", "prometheus"),
)


def expected_copies(repo: Path = REPO, chart_files: Path = CHART_FILES) -> dict[Path, Path]:
    """Chart copy path -> its source, for every file the chart must carry."""
    copies: dict[Path, Path] = {}
    for src_dir, pattern, dst_dir in MAPPINGS:
        for src in sorted((repo / src_dir).glob(pattern)):
            copies[chart_files / dst_dir / src.name] = src
    return copies


def differences(repo: Path = REPO, chart_files: Path = CHART_FILES) -> list[str]:
    """Human-readable problems: missing, differing or stale chart copies."""
    problems = []
    copies = expected_copies(repo, chart_files)
    for dst, src in copies.items():
        if not dst.exists():
            problems.append(f"missing {dst.relative_to(repo)} (copy of {src.relative_to(repo)})")
        elif dst.read_bytes() != src.read_bytes():
            problems.append(f"{dst.relative_to(repo)} differs from {src.relative_to(repo)}")
    for _, _, dst_dir in MAPPINGS:
        for dst in sorted((chart_files / dst_dir).glob("*")):
            if dst.is_file() and dst not in copies:
                problems.append(f"stale {dst.relative_to(repo)} (no source under deploy/)")
    return problems


def sync(repo: Path = REPO, chart_files: Path = CHART_FILES) -> list[str]:
    """Make the chart copies equal to deploy/; return what changed."""
    changed = []
    copies = expected_copies(repo, chart_files)
    for dst, src in copies.items():
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            changed.append(f"wrote {dst.relative_to(repo)}")
    for _, _, dst_dir in MAPPINGS:
        for dst in sorted((chart_files / dst_dir).glob("*")):
            if dst.is_file() and dst not in copies:
                dst.unlink()
                changed.append(f"removed {dst.relative_to(repo)}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report differences")
    args = parser.parse_args(argv)
    if args.check:
        problems = differences()
        for line in problems:
            print(line)
        if problems:
            print("run: python scripts/sync_chart_files.py", file=sys.stderr)
        return 1 if problems else 0
    for line in sync():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
