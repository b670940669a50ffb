"""P3: CPU_MLA accepts the hybrid model's 256-token pages only through the patch."""

from __future__ import annotations

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")


@pytest.fixture
def cpu_mla(monkeypatch):
    """CPUMLABackend with vLLM's own supports_block_size (restored after the test)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    from vllm_ling.patches import p3_cpu_mla_hybrid_blocks as p3

    upstream = p3.replaced or CPUMLABackend.__dict__["supports_block_size"]
    monkeypatch.setattr(CPUMLABackend, "supports_block_size", upstream)
    monkeypatch.setattr("vllm_ling.patches.p3_cpu_mla_hybrid_blocks.needed", lambda: True)
    return CPUMLABackend


def test_hybrid_page_sizes_only_with_p3(cpu_mla):
    from vllm_ling.patches import p3_cpu_mla_hybrid_blocks as p3
    from vllm_ling.patches.registry import apply_all

    assert not p3.is_applied()
    assert cpu_mla.supports_block_size(16) and not cpu_mla.supports_block_size(256)
    assert apply_all("register", ids=("P3",)) == ["P3 cpu-mla-hybrid-block-size"]
    assert p3.is_applied()
    assert cpu_mla.supports_block_size(256) and cpu_mla.supports_block_size(16)
    assert cpu_mla.supports_block_size(None)
    assert not cpu_mla.supports_block_size(24)  # still whole 16-token kernel blocks


def test_p3_refuses_a_changed_upstream_method(cpu_mla, monkeypatch):
    assert_refuses_changed_source(monkeypatch, "P3", lambda: not cpu_mla.supports_block_size(256))
