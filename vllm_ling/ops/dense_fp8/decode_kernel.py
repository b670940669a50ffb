"""The CUDA W8A16 decode kernel (``w8a16_decode.cu``, the why is in its header): shapes, source,
launch. Up to 32 activation rows (four MMA groups of 8), N a multiple of 16, K a multiple of 64.

A warp owns 16 output rows x K / ``ksplit`` and loads all of those weight bytes into registers
before it waits for the previous kernel, so ``steps`` = K / (64 ``ksplit``) sets the bytes in
flight per warp (32 per lane per step). ``stream`` selects the persistent kernel: ``ctas_per_sm``
CTAs per SM walk the tiles with two register buffers (loading tile i + 2 while computing i + 1). Compiled by NVRTC through :mod:`vllm_ling.ops.cuda_jit`
(humming's JIT cache); runs on sm_80+ (programmatic dependent launch from sm_90). No vLLM import.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from importlib import resources

import torch

from vllm_ling.ops.cuda_jit import cached_kernel, define_lines
from vllm_ling.options import DENSE_FP8_DECODE_MAX_ROWS as MAX_ROWS

# by ``stream``; neither name contains the other (humming finds a kernel by substring)
KERNEL_NAMES = {False: "ling_dense_w8a16_wave", True: "ling_dense_w8a16_stream"}
_ROWS_PER_GROUP = 8
_TILE_ROWS = 16
_STEP_K = 64
_MAX_STEPS = 16  # 32 registers of weights per step and lane
_SMEM_LIMIT = 48 * 1024
_ARG_TYPES = (ctypes.c_void_p,) * 4 + (ctypes.c_int,) * 4


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    ksplit: int          # warps along K per 16-row tile (partial sums reduced in shared memory)
    warps_n: int = 1     # 16-row tiles per CTA
    min_blocks: int = 1  # CTAs per SM the register allocator plans for
    pdl: bool = True     # programmatic dependent launch (sm_90+)
    stream: bool = False  # persistent CTAs with two register buffers (warps_n == 1)
    ctas_per_sm: int = 2  # stream: the grid is min(tiles, SMs x ctas_per_sm)

    def steps(self, k: int) -> int:
        return k // (_STEP_K * self.ksplit)

    def threads(self) -> int:
        return 32 * self.warps_n * self.ksplit

    def problems(self, n: int, k: int, rows: int) -> list[str]:
        """Why this config cannot run an [n, k] weight on ``rows`` activation rows (empty when it can)."""
        out = []
        if n % _TILE_ROWS:
            out.append(f"N={n} is not a multiple of {_TILE_ROWS}")
        if k % (_STEP_K * self.ksplit):
            out.append(f"K={k} is not a multiple of 64 x ksplit={self.ksplit}")
        elif not 1 <= self.steps(k) <= _MAX_STEPS:
            out.append(f"K / (64 x ksplit) = {self.steps(k)} steps per warp is outside 1..{_MAX_STEPS}")
        if not 1 <= rows <= MAX_ROWS:
            out.append(f"{rows} activation rows is outside 1..{MAX_ROWS}")
        if self.stream and self.warps_n != 1:
            out.append("the streaming kernel runs one tile per CTA (warps_n = 1)")
        if self.threads() > 1024:
            out.append(f"{self.threads()} threads per CTA exceed 1024")
        if self.ksplit > 1 and self.warps_n * self.ksplit * row_groups(rows) * 512 > _SMEM_LIMIT:
            out.append("the split-K reduction needs more than 48 KB of shared memory")
        return out


def row_groups(rows: int) -> int:
    """MMA groups of 8 activation rows: one compiled kernel serves each count."""
    return -(-rows // _ROWS_PER_GROUP)


def heuristic_config(n: int, k: int, rows: int, sm_count: int) -> DecodeConfig:
    """About eight warps per SM in flight: split K until the tiles x splits fill the SMs, with at
    least two steps (64 bytes per lane) per warp."""
    tiles, steps_total = n // _TILE_ROWS, k // _STEP_K
    splits = [d for d in range(1, steps_total + 1) if steps_total % d == 0 and steps_total // d <= _MAX_STEPS
              and 32 * d <= 1024]
    ksplit = splits[-1]
    for d in splits:
        if tiles * d >= 8 * sm_count or steps_total // d <= 2:
            ksplit = d
            break
    warps_n = 2 if ksplit <= 4 and tiles % 2 == 0 else 1
    config = DecodeConfig(ksplit=ksplit, warps_n=warps_n)
    return config if not config.problems(n, k, rows) else DecodeConfig(ksplit=ksplit)


@functools.cache
def _kernel_text() -> str:
    return resources.files(__package__).joinpath("w8a16_decode.cu").read_bytes().decode()


def source(config: DecodeConfig, k: int, rows: int) -> str:
    """The CUDA text handed to NVRTC: the launch shape as ``#define`` lines, the shared loads, then
    the kernel."""
    from vllm_ling.ops.cuda_jit import ptx_loads

    return define_lines(dict(WARPS_N=config.warps_n, KSPLIT=config.ksplit, STEPS=config.steps(k),
                             TG=row_groups(rows), MINB=config.min_blocks)) + ptx_loads() + _kernel_text()


_COMPILED: dict[tuple, object] = {}


def _compiled(config: DecodeConfig, k: int, rows: int, device: torch.device):
    key = (config.warps_n, config.ksplit, config.min_blocks, config.steps(k), row_groups(rows), config.stream, device)
    return cached_kernel(_COMPILED, KERNEL_NAMES[config.stream], key, device, source, config, k, rows)


def run(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
        config: DecodeConfig, sm_count: int) -> None:
    """Launch on checked inputs (:func:`~vllm_ling.ops.dense_fp8.linear.w8a16_linear` checks
    dtypes and shapes; this checks what the kernel adds: alignment and the config)."""
    from vllm_ling.ops.cuda_jit import launch

    (n, k), rows = weight.shape, x.shape[0]
    problems = config.problems(n, k, rows)
    if x.stride(0) % 8 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        problems.append("x rows and the weight must be 16-byte aligned")
    if problems:
        raise ValueError(f"dense FP8 decode config {config} cannot run {rows} x [{n}, {k}]: {'; '.join(problems)}")
    kernel = _compiled(config, k, rows, x.device)
    grid = -(-(n // _TILE_ROWS) // config.warps_n)
    if config.stream:
        grid = min(grid, config.ctas_per_sm * sm_count)
    launch(kernel, (grid, 1), config.threads(),
           (weight.data_ptr(), scale.data_ptr(), x.data_ptr(), out.data_ptr(), n, rows, scale.stride(0),
            x.stride(0)),
           _ARG_TYPES, torch.cuda.current_stream(x.device).cuda_stream, pdl=config.pdl)
