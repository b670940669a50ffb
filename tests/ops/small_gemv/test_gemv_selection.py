"""The router-gate and BF16-linear selectors: options + platform + shape -> path and reason (no vLLM)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_ling.ops.small_gemv.selection import (Bf16GemvUnavailable, GateFacts, GemvPath, RouterGemvUnavailable,
                                                select_bf16_gemv, select_router_gemv)
from vllm_ling.options import Bf16Gemv, LingOptions, RouterGemv
from vllm_ling.selection import Feature, Platform

LING_GATE = GateFacts("model.layers.5.mlp.gate", 256, 2560, torch.float32, has_bias=False, unquantized=True,
                      out_dtype=torch.float32)
RUNS = lambda: None  # noqa: E731


def test_lings_gate_takes_the_router_gemv_on_cuda():
    sel = select_router_gemv(LingOptions(), Platform.CUDA, LING_GATE, unavailable_reason=RUNS)
    assert (sel.feature, sel.choice, sel.reason) == (Feature.ROUTER_GEMV, GemvPath.LING,
                                                     "CUDA, the router GEMV holds this gate")


@pytest.mark.parametrize("options, platform, change, reason", [
    (LingOptions(router_gemv=RouterGemv.VLLM), Platform.CUDA, {}, "opted out (VLLM_LING_ROUTER_GEMV=vllm)"),
    (LingOptions(), Platform.CPU, {}, "the CPU platform: vLLM's GateLinear path"),
    (LingOptions(), Platform.CUDA, {"has_bias": True},
     "not an fp32 unquantized bias-free gate with fp32 logits (has a bias)"),
    (LingOptions(), Platform.CUDA, {"hidden_size": 8192}, "K=8192 exceeds 4096 (a weight row must fit a warp's registers)"),
    (LingOptions(), Platform.CUDA, {"batch_invariant": True}, "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) is on"),
])
def test_gates_the_kernel_does_not_serve_keep_gatelinear_with_the_reason(options, platform, change, reason):
    sel = select_router_gemv(options, platform, dataclasses.replace(LING_GATE, **change),
                             unavailable_reason=lambda: "never asked")
    assert (sel.choice, sel.reason) == (GemvPath.VLLM, reason)


def test_a_gate_the_kernel_holds_but_cannot_run_is_refused():
    with pytest.raises(RouterGemvUnavailable, match="model.layers.5.mlp.gate: sm_75.*VLLM_LING_ROUTER_GEMV=vllm"):
        select_router_gemv(LingOptions(), Platform.CUDA, LING_GATE, unavailable_reason=lambda: "sm_75")


def test_bf16_linears():
    sel = select_bf16_gemv(LingOptions(), Platform.CUDA, "b_proj", unavailable_reason=RUNS)
    assert (sel.feature, sel.choice, sel.reason) == (Feature.BF16_GEMV, GemvPath.LING, "CUDA, the small GEMV runs")
    assert select_bf16_gemv(LingOptions(bf16_gemv=Bf16Gemv.VLLM), Platform.CUDA, "b_proj").reason == \
        "opted out (VLLM_LING_BF16_GEMV=vllm)"
    assert select_bf16_gemv(LingOptions(), Platform.CPU, "b_proj").choice is GemvPath.VLLM
    with pytest.raises(Bf16GemvUnavailable, match="cannot run for b_proj: sm_75; opt out with VLLM_LING_BF16_GEMV=vllm"):
        select_bf16_gemv(LingOptions(), Platform.CUDA, "b_proj", unavailable_reason=lambda: "sm_75")
