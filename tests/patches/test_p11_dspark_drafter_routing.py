"""P11: vLLM's speculative config keeps a LingDSparkModel drafter a Qwen3-shaped DSpark draft (and
resolves vllm-ling's class) only through the patch; without it vLLM rewrites it into a DeepSeek-V4
drafter."""

from __future__ import annotations

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")


@pytest.fixture
def without_p11(monkeypatch):
    """vLLM's convertor map without a `qwen3` entry, the rest of vllm-ling registered (restored after)."""
    from vllm.config.model import MODEL_ARCH_CONFIG_CONVERTORS

    import vllm_ling

    vllm_ling.register()
    monkeypatch.delitem(MODEL_ARCH_CONFIG_CONVERTORS, "qwen3")
    monkeypatch.setenv("VLLM_LING_MTP", "0")
    return MODEL_ARCH_CONFIG_CONVERTORS


def _speculative(target_dir, draft_dir):
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(target_dir), enforce_eager=True, max_model_len=256).create_engine_config()
    return SpeculativeConfig(method="dspark", model=str(draft_dir), target_model_config=config.model_config,
                             target_parallel_config=config.parallel_config)


def test_ling_drafter_is_routed_as_a_qwen3_dspark_draft_only_with_p11(without_p11, tiny_checkpoint, tiny_dspark):
    from vllm_ling.patches import p11_dspark_drafter_routing as p11
    from vllm_ling.patches.registry import apply_all

    assert not p11.is_applied()
    # Without the patch vLLM takes any other DSpark architecture for DeepSeek-V4's, whose config
    # and weights live in the target checkpoint: it cannot build Ling's drafter.
    spec = _speculative(tiny_checkpoint, tiny_dspark)
    assert spec.draft_model_config.hf_config.model_type == "deepseek_v4"
    assert spec.draft_model_config.architectures == ["DSparkDraftModel"]

    assert apply_all("register", ids=("P11",)) == ["P11 dspark-ling-drafter-routing"]
    spec = _speculative(tiny_checkpoint, tiny_dspark)
    assert spec.draft_model_config.hf_config.model_type == "qwen3"
    assert spec.draft_model_config.architectures == ["LingDSparkModel", "Qwen3DSparkModel"]
    assert spec.draft_model_config.architecture == "LingDSparkModel"  # the first: vllm-ling's class
    assert spec.num_speculative_tokens == 8  # vLLM's default: the drafter's block_size
    assert spec.parallel_drafting
    assert apply_all("register", ids=("P11",)) == ["P11 dspark-ling-drafter-routing"]  # idempotent


def test_other_qwen3_configs_read_as_vllm_reads_them(without_p11, tiny_dspark):
    import json

    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase
    from transformers import Qwen3Config

    from vllm_ling.patches.config_hooks import LingDSparkArchConfigConvertor

    cfg = json.loads((tiny_dspark / "config.json").read_text())
    for archs in (["Qwen3ForCausalLM"], ["Qwen3DSparkModel"], ["LingDSparkModel", "Qwen3DSparkModel"]):
        hf = Qwen3Config(**{**cfg, "architectures": archs})
        ours = LingDSparkArchConfigConvertor(hf, hf).get_architectures()
        assert ours == ModelArchConfigConvertorBase(hf, hf).get_architectures() == archs


def test_p11_refuses_a_changed_upstream_map(without_p11, monkeypatch):
    convertors = without_p11
    assert_refuses_changed_source(monkeypatch, "P11", lambda: "qwen3" not in convertors)
