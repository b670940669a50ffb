"""P9: a `bailing_hybrid` config naming another architecture is refused once, naming
config.json, only through the patch; vLLM's config-parse retry never runs for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")

TINY_CONFIG = Path(__file__).resolve().parents[2] / "vllm_ling" / "data" / "ling3_tiny_fp4_config.json"
WRONG_ARCH = "BailingMoeV3ForCausalLMX"


@pytest.fixture
def without_p9(monkeypatch):
    """vLLM's convertor map without a `bailing_hybrid` entry, the rest of vllm-ling registered,
    and vLLM's retry sleeps recorded instead of slept (all restored after the test)."""
    import vllm.transformers_utils.repo_utils as repo_utils
    from vllm.config.model import MODEL_ARCH_CONFIG_CONVERTORS

    import vllm_ling

    vllm_ling.register()
    monkeypatch.delitem(MODEL_ARCH_CONFIG_CONVERTORS, "bailing_hybrid")
    sleeps: list[float] = []
    monkeypatch.setattr(repo_utils.time, "sleep", sleeps.append)
    return MODEL_ARCH_CONFIG_CONVERTORS, sleeps


@pytest.fixture
def wrong_arch_dir(tmp_path) -> Path:
    cfg = json.loads(TINY_CONFIG.read_text())
    cfg["architectures"] = [WRONG_ARCH]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_wrong_architecture_is_refused_once_only_with_p9(without_p9, wrong_arch_dir):
    from vllm.config import ModelConfig

    from vllm_ling.patches import p9_architecture_check as p9
    from vllm_ling.patches.registry import apply_all

    convertors, sleeps = without_p9
    assert not p9.is_applied()
    # Without the patch nothing of ours sees the architecture: vLLM's own error lists
    # every architecture it knows and names no file.
    with pytest.raises(ValueError, match=rf"Model architectures \['{WRONG_ARCH}'\] are not supported"):
        ModelConfig(model=str(wrong_arch_dir))

    assert apply_all("register", ids=("P9",)) == ["P9 config-parse-no-retry-on-rejection"]
    assert p9.is_applied() and convertors["bailing_hybrid"].__name__ == "LingArchConfigConvertor"
    with pytest.raises(ValueError) as refused:
        ModelConfig(model=str(wrong_arch_dir))
    message = str(refused.value)
    assert (f"{wrong_arch_dir}/config.json: architectures ['{WRONG_ARCH}'] is not a Ling-3.0 "
            "architecture for model_type 'bailing_hybrid'; expected 'BailingMoeV3ForCausalLM'. "
            "Fix the \"architectures\" field of the checkpoint's config.json.") in message
    assert message.count("is not a Ling-3.0 architecture") == 1
    # The refusal comes after vLLM's parse, so its retry (log, 2 s sleep, parse again) never runs.
    assert sleeps == []
    # --hf-overrides is applied before the check, so it can name the architecture.
    fixed = ModelConfig(model=str(wrong_arch_dir), hf_overrides={"architectures": ["BailingMoeV3ForCausalLM"]})
    assert fixed.architecture == "BailingMoeV3ForCausalLM"
    assert apply_all("register", ids=("P9",)) == ["P9 config-parse-no-retry-on-rejection"]  # idempotent


def test_p9_refuses_a_changed_upstream_map(without_p9, monkeypatch):
    convertors, _ = without_p9
    assert_refuses_changed_source(monkeypatch, "P9", lambda: "bailing_hybrid" not in convertors)
