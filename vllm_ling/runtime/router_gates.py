"""Startup verification of the router GEMV: which MoE router gates of the loaded target and
draft run it, read from the modules, and the report's ``router_gemv`` optimization entry.

Every ``GateLinear`` found is counted: vllm-ling's subclass with the kernel path on, vllm-ling's
subclass on GateLinear's path (with the reason it gave at construction), or vLLM's own class (the
subclass was not installed). The optimization is active only where every gate runs the kernel
and the kernel passed its known answers (``kernel_checks``: ``router_gemv``). On the CPU platform
it is not applicable: vLLM's GateLinear is built there and nothing is warned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

CHECK_NAME = "router_gates"
OPT_OUT = "VLLM_LING_ROUTER_GEMV=vllm"


@dataclasses.dataclass
class GateCensus:
    total: int = 0
    serving: int = 0
    off: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> gates on GateLinear's path
    foreign: list[str] = dataclasses.field(default_factory=list)   # vLLM's own GateLinear class

    def describe(self) -> str:
        text = f"{self.serving} of {self.total} MoE router gates on the router GEMV"
        text += "".join(f"; {n} x GateLinear's path: {why}" for why, n in sorted(self.off.items()))
        if self.foreign:
            text += f"; {len(self.foreign)} x vLLM's GateLinear class ({', '.join(self.foreign[:3])})"
        return text


def gate_census(target, draft) -> GateCensus:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    census = GateCensus()
    for label, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        for name, m in model.named_modules():
            if not isinstance(m, GateLinear):
                continue
            census.total += 1
            if not hasattr(m, "ling_router_gemv_reason"):
                census.foreign.append(f"{label}.{name}")
            elif m.ling_router_gemv:
                census.serving += 1
            else:
                why = m.ling_router_gemv_reason or f"logits dtype {m.out_dtype}, not float32"
                census.off[why] = census.off.get(why, 0) + 1
    return census


def _not_requested(platform: str) -> str:
    return ("not applicable on the CPU platform: vLLM's GateLinear path is unchanged" if platform == "cpu"
            else f"opted out ({OPT_OUT} or --router-gemv vllm): vLLM's GateLinear path")


def check_router_gates(census: GateCensus, requested: bool, platform: str) -> tuple[bool, str, str, str]:
    """The ``router_gates`` check's (passed, expected, actual, fix)."""
    if not requested:
        return (census.serving == 0, f"vLLM's GateLinear path ({_not_requested(platform)})", census.describe(),
                "the router GEMV served although it was not requested")
    return (not census.foreign,
            "every MoE router gate is vllm-ling's GateLinear, on the router GEMV wherever the kernel holds it",
            census.describe(),
            f"another plugin replaced vLLM's GateLinear (see the WARNING naming it), or opt out with {OPT_OUT}")


def router_kernel_passed(known: dict[str, Any]) -> bool | None:
    """The router GEMV's known-answer verdict (None: not run, no gate serves it)."""
    runs = [r for r in known["results"] if r["name"] == "router_gemv" and not r["skipped"]]
    return all(r["passed"] for r in runs) if runs else None


def optimization_entry(census: GateCensus, check_passed: bool, requested: bool, platform: str,
                       known: dict[str, Any]) -> dict[str, Any]:
    """The report's ``optimizations.router_gemv``: active where every gate runs the kernel and
    the kernel passed its known answers."""
    if not requested:
        return {"requested": False, "active": False, "detail": _not_requested(platform)}
    kernel = router_kernel_passed(known)
    active = check_passed and census.total > 0 and census.serving == census.total and kernel is True
    verdict = {None: "not run", True: "passed", False: "FAILED"}[kernel]
    return {"requested": True, "active": active, "detail": f"{census.describe()}; known answers {verdict}"}
