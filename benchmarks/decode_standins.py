"""One-launch stand-ins for two vLLM kernels the decode-step benchmark needs (benchmarks only).

Router: vLLM 0.32 runs Ling's router as the fp32 router GEMM plus one fused ``grouped_topk`` CUDA
kernel; this repo's router (``vllm_ling.ops.moe.routing.route``) is the plain-PyTorch
reference, about fifteen small launches per layer, which would charge both compositions of
``benchmarks/decode_step.py`` a launch cost vLLM does not pay. This Triton kernel computes the
same selection in one launch per layer (one program per token): sigmoid scores, expert bias
added for selection only, the sum of each group's top-2 biased scores, the ``topk_group`` best
groups, the top-k biased scores inside them, weights = unbiased scores renormalised and
multiplied by ``routed_scaling_factor``. Ties break towards the lower index.

Residual add + RMSNorm: vLLM's ``fused_add_rms_norm`` (one launch: ``residual += x``, then
``RMSNorm(residual)``), here as one Triton launch instead of three PyTorch ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, scaling,
                         E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, E)
    score = tl.sigmoid(tl.load(logits_ptr + t * E + offs).to(tl.float32))
    choice = score + tl.load(bias_ptr + offs).to(tl.float32)
    per: tl.constexpr = E // G
    c2 = tl.reshape(choice, (G, per))
    col = tl.arange(0, per)
    first = tl.argmax(c2, axis=1)
    top1 = tl.max(c2, axis=1)
    top2 = tl.max(tl.where(col[None, :] == first[:, None], float("-inf"), c2), axis=1)
    group_score = top1 + top2
    g_idx = tl.arange(0, G)
    keep = g_idx < 0
    for _ in tl.static_range(TG):
        best = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=0)
        keep = keep | (g_idx == best)
    keep_e = tl.reshape(tl.broadcast_to(keep[:, None], (G, per)), (E,))
    masked = tl.where(keep_e, choice, float("-inf"))
    k_idx = tl.arange(0, K)
    ids = tl.zeros((K,), dtype=tl.int32)
    wts = tl.zeros((K,), dtype=tl.float32)
    for i in tl.static_range(K):
        e = tl.argmax(masked, axis=0)
        s = tl.sum(tl.where(offs == e, score, 0.0), axis=0)
        ids = tl.where(k_idx == i, e, ids)
        wts = tl.where(k_idx == i, s, wts)
        masked = tl.where(offs == e, float("-inf"), masked)
    wts = wts / tl.sum(wts, axis=0) * scaling
    tl.store(ids_ptr + t * K + k_idx, ids)
    tl.store(w_ptr + t * K + k_idx, wts)


def fused_route(x: torch.Tensor, gate_weight: torch.Tensor, expert_bias: torch.Tensor, *, top_k: int,
                n_group: int, topk_group: int, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int32 [T, k]) as ``vllm_ling.ops.moe.routing.route``."""
    logits = x.float() @ gate_weight.t()
    T, E = logits.shape
    w = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    _grouped_topk_kernel[(T,)](logits, expert_bias, w, ids, float(routed_scaling_factor),
                               E=E, G=n_group, TG=topk_group, K=top_k, num_warps=4)
    return w, ids


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    s = (tl.load(x_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32))
    s = s.to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + t * H + offs, s, mask=mask)
    s = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``residual += x`` (in place) and return ``RMSNorm(residual) * weight``; contiguous [T, H]."""
    T, H = residual.shape
    out = torch.empty_like(residual)
    _add_rms_norm_kernel[(T,)](x.contiguous(), residual, weight, out, eps, H=H, BLOCK=triton.next_power_of_2(H),
                               num_warps=8)
    return out
