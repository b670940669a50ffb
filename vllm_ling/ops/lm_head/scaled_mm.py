"""The ``"scaled_mm"`` kernel: ``torch._scaled_mm`` row-wise, with dynamic per-token FP8
activation scales (activations are quantized too, so its error is larger)."""

from __future__ import annotations

import torch

from vllm_ling.ops.lm_head.quantize import quantize_fp8_per_token
from vllm_ling.ops.lm_head.state import Fp8HeadState


def scaled_mm_logits(x: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None) -> torch.Tensor:
    xq, x_scale = quantize_fp8_per_token(x)
    logits = torch._scaled_mm(
        xq,
        state.weight.t(),  # column-major [H, V] view of the row-major head, as cuBLASLt wants
        scale_a=x_scale,
        scale_b=state.scale.view(1, -1),
        out_dtype=state.out_dtype,
    )
    if out is not None:
        out.copy_(logits)
        logits = out
    return logits
