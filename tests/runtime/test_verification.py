"""Startup verification on the loaded tiny models: it reads the selection each module recorded and
proves the module serves it. Every feature's planted divergence (a module recording one choice and
serving another) fails its row, named; each other purposely broken setup with its exact message,
in strict and warn modes."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import types

import known_answer_faults as faults  # tests/known_answer_faults.py
import pytest
import torch

pytest.importorskip("vllm")

from vllm_ling.options import LingOptions, MoeDecode  # noqa: E402
from vllm_ling.selection import Feature, Selection  # noqa: E402


@contextlib.contextmanager
def swapped(obj, name, value):
    """Replace an attribute and put the original back, bypassing nn.Module's registration
    (vLLM's MoE quant methods may be modules or plain objects)."""
    store = next((d for d in (obj.__dict__.get("_modules"), obj.__dict__.get("_parameters"), obj.__dict__)
                  if d is not None and name in d), obj.__dict__)
    old = store[name]
    store[name] = value
    try:
        yield
    finally:
        store[name] = old


def _report(models, spec_changes=None, options=None, platform=None):
    from vllm_ling.runtime.verification import build_report
    from vllm_ling.runtime.verification.speculative import Speculative

    vllm_config, target, draft = models
    spec = Speculative.in_force(vllm_config)
    if spec_changes:
        spec = dataclasses.replace(spec, **spec_changes)
    return build_report(target, draft, vllm_config, options or LingOptions(), spec, platform)


def _census(models):
    from vllm_ling.layers.readers import readers
    from vllm_ling.runtime.verification.census import take_census

    _, target, draft = models
    return take_census(target, draft, readers())


def _plant(monkeypatch, module, selection):
    """``module`` records ``selection`` (restored after the test), whatever it serves."""
    from vllm_ling.selection import SELECTIONS_ATTR

    monkeypatch.setattr(module, SELECTIONS_ATTR, {**getattr(module, SELECTIONS_ATTR, {}), selection.feature: selection})


def _speculation(name):
    """The selection patch P5 would record (runtime.spec_policy.select_speculation), by choice name."""
    from vllm_ling.runtime.spec_policy import Speculation, select_speculation

    facts = {"DEFAULT_MTP": (LingOptions(), False, 1, 1), "USER": (LingOptions(), True, 1, 1),
             "OFF": (LingOptions(mtp=False), False, 1, 1), "OFF_NO_NEXTN": (LingOptions(), False, 0, 1),
             "OFF_PIPELINE": (LingOptions(), False, 1, 2)}[name]
    selection = select_speculation(*facts)
    assert selection.choice is Speculation[name]
    return selection


def _check(report, name):
    return next(c for c in report["checks"] if c["name"] == name)


def test_cpu_expectations_pass_and_say_so(loaded_tiny_models):
    from vllm_ling.runtime.report import REPORT_JSON_SCHEMA

    report = _report(loaded_tiny_models)
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert [c["name"] for c in report["checks"]] == [
        "model_classes", "moe_layers", "lm_head", "dense_fp8_layers", "small_bf16_layers", "kda_merged_in_proj",
        "kda_fused_conv", "kda_decode", "kda_output_norm", "kda_direct_output", "shared_swiglu_kernel",
        "router_gates", "router_topk", "dspark_drafter", "draft_shares_target_modules",
        "speculative_config", "prefill_graphs", "decode_splits", "residual_norm", "versions",
        "kernel_known_answers"]
    assert _check(report, "moe_layers")["actual"] == "5 x reference"
    assert _check(report, "moe_layers")["expected"] == (
        "5 routed-expert layers, each serving the selection recorded on it (5 x reference)")
    assert _check(report, "lm_head")["actual"] == "1 x Fp8LmHeadMethod, float8_e4m3fn, 524288 bytes; 1 x torch"
    assert report["optimizations"]["moe_humming"] == {
        "requested": False, "active": False, "detail": "not selected: 5 x CPU platform: no humming, the plain-PyTorch reference"}
    assert report["optimizations"]["moe_decode_kernels"] == {
        "requested": False, "active": False, "detail": "needs the humming MoE backend on CUDA"}
    assert report["optimizations"]["fp8_head"]["active"] is True
    assert report["optimizations"]["dspark"] == {
        "requested": False, "active": False, "detail": "not selected: no DSpark drafters"}
    assert any("plain-PyTorch MXFP4 reference" in n for n in report["notes"])
    assert report["optimizations"]["dense_fp8_decode"]["requested"] is False
    assert report["optimizations"]["router_gemv"] == {
        "requested": False, "active": False, "detail": "not selected: 5 x the CPU platform: vLLM's GateLinear path"}
    assert report["optimizations"]["decode_splits"] == {
        "requested": False, "active": False, "detail": "not selected: no FlashAttention decode on this platform"}
    assert report["optimizations"]["residual_norm"] == {
        "requested": False, "active": False, "detail": "not selected: the kernel is CUDA's: vLLM's platform default"}
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, REPORT_JSON_SCHEMA)


def test_the_census_reads_every_served_module_once(loaded_tiny_models):
    """One pass over target and draft: every feature's modules with their records; the draft's
    shared head is the target's module, counted once under the target's name."""
    census = _census(loaded_tiny_models)
    # the speculative method, the prefill graphs, the decode splits and the residual norms are the config's,
    # recorded on no module
    count = {f: len(census.of(f)) for f in Feature
             if f not in (Feature.SPECULATIVE, Feature.PREFILL_GRAPHS, Feature.DECODE_SPLITS, Feature.RESIDUAL_NORM)}
    assert count == {Feature.MOE: 5, Feature.DENSE_FP8: 33, Feature.BF16_GEMV: 7, Feature.ROUTER_GEMV: 5,
                     Feature.ROUTER_TOPK: 5, Feature.FP8_HEAD: 1, Feature.HEAD_KERNEL: 1,
                     Feature.KDA_MERGED_IN_PROJ: 5, Feature.KDA_FUSED_CONV: 5, Feature.KDA_DECODE: 5,
                     Feature.KDA_OUTPUT_NORM: 5, Feature.KDA_DIRECT_OUTPUT: 5, Feature.SHARED_SWIGLU: 3,
                     Feature.DRAFTER: 0}
    assert [e.name for e in census.of(Feature.FP8_HEAD)] == ["target.lm_head"]
    assert all(e.recorded is not None and e.served.key == e.recorded.served_as() for e in census.entries)


# ---- planted divergences: one per feature, each a module recording one choice and serving another

def _first(models, feature):
    return _census(models).of(feature)[0]


def _plant_moe(models, monkeypatch):
    for e in _census(models).of(Feature.MOE):
        _plant(monkeypatch, e.module, _humming_selection())
    return "moe_layers", ("not the recorded selection: ['target.model.layers.2.mlp.experts.routed_experts "
                          "(selected humming, serves reference)'")


def _plant_dense(models, monkeypatch):
    from vllm_ling.ops.dense_fp8.selection import DenseFp8Kernel, DenseFp8Selection

    e = _first(models, Feature.DENSE_FP8)
    _plant(monkeypatch, e.module, DenseFp8Selection(Feature.DENSE_FP8, DenseFp8Kernel.W8A16, "CUDA, the W8A16 kernel "
                                                    "runs", max_rows=32, prefill="CutlassFp8BlockScaledMMKernel"))
    return "dense_fp8_layers", f"not the recorded selection: ['{e.name} (selected w8a16, serves dequantized)']"


def _plant_bf16(models, monkeypatch):
    from vllm_ling.ops.small_gemv.selection import GemvPath

    e = _first(models, Feature.BF16_GEMV)
    _plant(monkeypatch, e.module, Selection(Feature.BF16_GEMV, GemvPath.LING, "CUDA, the small GEMV runs"))
    return "small_bf16_layers", f"not the recorded selection: ['{e.name} (selected ling, serves vllm)']"


def _plant_router(models, monkeypatch):
    from vllm_ling.ops.small_gemv.selection import GemvPath

    e = _first(models, Feature.ROUTER_GEMV)
    _plant(monkeypatch, e.module, Selection(Feature.ROUTER_GEMV, GemvPath.LING, "CUDA, the router GEMV holds this gate"))
    return "router_gates", f"not the recorded selection: ['{e.name} (selected ling, serves vllm)']"


def _plant_router_topk(models, monkeypatch):
    from vllm_ling.options import RouterTopk

    e = _first(models, Feature.ROUTER_TOPK)
    _plant(monkeypatch, e.module, Selection(Feature.ROUTER_TOPK, RouterTopk.LING,
                                            "CUDA, the grouped top-k kernel holds this router"))
    return "router_topk", f"not the recorded selection: [\"{e.name} (selected ling, serves vLLM's CPURouter)\"]"


def _plant_fp8_head(models, monkeypatch):
    from vllm_ling.ops.lm_head.selection import Fp8Head

    _, target, _ = models
    _plant(monkeypatch, target.lm_head, Selection(Feature.FP8_HEAD, Fp8Head.VLLM, "opted out (VLLM_LING_FP8_HEAD=0)"))
    return "lm_head", ("not the recorded selection: ['target.lm_head (selected vllm, serves Fp8LmHeadMethod, "
                       "float8_e4m3fn, 524288 bytes)']")


def _plant_head_kernel(models, monkeypatch):
    from vllm_ling.options import HeadKernel

    _, target, _ = models
    _plant(monkeypatch, target.lm_head, Selection(Feature.HEAD_KERNEL, HeadKernel.HUMMING, "sm_90 measured"))
    return "lm_head", "not the recorded selection: ['target.lm_head (selected humming, serves torch)']"


def _plant_kda(models, monkeypatch):
    from vllm_ling.models.kda_merged_in_proj import KdaInProj

    e = _first(models, Feature.KDA_MERGED_IN_PROJ)
    _plant(monkeypatch, e.module, Selection(Feature.KDA_MERGED_IN_PROJ, KdaInProj.VLLM,
                                            "opted out (VLLM_LING_KDA_MERGED_IN_PROJ=0)"))
    return "kda_merged_in_proj", f"not the recorded selection: ['{e.name} (selected vllm, serves one qkvfg_proj linear"


def _plant_kda_conv(models, monkeypatch):
    from vllm_ling.models.kda_fused_conv import FUSED_DESCRIPTION, KdaConv

    e = _first(models, Feature.KDA_FUSED_CONV)
    _plant(monkeypatch, e.module, Selection(Feature.KDA_FUSED_CONV, KdaConv.FUSED, FUSED_DESCRIPTION))
    return "kda_fused_conv", f"not the recorded selection: ['{e.name} (selected fused, serves separate)']"


def _plant_kda_decode(models, monkeypatch):
    from vllm_ling.models.kda_decode import DECODE_DESCRIPTION, KdaDecode

    e = _first(models, Feature.KDA_DECODE)
    _plant(monkeypatch, e.module, Selection(Feature.KDA_DECODE, KdaDecode.LING, DECODE_DESCRIPTION))
    return "kda_decode", f"not the recorded selection: ['{e.name} (selected ling, serves vllm)']"


def _plant_kda_output_norm(models, monkeypatch):
    """The layer records the norm inside the launch (as on CUDA); on CPU its op and forward serve vLLM's."""
    from vllm_ling.models.kda_output_norm import NORM_DESCRIPTION, KdaOutputNorm

    e = _first(models, Feature.KDA_OUTPUT_NORM)
    _plant(monkeypatch, e.module, Selection(Feature.KDA_OUTPUT_NORM, KdaOutputNorm.LING, NORM_DESCRIPTION))
    return "kda_output_norm", f"not the recorded selection: ['{e.name} (selected ling, serves vllm)']"


def _plant_kda_direct_output(models, monkeypatch):
    """The layer records vLLM's buffer (as opted out); the model's forward hands its output on as a value."""
    from vllm_ling.models.kda_direct_output import OPTION, KdaOutput

    e = _first(models, Feature.KDA_DIRECT_OUTPUT)
    _plant(monkeypatch, e.module, Selection(Feature.KDA_DIRECT_OUTPUT, KdaOutput.BUFFER, f"opted out ({OPTION}=0)"))
    return "kda_direct_output", f"not the recorded selection: ['{e.name} (selected buffer, serves the output the layer returns)']"


def _plant_shared_swiglu(models, monkeypatch):
    """Every clamped SwiGLU records vLLM's kernel (as on CUDA); on CPU each serves the PyTorch composition."""
    from vllm_ling.models.shared_swiglu import KERNEL_DESCRIPTION, SharedSwiglu

    entries = _census(models).of(Feature.SHARED_SWIGLU)
    for e in entries:
        _plant(monkeypatch, e.module, Selection(Feature.SHARED_SWIGLU, SharedSwiglu.KERNEL, KERNEL_DESCRIPTION))
    return "shared_swiglu_kernel", f"{entries[0].name} (selected kernel, serves vLLM's PyTorch composition)"


def _plant_speculative(models, monkeypatch):
    monkeypatch.setattr(models[0].model_config.hf_config, "vllm_ling_speculation",
                        {"choice": "off", "reason": "VLLM_LING_MTP=0"})  # P5 recorded off; MTP serves
    return "speculative_config", "mtp, 3 tokens"


def _plant_drafter(models, monkeypatch):
    """The DSpark drafter records a block of 4 draft tokens; vLLM's runtime drafts its block_size 8."""
    _, _, draft = models
    recorded = draft.vllm_ling_selections[Feature.DRAFTER]
    _plant(monkeypatch, draft, dataclasses.replace(recorded, draft_tokens=4, kda_window=5))
    return "dspark_drafter", ("not the recorded selection: ['draft (selected dspark (4 draft tokens per block, "
                              "target layers [2, 4, 5], Model Runner V2, KDA state for a 5-token verify window, "
                              "draft KV pages within the hybrid page, BF16 Markov projection), serves dspark "
                              "(8 draft tokens per block, target layers [2, 4, 5], Model Runner V2, KDA state for "
                              "a 9-token verify window")


def _plant_prefill_graphs(models, monkeypatch):
    """P13 recorded prefill graphs up to 2048 tokens; the CPU worker captures none."""
    monkeypatch.setattr(models[0].model_config.hf_config, "vllm_ling_prefill_graphs",
                        {"choice": "added", "reason": "20 prefill sizes added above vLLM's 4", "up_to": 2048},
                        raising=False)
    return "prefill_graphs", "no piecewise CUDA graphs"


def _plant_decode_splits(models, monkeypatch):
    """The config hook recorded a raised bound; this worker's attention_config holds vLLM's."""
    monkeypatch.setattr(models[0].model_config.hf_config, "vllm_ling_decode_splits",
                        {"choice": "raised", "reason": "raised from vLLM's 32", "bound": 128}, raising=False)
    return "decode_splits", "FlashAttention decode splits in CUDA graphs at most 32"


def _plant_residual_norm(models, monkeypatch):
    """The config hook recorded vllm-ling's norm first; this worker's dispatcher holds vLLM's default."""
    monkeypatch.setattr(models[0].model_config.hf_config, "vllm_ling_residual_norm",
                        {"choice": "ling", "reason": "provider vllm_ling first"}, raising=False)
    return "residual_norm", "IR op fused_add_rms_norm priority"


PLANTED = {Feature.MOE: _plant_moe, Feature.DENSE_FP8: _plant_dense, Feature.BF16_GEMV: _plant_bf16,
           Feature.ROUTER_GEMV: _plant_router, Feature.ROUTER_TOPK: _plant_router_topk,
           Feature.FP8_HEAD: _plant_fp8_head,
           Feature.HEAD_KERNEL: _plant_head_kernel, Feature.KDA_MERGED_IN_PROJ: _plant_kda,
           Feature.KDA_FUSED_CONV: _plant_kda_conv, Feature.KDA_DECODE: _plant_kda_decode,
           Feature.KDA_OUTPUT_NORM: _plant_kda_output_norm,
           Feature.KDA_DIRECT_OUTPUT: _plant_kda_direct_output, Feature.SHARED_SWIGLU: _plant_shared_swiglu,
           Feature.SPECULATIVE: _plant_speculative, Feature.DRAFTER: _plant_drafter,
           Feature.PREFILL_GRAPHS: _plant_prefill_graphs, Feature.DECODE_SPLITS: _plant_decode_splits,
           Feature.RESIDUAL_NORM: _plant_residual_norm}
# The models each feature's divergence is planted in (the NEXTN pair unless named here)
PLANTED_IN = {Feature.DRAFTER: "dspark_on_v2"}


def test_every_feature_has_a_planted_divergence():
    assert set(PLANTED) == set(Feature)


@pytest.mark.parametrize("feature", list(PLANTED), ids=str)
def test_a_module_serving_other_than_it_recorded_fails_its_row_named(request, monkeypatch, feature):
    from vllm_ling.runtime.verification import LingVerificationError, enforce_policy

    models = request.getfixturevalue(PLANTED_IN.get(feature, "loaded_tiny_models"))
    assert _report(models)["passed"]  # the control: as loaded, every module serves its record
    row, says = PLANTED[feature](models, monkeypatch)
    report = _report(models)
    check = _check(report, row)
    assert not check["passed"] and not report["passed"]
    assert says in check["actual"], check["actual"]
    assert [c["name"] for c in report["checks"] if not c["passed"]] == [row]
    with pytest.raises(LingVerificationError, match=f"startup verification failed \\({row}: "):
        enforce_policy(report, "strict")


@contextlib.contextmanager
def moe_selected(models, selection):
    """Every routed-expert layer records ``selection`` (as the quant config would have)."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_ling.selection import SELECTIONS_ATTR

    _, target, draft = models
    with contextlib.ExitStack() as stack:
        for model in (target, draft):
            for m in model.modules():
                if isinstance(m, RoutedExperts):
                    stack.enter_context(swapped(m, SELECTIONS_ATTR, {Feature.MOE: selection}))
        yield


def _humming_selection():
    from vllm_ling.ops.moe.selection import MoePath, MoeSelection

    return MoeSelection(Feature.MOE, MoePath.HUMMING, "CUDA, humming runs", decode=MoeDecode.AUTO, decode_max_tokens=32)


def test_moe_layers_serving_humming_as_recorded_pass(loaded_tiny_models):
    """Once the methods serve the recorded selection, the row passes and humming is requested."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod

    humming = _humming_selection()
    _, target, draft = loaded_tiny_models
    with moe_selected(loaded_tiny_models, humming), contextlib.ExitStack() as stack:
        for model in (target, draft):
            for _, m in model.named_modules():
                if isinstance(m, RoutedExperts):
                    stack.enter_context(swapped(m, "quant_method", LingMxfp4MoEMethod(m.moe_config, humming)))
        report = _report(loaded_tiny_models)
    assert _check(report, "moe_layers")["passed"] and report["moe_backend"] == "humming"
    assert report["optimizations"]["moe_humming"] == {"requested": True, "active": True, "detail": "5 x humming"}


def _moe_row_with_one_layer_serving(loaded_tiny_models, recorded, served):
    """The moe_layers row when every routed-expert layer records ``recorded`` and serves it, but the
    first target layer's method serves ``served``."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod

    _, target, draft = loaded_tiny_models
    layer = next(m for m in target.modules() if isinstance(m, RoutedExperts))
    with moe_selected(loaded_tiny_models, recorded), contextlib.ExitStack() as stack:
        for model in (target, draft):
            for m in model.modules():
                if isinstance(m, RoutedExperts):
                    stack.enter_context(swapped(m, "quant_method", LingMxfp4MoEMethod(
                        m.moe_config, served if m is layer else recorded)))
        return _check(_report(loaded_tiny_models), "moe_layers")


def test_a_layer_with_other_kernel_switches_than_selected_fails(loaded_tiny_models):
    """Same backend, different decode mode: the switches are part of what was selected."""
    humming = _humming_selection()
    off = dataclasses.replace(humming, decode=MoeDecode.OFF, decode_max_tokens=0)
    check = _moe_row_with_one_layer_serving(loaded_tiny_models, humming, off)
    assert not check["passed"]
    assert ("not the recorded selection: ['target.model.layers.2.mlp.experts.routed_experts (selected humming "
            "(False, auto, 32, gate_output, torch), serves humming (False, off, 0, gate_output, torch))']") in check["actual"]


def test_a_layer_building_routing_metadata_otherwise_than_recorded_fails(loaded_tiny_models):
    """Issue 47: vLLM's one-launch routing metadata for prefill is part of what the MoE layer records:
    a layer whose method serves the PyTorch layout instead fails the row, named."""
    from vllm_ling.options import MoeRouting

    humming = dataclasses.replace(_humming_selection(), routing=MoeRouting.VLLM)
    torch_layout = dataclasses.replace(humming, routing=MoeRouting.TORCH)
    check = _moe_row_with_one_layer_serving(loaded_tiny_models, humming, torch_layout)
    assert not check["passed"]
    assert ("target.model.layers.2.mlp.experts.routed_experts (selected humming (False, auto, 32, gate_output, "
            "vllm), serves humming (False, auto, 32, gate_output, torch))") in check["actual"]


def test_a_layer_without_a_recorded_selection_fails(loaded_tiny_models):
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_ling.selection import SELECTIONS_ATTR

    _, _, draft = loaded_tiny_models
    layer = next(m for m in draft.modules() if isinstance(m, RoutedExperts))
    with swapped(layer, SELECTIONS_ATTR, {}):
        check = _check(_report(loaded_tiny_models), "moe_layers")
    assert not check["passed"]
    assert check["actual"] == "5 x reference; no selection recorded: ['draft.model.layers.6.mlp.experts.routed_experts']"


def test_dense_linears_recording_w8a16_while_dequantized_fail_and_are_counted(loaded_tiny_models, monkeypatch):
    """The planted divergence on every dense linear: counted and named, requested, not active."""
    from vllm_ling.ops.dense_fp8.selection import DenseFp8Kernel, DenseFp8Selection

    found = _census(loaded_tiny_models).of(Feature.DENSE_FP8)
    assert found and all(e.recorded.choice is DenseFp8Kernel.DEQUANTIZED for e in found)
    w8a16 = DenseFp8Selection(Feature.DENSE_FP8, DenseFp8Kernel.W8A16, "CUDA, the W8A16 kernel runs", max_rows=32)
    for e in found:
        _plant(monkeypatch, e.module, w8a16)
    report = _report(loaded_tiny_models)
    check = _check(report, "dense_fp8_layers")
    assert not check["passed"] and check["expected"] == (
        f"{len(found)} block-FP8 dense linears, each serving the selection recorded on it ({len(found)} x w8a16)")
    assert check["actual"].startswith(f"{len(found)} x dequantized; not the recorded selection: "
                                      f"['{found[0].name} (selected w8a16, serves dequantized)'")
    assert report["optimizations"]["dense_fp8_decode"] == {"requested": True, "active": False,
                                                            "detail": check["actual"]}


def test_non_humming_moe_layer_is_named(loaded_tiny_models):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    vllm_config, _, draft = loaded_tiny_models
    layer = next(m for m in draft.modules() if isinstance(m, RoutedExperts))
    with set_current_vllm_config(vllm_config):
        vllm_method = UnquantizedFusedMoEMethod(layer.moe_config)
    with swapped(layer, "quant_method", vllm_method):
        check = _check(_report(loaded_tiny_models), "moe_layers")
    assert not check["passed"]
    assert check["actual"] == ("4 x reference, 1 x vllm:UnquantizedFusedMoEMethod; not the recorded selection: "
                               "['draft.model.layers.6.mlp.experts.routed_experts (selected reference, serves "
                               "vllm:UnquantizedFusedMoEMethod)']")


def test_bf16_head_fails_the_fp8_head_it_recorded(loaded_tiny_models):
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    _, target, _ = loaded_tiny_models
    bf16 = torch.nn.Parameter(torch.zeros(2048, 256, dtype=torch.bfloat16), requires_grad=False)
    with swapped(target.lm_head, "quant_method", UnquantizedEmbeddingMethod()), \
            swapped(target.lm_head, "weight", bf16):
        report = _report(loaded_tiny_models)
    check = _check(report, "lm_head")
    assert not check["passed"]
    assert ("['target.lm_head (selected fp8, serves UnquantizedEmbeddingMethod, bfloat16, 1048576 bytes)']"
            in check["actual"])
    assert report["optimizations"]["fp8_head"]["active"] is False


def test_a_head_without_a_kernel_selection_fails(loaded_tiny_models):
    from vllm_ling.options import HeadKernel
    from vllm_ling.selection import SELECTIONS_ATTR, recorded

    _, target, _ = loaded_tiny_models
    assert recorded(target.lm_head, Feature.HEAD_KERNEL).choice is HeadKernel.TORCH  # as loaded on CPU
    fp8_only = {Feature.FP8_HEAD: recorded(target.lm_head, Feature.FP8_HEAD)}
    with swapped(target.lm_head, SELECTIONS_ATTR, fp8_only):
        check = _check(_report(loaded_tiny_models), "lm_head")
    assert not check["passed"] and check["actual"].endswith("; no selection recorded: ['target.lm_head']")


def test_duplicated_draft_head_is_caught(loaded_tiny_models):
    _, target, draft = loaded_tiny_models
    with swapped(draft.model.layers["6"].shared_head, "head", copy.deepcopy(target.lm_head)):
        report = _report(loaded_tiny_models)
    check = _check(report, "draft_shares_target_modules")
    assert not check["passed"]
    assert "are NOT all the target's module" in check["actual"]
    assert "duplicate vocabulary-sized tensors in the draft: ['model.layers.6.shared_head.head.weight'" in check["actual"]
    assert report["optimizations"]["mtp"]["active"] is False


def test_a_gpu_heads_repacked_weight_is_no_duplicate_vocabulary_tensor(loaded_tiny_models):
    # On the GPU the FP8 head's humming kernel repacks the weight to [hidden / 16, ...]: 16 rows on
    # the tiny model, as many as the NEXTN layer's g_proj and router gate have. Rows count by the
    # head's logical vocabulary, so the correct sharing passes (it failed here on the H200)
    _, target, _ = loaded_tiny_models
    packed = torch.nn.Parameter(torch.zeros(16, 2048 * 256 // 16, dtype=torch.float8_e4m3fn), requires_grad=False)
    with swapped(target.lm_head, "weight", packed):
        check = _check(_report(loaded_tiny_models), "draft_shares_target_modules")
    assert check["passed"], check["actual"]
    assert "duplicate" not in check["actual"]


def test_a_check_that_raises_is_that_checks_failure_and_strict_refuses_in_one_line(loaded_tiny_models, monkeypatch):
    # an exception inside a check (e.g. vLLM's kernel raising in a known answer) fails that check,
    # named; the report is still built and strict refuses with the message, not a traceback
    from vllm_ling.runtime.verification import assembly
    from vllm_ling.runtime.verification.policy import LingVerificationError, enforce_policy

    def broken(*args, **kwargs):
        raise RuntimeError("dispatch_scaled_mm: scale_b must be float32")

    monkeypatch.setattr(assembly, "check_draft_sharing", broken)
    report = _report(loaded_tiny_models)
    check = _check(report, "draft_shares_target_modules")
    assert not check["passed"] and report["passed"] is False
    assert check["actual"] == "the check raised RuntimeError: dispatch_scaled_mm: scale_b must be float32"
    assert all(c["passed"] for c in report["checks"] if c["name"] != "draft_shares_target_modules")
    with pytest.raises(LingVerificationError, match="draft_shares_target_modules: expected the check completes") as err:
        enforce_policy(report, "strict")
    assert "\n" not in str(err.value)


def test_a_reader_that_raises_fails_its_row_naming_the_module(loaded_tiny_models, monkeypatch):
    from vllm_ling.layers import moe_method

    def broken(layer):
        raise RuntimeError("no such attribute")

    monkeypatch.setattr(moe_method, "READER", dataclasses.replace(moe_method.READER, served=broken))
    check = _check(_report(loaded_tiny_models), "moe_layers")
    assert not check["passed"]
    assert ("target.model.layers.2.mlp.experts.routed_experts (selected reference, serves reading it raised "
            "RuntimeError: no such attribute)") in check["actual"]


def test_a_multi_line_exception_becomes_one_line():
    # seen on the H200: FlashInfer's JIT build put its ninja output into the exception's message
    from vllm_ling.log import one_line

    exc = RuntimeError("ninja: Entering directory `/root/.cache/x'\n[1/9] g++ ...\n\n[2/9] nvcc ...\n"
                       "ninja: build stopped: interrupted by user.")
    assert one_line(exc) == ("RuntimeError: ninja: Entering directory `/root/.cache/x' ... "
                             "ninja: build stopped: interrupted by user.")
    assert one_line(ValueError("x" * 1000)).endswith("...") and len(one_line(ValueError("x" * 1000))) == 400


def test_wrong_speculative_config_is_caught(loaded_tiny_models):
    check = _check(_report(loaded_tiny_models, {"num_speculative_tokens": 2, "selection": _speculation("DEFAULT_MTP")}),
                   "speculative_config")
    assert not check["passed"]
    assert (check["expected"], check["actual"]) == ("mtp, 3 tokens (vllm-ling default)", "mtp, 2 tokens")


def test_strict_raises_with_every_failed_check_and_its_fix(loaded_tiny_models):
    from vllm_ling.runtime.verification import LingVerificationError, enforce_policy

    report = _report(loaded_tiny_models, {"num_speculative_tokens": 2, "selection": _speculation("DEFAULT_MTP")})
    with pytest.raises(LingVerificationError) as err:
        enforce_policy(report, "strict")
    assert str(err.value) == (
        "vllm-ling refuses to serve: startup verification failed (speculative_config: expected mtp, 3 "
        "tokens (vllm-ling default), got mtp, 2 tokens. Fix: pass --speculative-config '{\"method\": "
        "\"mtp\", \"num_speculative_tokens\": 3}'). Set VLLM_LING_VERIFY=warn to serve anyway.")


def test_warn_logs_each_failed_check_and_off_is_silent(loaded_tiny_models, caplog):
    from vllm_ling.runtime.verification import enforce_policy

    with moe_selected(loaded_tiny_models, _humming_selection()):
        report = _report(loaded_tiny_models, {"num_speculative_tokens": 2, "selection": _speculation("DEFAULT_MTP")})
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        enforce_policy(report, "warn")
        enforce_policy(report, "off")
    failed = [r.getMessage() for r in caplog.records if "FAILED" in r.getMessage()]
    assert len(failed) == 2
    assert failed[0].startswith("verification check moe_layers FAILED: expected 5 routed-expert layers")
    assert failed[1].startswith("verification check speculative_config FAILED")


def test_report_file_is_written_atomically(tmp_path, loaded_tiny_models):
    import json

    from vllm_ling.runtime.report import write_report

    report = _report(loaded_tiny_models)
    path = tmp_path / "sub" / "report.json"
    write_report(report, str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temp file left


def test_report_table_and_notes_state_the_kernels_read_from_the_layers(loaded_tiny_models):
    from vllm_ling.runtime.verification import format_table
    from vllm_ling.runtime.verification.known_answers import KDA_CPU_KERNEL

    report = _report(loaded_tiny_models)
    check = _check(report, "kernel_known_answers")
    assert check["passed"] and check["actual"].startswith("4 kernel(s) match their known answers: ")
    known = report["kernel_checks"]
    assert [(r["name"], r["kernel"], r["passed"]) for r in known["results"]] == [
        ("dense_fp8", "CpuBlockFp8LinearMethod", True),
        ("moe_mxfp4", "plain-PyTorch MXFP4 reference (CPU platform)", True),
        ("fp8_head", "torch", True), ("kda", KDA_CPU_KERNEL, True)]
    (n_dense,) = known["dense_fp8"]["kernels"].values()
    assert report["notes"][0] == (
        "serving kernels: dense_fp8: CpuBlockFp8LinearMethod; moe_mxfp4: plain-PyTorch MXFP4 reference "
        f"(CPU platform); fp8_head: torch; kda: {KDA_CPU_KERNEL}; dense block-FP8 linears: "
        f"{n_dense} x CpuBlockFp8LinearMethod")
    # the dense path every linear recorded (no process-wide guess): one choice and reason here
    assert known["dense_fp8"]["path_choice"]["kernel"] == "dequantized"
    table = format_table(report)
    assert f"known-answer kernel checks ({known['seconds']:.2f} s):" in table
    assert "  dense_fp8 [CpuBlockFp8LinearMethod]: ok, max rel. error " in table


def test_a_wrong_kernel_refuses_to_serve_naming_kernel_inputs_and_max_error(loaded_tiny_models, monkeypatch,
                                                                         caplog):
    """The FP8 head kernel reading e4m3 0x00/0x80 as +-2^-7: strict refuses with the check's
    message; warn logs it once."""
    import dataclasses as dc

    from vllm_ling.layers import fp8_lm_head
    from vllm_ling.runtime.verification import LingVerificationError, enforce_policy
    from vllm_ling.runtime.verification.known_answers import EXPECTED, FIX

    original = fp8_lm_head.head_ops.fp8_head_logits
    monkeypatch.setattr(fp8_lm_head.head_ops, "fp8_head_logits", lambda x, state: original(
        x, dc.replace(state, weight=faults.plant_zero_code_fault(state.weight))))
    report = _report(loaded_tiny_models)
    assert not report["passed"] and not report["kernel_checks"]["passed"]
    failure = ("fp8_head [torch]: max relative error 32 > tolerance 0.00781 on 256 one-hot rows (GEMM-sized): "
               "wrong e4m3 codes 0x00 0x80 in 256 rows (scales 2^-20..7168)")
    assert _check(report, "kernel_known_answers")["actual"] == failure
    assert report["optimizations"]["fp8_head"]["active"] is False  # its kernel's known answers failed
    with pytest.raises(LingVerificationError) as err:
        enforce_policy(report, "strict")
    assert str(err.value) == (
        f"vllm-ling refuses to serve: startup verification failed (kernel_known_answers: expected {EXPECTED}, "
        f"got {failure}. Fix: {FIX}). Set VLLM_LING_VERIFY=warn to serve anyway.")
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        enforce_policy(report, "warn")
    assert [r.getMessage() for r in caplog.records if "FAILED" in r.getMessage()] == [
        f"verification check kernel_known_answers FAILED: expected {EXPECTED}, got {failure}. Fix: {FIX}"]


def test_policy_off_runs_no_kernel_check(loaded_tiny_models, monkeypatch):
    from vllm_ling.runtime.verification import known_answers, once

    def must_not_run(*args):
        raise AssertionError("VLLM_LING_VERIFY=off must skip the known-answer checks")

    vllm_config, target, _ = loaded_tiny_models
    monkeypatch.setattr(known_answers, "report_section", must_not_run)
    monkeypatch.setattr(once, "_done", False)
    monkeypatch.setenv("VLLM_LING_VERIFY", "off")
    assert once.verify_once(target, vllm_config) is None


def test_weights_bytes_counts_each_storage_once():
    from vllm_ling.runtime.verification.assembly import weights_bytes

    target = torch.nn.Linear(8, 4, dtype=torch.bfloat16)  # 32 + 4 bf16 values
    target.register_buffer("scale", torch.ones(3, dtype=torch.float32))
    draft = torch.nn.Module()
    draft.head = target  # shared, as the NEXTN draft shares the target's head
    draft.own = torch.nn.Parameter(torch.zeros(5, dtype=torch.float8_e4m3fn))
    assert weights_bytes(target, None) == 36 * 2 + 3 * 4
    assert weights_bytes(target, draft) == 36 * 2 + 3 * 4 + 5


def test_report_states_the_weights_bytes_of_the_loaded_models(loaded_tiny_models):
    _, target, draft = loaded_tiny_models
    report = _report(loaded_tiny_models)
    head = target.lm_head.weight
    # Counting every tensor of both models counts the shared head and embedding twice.
    double = sum(t.numel() * t.element_size() for m in (target, draft) for t in [*m.parameters(), *m.buffers()])
    assert head.numel() * head.element_size() < report["memory"]["weights_bytes"] < double


def test_group_verdict_needs_every_rank():
    """An optimization active on rank 0 but not on a remote rank is inactive for the server,
    one failed rank fails the group (what the metrics show), and so do settings that differ
    between ranks although each rank passed against its own (a stale node-local value)."""
    from vllm_ling.runtime.verification.ranks import merge_ranks

    def rank(i, ok, fp8_head="1"):
        return {"rank": i, "node_ip": f"10.0.0.{i + 1}", "passed": ok,
                "optimizations": {"fp8_head": {"requested": True, "active": ok}},
                "options": {"VLLM_LING_FP8_HEAD": fp8_head, "VLLM_LING_MTP": ""}}

    def report():
        return {"passed": True, "checks": [], "optimizations": {
            "fp8_head": {"requested": True, "active": True, "detail": "Fp8LmHeadMethod"}}}

    merged = report()
    assert merge_ranks(merged, [rank(0, True), rank(1, False)]).passed
    assert merged["passed"] is False
    assert merged["optimizations"]["fp8_head"]["active"] is False
    assert merged["optimizations"]["fp8_head"]["detail"].endswith("inactive on rank(s) 1 (10.0.0.2)")
    assert [r["rank"] for r in merged["ranks"]] == [0, 1]

    # a pipeline stage without the head does not make the last stage's FP8 head inactive
    merged = report()
    first_stage = rank(0, True)
    first_stage["optimizations"]["fp8_head"] = {"requested": False, "active": False, "on_stage": False}
    merge_ranks(merged, [first_stage, rank(1, True)])
    assert merged["passed"] and merged["optimizations"]["fp8_head"]["active"] is True

    merged = report()
    agree = merge_ranks(merged, [rank(0, True, fp8_head="0"), rank(1, True, fp8_head="1")])
    assert not agree.passed and merged["passed"] is False
    assert agree.actual == "VLLM_LING_FP8_HEAD: rank 0 (10.0.0.1) '0', rank 1 (10.0.0.2) '1'"
    assert merged["checks"][-1]["name"] == "ranks_agree"


def test_user_chosen_ngram_passes_with_mtp_not_requested(loaded_tiny_models):
    """--speculative-config '{"method": "ngram"}': no Ling draft is loaded, and that is what
    was asked for; the report says MTP is not requested instead of blaming the plugin."""
    from vllm_ling.runtime.verification import build_report
    from vllm_ling.runtime.verification.speculative import Speculative

    vllm_config, target, _ = loaded_tiny_models
    spec = Speculative("ngram", 2, _speculation("USER"))
    report = build_report(target, None, vllm_config, LingOptions(), spec)
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert report["optimizations"]["mtp"] == {
        "requested": False, "active": False, "detail": "not requested: --speculative-config method ngram"}
    assert _check(report, "speculative_config")["expected"] == "as configured by the user"
    assert _check(report, "model_classes")["passed"]  # not "the plugin did not register its classes"
    assert _check(report, "moe_layers")["expected"].startswith("4 routed-expert layers")  # no NEXTN draft here


def test_checkpoint_without_nextn_layers_reports_mtp_not_requested(loaded_tiny_models):
    from vllm_ling.runtime.verification import build_report
    from vllm_ling.runtime.verification.speculative import Speculative

    vllm_config, target, _ = loaded_tiny_models
    spec = Speculative(None, 0, _speculation("OFF_NO_NEXTN"))
    report = build_report(target, None, vllm_config, LingOptions(), spec)
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert report["optimizations"]["mtp"]["requested"] is False
    assert "num_nextn_predict_layers=0" in report["optimizations"]["mtp"]["detail"]
    # Without the mark, missing speculation under VLLM_LING_MTP=1 is still a failure.
    spec = dataclasses.replace(spec, selection=_speculation("DEFAULT_MTP"))
    assert not _check(build_report(target, None, vllm_config, LingOptions(), spec), "speculative_config")["passed"]


def test_a_speculative_config_other_than_selected_fails(loaded_tiny_models):
    """P5 recorded 'off' (VLLM_LING_MTP=0) while MTP serves."""
    off = _speculation("OFF")
    check = _check(_report(loaded_tiny_models, {"method": "mtp", "num_speculative_tokens": 3, "selection": off}),
                   "speculative_config")
    assert not check["passed"] and (check["expected"], check["actual"]) == ("off (VLLM_LING_MTP=0)", "mtp, 3 tokens")
    vllm_config, _, _ = loaded_tiny_models
    from vllm_ling.runtime.spec_policy import Speculation, recorded_speculation

    # the session's engine config went through P5: vllm-ling's default, recorded on the target's config
    assert recorded_speculation(vllm_config.model_config.hf_config).choice is Speculation.DEFAULT_MTP


def test_speculation_selector():
    from vllm_ling.runtime.spec_policy import Speculation, select_speculation

    assert select_speculation(LingOptions(), True, 0, 2).choice is Speculation.USER  # the user's config wins
    assert select_speculation(LingOptions(mtp=False), False, 1, 2).reason == "VLLM_LING_MTP=0"
    assert select_speculation(LingOptions(), False, 0, 2).choice is Speculation.OFF_PIPELINE
    assert select_speculation(LingOptions(), False, 0, 1).choice is Speculation.OFF_NO_NEXTN
    sel = select_speculation(LingOptions(num_spec_tokens=2), False, 1, 1)
    assert (sel.choice, sel.reason) == (Speculation.DEFAULT_MTP, "vllm-ling default: mtp, 2 tokens")


def test_pipeline_stages_check_their_own_layers_head_and_draft(loaded_tiny_models, monkeypatch):
    from vllm.model_executor.models.utils import PPMissingLayer

    from vllm_ling.layers.readers import readers
    from vllm_ling.runtime.verification.census import take_census
    from vllm_ling.runtime.verification.draft_sharing import check_draft_sharing
    from vllm_ling.runtime.verification.recorded import check_recorded
    from vllm_ling.runtime.verification.speculative import Speculative
    from vllm_ling.runtime.verification.stage import Stage

    vllm_config, target, draft = loaded_tiny_models
    spec = Speculative.in_force(vllm_config)
    config = vllm_config.model_config.hf_config
    n = config.num_hidden_layers

    def rows(stage, with_draft):
        return check_recorded(take_census(target, draft if with_draft else None, readers()), readers(), config,
                              stage, with_draft)

    whole = rows(Stage(0, 1, 0, n), True)["moe_layers"]
    assert whole.passed and "pipeline" not in whole.expected
    # the full model measured against a later stage's range: the stage's count is expected
    later = rows(Stage(1, 2, n // 2, n), False)["moe_layers"]
    stage_moe = sum(1 for i in range(n // 2, n) if i >= config.first_k_dense_replace)
    assert not later.passed and later.actual.endswith(f"; 4 routed-expert layers where the stage has {stage_moe}")
    assert later.expected.endswith(f"on pipeline stage 1 of 2 (layers {n // 2}..{n - 1})")
    with swapped(target, "lm_head", PPMissingLayer()):
        assert rows(Stage(0, 2, 0, n // 2), False)["lm_head"].passed  # the first stage has no head
        last = rows(Stage(1, 2, n // 2, n), False)["lm_head"]  # the last stage must have it
        assert not last.passed and "0 LM heads where the stage has 1" in last.actual
    assert check_draft_sharing(target, None, spec, Stage(0, 2, 0, n // 2)).passed
    assert not check_draft_sharing(target, None, spec, Stage(1, 2, n // 2, n)).passed  # MTP needs the draft there
    # the first stage's report: its FP8 head entry says the head is elsewhere, so the group's verdict
    # (ranks.merge_ranks) leaves it out instead of calling the last stage's head inactive
    from vllm_ling.runtime.verification import assembly, build_report

    monkeypatch.setattr(assembly, "pipeline_stage", lambda model, layers: Stage(0, 2, 0, n // 2))
    with swapped(target, "lm_head", PPMissingLayer()):
        report = build_report(target, None, vllm_config, LingOptions(), Speculative(None, 0, _speculation("OFF_PIPELINE")))
    assert report["optimizations"]["fp8_head"] == {"requested": False, "active": False,
                                                  "detail": "no LM heads on this pipeline stage", "on_stage": False}


def test_kda_merge_is_reported_from_the_loaded_layers(loaded_tiny_models):
    _, target, _ = loaded_tiny_models
    # the dense block-FP8 method every other linear got (CPU: chosen by a known-answer check)
    method = type(target.model.layers[0].self_attn.o_proj.quant_method).__name__
    report = _report(loaded_tiny_models)
    check = _check(report, "kda_merged_in_proj")
    assert check["passed"], check
    assert check["actual"] == f"5 x one qkvfg_proj linear (5120x256 = 5 x 1024 rows; {method})"
    assert report["optimizations"]["kda_merged_in_proj"] == {"requested": True, "active": True,
                                                             "detail": check["actual"]}


def test_a_kda_layer_recording_the_merge_but_running_vllms_linears_fails(loaded_tiny_models):
    _, target, _ = loaded_tiny_models
    layer = target.model.layers[1].self_attn
    with swapped(layer, "qkvfg_proj", None):  # its forward takes vLLM's linears where it holds no merge
        report = _report(loaded_tiny_models)
    check = _check(report, "kda_merged_in_proj")
    assert not check["passed"]
    assert ("not the recorded selection: [\"target.model.layers.1.self_attn (selected merged, serves vLLM's "
            "in-projection linears)\"]") in check["actual"]
    assert report["optimizations"]["kda_merged_in_proj"]["active"] is False


def test_kda_merge_with_a_shard_the_checkpoint_did_not_fill_is_named(loaded_tiny_models):
    _, target, _ = loaded_tiny_models
    linear = target.model.layers[2].self_attn.qkvfg_proj
    with swapped(linear, "ling_loaded_shards", linear.ling_loaded_shards - {("weight", "f_proj")}):
        report = _report(loaded_tiny_models)
    check = _check(report, "kda_merged_in_proj")
    assert not check["passed"]
    assert ("target.model.layers.2.self_attn (selected merged, serves a malformed qkvfg_proj (weight.f_proj))"
            in check["actual"])
    assert report["optimizations"]["kda_merged_in_proj"]["active"] is False


def test_unmerged_kda_layers_pass_with_their_reason_but_are_not_active(loaded_tiny_models, monkeypatch):
    """A layer the merge refused for a checkpoint property records vLLM's linears as a fallback and
    serves them: the row passes naming the reason; the optimization is inactive."""
    from vllm_ling.models.kda_merged_in_proj import select_kda_merged_in_proj

    _, target, _ = loaded_tiny_models
    layer = target.model.layers[1].self_attn
    refused = select_kda_merged_in_proj(True, True, ("f_proj",))
    _plant(monkeypatch, layer, refused)
    with swapped(layer, "qkvfg_proj", None):
        report = _report(loaded_tiny_models)
    check = _check(report, "kda_merged_in_proj")
    assert check["passed"], check["actual"]
    assert check["actual"].endswith("; 1 x fell back from merged: the projections differ in precision (BF16: f_proj)")
    assert report["optimizations"]["kda_merged_in_proj"]["requested"] is True
    assert report["optimizations"]["kda_merged_in_proj"]["active"] is False


def _bf16_gemv_selected(layer, fallback_reason=None):
    from vllm_ling.ops.small_gemv.selection import GemvPath
    from vllm_ling.selection import record

    selection = Selection(Feature.BF16_GEMV, GemvPath.LING, "CUDA, the small GEMV runs")
    if fallback_reason:
        selection = Selection(Feature.BF16_GEMV, GemvPath.VLLM, fallback_reason, fallback_from=GemvPath.LING)
    record(layer, selection)
    return layer


def _with_planted_linears(monkeypatch, planted):
    """The census also finds ``planted`` (name, module) pairs (stand-ins for CUDA-served linears)."""
    from vllm_ling.runtime.verification import assembly, census

    real = census.take_census

    def take(target, draft, readers):
        found = real(target, draft, readers)
        more = [census.Entry(name, m, r, census.recorded(m, r.feature), r.served(m))
                for name, m in planted for r in readers if r.feature is Feature.BF16_GEMV]
        return census.Census(tuple(more) + found.entries)

    monkeypatch.setattr(assembly, "take_census", take)


def test_requested_small_gemv_needs_the_unquantized_linears_on_it(loaded_tiny_models, monkeypatch):
    # every unquantized linear records the small GEMV while the CPU-loaded model serves vLLM's GEMM:
    # verification fails and says what it found; as loaded (CPU: vLLM's GEMM) it passes, inactive
    layers = _census(loaded_tiny_models).of(Feature.BF16_GEMV)
    assert layers
    for e in layers:
        _plant(monkeypatch, e.module, Selection(Feature.BF16_GEMV, _ling(), "CUDA, the small GEMV runs"))
    report = _report(loaded_tiny_models)
    check = _check(report, "small_bf16_layers")
    assert not check["passed"] and check["actual"].startswith(f"{len(layers)} x vllm; not the recorded selection: [")
    assert "(selected ling, serves vllm)" in check["actual"]
    assert report["optimizations"]["small_bf16_decode"] == {"requested": True, "active": False,
                                                             "detail": check["actual"]}
    monkeypatch.undo()
    report = _report(loaded_tiny_models)
    assert _check(report, "small_bf16_layers")["passed"]
    assert report["optimizations"]["small_bf16_decode"]["requested"] is False


def _ling():
    from vllm_ling.ops.small_gemv.selection import GemvPath

    return GemvPath.LING


def test_small_gemv_fallback_is_reported_not_fatal(loaded_tiny_models, monkeypatch):
    # e.g. --dtype float16: the small GEMV holds no unquantized linear (one WARNING each at load,
    # each recording its fallback to vLLM's GEMM); the check passes, the optimization is requested
    # and inactive, named
    from vllm_ling.layers.small_bf16_cuda import LingSmallBf16LinearMethod

    layer = _bf16_gemv_selected(types.SimpleNamespace(
        quant_method=object.__new__(LingSmallBf16LinearMethod), ling_small_gemv=None),
        fallback_reason="the small GEMV cannot hold it: weight dtype torch.float16 is not BF16")
    _with_planted_linears(monkeypatch, [("target.model.layers.0.self_attn.b_proj", layer)])
    report = _report(loaded_tiny_models)
    check = _check(report, "small_bf16_layers")
    assert check["passed"] and "fell back from ling: the small GEMV cannot hold it" in check["actual"]
    entry = report["optimizations"]["small_bf16_decode"]
    assert entry["requested"] and not entry["active"] and "float16" in entry["detail"]


@pytest.mark.parametrize("wrong_from_rows", [None, 5])
def test_small_gemv_known_answer_runs_every_launch_shape(loaded_tiny_models, monkeypatch, wrong_from_rows):
    # the kernel's launch shape follows the row count (direct or staged rows, CTA width): the check
    # runs one row count per shape the layer is served with, and a kernel wrong only for staged
    # rows (5 and more) fails it
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_ling.layers.small_bf16_cuda import LingSmallBf16LinearMethod
    from vllm_ling.ops.small_gemv.kernel import BF16_MAX_ROWS, launch_row_counts

    weight = torch.randn((32, 256), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    layer = _bf16_gemv_selected(types.SimpleNamespace(quant_method=object.__new__(LingSmallBf16LinearMethod),
                                                      ling_small_gemv=weight, weight=weight))
    seen = []

    def kernel(layer, x):
        seen.append(x.shape[0])
        out = F.linear(x.double(), layer.weight.double())
        return (out * (2 if wrong_from_rows and x.shape[0] >= wrong_from_rows else 1)).to(torch.bfloat16)

    monkeypatch.setattr(LingSmallBf16LinearMethod, "apply_small_gemv", staticmethod(kernel))
    monkeypatch.setattr(UnquantizedLinearMethod, "apply", lambda self, layer, x, bias=None: F.linear(x, layer.weight))
    _with_planted_linears(monkeypatch, [("target.model.layers.0.self_attn.b_proj", layer)])
    report = _report(loaded_tiny_models)
    check = _check(report, "small_bf16_layers")
    assert tuple(seen) == launch_row_counts(32, BF16_MAX_ROWS)
    assert check["passed"] is (wrong_from_rows is None), check["actual"]
    assert "known answer on target.model.layers.0.self_attn.b_proj" in check["actual"]
