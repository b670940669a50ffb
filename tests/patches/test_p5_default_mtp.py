"""P5: a Ling target gets NEXTN MTP by default only through the patch."""

from __future__ import annotations

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")


def _engine_config(checkpoint, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(checkpoint), enforce_eager=True, max_model_len=256,
                      **kwargs).create_engine_config()


@pytest.fixture
def engine_args(monkeypatch):
    """EngineArgs with vLLM's own create_speculative_config, the rest of vllm-ling
    registered (restored after the test)."""
    import vllm_ling
    from vllm.engine.arg_utils import EngineArgs

    vllm_ling.register()
    current = EngineArgs.__dict__["create_speculative_config"]
    monkeypatch.setattr(EngineArgs, "create_speculative_config", getattr(current, "__wrapped__", current))
    monkeypatch.delenv("VLLM_LING_MTP", raising=False)
    return EngineArgs


def test_default_mtp_only_with_p5(engine_args, tiny_checkpoint):
    from vllm_ling.patches import p5_default_mtp as p5
    from vllm_ling.patches.registry import apply_all
    from vllm_ling.runtime.spec_policy import default_applied

    assert not p5.is_applied()
    assert _engine_config(tiny_checkpoint).speculative_config is None  # vLLM: MTP is opt-in

    assert apply_all("register", ids=("P5",)) == ["P5 model-default-speculative-config"]
    assert p5.is_applied()
    config = _engine_config(tiny_checkpoint)
    assert config.speculative_config.method == "mtp"
    assert config.speculative_config.num_speculative_tokens == 3
    assert default_applied(config)
    apply_all("register", ids=("P5",))
    wrapper = engine_args.__dict__["create_speculative_config"]
    assert not hasattr(wrapper.__wrapped__, "__wrapped__")  # wrapped once


def test_p5_refuses_a_changed_upstream_method(engine_args, monkeypatch):
    from vllm_ling.patches import p5_default_mtp as p5

    assert_refuses_changed_source(monkeypatch, "P5", lambda: not p5.is_applied())
