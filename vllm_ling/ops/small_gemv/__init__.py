"""Small-N GEMV with the weight held in registers, for decode-sized batches (no vLLM import).

Serves the linears too small for a GEMM library to reach the memory system before its launch
overhead dominates: Ling's fp32 MoE gate (:mod:`vllm_ling.ops.small_gemv.router`) and the BF16 linears the
checkpoint leaves unquantized (KDA ``b_proj``, MLA ``g_proj``: 32 rows each). The weight streams
into registers while the previous kernel finishes (``small_gemv.cu``). :mod:`.kernel` holds the
launcher, :mod:`.reference` the plain-PyTorch oracle.
"""

from vllm_ling.ops.small_gemv.kernel import (BF16_MAX_ROWS, MAX_ROWS, kernel_rows, kernel_unavailable_reason, shape_problems, small_gemv,
                                             unavailable_reason)
from vllm_ling.ops.small_gemv.reference import magnitude_bound, reference_gemv

__all__ = ["BF16_MAX_ROWS", "MAX_ROWS", "kernel_rows", "kernel_unavailable_reason", "magnitude_bound", "reference_gemv", "shape_problems",
           "small_gemv", "unavailable_reason"]
