"""The shared experts' clamped SwiGLU as one kernel (``shared_swiglu_kernel``).

Ling's last layers clamp their shared expert's SwiGLU (``share_expert_swiglu_limit_list``), which vLLM
0.32 builds as ``SwigluStepAndMul``. vLLM runs the shared experts inside its MoE custom op, opaque to
the model's torch.compile, and with vLLM's custom ops off (its default under Inductor) the op serves
its PyTorch composition there, eagerly: SiLU, two clamps and a product, four launches per layer (lease
2026-12-07c's 32K step: 8 layers each about 6.5 us longer than the others, whose ``SiluAndMul`` vLLM
compiles for exactly that reason). On CUDA the target's constructor enables vLLM's own one-launch
Triton kernel for that op (``+swiglustep_and_mul`` in vLLM's custom ops; same formula, rounded once).

Its names, the selector (:func:`select_shared_swiglu`) and :func:`install` live here; the reader is
:mod:`vllm_ling.layers.shared_swiglu`.
"""

from __future__ import annotations

import logging

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import Choice, LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection, record

logger = get_logger("moe")

OPTION = "VLLM_LING_SHARED_SWIGLU_KERNEL"
VLLM_OP = "swiglustep_and_mul"  # vLLM's registered name of SwigluStepAndMul
KERNEL_DESCRIPTION = ("the shared experts' clamped SwiGLU as vLLM's one-launch Triton kernel, not its PyTorch "
                      "composition (four launches inside vLLM's MoE op)")


class SharedSwiglu(Choice):
    """What computes a shared expert's clamped SwiGLU."""

    KERNEL = "kernel"  # vLLM's one-launch Triton kernel (the op's CUDA path)
    TORCH = "torch"    # vLLM's PyTorch composition (its native path)


def select_shared_swiglu(enabled: bool, platform: Platform, custom_ops: list[str]) -> Selection:
    """The selection for the target's clamped SwiGLUs: vLLM's kernel where ``enabled`` on CUDA, unless
    the user's ``custom_ops`` turn the op off; ``+swiglustep_and_mul`` from the user serves it anyway."""
    def torch_(reason: str) -> Selection:
        return Selection(Feature.SHARED_SWIGLU, SharedSwiglu.TORCH, reason)

    if platform is Platform.CPU:
        return torch_("the CPU platform: vLLM's PyTorch composition")
    if f"-{VLLM_OP}" in custom_ops:
        return torch_(f"--compilation-config custom_ops has -{VLLM_OP}")
    if not enabled and f"+{VLLM_OP}" not in custom_ops:
        return torch_(f"opted out ({opt_out_setting(OPTION)})")
    return Selection(Feature.SHARED_SWIGLU, SharedSwiglu.KERNEL, KERNEL_DESCRIPTION)


def decide(compilation_config, platform: Platform) -> Selection:
    """Before the target's modules are built (vLLM's ops read the custom ops when constructed): the
    selection, made so in ``compilation_config.custom_ops`` on CUDA (``+swiglustep_and_mul`` where the
    kernel serves, ``-swiglustep_and_mul`` where opted out, whatever vLLM's default for custom ops)."""
    custom_ops = compilation_config.custom_ops
    selection = select_shared_swiglu(LingOptions.current().shared_swiglu_kernel, platform, list(custom_ops))
    if platform is Platform.CUDA:
        wanted = f"{'+' if selection.choice is SharedSwiglu.KERNEL else '-'}{VLLM_OP}"
        if wanted not in custom_ops:
            custom_ops.append(wanted)
    if selection.choice is SharedSwiglu.KERNEL:
        log_once(logger, logging.INFO, "shared-swiglu", "Shared experts: %s.", KERNEL_DESCRIPTION)
    elif platform is Platform.CUDA:  # the opt-out, or the user's -swiglustep_and_mul
        log_once(logger, logging.WARNING, f"shared-swiglu-{selection.reason}",
                 "The shared experts' clamped SwiGLU runs vLLM's PyTorch composition (%s): four launches per "
                 "clamped layer; the startup report marks shared_swiglu_kernel inactive.", selection.reason)
    return selection


def install(modules, selection: Selection) -> None:
    """Record ``selection`` on each of the target's ``SwigluStepAndMul`` modules (the reader's)."""
    for module in modules:
        record(module, selection)
