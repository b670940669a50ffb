"""The MoE selector: options + platform + shape -> backend, kernel switches and reason (no vLLM)."""

from __future__ import annotations

import pytest

from vllm_ling.ops.moe.activation import SwigluClamp
from vllm_ling.ops.moe.humming import HummingUnavailable
from vllm_ling.ops.moe.selection import MoePath, MoeShape, select_moe
from vllm_ling.options import LingOptions, MoeBackend, MoeDecode
from vllm_ling.selection import Feature, Platform

LING = MoeShape(hidden=2560, intermediate=768)
RUNS = lambda w4a8: (True, "humming-kernels 0.1 on sm_90")  # noqa: E731
MISSING = lambda w4a8: (False, "humming-kernels is not installed")  # noqa: E731


def test_cuda_selects_humming_with_the_options_switches():
    sel = select_moe(LingOptions(moe_decode=MoeDecode.COPY, moe_decode_max_tokens=8), Platform.CUDA, LING, "l",
                     humming_status=RUNS)
    assert (sel.feature, sel.choice) == (Feature.MOE, MoePath.HUMMING)
    assert sel.reason == "CUDA, humming runs (humming-kernels 0.1 on sm_90)"
    assert sel.kernel_kwargs() == {"w4a8": False, "decode": MoeDecode.COPY, "decode_max_tokens": 8,
                                 "clamp": SwigluClamp.GATE_OUTPUT}


def test_decode_off_builds_no_decode_kernels():
    sel = select_moe(LingOptions(moe_decode=MoeDecode.OFF, moe_decode_max_tokens=32), Platform.CUDA, LING, "l",
                     humming_status=RUNS)
    assert sel.kernel_kwargs() == {"w4a8": False, "decode": MoeDecode.OFF, "decode_max_tokens": 0,
                                 "clamp": SwigluClamp.GATE_OUTPUT}


def test_cpu_selects_the_reference_without_decode_kernels():
    sel = select_moe(LingOptions(), Platform.CPU, LING, "l", humming_status=MISSING)
    assert sel.choice is MoePath.REFERENCE and sel.reason.startswith("CPU platform")
    assert sel.kernel_kwargs() == {"w4a8": False, "decode": MoeDecode.OFF, "decode_max_tokens": 0,
                                 "clamp": SwigluClamp.GATE_OUTPUT}


@pytest.mark.parametrize("options, vllm_backend, reason", [
    (LingOptions(moe_backend=MoeBackend.VLLM), "auto", "opted out: VLLM_LING_MOE_BACKEND=vllm"),
    (LingOptions(), "triton", "opted out: --moe-backend triton"),
])
def test_opt_outs_select_vllm_and_say_which(options, vllm_backend, reason):
    for platform in Platform:
        sel = select_moe(options, platform, LING, "l", vllm_moe_backend=vllm_backend, humming_status=MISSING)
        assert (sel.choice, sel.reason) == (MoePath.VLLM, reason)
        assert sel.clamp is SwigluClamp.GATE_INPUT  # what vLLM 0.32's own MoE methods compute


def test_vllms_own_humming_word_leaves_the_experts_to_us():
    assert select_moe(LingOptions(), Platform.CUDA, LING, "l", vllm_moe_backend="humming",
                      humming_status=RUNS).choice is MoePath.HUMMING


def test_requests_that_cannot_run_are_refused_naming_the_fix():
    with pytest.raises(HummingUnavailable, match="cannot run for l: humming-kernels is not installed.*"
                                                 "VLLM_LING_MOE_BACKEND=vllm"):
        select_moe(LingOptions(), Platform.CUDA, LING, "l", humming_status=MISSING)
    with pytest.raises(HummingUnavailable, match="VLLM_LING_MOE_W4A8=1 needs humming"):
        select_moe(LingOptions(moe_w4a8=True), Platform.CPU, LING, "l")
    with pytest.raises(HummingUnavailable, match="not multiples of 64"):
        select_moe(LingOptions(moe_decode=MoeDecode.COPY), Platform.CUDA, MoeShape(2560, 800), "l",
                   humming_status=RUNS)
    asked = []
    select_moe(LingOptions(moe_w4a8=True), Platform.CUDA, LING, "l", humming_status=lambda w4a8: asked.append(w4a8)
               or (True, ""))
    assert asked == [True]  # W4A8's capability is what gets asked


def test_prefill_routing_metadata_is_recorded_as_chosen():
    """Issue 47: humming on CUDA records vLLM's one-launch routing metadata by default and the
    PyTorch layout when VLLM_LING_MOE_ROUTING=torch; where humming does not serve there is nothing
    to align (TORCH recorded, the value every other path serves)."""
    from vllm_ling.options import MoeRouting

    assert select_moe(LingOptions(), Platform.CUDA, LING, "l", humming_status=RUNS).routing is MoeRouting.VLLM
    assert select_moe(LingOptions(moe_routing=MoeRouting.TORCH), Platform.CUDA, LING, "l",
                      humming_status=RUNS).routing is MoeRouting.TORCH
    assert select_moe(LingOptions(), Platform.CPU, LING, "l", humming_status=MISSING).routing is MoeRouting.TORCH
    opted = select_moe(LingOptions(moe_backend=MoeBackend.VLLM), Platform.CUDA, LING, "l", humming_status=RUNS)
    assert opted.routing is MoeRouting.TORCH
    assert LingOptions.from_env({"VLLM_LING_MOE_ROUTING": "torch"}).moe_routing is MoeRouting.TORCH
