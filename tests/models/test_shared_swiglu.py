"""The shared experts' clamped SwiGLU as vLLM's one-launch kernel (vllm_ling.models.shared_swiglu): the
selection, what it makes of vLLM's custom ops, and what vLLM's ``SwigluStepAndMul`` then dispatches to
and the reader reads back. The kernel's numbers against the plain-PyTorch reference need CUDA
(``test_the_kernel_computes_the_reference_on_the_gpu``)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_ling.models.shared_swiglu import OPTION, VLLM_OP, SharedSwiglu, decide, select_shared_swiglu
from vllm_ling.selection import Platform


@pytest.mark.parametrize("enabled,platform,custom_ops,choice,says", [
    (True, Platform.CUDA, ["none"], SharedSwiglu.KERNEL, "one-launch"),
    (False, Platform.CUDA, ["none"], SharedSwiglu.TORCH, f"opted out ({OPTION}=0)"),
    (True, Platform.CUDA, [f"-{VLLM_OP}"], SharedSwiglu.TORCH, f"custom_ops has -{VLLM_OP}"),
    (False, Platform.CUDA, [f"+{VLLM_OP}"], SharedSwiglu.KERNEL, "one-launch"),  # the user's request wins
    (True, Platform.CPU, [], SharedSwiglu.TORCH, "CPU platform"),
])
def test_the_selection(enabled, platform, custom_ops, choice, says):
    selection = select_shared_swiglu(enabled, platform, custom_ops)
    assert selection.choice is choice and says in selection.reason


@pytest.mark.parametrize("option,want", [("1", f"+{VLLM_OP}"), ("0", f"-{VLLM_OP}")])
def test_decide_makes_vllms_custom_ops_say_it_on_cuda(monkeypatch, option, want):
    monkeypatch.setenv(OPTION, option)
    config = types.SimpleNamespace(custom_ops=["none"])
    decide(config, Platform.CUDA)
    assert config.custom_ops == ["none", want]
    cpu = types.SimpleNamespace(custom_ops=["none"])
    decide(cpu, Platform.CPU)
    assert cpu.custom_ops == ["none"]


@pytest.mark.parametrize("option,choice", [("1", SharedSwiglu.KERNEL), ("0", SharedSwiglu.TORCH)])
def test_vllms_op_built_after_decide_serves_the_selection(monkeypatch, option, choice):
    """vLLM's own dispatch (its CUDA branch: the platform questions it asks answered as on CUDA) after
    :func:`decide` edited the custom ops: the reader reads back what was selected."""
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.activation import SwigluStepAndMul

    from vllm_ling.layers.shared_swiglu import served

    cuda = types.SimpleNamespace(**{q: (lambda: False) for q in ("is_rocm", "is_cpu", "is_tpu", "is_xpu",
                                                                 "is_out_of_tree")})
    monkeypatch.setattr(custom_op, "current_platform", cuda)
    monkeypatch.setenv(OPTION, option)
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    with set_current_vllm_config(config):
        selection = decide(config.compilation_config, Platform.CUDA)
        custom_op.get_cached_compilation_config.cache_clear()
        op = SwigluStepAndMul(limit=5.0)
    custom_op.get_cached_compilation_config.cache_clear()
    assert selection.choice is choice
    assert served(op).key == (choice,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 9, 300])
def test_the_kernel_computes_the_reference_on_the_gpu(tokens):
    """vLLM's Triton kernel (what the selection serves) against the plain-PyTorch clamped SwiGLU in float32
    (vllm_ling.ops.moe.activation, the shared expert's clamp mode), the shared expert's width: within BF16's
    rounding of the output (one rounding; the composition rounds after each op)."""
    from vllm.model_executor.layers.activation import swiglustep_and_mul_triton

    from vllm_ling.ops.moe.activation import SHARED_EXPERT_CLAMP, swiglu

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, 2 * 768, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    out = torch.empty(tokens, 768, dtype=torch.bfloat16, device="cuda")
    swiglustep_and_mul_triton(out, x, 5.0)
    want = swiglu(x.float(), 5.0, SHARED_EXPERT_CLAMP)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    assert want.abs().max() > 4  # the clamps were reached


@pytest.mark.parametrize("option,custom_ops,says", [("0", ["none"], f"opted out ({OPTION}=0)"),
                                                    ("1", [f"-{VLLM_OP}"], f"custom_ops has -{VLLM_OP}")])
def test_the_composition_on_cuda_is_one_warning_naming_why(monkeypatch, caplog, option, custom_ops, says):
    import logging

    from vllm_ling import log as ling_log

    monkeypatch.setenv(OPTION, option)
    monkeypatch.setattr(ling_log, "_once", set())
    with caplog.at_level(logging.WARNING, logger="vllm.ling.moe"):
        decide(types.SimpleNamespace(custom_ops=list(custom_ops)), Platform.CUDA)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and says in warnings[0], warnings

