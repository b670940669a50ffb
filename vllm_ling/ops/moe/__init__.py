"""Ling-3.0 MoE block: plain-PyTorch reference and the humming MXFP4 fused-MoE path.

Modules (one idea each; import from them directly):

- :mod:`.activation`: SwiGLU with the per-layer clamp, its two modes and their constants;
- :mod:`.routing`: the grouped top-k router (reference), routing metadata for the indexed
  GEMM (``moe_align_block_size``) and the weighted top-k sum;
- :mod:`.reference`: routed experts, shared expert and the whole block in float32;
- :mod:`.humming`: :class:`~.humming.HummingMxfp4Experts`, humming's indexed MoE GEMM;
- :mod:`.decode`: fused CUDA decode kernels for small batches (CUDA sources as package data);
- :mod:`.warmup`: compile every kernel the layer needs ahead of serving.

Imports run one way: activation <- routing <- reference; activation <- decode <- humming <-
warmup. No vLLM import anywhere (this package runs on the GPU device machine without vLLM).
The names below are what the layers and the CLI use (``from vllm_ling.ops import moe as moe_ops``).
"""

from vllm_ling.ops.moe.activation import layer_swiglu_limit
from vllm_ling.ops.moe.humming import (DECODE_AUTO, DECODE_COPY, DECODE_MODES, DECODE_OFF,
                                       DEFAULT_DECODE_MAX_TOKENS, HummingMxfp4Experts,
                                       HummingUnavailable, humming_status)
from vllm_ling.ops.moe.reference import LingMoEConfig, experts_reference, moe_block_reference
from vllm_ling.ops.moe.warmup import random_mxfp4_experts, warmup_kernels

__all__ = ["DECODE_AUTO", "DECODE_COPY", "DECODE_MODES", "DECODE_OFF", "DEFAULT_DECODE_MAX_TOKENS",
           "HummingMxfp4Experts", "HummingUnavailable", "LingMoEConfig", "experts_reference",
           "humming_status", "layer_swiglu_limit", "moe_block_reference", "random_mxfp4_experts",
           "warmup_kernels"]
