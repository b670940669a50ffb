"""The decode-splits family: the FlashAttention split bound in force in this worker is the one the
config hook recorded (:mod:`vllm_ling.runtime.decode_splits`), and the report's ``decode_splits`` entry.
After warm-up the worker reads the bound its metadata builders hold (:func:`confirm_builders`)."""

from __future__ import annotations

from typing import Any

from vllm_ling.log import get_logger
from vllm_ling.options import opt_out_setting
from vllm_ling.runtime.decode_splits import FALLBACK, SERVING, bound_in_force, recorded_decode_splits
from vllm_ling.runtime.verification.checks import Check
from vllm_ling.runtime.verification.optimizations import config_decision_entry

CHECK_NAME = "decode_splits"
logger = get_logger("verify")


def _describe(bound: int) -> str:
    return f"FlashAttention decode splits in CUDA graphs at most {bound}"


def check_decode_splits(vllm_config) -> Check:
    """The recorded decision against the bound this worker's metadata builders are built with."""
    recorded = recorded_decode_splits(vllm_config.model_config.hf_config)
    bound = bound_in_force(vllm_config)
    actual = _describe(bound)
    if recorded is None:
        return Check(CHECK_NAME, False, "a decision recorded by the config hook (P4)", actual,
                     "the config hook did not run for this model: check `vllm_ling.patches.registry`")
    expected = f"{_describe(recorded.bound)} ({recorded.choice}: {recorded.reason})"
    return Check(CHECK_NAME, bound == recorded.bound, expected, actual,
                 "something changed vLLM's attention_config after vllm-ling bounded the decode splits: pass "
                 "`--attention-config '{\"flash_attn_max_num_splits_for_cuda_graph\": N}'` to set it yourself, "
                 f"or {opt_out_setting('VLLM_LING_DECODE_SPLITS')}")


def decode_splits_entry(vllm_config, row: Check) -> dict[str, Any]:
    """Requested where the bound was raised, or where the budget kept vLLM's (a fallback: inactive); active
    where it was raised and the row passed (and, after warm-up, the builders hold it: :func:`confirm_builders`)."""
    return config_decision_entry(recorded_decode_splits(vllm_config.model_config.hf_config), SERVING, FALLBACK, row)


def confirm_builders(entry: dict[str, Any], builders: dict[str, list[int]], bound: int) -> dict[str, Any]:
    """The report entry once the metadata builders are built: active only where FlashAttention builders
    hold ``bound`` and none holds another cap (0: a builder for steps outside full graphs, where vLLM passes
    no bound at all). One WARNING where a raised bound is not what the builders hold; an entry not active
    (not asked for, or a fallback already said) is left as it is."""
    if not entry.get("active"):
        return entry
    capped = {n for values in builders.values() for n in values if n}
    held = ", ".join(f"{name} {'/'.join(map(str, values))}" for name, values in sorted(builders.items())) \
        or "no FlashAttention builder"
    if capped == {bound}:
        return {**entry, "detail": f"{entry['detail']}; metadata builders: {held}"}
    why = (f"the metadata builders hold {held}" if builders else
           "no FlashAttention metadata builder serves here (another attention backend, or no full CUDA graphs)")
    logger.warning("FlashAttention decode split bound %d is not in force: %s.", bound, why)
    return {**entry, "active": False, "detail": f"{entry['detail']}; not in force: {why}"}
