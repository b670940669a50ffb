"""Weight-only FP8 (W8A16) decode linears for block-scaled e4m3 weights (no vLLM import).

- :mod:`.decode_kernel` (with ``w8a16_decode.cu``): the CUDA decode kernel, up to 32 rows;
- :mod:`.kernel`: the Triton kernel (why it is shaped as it is), for larger batches and wherever
  the decode kernel cannot run;
- :mod:`.tuned_configs`: launch configs of both per architecture and shape, with an explicit
  heuristic fallback for untuned architectures;
- :mod:`.linear`: :func:`w8a16_linear`, the checked launcher that picks the kernel;
- :mod:`.warmup`: compiles ahead of serving every kernel the server will launch;
- :mod:`.reference`: the plain-PyTorch oracle.
"""

from vllm_ling.ops.dense_fp8.linear import unavailable_reason, w8a16_linear
from vllm_ling.ops.dense_fp8.reference import reference_linear
from vllm_ling.ops.dense_fp8.tuned_configs import W8A16Config, heuristic_config, select_config

__all__ = ["W8A16Config", "heuristic_config", "reference_linear", "select_config", "unavailable_reason",
           "w8a16_linear"]
