"""The patch registry: one ordered list that matches the installed vLLM, the README and
the upstream-ready diffs in top-level patches/."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]


def _registry():
    from vllm_ling.patches import registry

    return registry


def test_every_patch_is_declared_once_with_its_module():
    registry = _registry()
    ids = [p.id for p in registry.PATCHES]
    assert ids == [f"P{i}" for i in range(1, len(ids) + 1)]
    on_disk = {p.stem for p in (REPO / "vllm_ling" / "patches").glob("p[0-9]*_*.py")}
    assert on_disk == {p.module.rsplit(".", 1)[-1] for p in registry.PATCHES}
    for patch in registry.PATCHES:
        module = importlib.import_module(patch.module)
        assert callable(module.apply) and callable(module.is_applied), patch.id
        assert module.__doc__.startswith(f"Patch {patch.id}:"), patch.id
        vllm_targets = {t for t in patch.targets if t.startswith("vllm.")}
        assert vllm_targets <= set(patch.upstream_sha256), patch.id  # P2's target is the stdlib


def test_recorded_sources_are_the_installed_vllms():
    """Fails after a vLLM bump until every patch is reviewed against the new source."""
    registry = _registry()
    assert registry.main(["check"]) == 0


def test_whole_file_hashes_cover_every_recorded_source(monkeypatch):
    """The fast path (a byte-identical file) covers every file, and a file changed elsewhere
    than the patched sources still passes, symbol by symbol."""
    registry = _registry()
    modules = {s.partition(":")[0] for p in registry.PATCHES for s in p.upstream_sha256}
    assert set(registry.UPSTREAM_FILE_SHA256) == modules
    monkeypatch.setattr(registry, "_checked", set())
    for module in modules:
        monkeypatch.setitem(registry.UPSTREAM_FILE_SHA256, module, "0" * 64)
    for patch in registry.PATCHES:
        registry.check_upstream(patch)


def test_source_of_a_patched_target_is_still_vllms(monkeypatch):
    """Hashes are read from vLLM's files, so they describe vLLM's code after patching too."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    registry = _registry()
    monkeypatch.setattr(CPUMLABackend, "supports_block_size", CPUMLABackend.__dict__["supports_block_size"])
    monkeypatch.setattr("vllm_ling.patches.p3_cpu_mla_hybrid_blocks.needed", lambda: True)
    registry.apply_all("register", ids=("P3",))
    source = registry.upstream_source("vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.supports_block_size")
    assert source.lstrip().startswith("@classmethod") and "block_size == 16" in source
    assert registry.upstream_source("vllm.envs:environment_variables").startswith("environment_variables")
    with pytest.raises(LookupError, match="nope"):
        registry.upstream_source("vllm.envs:nope")


def test_readme_table_is_the_registry():
    table = _registry().render_table()
    readme = (REPO / "vllm_ling" / "patches" / "README.md").read_text()
    assert table in readme, "regenerate with `python -m vllm_ling.patches.registry readme`"
    assert readme.count("\n| P") == len(_registry().PATCHES)



def _diff_dir() -> Path:
    return REPO / "patches" / f"v{_registry().PATCHED_VLLM_VERSION}"


def test_series_matches_the_registry_one_to_one():
    registry = _registry()
    series = (_diff_dir() / "series").read_text().split()
    assert series == [Path(p.diff).name for p in registry.PATCHES]
    assert sorted(series) == sorted(p.name for p in _diff_dir().glob("*.diff"))
    top_readme = (REPO / "patches" / "README.md").read_text()
    for patch in registry.PATCHES:
        row = next(l for l in top_readme.splitlines() if l.startswith(f"| {patch.id} "))
        assert Path(patch.diff).name in row and patch.module.rsplit(".", 1)[-1] in row, patch.id


def _touched(diff: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", diff.read_text(), flags=re.M)


def test_every_diff_applies_to_the_installed_vllm(tmp_path):
    """Each diff alone and the series in order apply to a copy of the installed vLLM
    (only the files the diffs touch are copied: the package is 500 MB)."""
    import vllm

    site = Path(vllm.__file__).resolve().parents[1]
    series = (_diff_dir() / "series").read_text().split()
    files = sorted({f for name in series for f in _touched(_diff_dir() / name)})
    assert files and all(f.startswith("vllm/") for f in files)
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / f, tmp_path / f)
    patch = shutil.which("patch")
    if patch is None:
        pytest.skip("no `patch` program")

    def run(name: str, *flags: str, inexact: tuple[str, ...]) -> None:
        result = subprocess.run([patch, "-p1", "--forward", "--batch", *flags],
                                cwd=tmp_path, input=(_diff_dir() / name).read_text(),
                                capture_output=True, text=True)
        assert result.returncode == 0 and not any(w in result.stdout for w in inexact), \
            f"{name} does not apply cleanly:\n{result.stdout}{result.stderr}"

    for name in series:  # each alone, exactly where it says, on vLLM's own files
        run(name, "--dry-run", inexact=("offset", "fuzz"))
    for name in series:  # then all in order, as a distribution would carry them
        run(name, "--no-backup-if-mismatch", inexact=("fuzz",))
    for f in files:
        compile((tmp_path / f).read_text(), f, "exec")
