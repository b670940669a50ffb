"""The loaded target and draft are vllm-ling's classes (the plugin registered them): the NEXTN
draft for MTP, the DSpark drafter for D-Spark."""

from __future__ import annotations

from vllm_ling.runtime.verification.checks import Check
from vllm_ling.runtime.verification.speculative import Speculative
from vllm_ling.runtime.verification.stage import Stage


def check_model_classes(target, draft, spec: Speculative, stage: Stage | None = None) -> Check:
    from vllm_ling.models.ling3 import LingForCausalLM
    from vllm_ling.models.ling3_dspark import LingDSparkForCausalLM
    from vllm_ling.models.ling3_mtp import LingMTPModel

    actual = f"target {type(target).__name__}" + (f", draft {type(draft).__name__}" if draft is not None else "")
    draft_here = spec.draft_model and (stage is None or stage.is_last)  # vLLM runs the draft on the last stage
    draft_cls = LingDSparkForCausalLM if spec.dspark else LingMTPModel
    ok = isinstance(target, LingForCausalLM) and (
        isinstance(draft, draft_cls) if draft_here else not isinstance(draft, (LingMTPModel, LingDSparkForCausalLM)))
    expected = "target LingForCausalLM" + (f", draft {draft_cls.__name__}" if draft_here else
                                           f" (no draft on {stage.label()})" if spec.draft_model else "")
    return Check("model_classes", ok, expected, actual,
                 "vllm-ling's plugin did not register its classes: check VLLM_PLUGINS allows vllm_ling")
