"""Launch shapes of the decode kernels (benchmark levers): which kernel, its ``#define``s,
threads, grid, cluster and shared memory for given sizes, and why a shape cannot run."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from vllm_ling.ops.moe.decode.sources import humming_layout_source

# CUDA's gridDim.y limit; the decode kernels launch one grid row per (token, top-k slot)
MAX_GRID_ROWS = 65535


@dataclasses.dataclass(frozen=True)
class PackedDecodeConfig:
    """Launch shape of the packed-layout kernels (benchmark levers)."""

    k_split_gate_up: int = 8   # warps per gate_up CTA, each owns H/64/k_split chunks
    k_split_down: int = 1      # warps per slot in a down CTA
    min_blocks_gate_up: int = 3
    min_blocks_down: int = 2
    use_pdl: bool = True



def _align128(n: int) -> int:
    return (n + 127) // 128 * 128


class KernelShape:
    """Launch shape of one decode kernel on humming's layout; subclasses say how to build
    and launch it. ``problems`` lists why a shape cannot run given sizes (empty: it can)."""

    kernel_name: ClassVar[str]
    # source files beyond common.cuh + humming_layout.cuh (sources.py), the kernel last
    kernel_files: ClassVar[tuple[str, ...]]

    def source(self, hidden: int, intermediate: int, top_k: int, clamp_flag: int) -> str:
        return humming_layout_source(self.kernel_files, H_=hidden, I_=intermediate, TOPK=top_k,
                                     N1=2 * intermediate, CLAMP_GATE_OUTPUT=clamp_flag,
                                     **self._defines(hidden, intermediate))

    def smem(self, hidden: int, intermediate: int, top_k: int) -> int:
        return 0

    def _defines(self, hidden: int, intermediate: int) -> dict[str, int]:
        raise NotImplementedError

    def problems(self, hidden: int, intermediate: int, top_k: int, smem_limit: int) -> list[str]:
        out = []
        threads, smem = self.threads(hidden, intermediate), self.smem(hidden, intermediate, top_k)
        if threads > 1024:
            out.append(f"{threads} threads per CTA")
        if smem > smem_limit:
            out.append(f"{smem} bytes of shared memory per CTA (> {smem_limit})")
        return out


@dataclasses.dataclass(frozen=True)
class StreamedGateUp(KernelShape):
    """gate_up + SwiGLU, weights streamed through ``stages`` shared-memory stages by a producer
    warp (bulk copies): a CTA owns ``blocks_per_cta`` 64-row blocks of the gate and of the up
    rows (one consumer warp per block and group of a stage), a cluster of ``cluster`` CTAs
    splits K. ``blocks_per_cta`` divides intermediate / 64, ``cluster * groups_per_stage``
    divides hidden / 32."""

    kernel_name: ClassVar[str] = "ling_moe_hs_gate_up"
    kernel_files: ClassVar[tuple[str, ...]] = ("bulk_copy.cuh", "streamed_gate_up.cu")
    cluster: int = 8
    blocks_per_cta: int = 4
    groups_per_stage: int = 1
    stages: int = 4
    min_blocks: int = 4

    def _defines(self, hidden, intermediate):
        return dict(CL_S=self.cluster, BPC_S=self.blocks_per_cta, GPS_S=self.groups_per_stage,
                    ST_S=self.stages, MINB_S=self.min_blocks)

    def threads(self, hidden, intermediate):
        return 32 * (self.blocks_per_cta * self.groups_per_stage + 1)

    def grid_x(self, hidden, intermediate, top_k):
        return self.cluster * (intermediate // 64 // self.blocks_per_cta)

    def cluster_size(self, top_k):
        return self.cluster

    def smem(self, hidden, intermediate, top_k):
        # the kernel's layout: ST_S stages of STAGE_S, RED_S, XS_S, then 2 x ST_S mbarriers
        bpc, gps, cl = self.blocks_per_cta, self.groups_per_stage, self.cluster
        stage = _align128(gps * 4 * bpc * 512 + gps * 2 * bpc * 64)
        red = _align128(cl * gps * 2 * -(-bpc * 64 // cl) * 4)
        return self.stages * stage + red + _align128(hidden // 32 // cl * 64) + 16 * self.stages

    def problems(self, hidden, intermediate, top_k, smem_limit):
        out = super().problems(hidden, intermediate, top_k, smem_limit)
        if (intermediate // 64) % self.blocks_per_cta:
            out.append(f"blocks_per_cta {self.blocks_per_cta} does not divide {intermediate // 64} blocks")
        if (hidden // 32) % (self.cluster * self.groups_per_stage):
            out.append(f"cluster * groups_per_stage does not divide {hidden // 32} groups")
        return out


@dataclasses.dataclass(frozen=True)
class RegisterDown(KernelShape):
    """down + weighted top-k sum, weights straight into registers: one CTA per top-k slot in a
    cluster, a warp reads one 64-row block x ``groups_per_warp`` groups (divides
    intermediate / 32)."""

    kernel_name: ClassVar[str] = "ling_moe_hl_down"
    kernel_files: ClassVar[tuple[str, ...]] = ("register_down.cu",)
    groups_per_warp: int = 4
    min_blocks: int = 4

    def _defines(self, hidden, intermediate):
        return dict(GPW_B=self.groups_per_warp, WPB=(intermediate // 32) // self.groups_per_warp,
                    MINB_B=self.min_blocks)

    def threads(self, hidden, intermediate):
        return 32 * ((intermediate // 32) // self.groups_per_warp)

    def grid_x(self, hidden, intermediate, top_k):
        return top_k * (hidden // 64)

    def cluster_size(self, top_k):
        return top_k

    def problems(self, hidden, intermediate, top_k, smem_limit):
        out = super().problems(hidden, intermediate, top_k, smem_limit)
        if (intermediate // 32) % self.groups_per_warp:
            out.append(f"groups_per_warp {self.groups_per_warp} does not divide {intermediate // 32} groups")
        return out


@dataclasses.dataclass(frozen=True)
class HummingDecodeConfig:
    """The two kernels' launch shapes on humming's layout (benchmark levers) and whether both
    launch with programmatic dependent launch: gate_up sets up its pipeline while the previous
    kernel finishes, down streams its weights while gate_up finishes."""

    gate_up: StreamedGateUp = StreamedGateUp()
    down: RegisterDown = RegisterDown()
    use_pdl: bool = True

    def problems(self, hidden: int, intermediate: int, top_k: int, smem_limit: int) -> list[str]:
        return [f"{name}: {p}" for name, shape in (("gate_up", self.gate_up), ("down", self.down))
                for p in shape.problems(hidden, intermediate, top_k, smem_limit)]


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, cap + 1) if n % d == 0)


def default_humming_decode_configs(hidden: int, intermediate: int) -> dict[str, HummingDecodeConfig]:
    """Launch shapes for 1 token ("one") and for more ("many"). Ling (2560 / 768) gets the
    shapes measured fastest on the H200 (benchmarks/results/moe_decode_h200.md): streamed
    gate_up, 4 blocks per CTA, cluster 8; register down, 3 groups per warp for 1 token and 4
    for more. Other sizes get the nearest shapes that divide them."""
    g1, g2 = hidden // 32, intermediate // 32
    gate_up = StreamedGateUp(cluster=_divisor_at_most(g1, 8), blocks_per_cta=_divisor_at_most(intermediate // 64, 4))

    def down_groups(prefer: int) -> int:  # a divisor of g2, near `prefer`, <= 32 warps per CTA
        small = _divisor_at_most(g2, prefer)
        return small if g2 // small <= 32 else min(d for d in range(prefer, g2 + 1) if g2 % d == 0 and g2 // d <= 32)

    return {"one": HummingDecodeConfig(gate_up=gate_up, down=RegisterDown(groups_per_warp=down_groups(3), min_blocks=2)),
            "many": HummingDecodeConfig(gate_up=gate_up, down=RegisterDown(groups_per_warp=down_groups(4)))}


