"""P1: vLLM's config lookup knows `bailing_hybrid` only through the patch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")

TINY_CONFIG = Path(__file__).resolve().parents[2] / "vllm_ling" / "data" / "ling3_tiny_fp4_config.json"


@pytest.fixture
def without_p1(monkeypatch):
    """vLLM's and transformers' registries as before any registration of `bailing_hybrid`
    (restored after the test)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    monkeypatch.delitem(_CONFIG_REGISTRY, "bailing_hybrid", raising=False)
    monkeypatch.delitem(CONFIG_MAPPING._extra_content, "bailing_hybrid", raising=False)
    return _CONFIG_REGISTRY


def test_vllm_reads_ling_config_only_with_p1(without_p1, tmp_path):
    import json

    from vllm.transformers_utils.config import get_config

    from vllm_ling.models.configuration import LingHybridConfig
    from vllm_ling.patches import p1_bailing_hybrid_config as p1
    from vllm_ling.patches.registry import apply_all

    shutil.copy(TINY_CONFIG, tmp_path / "config.json")
    assert not p1.is_applied()
    with pytest.raises(ValueError, match="model type `bailing_hybrid`"):
        get_config(str(tmp_path), trust_remote_code=False)

    assert apply_all("register", ids=("P1",)) == ["P1 bailing-hybrid-config"]
    assert p1.is_applied() and without_p1["bailing_hybrid"] is LingHybridConfig
    config = get_config(str(tmp_path), trust_remote_code=False)
    assert type(config) is LingHybridConfig
    assert config.head_dim == json.loads(TINY_CONFIG.read_text())["head_dim"]
    assert apply_all("register", ids=("P1",)) == ["P1 bailing-hybrid-config"]  # idempotent


def test_p1_refuses_a_changed_upstream_registry(without_p1, monkeypatch):
    assert_refuses_changed_source(monkeypatch, "P1", lambda: "bailing_hybrid" not in without_p1)
