"""benchmarks/router_gate_prefill.py's candidate on the CPU: the BF16 parts of an fp32 gate weight and the
logits through them, against float64 (the timing needs a GPU)."""

from __future__ import annotations

import torch

from benchmarks import router_gate_prefill as B


def _gate(seed: int = 0, n: int = 64, k: int = 256):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=gen) * 0.02
    w[0, :4] = torch.tensor([1 / 3, -2 / 7, 1e-3 / 3, 5.0])  # significands no BF16 part holds alone
    x = (torch.randn((24, k), generator=gen)).to(torch.bfloat16)
    return w, x


def test_three_parts_hold_the_fp32_weight_two_hold_16_bits():
    w, _ = _gate()
    three = B.split_bf16(w, 3).float().view(3, *w.shape).sum(0)
    assert torch.equal(three, w)
    two = B.split_bf16(w, 2).float().view(2, *w.shape).sum(0)
    rel = ((two - w).abs() / w.abs()).max()
    assert 0 < rel <= 2.0 ** -16
    one = w.to(torch.bfloat16).float()
    assert ((one - w).abs() / w.abs()).max() > 2.0 ** -10  # one part alone is BF16: far coarser


def test_logits_through_the_parts_are_fp32_grade():
    w, x = _gate(1)
    ref = x.double() @ w.double().t()
    fp32 = B.max_rel_error(B.vllm_logits(x, w), ref)
    three = B.max_rel_error(B.split_logits(x, B.split_bf16(w, 3), 3), ref)
    two = B.max_rel_error(B.split_logits(x, B.split_bf16(w, 2), 2), ref)
    bf16 = B.max_rel_error((x.float() @ w.to(torch.bfloat16).float().t()), ref)
    assert three < 1e-6 and fp32 < 1e-6  # fp32 accumulation of exact products, as vLLM's fp32 GEMM
    assert two < 1e-4 < bf16  # 16 significand bits of weight: well inside BF16's error
    assert B.split_logits(x, B.split_bf16(w, 3), 3).shape == (x.shape[0], w.shape[0])


def test_the_three_parts_are_the_split_vllm_builds():
    """vLLM 0.32's ROCm BF16x3 tier builds the same three parts (stacked [3, E, K]): the candidate
    measured here is its function, enabled on CUDA."""
    vllm_gemm = B.vllm_bf16x3()
    w, _ = _gate(2)
    assert torch.equal(vllm_gemm.split_bf16x3(w), B.split_bf16(w, 3).view(3, *w.shape))
