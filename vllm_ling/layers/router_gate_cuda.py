"""Ling's MoE router gate on CUDA: vllm-ling's one-launch GEMV for decode-sized batches.

vLLM 0.32 builds Ling's gate as ``GateLinear(hidden, num_experts, out_dtype=float32,
params_dtype=float32)``. For an fp32 gate of Ling's shape none of GateLinear's specialized tiers
applies on sm_90 or sm_121: it casts the tokens to fp32 and runs cuBLAS's fp32 GEMM, two launches
(``benchmarks/results/small_gemv_h200.md``). :class:`LingGateLinear` *is* GateLinear (same
parameters, loaders and every tier); for a gate the router GEMV holds (fp32, unquantized,
bias-free, fp32 logits, a hidden size :func:`vllm_ling.ops.small_gemv.router.shape_problems` accepts, and no
specialized vLLM kernel for it on this GPU) it runs :func:`vllm_ling.ops.small_gemv.router.router_logits` for
batches of 1..``MAX_ROWS`` BF16 tokens and GateLinear's own forward otherwise. The decision is
made at construction, before weights load; a gate it does not hold keeps GateLinear's path, so
other models and every other platform are unchanged.

vLLM compiles the model with ``torch.compile(fullgraph=True)`` and symbolic batch sizes, so the
choice by row count happens inside one custom op (``vllm_ling::router_logits``, the gate found by
name as vLLM's own layer ops do), never as a Python branch on the traced batch size.

Installed through vLLM's out-of-tree layer mechanism (``PluggableLayer.register_oot``, keyed by
the in-tree class name), on every platform (:func:`register_router_gate`): each gate records its
selection, which on the CPU platform is GateLinear's path (the kernel is CUDA's), unchanged. The
startup verification reads each gate back (:data:`READER`) and runs the kernel on known answers
(``runtime/verification/``).
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_ling.layers.op_layers import LayersByName
from vllm_ling.layers.out_of_tree import install_out_of_tree
from vllm_ling.log import get_logger, log_once
from vllm_ling.options import LingOptions, RouterGemv, opt_out_setting
from vllm_ling.ops.small_gemv import router as router_ops
from vllm_ling.ops.small_gemv.selection import (NOT_A_GEMV_GATE, ROUTER_OPTION, GateFacts, GemvPath,
                                                RouterGemvUnavailable, select_router_gemv)
from vllm_ling.selection import Feature, Platform, Reader, Selection, Served, record, serving_platform

logger = get_logger("router")

IN_TREE_NAME = "GateLinear"
KERNEL_LABEL = f"vllm-ling router GEMV (<= {router_ops.MAX_ROWS} tokens)"
_DESCRIPTION = (f"MoE router gates (CUDA): {KERNEL_LABEL}, GateLinear's path above, for the fp32 gates GateLinear "
                "runs as cast + F.linear")
_CPU_DESCRIPTION = "MoE router gates (CPU): GateLinear's path, recorded per gate"
__all__ = ["READER", "GateFacts", "RouterGemvUnavailable", "decide", "register_router_gate", "router_gate_class",
           "served"]


def decide(facts: GateFacts, options: LingOptions, device: torch.device | str | None = None,
           platform: Platform = Platform.CUDA) -> Selection:
    """The gate's selection (:func:`~vllm_ling.ops.small_gemv.selection.select_router_gemv`), said
    once: opted out, one WARNING; not a gate the kernel is for (quantized, bias, not fp32 weights and
    logits), once at INFO; a gate of that kind the kernel cannot hold, one WARNING per reason; the
    CPU platform says nothing (GateLinear's path, as without vllm-ling).
    Raises :class:`RouterGemvUnavailable` where the kernel holds the gate and cannot run here."""
    selection = select_router_gemv(options, platform, facts,
                                   unavailable_reason=lambda: router_ops.unavailable_reason(device))
    reason = selection.reason
    if platform is Platform.CPU:
        pass
    elif selection.choice is GemvPath.LING:
        log_once(logger, logging.INFO, "router-gemv-on", "MoE router gates: %s.", KERNEL_LABEL)
    elif options.router_gemv is RouterGemv.VLLM:
        log_once(logger, logging.WARNING, "router-gemv-opt-out",
                 "Router GEMV is OFF by explicit choice (%s): MoE gates run vLLM's GateLinear path; the startup "
                 "report marks router_gemv inactive.", opt_out_setting(ROUTER_OPTION))
    elif reason.startswith(NOT_A_GEMV_GATE):
        log_once(logger, logging.INFO, f"router-gemv-kind-{reason}",
                 "%s and similar gates keep vLLM's GateLinear path: %s.", facts.prefix, reason)
    else:
        log_once(logger, logging.WARNING, f"router-gemv-off-{reason}",
                 "Router GEMV off for %s (%d experts x %d) and similar gates: %s; vLLM's GateLinear path serves "
                 "them (the startup check router_gates reports it).", facts.prefix, facts.num_experts,
                 facts.hidden_size, reason)
    return selection


_GATES = LayersByName()  # op name -> gate (layers/op_layers.py: why names are prefixes)


def register_gate(gate: torch.nn.Module, prefix: str) -> str:
    """The op's name for ``gate``: its prefix, suffixed where another live gate holds it."""
    return _GATES.register(gate, prefix, "gate")


def _router_logits_impl(x: torch.Tensor, gate_name: str) -> torch.Tensor:
    gate = _GATES[gate_name]
    if 1 <= x.shape[0] <= router_ops.MAX_ROWS:
        return router_ops.router_logits(router_ops.kernel_rows(x), gate.weight)
    return gate.vllm_gate_logits(x)


def _router_logits_fake(x: torch.Tensor, gate_name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], _GATES[gate_name].weight.shape[0]), dtype=torch.float32)


router_logits_op = torch.library.custom_op("vllm_ling::router_logits", _router_logits_impl, mutates_args=())
router_logits_op.register_fake(_router_logits_fake)


def _vllm_kernel(gate) -> str | None:
    """GateLinear's own specialized tier for this (fp32) gate on this GPU, if any."""
    for flag, name in (("allow_fp32_router_gemm", "fp32 router GEMM"),
                       ("allow_bf16x3_router_gemm", "BF16x3 router GEMM"),
                       ("allow_rocm_bf16x3_router_gemm", "ROCm BF16x3 router GEMM")):
        if getattr(gate, flag, False):
            return name
    return None


@functools.cache
def router_gate_class():
    """vllm-ling's subclass of vLLM's ``GateLinear``, built on first use: importing vLLM's layer
    must wait for the platform."""
    from vllm import envs
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    class LingGateLinear(GateLinear):
        """GateLinear whose fp32 gates run vllm-ling's router GEMV at decode sizes."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            device = self.weight.device if self.weight.device.type == "cuda" else None
            self.ling_router_key = register_gate(self, self.prefix)
            self.ling_platform = serving_platform()
            self._select(decide(self.gate_facts(), LingOptions.current(), device, self.ling_platform))

        def _select(self, selection: Selection) -> None:
            """Record the selection and dispatch by it (``ling_router_gemv_reason``: None where the
            router GEMV serves; verification compares the two)."""
            record(self, selection)
            self.ling_router_gemv_reason = None if selection.choice is GemvPath.LING else selection.reason

        def gate_facts(self) -> GateFacts:
            return GateFacts(prefix=self.prefix, num_experts=self.output_size, hidden_size=self.input_size,
                             weight_dtype=self.weight.dtype, has_bias=self.bias is not None,
                             unquantized=self.is_unquantized, out_dtype=self.out_dtype,
                             vllm_kernel=_vllm_kernel(self), batch_invariant=bool(envs.VLLM_BATCH_INVARIANT))

        @property
        def ling_router_gemv(self) -> bool:
            """The router GEMV serves this gate's batches of 1..MAX_ROWS BF16 tokens (fp32 logits:
            a gate built without ``out_dtype`` takes it once ``set_out_dtype(float32)`` is called)."""
            return self.ling_router_gemv_reason is None and self.out_dtype == torch.float32

        def set_out_dtype(self, out_dtype: torch.dtype) -> None:
            super().set_out_dtype(out_dtype)
            if self.ling_router_gemv_reason is None and out_dtype != torch.float32:
                self._select(decide(self.gate_facts(), LingOptions(router_gemv=RouterGemv.LING),
                                    platform=self.ling_platform))

        def vllm_gate_logits(self, x: torch.Tensor) -> torch.Tensor:
            """GateLinear's own forward (every tier), logits only."""
            out = super().forward(x)
            return out[0] if isinstance(out, tuple) else out

        def forward(self, x: torch.Tensor):
            # static facts only (dtype, rank, attributes): the row count is decided inside the op
            if not self.ling_router_gemv or x.dtype != torch.bfloat16 or x.dim() != 2:
                return super().forward(x)
            return self._return(torch.ops.vllm_ling.router_logits(x, self.ling_router_key))

    LingGateLinear.__qualname__ = "LingGateLinear"
    return LingGateLinear


def served(gate) -> Served:
    """What a gate serves at decode sizes, read from its dispatch state (vLLM's own class: nothing of
    vllm-ling's, named)."""
    if not hasattr(gate, "ling_router_gemv_reason"):
        return Served.of(None, label="vLLM's GateLinear class")
    return Served.of(GemvPath.LING if gate.ling_router_gemv else GemvPath.VLLM)


def _is_gate(module) -> bool:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    return isinstance(module, GateLinear)


READER = Reader(
    Feature.ROUTER_GEMV, "router_gates", "MoE router gates", _is_gate, served,
    f"another plugin replaced vLLM's GateLinear (see the WARNING naming it), or opt out with "
    f"{opt_out_setting(ROUTER_OPTION)}; a gate serving other than its selection is a defect: report it",
    optimization="router_gemv", optimizing=frozenset({GemvPath.LING}), known_answers="router_gemv")


def register_router_gate() -> list[str]:
    """Install :class:`LingGateLinear` for every ``GateLinear`` (every platform: each gate records its
    selection; only CUDA's can be the router GEMV).

    Idempotent (vLLM loads plugins in every process, sometimes twice). Returns what was
    registered, for the plugin's single INFO line.
    """
    from vllm.platforms import current_platform

    return install_out_of_tree(IN_TREE_NAME, router_gate_class(),
                               _DESCRIPTION if current_platform.is_cuda() else _CPU_DESCRIPTION)
