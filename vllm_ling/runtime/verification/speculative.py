"""The speculative family: the speculative config in force is the one patch P5 selected and
recorded on the target's config (:func:`vllm_ling.runtime.spec_policy.select_speculation`), and
the report's ``mtp`` entry. (The DSpark drafter's own row and ``dspark`` entry come from its reader,
:mod:`vllm_ling.layers.dspark_drafter`.)"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_ling.options import LingOptions, opt_out_setting
from vllm_ling.runtime.spec_policy import VLLM_DSPARK_METHOD, VLLM_MTP_METHOD, Speculation, recorded_speculation
from vllm_ling.runtime.verification.checks import Check
from vllm_ling.selection import Selection

CHECK_NAME = "speculative_config"
_OFF_BY_DESIGN = {Speculation.OFF_NO_NEXTN: "the checkpoint has no NEXTN layers (num_nextn_predict_layers=0)",
                  Speculation.OFF_PIPELINE: "pipeline parallelism (vLLM 0.32 runs no draft model there)"}


@dataclasses.dataclass(frozen=True)
class Speculative:
    """The speculative config in force (vLLM's) and what P5 recorded (None: it did not decide)."""

    method: str | None
    num_speculative_tokens: int
    selection: Selection | None

    @property
    def mtp(self) -> bool:
        """The NEXTN draft is what speculates (another method, e.g. ngram, has no Ling draft)."""
        return self.method == VLLM_MTP_METHOD

    @property
    def dspark(self) -> bool:
        """A DSpark drafter is what speculates (vLLM's D-Spark runtime)."""
        return self.method == VLLM_DSPARK_METHOD

    @property
    def draft_model(self) -> bool:
        """A draft model vllm-ling loads (the NEXTN layer or the DSpark drafter) speculates."""
        return self.mtp or self.dspark

    @classmethod
    def in_force(cls, vllm_config) -> "Speculative":
        spec = vllm_config.speculative_config
        return cls(getattr(spec, "method", None), int(getattr(spec, "num_speculative_tokens", 0) or 0),
                   recorded_speculation(vllm_config.model_config.hf_config))


def check_speculative(spec: Speculative, options: LingOptions) -> Check:
    sel = spec.selection
    choice = sel.choice if sel is not None else None
    if choice is Speculation.DEFAULT_MTP:
        expected = f"{VLLM_MTP_METHOD}, {options.num_spec_tokens} tokens (vllm-ling default)"
        ok = spec.mtp and spec.num_speculative_tokens == options.num_spec_tokens
    elif choice is Speculation.DEFAULT_DSPARK:
        expected = f"{VLLM_DSPARK_METHOD}, drafter {options.dspark_model} (vllm-ling default)"
        ok = spec.dspark
    elif choice in (Speculation.OFF, Speculation.OFF_NO_NEXTN, Speculation.OFF_PIPELINE):
        expected, ok = f"off ({sel.reason})", spec.method is None
    elif choice is Speculation.USER:
        expected, ok = "as configured by the user", spec.method is not None
    elif options.mtp and spec.method is None:  # nothing recorded: P5 did not run for this target
        expected, ok = f"{VLLM_MTP_METHOD} (VLLM_LING_MTP=1; no speculative selection recorded)", False
    else:
        expected = "as configured by the user" if spec.method else f"off ({opt_out_setting('VLLM_LING_MTP')})"
        ok = True
    actual = f"{spec.method}, {spec.num_speculative_tokens} tokens" if spec.method else "off"
    return Check(CHECK_NAME, ok, expected, actual,
                 "pass --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'")


def mtp_entry(spec: Speculative, sharing: Check) -> dict[str, Any]:
    """The report's ``mtp``: active where the NEXTN draft speculates and shares the target's modules."""
    if spec.selection is not None and spec.selection.choice in _OFF_BY_DESIGN and spec.method is None:
        detail = "not requested: " + _OFF_BY_DESIGN[spec.selection.choice]
    elif spec.method is not None and not spec.mtp:
        detail = f"not requested: --speculative-config method {spec.method}"
    else:
        detail = sharing.actual
    return {"requested": spec.mtp, "active": spec.mtp and sharing.passed, "detail": detail}
