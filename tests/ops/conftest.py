"""Fixtures shared by the GPU MoE tests (humming GEMM and decode kernels)."""

import pytest
import torch

LING_E, LING_H, LING_I = 512, 2560, 768


@pytest.fixture(scope="module")
def no_tf32():
    """The float32 references must not run their matmuls in TF32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(scope="module")
def weights():
    """Random MXFP4 routed experts at Ling shapes in vLLM's layout, on the GPU."""
    from vllm_ling.ops import moe

    return moe.random_mxfp4_experts(LING_E, LING_H, LING_I, device=torch.device("cuda"), seed=1234)
