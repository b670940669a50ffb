"""The prefill-graphs family: the capture sizes in force in this worker reach as far as patch P13
recorded (:mod:`vllm_ling.runtime.prefill_graphs`), and the report's ``prefill_graphs`` entry."""

from __future__ import annotations

from typing import Any

from vllm_ling.options import opt_out_setting
from vllm_ling.runtime.prefill_graphs import SERVING, graphs_in_force, recorded_prefill_graphs
from vllm_ling.runtime.verification.checks import Check

CHECK_NAME = "prefill_graphs"


def _describe(up_to: int) -> str:
    return f"prefill steps up to {up_to} tokens replay piecewise CUDA graphs" if up_to else "no piecewise CUDA graphs"


def check_prefill_graphs(vllm_config) -> Check:
    """The recorded decision against the sizes this worker's model runner will capture."""
    recorded = recorded_prefill_graphs(vllm_config.model_config.hf_config)
    up_to = graphs_in_force(vllm_config.compilation_config)
    actual = _describe(up_to)
    if recorded is None:  # P13 never ran: vLLM sized no graphs here (the CPU platform)
        return Check(CHECK_NAME, up_to == 0, "no CUDA graphs (vLLM sized none on this platform)", actual,
                     "patch P13 did not run where vLLM sized CUDA graphs: check `vllm_ling.patches.registry`")
    expected = f"{_describe(recorded.up_to)} ({recorded.choice}: {recorded.reason})"
    return Check(CHECK_NAME, up_to == recorded.up_to, expected, actual,
                 "something changed the capture sizes after vllm-ling added its prefill sizes: pass "
                 "`--compilation-config '{\"cudagraph_capture_sizes\": [...]}'` to set them yourself, or "
                 f"{opt_out_setting('VLLM_LING_PREFILL_GRAPH_TOKENS')}")


def prefill_graphs_entry(vllm_config, row: Check) -> dict[str, Any]:
    """Requested where vllm-ling's sizes apply (added, or vLLM's already reach the limit); active where
    the row passed."""
    recorded = recorded_prefill_graphs(vllm_config.model_config.hf_config)
    if recorded is None or recorded.choice not in SERVING:
        why = recorded.reason if recorded is not None else "no CUDA graphs on this platform"
        return {"requested": False, "active": False, "detail": f"not selected: {why}"}
    return {"requested": True, "active": row.passed and recorded.up_to > 0, "detail": row.actual}
