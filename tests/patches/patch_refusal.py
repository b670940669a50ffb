"""The check every per-patch test makes: the registry refuses a changed upstream source.

(A helper module, not a conftest.py: tests import the top-level conftest by name.)
"""

from __future__ import annotations

import pytest


def assert_refuses_changed_source(monkeypatch, patch_id: str, is_upstream) -> None:
    """With one recorded hash changed (as after a vLLM bump), applying the patch raises an
    error naming it and leaves the target as vLLM's. The caller first restores the upstream
    target (monkeypatch) so the patch is pending."""
    from vllm_ling.patches import registry

    patch = registry.by_id(patch_id)
    monkeypatch.setattr(registry, "_checked", set())
    symbol = next(iter(patch.upstream_sha256))
    monkeypatch.setitem(patch.upstream_sha256, symbol, "0" * 64)
    # as after a bump: the file differs too, so the symbol-by-symbol check runs
    monkeypatch.setitem(registry.UPSTREAM_FILE_SHA256, symbol.partition(":")[0], "0" * 64)
    with pytest.raises(registry.PatchSourceMismatch) as raised:
        registry.apply_all(patch.stage, ids=(patch_id,))
    message = str(raised.value)
    assert f"patch {patch_id} ({patch.slug}" in message and symbol in message
    assert is_upstream(), f"{patch_id} was applied although its source check failed"
