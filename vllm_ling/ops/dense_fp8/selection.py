"""Which kernel serves a block-FP8 dense linear: decided by :func:`select_dense_fp8` before the
weights load, and finally by :func:`select_after_load` once vLLM processed them.

The quant config builds the layer's method from the first answer and records it on the layer;
on CUDA the method records the final one after its post-load decisions (vLLM's processing may
leave the W8A16 kernel nothing to read: an explicit fallback to vLLM's kernel; the row limit per
shape; the kernel per decode row count), so the record names the layer's kernels for decode and
for prefill sizes. ``vllm-ling warmup`` compiles the W8A16 kernels for the shapes selected for
them, and the startup verification proves each layer serves what was recorded. No vLLM import: on
the CPU platform the kernel is decided by behaviour (vLLM's AMX kernel's known answers, run by the
layers package), and arrives here as that platform fact.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from vllm_ling.ops.fp8 import QUANT_BLOCK
from vllm_ling.options import Choice, DenseFp8, LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection

OPTION = "VLLM_LING_DENSE_FP8"


class DenseFp8Kernel(Choice):
    """What serves a block-FP8 dense linear (the report's per-layer kernel)."""

    W8A16 = "w8a16"              # CUDA: vllm-ling's W8A16 kernel for decode-sized batches, vLLM's above
    VLLM = "vllm"                # CUDA: vLLM's kernel at every size (block scales fitted to it)
    VLLM_AMX = "vllm_amx"        # CPU: vLLM's AMX kernel, after it passed its known-answer check
    DEQUANTIZED = "dequantized"  # CPU: vllm-ling's weights dequantized to BF16 at load


class DenseFp8Unavailable(RuntimeError):
    """The W8A16 dense path was requested (the default) and cannot run here."""


@dataclasses.dataclass(frozen=True)
class DenseFp8Selection(Selection):
    """A layer's final kernels: batches of at most ``max_rows`` rows run ``choice`` as ``decode``
    names it per row count, larger ones run ``prefill`` (0 and empty: one kernel at every size)."""

    max_rows: int = 0
    decode: str = ""
    prefill: str = ""

    def served_as(self) -> tuple:
        return (self.choice, self.max_rows, self.decode, self.prefill)


@dataclasses.dataclass(frozen=True)
class DenseShape:
    output_partition_sizes: tuple[int, ...]  # the merged linear's shards, per rank
    input_size: int


def unaligned_shards(output_partition_sizes, input_size: int) -> list[str]:
    """Why a merged linear cannot use the kernel's ``scale row = n // 128`` indexing: every
    shard but the last must be a whole number of 128-row blocks, and K a multiple of 128."""
    out = []
    if input_size % QUANT_BLOCK:
        out.append(f"K={input_size} is not a multiple of {QUANT_BLOCK}")
    for i, width in enumerate(list(output_partition_sizes)[:-1]):
        if width % QUANT_BLOCK:
            out.append(f"shard {i} has {width} rows, not a multiple of {QUANT_BLOCK}")
    return out


def select_dense_fp8(options: LingOptions, platform: Platform, shape: DenseShape, weight_block_size, prefix: str,
                     *, unavailable_reason: Callable[[], str | None] | None = None,
                     cpu_kernel: Callable[[], tuple[DenseFp8Kernel, str]] | None = None) -> Selection:
    """The selection for one block-FP8 dense linear of ``shape``.

    CUDA: ``VLLM_LING_DENSE_FP8=vllm`` opts out; otherwise the W8A16 kernel must run on this GPU
    (``unavailable_reason()``, default: ask the kernel's launcher; else :class:`DenseFp8Unavailable`,
    before any weight loads, naming the opt-out) and a linear whose shards it cannot index keeps
    vLLM's kernel. CPU: ``cpu_kernel()``, the process-wide behavioural decision.
    """
    if platform is Platform.CPU:
        if cpu_kernel is None:
            raise ValueError("the CPU platform's dense FP8 kernel is decided by behaviour: pass cpu_kernel")
        kernel, reason = cpu_kernel()
        return DenseFp8Selection(Feature.DENSE_FP8, kernel, reason)  # final: no post-load decision on CPU
    if options.dense_fp8 is DenseFp8.VLLM:
        return Selection(Feature.DENSE_FP8, DenseFp8Kernel.VLLM, f"opted out: {opt_out_setting(OPTION)}")
    block = list(weight_block_size or [])
    if block != [QUANT_BLOCK, QUANT_BLOCK]:
        raise DenseFp8Unavailable(f"{prefix}: the W8A16 kernel reads 128x128 block scales, the checkpoint has "
                                  f"{block}; opt out with {opt_out_setting(OPTION)}")
    if unavailable_reason is None:
        import vllm_ling.ops.dense_fp8 as dense_ops

        why = dense_ops.unavailable_reason()
    else:
        why = unavailable_reason()
    if why:
        raise DenseFp8Unavailable(f"dense block-FP8 W8A16 kernel cannot run for {prefix}: {why}; opt out with "
                                  f"{opt_out_setting(OPTION)}")
    problems = unaligned_shards(shape.output_partition_sizes, shape.input_size)
    if problems:
        return Selection(Feature.DENSE_FP8, DenseFp8Kernel.VLLM, "the W8A16 kernel cannot index it: " + "; ".join(problems))
    return Selection(Feature.DENSE_FP8, DenseFp8Kernel.W8A16, "CUDA, the W8A16 kernel runs")


def select_after_load(selected: Selection, prefill: str, *, replaced: str | None = None, max_rows: int = 0,
                      decode: str = "") -> DenseFp8Selection:
    """The final selection of a CUDA linear once vLLM processed its weights: ``selected`` (the
    pre-load answer) with the kernels that serve it, W8A16 for batches of at most ``max_rows`` rows
    (``decode``: the kernel per row count) and vLLM's ``prefill`` kernel above; or, where vLLM's
    processing ``replaced`` what the W8A16 kernel reads (the reason), vLLM's kernel at every size, an
    explicit fallback."""
    if selected.choice is DenseFp8Kernel.W8A16 and replaced is None:
        return DenseFp8Selection(Feature.DENSE_FP8, DenseFp8Kernel.W8A16, selected.reason, max_rows=max_rows,
                                 decode=decode, prefill=prefill)
    if selected.choice is DenseFp8Kernel.W8A16:
        return DenseFp8Selection(Feature.DENSE_FP8, DenseFp8Kernel.VLLM, f"{replaced}: vLLM's kernel at every size",
                                 fallback_from=DenseFp8Kernel.W8A16, prefill=prefill)
    return DenseFp8Selection(Feature.DENSE_FP8, selected.choice, selected.reason, selected.fallback_from,
                             prefill=prefill)
