"""Launch the W8A16 block-FP8 kernels: checks, kernel and config selection, PDL/prefetch
availability.

``w8a16_linear(x, weight, scale)`` computes ``x @ (weight * scale).T`` for BF16 ``x`` [M, K],
an e4m3 ``weight`` [N, K] and fp32 block scales [ceil(N/128), K/128] (the checkpoint's
``weight_scale_inv``, used as is). Up to 32 rows the CUDA decode kernel
(:mod:`.decode_kernel`) runs where it can (N % 16 == 0, K % 64 == 0, humming's JIT and the CUDA
driver bindings importable), otherwise the Triton kernel (:mod:`.kernel`), with one WARNING
naming the reason. CUDA-graph capturable (no host sync, no allocation besides the output when
``out`` is not given). No vLLM import.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from vllm_ling.log import get_logger, log_once
from vllm_ling.ops.dense_fp8 import decode_kernel as D
from vllm_ling.ops.dense_fp8 import kernel as K
from vllm_ling.ops.dense_fp8.tuned_configs import W8A16Config, select_config, select_decode_config
from vllm_ling.ops.fp8 import QUANT_BLOCK

logger = get_logger("ops.dense_fp8")


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can)."""
    if K.triton is None:
        return "triton is not installed"
    from vllm_ling.ops.cuda_jit import cuda_capability

    capability = cuda_capability(device)
    if isinstance(capability, str):
        return capability
    major, minor = capability
    if (major, minor) < (8, 9):
        return f"sm_{major}{minor} has no e4m3 conversion (needs sm_89+)"
    return None


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def device_facts(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of a CUDA device, cached."""
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())


def effective_config(config: W8A16Config, capability: tuple[int, int]) -> W8A16Config:
    """``config`` with the sm_90+ levers switched off where the chip or Triton lacks them."""
    feats = K.triton_features()
    hopper_plus = capability[0] >= 9
    return dataclasses.replace(
        config,
        pdl=config.pdl and hopper_plus and feats.get("pdl", False),
        prefetch_l2=config.prefetch_l2 and hopper_plus and feats.get("inline_asm", False),
    )


def _checked(config: W8A16Config, n: int, k: int, capability: tuple[int, int]) -> W8A16Config:
    problems = config.problems(n, k)
    if problems:
        raise ValueError(f"W8A16 config {config} cannot run a {n}x{k} weight: {'; '.join(problems)}")
    return effective_config(config, capability)


def decode_kernel_unavailable_reason() -> str | None:
    """Why the CUDA decode kernel cannot be compiled here (None when it can)."""
    from vllm_ling.ops.cuda_jit import jit_unavailable_reason

    return jit_unavailable_reason()


def _decode_unavailable(capability: tuple[int, int]) -> str | None:
    """Why the CUDA decode kernel cannot serve on a GPU of ``capability`` (None when it can)."""
    return decode_kernel_unavailable_reason() or ("needs sm_80+" if capability < (8, 0) else None)


def _decode_config(n: int, k: int, rows: int, capability: tuple[int, int], sm_count: int) -> D.DecodeConfig | None:
    if rows > D.MAX_ROWS:
        return None
    reason = _decode_unavailable(capability)
    if reason is None:
        config, reason = select_decode_config(n, k, rows, capability, sm_count)
        if config is not None:
            return dataclasses.replace(config, pdl=config.pdl and capability >= (9, 0))
        if reason is None:  # the Triton kernel measured faster here
            return None
        reason = f"shape {n}x{k}: {reason}"
    log_once(logger, logging.WARNING, f"dense-fp8-decode-kernel-{reason}",
             "Dense FP8 CUDA decode kernel unavailable (%s): the Triton W8A16 kernel serves decode sizes.", reason)
    return None


@functools.lru_cache(maxsize=None)
def launch_config(n: int, k: int, rows: int, capability: tuple[int, int],
                  sm_count: int) -> W8A16Config | D.DecodeConfig:
    """The checked, effective config for a shape: resolved once, not on every forward call. A
    :class:`~.decode_kernel.DecodeConfig` selects the CUDA decode kernel."""
    decode = _decode_config(n, k, rows, capability, sm_count)
    if decode is not None:
        return decode
    return triton_config(n, k, rows, capability, sm_count)


def triton_config(n: int, k: int, rows: int, capability: tuple[int, int], sm_count: int) -> W8A16Config:
    """The checked, effective Triton config for a shape: what runs where the decode kernel does not."""
    return _checked(select_config(n, k, rows, capability, sm_count)[0], n, k, capability)


def kernel_name(config: W8A16Config | D.DecodeConfig) -> str:
    """The kernel a config runs, for reports."""
    return "CUDA W8A16 decode" if isinstance(config, D.DecodeConfig) else \
        f"Triton W8A16 ({'tensor cores' if config.use_dot else 'fp32 FMA'})"


def layer_launch_configs(n: int, k: int, max_rows: int, device: torch.device) -> tuple:
    """The config for each row count 1..``max_rows`` of an [n, k] weight on ``device``: what a
    layer serves its decode-sized batches with (it hands them to :func:`w8a16_linear`), resolved
    once after loading (the WARNING where the decode kernel cannot run comes from here)."""
    capability, sm_count = device_facts(device)
    return tuple(launch_config(n, k, rows, capability, sm_count) for rows in range(1, max_rows + 1))


def describe_kernels(configs) -> str:
    """The kernels of per-row-count ``configs`` (:func:`layer_launch_configs`), one entry per run
    of row counts: ``CUDA W8A16 decode at 1-16 rows, Triton W8A16 (tensor cores) at 17-32 rows``."""
    runs: list[list] = []
    for rows, config in enumerate(configs, start=1):
        name = kernel_name(config)
        if runs and runs[-1][0] == name:
            runs[-1][2] = rows
        else:
            runs.append([name, rows, rows])
    return ", ".join(f"{name} at {lo}-{hi} rows" if hi > lo else f"{name} at {lo} rows" for name, lo, hi in runs)


def _prefetch_split(config: W8A16Config, k: int) -> tuple[int, int]:
    """(pieces per row, bytes per piece) so that about one bulk prefetch per thread covers the
    program's part of its rows (K / split_k bytes each); pieces is a power of two and each
    piece a multiple of 16 bytes."""
    span = k // config.split_k
    pieces = max(1, (config.num_warps * 32) // config.block_n)
    while pieces > 1 and (span % pieces or (span // pieces) % 16):
        pieces //= 2
    return pieces, span // pieces


_WORKSPACES: dict[tuple, torch.Tensor] = {}
# Outgrown buffers stay allocated: a CUDA graph captured while one was current keeps its address.
_OUTGROWN: list[torch.Tensor] = []


def _workspace(device: torch.device, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A persistent buffer per (device, kind) that only grows: split-K partials (fp32) and
    tickets (int32, zero between calls). Allocated on the first (eager) call of a size, so a
    CUDA graph captured after a warm-up call of the same row count allocates nothing; a buffer
    that is outgrown later is kept, never freed, so graphs captured on it stay valid."""
    key = (device, kind)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("dense FP8 split-K workspace must grow during CUDA-graph capture: run the "
                               "same row count once before capturing")
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(numel, 1), dtype=dtype, device=device)
        _WORKSPACES[key] = buf
    return buf


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 out: torch.Tensor | None = None,
                 config: W8A16Config | D.DecodeConfig | None = None) -> torch.Tensor:
    """``x @ (weight * scale).T`` in BF16 (fp32 accumulation); ``config`` overrides the table
    (a :class:`~.decode_kernel.DecodeConfig` runs the CUDA decode kernel, a
    :class:`~.tuned_configs.W8A16Config` the Triton one)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be a 2-D BF16 tensor with unit stride on K, got {x.dtype} {tuple(x.shape)}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, K] float8_e4m3fn tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]}, weight has K={k}")
    expected = (-(-n // QUANT_BLOCK), -(-k // QUANT_BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected or scale.stride(1) != 1:
        raise ValueError(f"scale must be float32 {expected} with unit stride on K, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    capability, sm_count = device_facts(x.device)
    if config is None:
        config = launch_config(n, k, m, capability, sm_count)
    elif isinstance(config, W8A16Config):
        config = _checked(config, n, k, capability)
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, n) or not out.is_contiguous() or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be a contiguous BF16 [{m}, {n}] tensor")
    if m == 0:
        return out
    if isinstance(config, D.DecodeConfig):
        D.run(x, weight, scale, out, config, sm_count)
        return out
    grid = (-(-n // config.block_n), -(-m // config.block_m), config.split_k)
    if config.split_k > 1:
        partials = _workspace(x.device, "partials", config.split_k * m * n, torch.float32)
        tickets = _workspace(x.device, "tickets", grid[0] * grid[1], torch.int32)
    else:
        partials = tickets = out  # unused
    constexprs, options = triton_compile_args(config, k)
    K._w8a16_block_fp8_kernel[grid](
        x, weight, scale, out, partials, tickets,
        m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0),
        **constexprs, **options,
    )
    return out


def triton_compile_args(config: W8A16Config, k: int) -> tuple[dict[str, object], dict[str, object]]:
    """The Triton kernel's constexpr arguments and compile options for ``config`` at ``K = k``
    (what one compiled variant depends on besides the argument types)."""
    pieces, piece_bytes = _prefetch_split(config, k)
    constexprs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, K_STEPS=config.k_steps,
                      SPLIT_K=config.split_k, USE_DOT=config.use_dot, USE_PDL=config.pdl,
                      PREFETCH_L2=config.prefetch_l2, PIECES=pieces, PIECE_BYTES=piece_bytes,
                      DOT_F16=config.dot_f16)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.pdl:
        options["launch_pdl"] = True
    return constexprs, options
