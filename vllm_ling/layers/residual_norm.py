"""The decoder layers' residual add + RMSNorm on CUDA: vllm-ling's kernel as a provider of vLLM's IR op.

vLLM 0.32 computes every ``RMSNorm(x, residual)`` through its IR op ``vllm.ir.ops.fused_add_rms_norm``,
whose implementation is chosen by a priority list (``kernel_config.ir_op_priority``): under torch.compile
the platform default is ``native``, which Inductor fuses into one reduction kernel per norm. That kernel
launches only when the one before it has finished, and the linear after it streams its weights only when
the norm has finished. vllm-ling registers the provider ``vllm_ling``
(:func:`vllm_ling.ops.residual_norm.kernel.add_rms_norm_cuda`: programmatic dependent launch, so the next
kernel's weights stream while the norm runs) through vLLM's own mechanism (``register_impl``, as its
``vllm_c`` and ``oink`` providers), on CUDA only; the config hook puts it first in the priority list
(:mod:`vllm_ling.runtime.residual_norm`) and every worker installs that list at start. vLLM's lowering pass
traces the provider into the compiled graph as the opaque op ``vllm_ling::add_rms_norm``; the op counts
its calls, so after warm-up each worker can say whether the compiled model called it.

No ``from __future__ import annotations`` here: vLLM infers the provider's schema from its annotations
and requires the native op's exactly.
"""

import functools

import torch
from torch import Tensor

from vllm_ling.ops.residual_norm import kernel as norm_kernel

PROVIDER = "vllm_ling"
OP_NAME = "vllm_ling::add_rms_norm"
TWO_ADDENDS_OP_NAME = "vllm_ling::add2_rms_norm"  # the MoE sum folded in (vllm_ling.layers.moe_sum_norm)
_CALLS = [0, 0]  # calls of the ops (one addend, two) outside CUDA graph replays (profile run, warm-up, captures)


def calls() -> int:
    """How often this process ran the norm's ops (graph replays do not count: they run no Python)."""
    return _CALLS[0] + _CALLS[1]


def folded_calls() -> int:
    """How often this process ran the two-addend op: the norms whose MoE sum the compiled graph folded in."""
    return _CALLS[1]


def _add_rms_norm_impl(x: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    _CALLS[0] += 1
    return norm_kernel.add_rms_norm_cuda(x, residual, weight, epsilon)


def _add_rms_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    # the kernel's outputs are contiguous whatever x's strides (empty_like would copy a view's)
    return x.new_empty(x.shape), x.new_empty(x.shape)


add_rms_norm_op = torch.library.custom_op(OP_NAME, _add_rms_norm_impl, mutates_args=())
add_rms_norm_op.register_fake(_add_rms_norm_fake)


def _add2_rms_norm_impl(x: Tensor, x2: Tensor, residual: Tensor, weight: Tensor,
                        epsilon: float) -> tuple[Tensor, Tensor]:
    _CALLS[1] += 1
    return norm_kernel.add_rms_norm_cuda(x, residual, weight, epsilon, x2=x2)


def _add2_rms_norm_fake(x: Tensor, x2: Tensor, residual: Tensor, weight: Tensor,
                        epsilon: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


add2_rms_norm_op = torch.library.custom_op(TWO_ADDENDS_OP_NAME, _add2_rms_norm_impl, mutates_args=())
add2_rms_norm_op.register_fake(_add2_rms_norm_fake)


@functools.lru_cache(maxsize=None)
def _kernel_takes(hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    return not norm_kernel.shape_problems(hidden, dtype, weight_dtype)


def supports_args(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                  variance_size: int | None = None) -> bool:
    """The arguments the kernel takes (vLLM's dispatch asks, with fake tensors under torch.compile, and at
    every call in eager mode: cheap): the whole row normalised, a weight, BF16 rows of a supported width on a
    CUDA device; others go to the next provider in the priority list."""
    return (variance_size is None and weight is not None and x.is_cuda and x.dim() >= 1
            and x_residual.shape == x.shape and x_residual.dtype == x.dtype
            and _kernel_takes(int(x.shape[-1]), x.dtype, weight.dtype))


def registered() -> bool:
    """The provider is registered with vLLM's IR op in this process."""
    from vllm import ir

    return PROVIDER in ir.ops.fused_add_rms_norm.impls


def register_residual_norm() -> list[str]:
    """Register the provider with ``vllm.ir.ops.fused_add_rms_norm`` (every platform: vLLM's priority
    check needs every listed provider registered; it is ``supported`` on CUDA only, and listed only where
    the config hook decided so). Idempotent. Returns what was registered."""
    from vllm import ir
    from vllm.platforms import current_platform

    op = ir.ops.fused_add_rms_norm
    if PROVIDER in op.impls:
        return []

    @op.register_impl(PROVIDER, supports_args=supports_args, supported=current_platform.is_cuda())
    def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[Tensor, Tensor]:
        return torch.ops.vllm_ling.add_rms_norm(x, x_residual, weight, epsilon)

    where = "CUDA" if current_platform.is_cuda() else "registered, not supported on this platform"
    return [f"residual add + RMSNorm ({where}): provider {PROVIDER} of vLLM's IR op fused_add_rms_norm"]
