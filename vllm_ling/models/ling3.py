"""Ling-3.0 target model: vLLM's BailingMoeV3ForCausalLM, owned by vllm-ling."""

from __future__ import annotations

from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3ForCausalLM


class LingForCausalLM(BailingMoeV3ForCausalLM):
    """The Ling-3.0 target as registered by vllm-ling."""
