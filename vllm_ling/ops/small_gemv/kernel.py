"""Launch the small-N GEMV (``small_gemv.cu``; the why is in its header).

``small_gemv(x, weight, out_dtype)`` = ``x @ weight.T`` for BF16 ``x`` [T, K] (T <= ``MAX_ROWS``,
rows 16-byte aligned) and an fp32 or BF16 ``weight`` [N, K] whose row fits a warp's registers
(K a multiple of 128 fp32 / 256 BF16 weights, at most 32 16-byte chunks per lane), into fp32 or
BF16. One warp per weight row, ``warps`` rows per CTA; up to four rows in one pass straight from
global memory, more staged in shared memory (:func:`default_launch`,
``benchmarks/results/small_gemv_h200.md``). Compiled by NVRTC through
:mod:`vllm_ling.ops.cuda_jit` (humming's JIT cache); runs on sm_80+, with programmatic dependent
launch from sm_90. CUDA-graph capturable (no host sync; one allocation, the output, when ``out``
is not given). No vLLM import.
"""

from __future__ import annotations

import ctypes
import functools
from importlib import resources

import torch

from vllm_ling.ops.cuda_jit import cached_kernel, define_lines
from vllm_ling.options import BF16_GEMV_MAX_ROWS as BF16_MAX_ROWS  # noqa: F401 (Ling's BF16 linears; measured: why there)
from vllm_ling.options import SMALL_GEMV_MAX_ROWS as MAX_ROWS  # the kernel's tokens (measured: why there)

KERNEL_NAME = "ling_small_gemv"
_MAX_CHUNKS_PER_LANE = 32  # 16-byte weight chunks held per lane (128 registers)
WARPS_PER_CTA = 4  # weight rows per CTA (one warp each)
_STAGE_BYTES = 40 * 1024  # shared memory for staged activations: under the 48 KB static limit on every target
_WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ARG_TYPES = (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3


def shape_problems(n: int, k: int, weight_dtype: torch.dtype) -> list[str]:
    """Why the kernel cannot hold an [N, K] weight of ``weight_dtype`` (empty when it can)."""
    if weight_dtype not in _WEIGHT_DTYPES:
        return [f"weight dtype {weight_dtype} is neither fp32 nor BF16"]
    out = []
    chunk_k = 16 // torch.empty((), dtype=weight_dtype).element_size()
    if k % (32 * chunk_k):
        out.append(f"K={k} is not a multiple of {32 * chunk_k}")
    elif k // (32 * chunk_k) > _MAX_CHUNKS_PER_LANE:
        out.append(f"K={k} exceeds {32 * chunk_k * _MAX_CHUNKS_PER_LANE} (a weight row must fit a warp's registers)")
    if n < 1:
        out.append("no output rows")
    return out


def kernel_unavailable_reason() -> str | None:
    """Why the kernel cannot be compiled or launched in this process (None when it can)."""
    from vllm_ling.ops.cuda_jit import jit_unavailable_reason

    return jit_unavailable_reason()


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can)."""
    from vllm_ling.ops.cuda_jit import sm80_unavailable_reason

    return sm80_unavailable_reason(device)


def staged_tokens(k: int) -> int:
    """Activation rows the CTA stages in shared memory at a time when a call has more rows than
    one pass takes (as many BF16 rows of K as fit the stage, at most ``MAX_ROWS``)."""
    return max(1, min(MAX_ROWS, _STAGE_BYTES // (2 * k)))


def default_launch(rows: int, n: int) -> tuple[int, int]:
    """(weight rows per CTA, tokens per pass) for ``rows`` activation rows and N weight rows, the
    fastest in the sweep of small_gemv_h200.md for Ling's router (N 512) and BF16 linears (N 32):
    up to four rows one direct pass (four rows: one warp per CTA, so 4x the CTAs issue their
    loads); above, staged rows four per pass, in CTAs of eight warps for a wide weight (fewer CTAs
    each staging the same activations) and four for a narrow one."""
    if rows <= 2:
        return WARPS_PER_CTA, rows
    if rows <= 4:
        return 1, 4
    return (8 if n >= 128 else WARPS_PER_CTA), 4


@functools.cache
def _kernel_text() -> str:
    return resources.files(__package__).joinpath("small_gemv.cu").read_bytes().decode()


def source(k: int, weight_dtype: torch.dtype, out_dtype: torch.dtype, warps: int, tokens_per_pass: int) -> str:
    """The CUDA text handed to NVRTC: the shape as ``#define`` lines, the shared loads, then the kernel."""
    from vllm_ling.ops.cuda_jit import ptx_loads

    return define_lines(dict(K_=k, WARPS=warps, TB=tokens_per_pass, XS_T=staged_tokens(k),
                             W_BF16=_WEIGHT_DTYPES[weight_dtype], OUT_BF16=_OUT_DTYPES[out_dtype])) \
        + ptx_loads() + _kernel_text()


_COMPILED: dict[tuple, object] = {}


def compiled(k: int, weight_dtype: torch.dtype, out_dtype: torch.dtype, warps: int, tokens_per_pass: int,
             device: torch.device):
    """The kernel for one shape (compiled on first use; warm-up calls this ahead of serving)."""
    return cached_kernel(_COMPILED, KERNEL_NAME, (k, weight_dtype, out_dtype, warps, tokens_per_pass, device),
                         device, source, k, weight_dtype, out_dtype, warps, tokens_per_pass)


def kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the [rows, K] view the kernel reads (unit stride on K, rows 16-byte aligned),
    copied only where it is not (e.g. a row slice at an odd offset)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or rows.stride(0) % 8 or rows.data_ptr() % 16:
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows


def launch_row_counts(n: int, max_rows: int = MAX_ROWS) -> tuple[int, ...]:
    """Row counts that run every launch shape :func:`default_launch` picks for N weight rows at
    1..``max_rows`` rows (each shape's fewest and most rows): what a known-answer check runs."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for rows in range(1, max_rows + 1):
        shapes.setdefault(default_launch(rows, n), []).append(rows)
    return tuple(sorted({r for rows in shapes.values() for r in (rows[0], rows[-1])}))


def small_gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, *, out: torch.Tensor | None = None,
               warps: int | None = None, tokens_per_pass: int | None = None, pdl: bool = True) -> torch.Tensor:
    """``out_dtype`` [T, N] = BF16 ``x`` [T, K] @ ``weight`` [N, K].T (fp32 accumulation)."""
    from vllm_ling.ops.cuda_jit import launch, pdl_available

    (n, k), t = weight.shape, x.shape[0]
    problems = shape_problems(n, k, weight.dtype)
    if x.dtype != torch.bfloat16:
        problems.append(f"needs BF16 activations, got {x.dtype}")
    if out_dtype not in _OUT_DTYPES:
        problems.append(f"output dtype {out_dtype} is neither fp32 nor BF16")
    if x.dim() != 2 or x.shape[1] != k:
        problems.append(f"activations {tuple(x.shape)} do not match the weight {tuple(weight.shape)}")
    if not 1 <= t <= MAX_ROWS:
        problems.append(f"{t} rows is outside 1..{MAX_ROWS}")
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or not weight.is_contiguous() \
            or weight.data_ptr() % 16:
        problems.append("x rows and the weight must be contiguous and 16-byte aligned")
    if out is not None and (out.shape != (t, n) or out.dtype != out_dtype or not out.is_contiguous()):
        problems.append(f"out must be a contiguous {out_dtype} [{t}, {n}]")
    if problems:
        raise ValueError(f"small GEMV cannot run {t} x {tuple(weight.shape)} {weight.dtype}: {'; '.join(problems)}")
    if out is None:
        out = torch.empty((t, n), dtype=out_dtype, device=x.device)
    default_warps, default_tokens = default_launch(t, n)
    warps, tokens_per_pass = warps or default_warps, tokens_per_pass or default_tokens
    kernel = compiled(k, weight.dtype, out_dtype, warps, tokens_per_pass, x.device)
    pdl = pdl and pdl_available(x.device)
    launch(kernel, (-(-n // warps), 1), 32 * warps, (weight.data_ptr(), x.data_ptr(), out.data_ptr(), n, t, x.stride(0)),
           _ARG_TYPES, torch.cuda.current_stream(x.device).cuda_stream, pdl=pdl)
    return out
