"""``ling_fp8``: vLLM's Fp8Config for Ling-3.0 -fp4 checkpoints, with vllm-ling's methods.

It takes over automatically (``override_quantization_method``) for checkpoints whose
``quantization_config`` says ``quant_method: fp8`` with MXFP4 routed experts, unless
the user named another ``--quantization``. Dense block-FP8 linears run vLLM's method with
vllm-ling's W8A16 kernel for decode-sized batches on CUDA (``VLLM_LING_DENSE_FP8=vllm`` opts
out; either way the block scales are fitted to the kernel vLLM selects) and a plain-PyTorch reference on CPUs without AMX; the linears the checkpoint leaves in BF16
run vLLM's method with vllm-ling's small GEMV for decode-sized batches on CUDA
(``VLLM_LING_BF16_GEMV=vllm`` opts out); routed experts, the LM head and the CPU paths are ours.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.platforms import current_platform

from vllm_ling.log import get_logger, log_once
from vllm_ling.ops.dense_fp8.selection import DenseShape, select_dense_fp8
from vllm_ling.ops.small_gemv.selection import select_bf16_gemv
from vllm_ling.options import LingOptions
from vllm_ling.selection import Platform, record

LING_QUANT_NAME = "ling_fp8"
logger = get_logger("quant")


def is_ling_fp4_checkpoint(hf_quant_cfg: dict[str, Any] | None) -> bool:
    return (isinstance(hf_quant_cfg, dict)
            and hf_quant_cfg.get("quant_method") == "fp8"
            and hf_quant_cfg.get("routed_experts_quant_method") == "mxfp4")


class LingFp8Config(Fp8Config):
    @classmethod
    def get_name(cls) -> str:
        return LING_QUANT_NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if is_ling_fp4_checkpoint(hf_quant_cfg) and user_quant in (None, LING_QUANT_NAME):
            return LING_QUANT_NAME
        return None

    @property
    def options(self) -> LingOptions:
        return LingOptions.current()

    def _skipped(self, prefix: str) -> bool:
        return is_layer_skipped(prefix=prefix, ignored_layers=self.ignored_layers,
                                fused_mapping=self.packed_modules_mapping,
                                match_mode=self.ignored_layers_match_mode)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase) and self.weight_block_size is not None \
                and current_platform.is_cpu() and not self._skipped(prefix):
            # vLLM's AMX kernel serves only if it passes its known-answer check (decided once).
            from vllm_ling.layers.dense_fp8_path import DEQUANTIZED, cpu_dense_fp8_path

            path = cpu_dense_fp8_path(self)
            selection = record(layer, select_dense_fp8(self.options, Platform.CPU, _dense_shape(layer), self.weight_block_size,
                                                       prefix, cpu_kernel=lambda: (path.kernel, path.reason)))
            if selection.choice is DEQUANTIZED:
                from vllm_ling.layers.dense_fp8_cpu import CPU_DENSE_FP8_PATH, CpuBlockFp8LinearMethod

                log_once(logger, logging.INFO, "cpu-dense", "Dense block-FP8 linears: %s (%s).",
                         CPU_DENSE_FP8_PATH, selection.reason)
                return CpuBlockFp8LinearMethod(self.weight_block_size,
                                               bool(getattr(self, "is_scale_e8m0", False)))
            log_once(logger, logging.INFO, "cpu-dense", "Dense block-FP8 linears: vLLM's kernel (%s).", selection.reason)
        if isinstance(layer, LinearBase) and self.weight_block_size is not None \
                and current_platform.is_cuda() and not self._skipped(prefix):
            from vllm_ling.layers.dense_fp8_cuda import choose_dense_fp8_method

            shape = _dense_shape(layer)
            method = choose_dense_fp8_method(self, layer, prefix, list(shape.output_partition_sizes), shape.input_size,
                                             self.options)
            from vllm.model_executor.layers.quantization.utils.marlin_utils import get_marlin_input_dtype

            method.marlin_input_dtype = get_marlin_input_dtype(prefix)  # as Fp8Config does
            return method
        if isinstance(layer, LinearBase) and current_platform.is_cuda() and self._skipped(prefix):
            from vllm_ling.layers.small_bf16_cuda import choose_small_bf16_method

            method = choose_small_bf16_method(layer, prefix, self.options)
            if method is not None:
                return method
        elif isinstance(layer, LinearBase) and self._skipped(prefix):
            record(layer, select_bf16_gemv(self.options, Platform.CPU, prefix))  # vLLM's GEMM, said on the layer
        if isinstance(layer, ParallelLMHead):
            from vllm_ling.ops.lm_head.selection import Fp8Head, select_fp8_head

            if record(layer, select_fp8_head(self.options)).choice is Fp8Head.FP8:
                from vllm_ling.layers.fp8_lm_head import Fp8LmHeadMethod

                return Fp8LmHeadMethod()
        if isinstance(layer, RoutedExperts) and self.store_dtype == "mxfp4" \
                and not self._skipped(prefix):
            from vllm_ling.layers.moe_method import choose_moe_method

            method = choose_moe_method(layer, prefix, self.options)
            if method is not None:
                return method
        return super().get_quant_method(layer, prefix)


def _dense_shape(layer) -> DenseShape:
    return DenseShape(tuple(getattr(layer, "output_partition_sizes", None) or [layer.output_size]), layer.input_size)


def register_ling_quant_config() -> list[str]:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    if LING_QUANT_NAME not in QUANTIZATION_METHODS or \
            get_quantization_config(LING_QUANT_NAME) is not LingFp8Config:
        register_quantization_config(LING_QUANT_NAME)(LingFp8Config)
    return [f"quantization {LING_QUANT_NAME} (Ling -fp4 checkpoints)"]
