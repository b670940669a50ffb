"""Which kernel serves block-FP8 dense linears on the CPU platform, decided by behaviour; and
what a loaded block-FP8 linear serves, on either platform (:func:`served_dense_fp8_kernel`).

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
from vllm_ling.ops.dense_fp8.selection import DenseFp8Kernel
from vllm_ling.ops.known_answer import KernelCheckResult

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


_chosen: DenseFp8Path | None = None


def cpu_dense_fp8_path(quant_config) -> DenseFp8Path:
    """The process-wide choice for ``quant_config``'s dense linears (decided on first use,
    while the model is built, so vLLM's config is current)."""
    global _chosen
    if _chosen is None:
        import torch

        def check():
            from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

            from vllm_ling.layers.known_answer import check_dense_fp8_method

            return check_dense_fp8_method(Fp8LinearMethod(quant_config))

        _chosen = choose_cpu_dense_fp8_path(torch.cpu._is_amx_tile_supported(), check)
    return _chosen


def last_choice() -> DenseFp8Path | None:
    """The choice made in this process (None if no dense block-FP8 linear was built on CPU)."""
    return _chosen


def served_dense_fp8_kernel(layer) -> DenseFp8Kernel | None:
    """What a loaded block-FP8 dense linear serves, read from its method and state (None: a method
    that is none of these)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod
    from vllm_ling.layers.dense_fp8_cuda import LingBlockFp8LinearMethod, served_kernel

    method = getattr(layer, "quant_method", None)
    if isinstance(method, CpuBlockFp8LinearMethod):
        return DEQUANTIZED
    if isinstance(method, LingBlockFp8LinearMethod):
        return served_kernel(method, layer)
    if type(method) is Fp8LinearMethod:
        return VLLM_AMX  # vLLM's own block-FP8 method: on vLLM-CPU that is its AMX kernel
    return None
