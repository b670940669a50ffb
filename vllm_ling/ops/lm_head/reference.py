"""fp32 references of the LM head logits, chunked over the vocabulary (the independent
reference of the tests, and the ``"torch"`` kernel's math)."""

from __future__ import annotations

import torch

from vllm_ling.ops.lm_head.quantize import DEFAULT_CHUNK_ROWS, check_fp8_pair


def reference_logits(
    hidden: torch.Tensor, weight: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> torch.Tensor:
    """fp32 ``hidden @ weight.T`` with both operands upcast to fp32: the independent reference
    (``[M, H]`` x ``[V, H]`` -> ``[M, V]`` float32), chunked over V."""
    hidden32 = hidden.float().reshape(-1, hidden.shape[-1])
    out = torch.empty((hidden32.shape[0], weight.shape[0]), dtype=torch.float32, device=hidden.device)
    for start in range(0, weight.shape[0], chunk_rows):
        block = weight[start : start + chunk_rows].to(device=hidden.device, dtype=torch.float32)
        torch.matmul(hidden32, block.t(), out=out[:, start : start + chunk_rows])
    return out


def fp8_reference_logits(
    hidden: torch.Tensor,
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """fp32 logits of the dequantized FP8 head (``hidden @ (q * scale).T``), chunked over V.
    This is the ``"torch"`` kernel's math and the exact target of the fast kernels."""
    check_fp8_pair(weight_fp8, scale)
    hidden32 = hidden.float().reshape(-1, hidden.shape[-1])
    out = torch.empty((hidden32.shape[0], weight_fp8.shape[0]), dtype=torch.float32, device=hidden.device)
    for start in range(0, weight_fp8.shape[0], chunk_rows):
        block = weight_fp8[start : start + chunk_rows].to(hidden.device).float()
        block.mul_(scale[start : start + chunk_rows].to(hidden.device).float()[:, None])
        torch.matmul(hidden32, block.t(), out=out[:, start : start + chunk_rows])
    return out
