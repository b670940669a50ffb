"""Startup verification of the router GEMV: which MoE router gates of the loaded target and
draft run it, read from the modules, and the report's ``router_gemv`` optimization entry.

Every ``GateLinear`` found is counted: vllm-ling's subclass with the kernel path on, vllm-ling's
subclass on GateLinear's path (with the reason its selection gave at construction), or vLLM's own
class (the subclass was not installed). Each of vllm-ling's gates must serve the selection recorded
on it (:func:`vllm_ling.ops.small_gemv.selection.select_router_gemv`); the optimization is requested
where a gate selected the kernel, and active only where every gate runs it and the kernel passed
its known answers (``kernel_checks``: ``router_gemv``). On the CPU platform it is not applicable:
vLLM's GateLinear is built there and nothing is warned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_ling.options import opt_out_setting

CHECK_NAME = "router_gates"
OPT_OUT = opt_out_setting("VLLM_LING_ROUTER_GEMV")


@dataclasses.dataclass
class GateCensus:
    total: int = 0
    serving: int = 0
    off: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> gates on GateLinear's path
    foreign: list[str] = dataclasses.field(default_factory=list)   # vLLM's own GateLinear class
    diverging: list[str] = dataclasses.field(default_factory=list)  # not serving their recorded selection
    selected: int = 0  # gates whose recorded selection is the router GEMV

    @property
    def requested(self) -> bool:
        return self.selected > 0

    def describe(self) -> str:
        text = f"{self.serving} of {self.total} MoE router gates on the router GEMV"
        text += "".join(f"; {n} x GateLinear's path: {why}" for why, n in sorted(self.off.items()))
        if self.foreign:
            text += f"; {len(self.foreign)} x vLLM's GateLinear class ({', '.join(self.foreign[:3])})"
        if self.diverging:
            text += f"; not the recorded selection: {self.diverging[:3]}"
        return text


def gate_census(target, draft) -> GateCensus:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from vllm_ling.layers.router_gate_cuda import served_path
    from vllm_ling.ops.small_gemv.selection import GemvPath
    from vllm_ling.selection import Feature, recorded

    census = GateCensus()
    for label, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        for name, m in model.named_modules():
            if not isinstance(m, GateLinear):
                continue
            census.total += 1
            served, sel = served_path(m), recorded(m, Feature.ROUTER_GEMV)
            if served is None:
                census.foreign.append(f"{label}.{name}")
                continue
            census.selected += sel is not None and sel.choice is GemvPath.LING
            if sel is None or served is not sel.choice:
                census.diverging.append(f"{label}.{name} (selected {sel.choice if sel else 'nothing'}, serves {served})")
            if served is GemvPath.LING:
                census.serving += 1
            else:
                why = m.ling_router_gemv_reason or f"logits dtype {m.out_dtype}, not float32"
                census.off[why] = census.off.get(why, 0) + 1
    return census


def check_router_gates(census: GateCensus, platform: str) -> tuple[bool, str, str, str]:
    """The ``router_gates`` check's (passed, expected, actual, fix)."""
    if platform == "cpu":
        return (census.serving == 0, "vLLM's GateLinear path (not applicable on the CPU platform)", census.describe(),
                "the router GEMV served on the CPU platform")
    return (not census.foreign and not census.diverging,
            "every MoE router gate is vllm-ling's GateLinear, serving its recorded selection (the router GEMV "
            "wherever the kernel holds it)", census.describe(),
            f"another plugin replaced vLLM's GateLinear (see the WARNING naming it), or opt out with {OPT_OUT}; a "
            "gate serving other than its selection is a defect: report it")


def router_kernel_passed(known: dict[str, Any]) -> bool | None:
    """The router GEMV's known-answer verdict (None: not run, no gate serves it)."""
    runs = [r for r in known["results"] if r["name"] == "router_gemv" and not r["skipped"]]
    return all(r["passed"] for r in runs) if runs else None


def optimization_entry(census: GateCensus, check_passed: bool, platform: str, known: dict[str, Any]) -> dict[str, Any]:
    """The report's ``optimizations.router_gemv``: requested where a gate selected the kernel,
    active where every gate runs it and the kernel passed its known answers."""
    if platform == "cpu":
        return {"requested": False, "active": False,
                "detail": "not applicable on the CPU platform: vLLM's GateLinear path is unchanged"}
    if not census.requested:
        return {"requested": False, "active": False, "detail": f"not selected: {census.describe()}"}
    kernel = router_kernel_passed(known)
    active = check_passed and census.total > 0 and census.serving == census.total and kernel is True
    verdict = {None: "not run", True: "passed", False: "FAILED"}[kernel]
    return {"requested": True, "active": active, "detail": f"{census.describe()}; known answers {verdict}"}
