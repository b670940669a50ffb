"""The fused KDA short convolutions: the selector, the weight views, the known answers (CPU, with
the plain-PyTorch conv in place of vLLM's Triton kernel) and, on the GPU, vLLM's kernel over the
three blocks at Ling's width. The fused forward against vLLM's own, step by step, is in
tests/layers/test_kda_cpu.py (its layer and metadata helpers)."""

from __future__ import annotations

import pytest
import torch

from vllm_ling.models.kda_fused_conv import KdaConv, select_kda_fused_conv
from vllm_ling.ops import kda as kda_ops
from vllm_ling.ops.known_answer.kda_conv import ConvCall, check_kda_conv
from vllm_ling.selection import Platform

LING_WIDTH = 32 * 128  # Ling-3.0-flash: 32 heads x 128 per block (TP=1)


def test_fused_on_cuda_for_a_merged_layer():
    s = select_kda_fused_conv(True, Platform.CUDA, True, [])
    assert s.choice is KdaConv.FUSED and s.fallback_from is None


@pytest.mark.parametrize("args,choice,fallback,words", [
    ((False, Platform.CUDA, True, []), KdaConv.SEPARATE, None, "opted out (VLLM_LING_KDA_FUSED_CONV=0)"),
    ((True, Platform.CPU, True, []), KdaConv.SEPARATE, None, "the CPU platform"),
    ((True, Platform.CUDA, False, []), KdaConv.SEPARATE, None, "the in-projection is not merged"),
    ((True, Platform.CUDA, True, ["a conv has a bias"]), KdaConv.SEPARATE, KdaConv.FUSED, "a conv has a bias"),
])
def test_the_other_cases_keep_three_launches_saying_why(args, choice, fallback, words):
    s = select_kda_fused_conv(*args)
    assert s.choice is choice and s.fallback_from is fallback and words in s.reason


def test_the_option_defaults_on_and_is_hashed_into_the_compile_cache():
    from vllm_ling import options as o

    assert o.LingOptions.from_env({}).kda_fused_conv is True
    assert o.LingOptions.from_env({"VLLM_LING_KDA_FUSED_CONV": "0"}).kda_fused_conv is False
    assert o.option("VLLM_LING_KDA_FUSED_CONV").compile_factor  # it changes the traced graph (another op)


def _plain_fused(call: ConvCall) -> torch.Tensor:
    if call.initial is not None:
        return kda_ops.causal_conv1d_prefill(call.x, call.weight, None, call.state, call.cu_seqlens, call.indices,
                                             call.initial)
    return kda_ops.causal_conv1d_update(call.x, call.weight, None, call.state, call.indices,
                                        cu_seqlens=call.cu_seqlens, num_accepted_tokens=call.accepted)


def test_one_conv_over_the_three_blocks_passes_the_known_answers():
    result = check_kda_conv(_plain_fused, "plain", 16)
    assert result.passed and result.cases == 6, result.message()


@pytest.mark.parametrize("fault,words", [
    ("weights of k for q", "outputs"),
    ("state not written", "states after"),
    ("accepted tokens ignored", "verify window"),
    ("a new sequence continues its slot's stale state", "prefill"),
])
def test_a_fused_conv_that_mixes_the_blocks_up_fails_named(fault, words):
    def wrong(call: ConvCall) -> torch.Tensor:
        w, state, accepted, initial = call.weight, call.state, call.accepted, call.initial
        if fault == "weights of k for q":
            w = torch.cat([w[16:32], w[:16], w[32:]])
        if fault == "state not written":
            state = state.clone()
        if fault == "accepted tokens ignored" and accepted is not None:
            accepted = torch.ones_like(accepted)
        if fault == "a new sequence continues its slot's stale state" and initial is not None:
            initial = torch.ones_like(initial)
        return _plain_fused(ConvCall(call.x, state, w, call.indices, call.cu_seqlens, accepted, call.max_len, initial))

    result = check_kda_conv(wrong, fault, 16)
    assert not result.passed and any(words in f for f in result.failing_inputs), result.failing_inputs


def test_the_weights_become_views_of_one_buffer_that_loading_fills():
    import types

    from vllm_ling.layers import kda_fused_conv as F

    layer = types.SimpleNamespace(**{n: torch.nn.Module() for n in ("q_conv1d", "k_conv1d", "v_conv1d")})
    for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
        conv.weight = torch.nn.Parameter(torch.zeros(8, 1, 4), requires_grad=False)
        conv.bias = None
    assert F.conv_problems(layer) == []
    fused = F.fuse_conv_weights(layer)
    assert fused.shape == (24, 4)
    with torch.no_grad():
        for i, conv in enumerate((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
            conv.weight.copy_(torch.full((8, 1, 4), float(i + 1)))  # what a weight loader does
    assert torch.equal(fused, torch.arange(1, 4).float().repeat_interleave(8)[:, None].expand(24, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu marker)")
def test_on_the_gpu_vllms_kernel_over_three_blocks_passes_and_equals_its_three_launches():
    """vLLM's causal_conv1d_update and causal_conv1d_fn as the layer calls them
    (layers/kda_fused_conv.short_conv) on the known answers at Ling's width (decode, verify window,
    prefill), then against three launches, one per block (vLLM's own paths), on the same inputs and
    state. Run on the device with `python -m pytest -m gpu tests/layers/test_kda_fused_conv.py` (the
    lease's `cuts` phase)."""
    pytest.importorskip("vllm")
    from vllm_ling.layers import kda_fused_conv as F
    from vllm_ling.ops.known_answer import kda_conv

    result = check_kda_conv(F.short_conv, F.KERNEL_LABEL, LING_WIDTH, device="cuda")
    assert result.passed, result.message()

    for name, call in kda_conv._calls(LING_WIDTH, 4, 3, torch.Generator().manual_seed(1)).items():
        cuda = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in vars(call).items()}
        fused = ConvCall(**{**cuda, "x": cuda["x"].clone(), "state": cuda["state"].clone()})
        split = ConvCall(**{**cuda, "x": cuda["x"].clone(), "state": cuda["state"].clone()})
        fused_out = F.short_conv(fused)
        split_out = torch.cat([F.short_conv(ConvCall(**{**vars(split), "x": split.x[:, cols],
                                                         "state": split.state[:, cols], "weight": split.weight[cols]}))
                               for cols in (slice(b * LING_WIDTH, (b + 1) * LING_WIDTH) for b in range(3))], dim=1)
        assert torch.equal(fused_out, split_out) and torch.equal(fused.state, split.state), name
