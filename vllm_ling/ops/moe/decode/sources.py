"""The CUDA C++ text of the decode kernels, as handed to NVRTC: ``#define`` lines for the
sizes and launch shape, then the package-data files below, concatenated verbatim.

Files (next to this module; shipped as package data), after :func:`vllm_ling.ops.cuda_jit.ptx_loads`
(the global loads every kernel of the package shares):

- ``common.cuh``: MXFP4 -> BF16 decode of the packed layout, ``mma.m16n8k16`` BF16, the
  2**100 activation scaling, E8M0 scale factors, SwiGLU with the per-layer clamp
  (``CLAMP_GATE_OUTPUT``), BF16 rounding.
- ``packed_layout.cu``: gate_up + SwiGLU and down + top-k sum on vllm-ling's own packed copy
  (:func:`~vllm_ling.ops.moe.decode.packing.pack_gate_up` / ``pack_down``; the ``copy`` mode).
- ``humming_layout.cuh``: reading humming's own transformed layout (W4A16: repacked nibbles,
  interleave mode 3, E8M0 scales transposed to [E, K/32, N] and permuted inside each block of
  64 output rows). In one k16 "slab" row of the weight ([E, K/16, 2N] int32), the 16 bytes of
  lane (g, t) for a block of 64 output rows hold four ints; int J is exactly the MMA A
  fragment of rows 16J..16J+15 (nibble pairs (0,4), (1,5), (2,6), (3,7) = a0, a2, a1, a3).
  Scales of rows 16J+g / 16J+8+g of a block are the bytes 8g + 2J / 8g + 2J + 1. A warp's
  unit of work is one 64-row block x some scale groups (``hl_group_mma`` per group); cluster
  helpers (rank, barrier, distributed-shared-memory store).
- ``register_down.cu``: down + weighted top-k sum on humming's layout, weights loaded straight
  into registers, one CTA per top-k slot in a cluster (:class:`~.shapes.RegisterDown`).
- ``bulk_copy.cuh``: mbarriers and ``cp.async.bulk`` (sm_90+) for the streamed kernel.
- ``streamed_gate_up.cu``: gate_up + SwiGLU on humming's layout with its weights streamed
  through shared memory (:class:`~.shapes.StreamedGateUp`): a producer warp copies pieces of
  slab rows into a ring of ST_S stages while consumer warps decode from shared memory, so a
  CTA keeps ST_S stages in flight while it computes (loading every weight of a warp into
  registers up front, as the down kernel does, measured slower: the Reading of
  benchmarks/results/moe_decode_h200.md). Consumer warp (b, kw): gate and up rows of block b,
  group kw of every stage. Partial sums go straight to the cluster rank that owns their rows
  (distributed shared memory).
"""

from __future__ import annotations

import functools
from importlib import resources

from vllm_ling.ops.cuda_jit import define_lines, ptx_loads


@functools.cache
def read(name: str) -> str:
    """The text of one source file of this package, byte for byte."""
    return resources.files(__package__).joinpath(name).read_bytes().decode()


def defines(**values: int) -> str:
    return define_lines({k: int(v) for k, v in values.items()})


def packed_layout_source(hidden: int, intermediate: int, top_k: int, config, clamp_flag: int) -> str:
    """Both packed-layout kernels (``ling_moe_decode_gate_up``, ``ling_moe_decode_down``) for a
    :class:`~.shapes.PackedDecodeConfig`."""
    return (defines(H_=hidden, I_=intermediate, TOPK=top_k,
                    KS_A=config.k_split_gate_up, KS_B=config.k_split_down,
                    MINB_A=config.min_blocks_gate_up, MINB_B=config.min_blocks_down,
                    CLAMP_GATE_OUTPUT=clamp_flag)
            + ptx_loads() + read("common.cuh") + read("packed_layout.cu"))


def humming_layout_source(kernel_files: tuple[str, ...], **values: int) -> str:
    """One humming-layout kernel: its defines, the common and humming-layout helpers, then
    ``kernel_files``."""
    return (defines(**values) + ptx_loads() + read("common.cuh") + read("humming_layout.cuh")
            + "".join(read(f) for f in kernel_files))
