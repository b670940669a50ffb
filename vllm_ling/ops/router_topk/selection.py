"""Which path picks the experts of Ling's MoE routers: decided once per MoE layer by
:func:`select_router_topk`.

The MoE runner records the answer on itself and routes by it; the startup verification proves each
runner's router serves what was recorded and runs the kernel on known answers. No vLLM import: a
router's facts (read from the router vLLM built) arrive as :class:`RouterFacts`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from vllm_ling.options import LingOptions, RouterTopk, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection

TOPK_OPTION = "VLLM_LING_ROUTER_TOPK"
NOT_LINGS_ROUTING = "not Ling's routing"  # the reasons that are no fallback: the kernel is not for them


class RouterTopkUnavailable(RuntimeError):
    """The grouped top-k kernel was requested (the default) for a router it holds and cannot run here."""


@dataclasses.dataclass(frozen=True)
class RouterFacts:
    """What decides a router's path, read from the router vLLM built for one MoE layer."""

    prefix: str
    router_class: str          # vLLM's class name: GroupedTopKRouter is the one the kernel replaces
    ling_model: bool           # the layer belongs to a Ling-3 target or NEXTN draft
    scoring_func: str
    has_bias: bool             # an expert-score correction bias (added for the choice only)
    num_experts: int
    n_group: int
    topk_group: int
    top_k: int
    eplb: bool = False         # expert-parallel load balancing maps the ids after the routing
    skip_padding: bool = False  # vLLM masks padded tokens' picks (DeepEP v2 kernels)
    fused_shared_experts: int = 0  # shared experts appended to the picks (ROCm AITER's fusion)


def select_router_topk(options: LingOptions, platform: Platform, facts: RouterFacts,
                       unavailable_reason: Callable[[], str | None] | None = None) -> Selection:
    """The selection for one MoE layer's router: the kernel where it holds the routing, else vLLM's
    router with the reason. Raises :class:`RouterTopkUnavailable` where it holds the routing and
    cannot run (``unavailable_reason()``, default: ask the kernel), naming the opt-out."""
    def vllm(reason: str) -> Selection:
        return Selection(Feature.ROUTER_TOPK, RouterTopk.VLLM, reason)

    if options.router_topk is RouterTopk.VLLM:
        return vllm(f"opted out ({opt_out_setting(TOPK_OPTION)})")
    if platform is Platform.CPU:
        return vllm(f"the CPU platform: vLLM's {facts.router_class}")
    kind = []
    if not facts.ling_model:
        kind.append("another model's layer")
    if facts.router_class != "GroupedTopKRouter":
        kind.append(f"vLLM built a {facts.router_class}")
    if facts.scoring_func != "sigmoid":
        kind.append(f"{facts.scoring_func} scores")
    if not facts.has_bias:
        kind.append("no expert bias")
    if kind:
        return vllm(f"{NOT_LINGS_ROUTING} (" + ", ".join(kind) + ")")
    from vllm_ling.ops.router_topk import kernel

    problems = kernel.shape_problems(facts.num_experts, facts.n_group, facts.topk_group, facts.top_k)
    if facts.eplb:
        problems.append("expert-parallel load balancing is on")
    if facts.skip_padding:
        problems.append("vLLM masks padded tokens' picks here (skip_padding)")
    if facts.fused_shared_experts:
        problems.append(f"{facts.fused_shared_experts} shared expert(s) fused into the picks")
    if problems:
        return vllm("; ".join(problems))
    why = kernel.unavailable_reason() if unavailable_reason is None else unavailable_reason()
    if why:
        raise RouterTopkUnavailable(f"the grouped top-k kernel cannot run for {facts.prefix}: {why}; opt out with "
                                    f"{opt_out_setting(TOPK_OPTION)}")
    return Selection(Feature.ROUTER_TOPK, RouterTopk.LING, "CUDA, the grouped top-k kernel holds this router")
