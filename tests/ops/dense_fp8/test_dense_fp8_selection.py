"""The dense FP8 selector: options + platform + shape -> kernel and reason (no vLLM, no GPU)."""

from __future__ import annotations

import pytest

from vllm_ling.ops.dense_fp8.selection import (DenseFp8Kernel, DenseFp8Unavailable, DenseShape, select_dense_fp8,
                                               unaligned_shards)
from vllm_ling.options import DenseFp8, LingOptions
from vllm_ling.selection import Feature, Platform

QKV = DenseShape((4096, 4096, 4096, 32), 2560)  # only the last shard partial: the kernel indexes it
BLOCK = [128, 128]
RUNS = lambda: None  # noqa: E731


def test_cuda_selects_w8a16_where_it_indexes_the_shards():
    sel = select_dense_fp8(LingOptions(), Platform.CUDA, QKV, BLOCK, "qkv", unavailable_reason=RUNS)
    assert (sel.feature, sel.choice, sel.reason) == (Feature.DENSE_FP8, DenseFp8Kernel.W8A16, "CUDA, the W8A16 kernel runs")


def test_cuda_keeps_vllms_kernel_when_opted_out_or_unaligned():
    sel = select_dense_fp8(LingOptions(dense_fp8=DenseFp8.VLLM), Platform.CUDA, QKV, BLOCK, "qkv",
                           unavailable_reason=lambda: "never asked")
    assert (sel.choice, sel.reason) == (DenseFp8Kernel.VLLM, "opted out: VLLM_LING_DENSE_FP8=vllm")
    sel = select_dense_fp8(LingOptions(), Platform.CUDA, DenseShape((100, 28), 2560), BLOCK, "p", unavailable_reason=RUNS)
    assert sel.choice is DenseFp8Kernel.VLLM
    assert sel.reason == "the W8A16 kernel cannot index it: shard 0 has 100 rows, not a multiple of 128"


def test_cuda_requests_that_cannot_run_are_refused_naming_the_opt_out():
    with pytest.raises(DenseFp8Unavailable, match="cannot run for p: sm_80 has no e4m3.*VLLM_LING_DENSE_FP8=vllm"):
        select_dense_fp8(LingOptions(), Platform.CUDA, QKV, BLOCK, "p", unavailable_reason=lambda: "sm_80 has no e4m3")
    with pytest.raises(DenseFp8Unavailable, match="128x128 block scales, the checkpoint has \\[64, 64\\]"):
        select_dense_fp8(LingOptions(), Platform.CUDA, QKV, [64, 64], "p", unavailable_reason=RUNS)


def test_cpu_takes_the_behavioural_decision():
    sel = select_dense_fp8(LingOptions(dense_fp8=DenseFp8.VLLM), Platform.CPU, QKV, BLOCK, "p",
                           cpu_kernel=lambda: (DenseFp8Kernel.DEQUANTIZED, "CPU without AMX"))
    assert (sel.choice, sel.reason) == (DenseFp8Kernel.DEQUANTIZED, "CPU without AMX")
    with pytest.raises(ValueError, match="pass cpu_kernel"):
        select_dense_fp8(LingOptions(), Platform.CPU, QKV, BLOCK, "p")


def test_unaligned_shards():
    assert unaligned_shards([4096, 4096, 4096], 2560) == []
    assert unaligned_shards([576], 2560) == []
    assert unaligned_shards([128], 200) == ["K=200 is not a multiple of 128"]
