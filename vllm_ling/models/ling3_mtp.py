"""Ling-3.0 NEXTN (MTP) draft: vLLM's BailingMoeV3MTPModel, owned by vllm-ling."""

from __future__ import annotations

from vllm.model_executor.models.bailing_moe_v3_mtp import BailingMoeV3MTPModel


class LingMTPModel(BailingMoeV3MTPModel):
    """The Ling-3.0 NEXTN draft as registered by vllm-ling."""
