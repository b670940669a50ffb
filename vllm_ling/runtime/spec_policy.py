"""When NEXTN MTP pays off: the cost model behind the default speculative config.

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

from vllm_ling.models.cost_model import build_plan, mtp_model, totals
from vllm_ling.options import STUDY_VERIFY_COST_BATCH1

# Set on the target's hf_config by patch P5 when vllm-ling's default speculative config is
# the one in force (the config object reaches every process; a global would not).
DEFAULT_SPEC_ATTR = "vllm_ling_default_spec"

STUDY_ACCEPT_LENGTH_GSM8K = 2.68
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "data" / "ling3_flash_fp4_config.json"
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


def mark_default_applied(hf_config) -> None:
    setattr(hf_config, DEFAULT_SPEC_ATTR, True)


# Set when MTP was wanted (VLLM_LING_MTP=1) but the checkpoint has no NEXTN layer to draft
# with: speculation is then off by design, not by failure.
NO_NEXTN_ATTR = "vllm_ling_no_nextn_layers"


def mark_no_nextn_layers(hf_config) -> None:
    setattr(hf_config, NO_NEXTN_ATTR, True)


def no_nextn_layers(vllm_config) -> bool:
    return bool(getattr(vllm_config.model_config.hf_config, NO_NEXTN_ATTR, False))


# Set when MTP was wanted but the server runs pipeline parallelism: vLLM 0.32 builds the draft
# on the last stage only and then reads it on every stage (gpu_model_runner's
# _check_and_update_cudagraph_mode), so speculation is off by design there.
PP_NO_DRAFT_ATTR = "vllm_ling_pp_no_draft"
PP_NO_DRAFT_REASON = ("vLLM 0.32 cannot run a draft model with pipeline parallelism (its model runner reads "
                      "the drafter on every stage; only the last stage builds one)")


def mark_pp_no_draft(hf_config) -> None:
    setattr(hf_config, PP_NO_DRAFT_ATTR, True)


def pp_no_draft(vllm_config) -> bool:
    return bool(getattr(vllm_config.model_config.hf_config, PP_NO_DRAFT_ATTR, False))


def default_applied(vllm_config) -> bool:
    """Whether the speculative config in force is vllm-ling's default."""
    return bool(getattr(vllm_config.model_config.hf_config, DEFAULT_SPEC_ATTR, False))
