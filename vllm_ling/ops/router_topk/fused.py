"""The MoE router in one launch (``router_fused.cu``; the why is in its header): a candidate, measured
against the two kernels that serve (the router GEMV, :mod:`vllm_ling.ops.small_gemv.router`, then
:func:`~vllm_ling.ops.router_topk.kernel.grouped_topk_cuda`) by ``benchmarks/router_topk.py``; not served.

``route_fused(x, gate, bias, ...)`` = the fp32 logits of BF16 ``x`` [T, H] against the fp32 ``gate``
[E, H], then :func:`vllm_ling.ops.moe.routing.grouped_topk` on them: float32 weights and int32 ids
[T, top_k], best first, and the logits [T, E] it routed. ``counter`` is one int32 the caller keeps for
the launches of a stream (zeros at first; each launch adds the grid size to it, never resets it).
CUDA-graph capturable; no vLLM import.
"""

from __future__ import annotations

import ctypes

import torch

from vllm_ling.ops.cuda_jit import cached_kernel, define_lines, ptx_loads
from vllm_ling.ops.router_topk import kernel as topk_kernel

KERNEL_NAME = "ling_router_fused"
SOURCE = "router_fused.cu"
WARPS_PER_EXPERT = 4  # a gate row's 2560 fp32 in four warps: 5 float4 per lane, 128 CTAs for 512 experts
MAX_TOKENS = 16       # the router GEMV's rows (small_gemv.router.MAX_ROWS): decode and MTP verify windows
_ARG_TYPES = (ctypes.c_void_p,) * 7 + (ctypes.c_int, ctypes.c_int, ctypes.c_float)


def grid_size(warps_per_expert: int = WARPS_PER_EXPERT) -> int:
    return 32 * warps_per_expert


def shape_problems(num_experts: int, n_group: int, topk_group: int, top_k: int, hidden: int,
                   warps_per_expert: int = WARPS_PER_EXPERT) -> list[str]:
    """Why the kernel cannot route this configuration (empty when it can): the top-k kernel's limits,
    and a gate row split into whole float4 per lane over ``warps_per_expert`` warps."""
    out = topk_kernel.shape_problems(num_experts, n_group, topk_group, top_k)
    warps = num_experts // 32
    if warps_per_expert not in (1, 2, 4, 8) or warps % warps_per_expert:
        out.append(f"{warps} warps (one thread per expert) do not split into experts of {warps_per_expert} warps")
    if hidden % (128 * warps_per_expert):
        out.append(f"hidden size {hidden} is not a multiple of {128 * warps_per_expert}")
    return out


def source(num_experts: int, n_group: int, topk_group: int, top_k: int, renormalize: bool, hidden: int,
           warps_per_expert: int = WARPS_PER_EXPERT) -> str:
    """The CUDA text handed to NVRTC: the configuration as ``#define`` lines, the shared loads, the
    top-k's selection helpers, then the kernel."""
    defines = dict(E_=num_experts, NG=n_group, TG=topk_group, K_=top_k, RENORM=int(renormalize), H_=hidden,
                   WPE=warps_per_expert, TMAX=MAX_TOKENS)
    return define_lines(defines) + ptx_loads() + topk_kernel.cuda_text("select.cuh") + topk_kernel.cuda_text(SOURCE)


_COMPILED: dict[tuple, object] = {}


def new_counter(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def route_fused(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                renormalize: bool = True, routed_scaling_factor: float = 1.0, *, counter: torch.Tensor,
                logits: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from vllm_ling.ops.cuda_jit import launch, pdl_available

    t, h = x.shape
    e = gate.shape[0]
    problems = shape_problems(e, n_group, topk_group, top_k, h)
    if not 1 <= t <= MAX_TOKENS:
        problems.append(f"{t} tokens: the kernel routes 1..{MAX_TOKENS}")
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.stride(0) % 4:
        problems.append(f"needs BF16 x with unit stride and rows 8-byte aligned, got {x.dtype} {x.stride()}")
    if gate.dtype != torch.float32 or gate.shape != (e, h) or not gate.is_contiguous():
        problems.append(f"needs a contiguous fp32 gate [{e}, {h}], got {gate.dtype} {tuple(gate.shape)}")
    if bias.dtype != torch.float32 or bias.shape != (e,) or not bias.is_contiguous():
        problems.append(f"needs a contiguous fp32 bias [{e}], got {bias.dtype} {tuple(bias.shape)}")
    if logits is not None and (logits.dtype != torch.float32 or logits.shape != (t, e) or not logits.is_contiguous()):
        problems.append(f"needs contiguous fp32 logits [{t}, {e}] to write")
    if counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != x.device:
        problems.append("needs one int32 counter on the activations' device")
    if problems:
        raise ValueError(f"the fused router cannot route {tuple(x.shape)} against {tuple(gate.shape)}: "
                         f"{'; '.join(problems)}")
    if logits is None:
        logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if weights is None:
        weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    if ids is None:
        ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    key = (e, n_group, topk_group, top_k, renormalize, h, x.device)
    kernel = cached_kernel(_COMPILED, KERNEL_NAME, key, x.device, source, e, n_group, topk_group, top_k,
                           renormalize, h)
    launch(kernel, (grid_size(), 1), e,
           (x.data_ptr(), gate.data_ptr(), bias.data_ptr(), logits.data_ptr(), weights.data_ptr(), ids.data_ptr(),
            counter.data_ptr(), t, x.stride(0), float(routed_scaling_factor)),
           _ARG_TYPES, torch.cuda.current_stream(x.device).cuda_stream, pdl=pdl_available(x.device))
    return weights, ids, logits
