"""The loaded target and draft are vllm-ling's classes (the plugin registered them)."""

from __future__ import annotations

from vllm_ling.runtime.verification.checks import Check
from vllm_ling.runtime.verification.speculative import Speculative
from vllm_ling.runtime.verification.stage import Stage


def check_model_classes(target, draft, spec: Speculative, stage: Stage | None = None) -> Check:
    from vllm_ling.models.ling3 import LingForCausalLM
    from vllm_ling.models.ling3_mtp import LingMTPModel

    actual = f"target {type(target).__name__}" + (f", draft {type(draft).__name__}" if draft is not None else "")
    draft_here = spec.mtp and (stage is None or stage.is_last)  # vLLM runs the draft on the last stage
    ok = isinstance(target, LingForCausalLM) and (
        isinstance(draft, LingMTPModel) if draft_here else not isinstance(draft, LingMTPModel))
    expected = "target LingForCausalLM" + (", draft LingMTPModel" if draft_here else
                                           f" (no draft on {stage.label()})" if spec.mtp else "")
    return Check("model_classes", ok, expected, actual,
                 "vllm-ling's plugin did not register its classes: check VLLM_PLUGINS allows vllm_ling")
