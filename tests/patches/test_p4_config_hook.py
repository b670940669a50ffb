"""P4: vLLM runs Ling's config hook (CPU cache mode, option conflicts) only through the patch."""

from __future__ import annotations

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")

ARCH = "BailingMoeV3ForCausalLM"


def _engine_config(checkpoint, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(checkpoint), enforce_eager=True, max_model_len=256,
                      **kwargs).create_engine_config()


@pytest.fixture
def config_map(monkeypatch):
    """vLLM's MODELS_CONFIG_MAP without a Ling entry, the rest of vllm-ling registered
    (restored after the test)."""
    import vllm_ling
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    vllm_ling.register()
    monkeypatch.delitem(MODELS_CONFIG_MAP, ARCH)
    monkeypatch.setenv("VLLM_LING_MTP", "0")  # keep P5's default out of the picture
    return MODELS_CONFIG_MAP


def test_hybrid_cache_mode_is_decided_by_the_hook_only_with_p4(config_map, tiny_checkpoint):
    from vllm.platforms import current_platform

    from vllm_ling.patches import p4_config_hook as p4
    from vllm_ling.patches.registry import apply_all

    if not current_platform.is_cpu():
        pytest.skip("the hook's visible decision here is the CPU prefix-cache one")
    assert not p4.is_applied()
    # Without the hook vLLM sizes the 'align' mamba cache mode for prefix caching, which
    # needs Triton kernels vLLM-CPU does not have; without AMX its CPU platform then turns
    # prefix caching off and the config does not even validate.
    try:
        mode = _engine_config(tiny_checkpoint).cache_config.mamba_cache_mode
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        assert "--mamba-block-size can only be set with --enable-prefix-caching" in str(exc)
    else:
        assert mode == "align"

    assert apply_all("register", ids=("P4",)) == ["P4 model-config-hook-api"]
    assert p4.is_applied() and config_map[ARCH].__name__ == "LingConfigHook"
    config = _engine_config(tiny_checkpoint)
    assert config.cache_config.mamba_cache_mode == "none"
    assert not config.cache_config.enable_prefix_caching


def test_p4_refuses_a_changed_upstream_map(config_map, monkeypatch):
    assert_refuses_changed_source(monkeypatch, "P4", lambda: ARCH not in config_map)
