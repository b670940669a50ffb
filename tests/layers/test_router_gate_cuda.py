"""The CUDA router-GEMV gate: its platform-independent rules (CPU).

The kernel itself is tested on the GPU (tests/ops/small_gemv/test_router_gemv_gpu.py); here it is replaced by the float64
reference cast to fp32, and every output is compared with an independent float64 F.linear.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm")  # the GPU box runs tests/ops only: it has no vLLM

from vllm_ling.layers import router_gate_cuda as R  # noqa: E402
from vllm_ling.ops.small_gemv import router as router_ops  # noqa: E402
from vllm_ling.ops.small_gemv.selection import GemvPath  # noqa: E402
from vllm_ling.options import LingOptionError, LingOptions, RouterGemv  # noqa: E402
from vllm_ling.selection import Platform  # noqa: E402

LING = dict(prefix="model.layers.5.mlp.gate", num_experts=512, hidden_size=2560, weight_dtype=torch.float32,
            has_bias=False, unquantized=True, out_dtype=torch.float32)
TOL = 2.0 ** -16  # of |x| @ |w|.T, as the kernel's own tests


@pytest.fixture
def records(ling_records):
    return ling_records


@pytest.fixture
def kernel_runs(monkeypatch):
    monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: None)


def _warnings(records):
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_option_parses_and_defaults_to_ling():
    assert LingOptions.from_env({}).router_gemv is RouterGemv.LING
    assert LingOptions.from_env({"VLLM_LING_ROUTER_GEMV": "vllm"}).router_gemv is RouterGemv.VLLM
    with pytest.raises(LingOptionError, match="VLLM_LING_ROUTER_GEMV"):
        LingOptions.from_env({"VLLM_LING_ROUTER_GEMV": "fast"})


def test_lings_fp32_gate_takes_the_kernel(kernel_runs, records):
    assert R.decide(R.GateFacts(**LING), LingOptions(router_gemv=RouterGemv.LING)).choice is GemvPath.LING
    assert _warnings(records) == []


def test_opt_out_warns_once_and_keeps_gatelinear(kernel_runs, records):
    for _ in range(3):  # one WARNING for all the gates
        assert R.decide(R.GateFacts(**LING), LingOptions(router_gemv=RouterGemv.VLLM)).reason == "opted out (VLLM_LING_ROUTER_GEMV=vllm)"
    assert len(_warnings(records)) == 1 and "explicit choice" in _warnings(records)[0]


@pytest.mark.parametrize("change,words", [
    ({"weight_dtype": torch.bfloat16}, "bfloat16 weights"),
    ({"has_bias": True}, "has a bias"),
    ({"unquantized": False}, "quantized"),
    ({"out_dtype": torch.bfloat16}, "bfloat16 logits"),
])
def test_other_kinds_of_gate_keep_gatelinear_without_a_warning(kernel_runs, records, change, words, monkeypatch):
    # e.g. another model's BF16 gate: not what the kernel is for, and not an error even where it cannot run
    monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: "sm_75: needs sm_80+")
    reason = R.decide(R.GateFacts(**{**LING, **change}), LingOptions(router_gemv=RouterGemv.LING)).reason
    assert reason.startswith("not an fp32 unquantized bias-free gate") and words in reason
    assert _warnings(records) == []


@pytest.mark.parametrize("change,words", [
    ({"hidden_size": 8192}, "K=8192 exceeds 4096"),
    ({"hidden_size": 2500}, "K=2500 is not a multiple of 128"),
    ({"vllm_kernel": "BF16x3 router GEMM"}, "vLLM has a specialized kernel for this gate here (BF16x3 router GEMM)"),
    ({"batch_invariant": True}, "batch-invariant"),
])
def test_an_fp32_gate_the_kernel_cannot_take_is_one_warning(records, change, words, monkeypatch):
    monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: "sm_75: needs sm_80+")  # not needed
    for _ in range(2):
        assert words in R.decide(R.GateFacts(**{**LING, **change}), LingOptions(router_gemv=RouterGemv.LING)).reason
    warned = _warnings(records)
    assert len(warned) == 1 and words in warned[0] and "model.layers.5.mlp.gate" in warned[0]


def test_requested_but_unavailable_is_an_error_naming_the_opt_out(monkeypatch):
    monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: "sm_75: needs sm_80+")
    with pytest.raises(R.RouterGemvUnavailable, match=r"model\.layers\.5\.mlp\.gate: sm_75.*VLLM_LING_ROUTER_GEMV=vllm"):
        R.decide(R.GateFacts(**LING), LingOptions(router_gemv=RouterGemv.LING))


def test_fake_impl_gives_the_shape_and_dtype_under_symbolic_sizes(kernel_runs):
    from torch._subclasses.fake_tensor import FakeTensorMode

    gate = torch.nn.Module()
    gate.weight = torch.zeros(16, 256)
    key = R.register_gate(gate, "test.fake.gate")
    with FakeTensorMode():
        out = torch.ops.vllm_ling.router_logits(torch.empty(5, 256, dtype=torch.bfloat16), key)
    assert out.shape == (5, 16) and out.dtype == torch.float32


def test_gate_names_stay_unique_and_follow_the_prefix():
    a, b = torch.nn.Module(), torch.nn.Module()
    assert R.register_gate(a, "model.layers.9.mlp.gate") == "model.layers.9.mlp.gate"
    assert R.register_gate(a, "model.layers.9.mlp.gate") == "model.layers.9.mlp.gate"  # same gate, same name
    assert R.register_gate(b, "model.layers.9.mlp.gate") == "model.layers.9.mlp.gate#2"


# ---- the subclass, built for real (vLLM's layers read the tensor-parallel group)

@pytest.fixture
def tp1(loaded_tiny_models, monkeypatch):
    """Model-parallel groups of one rank, set up by the session's loaded tiny models; gates built
    as on CUDA (the platform whose selection can be the kernel)."""
    monkeypatch.setattr(R, "serving_platform", lambda: Platform.CUDA)


def _gate(hidden=256, experts=16, **kwargs):
    kwargs = {"out_dtype": torch.float32, "params_dtype": torch.float32, "prefix": "test.mlp.gate", **kwargs}
    gate = R.router_gate_class()(hidden, experts, **kwargs)
    gate.weight.data.copy_(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(1)))
    gate._cpu_skip_gemm_dispatch = True  # vLLM-CPU's GateLinear path: plain F.linear, weight kept
    gate.quant_method.process_weights_after_loading(gate)
    return gate


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel replaced by the float64 reference cast to fp32; the row counts it saw."""
    calls = []

    def reference_kernel(x, weight):
        calls.append(x.shape[0])
        assert x.dtype == torch.bfloat16 and weight.dtype == torch.float32
        return router_ops.reference_router_logits(x, weight).float()

    monkeypatch.setattr(router_ops, "router_logits", reference_kernel)
    return calls


def _assert_logits(out, x, weight):
    # independent of both paths: float64 F.linear, judged against |x| @ |w|.T
    ref = torch.nn.functional.linear(x.double(), weight.double())
    bound = torch.nn.functional.linear(x.double().abs(), weight.double().abs())
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out.double() - ref).abs() <= TOL * bound).all()


def test_dispatch_by_row_count_kernel_then_gatelinear(tp1, kernel_runs, kernel_calls):
    gate = _gate()
    assert gate.ling_router_gemv and gate.ling_router_key == "test.mlp.gate"
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, router_ops.MAX_ROWS, router_ops.MAX_ROWS + 1, 40):
        x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
        out, bias = gate(x)
        assert bias is None
        _assert_logits(out, x, gate.weight)
    assert kernel_calls == [1, 2, router_ops.MAX_ROWS]  # above MAX_ROWS: GateLinear's own path


def test_dispatch_happens_inside_one_traceable_op(tp1, kernel_runs, kernel_calls):
    # vLLM compiles with fullgraph=True and symbolic batch sizes: the gate must trace to one opaque
    # op and the op, not the trace, picks the path by row count
    gate = _gate()
    compiled = torch.compile(lambda x: gate(x)[0], fullgraph=True, dynamic=True, backend="eager")
    gen = torch.Generator().manual_seed(3)
    for rows in (3, 33, 5):
        x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
        _assert_logits(compiled(x), x, gate.weight)
    assert kernel_calls == [3, 5]


def test_misaligned_rows_are_copied_for_the_kernel(tp1, kernel_runs, kernel_calls):
    gate = _gate()
    wide = torch.randn(4, 256 + 3).to(torch.bfloat16)
    x = wide[:, 3:]  # row stride 259: not 16-byte rows
    _assert_logits(gate(x)[0], x, gate.weight)
    assert kernel_calls == [4]


@pytest.mark.parametrize("kwargs,x_dtype", [
    ({}, torch.float32),                                          # fp32 tokens: GateLinear's path
    ({"params_dtype": torch.bfloat16}, torch.bfloat16),           # a BF16 gate (another model)
    ({"bias": True}, torch.bfloat16),
])
def test_anything_else_is_exactly_gatelinear(tp1, kernel_runs, kernel_calls, kwargs, x_dtype):
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    gate = _gate(**kwargs)
    if "bias" in kwargs:
        gate.bias.data.normal_()
    x = torch.randn(3, 256).to(x_dtype)
    ours, theirs = gate(x), GateLinear.forward(gate, x)
    assert torch.equal(ours[0], theirs[0]) and kernel_calls == []


def test_unavailable_kernel_refuses_the_gate_at_construction(tp1, monkeypatch):
    monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: "no CUDA device")
    with pytest.raises(R.RouterGemvUnavailable, match="VLLM_LING_ROUTER_GEMV=vllm"):
        _gate()
    monkeypatch.setenv("VLLM_LING_ROUTER_GEMV", "vllm")
    gate = _gate()
    assert gate.ling_router_gemv_reason == "opted out (VLLM_LING_ROUTER_GEMV=vllm)"
    from vllm_ling.selection import Feature, recorded

    assert recorded(gate, Feature.ROUTER_GEMV).choice is GemvPath.VLLM  # the gate records what it serves


def test_registered_on_every_platform(tp1, monkeypatch, records):
    """Every platform gets the subclass (each gate records its selection; on CPU GateLinear's path),
    CUDA's line names the kernel; idempotent; another plugin's replacement is left in place."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.platforms import current_platform

    present = op_registry_oot.pop("GateLinear", None)  # the session's own registration
    try:
        assert type(GateLinear(256, 16, out_dtype=torch.float32, params_dtype=torch.float32)) is GateLinear
        assert R.register_router_gate() == [R._CPU_DESCRIPTION]  # this suite runs on the CPU platform
        op_registry_oot.pop("GateLinear")
        with monkeypatch.context() as m:
            m.setattr(current_platform, "is_cuda", lambda: True)
            assert R.register_router_gate() == [R._DESCRIPTION]
            assert R.register_router_gate() == [R._DESCRIPTION]  # idempotent
        monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: None)
        built = GateLinear(256, 16, out_dtype=torch.float32, params_dtype=torch.float32, prefix="x.gate")
        assert type(built) is R.router_gate_class() and isinstance(built, GateLinear) and built.ling_router_gemv
        foreign = type("OtherGateLinear", (GateLinear,), {})
        op_registry_oot["GateLinear"] = foreign
        assert R.register_router_gate() == []
        assert op_registry_oot["GateLinear"] is foreign
        assert any("NOT used" in w for w in _warnings(records))
    finally:
        op_registry_oot.pop("GateLinear", None)
        if present is not None:
            op_registry_oot["GateLinear"] = present


def test_a_cpu_gate_records_gatelinears_path_and_serves_it(loaded_tiny_models):
    from vllm_ling.selection import Feature, recorded

    _, target, _ = loaded_tiny_models
    gate = target.model.layers[2].mlp.gate
    selection = recorded(gate, Feature.ROUTER_GEMV)
    assert type(gate) is R.router_gate_class() and not gate.ling_router_gemv
    assert (selection.choice, selection.reason) == (GemvPath.VLLM, "the CPU platform: vLLM's GateLinear path")
    assert R.served(gate).key == selection.served_as()


def test_logits_dtype_set_after_construction(tp1, kernel_runs, kernel_calls):
    later = _gate(out_dtype=None)
    assert not later.ling_router_gemv  # no fp32 logits yet: GateLinear's path
    later.set_out_dtype(torch.float32)
    x = torch.randn(2, 256).to(torch.bfloat16)
    _assert_logits(later(x)[0], x, later.weight)
    assert later.ling_router_gemv and kernel_calls == [2]
    bf16_logits = _gate(out_dtype=None)
    bf16_logits.set_out_dtype(torch.bfloat16)
    assert not bf16_logits.ling_router_gemv and "bfloat16 logits" in bf16_logits.ling_router_gemv_reason


def test_startup_check_runs_every_launch_shape_the_gate_is_served_with(tp1, kernel_runs, monkeypatch):
    # the kernel's launch shape follows the gate's expert count (CTA width for staged rows), so the
    # known-answer check must use the served gate's count, not a small test gate's
    from vllm_ling.layers.known_answer import check_router_gate
    from vllm_ling.ops.small_gemv.kernel import default_launch, launch_row_counts

    seen = []

    def reference_kernel(x, weight):
        seen.append(default_launch(x.shape[0], weight.shape[0]))
        return router_ops.reference_router_logits(x, weight).float()

    monkeypatch.setattr(router_ops, "router_logits", reference_kernel)
    gate = _gate(hidden=256, experts=512, prefix="test.mlp.wide_gate")
    result = check_router_gate(gate)
    assert result.passed, result.message()
    served = {default_launch(rows, 512) for rows in range(1, router_ops.MAX_ROWS + 1)}
    assert set(seen) == served and len(seen) == len(launch_row_counts(512))
