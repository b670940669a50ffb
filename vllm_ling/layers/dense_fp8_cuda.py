"""Block-FP8 dense linears on CUDA: vllm-ling's W8A16 kernel for decode-sized batches.

vLLM 0.32 runs Ling's block-FP8 dense linears W8A8 (activations quantized per token and
128-group, then DeepGEMM / CUTLASS / Triton block-scaled GEMMs). At decode sizes the weights are
the bytes and the extra quantization launch costs more than it saves
(``benchmarks/results/dense_fp8_h200.md``). This method *is* vLLM's ``Fp8LinearMethod``
(same parameters, loaders and post-load processing, and vLLM's kernel for larger batches); it
keeps a reference to the loaded e4m3 weight and an fp32 copy of the block scales from before
vLLM's processing, and runs :func:`vllm_ling.ops.dense_fp8.w8a16_linear` (BF16 activations, fp32
accumulation, one launch: the CUDA decode kernel, or the Triton kernel where it cannot run or the
tuned table prefers it) for batches of at most ``DECODE_MAX_ROWS`` tokens (fewer on the shapes where
vLLM's kernel measured faster from some batch size on: ``tuned_configs.W8A16_MAX_ROWS``). The decode kernel
reads the e4m3 NaN codes as +-480, so a weight holding them is refused at load, named. vLLM compiles the
model with ``torch.compile(fullgraph=True)`` and symbolic batch sizes, so the choice between the
two kernels happens inside one custom op (``vllm_ling::dense_fp8_linear``, the layer found by
name as vLLM's own layer ops do), never as a Python branch on the traced batch size. Where vLLM's
processing replaced the weight tensor (e.g. a Marlin repack), that layer keeps vLLM's kernel and
the reason is logged once and reported. After loading, each layer resolves its kernel per decode
row count once (the op hands it to the launcher) and records its final kernels for decode and
prefill sizes (:func:`~vllm_ling.ops.dense_fp8.selection.select_after_load`), which the startup
verification reads back (``runtime/verification/``), comparing both kernels on one layer too.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

from vllm_ling.layers.op_layers import LayersByName
from vllm_ling.log import get_logger, log_once
from vllm_ling.ops.dense_fp8.decode_kernel import MAX_ROWS as DECODE_MAX_ROWS
from vllm_ling.ops.dense_fp8.linear import describe_kernels
from vllm_ling.ops.dense_fp8.tuned_configs import w8a16_max_rows
from vllm_ling.ops.dense_fp8.selection import (OPTION, DenseFp8Kernel, DenseFp8Unavailable, DenseShape,
                                               select_after_load, select_dense_fp8, unaligned_shards)
from vllm_ling.options import DenseFp8, LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection, record, recorded

__all__ = ["DenseFp8Unavailable", "LingBlockFp8LinearMethod", "LingW8A16Fp8LinearMethod", "choose_dense_fp8_method",
           "unaligned_shards"]

logger = get_logger("quant.dense_fp8")

CUDA_DENSE_FP8_PATH = f"vllm-ling W8A16 block-FP8 kernel for <= {DECODE_MAX_ROWS} tokens (no activation quantization), vLLM's above"


def block_scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    """A private fp32 copy of the checkpoint's block scales (fp32, or E8M0 exponents for
    ``scale_fmt: ue8m0``; E8M0 -> fp32 is exact), as the kernel reads them."""
    return scale.to(torch.float32).contiguous().clone()


_LAYERS = LayersByName()  # op name -> layer (layers/op_layers.py: why names are prefixes)


def _dense_fp8_linear_impl(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    layer = _LAYERS[layer_name]
    rows = x.numel() // x.shape[-1]
    if getattr(layer, "ling_w8a16", None) is None or rows > layer.ling_w8a16_max_rows or x.dtype != torch.bfloat16:
        # the method that prepared the layer (a known-answer scratch layer has no quant_method). A strided
        # view (MLA's kv_b_proj over the cached context's latents, a slice of a wider buffer) is copied:
        # vLLM quantizes a non-contiguous input with its Triton fallback instead of its CUDA kernel, and
        # JIT-compiled it in the first long prompt of every fresh server (lease 2026-12-06c's logs)
        return Fp8LinearMethod.apply(layer.ling_dense_fp8_method, layer, x.contiguous())
    return LingW8A16Fp8LinearMethod.apply_w8a16(layer, x)


def _dense_fp8_linear_fake(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[layer_name].output_size_per_partition))


dense_fp8_linear_op = torch.library.custom_op("vllm_ling::dense_fp8_linear", _dense_fp8_linear_impl,
                                              mutates_args=())
dense_fp8_linear_op.register_fake(_dense_fp8_linear_fake)


def refuse_nan_codes(weight: torch.Tensor, prefix: str) -> None:
    """A corrupt checkpoint fails here, named: the decode kernel reads the e4m3 NaN codes
    (0x7F, 0xFF; no quantizer writes them) as +-480, where vLLM's kernels would give NaN."""
    count = int(((weight.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if count:
        raise ValueError(f"{prefix}.weight holds {count} e4m3 NaN codes (0x7F/0xFF): the checkpoint is corrupt; "
                         f"re-export it (or serve with {opt_out_setting(OPTION)} to see NaN outputs instead)")


E8M0_UPCAST = "float32 (upcast from E8M0)"


def fit_block_scales(layer: torch.nn.Module, kernel_name: str) -> str:
    """Make the block scales readable by the kernel vLLM selected, after vLLM's processing.

    A ``scale_fmt: ue8m0`` checkpoint loads ``float8_e8m0fnu`` scales. vLLM 0.32's DeepGEMM, B12x
    and CPU kernels convert them while processing; CUTLASS and Triton keep them and read them as
    float32 (``dispatch_scaled_mm`` raises in vLLM's memory-profile run: vllm#47818, GB10 too). So
    scales still in E8M0 here are upcast once (exact: E8M0 holds powers of two); the startup
    known-answer check proves the served kernel reads them right. Returns what the layer holds.
    """
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import FP8BlockParams

    name = FP8BlockParams.from_layer(layer).block_scale_attr  # the name vLLM's kernels read it by
    scale = getattr(layer, name, None)
    if scale is None:
        return "none"
    if scale.dtype != torch.float8_e8m0fnu:
        return str(scale.dtype).replace("torch.", "")
    from vllm.model_executor.utils import replace_parameter

    replace_parameter(layer, name, block_scales_fp32(scale.data))
    log_once(logger, logging.INFO, f"dense-fp8-e8m0-upcast-{kernel_name}",
             "Dense block-FP8 linears on %s: the checkpoint's E8M0 block scales upcast to float32 once "
             "(the kernel reads float32 scales; vllm#47818).", kernel_name)
    return E8M0_UPCAST


class LingBlockFp8LinearMethod(Fp8LinearMethod):
    """vLLM's block-FP8 method and kernel at every batch size, with the block scales in the form
    the selected kernel reads (:func:`fit_block_scales`). What serves when the W8A16 kernel is
    opted out or cannot index a layer: a correctness fix, not an optimization."""

    def __init__(self, quant_config, prefix: str):
        super().__init__(quant_config)
        self.prefix = prefix
        self.block_scales: str | None = None  # what the processed layers' scales are (the report's)

    @property
    def vllm_kernel_name(self) -> str:
        return type(getattr(self, "fp8_linear", None)).__name__

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        self._fit_scales(layer)
        self._record_final(layer)

    def _fit_scales(self, layer: torch.nn.Module) -> None:
        if not getattr(self, "use_marlin", False):  # Marlin repacks the scales into its own layout
            self.block_scales = layer.ling_block_scales = fit_block_scales(layer, self.vllm_kernel_name)

    _kernel = DenseFp8Kernel.VLLM  # what a known-answer scratch layer (no pre-load selection) was selected for

    def _record_final(self, layer: torch.nn.Module, **after_load) -> None:
        """Record what serves the loaded layer: its pre-load selection with the kernels its post-load
        decisions left (:func:`~vllm_ling.ops.dense_fp8.selection.select_after_load`)."""
        selected = recorded(layer, Feature.DENSE_FP8) or Selection(Feature.DENSE_FP8, self._kernel, "scratch layer")
        record(layer, select_after_load(selected, self.vllm_kernel_name, **after_load))


class LingW8A16Fp8LinearMethod(LingBlockFp8LinearMethod):
    _kernel = DenseFp8Kernel.W8A16

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm.model_executor import utils as vllm_utils

        # known-answer checks process scratch layers through copies of this method (same prefix):
        # they get their own names and keep the served layer's
        layer.ling_dense_fp8_key = _LAYERS.register(layer, self.prefix, "dense_fp8_linear")
        layer.ling_dense_fp8_method = self
        if vllm_utils.is_weights_pre_processed():  # scales already in vLLM's kernel layout
            Fp8LinearMethod.process_weights_after_loading(self, layer)
            self._keep_vllm(layer, "the checkpoint holds weights pre-processed for vLLM's kernel")
            return
        weight = layer.weight.data
        refuse_nan_codes(weight, self.prefix)
        scale = block_scales_fp32(layer.weight_scale_inv.data)
        Fp8LinearMethod.process_weights_after_loading(self, layer)
        kept = layer.weight.data
        if kept.data_ptr() != weight.data_ptr() or kept.shape != weight.shape or kept.dtype != torch.float8_e4m3fn \
                or not kept.is_contiguous():
            self._keep_vllm(layer, "vLLM's post-load processing replaced the weight tensor")
            return
        self._fit_scales(layer)
        layer.ling_w8a16 = (kept, scale)
        layer.ling_w8a16_reason = None
        layer.ling_w8a16_max_rows, layer.ling_w8a16_configs = decode_plan(kept)
        configs = layer.ling_w8a16_configs
        self._record_final(layer, max_rows=layer.ling_w8a16_max_rows, decode=describe_kernels(configs) if configs else "")

    def _keep_vllm(self, layer: torch.nn.Module, reason: str) -> None:
        self._fit_scales(layer)
        layer.ling_w8a16 = None
        layer.ling_w8a16_reason = reason
        self._record_final(layer, replaced=reason)
        log_once(logger, logging.WARNING, f"dense-fp8-off-{reason}",
                 "Dense block-FP8 W8A16 kernel off for %s and similar layers: %s; vLLM's kernel serves them "
                 "(the startup check dense_fp8_layers reports it).", self.prefix, reason)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.vllm_ling.dense_fp8_linear(x, layer.ling_dense_fp8_key)
        return out if bias is None else out + bias

    @staticmethod
    def apply_w8a16(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The W8A16 kernel on the layer, with the config it resolved for this row count."""
        from vllm_ling.ops.dense_fp8 import w8a16_linear

        weight, scale = layer.ling_w8a16
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        configs = getattr(layer, "ling_w8a16_configs", None)
        config = configs[rows.shape[0] - 1] if configs and 1 <= rows.shape[0] <= len(configs) else None
        out = w8a16_linear(rows, weight, scale, **({} if config is None else {"config": config}))
        return out.reshape(*x.shape[:-1], out.shape[-1])


def decode_plan(weight: torch.Tensor) -> tuple[int, tuple | None]:
    """(the most rows the W8A16 kernels serve, the launch config per row count) for a loaded weight:
    on CUDA per shape and GPU (where vLLM's W8A8 kernel measured faster from some batch size on:
    tuned_configs.W8A16_MAX_ROWS; the CUDA decode or the Triton kernel per row count); elsewhere
    (unit tests) every row count, the launcher picking the config per call."""
    if not weight.is_cuda:
        return DECODE_MAX_ROWS, None
    from vllm_ling.ops.dense_fp8.linear import layer_launch_configs

    max_rows = w8a16_max_rows(*weight.shape, torch.cuda.get_device_capability(weight.device))
    return max_rows, layer_launch_configs(*weight.shape, max_rows, weight.device)


def choose_dense_fp8_method(quant_config, layer, prefix: str, output_partition_sizes: list[int], input_size: int,
                            options: LingOptions, device: torch.device | str | None = None) -> LingBlockFp8LinearMethod:
    """Our method for one CUDA block-FP8 dense linear, built from its selection
    (:func:`~vllm_ling.ops.dense_fp8.selection.select_dense_fp8`), which is recorded on ``layer``:
    W8A16 below vLLM's kernel, or vLLM's kernel at every size (:class:`LingBlockFp8LinearMethod`,
    scales fitted to it) when opted out (one WARNING) or for a linear whose shards the kernel cannot
    index (one WARNING naming it). Raises :class:`DenseFp8Unavailable` before any weight loads."""
    import vllm_ling.ops.dense_fp8 as dense_ops

    selection = record(layer, select_dense_fp8(
        options, Platform.CUDA, DenseShape(tuple(output_partition_sizes), input_size),
        getattr(quant_config, "weight_block_size", None), prefix,
        unavailable_reason=lambda: dense_ops.unavailable_reason(device)))
    if selection.choice is DenseFp8Kernel.W8A16:
        log_once(logger, logging.INFO, "dense-fp8-on", "Dense block-FP8 linears: %s.", CUDA_DENSE_FP8_PATH)
        return LingW8A16Fp8LinearMethod(quant_config, prefix)
    if options.dense_fp8 is DenseFp8.VLLM:
        log_once(logger, logging.WARNING, "dense-fp8-opt-out",
                 "Dense block-FP8 W8A16 kernel is OFF by explicit choice (%s): vLLM selects the dense FP8 "
                 "linear kernel; the startup report marks dense_fp8_decode inactive.", opt_out_setting(OPTION))
    else:
        log_once(logger, logging.WARNING, f"dense-fp8-unaligned-{prefix}",
                 "%s keeps vLLM's block-FP8 kernel: %s.", prefix, selection.reason)
    return LingBlockFp8LinearMethod(quant_config, prefix)


def served_kernels(method, layer) -> tuple:
    """What a CUDA block-FP8 linear serves, read from its method and the state its op dispatches by,
    as :meth:`~vllm_ling.ops.dense_fp8.selection.DenseFp8Selection.served_as` gives it (None: not ours)."""
    if isinstance(method, LingW8A16Fp8LinearMethod) and getattr(layer, "ling_w8a16", None) is not None:
        configs = getattr(layer, "ling_w8a16_configs", None)
        return (DenseFp8Kernel.W8A16, layer.ling_w8a16_max_rows, describe_kernels(configs) if configs else "",
                method.vllm_kernel_name)
    if isinstance(method, LingBlockFp8LinearMethod):  # the post-load fallback of the W8A16 method too
        return (DenseFp8Kernel.VLLM, 0, "", method.vllm_kernel_name)
    return (None,)
