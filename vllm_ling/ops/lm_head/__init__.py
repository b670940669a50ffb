"""FP8 (e4m3) LM head: per-row quantization, an fp32 reference, and the fast logits kernels.

No vLLM import; runs on torch 2.11..2.13. humming-kernels is imported only when its kernel is
prepared; Triton, when installed, at import (the CUDA builds of torch and vLLM ship it).

Quantization rule (per output row ``n`` of a ``[V, H]`` head, i.e. per vocabulary entry)::

    amax[n]  = max_k |w[n, k]|
    scale[n] = amax[n] / 448, rounded UP to the nearest bfloat16 value   (448 = e4m3 max)
    q[n, k]  = round_to_nearest_even(w[n, k] / scale[n])   as float8_e4m3fn, |q| <= 448
    w[n, k] ~= float(q[n, k]) * scale[n]
    all-zero rows (vLLM's vocabulary padding): scale = 1, q = 0 (never NaN or inf)

Rounding the scale up to a bfloat16 value costs under 1% of the top e4m3 code and makes the
scale exact in every kernel: humming keeps per-channel scales in the activation dtype
(bf16), Triton and ``torch._scaled_mm`` read them as fp32; all see the same weights.
Error bound per weight: ``|w - q*scale| <= 2**-4 * |w|`` (3 mantissa bits, round to
nearest) where ``|w| / scale >= 2**-6`` (e4m3's normal range), ``2**-10 * scale`` below it
(subnormal codes), so never more than ``2**-4 * amax`` of the row.

Kernels (``KERNELS``), all producing ``[M, V]`` logits in ``out_dtype`` (bf16 by default),
one module each:

- ``"humming"`` (:mod:`.humming`): humming-kernels W8A16 dense GEMM (FP8 e4m3 weight,
  per-channel bf16 scale, BF16 activations), prepared as vLLM 0.32 prepares humming FP8
  linears, with a tuned config for 1..16 rows (``HUMMING_TUNING_BY_ARCH``). Its output can be
  one BF16 step off the exact value (it rounds before and after the scale). The default on sm_90.
- ``"triton"`` (:mod:`.triton_kernel`): our Triton kernel: one row as an fp32 elementwise
  GEMV, more rows on the tensor cores with the e4m3 weight converted to bf16 in registers;
  fp32 accumulation; the per-row fp32 scale applied once per output; output within half a
  BF16 step.
- ``"scaled_mm"`` (:mod:`.scaled_mm`): ``torch._scaled_mm`` row-wise, with dynamic per-token
  FP8 activation scales (activations are quantized too, so its error is larger).
- ``"torch"`` (:mod:`.reference`): dequantize-on-the-fly in vocabulary chunks and an fp32
  matmul. Correctness only (the CPU path); its memory stays bounded by one chunk.

Which kernel runs is chosen per GPU architecture from ``HEAD_KERNEL_BY_ARCH`` (measured;
see ``benchmarks/lm_head.py`` and ``benchmarks/results/lm_head_h200.md``), or forced with
``VLLM_LING_LM_HEAD_KERNEL`` (:mod:`.selection`). A forced or chosen kernel that cannot run
is an error or a WARNING naming the reason, never a silent switch. :mod:`.quantize` holds the
rule above, :mod:`.state` / :mod:`.head` the prepared head and its forward, :mod:`.warmup`
the ahead-of-serving compile. No vLLM import; runs on torch 2.11..2.13. humming-kernels is
imported only when its kernel is prepared; Triton, when installed, at import.

The names below are what the layers and the CLI use (``from vllm_ling.ops import lm_head``).
"""

from vllm_ling.ops.lm_head.head import Fp8LmHead, fp8_head_logits, prepare_fp8_head
from vllm_ling.ops.lm_head.quantize import dequantize_fp8_per_channel, quantize_fp8_per_channel
from vllm_ling.ops.lm_head.reference import fp8_reference_logits, reference_logits
from vllm_ling.ops.lm_head.selection import KERNELS, kernel_unavailable_reason, select_head_kernel
from vllm_ling.ops.lm_head.state import Fp8HeadState
from vllm_ling.ops.lm_head.warmup import warmup_kernels

__all__ = ["KERNELS", "Fp8HeadState", "Fp8LmHead", "dequantize_fp8_per_channel", "fp8_head_logits",
           "fp8_reference_logits", "kernel_unavailable_reason", "prepare_fp8_head",
           "quantize_fp8_per_channel", "reference_logits", "select_head_kernel", "warmup_kernels"]
