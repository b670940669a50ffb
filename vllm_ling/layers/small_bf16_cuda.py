"""The BF16 linears a Ling -fp4 checkpoint leaves unquantized, on CUDA: vllm-ling's small GEMV for
decode-sized batches.

The checkpoint keeps KDA ``b_proj`` and MLA ``g_proj`` (32 heads x 2560 each, 43 layers) in BF16
(``modules_to_not_convert``). vLLM runs them through ``UnquantizedLinearMethod``, i.e. cuBLAS,
which spends about 6 us on each 164 KB weight at decode sizes, 0.25 ms per step
(``benchmarks/results/small_gemv_h200.md``). This method *is* vLLM's ``UnquantizedLinearMethod``
(same parameter, loader, post-load processing, and vLLM's GEMM above ``SMALL_BF16_MAX_ROWS``
tokens); up to that many tokens it runs :func:`vllm_ling.ops.small_gemv.small_gemv`: one launch
whose weight load overlaps the previous kernel. As for the dense FP8 method, the row-count choice
happens inside one custom op (``vllm_ling::small_bf16_linear``, the layer found by name), never
as a Python branch on vLLM's traced batch size. A layer the kernel cannot hold keeps vLLM's GEMM
with one WARNING, recording that fallback; the startup verification reads each layer back
(:data:`READER`) and checks the served layers against vLLM's GEMM (``runtime/verification/``).
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from vllm_ling.layers.op_layers import LayersByName
from vllm_ling.log import get_logger, log_once
from vllm_ling.ops.small_gemv.kernel import BF16_MAX_ROWS as SMALL_BF16_MAX_ROWS
from vllm_ling.ops.small_gemv.selection import (BF16_OPTION, Bf16GemvUnavailable, GemvPath, bf16_gemv_after_load,
                                                select_bf16_gemv)
from vllm_ling.options import LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Platform, Reader, Selection, Served, record, recorded

logger = get_logger("quant.small_bf16")

SMALL_BF16_MAX_N = 512    # output rows per rank: the sizes measured (a GEMM library wins on wide weights)
__all__ = ["READER", "Bf16GemvUnavailable", "LingSmallBf16LinearMethod", "choose_small_bf16_method",
           "kernel_problems", "served"]

_LAYERS = LayersByName()  # op name -> layer (layers/op_layers.py: why names are prefixes)


def _small_bf16_linear_impl(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    layer = _LAYERS[layer_name]
    rows = x.numel() // x.shape[-1]
    # the kernel takes 1..SMALL_BF16_MAX_ROWS rows: vLLM's GEMM answers an empty batch too
    if getattr(layer, "ling_small_gemv", None) is None or not 1 <= rows <= SMALL_BF16_MAX_ROWS \
            or x.dtype != torch.bfloat16:
        return UnquantizedLinearMethod.apply(layer.quant_method, layer, x)
    return LingSmallBf16LinearMethod.apply_small_gemv(layer, x)


def _small_bf16_linear_fake(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[layer_name].weight.shape[0]))


small_bf16_linear_op = torch.library.custom_op("vllm_ling::small_bf16_linear", _small_bf16_linear_impl,
                                               mutates_args=())
small_bf16_linear_op.register_fake(_small_bf16_linear_fake)


def kernel_problems(weight: torch.Tensor) -> list[str]:
    """Why the small GEMV cannot serve a loaded weight (empty when it can)."""
    from vllm_ling.ops.small_gemv import shape_problems

    if weight.dim() != 2:
        return [f"weight has {weight.dim()} dimensions"]
    out = [] if weight.dtype == torch.bfloat16 else [f"weight dtype {weight.dtype} is not BF16"]
    if weight.shape[0] > SMALL_BF16_MAX_N:
        out.append(f"{weight.shape[0]} output rows exceed {SMALL_BF16_MAX_N}")
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        out.append("weight is not contiguous and 16-byte aligned")
    return out + shape_problems(weight.shape[0], weight.shape[1], weight.dtype)


class LingSmallBf16LinearMethod(UnquantizedLinearMethod):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.ling_small_gemv_key = _LAYERS.register(layer, self.prefix, "small_bf16_linear")
        problems = kernel_problems(layer.weight.data)
        layer.ling_small_gemv = None if problems else layer.weight.data
        layer.ling_small_gemv_reason = "; ".join(problems) or None
        selected = recorded(layer, Feature.BF16_GEMV) or Selection(Feature.BF16_GEMV, GemvPath.LING, "scratch layer")
        record(layer, bf16_gemv_after_load(selected, problems))
        if problems:
            log_once(logger, logging.WARNING, f"small-bf16-off-{layer.ling_small_gemv_reason}",
                     "BF16 linear %s keeps vLLM's GEMM (the small GEMV cannot hold it: %s); the startup check "
                     "small_bf16_layers reports it.", self.prefix, layer.ling_small_gemv_reason)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.vllm_ling.small_bf16_linear(x, layer.ling_small_gemv_key)
        return out if bias is None else out + bias

    @staticmethod
    def apply_small_gemv(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from vllm_ling.ops import small_gemv as ops

        out = ops.small_gemv(ops.kernel_rows(x), layer.ling_small_gemv, torch.bfloat16)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def choose_small_bf16_method(layer, prefix: str, options: LingOptions,
                             device: torch.device | str | None = None) -> UnquantizedLinearMethod | None:
    """Our method for one unquantized (checkpoint-skipped) linear on CUDA, or None to let vLLM
    choose, from its selection (:func:`~vllm_ling.ops.small_gemv.selection.select_bf16_gemv`),
    recorded on ``layer``. Opted out: one WARNING; a kernel that cannot run on this GPU raises
    :class:`Bf16GemvUnavailable` before any weight loads, naming the opt-out."""
    import vllm_ling.ops.small_gemv as gemv_ops

    selection = record(layer, select_bf16_gemv(options, Platform.CUDA, prefix,
                                               unavailable_reason=lambda: gemv_ops.unavailable_reason(device)))
    if selection.choice is GemvPath.VLLM:
        log_once(logger, logging.WARNING, "small-gemv-opt-out-bf16",
                 "Small GEMV for BF16 linears is OFF by explicit choice (%s): vLLM's GEMM serves the checkpoint's "
                 "unquantized linears; the startup report marks small_bf16_decode inactive.", opt_out_setting(BF16_OPTION))
        return None
    log_once(logger, logging.INFO, "small-bf16-on",
             "Unquantized BF16 linears: vllm-ling small GEMV for <= %d tokens, vLLM's GEMM above.", SMALL_BF16_MAX_ROWS)
    return LingSmallBf16LinearMethod(prefix)


def _is_unquantized(layer) -> bool:
    """A linear the checkpoint leaves unquantized: built with the quant config, which gave it vLLM's
    unquantized method or ours (the ones built without one, e.g. the KDA conv weights and the router
    gate, are not the checkpoint's to quantize); or one with a selection recorded."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(layer, LinearBase) and (recorded(layer, Feature.BF16_GEMV) is not None or (
        getattr(layer, "quant_config", None) is not None
        and isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod)
        and isinstance(getattr(layer, "weight", None), torch.Tensor)))


def served(layer) -> Served:
    """What an unquantized linear serves at decode sizes, read from its method and the weight its op
    dispatches by: the small GEMV, or vLLM's GEMM (vLLM's method, or ours on a weight it cannot hold)."""
    if isinstance(getattr(layer, "quant_method", None), LingSmallBf16LinearMethod) \
            and getattr(layer, "ling_small_gemv", None) is not None:
        return Served.of(GemvPath.LING)
    return Served.of(GemvPath.VLLM)


READER = Reader(
    Feature.BF16_GEMV, "small_bf16_layers", "unquantized linears", _is_unquantized, served,
    f"see the WARNING naming the layers the small GEMV cannot hold, or set {opt_out_setting(BF16_OPTION)}; a "
    "layer serving other than its selection is a defect: report it",
    optimization="small_bf16_decode", optimizing=frozenset({GemvPath.LING}), needs_all=False)
