"""Warm-up of the LM-head kernels (``vllm-ling warmup``): compile the chosen kernel for the
head's shapes ahead of serving."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from vllm_ling.ops.lm_head.head import fp8_head_logits, prepare_fp8_head
from vllm_ling.ops.lm_head.quantize import quantize_fp8_per_channel
from vllm_ling.options import HeadKernel
from vllm_ling.ops.lm_head.selection import default_device, select_head_kernel


def warmup_kernels(
    vocab_size: int,
    hidden_size: int,
    row_counts: tuple[int, ...] = (1, 2, 4, 8, 16),
    kernel: str | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """JIT-compile the chosen kernel for a ``vocab_size x hidden_size`` head at each row count
    (humming compiles its whole per-M table on the first call; Triton one kernel per
    row-count bucket) on a random head, and run each once. Returns what was done."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        raise RuntimeError(f"warmup_kernels needs a CUDA device, got {device}")
    started = time.perf_counter()
    selection = select_head_kernel(device, preferred=kernel)  # the head method's selector (layers/fp8_lm_head.py)
    name, reason = selection.choice, selection.reason
    kernels_before = 0
    if name is HeadKernel.HUMMING:
        from vllm_ling.ops.humming_cache import configure_humming_cache, count_cached_kernels

        kernels_before = count_cached_kernels(configure_humming_cache())
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn((vocab_size, hidden_size), device=device, dtype=torch.bfloat16, generator=gen)
    q, s = quantize_fp8_per_channel(weight)
    del weight
    state = prepare_fp8_head(q, s, name)
    del q
    rows_done = []
    for rows in sorted(set(int(r) for r in row_counts)):
        x = torch.randn((rows, hidden_size), device=device, dtype=torch.bfloat16, generator=gen)
        logits = fp8_head_logits(x, state)
        if not torch.isfinite(logits.float()).all():
            raise RuntimeError(f"FP8 LM head ({name}) produced non-finite logits at {rows} rows during warm-up")
        rows_done.append(rows)
    torch.cuda.synchronize(device)
    result = {
        "kernel": name.value,
        "reason": reason,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "row_counts": rows_done,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if name is HeadKernel.HUMMING:
        from vllm_ling.ops.humming_cache import count_cached_kernels

        result["cache_dir"] = os.environ.get("HUMMING_CACHE_DIR")
        result["kernels_before"] = kernels_before
        result["kernels_after"] = count_cached_kernels()
        result["new_kernels"] = result["kernels_after"] - kernels_before
        result["compile_seconds"] = state.extra.get("compile_seconds")
    del state
    return result
