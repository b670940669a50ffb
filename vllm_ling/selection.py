"""What serves each feature, decided once and read back: :class:`Selection` and :class:`Reader`.

Each feature has one selector beside it (``ops/<feature>/selection.py``, or where its policy
lives): options + platform + layer shape -> the enum value that serves and why. The module that
serves the feature records the answer on itself (:func:`record`): the quant config or the layer
when it is built, and the layer again where a decision after loading changes what serves (an
explicit fallback, :attr:`Selection.fallback_from`). Warm-up compiles for the same value. The
startup verification reads every recorded value back (:func:`recorded`) and proves, through the
feature's :class:`Reader` (beside the layer, listed in :mod:`vllm_ling.layers.readers`), that
the module serves *that*, instead of deriving the choice a second time.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

from vllm_ling.options import Choice

SELECTIONS_ATTR = "vllm_ling_selections"  # on a module: {Feature: Selection}
# The report row proving a draft's head and embedding are the target's modules
# (runtime.verification.draft_sharing); a drafter's optimization needs it (Reader.needs_rows).
DRAFT_SHARING_ROW = "draft_shares_target_modules"


class Feature(Choice):
    MOE = "moe"                                  # routed-expert backend and decode mode
    DENSE_FP8 = "dense_fp8"                      # block-FP8 dense linears
    BF16_GEMV = "bf16_gemv"                      # the checkpoint's unquantized BF16 linears
    ROUTER_GEMV = "router_gemv"                  # the MoE router gates
    ROUTER_TOPK = "router_topk"                  # the MoE routers' grouped top-k
    FP8_HEAD = "fp8_head"                        # the LM head quantized to FP8, or the checkpoint's
    HEAD_KERNEL = "head_kernel"                  # the FP8 LM head's kernel
    KDA_MERGED_IN_PROJ = "kda_merged_in_proj"    # each KDA layer's q, k, v, f, g as one linear
    KDA_FUSED_CONV = "kda_fused_conv"            # each KDA layer's q, k, v short convolutions as one launch
    KDA_DECODE = "kda_decode"                    # each KDA layer's decode step after its in-projection as one launch
    KDA_OUTPUT_NORM = "kda_output_norm"          # each KDA layer's gated output norm inside that launch
    KDA_DIRECT_OUTPUT = "kda_direct_output"      # each KDA layer's output handed to the norm as a value
    SHARED_SWIGLU = "shared_swiglu_kernel"       # the shared experts' clamped SwiGLU as one kernel
    SPECULATIVE = "speculative"                  # the speculative method
    DRAFTER = "drafter"                          # the DSpark drafter: its block, what it reads and shares
    PREFILL_GRAPHS = "prefill_graphs"            # the CUDA graph sizes prefill steps replay
    DECODE_SPLITS = "decode_splits"              # FlashAttention's split-KV bound for decode in CUDA graphs
    RESIDUAL_NORM = "residual_norm"              # the decoder layers' residual add + RMSNorm


class Platform(Choice):
    CPU = "cpu"
    CUDA = "cuda"


def serving_platform() -> Platform:
    """The platform this vLLM process serves on (vLLM's own answer, asked when needed: vLLM resolves
    it after the plugins load)."""
    from vllm.platforms import current_platform

    return Platform.CPU if current_platform.is_cpu() else Platform.CUDA


@dataclasses.dataclass(frozen=True)
class Selection:
    feature: Feature
    choice: enum.Enum
    reason: str
    fallback_from: enum.Enum | None = None  # what the option asked for, where a later decision serves ``choice``

    def __post_init__(self) -> None:
        # enums end to end: a bare string here would compare equal to a typo-free enum by luck only
        if not isinstance(self.feature, Feature) or not isinstance(self.choice, enum.Enum):
            raise TypeError(f"Selection needs a Feature and an enum choice, got {self.feature!r}, {self.choice!r}")

    def served_as(self) -> tuple:
        """What a module serving this selection shows (its :class:`Reader` reads the same tuple):
        the choice, and in subclasses the switches it runs with."""
        return (self.choice,)


def record(module, selection: Selection) -> Selection:
    """Write ``selection`` on ``module`` (plain attribute: no nn.Module registration)."""
    selections = module.__dict__.setdefault(SELECTIONS_ATTR, {})
    selections[selection.feature] = selection
    return selection


def recorded(module, feature: Feature) -> Selection | None:
    """The selection recorded on ``module`` for ``feature`` (None: nothing selected it)."""
    return getattr(module, SELECTIONS_ATTR, {}).get(feature)


_BASE_FIELDS = ("feature", "choice", "reason", "fallback_from")


def record_on_config(hf_config, attr: str, selection: Selection) -> None:
    """A decision made on the config before any module exists, as plain values on the target's
    hf_config (it reaches every process with the config, which still serialises as JSON): the
    choice, the reason and a :class:`Selection` subclass's own fields."""
    extra = {f.name: getattr(selection, f.name) for f in dataclasses.fields(selection) if f.name not in _BASE_FIELDS}
    setattr(hf_config, attr, {"choice": selection.choice.value, "reason": selection.reason, **extra})


def recorded_on_config(hf_config, attr: str, cls: type[Selection], feature: Feature,
                       choices: type[enum.Enum]) -> Selection | None:
    """The decision :func:`record_on_config` wrote (None: nothing decided on this config)."""
    raw = getattr(hf_config, attr, None)
    if not raw:
        return None
    extra = {k: v for k, v in raw.items() if k not in ("choice", "reason")}
    return cls(feature, choices(raw["choice"]), raw["reason"], **extra)


@dataclasses.dataclass(frozen=True)
class Served:
    """What one module serves, read from its method and loaded state: ``(choice, *switches)`` as
    :meth:`Selection.served_as` gives it (``choice`` None: nothing of the feature's choices), and
    how the report names it."""

    key: tuple
    label: str

    @classmethod
    def of(cls, choice: enum.Enum | None, *switches, label: str | None = None) -> "Served":
        return cls((choice, *switches), label if label is not None else str(choice))


@dataclasses.dataclass(frozen=True)
class Reader:
    """How the startup verification reads one feature back from the modules that serve it.

    ``applies(module)``: the module is one that serves the feature (a vLLM class: every instance
    must carry a recorded selection); ``served(module)``: what it serves. ``check`` is the report
    row that proves it (features may share one), ``what`` names the modules (plural). Optional:
    ``expected(hf_config, stage, draft_here)``, how many such modules this pipeline stage holds
    (``draft_here``: the NEXTN draft, whose layers are the target's kinds, is in this process);
    ``uniform``, every module must record the same selection; ``optimization``, the report's
    optimizations entry (and metric label) with the ``optimizing`` choices that are it, requested
    where a module selected one (or fell back from one), active where the check passed and every
    module (``needs_all``) or one serves one, the known-answer results named ``known_answers``
    passed, and the report rows named in ``needs_rows`` passed (a drafter's sharing of the
    target's modules).
    """

    feature: Feature
    check: str
    what: str
    applies: Callable[[Any], bool]
    served: Callable[[Any], Served]
    fix: str
    expected: Callable[[Any, Any, bool], int] | None = None
    uniform: bool = False
    optimization: str | None = None
    optimizing: frozenset = frozenset()
    needs_all: bool = True
    known_answers: str | None = None
    needs_rows: tuple[str, ...] = ()
