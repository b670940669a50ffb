"""Launch configurations of the W8A16 block-FP8 kernel, per GPU architecture and shape.

``TUNED[(major, minor)][(N, K)]`` lists ``(max_rows, config)`` buckets measured on that
architecture (``benchmarks/dense_fp8.py --sweep``; numbers in
``benchmarks/results/dense_fp8_h200.md``). Any other architecture or shape gets
:func:`heuristic_config`, and :func:`select_config` says so (one WARNING per architecture):
nothing assumes sm_90 silently. No vLLM import, no GPU needed to select.
"""

from __future__ import annotations

import dataclasses

from vllm_ling.log import get_logger, log_once
from vllm_ling.ops.fp8 import QUANT_BLOCK
from vllm_ling.ops.dense_fp8.decode_kernel import MAX_ROWS as DECODE_MAX_ROWS
from vllm_ling.ops.dense_fp8.decode_kernel import DecodeConfig
from vllm_ling.ops.dense_fp8.decode_kernel import heuristic_config as decode_heuristic_config

logger = get_logger("ops.dense_fp8")


@dataclasses.dataclass(frozen=True)
class W8A16Config:
    block_n: int          # output rows per program; a divisor of 128 (one scale row per program)
    k_steps: int          # 128-wide k-steps per loop iteration (loads in flight per iteration)
    num_warps: int
    num_stages: int
    block_m: int = 1      # activation rows per program: 1, 2, 4 (fp32 FMAs) or >= 16 (use_dot)
    use_dot: bool = False  # tensor cores (BF16) instead of fp32 multiply-adds
    split_k: int = 1       # programs per output tile along K (the last one reduces; no extra launch)
    prefetch_l2: bool = True  # bulk L2 prefetch of the program's weight rows (sm_90+)
    pdl: bool = True          # programmatic dependent launch (sm_90+)
    dot_f16: bool = False     # use_dot: FP16 tensor cores on per-row power-of-two scaled x (kernel.py)

    def problems(self, n: int, k: int) -> list[str]:
        """Why this config cannot run an [n, k] weight (empty when it can)."""
        out = []
        if self.block_n not in (8, 16, 32, 64, 128):
            out.append(f"block_n {self.block_n} must be a power of two dividing 128")
        if k % QUANT_BLOCK:
            out.append(f"K={k} is not a multiple of {QUANT_BLOCK}")
        elif (k // QUANT_BLOCK) % (self.k_steps * self.split_k):
            out.append(f"K/128={k // QUANT_BLOCK} is not a multiple of k_steps x split_k="
                       f"{self.k_steps} x {self.split_k}")
        if self.use_dot and (self.block_m < 16 or self.block_m & (self.block_m - 1) or self.block_n < 16):
            out.append("use_dot needs block_m a power of two >= 16 and block_n >= 16")
        if self.dot_f16 and not self.use_dot:
            out.append("dot_f16 applies to the tensor-core path (use_dot) only")
        if not self.use_dot and self.block_m not in (1, 2, 4):
            out.append(f"block_m {self.block_m} must be 1, 2 or 4 without use_dot")
        return out


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def heuristic_config(n: int, k: int, rows: int, sm_count: int, capability: tuple[int, int]) -> W8A16Config:
    """A reasonable config for any shape and architecture, shaped like the H200 winners: fp32
    FMAs on 512-byte k-tiles for one row, BF16 tensor cores for more, split-K until there are
    two programs per SM, PDL where the chip has it (the L2 prefetch helped some H200 shapes and
    hurt others, so it is left to the tuned tables)."""
    k_blocks = max(1, k // QUANT_BLOCK)
    if rows == 1:
        block_m, block_n, warps, use_dot = 1, 16, 4, False
        k_steps = next(s for s in (4, 2, 1) if k_blocks % s == 0)
    else:
        # rows past 64 are tiled over programs (prefill sizes: correct, not tuned)
        block_m, block_n, warps, use_dot, k_steps = min(64, max(16, _pow2_at_least(rows))), 64, 4, True, 1
    programs = -(-n // block_n) * -(-rows // block_m)
    split_k = 1
    while programs * split_k < 2 * sm_count and k_blocks % (2 * split_k * k_steps) == 0 and split_k < 8:
        split_k *= 2
    return W8A16Config(block_n=block_n, k_steps=k_steps, num_warps=warps, num_stages=3, block_m=block_m,
                       use_dot=use_dot, split_k=split_k, prefetch_l2=False, pdl=capability[0] >= 9)


def _dot(block_n: int, warps: int, stages: int, block_m: int, split_k: int, prefetch: bool = True,
         f16: bool = False) -> W8A16Config:
    return W8A16Config(block_n=block_n, k_steps=1, num_warps=warps, num_stages=stages, block_m=block_m,
                       use_dot=True, split_k=split_k, prefetch_l2=prefetch, dot_f16=f16)


def _fma(block_n: int, k_steps: int, warps: int, block_m: int, split_k: int, prefetch: bool = True) -> W8A16Config:
    return W8A16Config(block_n=block_n, k_steps=k_steps, num_warps=warps, num_stages=2, block_m=block_m,
                       split_k=split_k, prefetch_l2=prefetch)


# Sweep winners on the H200 (benchmarks/dense_fp8.py --sweep; us per call in CUDA graphs with
# weights rotated beyond L2; which of the three runs of 2026-12-01 found each is noted: the
# kernel code of run 1 differs only in the one-row path, which runs 2 and 3 re-swept). A bucket
# (max_rows, config) serves rows up to max_rows; rows past the last bucket and shapes not listed
# use the heuristic.
TUNED: dict[tuple[int, int], dict[tuple[int, int], tuple[tuple[int, W8A16Config], ...]]] = {
    (9, 0): {
        (12288, 2560): (
            (1, _fma(32, 2, 8, 1, 1, prefetch=False)),  # 16.77 us (run 3)
            (2, _dot(128, 8, 3, 16, 4)),  # 19.84 us (run 2)
            (4, _dot(128, 8, 3, 16, 2, prefetch=False, f16=True)),  # 17.44 us (run 3)
            (8, _dot(128, 8, 3, 16, 2, prefetch=False, f16=True)),  # 17.77 us (run 3)
            (16, _dot(64, 4, 3, 16, 4)),  # 17.46 us (run 3)
            (32, _dot(64, 4, 4, 32, 4)),  # 20.42 us (run 1)
        ),
        (2560, 6144): (
            (1, _fma(32, 2, 4, 1, 8, prefetch=False)),  # 9.33 us (run 3)
            (2, _dot(64, 4, 3, 16, 8)),  # 12.08 us (run 2)
            (4, _dot(64, 4, 3, 16, 8, prefetch=False)),  # 11.40 us (run 3)
            (8, _dot(64, 4, 3, 16, 8, prefetch=False)),  # 11.44 us (run 3)
            (16, _dot(64, 4, 3, 16, 8, prefetch=False)),  # 11.51 us (run 3)
            (32, _dot(64, 4, 3, 32, 8)),  # 15.17 us (run 1)
        ),
        (6144, 2560): (
            (1, _dot(128, 8, 3, 16, 4, f16=True)),  # 10.18 us (run 3)
            (2, _dot(128, 8, 3, 16, 4)),  # 12.27 us (run 2)
            (4, _dot(128, 8, 3, 16, 4, f16=True)),  # 10.36 us (run 3)
            (8, _dot(128, 8, 3, 16, 4, f16=True)),  # 10.43 us (run 3)
            (16, _dot(128, 8, 3, 16, 4, f16=True)),  # 10.61 us (run 3)
            (32, _dot(64, 4, 3, 32, 4)),  # 12.93 us (run 1)
        ),
        (2560, 5120): (
            (1, _dot(128, 8, 3, 16, 8, f16=True)),  # 10.17 us (run 3)
            (2, _dot(64, 4, 3, 16, 8)),  # 10.25 us (run 2)
            (4, _dot(128, 8, 3, 16, 8, f16=True)),  # 10.01 us (run 3)
            (8, _dot(64, 4, 3, 16, 8)),  # 9.80 us (run 3)
            (16, _dot(64, 4, 3, 16, 8)),  # 9.98 us (run 3)
            (32, _dot(64, 4, 3, 32, 8)),  # 13.20 us (run 1)
        ),
        (4096, 2560): (
            (1, _dot(128, 8, 3, 16, 4, f16=True)),  # 9.15 us (run 3)
            (2, _dot(128, 8, 3, 16, 4)),  # 11.68 us (run 2)
            (4, _dot(128, 8, 3, 16, 4, f16=True)),  # 9.27 us (run 3)
            (8, _dot(128, 8, 3, 16, 4, f16=True)),  # 9.55 us (run 3)
            (16, _dot(128, 8, 3, 16, 4, f16=True)),  # 10.21 us (run 3)
            (32, _dot(64, 4, 3, 32, 4)),  # 12.18 us (run 1)
        ),
        (2560, 4096): (
            (1, _fma(32, 2, 4, 1, 8, prefetch=False)),  # 6.85 us (run 3)
            (2, _dot(64, 4, 3, 16, 8)),  # 8.70 us (run 2)
            (4, _dot(128, 8, 3, 16, 8, f16=True)),  # 8.63 us (run 3)
            (8, _dot(64, 4, 3, 16, 8)),  # 8.45 us (run 3)
            (16, _dot(64, 4, 3, 16, 8)),  # 8.89 us (run 3)
            (32, _dot(64, 4, 3, 32, 8)),  # 11.52 us (run 1)
        ),
        (1536, 2560): (
            (1, _fma(16, 4, 4, 1, 1)),  # 7.69 us (run 3)
            (2, _dot(64, 4, 3, 16, 4)),  # 8.49 us (run 2)
            (4, _dot(64, 4, 3, 16, 4)),  # 8.42 us (run 3)
            (8, _dot(64, 4, 3, 16, 4, prefetch=False, f16=True)),  # 8.57 us (run 3)
            (16, _dot(64, 4, 3, 16, 4, prefetch=False, f16=True)),  # 8.81 us (run 3)
            (32, _dot(64, 4, 4, 32, 2)),  # 10.03 us (run 1)
        ),
        (2560, 768): (
            (1, _fma(32, 2, 8, 1, 1, prefetch=False)),  # 4.82 us (run 3)
            (2, _fma(32, 2, 8, 2, 1)),  # 5.85 us (run 2)
            (4, _dot(64, 4, 3, 16, 1, prefetch=False)),  # 6.07 us (run 3)
            (8, _dot(64, 4, 3, 16, 1, prefetch=False)),  # 6.12 us (run 3)
            (16, _dot(32, 4, 4, 16, 1)),  # 5.93 us (run 3)
            (32, _dot(32, 4, 4, 32, 1)),  # 6.21 us (run 1)
        ),
        (576, 2560): (
            (1, _fma(8, 4, 2, 1, 1)),  # 5.71 us (run 3)
            (2, _dot(64, 4, 3, 16, 4)),  # 6.93 us (run 2)
            (4, _dot(64, 4, 3, 16, 4, prefetch=False)),  # 6.79 us (run 3)
            (8, _dot(64, 4, 3, 16, 4, prefetch=False)),  # 6.78 us (run 3)
            (16, _dot(64, 4, 3, 16, 4, prefetch=False)),  # 6.91 us (run 3)
            (32, _dot(32, 4, 4, 32, 4)),  # 6.99 us (run 1)
        ),
    },
}


def select_config(n: int, k: int, rows: int, capability: tuple[int, int], sm_count: int) -> tuple[W8A16Config, str]:
    """(config, where it came from) for an [n, k] weight at ``rows`` activation rows."""
    arch = tuple(capability)
    table = TUNED.get(arch)
    if table is None:
        log_once(logger, 30, f"dense_fp8_untuned_{arch}",
                 "dense FP8 W8A16 kernel: no tuned launch configs for sm_%d%d; using the heuristic "
                 "configs (correct, not tuned: run benchmarks/dense_fp8.py --sweep on this GPU)", *arch)
        return heuristic_config(n, k, rows, sm_count, arch), f"heuristic (no table for sm_{arch[0]}{arch[1]})"
    for max_rows, config in table.get((n, k), ()):
        if rows <= max_rows and not config.problems(n, k):
            return config, f"tuned sm_{arch[0]}{arch[1]}"
    return heuristic_config(n, k, rows, sm_count, arch), f"heuristic (shape {n}x{k} at {rows} rows not tuned)"


# The CUDA decode kernel (decode_kernel.py), per architecture and shape: (max_rows, config)
# buckets from benchmarks/dense_fp8.py --sweep-decode; a bucket whose config is None is one
# where the Triton kernel measured faster. The decode kernel's configs change speed only,
# never the numerics, so untuned architectures and shapes take decode_kernel.heuristic_config.
TUNED_DECODE: dict[tuple[int, int], dict[tuple[int, int], tuple[tuple[int, DecodeConfig | None], ...]]] = {
    (9, 0): {  # H200 sweep of 2026-12-01 (benchmarks/results/dense_fp8_h200.md)
        # KDA q|k|v|f|g merged (benchmarks/results/dense_fp8_merge_h200.md, swept at 1..32 rows)
        (20480, 2560): ((1, DecodeConfig(ksplit=10, min_blocks=2)), (8, DecodeConfig(ksplit=8, min_blocks=2)),
                       (16, DecodeConfig(ksplit=4, min_blocks=2)), (32, None)),
        (12288, 2560): ((8, DecodeConfig(ksplit=8, min_blocks=2)), (16, DecodeConfig(ksplit=4)), (32, None)),
        (2560, 6144): ((4, DecodeConfig(ksplit=16)), (8, DecodeConfig(ksplit=8, min_blocks=2)),
                       (16, DecodeConfig(ksplit=8)), (32, None)),
        (6144, 2560): ((1, DecodeConfig(ksplit=8, stream=True, ctas_per_sm=1)),
                       (16, DecodeConfig(ksplit=4, warps_n=2, min_blocks=2)), (32, None)),
        (2560, 5120): ((1, DecodeConfig(ksplit=10, warps_n=2)), (4, DecodeConfig(ksplit=8, warps_n=2)),
                       (16, DecodeConfig(ksplit=8, min_blocks=2)), (32, None)),
        (4096, 2560): ((8, DecodeConfig(ksplit=8, min_blocks=2)), (16, DecodeConfig(ksplit=4, min_blocks=2)),
                       (32, DecodeConfig(ksplit=4, warps_n=2))),
        (2560, 4096): ((32, DecodeConfig(ksplit=8, min_blocks=2)),),
        (1536, 2560): ((4, DecodeConfig(ksplit=8)), (8, DecodeConfig(ksplit=10)), (32, DecodeConfig(ksplit=8))),
        (2560, 768): ((1, DecodeConfig(ksplit=3, min_blocks=2, stream=True, ctas_per_sm=2)),
                      (4, DecodeConfig(ksplit=4, warps_n=2)), (8, DecodeConfig(ksplit=3, warps_n=2, min_blocks=2)),
                      (16, DecodeConfig(ksplit=4, min_blocks=2, stream=True, ctas_per_sm=3)),
                      (32, DecodeConfig(ksplit=6, warps_n=2))),
        (576, 2560): ((8, DecodeConfig(ksplit=10)), (32, DecodeConfig(ksplit=8))),
    },
}


def select_decode_config(n: int, k: int, rows: int, capability: tuple[int, int],
                         sm_count: int) -> tuple[DecodeConfig | None, str | None]:
    """(the CUDA decode kernel's config, None) for an [n, k] weight at ``rows`` rows; (None, why)
    when it cannot run it; (None, None) where the Triton kernel is tuned to serve instead."""
    for max_rows, config in TUNED_DECODE.get(tuple(capability), {}).get((n, k), ()):
        if rows <= max_rows:
            if config is None:
                return None, None
            if not config.problems(n, k, rows):
                return config, None
            break
    config = decode_heuristic_config(n, k, rows, sm_count)
    problems = config.problems(n, k, rows)
    return (None, "; ".join(problems)) if problems else (config, None)


# The most rows the W8A16 kernels serve, per architecture and shape, where vLLM's own W8A8
# block-FP8 kernel measured faster above (the upstream-equivalent column of dense_fp8_h200.md and
# dense_fp8_merge_h200.md: on the two widest weights the activation quantization pays for itself
# from 16 rows). Everything else: W8A16 up to DECODE_MAX_ROWS.
W8A16_MAX_ROWS: dict[tuple[int, int], dict[tuple[int, int], int]] = {
    (9, 0): {(20480, 2560): 8, (12288, 2560): 8},
}


def w8a16_max_rows(n: int, k: int, capability: tuple[int, int]) -> int:
    """Batches of at most this many rows run the W8A16 kernels on an [n, k] weight; vLLM's above."""
    return W8A16_MAX_ROWS.get(tuple(capability), {}).get((n, k), DECODE_MAX_ROWS)
