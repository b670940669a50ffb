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

Kernels (``KERNELS``), all producing ``[M, V]`` logits in ``out_dtype`` (bf16 by default):

- ``"humming"``: humming-kernels W8A16 dense GEMM (FP8 e4m3 weight, per-channel bf16 scale,
  BF16 activations), prepared as vLLM 0.32 prepares humming FP8 linears, with a tuned config
  for 1..16 rows (``HUMMING_TUNING_BY_ARCH``). Its output can be one BF16 step off the
  exact value (it rounds before and after the scale). The default on sm_90.
- ``"triton"``: our Triton kernel: one row as an fp32 elementwise GEMV, more rows on the
  tensor cores with the e4m3 weight converted to bf16 in registers; fp32 accumulation; the
  per-row fp32 scale applied once per output; output within half a BF16 step.
- ``"scaled_mm"``: ``torch._scaled_mm`` row-wise, with dynamic per-token FP8 activation
  scales (activations are quantized too, so its error is larger).
- ``"torch"``: dequantize-on-the-fly in vocabulary chunks and an fp32 matmul. Correctness
  only (the CPU path); its memory stays bounded by one chunk.

Which kernel runs is chosen per GPU architecture from ``HEAD_KERNEL_BY_ARCH`` (measured;
see ``benchmarks/lm_head.py`` and ``benchmarks/results/lm_head_h200.md``), or forced with
``VLLM_LING_LM_HEAD_KERNEL``. A forced or chosen kernel that cannot run is an error or a
WARNING naming the reason, never a silent switch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
import time
from typing import Any

import torch

from vllm_ling.log import get_logger, log_once

try:  # Triton ships with CUDA builds of torch and with vLLM; the kernel is optional
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

logger = get_logger("ops.lm_head")

FP8_E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
KERNELS = ("humming", "triton", "scaled_mm", "torch")
KERNEL_ENV = "VLLM_LING_LM_HEAD_KERNEL"

# Rows of the vocabulary handled at once by the chunked (CPU / reference) paths: 8192 x 2560
# fp32 is 84 MB, so a 157,184 x 2,560 head never needs its 1.6 GB fp32 copy.
DEFAULT_CHUNK_ROWS = 8192

# Per GPU architecture (compute capability): kernels in order of preference and the
# measurement behind it (Ling head 157,184 x 2,560, CUDA-graph medians from
# benchmarks/lm_head.py, see benchmarks/results/lm_head_h200.md). Architectures without a row
# were not measured: they get _UNMEASURED_ORDER and the reason says so.
HEAD_KERNEL_BY_ARCH: dict[tuple[int, int], tuple[tuple[str, ...], str]] = {
    # H200, us at 1 / 4 / 16 rows, final run of benchmarks/lm_head.py (copy bandwidth 4,239 GB/s
    # read + write in the same run; 403 MB read per call):
    #   BF16 cuBLAS                                           184.4 / 185.3 / 189.8  (1.03 of copy BW)
    #   humming W8A16, HUMMING_TUNING_BY_ARCH config          100.6 / 100.1 / 103.8  (0.94; 1.83x BF16)
    #   humming W8A16, humming's own heuristic                128.1 / 130.3 / 136.2
    #   Triton, TRITON_CONFIGS (bf16 tensor-core inputs)      107.5 / 154.0 / 147.3
    #   Triton with fp16 tensor-core inputs (not default)     125.5 / 115.6 / 101.7
    #   torch._scaled_mm row-wise + per-token act quant       167.2 / 167.3 / 168.8
    # humming is fastest at 1 and 4 rows and within 2 % at 16, with no input-range caveat.
    (9, 0): (
        ("humming", "triton", "scaled_mm"),
        "sm_90 (H200) measured, us at 1/4/16 rows: humming W8A16 tuned 100.6/100.1/103.8, "
        "Triton 107.5/154.0/147.3, torch._scaled_mm row-wise 167.2/167.3/168.8, BF16 cuBLAS 184.4/185.3/189.8",
    ),
}
# Unmeasured GPUs: humming first (supports sm_80+ with BF16 activations), then Triton
# (FP8 conversion needs sm_89+), then _scaled_mm (row-wise FP8 needs sm_89+).
_UNMEASURED_ORDER = ("humming", "triton", "scaled_mm")
_MIN_CAPABILITY = {"humming": (8, 0), "triton": (8, 9), "scaled_mm": (8, 9)}


# --------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------


def _round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16-representable float32 >= x, for finite x >= 0 (bit trick: bf16 is
    the top 16 bits of fp32, so add 0xFFFF and clear the low half)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def fp8_row_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale rule: amax / 448 rounded up to a bfloat16 value; 1 for all-zero rows."""
    amax = amax.float()
    scale = _round_up_to_bf16(amax / FP8_E4M3_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_fp8_per_channel(
    weight: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[V, H]`` real weight -> (``float8_e4m3fn [V, H]``, ``float32 [V]`` scale).

    ``w ~= q.float() * scale[:, None]``; see the module docstring for the rule and bound.
    Works on the weight's device, ``chunk_rows`` rows at a time, so the temporary fp32 copy
    is one chunk, never the whole head. Raises ``ValueError`` on NaN/inf weights.
    """
    if weight.dim() != 2:
        raise ValueError(f"LM head weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point() or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"LM head weight must be bf16/fp16/fp32 to quantize, got {weight.dtype}")
    rows, cols = weight.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=weight.device)
    for start in range(0, rows, chunk_rows):
        block = weight[start : start + chunk_rows].to(torch.float32, copy=True)  # divided in place below
        if not torch.isfinite(block).all():
            bad = start + int((~torch.isfinite(block)).any(dim=1).nonzero()[0, 0])
            raise ValueError(
                f"LM head weight has NaN/inf values (first in vocabulary row {bad}); "
                "the checkpoint's lm_head.weight is corrupt, refusing to quantize it to FP8"
            )
        s = fp8_row_scale(block.abs().amax(dim=1))
        block.div_(s[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        q[start : start + chunk_rows] = block.to(FP8_DTYPE)
        scale[start : start + chunk_rows] = s
    return q, scale


def dequantize_fp8_per_channel(
    weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * scale[:, None]`` as ``dtype`` (materialises the whole matrix: tests and
    small heads only; the logits paths dequantize chunk by chunk)."""
    _check_fp8_pair(weight_fp8, scale)
    return (weight_fp8.float() * scale.float()[:, None]).to(dtype)


def _check_fp8_pair(weight_fp8: torch.Tensor, scale: torch.Tensor) -> None:
    if weight_fp8.dtype != FP8_DTYPE or weight_fp8.dim() != 2:
        raise ValueError(
            f"expected a 2-D float8_e4m3fn head weight, got {weight_fp8.dtype} {tuple(weight_fp8.shape)}"
        )
    if scale.shape != (weight_fp8.shape[0],):
        raise ValueError(
            f"expected one scale per vocabulary row, shape ({weight_fp8.shape[0]},), got {tuple(scale.shape)}"
        )


# --------------------------------------------------------------------------------------
# References (fp32 math, chunked over the vocabulary)
# --------------------------------------------------------------------------------------


def reference_logits(
    hidden: torch.Tensor, weight: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> torch.Tensor:
    """fp32 ``hidden @ weight.T`` with both operands upcast to fp32: the independent reference
    (``[M, H]`` x ``[V, H]`` -> ``[M, V]`` float32), chunked over V."""
    hidden32 = hidden.float().reshape(-1, hidden.shape[-1])
    out = torch.empty((hidden32.shape[0], weight.shape[0]), dtype=torch.float32, device=hidden.device)
    for start in range(0, weight.shape[0], chunk_rows):
        block = weight[start : start + chunk_rows].to(device=hidden.device, dtype=torch.float32)
        torch.matmul(hidden32, block.t(), out=out[:, start : start + chunk_rows])
    return out


def fp8_reference_logits(
    hidden: torch.Tensor,
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """fp32 logits of the dequantized FP8 head (``hidden @ (q * scale).T``), chunked over V.
    This is the ``"torch"`` kernel's math and the exact target of the fast kernels."""
    _check_fp8_pair(weight_fp8, scale)
    hidden32 = hidden.float().reshape(-1, hidden.shape[-1])
    out = torch.empty((hidden32.shape[0], weight_fp8.shape[0]), dtype=torch.float32, device=hidden.device)
    for start in range(0, weight_fp8.shape[0], chunk_rows):
        block = weight_fp8[start : start + chunk_rows].to(hidden.device).float()
        block.mul_(scale[start : start + chunk_rows].to(hidden.device).float()[:, None])
        torch.matmul(hidden32, block.t(), out=out[:, start : start + chunk_rows])
    return out


# --------------------------------------------------------------------------------------
# Kernel selection
# --------------------------------------------------------------------------------------


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def kernel_unavailable_reason(kernel: str, device: torch.device | str | None = None) -> str | None:
    """None when ``kernel`` can run on ``device``; otherwise why not (cheap: no JIT, no
    humming import)."""
    if kernel not in KERNELS:
        return f"unknown LM-head kernel {kernel!r}; choose one of {', '.join(KERNELS)}"
    device = torch.device(device) if device is not None else _default_device()
    if kernel == "torch":
        return None
    if device.type != "cuda":
        return f"{kernel} needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return f"{kernel} needs CUDA, but torch.cuda.is_available() is False"
    cap = torch.cuda.get_device_capability(device)
    need = _MIN_CAPABILITY[kernel]
    if cap < need:
        return f"{kernel} needs compute capability >= {need[0]}.{need[1]}, this GPU is {cap[0]}.{cap[1]}"
    if kernel == "humming" and not _module_available("humming"):
        return "humming-kernels is not installed (pip install humming-kernels==0.1.17)"
    if kernel == "triton" and _triton() is None:
        return "triton is not installed"
    if kernel == "scaled_mm" and not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def select_head_kernel(device: torch.device | str | None = None, preferred: str | None = None) -> tuple[str, str]:
    """(kernel name, reason). ``preferred`` (or env ``VLLM_LING_LM_HEAD_KERNEL``) forces a
    kernel and raises ``ValueError`` if it cannot run. Otherwise the arch table's first
    runnable kernel; skipping a better one logs a WARNING once with why."""
    device = torch.device(device) if device is not None else _default_device()
    forced = preferred or os.environ.get(KERNEL_ENV) or None
    if forced:
        why_not = kernel_unavailable_reason(forced, device)
        if why_not is not None:
            source = "preferred=" if preferred else f"{KERNEL_ENV}="
            raise ValueError(f"LM-head kernel {source}{forced!r} cannot run on {device}: {why_not}")
        return forced, f"forced by {'argument' if preferred else KERNEL_ENV}"
    if device.type != "cuda":
        return "torch", f"no CUDA device ({device}): chunked fp32 dequantize path, for correctness only"
    cap = torch.cuda.get_device_capability(device)
    order, evidence = HEAD_KERNEL_BY_ARCH.get(
        cap, (_UNMEASURED_ORDER, f"sm_{cap[0]}{cap[1]} not measured; default order {', '.join(_UNMEASURED_ORDER)}")
    )
    skipped = []
    for kernel in order:
        why_not = kernel_unavailable_reason(kernel, device)
        if why_not is None:
            reason = evidence
            if skipped:
                reason = f"{evidence}; skipped " + "; ".join(skipped)
                log_once(logger, logging.WARNING, f"lm_head_kernel_{cap}_{kernel}",
                         "FP8 LM head uses the %s kernel instead of the faster %s: %s",
                         kernel, order[0], "; ".join(skipped))
            return kernel, reason
        skipped.append(f"{kernel}: {why_not}")
    raise RuntimeError(f"no FP8 LM-head kernel can run on {device}: " + "; ".join(skipped))


# --------------------------------------------------------------------------------------
# Prepared state and the forward
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Fp8HeadState:
    """Everything one kernel needs per forward. ``weight``/``scale`` are in that kernel's
    layout (humming: its repacked int32 weight and ``[V, 1]`` bf16 scale; the others: the
    ``[V, H]`` e4m3 weight and ``[V]`` fp32 scale). Register them on the module (they are
    the only large tensors) so they move and count with it."""

    kernel: str
    vocab_size: int
    hidden_size: int
    weight: torch.Tensor
    scale: torch.Tensor
    out_dtype: torch.dtype = torch.bfloat16
    reason: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def nbytes(self) -> int:
        tensors = [self.weight, self.scale] + [v for v in self.extra.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def prepare_fp8_head(
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    kernel: str | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    humming_tuning: str = "table",
) -> Fp8HeadState:
    """Turn a quantized head (``quantize_fp8_per_channel`` output, on its target device) into
    the state of ``kernel`` (None: ``select_head_kernel``). For humming the returned state
    holds a repacked copy: drop your reference to ``weight_fp8`` afterwards to free it; it
    also JIT-compiles humming's kernels (seconds cold, cached on disk). ``humming_tuning``:
    "table" uses HUMMING_TUNING_BY_ARCH for small row counts, "heuristic" humming's own."""
    _check_fp8_pair(weight_fp8, scale)
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if kernel is None:
        kernel, reason = select_head_kernel(weight_fp8.device)
    else:
        why_not = kernel_unavailable_reason(kernel, weight_fp8.device)
        if why_not is not None:
            raise ValueError(f"LM-head kernel {kernel!r} cannot run on {weight_fp8.device}: {why_not}")
        reason = "requested by caller"
    vocab, hidden = weight_fp8.shape
    common = dict(kernel=kernel, vocab_size=vocab, hidden_size=hidden, out_dtype=out_dtype, reason=reason)
    if kernel == "humming":
        if humming_tuning not in ("table", "heuristic"):
            raise ValueError(f"humming_tuning must be 'table' or 'heuristic', got {humming_tuning!r}")
        return _prepare_humming(weight_fp8, scale, common, humming_tuning)
    if kernel == "scaled_mm" and (hidden % 16 or vocab % 16):
        raise ValueError(f"scaled_mm needs hidden and vocab sizes divisible by 16, got {vocab} x {hidden}")
    return Fp8HeadState(weight=weight_fp8.contiguous(), scale=scale.float().contiguous(), **common)


def fp8_head_logits(hidden: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., H]`` hidden states -> ``[..., V]`` logits in ``state.out_dtype``.

    GPU kernels read activations as bf16 (cast if given another dtype); the ``"torch"``
    path computes in fp32 and casts at the end. ``out`` (2-D ``[M, V]``, contiguous) is
    written in place when given (not for humming with a non-bf16 out_dtype)."""
    if hidden.shape[-1] != state.hidden_size:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the FP8 head's {state.hidden_size}")
    lead_shape = hidden.shape[:-1]
    x = hidden.reshape(-1, state.hidden_size)
    if state.kernel == "torch":
        logits = fp8_reference_logits(x, state.weight, state.scale).to(state.out_dtype)
        if out is not None:
            out.copy_(logits)
            logits = out
    elif x.shape[0] == 0:
        logits = torch.empty((0, state.vocab_size), dtype=state.out_dtype, device=x.device)
    elif state.kernel == "humming":
        logits = _humming_logits(x, state, out)
    elif state.kernel == "triton":
        logits = _triton_logits(x, state, out)
    elif state.kernel == "scaled_mm":
        logits = _scaled_mm_logits(x, state, out)
    else:
        raise ValueError(f"unknown LM-head kernel {state.kernel!r}")
    return logits.reshape(*lead_shape, state.vocab_size)


class Fp8LmHead:
    """Convenience wrapper: ``Fp8LmHead.from_bf16(weight)(hidden) -> logits``."""

    def __init__(self, state: Fp8HeadState):
        self.state = state

    @classmethod
    def from_bf16(cls, weight: torch.Tensor, kernel: str | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> "Fp8LmHead":
        q, s = quantize_fp8_per_channel(weight)
        return cls(prepare_fp8_head(q, s, kernel, out_dtype=out_dtype))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return fp8_head_logits(hidden, self.state)


# --------------------------------------------------------------------------------------
# humming (W8A16 dense GEMM)
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _import_humming():
    """Point humming's JIT cache at ours (``vllm_ling.ops.humming_cache``: env
    VLLM_LING_HUMMING_CACHE, default ~/.cache/vllm-ling/humming), then import it."""
    from vllm_ling.ops.humming_cache import configure_humming_cache

    configure_humming_cache()
    import humming  # noqa: F401
    import humming.ops
    import humming.schema
    import humming.transform

    return humming


# gemm_type "dense" and fp32 accumulation, as vLLM 0.32's get_humming_linear_compute_config.
_HUMMING_COMPUTE_CONFIG = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "dense"})

# Hand-tuned humming config for small row counts, per arch: rows 1..max_rows use `config`,
# larger row counts keep humming's own per-M heuristic table. H200 (sm_90), 157,184 x 2,560,
# CUDA-graph medians (benchmarks/lm_head.py --sweep, benchmarks/results/lm_head_h200.md), us at
# 1 / 4 / 16 rows:
#   humming's heuristic (WGMMA, warp-specialised, TMA, Stream-K, 8|16 x 256 x 64)  128.2 / 131.4 / 136.2
#   MMA 16x64x256, warps 16x32x64, 4 stages, 2 CTAs/SM, no Stream-K              101.8 / 103.5 / 105.4
#   MMA 16x64x256, warps 16x32x64, 3 stages, 3 CTAs/SM, no Stream-K (chosen)     101.5 / 101.5 / 102.9
#   MMA 16x64x512, warps 16x32x128, 2 stages, 2 CTAs/SM                           99.5 / 100.2 / 105.1
#   (same sweep: the 4-stage 2-CTA shape with Stream-K 108.3 / 107.1 / 110.8; block N 128, 1 CTA/SM
#   113.9 / 113.6 / 118.1). Final benchmark run with the chosen config: 100.6 / 100.1 / 103.8.
# Likely why (not profiled): several small CTAs per SM keep more weight bytes in flight than one
# warp-specialised CTA per SM, and for 1..16 rows Stream-K fix-ups cost more than they balance.
HUMMING_TUNING_BY_ARCH: dict[tuple[int, int], dict] = {
    (9, 0): {
        "max_rows": 16,
        "config": {"mma_type": "mma", "block_shape": [16, 64, 256], "warp_shape": [16, 32, 64],
                   "num_stages": 3, "num_ctas_per_sm": 3, "use_stream_k": False, "use_tma": False,
                   "use_warp_spec": False},
    },
}


def humming_tuning_table(layer_config, device: torch.device, small: dict | None) -> list | None:
    """humming's per-M tuning list ``[[lo, hi, config], ...]`` (rows in (lo, hi]) with rows
    1..small["max_rows"] replaced by small["config"]; None (= humming decides) without one."""
    if not small:
        return None
    _import_humming()
    import humming.tune

    table = humming.tune.get_heuristics_config(layer_config, gemm_type="dense", device=device)
    max_rows = int(small["max_rows"])
    out = [[0, max_rows, dict(small["config"])]]
    for lo, hi, config in table:
        if 0 < hi <= max_rows:
            continue
        out.append([max(lo, max_rows), hi, config])
    return out


def _prepare_humming(weight_fp8: torch.Tensor, scale: torch.Tensor, common: dict,
                     tuning: str = "table") -> Fp8HeadState:
    humming = _import_humming()
    vocab, hidden = weight_fp8.shape
    if hidden % 4:
        raise ValueError(f"humming needs the hidden size divisible by 4, got {hidden}")
    weight_schema = humming.schema.HummingWeightSchema(b_dtype="float8e4m3", weight_scale_group_size=0)
    tensors = {
        "weight": weight_fp8.contiguous().view(torch.int32),  # [V, H/4]: humming's packed layout
        # Exact: our scales are bf16-representable by construction.
        "weight_scale": scale.to(torch.bfloat16).reshape(vocab, 1).contiguous(),
    }
    # Same padding as vLLM's humming linears (N to 256, K to 128).
    config, out = humming.transform.prepare_and_transform_humming_tensors(
        tensors=tensors,
        shape_n=vocab,
        shape_k=hidden,
        weight_schema=weight_schema,
        input_schema=humming.schema.HummingInputSchema(),
        pad_n_to_multiple=256,
        pad_k_to_multiple=128,
        has_bias=False,
        torch_dtype=torch.bfloat16,
        device=weight_fp8.device,
    )
    del tensors
    props = torch.cuda.get_device_properties(weight_fp8.device)
    small = HUMMING_TUNING_BY_ARCH.get((props.major, props.minor)) if tuning == "table" else None
    tuning_list = humming_tuning_table(config, weight_fp8.device, small)
    extra = {
        "layer_config": config.to_str(),  # serialised once; humming_forward would redo it per call
        "layer_config_obj": config,
        "tuning_config": json.dumps(tuning_list) if tuning_list else None,
        "tuning": "table" if tuning_list else "heuristic",
        # Stream-K locks: vLLM sizes them 8 per SM; 16 leaves room for 2 CTAs per SM.
        "locks": torch.zeros(props.multi_processor_count * 16, dtype=torch.int32, device=weight_fp8.device),
    }
    state = Fp8HeadState(weight=out["weight"], scale=out["weight_scale"], extra=extra, **common)
    # humming compiles its whole per-row-count kernel table on the first call: do it now, under
    # the cross-process compile lock, so the first decode step does not pay for it.
    from vllm_ling.ops.humming_cache import compile_lock

    started = time.perf_counter()
    with compile_lock():
        _humming_logits(torch.zeros((1, hidden), dtype=torch.bfloat16, device=weight_fp8.device), state, None)
    torch.cuda.synchronize(weight_fp8.device)
    state.extra["compile_seconds"] = round(time.perf_counter() - started, 2)
    return state


def _humming_logits(x: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None) -> torch.Tensor:
    humming = _import_humming()
    x = x.to(torch.bfloat16).contiguous()
    direct_out = out if (out is not None and out.dtype == torch.bfloat16) else None
    logits = humming.ops.humming_gemm(
        layer_config=state.extra["layer_config"],
        compute_config=_HUMMING_COMPUTE_CONFIG,
        tuning_config=state.extra["tuning_config"],
        inputs=x,
        weight=state.weight,
        weight_scale=state.scale,
        outputs=direct_out,
        locks=state.extra["locks"],
    )
    if state.out_dtype != torch.bfloat16:
        logits = logits.to(state.out_dtype)
    if out is not None and logits is not out:
        out.copy_(logits)
        logits = out
    return logits


# --------------------------------------------------------------------------------------
# Triton GEMV / GEMM
# --------------------------------------------------------------------------------------


def _triton():
    """The Triton kernel, or None when Triton is not installed."""
    return _fp8_head_kernel if triton is not None else None


# One program computes logits[m0:m0+BLOCK_M, n0:n0+BLOCK_N] over the whole hidden dim: the
# weight tile is read once, converted e4m3 -> bf16 in registers and multiplied on the tensor
# cores (USE_DOT, BLOCK_M >= 16), or, for a single row, multiplied elementwise in fp32 and
# reduced (no tensor cores, no padding rows). The per-row scale is applied once at the end.
if triton is not None:

    @triton.jit
    def _fp8_head_kernel(
        x_ptr, w_ptr, scale_ptr, out_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP16: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_m = offs_m < M
        # Out-of-range rows re-read row 0 instead of predicating every weight load.
        rows_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
        rows_m = tl.where(mask_m, offs_m, 0)
        w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
        if USE_DOT:
            x_ptrs = x_ptr + rows_m[None, :] * stride_xm + offs_k[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                if USE_DOT:
                    x = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
                else:
                    x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            if USE_DOT and DOT_FP16:
                # e4m3 -> fp16 is one packed conversion (bf16 needs two) and exact; x in fp16 is
                # exact for bf16 values of magnitude 6e-5..65504 (see TritonHeadConfig).
                acc = tl.dot(w.to(tl.float16), x.to(tl.float16), acc)
            elif USE_DOT:
                acc = tl.dot(w.to(tl.bfloat16), x.to(tl.bfloat16), acc)
            else:
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        if USE_DOT:
            res = acc * scale[:, None]
            out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
        else:
            res = acc * scale
            tl.store(out_ptr + offs_m * stride_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask_n)

else:
    _fp8_head_kernel = None


@dataclasses.dataclass(frozen=True)
class TritonHeadConfig:
    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int
    num_stages: int
    # fp16 tensor-core inputs: faster conversion, but hidden values must stay below 65504
    # in magnitude (true after the final RMSNorm unless its weights exceed ~1000).
    dot_fp16: bool = False


# Per row-count bucket (upper bound of M, config). 1 and 2..16 rows: best of the H200 sweeps
# (us: 1 row elementwise fp32 109.2 (107.5 in the final run), 4 warps 151.5; 2..16 rows bf16
# tensor cores 152.8 / 146.2 at 4 / 16 rows); fp16 tensor-core inputs (2 warps) ran 126.5 /
# 115.2 / 102.5 at 1 / 4 / 16 rows but overflow for |hidden| > 65504, so they stay off by
# default. Buckets above 16 rows were not tuned (decode runs 1..16 rows; larger batches are
# correct, just not tuned).
TRITON_CONFIGS: tuple[tuple[int, TritonHeadConfig], ...] = (
    (1, TritonHeadConfig(1, 16, 512, False, 2, 3)),
    (16, TritonHeadConfig(16, 64, 128, True, 4, 4)),
    (32, TritonHeadConfig(32, 64, 128, True, 4, 4)),
    (64, TritonHeadConfig(64, 128, 64, True, 4, 4)),
    (1 << 62, TritonHeadConfig(128, 128, 64, True, 8, 4)),
)


def triton_config_for(rows: int) -> TritonHeadConfig:
    for bound, config in TRITON_CONFIGS:
        if rows <= bound:
            return config
    return TRITON_CONFIGS[-1][1]


def _triton_logits(x: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None,
                   config: TritonHeadConfig | None = None) -> torch.Tensor:
    kernel = _triton()
    x = x.to(torch.bfloat16).contiguous()
    rows = x.shape[0]
    config = config or triton_config_for(rows)
    if not config.use_dot and config.block_m != 1:
        raise ValueError("the elementwise Triton path handles one row per program (block_m=1)")
    if out is None:
        out = torch.empty((rows, state.vocab_size), dtype=state.out_dtype, device=x.device)
    elif out.shape != (rows, state.vocab_size) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows}, {state.vocab_size}] tensor")
    grid = (-(-state.vocab_size // config.block_n), -(-rows // config.block_m))
    kernel[grid](
        x, state.weight, state.scale, out,
        rows, state.vocab_size, state.hidden_size,
        x.stride(0), state.weight.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.use_dot, EVEN_K=state.hidden_size % config.block_k == 0, DOT_FP16=config.dot_fp16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------
# torch._scaled_mm (row-wise, dynamic per-token activation scales)
# --------------------------------------------------------------------------------------


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row activation quantization: (e4m3 [M, K], fp32 [M, 1] scale)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (x32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE), scale


def _scaled_mm_logits(x: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None) -> torch.Tensor:
    xq, x_scale = quantize_fp8_per_token(x)
    logits = torch._scaled_mm(
        xq,
        state.weight.t(),  # column-major [H, V] view of the row-major head, as cuBLASLt wants
        scale_a=x_scale,
        scale_b=state.scale.view(1, -1),
        out_dtype=state.out_dtype,
    )
    if out is not None:
        out.copy_(logits)
        logits = out
    return logits


# --------------------------------------------------------------------------------------
# Warm-up (vllm-ling warmup): compile the kernels for the head's shapes ahead of serving
# --------------------------------------------------------------------------------------


def warmup_kernels(
    vocab_size: int,
    hidden_size: int,
    row_counts: tuple[int, ...] = (1, 2, 4, 8, 16),
    kernel: str | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """JIT-compile the chosen kernel for a ``vocab_size x hidden_size`` head at each row count
    (humming compiles its whole per-M table on the first call; Triton one kernel per
    row-count bucket) on a random head, and run each once. Returns what was done."""
    device = torch.device(device) if device is not None else _default_device()
    if device.type != "cuda":
        raise RuntimeError(f"warmup_kernels needs a CUDA device, got {device}")
    started = time.perf_counter()
    name, reason = (kernel, "requested") if kernel else select_head_kernel(device)
    kernels_before = 0
    if name == "humming":
        from vllm_ling.ops.humming_cache import configure_humming_cache, count_cached_kernels

        kernels_before = count_cached_kernels(configure_humming_cache())
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn((vocab_size, hidden_size), device=device, dtype=torch.bfloat16, generator=gen)
    q, s = quantize_fp8_per_channel(weight)
    del weight
    state = prepare_fp8_head(q, s, name)
    del q
    rows_done = []
    for rows in sorted(set(int(r) for r in row_counts)):
        x = torch.randn((rows, hidden_size), device=device, dtype=torch.bfloat16, generator=gen)
        logits = fp8_head_logits(x, state)
        if not torch.isfinite(logits.float()).all():
            raise RuntimeError(f"FP8 LM head ({name}) produced non-finite logits at {rows} rows during warm-up")
        rows_done.append(rows)
    torch.cuda.synchronize(device)
    result = {
        "kernel": name,
        "reason": reason,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "row_counts": rows_done,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if name == "humming":
        from vllm_ling.ops.humming_cache import count_cached_kernels

        result["cache_dir"] = os.environ.get("HUMMING_CACHE_DIR")
        result["kernels_before"] = kernels_before
        result["kernels_after"] = count_cached_kernels()
        result["new_kernels"] = result["kernels_after"] - kernels_before
        result["compile_seconds"] = state.extra.get("compile_seconds")
    del state
    return result
