"""vllm-ling's MXFP4 MoE method inside vLLM's Ling MoE block, and its backend policy."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm")
from vllm_ling.options import LingOptions, MoeBackend, MoeDecode  # noqa: E402


@pytest.mark.parametrize("layer", [2, 4])  # layer 4 has SwiGLU clamps (experts 4, shared 5)
def test_moe_block_matches_the_independent_reference(loaded_tiny_models, tiny_checkpoint, layer):
    """vLLM's routing + shared expert + our CPU method == ops.moe.moe_block_reference."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from vllm_ling.ops.moe.activation import layer_swiglu_limit
    from vllm_ling.ops.moe.reference import LingMoEConfig, moe_block_reference

    vllm_config, target, _ = loaded_tiny_models
    cfg_hf = vllm_config.model_config.hf_config
    block = target.model.layers[layer].mlp
    # x40: pre-activations ~N(0, 13) so layer 4's clamps (4 and 5) really bite.
    x = (40 * torch.randn(7, cfg_hf.hidden_size, generator=torch.Generator().manual_seed(layer))).to(torch.bfloat16)
    with set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        got = block(x).float()
    # Every reference weight comes from the checkpoint's tensors: after loading, vLLM may have
    # repacked them (the router for its CPU GEMM; block-FP8 linears for AMX).
    ref_weights = _block_weights_from_checkpoint(tiny_checkpoint, layer, cfg_hf.num_experts)
    cfg = LingMoEConfig.from_hf_config(cfg_hf)
    ref = moe_block_reference(
        x, cfg, **ref_weights,
        routed_swiglu_limit=layer_swiglu_limit(cfg_hf.expert_swiglu_limit_list, layer),
        shared_swiglu_limit=layer_swiglu_limit(cfg_hf.share_expert_swiglu_limit_list, layer))
    # BF16 activations between the GEMMs (vLLM's shared expert and our method's output cast)
    # against an fp32 reference: a few BF16 ulps of the output scale.
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 2e-2 * scale, ((got - ref).abs().max(), scale)
    if layer == 4:  # the clamp matters here: an unclamped block is far off
        unclamped = moe_block_reference(x, cfg, **ref_weights)
        assert (got - unclamped).abs().max() > 0.2 * scale


def _block_weights_from_checkpoint(checkpoint, layer: int, num_experts: int) -> dict[str, torch.Tensor]:
    """moe_block_reference's weights for ``layer``, read from the safetensors shards: router
    and expert bias, MXFP4 experts stacked as vLLM's w13/w2, the shared expert's block-FP8
    linears dequantized with their checkpoint scales."""
    from safetensors import safe_open

    from vllm_ling.ops.fp8 import block_fp8_dequantize

    prefix = f"model.layers.{layer}.mlp."
    t = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            t.update({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})

    def experts(projs, what):
        return torch.stack([torch.cat([t[f"experts.{e}.{p}.{what}"] for p in projs]) for e in range(num_experts)])

    def fp8(name):
        return block_fp8_dequantize(t[f"{name}.weight"], t[f"{name}.weight_scale_inv"].float())

    return dict(gate_weight=t["gate.weight"], expert_bias=t["gate.expert_bias"],
                w13=experts(("gate_proj", "up_proj"), "weight"), w2=experts(("down_proj",), "weight"),
                w13_scale=experts(("gate_proj", "up_proj"), "weight_scale_inv").view(torch.uint8),
                w2_scale=experts(("down_proj",), "weight_scale_inv").view(torch.uint8),
                shared_gate_up=torch.cat([fp8("shared_experts.gate_proj"), fp8("shared_experts.up_proj")]),
                shared_down=fp8("shared_experts.down_proj"))


class _FakeMoE:
    def __init__(self, moe_config):
        self.moe_config = moe_config


def test_cuda_without_humming_refuses_naming_the_cause(loaded_tiny_models, monkeypatch):
    from vllm.platforms import current_platform

    from vllm_ling.layers import moe_method

    _, target, _ = loaded_tiny_models
    layer = _FakeMoE(target.model.layers[2].mlp.experts.routed_experts.moe_config)
    monkeypatch.setattr(current_platform.__class__, "is_cpu", lambda self=None: False)
    monkeypatch.setattr(moe_method.moe_ops, "humming_status",
                        lambda *a, **k: (False, "humming-kernels is not installed"))
    with pytest.raises(moe_method.HummingUnavailable) as err:
        moe_method.choose_moe_method(layer, "model.layers.2.mlp.experts", LingOptions(moe_backend=MoeBackend.HUMMING))
    assert str(err.value) == (
        "Humming MXFP4 MoE cannot run for model.layers.2.mlp.experts: humming-kernels is not installed. "
        "Install humming-kernels (it comes with vllm==0.32.0) on an sm_75+ GPU, or opt out explicitly "
        "with VLLM_LING_MOE_BACKEND=vllm (or vLLM's --moe-backend).")


def test_explicit_opt_out_is_one_warning_and_leaves_vllm_in_charge(loaded_tiny_models, caplog):
    from vllm_ling.layers import moe_method
    from vllm_ling.log import _once

    _, target, _ = loaded_tiny_models
    layer = _FakeMoE(target.model.layers[2].mlp.experts.routed_experts.moe_config)
    _once.discard(("vllm.ling.moe", "moe-opt-out"))
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        assert moe_method.choose_moe_method(layer, "a", LingOptions(moe_backend=MoeBackend.VLLM)) is None
        assert moe_method.choose_moe_method(layer, "b", LingOptions(moe_backend=MoeBackend.VLLM)) is None
    warnings = [r.getMessage() for r in caplog.records if "Humming MoE is OFF" in r.getMessage()]
    assert warnings == ["Humming MoE is OFF by explicit choice (VLLM_LING_MOE_BACKEND=vllm): vLLM selects "
                        "the MXFP4 MoE backend; the startup report marks moe_humming inactive."]


def test_cpu_uses_the_reference_method(loaded_tiny_models):
    from vllm_ling.layers.moe_method import REFERENCE, choose_moe_method

    _, target, _ = loaded_tiny_models
    layer = _FakeMoE(target.model.layers[2].mlp.experts.routed_experts.moe_config)
    assert choose_moe_method(layer, "x", LingOptions(moe_backend=MoeBackend.HUMMING)).backend == REFERENCE


def test_w4a8_is_selectable_and_refused_where_it_cannot_run(loaded_tiny_models, monkeypatch):
    from vllm.platforms import current_platform

    from vllm_ling.layers import moe_method

    _, target, _ = loaded_tiny_models
    layer = _FakeMoE(target.model.layers[2].mlp.experts.routed_experts.moe_config)
    with pytest.raises(moe_method.HummingUnavailable, match="VLLM_LING_MOE_W4A8=1 needs humming on an sm_89"):
        moe_method.choose_moe_method(layer, "x", LingOptions(moe_backend=MoeBackend.HUMMING, moe_w4a8=True))
    monkeypatch.setattr(current_platform.__class__, "is_cpu", lambda self=None: False)
    asked = []

    def status(w4a8=False, **_):
        asked.append(w4a8)
        return True, ""

    monkeypatch.setattr(moe_method.moe_ops, "humming_status", status)
    method = moe_method.choose_moe_method(layer, "x", LingOptions(moe_backend=MoeBackend.HUMMING, moe_w4a8=True))
    assert asked == [True]  # the W4A8 capability (sm_89+) is what gets checked
    assert method.backend == moe_method.HUMMING and method.w4a8
    assert method.description == "humming MXFP4 indexed GEMM (W4A8, FP8 per-token activations)"


def test_decode_options_reach_the_method(loaded_tiny_models, monkeypatch):
    """VLLM_LING_MOE_DECODE / _MAX_TOKENS are parsed (bad values named) and handed to the
    humming method that CUDA would build."""
    from vllm_ling.layers.moe_method import HUMMING, LingMxfp4MoEMethod, choose_moe_method
    from vllm_ling.options import LingOptionError

    from vllm_ling.ops import moe as moe_ops

    monkeypatch.delenv("VLLM_LING_MOE_DECODE_MAX_TOKENS", raising=False)
    defaults = LingOptions.from_env()  # the option's default is the ops' default (measured crossover)
    assert defaults.moe_decode_max_tokens == moe_ops.DEFAULT_DECODE_MAX_TOKENS == 32
    monkeypatch.setenv("VLLM_LING_MOE_DECODE", "copy")
    monkeypatch.setenv("VLLM_LING_MOE_DECODE_MAX_TOKENS", "4")
    opts = LingOptions.from_env()
    assert (opts.moe_decode, opts.moe_decode_max_tokens) == ("copy", 4)
    monkeypatch.setenv("VLLM_LING_MOE_DECODE", "fast")
    with pytest.raises(LingOptionError, match="VLLM_LING_MOE_DECODE='fast': expected one of auto, copy, off"):
        LingOptions.from_env()
    monkeypatch.setenv("VLLM_LING_MOE_DECODE", "off")
    monkeypatch.setenv("VLLM_LING_MOE_DECODE_MAX_TOKENS", "-1")
    with pytest.raises(LingOptionError, match="VLLM_LING_MOE_DECODE_MAX_TOKENS=-1 must be >= 0"):
        LingOptions.from_env()
    monkeypatch.setenv("VLLM_LING_MOE_DECODE_MAX_TOKENS", "8193")  # 8 slots x 8193 > 65535 grid rows
    with pytest.raises(LingOptionError, match="VLLM_LING_MOE_DECODE_MAX_TOKENS=8193 must be <= 4096"):
        LingOptions.from_env()

    _, target, _ = loaded_tiny_models
    # a stand-in: choosing records the selection on the layer, and the loaded model is shared
    layer = _FakeMoE(target.model.layers[2].mlp.experts.routed_experts.moe_config)
    from vllm.platforms import current_platform
    from vllm_ling.ops import moe as moe_ops

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(moe_ops, "humming_status", lambda w4a8=False: (True, "pretend"))
    method = choose_moe_method(layer, "model.layers.2.mlp.experts", LingOptions(moe_backend=MoeBackend.HUMMING, moe_decode=MoeDecode.COPY, moe_decode_max_tokens=4))
    assert isinstance(method, LingMxfp4MoEMethod) and method.backend == HUMMING
    assert (method.decode, method.decode_max_tokens) == ("copy", 4)
    assert method.decode_status is None and not method.decode_active  # nothing built before loading


def test_packed_copy_that_cannot_run_is_refused_before_loading(loaded_tiny_models, monkeypatch):
    """An explicit VLLM_LING_MOE_DECODE=copy is refused (naming the option) where it cannot run:
    on the CPU platform, with W4A8, or with sizes the kernels cannot tile."""
    from vllm.platforms import current_platform

    from vllm_ling.layers.moe_method import HummingUnavailable, choose_moe_method
    from vllm_ling.ops import moe as moe_ops

    _, target, _ = loaded_tiny_models
    layer = _FakeMoE(target.model.layers[2].mlp.experts.routed_experts.moe_config)
    prefix = "model.layers.2.mlp.experts"
    with pytest.raises(HummingUnavailable, match="VLLM_LING_MOE_DECODE=copy cannot run .*CPU platform"):
        choose_moe_method(layer, prefix, LingOptions(moe_backend=MoeBackend.HUMMING, moe_decode=MoeDecode.COPY))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(moe_ops, "humming_status", lambda w4a8=False: (True, "pretend"))
    with pytest.raises(HummingUnavailable, match="copy cannot run .*VLLM_LING_MOE_W4A8=1"):
        choose_moe_method(layer, prefix, LingOptions(moe_backend=MoeBackend.HUMMING, moe_w4a8=True, moe_decode=MoeDecode.COPY))
    cfg = layer.moe_config
    if cfg.hidden_dim % 64 == 0 and cfg.intermediate_size_per_partition % 64 == 0:
        monkeypatch.setattr(cfg, "intermediate_size_per_partition", cfg.intermediate_size_per_partition + 32)
    with pytest.raises(HummingUnavailable, match="not multiples of 64.*VLLM_LING_MOE_DECODE=auto"):
        choose_moe_method(layer, prefix, LingOptions(moe_backend=MoeBackend.HUMMING, moe_decode=MoeDecode.COPY))
    assert choose_moe_method(layer, prefix, LingOptions(moe_backend=MoeBackend.HUMMING, moe_decode=MoeDecode.AUTO)) is not None  # auto: best effort


def test_a_backend_name_as_a_string_is_refused(loaded_tiny_models):
    """Backends travel as enum members inside a Selection: a plain word (a typo or not) fails
    loudly, never silently."""
    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod
    from vllm_ling.ops.moe.selection import MoePath, MoeSelection
    from vllm_ling.selection import Feature

    _, target, _ = loaded_tiny_models
    moe_config = target.model.layers[2].mlp.experts.routed_experts.moe_config
    with pytest.raises(TypeError, match="Selection needs a Feature and an enum choice"):
        MoeSelection(Feature.MOE, "humming", "a word")
    with pytest.raises(ValueError, match="not a selection of a Ling MoE backend"):
        LingMxfp4MoEMethod(moe_config, MoeSelection(Feature.MOE, MoePath.VLLM, "vLLM's"))
    reference = MoeSelection(Feature.MOE, MoePath.REFERENCE, "test")
    assert LingMxfp4MoEMethod(moe_config, reference).backend is MoePath.REFERENCE


def test_choosing_records_the_selection_on_the_layer(loaded_tiny_models):
    """The loaded model's routed-expert layers carry the selection the quant config made (CPU:
    the reference), and their methods serve exactly it."""
    from vllm_ling.ops.moe.selection import MoePath
    from vllm_ling.selection import Feature, recorded

    _, target, draft = loaded_tiny_models
    for model in (target, draft):
        for layer in (m for n, m in model.named_modules() if n.endswith("routed_experts")):
            selection = recorded(layer, Feature.MOE)
            assert selection.choice is MoePath.REFERENCE and selection.reason.startswith("CPU platform")
            assert layer.quant_method.selection == selection


def test_the_served_clamp_is_after_the_silu_and_a_planted_pre_silu_method_fails_its_known_answers(
        loaded_tiny_models):
    """Issue 43. The loaded layers record, and their methods serve, the clamp after the SiLU (what
    verification compares: ``served`` against the recorded ``served_as``); the startup
    known-answer check passes on the served method and catches the same method forced to vLLM 0.32's
    clamp before the SiLU on exactly the case whose gates exceed the limit."""
    import dataclasses

    from vllm_ling.layers.known_answer import check_moe_method
    import types

    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod, served
    from vllm_ling.ops import known_answer as ka
    from vllm_ling.ops.moe.activation import SwigluClamp
    from vllm_ling.selection import Feature, recorded

    _, target, _ = loaded_tiny_models
    layer = target.model.layers[2].mlp.experts.routed_experts
    method, selection = layer.quant_method, recorded(layer, Feature.MOE)
    assert selection.clamp is SwigluClamp.GATE_OUTPUT and method.clamp is SwigluClamp.GATE_OUTPUT
    assert served(layer).key == selection.served_as()
    assert check_moe_method(method).passed

    planted = LingMxfp4MoEMethod(layer.moe_config, dataclasses.replace(selection, clamp=SwigluClamp.GATE_INPUT))
    assert served(types.SimpleNamespace(quant_method=planted)).key != selection.served_as()  # the census sees it
    r = check_moe_method(planted)
    assert not r.passed and r.max_error > 5 * r.tolerance, r.message()
    assert [f.split(":")[0] for f in r.failing_inputs] == [
        f"4 tokens (decode-sized), SwiGLU clamp {ka.MOE_MODE_LIMIT:g} after the SiLU"], r.message()
