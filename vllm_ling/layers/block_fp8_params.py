"""The parameters of a block-FP8 dense linear exactly as vLLM's ``Fp8LinearMethod`` creates them.

Same names, dtypes, shapes and weight loaders (``weight`` e4m3 [N, K], ``weight_scale_inv``
[ceil(N/128) per shard, ceil(K/128)], fp32 or E8M0 when the checkpoint says ``scale_fmt:
ue8m0``), so vLLM's loaders fill them; vllm-ling's block-FP8 methods (the CPU reference and the
CUDA W8A16 decode kernel) differ only in what they do after loading and in ``apply``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    create_fp8_scale_parameter,
    create_fp8_weight_parameter,
    validate_fp8_block_shape,
)
from vllm.model_executor.parameter import BlockQuantScaleParameter


class BlockFp8LinearMethodBase(LinearMethodBase):
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
