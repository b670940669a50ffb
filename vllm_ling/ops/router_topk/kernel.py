"""Launch the grouped top-k (``grouped_topk.cu``; the why is in its header).

``grouped_topk_cuda(logits, bias, ...)`` = :func:`vllm_ling.ops.moe.routing.grouped_topk` (the
plain-PyTorch reference, sigmoid scoring with a correction bias) for fp32 logits [T, E]: float32
weights and int32 ids [T, top_k], best first. One CTA of E threads per token; compiled by NVRTC
through :mod:`vllm_ling.ops.cuda_jit`; runs on sm_80+, with programmatic dependent launch on sm_90+
(the bias is read before the wait for the gate's logits). CUDA-graph capturable (no host sync; two
allocations, the outputs, when they are not given). No vLLM import. Served by
:mod:`vllm_ling.layers.router_topk` (``VLLM_LING_ROUTER_TOPK``); measured against vLLM's kernel by
``benchmarks/router_topk.py``.
"""

from __future__ import annotations

import ctypes
import functools
from importlib import resources

import torch

from vllm_ling.ops.cuda_jit import cached_kernel, define_lines

KERNEL_NAME = "ling_grouped_topk"
# kernel variants: (source file, kernel name; neither name contains the other: humming finds a kernel by
# substring). "rounds" serves; the candidate "ranks" (each expert counts those that beat it: three barriers and
# no chain of K_ rounds) is measured against it by benchmarks/router_topk.py and tested on the GPU before it is
# chosen. (The two-level candidate, K_ rounds in each of two levels, lost: lease 2026-12-07g, 5.00 against 5.06 us.)
VARIANTS = {"rounds": ("grouped_topk.cu", KERNEL_NAME),
            "ranks": ("grouped_topk_ranks.cu", "ling_router_topk_ranks")}
SERVED_VARIANT = "rounds"
CANDIDATE_VARIANT = "ranks"
MAX_EXPERTS = 1024  # one thread per expert, one CTA per token
MAX_TOP_K = 32
_ARG_TYPES = (ctypes.c_void_p,) * 4 + (ctypes.c_int, ctypes.c_float)


def shape_problems(num_experts: int, n_group: int, topk_group: int, top_k: int) -> list[str]:
    """Why the kernel cannot route this configuration (empty when it can)."""
    out = []
    if not 32 <= num_experts <= MAX_EXPERTS or num_experts % 32:
        out.append(f"{num_experts} experts is not a multiple of 32 in 32..{MAX_EXPERTS}")
    if not 1 <= n_group <= 32 or num_experts % n_group or (num_experts // n_group) % 32:
        out.append(f"{n_group} groups of {num_experts} experts: needs at most 32 groups of a multiple of 32")
    if not 1 <= topk_group <= n_group:
        out.append(f"topk_group={topk_group} is outside 1..{n_group}")
    if not 1 <= top_k <= min(MAX_TOP_K, topk_group * (num_experts // max(n_group, 1))):
        out.append(f"top_k={top_k} is outside 1..{MAX_TOP_K} or beyond the kept groups' experts")
    return out


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can)."""
    from vllm_ling.ops.cuda_jit import sm80_unavailable_reason

    return sm80_unavailable_reason(device)


@functools.cache
def _text(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_bytes().decode()


def source(num_experts: int, n_group: int, topk_group: int, top_k: int, renormalize: bool,
           variant: str = SERVED_VARIANT) -> str:
    """The CUDA text handed to NVRTC: the configuration as ``#define`` lines, the selection helpers
    (``select.cuh``), then the variant's kernel."""
    return define_lines(dict(E_=num_experts, NG=n_group, TG=topk_group, K_=top_k, RENORM=int(renormalize))) \
        + _text("select.cuh") + _text(VARIANTS[variant][0])


_COMPILED: dict[tuple, object] = {}


def compiled(num_experts: int, n_group: int, topk_group: int, top_k: int, renormalize: bool, device: torch.device,
             variant: str = SERVED_VARIANT):
    return cached_kernel(_COMPILED, VARIANTS[variant][1],
                         (num_experts, n_group, topk_group, top_k, renormalize, device, variant),
                         device, source, num_experts, n_group, topk_group, top_k, renormalize, variant)


def grouped_topk_cuda(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                      renormalize: bool = True, routed_scaling_factor: float = 1.0, *,
                      weights: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                      variant: str = SERVED_VARIANT) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm_ling.ops.cuda_jit import launch, pdl_available

    t, e = logits.shape
    problems = shape_problems(e, n_group, topk_group, top_k)
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        problems.append(f"needs fp32 logits with unit stride on the experts, got {logits.dtype} {logits.stride()}")
    if bias.dtype != torch.float32 or bias.shape != (e,) or not bias.is_contiguous():
        problems.append(f"needs a contiguous fp32 bias [{e}], got {bias.dtype} {tuple(bias.shape)}")
    if problems:
        raise ValueError(f"grouped top-k cannot route {tuple(logits.shape)}: {'; '.join(problems)}")
    if weights is None:
        weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if ids is None:
        ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    kernel = compiled(e, n_group, topk_group, top_k, renormalize, logits.device, variant)
    launch(kernel, (t, 1), e, (logits.data_ptr(), bias.data_ptr(), weights.data_ptr(), ids.data_ptr(),
                               logits.stride(0), float(routed_scaling_factor)),
           _ARG_TYPES, torch.cuda.current_stream(logits.device).cuda_stream, pdl=pdl_available(logits.device))
    return weights, ids
