"""When NEXTN MTP pays off: the cost model behind the default speculative config; and which
speculative method serves (:func:`select_speculation`, the one place it is decided: patch P5 calls
it and records the answer on the target's config, the startup verification proves it).

One MTP cycle at batch size b drafts k tokens per sequence and verifies k+1 positions per
sequence; it emits ``accept_length`` tokens per sequence, where plain decoding emits one per
step. So

    speedup(b) = accept_length / cost_ratio(b),   break-even accept length = cost_ratio(b)

with ``cost_ratio(b) = (verify over b*(k+1) tokens + k draft steps) / (plain step over b
tokens)``. Decode is bandwidth-bound, so each step costs the bytes it reads, taken from
``vllm-ling plan``'s byte model (``models/cost_model.py``: weights, distinct routed experts
touched under uniform routing, KDA state and MLA cache). Verifying 4 positions at batch 1
touches up to 32 experts instead of 8, which is why verify is not free; at larger batch the
plain step already touches most experts and the ratio falls again. Bytes alone give 1.98 at
batch 1; the study measured ``STUDY_VERIFY_COST_BATCH1`` (small steps use bandwidth less well), so the curve is
scaled to that measured point.

Where the break-even exceeds the accept length the model really reaches (2.68 on GSM8K in
the study, not the 3.90 of repetitive synthetic prompts), speculation is switched off for
that batch-size range through vLLM's own dynamic schedule
(``num_speculative_tokens_per_batch_size``). Compute is not modelled: on DGX Spark and H200
the decode batch sizes Ling serves stay bandwidth-bound.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from vllm_ling.models.cost_model import build_plan, dspark_model, mtp_model, totals
from vllm_ling.models.names import SPECULATION_ATTR
from vllm_ling.options import STUDY_VERIFY_COST_BATCH1, Choice, Drafter, LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Selection

STUDY_ACCEPT_LENGTH_GSM8K = 2.68
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "data" / "ling3_flash_fp4_config.json"
DEFAULT_DSPARK_CONFIG = Path(__file__).resolve().parent.parent / "data" / "ling3_flash_dspark_config.json"
CONTEXT_TOKENS = 4096  # KV/state reads at a typical chat context; small next to the weights
HEAD = "fp8"


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or DEFAULT_CONFIG).read_text())


class CostModel:
    """Bytes-per-step cost ratios for one config, scaled to the study's batch-1 point."""

    def __init__(self, config: dict[str, Any], num_spec_tokens: int,
                 calibrate_to: float = STUDY_VERIFY_COST_BATCH1):
        self.config = config
        self.k = num_spec_tokens
        self.scale = calibrate_to / self.raw_ratio(1)

    @functools.lru_cache(maxsize=None)
    def step_bytes(self, tokens: int) -> float:
        """Bytes of one forward over ``tokens`` positions (one per sequence or drafts)."""
        return totals(build_plan(self.config, context=CONTEXT_TOKENS, verify_tokens=tokens), HEAD)[1]

    @functools.lru_cache(maxsize=None)
    def draft_bytes(self) -> float:
        plan = build_plan(self.config, context=CONTEXT_TOKENS, verify_tokens=self.k + 1)
        return mtp_model(plan, HEAD, self.k)["draft_cost_ratio"] * totals(plan, HEAD)[0]

    def raw_ratio(self, batch: int) -> float:
        return (self.step_bytes(batch * (self.k + 1)) + self.draft_bytes()) / self.step_bytes(batch)

    def break_even(self, batch: int) -> float:
        """Accept length above which MTP is faster than plain decoding at this batch size."""
        return self.raw_ratio(batch) * self.scale


def dspark_break_even(num_spec_tokens: int, config: dict[str, Any] | None = None,
                      drafter_config: dict[str, Any] | None = None) -> float:
    """DSpark's break-even accept length at batch 1: a verify over ``num_spec_tokens + 1``
    positions plus one draft cycle, in plain decode steps, from the same bytes model as MTP's and
    scaled the same way to the study's measured MTP point (no DSpark measurement exists yet)."""
    from vllm_ling.models.dspark_format import read_fields

    config = config or load_config()
    fields = read_fields(drafter_config or load_config(DEFAULT_DSPARK_CONFIG), "drafter config")
    plan = build_plan(config, context=CONTEXT_TOKENS, verify_tokens=num_spec_tokens + 1)
    raw = dspark_model(plan, HEAD, fields, num_spec_tokens)["break_even_accept_length"]
    return raw * CostModel(config, 3).scale


def speculative_schedule(config: dict[str, Any] | None = None, num_spec_tokens: int = 3,
                         max_batch: int = 1024,
                         expected_accept_length: float = STUDY_ACCEPT_LENGTH_GSM8K
                         ) -> list[tuple[int, int, int]]:
    """vLLM ``num_speculative_tokens_per_batch_size`` ranges: k where MTP pays, else 0."""
    model = CostModel(config or load_config(), num_spec_tokens)
    ranges: list[tuple[int, int, int]] = []
    for b in range(1, max_batch + 1):
        k = num_spec_tokens if model.break_even(b) < expected_accept_length else 0
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], b, k)
        else:
            ranges.append((b, b, k))
    return ranges


VLLM_MTP_METHOD = "mtp"  # vLLM's name for NEXTN MTP in --speculative-config (parsed from vLLM's config)
VLLM_DSPARK_METHOD = "dspark"  # vLLM's name for its D-Spark runtime


class Speculation(Choice):
    """Which speculative config is in force for a Ling target, and by whose decision."""

    DEFAULT_MTP = "default_mtp"    # vllm-ling's default NEXTN MTP config
    DEFAULT_DSPARK = "default_dspark"  # vllm-ling's default config with the DSpark drafter given
    USER = "user"                  # the user's speculative config, served as given
    OFF = "off"                    # VLLM_LING_MTP=0: no speculation
    OFF_NO_NEXTN = "off_no_nextn"  # MTP wanted, but the checkpoint has no NEXTN layer to draft with
    OFF_PIPELINE = "off_pipeline"  # MTP wanted, but pipeline parallelism runs no draft (vLLM 0.32)


def select_speculation(options: LingOptions, user_gave: bool, nextn_layers: int, pipeline_parallel_size: int) -> Selection:
    """The speculative method for a Ling target: the user's config wins; else vllm-ling's default
    with the drafter ``VLLM_LING_DRAFTER`` names (DSpark when a drafter is given, else NEXTN MTP),
    unless speculation is switched off or nothing can draft (refusing what cannot serve, e.g. a
    DSpark drafter on CPU or a draft-model config under pipeline parallelism, is patch P5's,
    before this: ``config_hooks.check_dspark_request``)."""
    def sel(choice: Speculation, reason: str) -> Selection:
        return Selection(Feature.SPECULATIVE, choice, reason)

    if user_gave:
        return sel(Speculation.USER, "the user's --speculative-config")
    if not options.mtp:
        return sel(Speculation.OFF, opt_out_setting("VLLM_LING_MTP"))
    if options.resolved_drafter is Drafter.DSPARK:  # refused before this where it cannot serve
        return sel(Speculation.DEFAULT_DSPARK,
                   f"vllm-ling default: {VLLM_DSPARK_METHOD}, drafter {options.dspark_model}, its block_size tokens")
    if pipeline_parallel_size > 1:
        return sel(Speculation.OFF_PIPELINE, "pipeline parallelism: vLLM 0.32 runs no draft model there")
    if nextn_layers == 0:
        return sel(Speculation.OFF_NO_NEXTN, "the checkpoint has no NEXTN layers: num_nextn_predict_layers=0")
    return sel(Speculation.DEFAULT_MTP, f"vllm-ling default: {VLLM_MTP_METHOD}, {options.num_spec_tokens} tokens")


def record_speculation(hf_config, selection: Selection) -> None:
    """On the target's hf_config, which reaches every process; plain strings, so the config still
    serialises as JSON."""
    setattr(hf_config, SPECULATION_ATTR, {"choice": selection.choice.value, "reason": selection.reason})


def recorded_speculation(hf_config) -> Selection | None:
    """The selection P5 recorded on the target's hf_config (None: P5 did not decide, e.g. not a Ling
    target)."""
    raw = getattr(hf_config, SPECULATION_ATTR, None)
    if not raw:
        return None
    return Selection(Feature.SPECULATIVE, Speculation(raw["choice"]), raw["reason"])


def _recorded_is(vllm_config, choice: Speculation) -> bool:
    selection = recorded_speculation(vllm_config.model_config.hf_config)
    return selection is not None and selection.choice is choice


def no_nextn_layers(vllm_config) -> bool:
    return _recorded_is(vllm_config, Speculation.OFF_NO_NEXTN)


PP_NO_DRAFT_REASON = ("vLLM 0.32 cannot run a draft model with pipeline parallelism (its model runner reads "
                      "the drafter on every stage; only the last stage builds one)")


def pp_no_draft(vllm_config) -> bool:
    return _recorded_is(vllm_config, Speculation.OFF_PIPELINE)


def default_applied(vllm_config) -> bool:
    """Whether the speculative config in force is vllm-ling's default."""
    return _recorded_is(vllm_config, Speculation.DEFAULT_MTP) or _recorded_is(vllm_config, Speculation.DEFAULT_DSPARK)
