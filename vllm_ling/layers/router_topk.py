"""Ling's MoE routers on CUDA: vllm-ling's grouped top-k kernel picks each token's experts.

vLLM 0.32 routes Ling's MoE layers with ``GroupedTopKRouter``, whose ``_compute_routing`` calls the
module-level ``grouped_topk`` (its ``grouped_topk_fused_kernel``: 12.5 us per layer for one token on
an H100, ``benchmarks/results/step_profile_real_h100.md``); an out-of-tree ``GroupedTopk`` CustomOp
would never be reached. The router is built by ``FusedMoEFactory`` and held by the layer's
``MoERunner``, a ``PluggableLayer``: :class:`LingMoERunner` *is* vLLM's runner (same arguments,
state and forward) and, for a router the kernel holds (a Ling model's sigmoid router with expert
bias, a configuration :func:`vllm_ling.ops.router_topk.kernel.shape_problems` accepts, no EPLB),
swaps in :class:`LingGroupedTopKRouter`: vLLM's router whose routing step is the kernel, one launch
per layer at every batch size (EPLB mapping, the routed-experts capture and the id dtype stay
vLLM's). The decision is made at construction, before weights load, and recorded on the runner; the
startup verification reads each runner's router back (:data:`READER`) and runs the kernel on known
answers through a copy of the served router (``runtime/verification/``).

The routing runs inside vLLM's opaque ``moe_forward`` op, never traced by torch.compile: the kernel
is captured in CUDA graphs as launched.
"""

from __future__ import annotations

import functools
import logging

from vllm_ling.layers.moe_method import expected_layers
from vllm_ling.layers.out_of_tree import install_out_of_tree
from vllm_ling.log import get_logger, log_once
from vllm_ling.models.names import LING_ARCHITECTURES, LING_MODEL_TYPE
from vllm_ling.ops.router_topk import kernel as topk_kernel
from vllm_ling.ops.router_topk.selection import (NOT_LINGS_ROUTING, TOPK_OPTION, RouterFacts,
                                                 RouterTopkUnavailable, select_router_topk)
from vllm_ling.options import LingOptions, RouterTopk, opt_out_setting
from vllm_ling.selection import Feature, Platform, Reader, Selection, Served, record, serving_platform

logger = get_logger("router")

IN_TREE_NAME = "MoERunner"
KERNEL_LABEL = "vllm-ling grouped top-k (one CTA per token)"
_DESCRIPTION = f"MoE routers (CUDA): {KERNEL_LABEL} for Ling's sigmoid grouped top-k with expert bias"
_CPU_DESCRIPTION = "MoE routers (CPU): vLLM's CPURouter, recorded per layer"
__all__ = ["READER", "RouterFacts", "RouterTopkUnavailable", "decide", "ling_router_class", "register_router_topk",
           "served"]


def decide(facts: RouterFacts, options: LingOptions, platform: Platform = Platform.CUDA) -> Selection:
    """The router's selection (:func:`~vllm_ling.ops.router_topk.selection.select_router_topk`),
    said once: opted out, one WARNING; not Ling's routing, once at INFO; Ling's routing the kernel
    cannot hold, one WARNING per reason; the CPU platform says nothing (vLLM's CPURouter, as without
    vllm-ling). Raises :class:`RouterTopkUnavailable` where the kernel holds it and cannot run here."""
    selection = select_router_topk(options, platform, facts)
    reason = selection.reason
    if platform is Platform.CPU:
        pass
    elif selection.choice is RouterTopk.LING:
        log_once(logger, logging.INFO, "router-topk-on", "MoE routers: %s.", KERNEL_LABEL)
    elif options.router_topk is RouterTopk.VLLM:
        log_once(logger, logging.WARNING, "router-topk-opt-out",
                 "Router top-k is OFF by explicit choice (%s): MoE routers run vLLM's grouped_topk; the startup "
                 "report marks router_topk inactive.", opt_out_setting(TOPK_OPTION))
    elif reason.startswith(NOT_LINGS_ROUTING):
        log_once(logger, logging.INFO, f"router-topk-kind-{reason}",
                 "%s and similar routers keep vLLM's router: %s.", facts.prefix, reason)
    else:
        log_once(logger, logging.WARNING, f"router-topk-off-{reason}",
                 "Router top-k off for %s (%d experts, %d groups keep %d, top %d) and similar routers: %s; vLLM's "
                 "grouped_topk serves them (the startup check router_topk reports it).", facts.prefix,
                 facts.num_experts, facts.n_group, facts.topk_group, facts.top_k, reason)
    return selection


def _ling_model() -> bool:
    """The model being built is a Ling-3 target or NEXTN draft (vLLM's current config says so)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    hf_config = getattr(getattr(config, "model_config", None), "hf_config", None)
    return (bool(set(getattr(hf_config, "architectures", None) or ()) & set(LING_ARCHITECTURES))
            or getattr(hf_config, "model_type", None) == LING_MODEL_TYPE)


def router_facts(router, prefix: str, ling_model: bool) -> RouterFacts:
    """What decides a router's path, read from the router vLLM built (any router class)."""
    def attr(name, default=0):
        return getattr(router, name, default)

    return RouterFacts(prefix=prefix, router_class=type(router).__name__, ling_model=ling_model,
                       scoring_func=str(attr("scoring_func", "")),
                       has_bias=attr("e_score_correction_bias", None) is not None,
                       num_experts=int(attr("global_num_experts")), n_group=int(attr("num_expert_group") or 0),
                       topk_group=int(attr("topk_group") or 0), top_k=int(attr("top_k")),
                       eplb=attr("eplb_state", None) is not None, skip_padding=bool(attr("skip_padding", False)),
                       fused_shared_experts=int(attr("num_fused_shared_experts") or 0))


@functools.cache
def ling_router_class():
    """vllm-ling's subclass of vLLM's ``GroupedTopKRouter``, built on first use: importing vLLM's
    router must wait for the platform."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    class LingGroupedTopKRouter(GroupedTopKRouter):
        """GroupedTopKRouter whose routing step is vllm-ling's grouped top-k kernel."""

        @classmethod
        def taking_over(cls, router: GroupedTopKRouter) -> "LingGroupedTopKRouter":
            """The same routing as ``router`` (its configuration and bias parameter)."""
            return cls(top_k=router.top_k, global_num_experts=router.global_num_experts,
                       num_expert_group=router.num_expert_group, topk_group=router.topk_group,
                       renormalize=router.renormalize, scoring_func=router.scoring_func,
                       routed_scaling_factor=router.routed_scaling_factor,
                       e_score_correction_bias=router.e_score_correction_bias,
                       num_fused_shared_experts=router.num_fused_shared_experts, eplb_state=router.eplb_state,
                       skip_padding=router.skip_padding)

        def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
            # looked up on the module at call time (the CPU tests put the reference in its place)
            return topk_kernel.grouped_topk_cuda(router_logits, self.e_score_correction_bias, self.top_k,
                                                 self.num_expert_group, self.topk_group, self.renormalize,
                                                 self.routed_scaling_factor)

    LingGroupedTopKRouter.__qualname__ = "LingGroupedTopKRouter"
    return LingGroupedTopKRouter


@functools.cache
def ling_runner_class():
    """vllm-ling's subclass of vLLM's ``MoERunner``, built on first use."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    class LingMoERunner(MoERunner):
        """MoERunner that routes Ling's MoE layers with vllm-ling's grouped top-k kernel."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.ling_route(self.router)

        def ling_route(self, router) -> Selection:
            """Decide for ``router`` (the one vLLM built), record the selection and hold the router
            that serves it: the kernel's, taking over ``router``'s routing, or ``router``."""
            facts = router_facts(router, str(getattr(self, "layer_name", "") or "an MoE layer"), _ling_model())
            selection = record(self, decide(facts, LingOptions.current(), serving_platform()))
            self.router = ling_router_class().taking_over(router) if selection.choice is RouterTopk.LING else router
            return selection

    LingMoERunner.__qualname__ = "LingMoERunner"
    return LingMoERunner


def served(runner) -> Served:
    """What a runner's router serves, read from the router it holds (vLLM's own runner class:
    nothing of vllm-ling's, named)."""
    router = getattr(runner, "router", None)
    if type(router) is ling_router_class():
        return Served.of(RouterTopk.LING)
    return Served.of(RouterTopk.VLLM, label=f"vLLM's {type(router).__name__}")


def _is_runner(module) -> bool:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return isinstance(module, MoERunner)


READER = Reader(
    Feature.ROUTER_TOPK, "router_topk", "MoE routers' top-k", _is_runner, served,
    f"another plugin replaced vLLM's MoERunner (see the WARNING naming it), or opt out with "
    f"{opt_out_setting(TOPK_OPTION)}; a router serving other than its selection is a defect: report it",
    expected=expected_layers, optimization="router_topk", optimizing=frozenset({RouterTopk.LING}),
    known_answers="router_topk")


def register_router_topk() -> list[str]:
    """Install :class:`LingMoERunner` for every ``MoERunner`` (every platform: each records its
    selection; only CUDA's can be the kernel). Idempotent. Returns what was registered."""
    from vllm.platforms import current_platform

    return install_out_of_tree(IN_TREE_NAME, ling_runner_class(),
                               _DESCRIPTION if current_platform.is_cuda() else _CPU_DESCRIPTION)
