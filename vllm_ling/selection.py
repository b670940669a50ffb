"""What serves each feature, decided once: the :class:`Selection` a feature's selector returns.

Each feature has one selector beside it (``ops/<feature>/selection.py``, or where its policy
lives): options + platform + layer shape -> the enum value that serves and why. The quant config
builds the layer's method from that value and records it on the layer (:func:`record`); warm-up
compiles for the same value; the startup verification reads the recorded value back
(:func:`recorded`) and proves the layer runs *that*, instead of deriving the choice a second time.
"""

from __future__ import annotations

import dataclasses
import enum

from vllm_ling.options import Choice

SELECTIONS_ATTR = "vllm_ling_selections"  # on a module: {Feature: Selection}


class Feature(Choice):
    MOE = "moe"                  # routed-expert backend and decode mode
    DENSE_FP8 = "dense_fp8"      # block-FP8 dense linears
    BF16_GEMV = "bf16_gemv"      # the checkpoint's unquantized BF16 linears
    ROUTER_GEMV = "router_gemv"  # the MoE router gates
    HEAD_KERNEL = "head_kernel"  # the FP8 LM head's kernel
    SPECULATIVE = "speculative"  # the speculative method


class Platform(Choice):
    CPU = "cpu"
    CUDA = "cuda"


@dataclasses.dataclass(frozen=True)
class Selection:
    feature: Feature
    choice: enum.Enum
    reason: str

    def __post_init__(self) -> None:
        # enums end to end: a bare string here would compare equal to a typo-free enum by luck only
        if not isinstance(self.feature, Feature) or not isinstance(self.choice, enum.Enum):
            raise TypeError(f"Selection needs a Feature and an enum choice, got {self.feature!r}, {self.choice!r}")


def record(module, selection: Selection) -> Selection:
    """Write ``selection`` on ``module`` (plain attribute: no nn.Module registration)."""
    selections = module.__dict__.setdefault(SELECTIONS_ATTR, {})
    selections[selection.feature] = selection
    return selection


def recorded(module, feature: Feature) -> Selection | None:
    """The selection recorded on ``module`` for ``feature`` (None: nothing selected it)."""
    return getattr(module, SELECTIONS_ATTR, {}).get(feature)
