"""The MoE router GEMV on CUDA: fp32 logits of BF16 hidden states against Ling's fp32 gate
(no vLLM import).

vLLM 0.32 has no specialized kernel for Ling's gate shape (hidden 2560 x 512 experts, fp32): its
``GateLinear`` casts the activations to fp32 in one launch and runs cuBLAS's fp32 GEMM in
another. :func:`router_logits` is one launch whose weight stream overlaps the previous kernel
(``router_gemv.cu``). :mod:`.kernel` holds the launcher, :mod:`.reference` the plain-PyTorch
oracle.
"""

from vllm_ling.ops.router.kernel import (MAX_ROWS, kernel_unavailable_reason, router_logits, shape_problems,
                                         unavailable_reason)
from vllm_ling.ops.router.reference import magnitude_bound, reference_router_logits

__all__ = ["MAX_ROWS", "kernel_unavailable_reason", "magnitude_bound", "reference_router_logits",
           "router_logits", "shape_problems", "unavailable_reason"]
