"""Launch the residual add + RMSNorm (``add_rms_norm.cu``; the why is in its header).

``add_rms_norm_cuda(x, residual, weight, eps)`` = :func:`vllm_ling.ops.residual_norm.reference.add_rms_norm`
for BF16 rows [T, H] (unit stride on H, rows 16-byte aligned) and a contiguous BF16 weight [H]: the normalised
rows and the new residual stream, both new tensors; with ``x2`` (rows like ``x``), x is ``x + x2`` rounded to BF16
first (:func:`~vllm_ling.ops.residual_norm.reference.add2_rms_norm`). One CTA per token at every T; compiled by NVRTC through
:mod:`vllm_ling.ops.cuda_jit`; runs on sm_80+, with programmatic dependent launch on sm_90+ (the next kernel
launches at once and the norm's weight is read before the wait for ``x``). CUDA-graph capturable (no host
sync; two allocations, the outputs). No vLLM import. Served through vLLM's IR op ``fused_add_rms_norm``
(:mod:`vllm_ling.layers.residual_norm`).
"""

from __future__ import annotations

import ctypes
import functools
from importlib import resources

import torch

from vllm_ling.ops.cuda_jit import cached_kernel, define_lines

KERNEL_NAME = "ling_add_rms_norm"
MAX_THREADS = 1024
MAX_CHUNKS = 4  # 16-byte chunks (8 values) per thread: the sums stay in registers
DTYPE = torch.bfloat16
_ARG_TYPES = (ctypes.c_void_p,) * 5 + (ctypes.c_int,) * 4 + (ctypes.c_float, ctypes.c_void_p, ctypes.c_int)


@functools.cache  # asked at every launch (eager steps, warm-up, capture)
def layout(hidden: int) -> tuple[int, int] | None:
    """``(threads, chunks per thread)`` for rows of ``hidden`` values, or None where none fits."""
    if hidden <= 0 or hidden % 8:
        return None
    chunks = hidden // 8
    for per_thread in range(1, MAX_CHUNKS + 1):
        if chunks % per_thread == 0 and chunks // per_thread <= MAX_THREADS and (chunks // per_thread) % 32 == 0:
            return chunks // per_thread, per_thread
    return None


def shape_problems(hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> list[str]:
    """Why the kernel cannot normalise rows of ``hidden`` values (empty when it can)."""
    out = []
    if dtype != DTYPE or weight_dtype != DTYPE:
        out.append(f"needs BF16 rows and weight, got {dtype} and {weight_dtype}")
    if layout(hidden) is None:
        out.append(f"hidden size {hidden} is not 256 * n (n <= {MAX_CHUNKS * MAX_THREADS // 256}) in whole warps")
    return out


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can)."""
    from vllm_ling.ops.cuda_jit import sm80_unavailable_reason

    return sm80_unavailable_reason(device)


@functools.cache
def _text() -> str:
    return resources.files(__package__).joinpath("add_rms_norm.cu").read_bytes().decode()


def source(hidden: int, addends: int = 1) -> str:
    """The CUDA text handed to NVRTC: the layout and the number of addends as ``#define`` lines, then the kernel."""
    threads, chunks = layout(hidden)
    return define_lines(dict(H_=hidden, THREADS=threads, CH=chunks, ADDENDS=addends)) + _text()


_COMPILED: dict[tuple, object] = {}


def _rows_ok(t: torch.Tensor, hidden: int) -> bool:
    return (t.dim() == 2 and t.shape[1] == hidden and t.stride(1) == 1 and t.stride(0) % 8 == 0
            and t.data_ptr() % 16 == 0)


def add_rms_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, x2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm_ling.ops.cuda_jit import launch, pdl_available

    hidden = x.shape[-1]
    problems = shape_problems(hidden, x.dtype, weight.dtype)
    for name, other in (("residual", residual), ("x2", x2)):
        if other is not None and (other.shape != x.shape or other.dtype != x.dtype):
            problems.append(f"{name} {other.dtype} {tuple(other.shape)} does not match x {x.dtype} {tuple(x.shape)}")
    if weight.shape != (hidden,) or not weight.is_contiguous():
        problems.append(f"needs a contiguous weight [{hidden}], got {tuple(weight.shape)}")
    if problems:
        raise ValueError(f"add_rms_norm cannot normalise {tuple(x.shape)}: {'; '.join(problems)}")
    rows, res_rows = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    if not _rows_ok(rows, hidden):
        rows = rows.contiguous()
    if not _rows_ok(res_rows, hidden):
        res_rows = res_rows.contiguous()
    rows2 = rows  # the kernel reads it with two addends only
    if x2 is not None:
        rows2 = x2.reshape(-1, hidden)
        if not _rows_ok(rows2, hidden):
            rows2 = rows2.contiguous()
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    new_residual = torch.empty_like(rows, memory_format=torch.contiguous_format)
    tokens = rows.shape[0]
    if tokens:
        threads, _ = layout(hidden)
        addends = 1 if x2 is None else 2
        kernel = cached_kernel(_COMPILED, KERNEL_NAME, (hidden, addends, x.device), x.device, source, hidden, addends)
        launch(kernel, (tokens, 1), threads,
               (rows.data_ptr(), res_rows.data_ptr(), weight.data_ptr(), out.data_ptr(), new_residual.data_ptr(),
                rows.stride(0), res_rows.stride(0), out.stride(0), new_residual.stride(0), float(eps),
                rows2.data_ptr(), rows2.stride(0)),
               _ARG_TYPES, torch.cuda.current_stream(x.device).cuda_stream, pdl=pdl_available(x.device))
    return out.view(x.shape), new_residual.view(x.shape)
