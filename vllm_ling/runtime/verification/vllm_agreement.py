"""Known answers on the served layers themselves: where vllm-ling's kernel serves a dense
block-FP8 or an unquantized BF16 linear, its output for random rows against vLLM's own kernel on
the same layer (the first such layer of the census). Each finding joins its feature's row. The
known answers on scratch layers are :mod:`.known_answers`."""

from __future__ import annotations

import torch

from vllm_ling.log import get_logger, one_line
from vllm_ling.ops.dense_fp8.selection import OPTION as DENSE_OPTION
from vllm_ling.ops.dense_fp8.selection import DenseFp8Kernel
from vllm_ling.ops.small_gemv.selection import GemvPath
from vllm_ling.options import opt_out_setting
from vllm_ling.runtime.verification.census import Census, Entry
from vllm_ling.runtime.verification.checks import Check, guarded
from vllm_ling.selection import Feature

logger = get_logger("verify")

DENSE_FP8_MAX_REL_DIFF = 0.1  # vs vLLM's W8A8 kernel: its activation quantization alone is ~2-4% L2
SMALL_BF16_MAX_REL_DIFF = 2.0**-7  # vs vLLM's BF16 GEMM: both round once to BF16 from fp32 sums


def _rel(ours: torch.Tensor, vllm: torch.Tensor) -> float:
    return float((ours.float() - vllm.float()).norm() / vllm.float().norm().clamp_min(1e-30))


def findings(census: Census) -> list[Check]:
    """One finding per feature whose kernel serves a layer, named as that feature's row."""
    found = []
    for feature, ours, compare in ((Feature.DENSE_FP8, DenseFp8Kernel.W8A16, dense_fp8),
                                   (Feature.BF16_GEMV, GemvPath.LING, small_bf16)):
        serving = [e for e in census.of(feature) if e.served.key[0] is ours]
        if serving:
            found.append(guarded(serving[0].reader.check, lambda: compare(serving[0])))
    return found


def dense_fp8(served: Entry) -> Check:
    """The W8A16 kernel against vLLM's (W8A8) kernel on two random rows."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from vllm_ling.layers.dense_fp8_cuda import LingW8A16Fp8LinearMethod

    row, name, layer = served.reader.check, served.name, served.module
    above = layer.quant_method.vllm_kernel_name
    expected = "the W8A16 kernel agreeing with vLLM's kernel"
    actual = f"vLLM's {above} reads block scales {getattr(layer, 'ling_block_scales', 'as loaded')}"
    try:
        gen = torch.Generator(device=layer.weight.device).manual_seed(0)
        x = torch.randn((2, layer.input_size_per_partition), device=layer.weight.device, generator=gen,
                        dtype=torch.float32).to(torch.bfloat16)
        with torch.no_grad():
            rel = _rel(LingW8A16Fp8LinearMethod.apply_w8a16(layer, x), Fp8LinearMethod.apply(layer.quant_method, layer, x))
    except Exception as exc:  # the check fails, naming the kernel that raised; the server does not crash
        logger.debug("%s: known answer on %s raised", row, name, exc_info=True)
        return Check(row, False, expected, f"{actual}; known answer on {name} raised {one_line(exc)} (W8A16 kernel "
                     f"vs vLLM's {above})", f"vLLM's {above} cannot run this layer: set "
                     f"{opt_out_setting(DENSE_OPTION)} to see whether vLLM's kernel serves it alone, or report the kernel")
    return Check(row, rel < DENSE_FP8_MAX_REL_DIFF, expected,
                 f"{actual}; known answer on {name}: relative L2 difference to vLLM's kernel {rel:.3g} "
                 f"(limit {DENSE_FP8_MAX_REL_DIFF})", "report the kernel, and serve with "
                 f"{opt_out_setting(DENSE_OPTION)} meanwhile")


def small_bf16(served: Entry) -> Check:
    """The small GEMV against vLLM's own GEMM, at one row count per launch shape the kernel picks
    for the layer (CTA width, direct or staged rows)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_ling.layers.small_bf16_cuda import LingSmallBf16LinearMethod
    from vllm_ling.ops.small_gemv.kernel import BF16_MAX_ROWS, launch_row_counts

    row, name, layer = served.reader.check, served.name, served.module
    gen = torch.Generator(device=layer.weight.device).manual_seed(0)
    row_counts = launch_row_counts(layer.weight.shape[0], BF16_MAX_ROWS)
    rel = 0.0
    for rows in row_counts:
        x = torch.randn((rows, layer.weight.shape[1]), device=layer.weight.device, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            rel = max(rel, _rel(LingSmallBf16LinearMethod.apply_small_gemv(layer, x),
                                UnquantizedLinearMethod.apply(layer.quant_method, layer, x)))
    return Check(row, rel < SMALL_BF16_MAX_REL_DIFF, "the small GEMV agreeing with vLLM's GEMM",
                 f"known answer on {name} at {', '.join(map(str, row_counts))} rows: largest relative L2 difference "
                 f"to vLLM's GEMM {rel:.3g} (limit {SMALL_BF16_MAX_REL_DIFF:.3g})",
                 f"report the kernel, and serve with {opt_out_setting('VLLM_LING_BF16_GEMV')} meanwhile")
