"""MoE decode kernels: routed MXFP4 experts for decode-sized batches in two fused CUDA kernels.

Why: for a few tokens a Ling MoE layer is a set of GEMVs over 8 experts per token, and
humming's indexed GEMM needs five launches (routing metadata, gate_up, SwiGLU, down, top-k
sum) and reaches a small fraction of the copy bandwidth there. These kernels index the
experts straight from ``topk_ids`` (no routing metadata), fuse SwiGLU (+ the per-layer clamp)
into gate_up and the weighted top-k sum into down, and let the down kernel load its weights
while gate_up finishes (programmatic dependent launch, sm_90+). They serve batches up to
``decode_max_tokens`` (:class:`~vllm_ling.ops.moe.humming.HummingMxfp4Experts`); measured in
benchmarks/results/moe_decode_h200.md.

Two weight layouts, same math (:mod:`.layouts`):

- :class:`HummingLayoutDecode` (the default, ``VLLM_LING_MOE_DECODE=auto``) reads humming's
  own transformed W4A16 tensors, so there is no second copy. In a k16 "slab" row of
  humming's weight ([E, K/16, 2N] int32) the 16 bytes of lane (g, t) for a block of 64
  output rows hold four ints, and int J is exactly the MMA A fragment of rows 16J..16J+15
  (checked bit for bit against humming's transform on the GPU). A 64-row block is the
  smallest unit a warp can read, so gate_up splits K over a cluster of CTAs that reduce in
  distributed shared memory and streams its weights through shared-memory stages filled
  by bulk copies (:class:`StreamedGateUp`); down runs one CTA per top-k slot in a cluster
  and loads its weights into registers (:class:`RegisterDown`). sm_90+.
- :class:`PackedLayoutDecode` (``VLLM_LING_MOE_DECODE=copy``) repacks the checkpoint's
  codes once into a layout made for GEMV (:func:`~.packing.pack_gate_up`,
  :func:`~.packing.pack_down`: each lane's 16 bytes are its fragments of 16 rows x 64 k, and
  8 codes decode in 9 integer instructions). Faster, but humming still needs its copy for
  larger batches: twice the routed-expert memory.

Math (``mma.m16n8k16`` BF16 -> FP32, weights as A, the token as B column 0): an MXFP4 code
becomes a BF16 bit pattern worth ``v * 2**-126`` by moving its sign to bit 15 and its
exponent/mantissa bits to bits 8..6 (codes +-0.5 become BF16 subnormals, which the tensor
cores keep: a GPU test uses only those codes); activations are multiplied by 2**100 (exact)
so products stay normal FP32 numbers; each group's E8M0 scale ``2**(s-127)`` times the
``2**(126-100)`` correction is applied once per row and 32-k group to the FP32 result.
Numerics: FP32 accumulation, SwiGLU output rounded to BF16 (as vLLM's intermediate cache),
routed sum in FP32, output BF16. E8M0 exponents up to 228 are exact.
Known limit: because of the 2**100 shift, a partial sum above about 2**27 (activations around
1e8, far beyond any Ling layer's) overflows FP32 to inf where humming's GEMM stays finite; the
startup known-answer check keeps its inputs below that (benchmarks/results/kernel_checks_h200.md).

Modules: :mod:`.packing` (layouts and their PyTorch emulation), :mod:`.sources` (the CUDA
sources, ``*.cu`` / ``*.cuh`` package data; compiled and launched by
:mod:`vllm_ling.ops.cuda_jit`), :mod:`.shapes` (launch
shapes), :mod:`.layouts` (the two decoders). No vLLM import; nothing here imports the humming
wrapper. Limits: BF16 activations, hidden and intermediate multiples of 64, top_k <= 8
(cluster size), int32 top-k ids (others are converted).
"""

from vllm_ling.ops.moe.decode.layouts import HummingLayoutDecode, PackedLayoutDecode, humming_decode_support
from vllm_ling.ops.moe.decode.shapes import (HummingDecodeConfig, PackedDecodeConfig, RegisterDown,
                                             StreamedGateUp, default_humming_decode_configs)

__all__ = ["HummingDecodeConfig", "HummingLayoutDecode", "PackedDecodeConfig", "PackedLayoutDecode",
           "RegisterDown", "StreamedGateUp", "default_humming_decode_configs", "humming_decode_support"]
