"""The router top-k layer: its selection rules and the router it serves (CPU).

The kernel itself is tested on the GPU (tests/ops/test_router_topk_gpu.py); here it is replaced by
the plain-PyTorch reference, and what the served router returns is compared with an independent
float64 rewrite of Ling's routing (tests/known_answer_faults.py)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm")

import known_answer_faults as faults  # noqa: E402
from vllm_ling.layers import router_topk as R  # noqa: E402
from vllm_ling.ops.known_answer import Routing  # noqa: E402
from vllm_ling.ops.moe.routing import grouped_topk  # noqa: E402
from vllm_ling.ops.router_topk import kernel as topk_kernel  # noqa: E402
from vllm_ling.options import LingOptionError, LingOptions, RouterTopk  # noqa: E402
from vllm_ling.selection import Feature, Platform, recorded  # noqa: E402

LING = dict(prefix="model.layers.5.mlp.experts", router_class="GroupedTopKRouter", ling_model=True,
            scoring_func="sigmoid", has_bias=True, num_experts=512, n_group=8, topk_group=4, top_k=8)
ON = LingOptions(router_topk=RouterTopk.LING)


@pytest.fixture
def records(ling_records):
    return ling_records


@pytest.fixture
def kernel_runs(monkeypatch):
    monkeypatch.setattr(topk_kernel, "unavailable_reason", lambda device=None: None)


def _warnings(records):
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_option_parses_and_defaults_to_ling():
    assert LingOptions.from_env({}).router_topk is RouterTopk.LING
    assert LingOptions.from_env({"VLLM_LING_ROUTER_TOPK": "vllm"}).router_topk is RouterTopk.VLLM
    with pytest.raises(LingOptionError, match="VLLM_LING_ROUTER_TOPK"):
        LingOptions.from_env({"VLLM_LING_ROUTER_TOPK": "fast"})


def test_lings_router_takes_the_kernel(kernel_runs, records):
    selection = R.decide(R.RouterFacts(**LING), ON)
    assert selection.feature is Feature.ROUTER_TOPK and selection.choice is RouterTopk.LING
    assert _warnings(records) == []


def test_the_cpu_platform_keeps_vllms_router_silently(records, monkeypatch):
    monkeypatch.setattr(topk_kernel, "unavailable_reason", lambda device=None: "no CUDA device")  # not asked
    selection = R.decide(R.RouterFacts(**{**LING, "router_class": "CPURouter"}), ON, Platform.CPU)
    assert selection.choice is RouterTopk.VLLM and selection.reason == "the CPU platform: vLLM's CPURouter"
    assert records == []


def test_opt_out_warns_once_and_keeps_vllms_router(kernel_runs, records):
    for _ in range(3):
        selection = R.decide(R.RouterFacts(**LING), LingOptions(router_topk=RouterTopk.VLLM))
        assert selection.reason == "opted out (VLLM_LING_ROUTER_TOPK=vllm)"
    assert len(_warnings(records)) == 1 and "explicit choice" in _warnings(records)[0]


@pytest.mark.parametrize("change,words", [
    ({"ling_model": False}, "another model's layer"),
    ({"router_class": "FusedTopKBiasRouter"}, "vLLM built a FusedTopKBiasRouter"),
    ({"scoring_func": "softmax"}, "softmax scores"),
    ({"has_bias": False}, "no expert bias"),
])
def test_other_routing_keeps_vllms_router_without_a_warning(records, change, words, monkeypatch):
    monkeypatch.setattr(topk_kernel, "unavailable_reason", lambda device=None: "sm_75: needs sm_80+")
    reason = R.decide(R.RouterFacts(**{**LING, **change}), ON).reason
    assert reason.startswith("not Ling's routing") and words in reason
    assert _warnings(records) == []


@pytest.mark.parametrize("change,words", [
    ({"num_experts": 16, "n_group": 4, "topk_group": 2, "top_k": 2}, "16 experts is not a multiple of 32"),
    ({"n_group": 64}, "64 groups of 512 experts"),
    ({"top_k": 40}, "top_k=40 is outside 1..32"),
    ({"eplb": True}, "expert-parallel load balancing"),
    ({"skip_padding": True}, "skip_padding"),
    ({"fused_shared_experts": 1}, "1 shared expert(s) fused into the picks"),
])
def test_lings_routing_the_kernel_cannot_hold_is_one_warning(records, change, words, monkeypatch):
    monkeypatch.setattr(topk_kernel, "unavailable_reason", lambda device=None: "sm_75: needs sm_80+")  # not asked
    for _ in range(2):
        assert words in R.decide(R.RouterFacts(**{**LING, **change}), ON).reason
    warned = _warnings(records)
    assert len(warned) == 1 and words in warned[0] and "model.layers.5.mlp.experts" in warned[0]


def test_requested_but_unavailable_is_an_error_naming_the_opt_out(monkeypatch):
    monkeypatch.setattr(topk_kernel, "unavailable_reason", lambda device=None: "sm_75: needs sm_80+")
    with pytest.raises(R.RouterTopkUnavailable,
                       match=r"model\.layers\.5\.mlp\.experts: sm_75.*VLLM_LING_ROUTER_TOPK=vllm"):
        R.decide(R.RouterFacts(**LING), ON)


def _vllms_router(r: Routing, bias: torch.Tensor):
    """The router vLLM 0.32's factory builds for a Ling MoE layer on CUDA."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    return GroupedTopKRouter(top_k=r.top_k, global_num_experts=r.num_experts, num_expert_group=r.n_group,
                             topk_group=r.topk_group, renormalize=r.renormalize, scoring_func="sigmoid",
                             routed_scaling_factor=r.scale, e_score_correction_bias=torch.nn.Parameter(bias))


@pytest.fixture
def reference_kernel(monkeypatch):
    """The kernel's entry point replaced by the plain-PyTorch reference, with the kernel's signature."""
    calls = []

    def run(logits, bias, top_k, n_group, topk_group, renormalize=True, routed_scaling_factor=1.0):
        calls.append(logits.shape[0])
        return grouped_topk(logits, top_k, n_group, topk_group, bias, renormalize, routed_scaling_factor)

    monkeypatch.setattr(topk_kernel, "grouped_topk_cuda", run)
    return calls


def test_the_kernels_router_takes_over_vllms_routing_and_bias(reference_kernel):
    r = Routing(512, 8, 4, 8, True, 2.5)
    bias = torch.randn(512) * 0.1
    theirs = _vllms_router(r, bias)
    ours = R.ling_router_class().taking_over(theirs)
    assert ours.e_score_correction_bias is theirs.e_score_correction_bias  # the loaded parameter, not a copy
    assert ours.routing_method_type == theirs.routing_method_type  # what vLLM's kernels are selected by

    logits = torch.randn(5, 512) * 3
    weights, ids = ours.select_experts(hidden_states=torch.empty(5, 0), router_logits=logits,
                                       topk_indices_dtype=torch.int64)
    assert reference_kernel == [5] and ids.dtype == torch.int64  # vLLM's dtype conversion still applies
    want_w, want_ids = faults.misrouting("none", r)(logits, bias)
    torch.testing.assert_close(weights.double(), want_w.double(), rtol=1e-5, atol=0)
    assert torch.equal(ids.int(), want_ids)


def test_the_runner_holds_the_router_its_selection_names(reference_kernel, kernel_runs, monkeypatch):
    """LingMoERunner.ling_route: the kernel's router where Ling's routing is held, vLLM's otherwise;
    the selection recorded on the runner, read back by the verification's reader."""
    monkeypatch.setattr(R, "serving_platform", lambda: Platform.CUDA)
    monkeypatch.setattr(R, "_ling_model", lambda: True)
    runner = R.ling_runner_class().__new__(R.ling_runner_class())  # the state ling_route reads and writes
    torch.nn.Module.__init__(runner)
    runner.layer_name = "model.layers.5.mlp.experts"
    theirs = _vllms_router(Routing(512, 8, 4, 8, True, 2.5), torch.zeros(512))

    assert runner.ling_route(theirs).choice is RouterTopk.LING
    assert type(runner.router) is R.ling_router_class() and R.served(runner).key == (RouterTopk.LING,)
    assert recorded(runner, Feature.ROUTER_TOPK).choice is RouterTopk.LING

    monkeypatch.setenv("VLLM_LING_ROUTER_TOPK", "vllm")
    assert runner.ling_route(theirs).choice is RouterTopk.VLLM
    assert runner.router is theirs and R.served(runner).key == (RouterTopk.VLLM,)
    assert R.served(runner).label == "vLLM's GroupedTopKRouter"


def test_the_runner_is_installed_for_vllms_moerunner():
    from vllm.model_executor.custom_op import op_registry_oot

    R.register_router_topk()
    R.register_router_topk()  # idempotent: vLLM loads plugins more than once
    assert op_registry_oot["MoERunner"] is R.ling_runner_class()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu marker)")
def test_on_the_gpu_the_served_router_passes_its_known_answers_and_picks_as_vllms():
    """The real kernel behind the served router: the startup check's known answers, then vLLM's own
    router on the same logits (same experts per token, same weights). Run on the device with
    `python -m pytest -m gpu tests/layers/test_router_topk.py` (the lease's `cuts` phase)."""
    import types

    from vllm_ling.layers.known_answer import check_router_topk

    r = Routing(512, 8, 4, 8, True, 2.5)
    theirs = _vllms_router(r, (torch.randn(512) * 0.1).cuda())
    runner = types.SimpleNamespace(router=R.ling_router_class().taking_over(theirs))
    result = check_router_topk(runner, "cuda")
    assert result.passed and result.kernel == R.KERNEL_LABEL, result.message()

    for tokens in (1, 4, 300):
        logits = torch.randn(tokens, 512, device="cuda") * 3
        x = torch.empty(tokens, 0, device="cuda")
        ours_w, ours_ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
        their_w, their_ids = theirs.select_experts(hidden_states=x, router_logits=logits)
        ours = torch.zeros(tokens, 512, device="cuda").scatter_(1, ours_ids.long(), ours_w)
        their = torch.zeros(tokens, 512, device="cuda").scatter_(1, their_ids.long(), their_w)
        torch.testing.assert_close(ours, their, rtol=1e-5, atol=1e-6)  # vLLM may order its picks otherwise
