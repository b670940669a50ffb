"""The CUDA W8A16 dense block-FP8 method: its platform-independent rules (CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_ling.layers import dense_fp8_cuda as D


def test_unaligned_shards():
    assert D.unaligned_shards([4096, 4096, 4096], 2560) == []
    assert D.unaligned_shards([4096, 4096, 4096, 32], 2560) == []   # qkvb: only the last shard is partial
    assert D.unaligned_shards([576], 2560) == []                     # kv_a_proj_with_mqa
    assert any("shard 0" in p for p in D.unaligned_shards([100, 28], 2560))
    assert any("K=200" in p for p in D.unaligned_shards([128], 200))


def test_e8m0_scales_become_exact_fp32():
    exps = torch.tensor([[0, 1, 120], [127, 130, 254]], dtype=torch.uint8)
    e8m0 = exps.view(torch.float8_e8m0fnu)
    got = D.block_scales_fp32(e8m0)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, torch.exp2(exps.float() - 127))


def test_opt_out_warns_and_keeps_vllm(caplog):
    logging.getLogger("vllm.ling").propagate = True
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        assert D.choose_dense_fp8_method("model.layers.0.self_attn.qkv_proj", [4096] * 3, 2560, [128, 128],
                                         True, option="vllm") is None
    assert any("explicit choice" in r.getMessage() for r in caplog.records)


def test_requested_but_unavailable_is_an_error_naming_the_opt_out(monkeypatch):
    import vllm_ling.ops.dense_fp8 as ops

    monkeypatch.setattr(ops, "unavailable_reason", lambda device=None: "sm_80 has no e4m3 conversion")
    with pytest.raises(D.DenseFp8Unavailable, match="opt out"):
        D.choose_dense_fp8_method("p", [4096], 2560, [128, 128], False, option="ling")
    with pytest.raises(D.DenseFp8Unavailable, match="128x128"):
        D.choose_dense_fp8_method("p", [4096], 2560, [64, 64], False, option="ling")


def test_unaligned_linear_keeps_vllm_with_a_warning(monkeypatch):
    import vllm_ling.ops.dense_fp8 as ops

    monkeypatch.setattr(ops, "unavailable_reason", lambda device=None: None)
    assert D.choose_dense_fp8_method("p", [100, 28], 2560, [128, 128], False, option="ling") is None
    method = D.choose_dense_fp8_method("p", [4096, 4096], 2560, [128, 128], True, option="ling")
    assert isinstance(method, D.W8A16BlockFp8LinearMethod) and method.is_scale_e8m0
