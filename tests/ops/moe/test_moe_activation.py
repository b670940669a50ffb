"""SwiGLU with the per-layer clamp (plain PyTorch and humming's activation expression)
against hand-computed values and vLLM's semantics."""

import math
import re

import pytest
import torch

from vllm_ling.ops.moe import activation
from vllm_ling.ops.moe.activation import SwigluClamp

SILU = lambda v: v / (1.0 + math.exp(-v))  # noqa: E731


# ----------------------------------------------------------------------------- clamp

@pytest.mark.parametrize("limit", [None, 0, 0.0])
def test_swiglu_without_limit_is_plain_silu_mul(limit):
    x = torch.tensor([[9.0, -3.0, 20.0, -20.0]])  # gate (9, -3), up (20, -20)
    got = activation.swiglu(x, limit)
    assert torch.allclose(got, torch.tensor([[SILU(9.0) * 20.0, SILU(-3.0) * -20.0]]))


def test_swiglu_clamp_gate_input_matches_vllm_fused_moe_semantics():
    # gate 9 -> min(9, 4) = 4 -> silu(4); up 20 -> 4; gate -3 unclamped; up -20 -> -4
    x = torch.tensor([[9.0, -3.0, 20.0, -20.0]])
    got = activation.swiglu(x, 4.0, SwigluClamp.GATE_INPUT)
    expected = [SILU(4.0) * 4.0, SILU(-3.0) * -4.0]
    assert torch.allclose(got, torch.tensor([expected]), rtol=1e-6)


def test_swiglu_clamp_gate_output_matches_swiglu_step():
    # silu(9) = 8.9990 -> min(., 4) = 4; silu(4.05) = 3.98 stays (< 4) -- differs from
    # the gate-input mode, where min(4.05, 4) = 4 -> silu(4) = 3.928
    x = torch.tensor([[9.0, 4.05, 1.0, 1.0]])
    got = activation.swiglu(x, 4.0, SwigluClamp.GATE_OUTPUT)
    assert torch.allclose(got, torch.tensor([[4.0, SILU(4.05)]]), rtol=1e-6)
    pre = activation.swiglu(x, 4.0, SwigluClamp.GATE_INPUT)
    assert torch.allclose(pre, torch.tensor([[SILU(4.0), SILU(4.0)]]), rtol=1e-6)


def test_routed_experts_clamp_after_the_silu_as_trained():
    """Issue 43: every routed-expert path vllm-ling owns computes min(silu(g), L) * clamp(u, -L, L)
    (the shared expert, vLLM's SwigluStepAndMul, too); vLLM 0.32's own fused MoE clamps g first."""
    assert activation.ROUTED_EXPERT_CLAMP is SwigluClamp.GATE_OUTPUT
    assert activation.SHARED_EXPERT_CLAMP is SwigluClamp.GATE_OUTPUT
    assert activation.VLLM_ROUTED_EXPERT_CLAMP is SwigluClamp.GATE_INPUT
    x = torch.tensor([[9.0, 20.0]])  # g = 9 > L = 4, u = 20
    assert activation.swiglu(x, 4.0).item() == pytest.approx(4.0 * 4.0)  # the default is the served mode
    assert activation.clamp_define(activation.ROUTED_EXPERT_CLAMP) == 1  # the decode kernels' define
    expr = activation.swiglu_activation_expr(4.0)  # humming's activation expression
    assert _eval_c_expr(expr, 9.0, 20.0) == pytest.approx(16.0)


def test_shared_expert_clamp_is_vllms_swiglu_step():
    """The shared expert stays vLLM's SwigluStepAndMul (untouched by vllm-ling): after the SiLU."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SwigluStepAndMul

    x = torch.tensor([[9.0, 4.05, -3.0, 20.0, -9.0, 2.0]])
    with set_current_vllm_config(VllmConfig()):
        got = SwigluStepAndMul(limit=4.0).forward_native(x)
    assert torch.allclose(got, activation.swiglu(x, 4.0, activation.SHARED_EXPERT_CLAMP), rtol=1e-6)
    assert not torch.allclose(got, activation.swiglu(x, 4.0, SwigluClamp.GATE_INPUT), rtol=1e-4)


def test_modes_take_the_plain_word_and_name_the_formula():
    assert activation.check_clamp("gate_output") is SwigluClamp.GATE_OUTPUT
    assert f"{SwigluClamp.GATE_INPUT}" == "gate_input"
    assert SwigluClamp.GATE_OUTPUT.describe() == "clamped after the SiLU, min(silu(g), L) * clamp(u, -L, L)"
    assert SwigluClamp.GATE_INPUT.describe() == "clamped before the SiLU, silu(min(g, L)) * clamp(u, -L, L)"


def test_swiglu_rejects_bad_mode_and_negative_limit():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="clamp"):
        activation.swiglu(x, 1.0, "both")
    with pytest.raises(ValueError, match="swiglu_limit"):
        activation.swiglu(x, -1.0)


def test_layer_swiglu_limit_reads_like_vllm():
    limits = [0, 0, 4, None, 7.5]
    assert [activation.layer_swiglu_limit(limits, i) for i in range(6)] == [None, None, 4.0, None, 7.5, None]
    assert activation.layer_swiglu_limit(None, 0) is None


def _eval_c_expr(expr: str, a: float, b: float) -> float:
    py = re.sub(r"(\d\.?\d*(?:e[-+]?\d+)?)f\b", r"\1", expr)
    return eval(py, {"fminf": min, "fmaxf": max, "expf": math.exp, "a": a, "b": b})  # noqa: S307


@pytest.mark.parametrize("limit", [None, 4.0, 7.0])
@pytest.mark.parametrize("clamp", list(SwigluClamp))
def test_humming_activation_expression_equals_reference(limit, clamp):
    expr = activation.swiglu_activation_expr(limit, clamp)
    for a, b in [(9.0, 20.0), (4.05, -9.0), (-3.0, 2.0), (0.5, -0.25), (-30.0, 8.0)]:
        ref = activation.swiglu(torch.tensor([[a, b]], dtype=torch.float64), limit, clamp).item()
        assert math.isclose(_eval_c_expr(expr, a, b), ref, rel_tol=1e-12, abs_tol=1e-12)
