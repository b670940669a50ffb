"""When NEXTN MTP pays off: the cost model behind the default speculative config.

One MTP cycle drafts k tokens and verifies k+1 positions; it emits ``accept_length``
tokens on average, where plain decoding emits one token per step. So

    speedup = accept_length / verify_cost_ratio,   break-even accept length = verify_cost_ratio

with ``verify_cost_ratio = t(b * (k+1)) / t(b)`` (draft cost folded in), t(n) the time
of a forward over n tokens. Decode of this MoE is a roofline: t(n) = max(bytes(n) / BW,
flops(n) / FLOPS), bytes(n) = weights every token reads (dense, attention, routers,
shared expert, head) + distinct routed experts touched, ``E * (1 - (1 - topk/E)**n)``
per MoE layer under uniform routing. Verifying 4 positions at batch 1 touches up to 32
experts instead of 8, which is why verify is not free. The study measured the ratio at
2.26 at batch 1; the roofline gives the shape in batch size and is scaled to that point.

Above the batch size where the break-even accept length exceeds the accept length the
model really reaches (2.68 on GSM8K in the study, not the 3.90 of repetitive synthetic
prompts), speculation is switched off through vLLM's own dynamic schedule
(``num_speculative_tokens_per_batch_size``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from vllm_ling.models.checkpoint_format import checkpoint_specs, stored_bytes

STUDY_VERIFY_COST_BATCH1 = 2.26  # normal steps per verify of 4 positions, DGX Spark, batch 1
STUDY_ACCEPT_LENGTH_GSM8K = 2.68
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "data" / "ling3_flash_fp4_config.json"


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    bandwidth_gbs: float
    bf16_tflops: float


DEVICES = {
    "spark": Device("DGX Spark (GB10)", 273.0, 100.0),
    "h200": Device("H200", 4800.0, 989.0),
}


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    fixed_bytes: float  # read once per forward, whatever the batch
    bytes_per_expert: float  # one routed expert (gate, up, down with scales)
    moe_layers: int
    num_experts: int
    top_k: int
    active_params: float  # multiply-accumulates per token

    @classmethod
    def from_config(cls, config: dict[str, Any], head_bytes_per_param: float = 1.0) -> "DecodeCost":
        fixed = per_expert = 0.0
        active = 0.0
        for spec in checkpoint_specs(config, include_mtp=False):
            if spec.tensor_class == "embeddings":
                continue  # a gather, not a read of the table
            if spec.tensor_class == "head":
                fixed += spec.numel * head_bytes_per_param
                active += spec.numel
            elif spec.tensor_class == "routed_experts":
                if spec.layer == config["first_k_dense_replace"] and spec.expert == 0:
                    per_expert += stored_bytes(spec)
            else:
                fixed += stored_bytes(spec)
                active += spec.numel
        moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
        k = config["num_experts_per_tok"]
        active += moe_layers * k * 3 * config["hidden_size"] * config["moe_intermediate_size"]
        return cls(fixed, per_expert, moe_layers, config["num_experts"], k, active)

    def experts_touched(self, tokens: int) -> float:
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def forward_time(self, tokens: int, device: Device) -> float:
        bytes_read = self.fixed_bytes + self.moe_layers * self.experts_touched(tokens) * self.bytes_per_expert
        flops = 2.0 * self.active_params * tokens
        return max(bytes_read / (device.bandwidth_gbs * 1e9), flops / (device.bf16_tflops * 1e12))

    def verify_cost_ratio(self, batch: int, num_spec_tokens: int, device: Device,
                          calibrate_to: float = STUDY_VERIFY_COST_BATCH1) -> float:
        def raw(b: int) -> float:
            return self.forward_time(b * (num_spec_tokens + 1), device) / self.forward_time(b, device)

        return raw(batch) * calibrate_to / raw(1)


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or DEFAULT_CONFIG).read_text())


def disable_batch_size(config: dict[str, Any] | None = None, num_spec_tokens: int = 3,
                       device: str = "spark", expected_accept_length: float = STUDY_ACCEPT_LENGTH_GSM8K,
                       max_batch: int = 1024) -> int:
    """Largest batch size at which MTP is still expected to pay off (>= 1)."""
    cost = DecodeCost.from_config(config or load_config())
    dev = DEVICES[device]
    last_good = 1
    for b in range(1, max_batch + 1):
        if cost.verify_cost_ratio(b, num_spec_tokens, dev) < expected_accept_length:
            last_good = b
        else:
            break
    return last_good


def speculative_schedule(config: dict[str, Any] | None = None, num_spec_tokens: int = 3,
                         device: str = "spark", max_batch: int = 1024,
                         expected_accept_length: float = STUDY_ACCEPT_LENGTH_GSM8K
                         ) -> list[tuple[int, int, int]]:
    """vLLM ``num_speculative_tokens_per_batch_size`` ranges: k where MTP pays, else 0."""
    cost = DecodeCost.from_config(config or load_config())
    dev = DEVICES[device]
    ranges: list[tuple[int, int, int]] = []
    for b in range(1, max_batch + 1):
        k = num_spec_tokens if cost.verify_cost_ratio(b, num_spec_tokens, dev) < expected_accept_length else 0
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], b, k)
        else:
            ranges.append((b, b, k))
    return ranges
