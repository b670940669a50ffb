"""Which path serves Ling's MoE router gates and the checkpoint's unquantized BF16 linears:
decided once each, by :func:`select_router_gemv` and :func:`select_bf16_gemv`.

The layers build their path from the answer and record it on themselves, ``vllm-ling warmup``
compiles the kernel where the same selector picks it, and the startup verification proves each
gate and linear serves what was recorded. No vLLM import: a gate's facts (read from the constructed
GateLinear) arrive as :class:`GateFacts`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from vllm_ling.options import Bf16Gemv, Choice, LingOptions, RouterGemv, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection

ROUTER_OPTION, BF16_OPTION = "VLLM_LING_ROUTER_GEMV", "VLLM_LING_BF16_GEMV"
NOT_A_GEMV_GATE = "not an fp32 unquantized bias-free gate with fp32 logits"


class GemvPath(Choice):
    """What serves a small linear (a router gate or an unquantized BF16 linear)."""

    LING = "ling"  # vllm-ling's small GEMV for decode-sized batches, vLLM's path above
    VLLM = "vllm"  # vLLM's path at every size


class RouterGemvUnavailable(RuntimeError):
    """The router GEMV was requested (the default) for a gate it holds and cannot run here."""


class Bf16GemvUnavailable(RuntimeError):
    """The small-GEMV path was requested (the default) and cannot run here."""


@dataclasses.dataclass(frozen=True)
class GateFacts:
    """What decides a gate's path, read from the constructed GateLinear before weights load."""

    prefix: str
    num_experts: int
    hidden_size: int
    weight_dtype: torch.dtype
    has_bias: bool
    unquantized: bool
    out_dtype: torch.dtype | None
    vllm_kernel: str | None = None  # a specialized kernel vLLM has for this gate on this GPU
    batch_invariant: bool = False   # VLLM_BATCH_INVARIANT: vLLM's batch-invariant linear


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def select_router_gemv(options: LingOptions, platform: Platform, facts: GateFacts,
                       unavailable_reason: Callable[[], str | None] | None = None) -> Selection:
    """The selection for one gate: the router GEMV where it holds the gate, else GateLinear's path
    with the reason. Raises :class:`RouterGemvUnavailable` where it holds the gate and cannot run
    (``unavailable_reason()``, default: ask the kernel), naming the opt-out."""
    def vllm(reason: str) -> Selection:
        return Selection(Feature.ROUTER_GEMV, GemvPath.VLLM, reason)

    if options.router_gemv is RouterGemv.VLLM:
        return vllm(f"opted out ({opt_out_setting(ROUTER_OPTION)})")
    if platform is Platform.CPU:
        return vllm("the CPU platform: vLLM's GateLinear path")
    kind = []
    if not facts.unquantized:
        kind.append("quantized")
    if facts.has_bias:
        kind.append("has a bias")
    if facts.weight_dtype != torch.float32:
        kind.append(f"{_dtype(facts.weight_dtype)} weights")
    if facts.out_dtype not in (None, torch.float32):
        kind.append(f"{_dtype(facts.out_dtype)} logits")
    if kind:
        return vllm(f"{NOT_A_GEMV_GATE} (" + ", ".join(kind) + ")")
    from vllm_ling.ops.small_gemv import router as router_ops

    problems = router_ops.shape_problems(facts.num_experts, facts.hidden_size)
    if facts.vllm_kernel:
        problems.append(f"vLLM has a specialized kernel for this gate here ({facts.vllm_kernel})")
    if facts.batch_invariant:
        problems.append("vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) is on")
    if problems:
        return vllm("; ".join(problems))
    why = router_ops.unavailable_reason() if unavailable_reason is None else unavailable_reason()
    if why:
        raise RouterGemvUnavailable(f"router GEMV cannot run for {facts.prefix}: {why}; opt out with "
                                    f"{opt_out_setting(ROUTER_OPTION)}")
    return Selection(Feature.ROUTER_GEMV, GemvPath.LING, "CUDA, the router GEMV holds this gate")


def select_bf16_gemv(options: LingOptions, platform: Platform, prefix: str,
                     unavailable_reason: Callable[[], str | None] | None = None) -> Selection:
    """The selection for one unquantized (checkpoint-skipped) linear: vllm-ling's method with the
    small GEMV (a loaded weight it cannot hold then keeps vLLM's GEMM, reported), or vLLM's GEMM.
    Raises :class:`Bf16GemvUnavailable` where the kernel cannot run on this GPU, naming the opt-out."""
    if options.bf16_gemv is Bf16Gemv.VLLM:
        return Selection(Feature.BF16_GEMV, GemvPath.VLLM, f"opted out ({opt_out_setting(BF16_OPTION)})")
    if platform is Platform.CPU:
        return Selection(Feature.BF16_GEMV, GemvPath.VLLM, "the CPU platform: vLLM's GEMM")
    if unavailable_reason is None:
        import vllm_ling.ops.small_gemv as gemv_ops

        why = gemv_ops.unavailable_reason()
    else:
        why = unavailable_reason()
    if why:
        raise Bf16GemvUnavailable(f"the small GEMV cannot run for {prefix}: {why}; opt out with "
                                  f"{opt_out_setting(BF16_OPTION)}")
    return Selection(Feature.BF16_GEMV, GemvPath.LING, "CUDA, the small GEMV runs")


def bf16_gemv_after_load(selected: Selection, problems: list[str]) -> Selection:
    """The final selection of a linear the small GEMV was selected for, once its weight is loaded:
    unchanged, or vLLM's GEMM where the kernel cannot hold the weight (an explicit fallback)."""
    if selected.choice is not GemvPath.LING or not problems:
        return selected
    return Selection(Feature.BF16_GEMV, GemvPath.VLLM, "the small GEMV cannot hold it: " + "; ".join(problems),
                     fallback_from=GemvPath.LING)
