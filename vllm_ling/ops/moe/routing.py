"""Routing of a Ling MoE layer: which experts each token goes to, and the two routing-side
steps around humming's indexed GEMM.

- The router (plain PyTorch, the reference), following vLLM 0.32's ``grouped_topk``
  (``fused_moe/router/grouped_topk_router.py``, same in the CPU router): fp32 router logits
  ``x @ gate_w.T``; sigmoid scores; the expert bias (``e_score_correction_bias``,
  "noaux_tc") is added for *selection only*; each of ``n_group`` groups scores the **sum of
  its top-2 biased scores**; the ``topk_group`` best groups are kept; the top-k biased scores
  inside them pick the experts; the weights are the *unbiased* sigmoid scores of those
  experts, renormalised to sum 1 (``norm_topk_prob``) and then multiplied by
  ``routed_scaling_factor``.
- Routing metadata before the GEMM (vLLM's ``moe_align_block_size`` layout): PyTorch, or one
  Triton launch for decode-sized batches.
- The weighted top-k sum after it: one Triton launch (fp32 weights), or a BF16 batched GEMM.

No vLLM import; Triton is imported only when a Triton path runs.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable

import torch

from vllm_ling.log import get_logger, log_once

logger = get_logger("ops.moe.routing")


# --------------------------------------------------------------------------------------
# Router (plain PyTorch reference)
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

    Returns (weights float32 [T, k], ids int32 [T, k]), computed in float32 (float64 for float64
    logits). Ties are broken by torch.topk.
    """
    T, E = logits.shape
    if E % n_group:
        raise ValueError(f"num_experts={E} is not divisible by n_group={n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    per_group = E // n_group
    if top_k > topk_group * per_group:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * per_group} experts of the kept groups")
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 logits: a float64 answer
    scores = logits.to(dtype).sigmoid()
    if expert_bias is not None:
        choice = scores + expert_bias.to(dtype).unsqueeze(0)
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


AlignFn = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         impl: str = "auto", large: AlignFn | None = None):
    """Dispatch: ``triton`` (one launch, small batches), ``torch``, or ``auto``: Triton on CUDA for
    n <= 128 when Triton imports; above, ``large`` where given (a one-launch aligner with the same
    layout: the layer passes vLLM's CUDA ``moe_align_block_size``; this module imports no vLLM),
    else PyTorch (about 17 launches, which prefill pays per MoE layer in host time)."""
    if impl == "torch":
        return moe_align_block_size_torch(topk_ids, block_size, num_experts)
    if impl == "triton":
        return moe_align_block_size_triton(topk_ids, block_size, num_experts)
    if impl != "auto":
        raise ValueError(f"routing impl must be auto, torch or triton, got {impl!r}")
    if (topk_ids.is_cuda and topk_ids.numel() <= TRITON_ALIGN_MAX_ASSIGNMENTS
            and _triton_available()):
        return moe_align_block_size_triton(topk_ids, block_size, num_experts)
    if large is not None and topk_ids.numel() > TRITON_ALIGN_MAX_ASSIGNMENTS:
        return large(topk_ids, block_size, num_experts)
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


