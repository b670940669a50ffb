"""The startup verification's reading of ``shared_swiglu_kernel``: which path each of the target's
clamped SwiGLUs (vLLM's ``SwigluStepAndMul``) dispatches to (:mod:`vllm_ling.models.shared_swiglu`
decides and records)."""

from __future__ import annotations

from vllm_ling.models.shared_swiglu import OPTION, SharedSwiglu
from vllm_ling.options import opt_out_setting
from vllm_ling.selection import Feature, Reader, Served


def is_clamped_swiglu(module) -> bool:
    from vllm.model_executor.layers.activation import SwigluStepAndMul

    return isinstance(module, SwigluStepAndMul)


def clamped_shared_experts(config, stage, draft_here: bool) -> int:
    """The stage's MoE layers whose shared expert clamps its SwiGLU, by vLLM's own reading of the
    config (the NEXTN layer is past the per-layer list: none)."""
    from vllm.model_executor.models.bailing_moe_v3 import _get_layer_swiglu_limit

    limits = getattr(config, "share_expert_swiglu_limit_list", None)
    first_moe = getattr(config, "first_k_dense_replace", 0)
    return sum(1 for i in range(max(stage.start, first_moe), stage.end) if _get_layer_swiglu_limit(limits, i))


def served(module) -> Served:
    """What the op's forward dispatches to, read from the method vLLM bound at construction."""
    if module._forward_method == module.forward_cuda:
        return Served.of(SharedSwiglu.KERNEL, label="vLLM's Triton kernel")
    return Served.of(SharedSwiglu.TORCH, label="vLLM's PyTorch composition")


READER = Reader(
    Feature.SHARED_SWIGLU, "shared_swiglu_kernel", "clamped shared-expert SwiGLUs", is_clamped_swiglu, served,
    f"set {opt_out_setting(OPTION)}, or remove -swiglustep_and_mul from --compilation-config custom_ops; a module "
    "serving other than its selection is a defect: report it",
    expected=clamped_shared_experts, uniform=True, optimization="shared_swiglu_kernel",
    optimizing=frozenset({SharedSwiglu.KERNEL}))
