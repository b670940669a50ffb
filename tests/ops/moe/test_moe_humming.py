"""CPU checks of the humming wrapper: without CUDA it says why and refuses to build."""

import pytest
import torch

from vllm_ling.ops.moe import humming, warmup


# ----------------------------------------------------------------------------- humming plumbing

def test_humming_status_on_cpu_machine_says_why():
    ok, reason = humming.humming_status()
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    assert ok is False
    assert "humming" in reason or "CUDA" in reason


def test_humming_experts_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    t = warmup.random_mxfp4_experts(4, 64, 32, device="cpu")
    with pytest.raises(humming.HummingUnavailable):
        humming.HummingMxfp4Experts(**t)
