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

logger = get_logger("ops.dense_fp8")

QUANT_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class W8A16Config:
    block_n: int          # output rows per program; a divisor of 128 (one scale row per program)
    k_steps: int          # 128-wide k-steps per loop iteration (loads in flight per iteration)
    num_warps: int
    num_stages: int
    block_m: int = 1      # activation rows per program: 1, 2, 4, 8 (fp32 FMAs) or >= 16 (use_dot)
    use_dot: bool = False  # tensor cores (BF16) instead of fp32 multiply-adds
    split_k: int = 1       # programs per output tile along K (the last one reduces; no extra launch)
    prefetch_l2: bool = True  # bulk L2 prefetch of the program's weight rows (sm_90+)
    pdl: bool = True          # programmatic dependent launch (sm_90+)

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
        if not self.use_dot and self.block_m not in (1, 2, 4, 8):
            out.append(f"block_m {self.block_m} must be 1, 2, 4 or 8 without use_dot")
        return out


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def heuristic_config(n: int, k: int, rows: int, sm_count: int, capability: tuple[int, int]) -> W8A16Config:
    """A reasonable config for any shape and architecture: fp32 FMAs for one row, tensor
    cores for more (a 64-row weight tile keeps both near 4 instructions per weight byte in
    SASS), split-K until there are two programs per SM; sm_90+ levers where the chip has them."""
    hopper_plus = capability[0] >= 9
    k_blocks = max(1, k // QUANT_BLOCK)
    block_m = 1 if rows == 1 else max(16, _pow2_at_least(rows))
    block_n, k_steps, warps = (32, 1, 4) if rows == 1 else (64, 1, 4)
    programs = -(-n // block_n) * -(-rows // block_m)
    split_k = 1
    while programs * split_k < 2 * sm_count and k_blocks % (2 * split_k * k_steps) == 0 and split_k < 8:
        split_k *= 2
    return W8A16Config(block_n=block_n, k_steps=k_steps, num_warps=warps, num_stages=4, block_m=block_m,
                       use_dot=block_m >= 16, split_k=split_k, prefetch_l2=hopper_plus, pdl=hopper_plus)


# Filled from the H200 sweep (benchmarks/dense_fp8.py --sweep); empty buckets use the heuristic.
TUNED: dict[tuple[int, int], dict[tuple[int, int], tuple[tuple[int, W8A16Config], ...]]] = {
    (9, 0): {},
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
