"""Triton stand-ins for the vLLM kernels one decode step of ``benchmarks/decode_step.py`` needs
and this repo has no serving kernel for (benchmarks only; never imported by ``vllm_ling``).

The H200 where the decode step is measured has no vLLM, and plain PyTorch op chains for these
ops charge both compositions launches and passes vLLM does not pay. Each stand-in computes what
the named vLLM kernel computes (same inputs, same math, tests against a plain-PyTorch reference
in ``tests/benchmarks/test_decode_standins.py``) in at most as many launches:

- ``grouped_topk``: Ling's expert selection from the gate's fp32 logits (the gate GEMV itself is
  each composition's own: ``vllm_ling.ops.small_gemv.router`` or vLLM's cast + cuBLAS). vLLM: one fused
  ``grouped_topk`` kernel; here one launch, a program per token: sigmoid scores, expert bias for
  selection only, each group scored by the sum of its top-2 biased scores, the ``topk_group``
  best groups kept, the top-k biased scores inside them, weights = unbiased scores renormalised
  times ``routed_scaling_factor``. Ties break towards the lower index.
- ``fused_add_rms_norm``: vLLM's ``fused_add_rms_norm`` (``residual += x``; RMSNorm), with an
  optional second addend so the MoE layer's ``routed + shared`` sum costs no launch of its own.
- ``swiglu_act``: vLLM's ``SiluAndMul`` / ``SwigluStepAndMul`` with the per-layer limit, in both
  clamp modes of ``vllm_ling.ops.moe.activation``.
- ``conv4_silu_update``: vLLM's ``causal_conv1d_update`` (window 4, SiLU, no bias), which vLLM's
  Ling KDA layer calls three times (q, k, v); here one launch over the merged channels that
  writes q, k and v as separate contiguous tensors.
- ``gated_rms_norm``: vLLM's ``FusedRMSNormGated`` (fla ``layernorm_gated``), sigmoid gate:
  ``rmsnorm(o) * weight * sigmoid(g)`` per head; g may be row-strided (a column slice of a merged
  projection), as vLLM's kernel allows.
- MLA decode over the BF16 latent cache (vLLM's TRITON_MLA backend, ``triton_decode_attention``;
  on sm_90 vLLM prefers FlashMLA, same data movement): ``mla_prepare`` (kv_a RMSNorm,
  interleaved RoPE of k_pe and q_pe from a cos/sin table, latent-cache write of the new rows;
  vLLM: RMSNorm + rotary + ``concat_and_cache_mla``), ``mla_decode`` = a split-K pass (each cache
  row read once per block of query rows, online softmax with a running max, partial outputs +
  log-sum-exp per split) and a combine pass that merges the splits and applies W_UV and the
  head-wise sigmoid output gate (partials in fp32; launch settings from an H200 sweep,
  ``benchmarks/standins_timing.py``). Query token t of a T-token verify window attends to the
  ``pos + t + 1`` rows up to and including its own (causal, as vLLM's spec-decode metadata does).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_ling.ops.moe.activation import SHARED_EXPERT_CLAMP, SwigluClamp, check_clamp, effective_limit

# --------------------------------------------------------------------------------------
# Router: grouped top-k of the gate's fp32 logits
# --------------------------------------------------------------------------------------


@triton.jit
def _grouped_topk_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, scaling, t0, T,
                       TOK: tl.constexpr, E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr):
    """Grouped top-k of tokens [t0, t0 + TOK) (all in parallel, one row each)."""
    toks = t0 + tl.arange(0, TOK)
    tmask = toks < T
    offs = tl.arange(0, E)
    # .cg: read from L2 (the logits are the previous kernel's output)
    logits = tl.load(logits_ptr + toks[:, None] * E + offs[None, :], mask=tmask[:, None], other=0.0,
                     cache_modifier=".cg")
    score = tl.sigmoid(logits)
    choice = score + tl.load(bias_ptr + offs).to(tl.float32)[None, :]
    per: tl.constexpr = E // G
    c3 = tl.reshape(choice, (TOK, G, per))
    col = tl.arange(0, per)
    first = tl.argmax(c3, axis=2)
    top1 = tl.max(c3, axis=2)
    top2 = tl.max(tl.where(col[None, None, :] == first[:, :, None], float("-inf"), c3), axis=2)
    group_score = top1 + top2  # [TOK, G]
    g_idx = tl.arange(0, G)
    keep = tl.zeros((TOK, G), dtype=tl.int32) > 0
    for _ in tl.static_range(TG):
        best = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=1)
        keep = keep | (g_idx[None, :] == best[:, None])
    keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], (TOK, G, per)), (TOK, E))
    masked = tl.where(keep_e, choice, float("-inf"))
    k_idx = tl.arange(0, K)
    ids = tl.zeros((TOK, K), dtype=tl.int32)
    wts = tl.zeros((TOK, K), dtype=tl.float32)
    for i in tl.static_range(K):
        e = tl.argmax(masked, axis=1)
        hit = offs[None, :] == e[:, None]
        s = tl.sum(tl.where(hit, score, 0.0), axis=1)
        ids = tl.where(k_idx[None, :] == i, e[:, None], ids)
        wts = tl.where(k_idx[None, :] == i, s[:, None], wts)
        masked = tl.where(hit, float("-inf"), masked)
    wts = wts / tl.sum(wts, axis=1)[:, None] * scaling
    out = toks[:, None] * K + k_idx[None, :]
    tl.store(ids_ptr + out, ids, mask=tmask[:, None])
    tl.store(w_ptr + out, wts, mask=tmask[:, None])


@triton.jit
def _grouped_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, scaling, T,
                         E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr, TOK: tl.constexpr):
    _grouped_topk_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, scaling, tl.program_id(0) * TOK, T, TOK, E, G, TG, K)


def grouped_topk(logits: torch.Tensor, expert_bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
                 routed_scaling_factor: float, num_warps: int = 1):
    """(weights fp32 [T, k], ids int32 [T, k]) from fp32 router logits [T, E]: one launch, a
    program per token (vLLM: the fused grouped_topk kernel after the gate GEMM)."""
    T, E = logits.shape
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    _grouped_topk_kernel[(T,)](logits, expert_bias, w, ids, float(routed_scaling_factor), T, E=E, G=n_group,
                               TG=topk_group, K=top_k, TOK=1, num_warps=num_warps)
    return w, ids


# --------------------------------------------------------------------------------------
# Residual add (+ optional second addend) + RMSNorm; SwiGLU
# --------------------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(x_ptr, x2_ptr, res_ptr, w_ptr, out_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_X2: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    s = (tl.load(x_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32))
    if HAS_X2:
        s += tl.load(x2_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    s = s.to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + t * H + offs, s, mask=mask)
    s = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       x2: torch.Tensor | None = None) -> torch.Tensor:
    """``residual += x (+ x2)`` (in place, summed in fp32, rounded once) and return
    ``RMSNorm(residual) * weight``; contiguous [T, H]."""
    T, H = residual.shape
    out = torch.empty_like(residual)
    x = x.contiguous()
    _add_rms_norm_kernel[(T,)](x, x if x2 is None else x2.contiguous(), residual, weight, out, eps, H=H,
                               BLOCK=triton.next_power_of_2(H), HAS_X2=x2 is not None, num_warps=8)
    return out


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, D, limit, BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr,
                   CLAMP_OUTPUT: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(x_ptr + t * 2 * D + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * 2 * D + D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        if CLAMP_OUTPUT:
            a = tl.minimum(g * tl.sigmoid(g), limit)
        else:
            g = tl.minimum(g, limit)
            a = g * tl.sigmoid(g)
    else:
        a = g * tl.sigmoid(g)
    tl.store(out_ptr + t * D + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_act(x: torch.Tensor, limit: float | None = None,
               clamp: SwigluClamp | str = SHARED_EXPERT_CLAMP) -> torch.Tensor:
    """``vllm_ling.ops.moe.activation.swiglu`` on contiguous [T, 2d] in one launch (fp32 math,
    one rounding to x's dtype)."""
    clamp = check_clamp(clamp)
    lim = effective_limit(limit)
    T, two_d = x.shape
    d = two_d // 2
    out = torch.empty((T, d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _swiglu_kernel[(T, triton.cdiv(d, block))](x.contiguous(), out, d, 0.0 if lim is None else lim, BLOCK=block,
                                               HAS_LIMIT=lim is not None, CLAMP_OUTPUT=clamp is SwigluClamp.GATE_OUTPUT,
                                               num_warps=4)
    return out


# --------------------------------------------------------------------------------------
# KDA: short causal conv (window 4) + SiLU + conv-state update; gated RMSNorm
# --------------------------------------------------------------------------------------


@triton.jit
def _conv4_silu_kernel(x_ptr, s_x, state_ptr, w_ptr, out_ptr, T, C, SPLIT, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    # the window's three older inputs (BF16 values, kept exact in fp32) and the four taps
    s0 = tl.load(state_ptr + c * 3, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(state_ptr + c * 3 + 1, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(state_ptr + c * 3 + 2, mask=m, other=0.0).to(tl.float32)
    w0 = tl.load(w_ptr + c * 4, mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * 4 + 1, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * 4 + 2, mask=m, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * 4 + 3, mask=m, other=0.0).to(tl.float32)
    part = c // SPLIT
    col = c % SPLIT
    for t in range(T):
        xt = tl.load(x_ptr + t * s_x + c, mask=m, other=0.0).to(tl.float32)
        y = w0 * s0 + w1 * s1 + w2 * s2 + w3 * xt
        y = y * tl.sigmoid(y)
        tl.store(out_ptr + (part * T + t) * SPLIT + col, y.to(out_ptr.dtype.element_ty), mask=m)
        s0 = s1
        s1 = s2
        s2 = xt
    tl.store(state_ptr + c * 3, s0.to(state_ptr.dtype.element_ty), mask=m)
    tl.store(state_ptr + c * 3 + 1, s1.to(state_ptr.dtype.element_ty), mask=m)
    tl.store(state_ptr + c * 3 + 2, s2.to(state_ptr.dtype.element_ty), mask=m)


def conv4_silu_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, split: int) -> torch.Tensor:
    """Causal depthwise conv of window 4 + SiLU over T new tokens x [T, C], continuing from
    ``conv_state`` [C, 3] (the last three inputs, oldest first; updated in place), taps
    ``weight`` [C, 4] (the last tap multiplies the newest input). Returns [C // split, T, split]:
    channels cut into ``split``-wide parts (q, k, v), each a contiguous [T, split]."""
    T, C = x.shape
    if weight.shape != (C, 4) or conv_state.shape != (C, 3) or C % split:
        raise ValueError(f"conv4_silu_update: weight {tuple(weight.shape)}, state {tuple(conv_state.shape)}, "
                         f"x {tuple(x.shape)}, split {split} do not fit a window-4 conv")
    if not (conv_state.is_contiguous() and weight.is_contiguous() and x.stride(1) == 1):
        raise ValueError("conv4_silu_update wants contiguous state/weight and x with unit last stride")
    out = torch.empty((C // split, T, split), dtype=x.dtype, device=x.device)
    block = 512
    _conv4_silu_kernel[(triton.cdiv(C, block),)](x, x.stride(0), conv_state, weight, out, T, C, split,
                                                 BLOCK_C=block, num_warps=4)
    return out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, R, eps, heads, g_row_stride, D: tl.constexpr,
                           BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    m = (rows < R)[:, None]
    idx = rows[:, None] * D + d[None, :]
    g_idx = (rows // heads)[:, None] * g_row_stride + (rows % heads)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + g_idx, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    y = x * inv[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``RMSNorm(x) * weight * sigmoid(gate)`` over the last ``D = weight.numel()`` elements of
    each head; x contiguous with T * heads * D elements, gate [T, heads * D] with unit last stride
    and any row stride (a column slice of a merged projection, as vLLM's FusedRMSNormGated reads
    it). Returns [T, heads * D] in x's dtype."""
    D = weight.numel()
    if gate.dim() != 2 or x.numel() != gate.numel() or gate.shape[1] % D or not x.is_contiguous() \
            or gate.stride(1) != 1:
        raise ValueError("gated_rms_norm wants contiguous x and a [T, heads * D] gate of the same size with unit "
                         "last stride")
    R = x.numel() // D
    out = torch.empty((gate.shape[0], gate.shape[1]), dtype=x.dtype, device=x.device)
    block_r = 16
    _gated_rms_norm_kernel[(triton.cdiv(R, block_r),)](x, gate, weight, out, R, eps, gate.shape[1] // D,
                                                       gate.stride(0), D=D, BLOCK_R=block_r, num_warps=4)
    return out


# --------------------------------------------------------------------------------------
# MLA decode over the BF16 latent cache
# --------------------------------------------------------------------------------------

# Triton's interpreter (the CPU tests) multiplies BF16 tl.dot operands as raw integers; there
# the MLA kernels multiply in fp32 instead (the GPU path is unchanged).
_UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


def rope_table(theta: float, rope_dim: int, positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, rope_dim // 2] fp32, as vLLM's rotary cache computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32, device=device), inv_freq)
    return freqs.cos().contiguous(), freqs.sin().contiguous()


@triton.jit
def _mla_prepare_kernel(q_ptr, s_q_t, s_q_h, kv_ptr, s_kv, norm_w_ptr, cache_ptr, s_c, cos_ptr, sin_ptr, pos, eps,
                        HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
                        PE_OFF: tl.constexpr):
    t = tl.program_id(0)
    p = pos + t
    dl = tl.arange(0, LORA)
    c = tl.load(kv_ptr + t * s_kv + dl).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / LORA + eps)
    c = c * inv * tl.load(norm_w_ptr + dl).to(tl.float32)
    tl.store(cache_ptr + p * s_c + dl, c.to(cache_ptr.dtype.element_ty))
    half = tl.arange(0, ROPE // 2)
    cs = tl.load(cos_ptr + p * (ROPE // 2) + half)
    sn = tl.load(sin_ptr + p * (ROPE // 2) + half)
    # interleaved (GPT-J) RoPE: pairs (x[2i], x[2i+1]) rotated by angle i
    ke = tl.load(kv_ptr + t * s_kv + LORA + 2 * half).to(tl.float32)
    ko = tl.load(kv_ptr + t * s_kv + LORA + 2 * half + 1).to(tl.float32)
    tl.store(cache_ptr + p * s_c + LORA + 2 * half, (ke * cs - ko * sn).to(cache_ptr.dtype.element_ty))
    tl.store(cache_ptr + p * s_c + LORA + 2 * half + 1, (ko * cs + ke * sn).to(cache_ptr.dtype.element_ty))
    hh = tl.arange(0, HEADS_PAD)
    hm = (hh < HEADS)[:, None]
    qb = q_ptr + t * s_q_t + hh[:, None] * s_q_h + PE_OFF + 2 * half[None, :]
    qe = tl.load(qb, mask=hm, other=0.0).to(tl.float32)
    qo = tl.load(qb + 1, mask=hm, other=0.0).to(tl.float32)
    tl.store(qb, (qe * cs[None, :] - qo * sn[None, :]).to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(qb + 1, (qo * cs[None, :] + qe * sn[None, :]).to(q_ptr.dtype.element_ty), mask=hm)


def mla_prepare(q: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, cache: torch.Tensor, pos: int,
                cos: torch.Tensor, sin: torch.Tensor, *, nope: int, eps: float = 1e-6) -> None:
    """For the T new tokens at positions pos..pos+T-1: cache rows ``[RMSNorm(c_kv) * w, RoPE(k_pe)]``
    from kv_a's output ``kv`` [T, lora + rope]; RoPE of the rope part of q [T, heads, nope + rope]
    in place. cos/sin from :func:`rope_table`."""
    T, heads, qd = q.shape
    lora = norm_weight.numel()
    rope = qd - nope
    if kv.shape != (T, lora + rope) or cache.shape[1] != lora + rope or q.stride(2) != 1 or kv.stride(1) != 1:
        raise ValueError("mla_prepare: q, kv and cache shapes do not match")
    _mla_prepare_kernel[(T,)](q, q.stride(0), q.stride(1), kv, kv.stride(0), norm_weight, cache, cache.stride(0),
                              cos, sin, pos, eps, HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), LORA=lora,
                              ROPE=rope, PE_OFF=nope, num_warps=4)


@triton.jit
def _mla_split_kernel(qlat_ptr, s_l_h, s_l_t, q_ptr, s_q_t, s_q_h, cache_ptr, s_c, part_ptr, lse_ptr,
                      pos, N, R, chunk, scale_log2,
                      HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, PE_OFF: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    # row blocks of one split are neighbours in the launch order, so they run together and
    # the second one finds the split's cache rows in L2
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # row = token * HEADS + head
    rmask = rows < R
    t = rows // HEADS
    h = rows % HEADS
    dl = tl.arange(0, LORA)
    dr = tl.arange(0, ROPE)
    qn = tl.load(qlat_ptr + h[:, None] * s_l_h + t[:, None] * s_l_t + dl[None, :], mask=rmask[:, None], other=0.0)
    qp = tl.load(q_ptr + t[:, None] * s_q_t + h[:, None] * s_q_h + PE_OFF + dr[None, :], mask=rmask[:, None],
                 other=0.0)
    kv_len = pos + t + 1  # causal: token t sees the rows up to its own
    start = split * chunk
    end = tl.minimum(start + chunk, N)
    m = tl.full((BLOCK_M,), -1e30, tl.float32)
    l_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, LORA), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < end
        kc = tl.load(cache_ptr + cols[:, None] * s_c + dl[None, :], mask=cmask[:, None], other=0.0)
        kp = tl.load(cache_ptr + cols[:, None] * s_c + LORA + dr[None, :], mask=cmask[:, None], other=0.0)
        sc = (_dot(qn, tl.trans(kc), UPCAST) + _dot(qp, tl.trans(kp), UPCAST)) * scale_log2
        sc = tl.where(cmask[None, :] & (cols[None, :] < kv_len[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(kc.dtype), kc, UPCAST)  # the same tile is V: one read
        m = m_new
    seen = l_sum > 0
    l_safe = tl.where(seen, l_sum, 1.0)
    # partials [R, splits, LORA] and log2-sum-exp [R, splits]: a row's splits are contiguous
    tl.store(part_ptr + (rows * n_splits + split)[:, None] * LORA + dl[None, :], acc / l_safe[:, None],
             mask=rmask[:, None])
    tl.store(lse_ptr + rows * n_splits + split, tl.where(seen, m + tl.log2(l_safe), float("-inf")), mask=rmask)


@triton.jit
def _mla_combine_uv_kernel(part_ptr, lse_ptr, gate_ptr, s_g_t, wuvt_ptr, out_ptr, n_splits,
                           HEADS: tl.constexpr, LORA: tl.constexpr, VD: tl.constexpr, S_BLOCK: tl.constexpr,
                           V_PART: tl.constexpr, V_BLOCK: tl.constexpr, HAS_GATE: tl.constexpr):
    """One program per (query row, VD / V_PART columns): merge the row's splits by their
    log-sum-exp weights (all splits of a block at once), round the latent to BF16 as the
    unfused path does, then W_UV's columns and the sigmoid gate."""
    r = tl.program_id(0)
    t = r // HEADS
    h = r % HEADS
    ss = tl.arange(0, S_BLOCK)
    m = tl.full((S_BLOCK,), -1e30, tl.float32)
    for s0 in range(0, n_splits, S_BLOCK):
        m = tl.maximum(m, tl.load(lse_ptr + r * n_splits + s0 + ss, mask=s0 + ss < n_splits, other=float("-inf")))
    m_all = tl.max(m, axis=0)
    dl = tl.arange(0, LORA)
    lat = tl.zeros((LORA,), tl.float32)
    total = tl.zeros((S_BLOCK,), tl.float32)
    for s0 in range(0, n_splits, S_BLOCK):
        smask = s0 + ss < n_splits
        wgt = tl.exp2(tl.load(lse_ptr + r * n_splits + s0 + ss, mask=smask, other=float("-inf")) - m_all)
        total += wgt
        o = tl.load(part_ptr + (r * n_splits + s0 + ss)[:, None] * LORA + dl[None, :], mask=smask[:, None],
                    other=0.0)
        lat += tl.sum(wgt[:, None] * o, axis=0)
    lat = (lat / tl.sum(total, axis=0)).to(wuvt_ptr.dtype.element_ty).to(tl.float32)
    g = 1.0
    if HAS_GATE:
        g = tl.sigmoid(tl.load(gate_ptr + t * s_g_t + h).to(tl.float32))
    v_base = tl.program_id(1) * (VD // V_PART)
    for v0 in tl.static_range(0, VD // V_PART, V_BLOCK):
        dv = v_base + v0 + tl.arange(0, V_BLOCK)
        w = tl.load(wuvt_ptr + (h * VD + dv)[:, None] * LORA + dl[None, :]).to(tl.float32)  # W_UV^T rows
        o = tl.sum(w * lat[None, :], axis=1) * g
        tl.store(out_ptr + t * (HEADS * VD) + h * VD + dv, o.to(out_ptr.dtype.element_ty))


def mla_splits(rows: int, n_kv: int, block_m: int, block_n: int, programs: int) -> int:
    """Splits of the cache so that about ``programs`` programs run (rows blocks x splits)."""
    row_blocks = triton.cdiv(rows, block_m)
    return max(1, min(triton.cdiv(n_kv, block_n), triton.cdiv(programs, row_blocks)))


def mla_split_settings(rows: int) -> dict:
    """Launch settings of the split pass by query rows (T * heads): the fastest of
    ``benchmarks/standins_timing.py``'s sweep on the H200 at 1, 4, 8 and 32 tokens x 32 heads."""
    if rows <= 32:
        return dict(block_m=32, block_n=64, num_warps=8, num_stages=3, programs_per_sm=1)
    if rows <= 128:
        return dict(block_m=32, block_n=64, num_warps=4, num_stages=2, programs_per_sm=2)
    return dict(block_m=64, block_n=64, num_warps=8, num_stages=2, programs_per_sm=2)


def mla_split_pass(q: torch.Tensor, q_lat: torch.Tensor, cache: torch.Tensor, pos: int, *, nope: int, scale: float,
                   splits: int | None = None, **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K pass of :func:`mla_decode`: (partial outputs fp32 [R, splits, lora], their
    log2-sum-exp [R, splits]), R = T * heads rows ordered token-major. ``settings`` override
    :func:`mla_split_settings` (block_m, block_n, num_warps, num_stages, programs_per_sm)."""
    T, heads, qd = q.shape
    lora = q_lat.shape[2]
    rope = qd - nope
    if q_lat.shape[:2] != (heads, T) or q_lat.stride(2) != 1 or cache.shape[1] != lora + rope:
        raise ValueError("mla_decode: q_lat / cache shapes do not match q")
    R, N = T * heads, pos + T
    settings = {**mla_split_settings(R), **settings}
    block_m, block_n, programs_per_sm = settings["block_m"], settings["block_n"], settings["programs_per_sm"]
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        splits = mla_splits(R, N, block_m, block_n, programs_per_sm * sms)
    chunk = triton.cdiv(triton.cdiv(N, splits), block_n) * block_n
    splits = triton.cdiv(N, chunk)
    part = torch.empty((R, splits, lora), dtype=torch.float32, device=q.device)
    lse = torch.empty((R, splits), dtype=torch.float32, device=q.device)
    _mla_split_kernel[(triton.cdiv(R, block_m), splits)](
        q_lat, q_lat.stride(0), q_lat.stride(1), q, q.stride(0), q.stride(1), cache, cache.stride(0), part, lse,
        pos, N, R, chunk, scale * 1.4426950408889634, HEADS=heads, LORA=lora, ROPE=rope, PE_OFF=nope,
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_UPCAST_DOT, num_warps=settings["num_warps"],
        num_stages=settings["num_stages"])
    return part, lse


def mla_combine_pass(part: torch.Tensor, lse: torch.Tensor, w_uv_t: torch.Tensor, gate_logits: torch.Tensor | None,
                     *, s_block: int = 32, v_part: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """The combine pass of :func:`mla_decode`: [T, heads * vd] from the split pass's output.
    Defaults: the fastest of ``benchmarks/standins_timing.py``'s sweep on the H200."""
    R, splits, lora = part.shape
    heads, vd = w_uv_t.shape[0], w_uv_t.shape[1]
    T = R // heads
    v_part = v_part or (4 if T <= 4 else 2)
    out = torch.empty((T, heads * vd), dtype=w_uv_t.dtype, device=part.device)
    g = gate_logits if gate_logits is not None else out
    _mla_combine_uv_kernel[(R, v_part)](part, lse, g, g.stride(0), w_uv_t, out, splits, HEADS=heads, LORA=lora, VD=vd,
                                        S_BLOCK=min(s_block, triton.next_power_of_2(splits)), V_PART=v_part,
                                        V_BLOCK=min(16, vd // v_part), HAS_GATE=gate_logits is not None,
                                        num_warps=num_warps)
    return out


def mla_decode(q: torch.Tensor, q_lat: torch.Tensor, cache: torch.Tensor, pos: int, w_uv_t: torch.Tensor,
               gate_logits: torch.Tensor | None, *, nope: int, scale: float, combine: dict | None = None,
               **split) -> torch.Tensor:
    """MLA decode attention of T query tokens at positions pos..pos+T-1 over ``cache[:pos + T]``
    (the new rows already written): q [T, heads, nope + rope] (its rope part used, RoPE applied),
    q_lat [heads, T, lora] (q_nope absorbed through W_UK; any strides with unit last), cache
    [rows, lora + rope] BF16, w_uv_t [heads, vd, lora] (W_UV transposed once, so the combine
    pass reads its rows contiguously). Returns [T, heads * vd]: softmax(scale * q . cache) .
    cache[:, :lora] through W_UV, times sigmoid(gate_logits [T, heads]) if given. ``split`` and
    ``combine`` pass launch settings to the two passes."""
    if w_uv_t.shape[0] != q.shape[1] or w_uv_t.shape[2] != q_lat.shape[2] or not w_uv_t.is_contiguous():
        raise ValueError("mla_decode: w_uv_t must be contiguous [heads, vd, lora]")
    part, lse = mla_split_pass(q, q_lat, cache, pos, nope=nope, scale=scale, **split)
    return mla_combine_pass(part, lse, w_uv_t, gate_logits, **(combine or {}))
