"""The report's ``optimizations``: for each feature with an optimization, whether it was requested
(a module selected it, or fell back from it) and is active (its row passed and the modules serve
it, its kernel's known answers included), read from the census and the rows; and the MoE decode
kernels, a part of the humming MoE that its experts build after loading."""

from __future__ import annotations

from typing import Any

from vllm_ling.ops.moe.selection import MoePath
from vllm_ling.options import MoeDecode
from vllm_ling.runtime.verification.census import Census
from vllm_ling.runtime.verification.checks import Check
from vllm_ling.runtime.verification.recorded import counts
from vllm_ling.selection import Feature, Reader

_VERDICT = {None: "not run", True: "passed", False: "FAILED"}


def config_decision_entry(recorded, serving: frozenset, fallback: frozenset, row: Check) -> dict[str, Any]:
    """The entry of a decision the config hook recorded (decode splits, residual norm): requested where it
    serves (``serving``) or fell back (``fallback``: inactive); active where it serves and ``row`` passed."""
    if recorded is not None and recorded.choice in fallback:
        return {"requested": True, "active": False, "detail": f"fallback: {recorded.reason}"}
    if recorded is None or recorded.choice not in serving:
        why = recorded.reason if recorded is not None else "no decision recorded"
        return {"requested": False, "active": False, "detail": f"not selected: {why}"}
    return {"requested": True, "active": row.passed, "detail": row.actual}


def known_answers_passed(known: dict[str, Any], name: str) -> bool | None:
    """The verdict of the known-answer results named ``name`` (None: none ran)."""
    runs = [r for r in known["results"] if r["name"] == name and not r["skipped"]]
    return all(r["passed"] for r in runs) if runs else None


def entry(reader: Reader, census: Census, row: Check, known: dict[str, Any], stage_has: int | None = None,
          needs: tuple[Check, ...] = ()) -> dict[str, Any]:
    """``stage_has``: how many modules of the feature this pipeline stage holds, where the reader
    knows; none (the head on an earlier stage) gives an entry the group's verdict leaves out.
    ``needs``: the report rows the reader's ``needs_rows`` names."""
    entries = census.of(reader.feature)
    if stage_has == 0 and not entries:
        return {"requested": False, "active": False, "detail": f"no {reader.what} on this pipeline stage",
                "on_stage": False}
    ours = reader.optimizing
    if not any(e.recorded and (e.recorded.choice in ours or e.recorded.fallback_from in ours) for e in entries):
        why = counts(e.recorded.reason if e.recorded else "no selection recorded" for e in entries)
        return {"requested": False, "active": False, "detail": f"not selected: {why or 'no ' + reader.what}"}
    serving = [e for e in entries if e.served.key[0] in ours]
    active = row.passed and (len(serving) == len(entries) if reader.needs_all else bool(serving))
    detail = row.actual
    if reader.known_answers:
        verdict = known_answers_passed(known, reader.known_answers)
        active = active and verdict is True
        detail += f"; known answers {_VERDICT[verdict]}"
    failed = [c.name for c in needs if not c.passed]
    if failed:
        active = False
        detail += f"; needs {', '.join(failed)}, which failed"
    return {"requested": True, "active": active, "detail": detail}


def moe_decode_entry(census: Census) -> dict[str, Any]:
    """The fused decode kernels for batches of at most VLLM_LING_MOE_DECODE_MAX_TOKENS tokens:
    requested where a humming MoE layer selected a decode mode, active where every humming layer's
    experts built them (where they cannot run, humming's GEMM serves: one WARNING, reported here)."""
    humming = [e for e in census.of(Feature.MOE) if e.recorded is not None and e.recorded.choice is MoePath.HUMMING]
    if not humming:
        return {"requested": False, "active": False, "detail": "needs the humming MoE backend on CUDA"}
    requested = any(e.recorded.decode is not MoeDecode.OFF for e in humming)
    methods = [e.module.quant_method for e in humming if hasattr(e.module.quant_method, "decode_active")]
    detail = counts(qm.decode_status or "not built" for qm in methods) or "no humming MoE layers"
    active = requested and bool(methods) and all(qm.decode_active for qm in methods)
    return {"requested": requested, "active": active, "detail": detail}


def moe_backend(census: Census) -> MoePath:
    """What the MoE layers selected (the first one's; the row fails where another differs), vLLM's
    backend where nothing of ours selected."""
    first = next((e.recorded for e in census.of(Feature.MOE) if e.recorded is not None), None)
    return first.choice if first is not None else MoePath.VLLM
