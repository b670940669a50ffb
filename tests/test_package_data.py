"""Every file the package reads at run time ships in its wheel: pyproject.toml's package-data patterns
cover every non-Python file under vllm_ling/ (the CUDA sources NVRTC compiles on the GPU, the data files).

A checkout runs them from the tree either way (the GPU leases run from it), so a source missing from the
wheel shows only after `pip install vllm-ling`: the router top-k's grouped_topk.cu was (its kernel then
could not load on a GPU installed from the wheel)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vllm_ling"


def test_package_data_ships_every_non_python_file_of_the_package():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vllm_ling"]
    shipped = {path for pattern in patterns for path in PACKAGE.glob(pattern)}
    resources = {path for path in PACKAGE.rglob("*") if path.is_file() and path.suffix not in {".py", ".pyc"}
                 and "__pycache__" not in path.parts}
    missing = sorted(str(path.relative_to(REPO)) for path in resources - shipped)
    assert not missing, f"not in pyproject.toml's [tool.setuptools.package-data]: {missing}"
    assert all(any(PACKAGE.glob(pattern)) for pattern in patterns), "a package-data pattern matches nothing"
