"""``VLLM_LING_NEGATIVE_CONTROL=weight_only_head`` (tests): rebuild the upstream head-sharing trap on
purpose before the checks run, so the tests prove the verification refuses it."""

from __future__ import annotations

import logging

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import read

logger = get_logger("verify")


def apply_negative_control(target, draft) -> None:
    mode = read("VLLM_LING_NEGATIVE_CONTROL") or ""
    if not mode:
        return
    if mode != "weight_only_head":
        raise ValueError(f"VLLM_LING_NEGATIVE_CONTROL={mode!r}: the only control is 'weight_only_head'")
    if draft is None:
        return
    from vllm_ling.models.ling3_mtp import build_weight_only_trap

    trap = build_weight_only_trap(target.lm_head)
    for layer in draft.model.layers.values():
        layer.shared_head.head = trap
    draft.lm_head = trap
    draft.ling_sharing_path = "NEGATIVE CONTROL: weight tensor only (the trap)"
    log_once(logger, logging.WARNING, "negative-control",
             "NEGATIVE CONTROL active: the NEXTN draft uses the target's FP8 head weight without its "
             "scales or method (the silent-degradation trap, on purpose)")
