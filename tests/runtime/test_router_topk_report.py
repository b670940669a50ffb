"""The router top-k in the startup verification, the report and the metrics, on the loaded tiny
models: the CPU platform's recorded CPURouter, vLLM's own runner class (nothing recorded), and active
(each runner's router rebuilt as vLLM's factory builds it on CUDA and taken over by vllm-ling's, its
kernel replaced by the plain-PyTorch reference, so the known-answer check runs through the served
router's own select_experts)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import known_answer_faults as faults  # noqa: E402
from conftest import exported_samples  # noqa: E402
from vllm_ling.options import LingOptions, RouterTopk  # noqa: E402

RUNNERS = 5  # the tiny model: 4 MoE layers + the NEXTN layer


def _report(models, options=None):
    from vllm_ling.runtime.verification import build_report

    vllm_config, target, draft = models
    return build_report(target, draft, vllm_config, options or LingOptions(), platform="cuda")


def _check(report):
    return next(c for c in report["checks"] if c["name"] == "router_topk")


def _topk_results(report):
    return [r for r in report["kernel_checks"]["results"] if r["name"] == "router_topk"]


def _runners(models):
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    _, target, draft = models
    return [m for model in (target, draft) for m in model.modules() if isinstance(m, MoERunner)]


def test_cpu_runners_record_vllms_cpurouter_and_say_so(loaded_tiny_models):
    from vllm_ling.runtime.verification import build_report

    vllm_config, target, draft = loaded_tiny_models
    report = build_report(target, draft, vllm_config, LingOptions())
    assert report["optimizations"]["router_topk"] == {
        "requested": False, "active": False, "detail": f"not selected: {RUNNERS} x the CPU platform: vLLM's CPURouter"}
    check = _check(report)
    assert check["passed"] and check["actual"] == f"{RUNNERS} x vLLM's CPURouter"
    assert _topk_results(report) == []


@pytest.fixture
def lings_routers(loaded_tiny_models, monkeypatch):
    """Every runner of target and draft routed as on CUDA: vLLM's GroupedTopKRouter built from the
    loaded CPU router's configuration and bias, handed to the runner's own ling_route (the tiny
    model's 16 experts are below the kernel's 32: its shape rule is lifted here, the kernel replaced
    by the reference)."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    from vllm_ling.layers import router_topk as R
    from vllm_ling.ops.moe.routing import grouped_topk
    from vllm_ling.ops.router_topk import kernel as topk_kernel
    from vllm_ling.selection import SELECTIONS_ATTR, Platform

    monkeypatch.setattr(R, "serving_platform", lambda: Platform.CUDA)
    monkeypatch.setattr(R, "_ling_model", lambda: True)
    monkeypatch.setattr(topk_kernel, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(topk_kernel, "shape_problems", lambda *a: [])
    monkeypatch.setattr(topk_kernel, "grouped_topk_cuda",
                        lambda logits, bias, k, g, tg, renorm=True, scale=1.0:
                        grouped_topk(logits, k, g, tg, bias, renorm, scale))
    runners, vllms = _runners(loaded_tiny_models), []
    assert len(runners) == RUNNERS
    for runner in runners:
        cpu = runner.router
        monkeypatch.setattr(runner, "router", cpu)  # restored after the test
        monkeypatch.setitem(runner.__dict__, SELECTIONS_ATTR, dict(runner.__dict__[SELECTIONS_ATTR]))
        vllms.append(GroupedTopKRouter(
            top_k=cpu.top_k, global_num_experts=cpu.global_num_experts, num_expert_group=cpu.num_expert_group,
            topk_group=cpu.topk_group, renormalize=cpu.renormalize, scoring_func=cpu.scoring_func,
            routed_scaling_factor=cpu.routed_scaling_factor, e_score_correction_bias=cpu.e_score_correction_bias))
        runner.ling_route(vllms[-1])
    return list(zip(runners, vllms))


def test_active_when_every_router_runs_the_kernel_and_it_passes(loaded_tiny_models, lings_routers, monkeypatch,
                                                                tmp_path):
    report = _report(loaded_tiny_models)
    assert _check(report)["passed"] and _check(report)["actual"] == f"{RUNNERS} x ling"
    [result] = _topk_results(report)  # one routing configuration: one check
    assert result["passed"] and result["kernel"] == "vllm-ling grouped top-k (one CTA per token)"
    assert result["cases"] == 3
    assert report["optimizations"]["router_topk"] == {
        "requested": True, "active": True, "detail": f"{RUNNERS} x ling; known answers passed"}

    assert exported_samples(report, tmp_path, monkeypatch, {
        "vllm_ling:optimization_active": {"optimization": "router_topk"},
        "vllm_ling:kernel_check_passed": {"kernel": "router_topk", "impl": result["kernel"]}}) == {
        "vllm_ling:optimization_active": 1, "vllm_ling:kernel_check_passed": 1}


def test_the_known_answers_run_on_the_device_of_the_served_routers_bias(loaded_tiny_models, lings_routers,
                                                                        monkeypatch):
    """The runner holds no parameter of its own (its experts and gate are submodules): the check's device
    is read from the router's bias, where the kernel reads it while serving."""
    from vllm_ling.layers import known_answer as layer_checks
    from vllm_ling.ops.known_answer import skipped_result

    seen = []

    def spy(runner, device):
        seen.append(device)
        return skipped_result("router_topk", "spy", "only the device is read here")

    monkeypatch.setattr(layer_checks, "check_router_topk", spy)
    for runner, _ in lings_routers:
        monkeypatch.setattr(runner.router, "e_score_correction_bias",
                            torch.nn.Parameter(torch.zeros(runner.router.global_num_experts, device="meta")))
    _report(loaded_tiny_models)
    assert seen == [torch.device("meta")]


def test_the_known_answers_leave_the_served_routers_bias_alone(loaded_tiny_models, lings_routers):
    before = [r.router.e_score_correction_bias.detach().clone() for r, _ in lings_routers]
    _report(loaded_tiny_models)
    assert all(torch.equal(r.router.e_score_correction_bias, b) for (r, _), b in zip(lings_routers, before))


@pytest.mark.parametrize("fault", ["no_bias", "group_max", "biased_weights"])
def test_a_wrong_kernel_fails_the_known_answers_and_the_optimization(loaded_tiny_models, lings_routers, monkeypatch,
                                                                     fault):
    from vllm_ling.ops.known_answer import Routing
    from vllm_ling.ops.router_topk import kernel as topk_kernel

    def wrong(logits, bias, k, g, tg, renorm=True, scale=1.0):
        return faults.misrouting(fault, Routing(logits.shape[1], g, tg, k, renorm, scale))(logits, bias)

    monkeypatch.setattr(topk_kernel, "grouped_topk_cuda", wrong)
    report = _report(loaded_tiny_models)
    [result] = _topk_results(report)
    assert not result["passed"] and "tokens routed to other experts or weights" in result["failing_inputs"][0]
    assert report["optimizations"]["router_topk"]["active"] is False
    assert report["optimizations"]["router_topk"]["detail"].endswith("known answers FAILED")
    assert not report["passed"]  # kernel_known_answers fails: strict refuses to serve


def test_a_runner_serving_other_than_its_selection_fails(loaded_tiny_models, lings_routers, monkeypatch):
    """A planted divergence: a runner records the kernel while it holds vLLM's router."""
    runner, vllms_router = lings_routers[0]
    monkeypatch.setattr(runner, "router", vllms_router)
    report = _report(loaded_tiny_models)
    check = _check(report)
    assert not check["passed"] and not report["passed"]
    assert ("not the recorded selection: [\"target.model.layers.2.mlp.experts (selected ling, serves vLLM's "
            "GroupedTopKRouter)\"]" in check["actual"])


def test_opted_out_on_cuda(loaded_tiny_models, lings_routers, monkeypatch):
    monkeypatch.setenv("VLLM_LING_ROUTER_TOPK", "vllm")
    for runner, vllms_router in lings_routers:
        runner.ling_route(vllms_router)
    report = _report(loaded_tiny_models, LingOptions(router_topk=RouterTopk.VLLM))
    assert report["optimizations"]["router_topk"] == {
        "requested": False, "active": False,
        "detail": f"not selected: {RUNNERS} x opted out (VLLM_LING_ROUTER_TOPK=vllm)"}
    assert _check(report)["passed"] and _topk_results(report) == []


def test_vllms_own_runners_record_nothing_and_fail_naming_them(loaded_tiny_models, monkeypatch):
    from vllm_ling.selection import SELECTIONS_ATTR

    for runner in _runners(loaded_tiny_models):
        monkeypatch.delitem(runner.__dict__, SELECTIONS_ATTR)  # as vLLM's own MoERunner is built
    check = _check(_report(loaded_tiny_models))
    assert not check["passed"] and "no selection recorded: ['target.model.layers.2.mlp.experts'" in check["actual"]
    assert "VLLM_LING_ROUTER_TOPK=vllm" in check["fix"]
