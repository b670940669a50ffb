"""Ling-3.0 MoE block: plain-PyTorch reference and the humming MXFP4 fused-MoE path.

No vLLM import (this module runs on the GPU device machine without vLLM); humming-kernels
is imported lazily, only when the humming path is built. Runs on torch 2.11 .. 2.13.

Semantics follow vLLM 0.32's Ling model (``model_executor/models/bailing_moe_v3.py``):

Routing (``grouped_topk`` in ``fused_moe/router/grouped_topk_router.py``, same in the CPU
router): fp32 router logits ``x @ gate_w.T``; sigmoid scores; the expert bias
(``e_score_correction_bias``, "noaux_tc") is added for *selection only*; each of
``n_group`` groups scores the **sum of its top-2 biased scores**; the ``topk_group`` best
groups are kept; the top-k biased scores inside them pick the experts; the weights are the
*unbiased* sigmoid scores of those experts, renormalised to sum 1 (``norm_topk_prob``) and
then multiplied by ``routed_scaling_factor``.

SwiGLU clamp. vLLM applies the per-layer limits in two *different* ways, and we match each:

- routed experts (FusedMoE, activation ``silu`` with ``swiglu_limit``;
  ``fused_moe/activation.py`` -> ``silu_and_mul_with_clamp``):
  ``silu(min(gate, L)) * clamp(up, -L, L)`` -- the gate is clamped *before* SiLU
  (:data:`CLAMP_GATE_INPUT`);
- shared expert (``SwigluStepAndMul`` in ``layers/activation.py``):
  ``min(silu(gate), L) * clamp(up, -L, L)`` -- the SiLU *output* is clamped
  (:data:`CLAMP_GATE_OUTPUT`).

A limit of ``None`` or ``0`` means no clamp (vLLM's ``_get_layer_swiglu_limit``).

Weights use vLLM's MXFP4 MoE layout: ``w13_weight`` uint8 [E, 2I, H/2] (gate rows, then up
rows), ``w13_weight_scale`` uint8 E8M0 [E, 2I, H/32], ``w2_weight`` uint8 [E, H, I/2],
``w2_weight_scale`` uint8 [E, H, I/32].
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from vllm_ling.log import get_logger, log_once
from vllm_ling.ops.mxfp4 import MXFP4_GROUP_SIZE, mxfp4_dequantize

logger = get_logger("ops.moe")

CLAMP_GATE_INPUT = "gate_input"  # vLLM fused-MoE experts: silu(min(g, L)) * clamp(u)
CLAMP_GATE_OUTPUT = "gate_output"  # vLLM SwigluStepAndMul (shared expert): min(silu(g), L) * clamp(u)
ROUTED_EXPERT_CLAMP = CLAMP_GATE_INPUT
# Decode kernels for small batches (vllm_ling.ops.moe_decode): "auto" runs them on humming's
# own weights where supported, "copy" on a second GEMV-packed copy (faster, 2x expert memory),
# "off" never. Up to 32 tokens (the largest batch measured) they beat humming's GEMM on the H200
# (1.30x at 32; benchmarks/results/moe_decode_h200.md).
DECODE_AUTO, DECODE_COPY, DECODE_OFF = "auto", "copy", "off"
DECODE_MODES = (DECODE_AUTO, DECODE_COPY, DECODE_OFF)
DEFAULT_DECODE_MAX_TOKENS = 32  # = vllm_ling.options.MOE_DECODE_MAX_TOKENS
SHARED_EXPERT_CLAMP = CLAMP_GATE_OUTPUT
_CLAMP_MODES = (CLAMP_GATE_INPUT, CLAMP_GATE_OUTPUT)

FP8_E4M3_MAX = 448.0


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LingMoEConfig:
    """The routing/shape fields of a Ling MoE layer (from the HF config)."""

    num_experts: int = 512
    top_k: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    hidden_size: int = 2560
    moe_intermediate_size: int = 768
    shared_intermediate_size: int = 768

    @classmethod
    def from_hf_config(cls, config: Any) -> "LingMoEConfig":
        get = (config.get if isinstance(config, dict)
               else lambda k, d=None: getattr(config, k, d))
        shared = get("moe_shared_expert_intermediate_size") or get("moe_intermediate_size")
        return cls(
            num_experts=int(get("num_experts")),
            top_k=int(get("num_experts_per_tok")),
            n_group=int(get("n_group") or 1),
            topk_group=int(get("topk_group") or 1),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
            hidden_size=int(get("hidden_size")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_intermediate_size=int(shared) * int(get("num_shared_experts") or 1),
        )


def layer_swiglu_limit(limit_list: list | None, layer_idx: int) -> float | None:
    """Per-layer limit as vLLM reads it: missing, ``None`` or ``0`` -> no clamp."""
    if not limit_list or layer_idx >= len(limit_list):
        return None
    limit = limit_list[layer_idx]
    if limit in (None, 0):
        return None
    return float(limit)


def _effective_limit(limit: float | None) -> float | None:
    if limit is None:
        return None
    limit = float(limit)
    if limit < 0 or math.isnan(limit):
        raise ValueError(f"swiglu_limit must be None, 0 or positive, got {limit}")
    return limit if limit > 0 else None


# --------------------------------------------------------------------------------------
# Reference: routing
# --------------------------------------------------------------------------------------

def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits ``x @ gate_weight.T`` ([T, H] x [E, H] -> [T, E])."""
    return x.float() @ gate_weight.float().t()


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    expert_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid grouped top-k (DeepSeek-V3 / vLLM ``grouped_topk`` with ``scoring_func=sigmoid``).

    Returns (weights float32 [T, k], ids int32 [T, k]). Ties are broken by torch.topk.
    """
    T, E = logits.shape
    if E % n_group:
        raise ValueError(f"num_experts={E} is not divisible by n_group={n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    per_group = E // n_group
    if top_k > topk_group * per_group:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * per_group} experts of the kept groups")
    scores = logits.float().sigmoid()
    if expert_bias is not None:
        choice = scores + expert_bias.float().unsqueeze(0)
        group_scores = choice.view(T, n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
    else:
        choice = scores
        group_scores = choice.view(T, n_group, per_group).amax(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(T, n_group, per_group).reshape(T, E)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = masked.topk(top_k, dim=-1)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights.float(), topk_ids.to(torch.int32)


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    expert_bias: torch.Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ling router: fp32 logits, sigmoid, biased grouped top-k -> (weights, ids)."""
    return grouped_topk(router_logits(x, gate_weight), top_k, n_group, topk_group,
                        expert_bias, norm_topk_prob, routed_scaling_factor)


# --------------------------------------------------------------------------------------
# Reference: SwiGLU and experts
# --------------------------------------------------------------------------------------

def swiglu(x: torch.Tensor, limit: float | None = None,
           clamp: str = ROUTED_EXPERT_CLAMP) -> torch.Tensor:
    """SwiGLU on [..., 2d] (gate first, then up) -> [..., d], computed in x's dtype.

    ``limit`` None/0: ``silu(gate) * up``. Otherwise ``clamp`` picks where the gate is
    clamped (see the module docstring); ``up`` is always clamped to [-limit, limit].
    """
    if clamp not in _CLAMP_MODES:
        raise ValueError(f"clamp must be one of {_CLAMP_MODES}, got {clamp!r}")
    gate, up = x.chunk(2, dim=-1)
    limit = _effective_limit(limit)
    if limit is None:
        return F.silu(gate) * up
    up = up.clamp(min=-limit, max=limit)
    if clamp == CLAMP_GATE_INPUT:
        return F.silu(gate.clamp(max=limit)) * up
    return F.silu(gate).clamp(max=limit) * up


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Round rows to FP8 e4m3 with a per-row dynamic scale amax/448 (what a W4A8 kernel
    does to its activations), returned dequantized in float32."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
    return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
    if w.dtype == torch.uint8:
        if scale is None:
            raise ValueError("MXFP4 (uint8) expert weights need their E8M0 scales")
        return mxfp4_dequantize(w[e], scale[e], MXFP4_GROUP_SIZE, torch.float32)
    return w[e].float()


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    clamp: str = ROUTED_EXPERT_CLAMP,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """Weighted routed-expert sum in float32: sum_k w[t,k] * expert_{id[t,k]}(x[t]).

    ``w13`` [E, 2I, H] / ``w2`` [E, H, I] real weights, or MXFP4 uint8 [E, 2I, H/2] /
    [E, H, I/2] with ``w13_scale`` / ``w2_scale`` (only the selected experts are
    dequantized). ``fp8_activations`` rounds both GEMM inputs to FP8 e4m3 per token, as
    the W4A8 kernel does. Returns float32 [T, H].
    """
    xf = x.float()
    T = xf.shape[0]
    H = w2.shape[1]
    out = torch.zeros(T, H, dtype=torch.float32, device=xf.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13_e = _expert_weight(w13, w13_scale, e)
        w2_e = _expert_weight(w2, w2_scale, e)
        xe = xf[tok]
        if fp8_activations:
            xe = fake_quant_fp8_per_token(xe)
        act = swiglu(xe @ w13_e.t(), swiglu_limit, clamp)
        if fp8_activations:
            act = fake_quant_fp8_per_token(act)
        y = act @ w2_e.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
    return out


def shared_expert_reference(x: torch.Tensor, gate_up_weight: torch.Tensor,
                            down_weight: torch.Tensor, swiglu_limit: float | None = None,
                            clamp: str = SHARED_EXPERT_CLAMP) -> torch.Tensor:
    """Dense SwiGLU MLP ([2I, H] gate_up, [H, I] down) in float32 -> [T, H]."""
    h = x.float() @ gate_up_weight.float().t()
    return swiglu(h, swiglu_limit, clamp) @ down_weight.float().t()


def moe_block_reference(
    x: torch.Tensor,
    cfg: LingMoEConfig,
    *,
    gate_weight: torch.Tensor,
    expert_bias: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    routed_swiglu_limit: float | None = None,
    shared_swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Whole Ling MoE block: routed (scaled) experts + shared expert, float32 [T, H]."""
    weights, ids = route(x, gate_weight, expert_bias, top_k=cfg.top_k, n_group=cfg.n_group,
                         topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                         routed_scaling_factor=cfg.routed_scaling_factor)
    routed = experts_reference(x, w13, w2, weights, ids, routed_swiglu_limit,
                               w13_scale=w13_scale, w2_scale=w2_scale)
    shared = shared_expert_reference(x, shared_gate_up, shared_down, shared_swiglu_limit)
    return routed + shared


# --------------------------------------------------------------------------------------
# Routing metadata for the indexed MoE GEMM (vLLM's moe_align_block_size layout)
# --------------------------------------------------------------------------------------

def moe_align_buffer_sizes(num_assignments: int, block_size: int, num_experts: int) -> tuple[int, int]:
    """(len(sorted_ids), len(expert_ids)) exactly as vLLM sizes them (static per T)."""
    max_padded = num_assignments + num_experts * (block_size - 1)
    if num_assignments < num_experts:
        max_padded = min(num_assignments * block_size, max_padded)
    return max_padded, -(-max_padded // block_size)


def moe_align_block_size_torch(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """PyTorch version of vLLM's ``moe_align_block_size`` (no host sync, graph-capturable).

    Flat assignment ``i = token * top_k + slot`` goes to expert ``topk_ids.flat[i]``. Each
    expert's assignments are listed consecutively (experts in increasing order, assignments
    in increasing order) and padded to a multiple of ``block_size`` with the sentinel
    ``numel``. Returns (sorted_ids int32 [P], expert_ids int32 [P / block_size] -- one
    expert per block, num_tokens_padded int32 [1] -- the used prefix of sorted_ids).
    """
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    num_slots, num_blocks = moe_align_buffer_sizes(n, block_size, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_size - 1) // block_size
    block_end = torch.cumsum(blocks, 0)
    first_in_expert = torch.cumsum(counts, 0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(n, device=device) - first_in_expert[sorted_experts]
    pos = (block_end - blocks)[sorted_experts] * block_size + rank
    sorted_ids = torch.full((num_slots,), n, dtype=torch.int32, device=device)
    sorted_ids[pos] = order.to(torch.int32)
    block_index = torch.arange(num_blocks, device=device)
    expert_ids = torch.searchsorted(block_end, block_index, right=True).clamp_(max=num_experts - 1)
    num_tokens_padded = (block_end[-1:] * block_size).to(torch.int32)
    return sorted_ids, expert_ids.to(torch.int32), num_tokens_padded


# One CTA computes the whole layout with O(n^2) comparisons in registers: for decode
# batches (n = T * top_k <= 128) this replaces ~15 small PyTorch kernels by one launch.
TRITON_ALIGN_MAX_ASSIGNMENTS = 128
_triton_align_kernel = None


def _get_triton_align_kernel():
    global _triton_align_kernel
    if _triton_align_kernel is not None:
        return _triton_align_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _moe_align_small(ids_ptr, sorted_ids_ptr, expert_ids_ptr, ntp_ptr, n, num_slots,
                         num_blocks, BLOCK_SIZE: tl.constexpr, N: tl.constexpr,
                         FILL: tl.constexpr):
        offs = tl.arange(0, N)
        valid = offs < n
        ids = tl.load(ids_ptr + offs, mask=valid, other=0x3FFFFFFF).to(tl.int32)
        fill = tl.arange(0, FILL)
        for start in range(0, num_slots, FILL):
            tl.store(sorted_ids_ptr + start + fill, tl.zeros([FILL], tl.int32) + n,
                     mask=start + fill < num_slots)
        for start in range(0, num_blocks, FILL):
            tl.store(expert_ids_ptr + start + fill, tl.zeros([FILL], tl.int32),
                     mask=start + fill < num_blocks)
        tl.debug_barrier()
        row = ids[:, None]
        col = ids[None, :]
        col_valid = valid[None, :]
        same = (row == col) & col_valid
        count = tl.sum(same.to(tl.int32), axis=1)
        rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
        nblk = (count + BLOCK_SIZE - 1) // BLOCK_SIZE
        first_nblk = tl.where((rank == 0) & valid, nblk, 0)
        less = (col < row) & col_valid
        gstart = tl.sum(tl.where(less, first_nblk[None, :], 0), axis=1)
        tl.store(sorted_ids_ptr + gstart * BLOCK_SIZE + rank, offs, mask=valid)
        tl.store(expert_ids_ptr + gstart + rank // BLOCK_SIZE, ids, mask=valid)
        total = tl.sum(first_nblk, axis=0)
        tl.store(ntp_ptr, total * BLOCK_SIZE)

    _triton_align_kernel = _moe_align_small
    return _triton_align_kernel


def moe_align_block_size_triton(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """Same output as :func:`moe_align_block_size_torch`, one Triton launch; only for
    ``topk_ids.numel() <= TRITON_ALIGN_MAX_ASSIGNMENTS``."""
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    flat = flat.contiguous()
    n = flat.numel()
    if n > TRITON_ALIGN_MAX_ASSIGNMENTS:
        raise ValueError(f"triton align handles at most {TRITON_ALIGN_MAX_ASSIGNMENTS} "
                         f"assignments, got {n}")
    num_slots, num_blocks = moe_align_buffer_sizes(n, block_size, num_experts)
    sorted_ids = torch.empty(num_slots, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    ntp = torch.empty(1, dtype=torch.int32, device=flat.device)
    N = max(16, 1 << (n - 1).bit_length())
    kernel = _get_triton_align_kernel()
    kernel[(1,)](flat, sorted_ids, expert_ids, ntp, n, num_slots, num_blocks,
                 BLOCK_SIZE=block_size, N=N, FILL=256, num_warps=4 if N <= 64 else 8)
    return sorted_ids, expert_ids, ntp


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         impl: str = "auto"):
    """Dispatch: ``triton`` (one launch, small batches), ``torch``, or ``auto`` (Triton on
    CUDA for n <= 128 when Triton imports, else PyTorch)."""
    if impl == "torch":
        return moe_align_block_size_torch(topk_ids, block_size, num_experts)
    if impl == "triton":
        return moe_align_block_size_triton(topk_ids, block_size, num_experts)
    if impl != "auto":
        raise ValueError(f"routing impl must be auto, torch or triton, got {impl!r}")
    if (topk_ids.is_cuda and topk_ids.numel() <= TRITON_ALIGN_MAX_ASSIGNMENTS
            and _triton_available()):
        return moe_align_block_size_triton(topk_ids, block_size, num_experts)
    return moe_align_block_size_torch(topk_ids, block_size, num_experts)


def _triton_available() -> bool:
    ok = importlib.util.find_spec("triton") is not None
    if not ok:
        log_once(logger, logging.WARNING, "no-triton",
                 "Triton is not installed: MoE routing metadata is built with ~15 small "
                 "PyTorch kernels instead of one fused Triton kernel (slower decode).")
    return ok


_triton_wsum_kernel = None


def _get_triton_weighted_sum_kernel():
    global _triton_wsum_kernel
    if _triton_wsum_kernel is not None:
        return _triton_wsum_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _weighted_sum(down_ptr, w_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], tl.float32)
        for k in tl.static_range(TOP_K):
            wk = tl.load(w_ptr + t * TOP_K + k)
            row = tl.load(down_ptr + (t * TOP_K + k) * H + offs, mask=mask, other=0.0)
            acc += wk * row.to(tl.float32)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    _triton_wsum_kernel = _weighted_sum
    return _triton_wsum_kernel


def weighted_topk_sum(down: torch.Tensor, topk_weights: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * down[t * k_total + k] for down [T*k, H].

    ``triton``: one launch, fp32 weights and accumulation; ``torch``: BF16 batched GEMM
    (weights cast to BF16, two launches); ``auto``: Triton on CUDA when it imports.
    """
    T, top_k = topk_weights.shape
    H = down.shape[-1]
    if impl == "auto":
        impl = "triton" if down.is_cuda and _triton_available() else "torch"
    if impl == "torch":
        weights = topk_weights.to(down.dtype).unsqueeze(1)
        return torch.bmm(weights, down.view(T, top_k, H)).squeeze(1)
    if impl != "triton":
        raise ValueError(f"weighted-sum impl must be auto, torch or triton, got {impl!r}")
    down = down.contiguous()
    w = topk_weights.float().contiguous()
    out = torch.empty(T, H, dtype=down.dtype, device=down.device)
    block_h = 512
    _get_triton_weighted_sum_kernel()[(T, -(-H // block_h))](down, w, out, H, TOP_K=top_k,
                                                              BLOCK_H=block_h, num_warps=4)
    return out


# --------------------------------------------------------------------------------------
# Humming path
# --------------------------------------------------------------------------------------

class HummingUnavailableError(RuntimeError):
    """humming cannot run here (not installed, no CUDA, GPU too old, bad dtype)."""


def humming_status(w4a8: bool = False, device: int | torch.device | None = None) -> tuple[bool, str]:
    """Can the humming MXFP4 MoE path run here? Checks without importing humming (its
    import starts a background build) and without compiling anything."""
    if importlib.util.find_spec("humming") is None:
        return False, ("humming-kernels is not installed (pip install humming-kernels; it "
                       "comes with vllm==0.32.0)")
    if not torch.cuda.is_available():
        return False, "CUDA is not available (humming needs an NVIDIA GPU, sm_75 or newer)"
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    arch = f"sm_{major}{minor}"
    if (major, minor) < (7, 5):
        return False, f"GPU {torch.cuda.get_device_name(dev)} is {arch}; humming needs sm_75+"
    if (major, minor) < (8, 0):
        return False, (f"GPU is {arch}: humming runs there only with FP16 activations, but "
                       "the Ling MoE path uses BF16 activations, which need sm_80+")
    if w4a8 and (major, minor) < (8, 9):
        return False, f"W4A8 (FP8 e4m3 activations) needs sm_89+; this GPU is {arch}"
    from vllm_ling.versions import TESTED_HUMMING_VERSION, humming_version

    version = humming_version()
    extra = ""
    if version is not None and version != TESTED_HUMMING_VERSION:
        extra = f" (untested humming-kernels {version}; tested {TESTED_HUMMING_VERSION})"
    return True, f"humming-kernels {version} on {arch}{extra}"


def _import_humming():
    """Configure the JIT cache, then import the humming entry points we call."""
    from vllm_ling.ops.humming_cache import configure_humming_cache

    configure_humming_cache()
    try:
        from humming.forward import humming_forward, may_process_input
        from humming.schema import HummingInputSchema, HummingWeightSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise HummingUnavailableError(f"cannot import humming-kernels: {exc}") from exc
    return dict(humming_forward=humming_forward, may_process_input=may_process_input,
                HummingInputSchema=HummingInputSchema, HummingWeightSchema=HummingWeightSchema,
                prepare=prepare_and_transform_humming_tensors,
                get_heuristics_config=get_heuristics_config)


def swiglu_activation_expr(limit: float | None, clamp: str = ROUTED_EXPERT_CLAMP) -> str:
    """C++ expression of floats ``a`` (gate) and ``b`` (up) for humming's ``binary_split``
    input processing: the clamp is done inside humming's activation kernel, no extra pass."""
    limit = _effective_limit(limit)
    if limit is None:
        return "(a / (1.f + expf(-a))) * b"
    lim = f"({limit!r}f)"
    up = f"fmaxf(fminf(b, {lim}), -{lim})"
    if clamp == CLAMP_GATE_INPUT:
        return f"(fminf(a, {lim}) / (1.f + expf(-fminf(a, {lim})))) * {up}"
    if clamp == CLAMP_GATE_OUTPUT:
        return f"fminf(a / (1.f + expf(-a)), {lim}) * {up}"
    raise ValueError(f"clamp must be one of {_CLAMP_MODES}, got {clamp!r}")


def _interval_config(intervals, shape_m: int) -> dict:
    for lower, upper, config in intervals:
        if lower < shape_m <= upper:
            return config
    raise RuntimeError(f"humming has no tuning interval for shape_m={shape_m}")


class HummingMxfp4Experts:
    """Routed MXFP4 experts through humming's indexed MoE GEMM (W4A16, or W4A8 on sm_89+).

    Built once from vLLM-layout tensors (which it transforms; drop the originals after; the
    transformed tensors are in ``self.tensors["w13" | "w2"]``).
    ``forward(x, topk_weights, topk_ids, swiglu_limit)`` returns the weighted routed sum
    [T, H] in BF16 (routed_scaling_factor is expected inside ``topk_weights``, as vLLM's
    router puts it). Per call, five launches: routing metadata (one Triton kernel for
    T * top_k <= 128, else PyTorch), gate_up GEMM indexed by top-k, SwiGLU (+clamp, +FP8
    quantization for W4A8) in humming's input kernel, down GEMM, weighted top-k sum (one
    Triton kernel, fp32 weights). The steps are public methods (``routing_metadata``,
    ``gate_up``, ``activation``, ``down``, ``weighted_sum``) so they can be timed alone.
    No host synchronisation: the forward can be captured in a CUDA graph (tested).

    Decode-sized batches (``T <= decode_max_tokens``, given ``top_k``) go instead through two
    fused kernels (:mod:`vllm_ling.ops.moe_decode`): with ``decode="auto"`` they read these
    same transformed tensors (no copy; sm_90+, W4A16; where they cannot run the reason is
    logged once at WARNING and kept in ``decode_status``), with ``"copy"`` a second
    GEMV-packed copy of the experts (faster, twice the expert memory), ``"off"`` never.

    Tuning: for each batch size the entry of humming's heuristic intervals that contains
    ``shape_m = T * top_k`` is compiled alone (not the whole interval list, which would
    compile every interval's kernel on first use). ``tuning_overrides`` ({"w13": {...},
    "w2": {...}}) patches those entries (benchmark levers).
    """

    def __init__(
        self,
        w13_weight: torch.Tensor,
        w13_weight_scale: torch.Tensor,
        w2_weight: torch.Tensor,
        w2_weight_scale: torch.Tensor,
        *,
        w4a8: bool = False,
        clamp: str = ROUTED_EXPERT_CLAMP,
        routing_impl: str = "auto",
        reduce_impl: str = "auto",
        tuning_overrides: dict[str, dict] | None = None,
        param_dtype: torch.dtype = torch.bfloat16,
        top_k: int | None = None,
        decode: str = DECODE_AUTO,
        decode_max_tokens: int = DEFAULT_DECODE_MAX_TOKENS,
    ):
        if param_dtype != torch.bfloat16:
            raise ValueError("the humming Ling MoE path supports BF16 activations only")
        if clamp not in _CLAMP_MODES:
            raise ValueError(f"clamp must be one of {_CLAMP_MODES}, got {clamp!r}")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        if decode != DECODE_OFF and top_k and decode_max_tokens * top_k > 65535:
            raise ValueError(f"decode_max_tokens {decode_max_tokens} x top_k {top_k} exceeds the decode kernels' "
                             "65535 grid rows (one per token and slot)")
        for label, impl in (("routing_impl", routing_impl), ("reduce_impl", reduce_impl)):
            if impl not in ("auto", "torch", "triton"):
                raise ValueError(f"{label} must be auto, torch or triton, got {impl!r}")
        device = w13_weight.device
        ok, reason = humming_status(w4a8=w4a8, device=device if device.type == "cuda" else None)
        if not ok:
            raise HummingUnavailableError(reason)
        if device.type != "cuda":
            raise HummingUnavailableError(f"expert weights must be on a CUDA device, got {device}")
        for name, t in (("w13_weight", w13_weight), ("w13_weight_scale", w13_weight_scale),
                        ("w2_weight", w2_weight), ("w2_weight_scale", w2_weight_scale)):
            if t.dtype not in (torch.uint8, torch.float8_e8m0fnu) or t.dim() != 3:
                raise ValueError(f"{name} must be a 3-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        E, two_i, half_h = w13_weight.shape
        H, I = half_h * 2, two_i // 2
        if tuple(w2_weight.shape) != (E, H, I // 2):
            raise ValueError(f"w2_weight must be [E, H, I/2] = {(E, H, I // 2)}, got {tuple(w2_weight.shape)}")
        if tuple(w13_weight_scale.shape) != (E, two_i, H // MXFP4_GROUP_SIZE):
            raise ValueError(f"w13_weight_scale shape {tuple(w13_weight_scale.shape)} != {(E, two_i, H // 32)}")
        if tuple(w2_weight_scale.shape) != (E, H, I // MXFP4_GROUP_SIZE):
            raise ValueError(f"w2_weight_scale shape {tuple(w2_weight_scale.shape)} != {(E, H, I // 32)}")

        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.w4a8 = w4a8
        self.clamp = clamp
        self.routing_impl = routing_impl
        self.reduce_impl = reduce_impl
        self.device = device
        self.tuning_overrides = tuning_overrides or {}
        hm = _import_humming()
        self.decoder = None
        self.decode_max_tokens = decode_max_tokens
        if decode == DECODE_COPY:  # needs the checkpoint-layout tensors, before humming's transform
            self.decoder = self._packed_decoder(w13_weight, w13_weight_scale, w2_weight,
                                                w2_weight_scale, top_k)
        self._forward_fn = hm["humming_forward"]
        self._process_fn = hm["may_process_input"]
        weight_schema = hm["HummingWeightSchema"](
            b_dtype="float4e2m1", bs_dtype="float8e8m0", weight_scale_group_size=MXFP4_GROUP_SIZE)
        if w4a8:
            input_schema = hm["HummingInputSchema"](a_dtype="float8e4m3",
                                                     input_quant_mode="dynamic_token")
        else:
            input_schema = hm["HummingInputSchema"]()
        self.configs = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        for sub, w, s, n, k in (("w13", w13_weight, w13_weight_scale, two_i, H),
                                ("w2", w2_weight, w2_weight_scale, H, I)):
            src = {"weight": w.contiguous().view(torch.uint8).view(torch.int32),
                   "weight_scale": s.contiguous().view(torch.uint8).view(torch.float8_e8m0fnu)}
            cfg, out = hm["prepare"](src, shape_n=n, shape_k=k, weight_schema=weight_schema,
                                     input_schema=input_schema, num_experts=E,
                                     pad_n_to_multiple=256, pad_k_to_multiple=128,
                                     torch_dtype=torch.bfloat16, device=device)
            self.configs[sub] = cfg
            self.tensors[sub] = out
        self.compute_config = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                                          "gemm_type": "indexed"})
        self.intervals = {
            sub: hm["get_heuristics_config"](self.configs[sub], use_f16_accum=False,
                                             use_batch_invariant=False, gemm_type="indexed",
                                             device=device)
            for sub in ("w13", "w2")}
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # humming's stream-K / split reduction workspace, sized as vLLM does.
        self.locks = torch.zeros(num_sms * 8, dtype=torch.int32, device=device)
        self._plans: dict[int, dict] = {}
        self._compiled: set[tuple] = set()
        log_once(logger, logging.INFO, f"humming-moe-{w4a8}",
                 "Humming MXFP4 MoE: %d experts, hidden %d, intermediate %d, %s, indexed GEMM",
                 E, H, I, "W4A8 (FP8 e4m3 per-token activations)" if w4a8 else "W4A16 (BF16 activations)")
        if decode == DECODE_AUTO:
            self.decoder = self._humming_layout_decoder(top_k)
        if decode == DECODE_OFF:
            self.decode_status = "off (VLLM_LING_MOE_DECODE=off): humming's GEMM at every batch size"
        elif self.decoder is not None:
            self.decode_status = (f"{'packed copy' if decode == DECODE_COPY else 'humming layout'}, "
                                  f"<= {decode_max_tokens} tokens")

    # -- decode kernels ---------------------------------------------------------------------
    def _humming_layout_decoder(self, top_k: int | None):
        """Fused decode kernels on humming's tensors, or None (logged once with the reason)."""
        from vllm_ling.ops import moe_decode

        if top_k is None:
            self.decode_status = "off: top_k not given"
            return None
        ok, reason = moe_decode.humming_decode_support(self, top_k)
        if not ok:
            self.decode_status = f"unavailable: {reason}"
            log_once(logger, logging.WARNING, f"moe-decode-off-{reason}",
                     "MoE decode kernels unavailable (%s): batches <= %d tokens run humming's "
                     "indexed GEMM, 1.4-1.8x slower per layer at 1-4 tokens on an H200.",
                     reason, self.decode_max_tokens)
            return None
        decoder = moe_decode.HummingLayoutDecode(self, top_k)
        log_once(logger, logging.INFO, "moe-decode-humming",
                 "MoE decode kernels: batches <= %d tokens run two fused kernels on humming's "
                 "weights (gate_up+SwiGLU, down+top-k sum).", self.decode_max_tokens)
        return decoder

    def _packed_decoder(self, w13, s13, w2, s2, top_k: int | None):
        """The ``copy`` mode: a second, GEMV-packed copy of the experts (explicitly requested,
        so failures raise)."""
        from vllm_ling.ops import moe_decode

        if top_k is None:
            raise ValueError("decode='copy' needs top_k")
        decoder = moe_decode.PackedLayoutDecode(w13, s13, w2, s2, top_k=top_k, clamp=self.clamp)
        log_once(logger, logging.INFO, "moe-decode-copy",
                 "MoE decode kernels on a packed copy of the experts (VLLM_LING_MOE_DECODE=copy): "
                 "+%.1f MB per layer on top of humming's copy, batches <= %d tokens.",
                 decoder.nbytes / 1e6, self.decode_max_tokens)
        return decoder

    # -- tuning -------------------------------------------------------------------------
    def set_tuning_overrides(self, overrides: dict[str, dict] | None) -> None:
        """Replace the per-GEMM patches of humming's heuristic entries (new kernels are
        compiled on next use)."""
        self.tuning_overrides = overrides or {}
        self._plans.clear()
        self._compiled.clear()

    def plan(self, num_assignments: int) -> dict:
        """Tuning entries (and their JSON) for shape_m = T * top_k."""
        plan = self._plans.get(num_assignments)
        if plan is None:
            plan = {}
            for sub in ("w13", "w2"):
                cfg = dict(_interval_config(self.intervals[sub], num_assignments))
                cfg.update(self.tuning_overrides.get(sub, {}))
                plan[sub] = cfg
                plan[sub + "_json"] = json.dumps(cfg, sort_keys=True)
                plan[sub + "_block"] = int(cfg["block_shape"][0])
            self._plans[num_assignments] = plan
        return plan

    # -- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"hidden states must be bfloat16, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        T, top_k = topk_ids.shape
        if self.decoder is not None and 0 < T <= self.decode_max_tokens and top_k == self.decoder.top_k:
            return self.decoder(x, topk_weights, topk_ids, swiglu_limit)
        plan = self.plan(T * top_k)
        key = (T * top_k, _effective_limit(swiglu_limit))
        if key in self._compiled:
            return self._forward(x, topk_weights, topk_ids, swiglu_limit, plan)
        # First use of this shape/limit may JIT-compile: serialise with other processes
        # sharing the cache so only one of them compiles each kernel.
        from vllm_ling.ops.humming_cache import compile_lock

        with compile_lock():
            out = self._forward(x, topk_weights, topk_ids, swiglu_limit, plan)
        self._compiled.add(key)
        return out

    __call__ = forward

    def _forward(self, x, topk_weights, topk_ids, swiglu_limit, plan) -> torch.Tensor:
        T, top_k = topk_ids.shape
        align13, align2 = self.routing_metadata(topk_ids, plan)
        gate_up = self.gate_up(x.contiguous(), align13, plan, top_k)
        act, s2, s2_2 = self.activation(gate_up, swiglu_limit)
        down = self.down(act, s2, s2_2, align2, plan)
        return self.weighted_sum(down, topk_weights)

    # The steps of one forward, public so benchmarks can time them one by one.
    def routing_metadata(self, topk_ids, plan):
        align13 = moe_align_block_size(topk_ids, plan["w13_block"], self.num_experts, self.routing_impl)
        if plan["w2_block"] == plan["w13_block"]:
            return align13, align13
        return align13, moe_align_block_size(topk_ids, plan["w2_block"], self.num_experts,
                                             self.routing_impl)

    def gate_up(self, x, align, plan, top_k):
        cfg, w = self.configs["w13"], self.tensors["w13"]
        n = x.shape[0] * top_k
        a, s, s_2 = self._quantize_input(cfg, x)
        out = torch.empty(n, 2 * self.intermediate_size, dtype=torch.bfloat16, device=x.device)
        self._forward_fn(cfg, inputs=a, weight=w["weight"], weight_scale=w["weight_scale"],
                         weight_scale_2=w.get("weight_scale_2"), input_scale=s, input_scale_2=s_2,
                         outputs=out, sorted_ids=align[0], expert_ids=align[1],
                         num_tokens_padded=align[2], locks=self.locks, top_k=top_k,
                         valid_shape_m=n, compute_config=self.compute_config,
                         tuning_config=plan["w13_json"])
        return out

    def activation(self, gate_up, swiglu_limit):
        """SwiGLU (+clamp) in humming's input kernel; for W4A8 it also quantizes to FP8."""
        mode = self.configs["w2"].input_quant_mode
        act, group_scales, token_scales = self._process_fn(
            self.configs["w2"], inputs=gate_up, activation_type="binary_split",
            activation_impl=swiglu_activation_expr(swiglu_limit, self.clamp))
        s = group_scales if mode.has_group_scale else token_scales
        s_2 = token_scales if mode.has_secondary_scale else None
        return act, s, s_2

    def down(self, act, s, s_2, align, plan):
        cfg, w = self.configs["w2"], self.tensors["w2"]
        n = act.shape[0]
        out = torch.empty(n, self.hidden_size, dtype=torch.bfloat16, device=act.device)
        self._forward_fn(cfg, inputs=act, weight=w["weight"], weight_scale=w["weight_scale"],
                         weight_scale_2=w.get("weight_scale_2"), input_scale=s, input_scale_2=s_2,
                         outputs=out, sorted_ids=align[0], expert_ids=align[1],
                         num_tokens_padded=align[2], locks=self.locks, top_k=1, valid_shape_m=n,
                         compute_config=self.compute_config, tuning_config=plan["w2_json"])
        return out

    def weighted_sum(self, down, topk_weights):
        return weighted_topk_sum(down, topk_weights, self.reduce_impl)

    def _quantize_input(self, cfg, x):
        mode = cfg.input_quant_mode
        if not mode.should_quantize:
            return x, None, None
        q, group_scales, token_scales = self._process_fn(cfg, inputs=x)
        scale = group_scales if mode.has_group_scale else token_scales
        scale_2 = token_scales if mode.has_secondary_scale else None
        return q, scale, scale_2


# --------------------------------------------------------------------------------------
# Warm-up (used by ``vllm-ling warmup``)
# --------------------------------------------------------------------------------------

def random_mxfp4_experts(num_experts: int, hidden_size: int, intermediate_size: int,
                         device: torch.device | str = "cuda", seed: int = 0,
                         scale_exponents: tuple[int, int] = (118, 122)) -> dict[str, torch.Tensor]:
    """Random MXFP4 expert tensors in vLLM's layout (uint8 codes and E8M0 scales).

    Scales 2**(e-127) with e in ``scale_exponents`` keep activations O(1) at Ling sizes.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, I = num_experts, hidden_size, intermediate_size

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)

    def scales(*shape):
        lo, hi = scale_exponents
        return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, device=device, generator=g)

    return {"w13_weight": codes(E, 2 * I, H // 2), "w13_weight_scale": scales(E, 2 * I, H // 32),
            "w2_weight": codes(E, H, I // 2), "w2_weight_scale": scales(E, H, I // 32)}


def warmup_kernels(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                   token_counts=(1, 2, 4, 8, 16), w4a8: bool = False,
                   swiglu_limits=(None,), clamp: str = ROUTED_EXPERT_CLAMP,
                   decode: str = DECODE_AUTO, decode_max_tokens: int = DEFAULT_DECODE_MAX_TOKENS,
                   device: int | torch.device | None = None) -> dict:
    """Compile (into the shared JIT cache) every humming kernel the MoE layer needs for
    these batch sizes and clamp limits, by running the layer once on random weights.

    Returns counts and timings: ``kernels_before`` / ``kernels_after`` (cubins in the
    cache), ``new_kernels``, ``seconds`` (total), ``build_seconds`` (weight transform),
    ``per_call_seconds`` {"tokens=T,limit=L": s}, ``cache_dir``.
    """
    from vllm_ling.ops.humming_cache import configure_humming_cache, count_cached_kernels

    ok, reason = humming_status(w4a8=w4a8)
    if not ok:
        raise HummingUnavailableError(reason)
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    kernels_dir = configure_humming_cache()
    before = count_cached_kernels(kernels_dir)
    t0 = time.perf_counter()
    tensors = random_mxfp4_experts(num_experts, hidden_size, intermediate_size, dev)
    experts = HummingMxfp4Experts(**tensors, w4a8=w4a8, clamp=clamp, top_k=top_k, decode=decode,
                                  decode_max_tokens=decode_max_tokens)  # as the server builds it
    del tensors
    build_s = time.perf_counter() - t0
    per_call = {}
    g = torch.Generator(device=dev).manual_seed(1)
    for limit in swiglu_limits:
        for t in token_counts:
            x = torch.randn(t, hidden_size, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.stack([torch.randperm(num_experts, device=dev, generator=g)[:top_k]
                               for _ in range(t)]).to(torch.int32)
            w = torch.full((t, top_k), 1.0 / top_k, device=dev)
            t1 = time.perf_counter()
            experts(x, w, ids, limit)
            torch.cuda.synchronize(dev)
            per_call[f"tokens={t},limit={limit}"] = time.perf_counter() - t1
    after = count_cached_kernels(kernels_dir)
    return {"cache_dir": str(kernels_dir), "kernels_before": before, "kernels_after": after,
            "new_kernels": after - before, "seconds": time.perf_counter() - t0,
            "build_seconds": build_s, "per_call_seconds": per_call, "w4a8": w4a8}
