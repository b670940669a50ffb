"""The prepared FP8 head: what one kernel needs per forward."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_ling.options import HeadKernel


@dataclasses.dataclass
class Fp8HeadState:
    """Everything one kernel needs per forward. ``weight``/``scale`` are in that kernel's
    layout (humming: its repacked int32 weight and ``[V, 1]`` bf16 scale; the others: the
    ``[V, H]`` e4m3 weight and ``[V]`` fp32 scale). Register them on the module (they are
    the only large tensors) so they move and count with it."""

    kernel: HeadKernel
    vocab_size: int
    hidden_size: int
    weight: torch.Tensor
    scale: torch.Tensor
    out_dtype: torch.dtype = torch.bfloat16
    reason: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def nbytes(self) -> int:
        tensors = [self.weight, self.scale] + [v for v in self.extra.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)
