"""vLLM (and on CUDA humming) are the versions vllm-ling was tested with; the GPU's architecture."""

from __future__ import annotations

import torch

from vllm_ling.runtime.verification.checks import Check
from vllm_ling.versions import TESTED_HUMMING_VERSION, TESTED_VLLM_VERSION, humming_version, vllm_version


def check_versions(platform: str) -> Check:
    v, h = vllm_version(), humming_version()
    ok = (v or "").split("+")[0] == TESTED_VLLM_VERSION and (platform == "cpu" or h == TESTED_HUMMING_VERSION)
    return Check("versions", ok, f"vllm {TESTED_VLLM_VERSION}, humming {TESTED_HUMMING_VERSION}"
                 + (" (unused on CPU)" if platform == "cpu" else ""),
                 f"vllm {v}, humming {h}", f"pip install vllm-ling[{'cpu' if platform == 'cpu' else 'gpu'}]")


def gpu_arch() -> str | None:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return None
