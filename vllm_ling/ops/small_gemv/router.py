"""The MoE router GEMV on CUDA, the small GEMV in its fp32-weight mode: fp32 logits of BF16 hidden
states against Ling's fp32 gate (no vLLM import).

vLLM 0.32 has no specialized kernel for Ling's gate shape (hidden 2560 x 512 experts, fp32): its
``GateLinear`` casts the activations to fp32 in one launch and runs cuBLAS's fp32 GEMM in
another. :func:`router_logits` is one launch of this package's small GEMV whose weight
stream overlaps the previous kernel.
"""

from __future__ import annotations

import torch

from vllm_ling.ops.small_gemv import MAX_ROWS, kernel_rows, kernel_unavailable_reason, small_gemv, unavailable_reason
from vllm_ling.ops.small_gemv import magnitude_bound
from vllm_ling.ops.small_gemv import reference_gemv as reference_router_logits
from vllm_ling.ops.small_gemv import shape_problems as _gemv_shape_problems

__all__ = ["MAX_ROWS", "kernel_rows", "kernel_unavailable_reason", "magnitude_bound", "reference_router_logits",
           "router_logits", "shape_problems", "unavailable_reason"]


def shape_problems(num_experts: int, hidden_size: int) -> list[str]:
    """Why the kernel cannot hold an fp32 [E, H] gate (empty when it can)."""
    return _gemv_shape_problems(num_experts, hidden_size, torch.float32)


def router_logits(x: torch.Tensor, weight: torch.Tensor, **launch) -> torch.Tensor:
    """fp32 [T, E] logits of BF16 ``x`` [T, H] against the fp32 gate ``weight`` [E, H]
    (``launch``: ``out``, ``warps``, ``tokens_per_pass``, ``pdl``)."""
    if weight.dtype != torch.float32:
        raise ValueError(f"router GEMV wants the fp32 gate weight, got {weight.dtype}")
    return small_gemv(x, weight, torch.float32, **launch)
