"""Block-FP8 dense linears on CUDA through vllm-ling's W8A16 decode kernel.

vLLM 0.32 runs Ling's block-FP8 dense linears W8A8 (activations quantized per token and
128-group, then DeepGEMM / CUTLASS / Triton block-scaled GEMMs). At decode sizes the weights
are the bytes and the extra quantization launch costs more than it saves; this method keeps
vLLM's parameters and loaders (:mod:`.block_fp8_params`), keeps the checkpoint's e4m3 weight
as loaded, turns its block scales into fp32 once, and runs :func:`vllm_ling.ops.dense_fp8
.w8a16_linear` (BF16 activations, fp32 accumulation, one launch; launch configs per GPU
architecture in ``ops/dense_fp8/tuned_configs.py``). Measured in
``benchmarks/results/dense_fp8_h200.md``.

Not yet selected by ``ling_fp8`` (the wiring waits for the option table of issue 16):
:func:`choose_dense_fp8_method` holds the rules it will apply.
"""

from __future__ import annotations

import logging

import torch

from vllm_ling.layers.block_fp8_params import BlockFp8LinearMethodBase
from vllm_ling.log import get_logger, log_once

logger = get_logger("quant.dense_fp8")

CUDA_DENSE_FP8_PATH = "vllm-ling W8A16 block-FP8 kernel (BF16 activations, no activation quantization)"
QUANT_BLOCK = 128


class DenseFp8Unavailable(RuntimeError):
    """The W8A16 dense path was requested (the default) and cannot run here."""


def unaligned_shards(output_partition_sizes: list[int], input_size: int) -> list[str]:
    """Why a merged linear cannot use the kernel's ``scale row = n // 128`` indexing: every
    shard but the last must be a whole number of 128-row blocks, and K a multiple of 128."""
    out = []
    if input_size % QUANT_BLOCK:
        out.append(f"K={input_size} is not a multiple of {QUANT_BLOCK}")
    for i, width in enumerate(output_partition_sizes[:-1]):
        if width % QUANT_BLOCK:
            out.append(f"shard {i} has {width} rows, not a multiple of {QUANT_BLOCK}")
    return out


def block_scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    """The checkpoint's block scales (fp32, or E8M0 exponents for ``scale_fmt: ue8m0``) as the
    contiguous fp32 tensor the kernel reads; E8M0 -> fp32 is exact."""
    return scale.to(torch.float32).contiguous()


class W8A16BlockFp8LinearMethod(BlockFp8LinearMethodBase):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm.model_executor.utils import replace_parameter

        problems = unaligned_shards(list(layer.logical_widths), layer.input_size_per_partition)
        if problems:  # choose_dense_fp8_method checks this before weights load
            raise ValueError(f"W8A16 block-FP8 kernel cannot run this linear: {'; '.join(problems)}")
        replace_parameter(layer, "weight_scale_inv", block_scales_fp32(layer.weight_scale_inv.data))
        if not layer.weight.data.is_contiguous():
            replace_parameter(layer, "weight", layer.weight.data.contiguous())

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from vllm_ling.ops.dense_fp8 import w8a16_linear

        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        out = w8a16_linear(x2.contiguous(), layer.weight, layer.weight_scale_inv)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def choose_dense_fp8_method(prefix: str, output_partition_sizes: list[int], input_size: int,
                            weight_block_size: list[int], is_scale_e8m0: bool, option: str,
                            device: torch.device | str | None = None) -> W8A16BlockFp8LinearMethod | None:
    """Our method for one CUDA block-FP8 dense linear, or None to let vLLM choose.

    ``option`` "vllm" opts out (one WARNING). Otherwise the kernel must be able to run on this
    GPU (else :class:`DenseFp8Unavailable`, before any weight loads, naming the opt-out); a
    linear whose shards the kernel cannot index keeps vLLM's method with one WARNING naming it.
    """
    if option == "vllm":
        log_once(logger, logging.WARNING, "dense-fp8-opt-out",
                 "Dense block-FP8 W8A16 kernel is OFF by explicit choice: vLLM selects the dense FP8 "
                 "linear kernel; the startup report marks dense_fp8_decode inactive.")
        return None
    if list(weight_block_size) != [QUANT_BLOCK, QUANT_BLOCK]:
        raise DenseFp8Unavailable(f"{prefix}: the W8A16 kernel reads 128x128 block scales, the checkpoint has "
                                  f"{list(weight_block_size)}; opt out with the dense FP8 option set to vllm")
    from vllm_ling.ops.dense_fp8 import unavailable_reason

    why = unavailable_reason(device)
    if why:
        raise DenseFp8Unavailable(f"dense block-FP8 W8A16 kernel cannot run for {prefix}: {why}; opt out "
                                  "with the dense FP8 option set to vllm")
    problems = unaligned_shards(output_partition_sizes, input_size)
    if problems:
        log_once(logger, logging.WARNING, f"dense-fp8-unaligned-{prefix}",
                 "%s keeps vLLM's block-FP8 kernel: %s.", prefix, "; ".join(problems))
        return None
    return W8A16BlockFp8LinearMethod(weight_block_size, is_scale_e8m0)
