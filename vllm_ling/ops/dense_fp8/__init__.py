"""Weight-only FP8 (W8A16) decode linears for block-scaled e4m3 weights (no vLLM import).

- :mod:`.kernel`: the Triton kernel (why it is shaped as it is);
- :mod:`.tuned_configs`: launch configs per architecture and shape, with an explicit heuristic
  fallback for untuned architectures;
- :mod:`.linear`: :func:`w8a16_linear`, the checked launcher;
- :mod:`.reference`: the plain-PyTorch oracle.
"""

from vllm_ling.ops.dense_fp8.linear import unavailable_reason, w8a16_linear
from vllm_ling.ops.dense_fp8.reference import reference_linear
from vllm_ling.ops.dense_fp8.tuned_configs import W8A16Config, heuristic_config, select_config

__all__ = ["W8A16Config", "heuristic_config", "reference_linear", "select_config", "unavailable_reason",
           "w8a16_linear"]
