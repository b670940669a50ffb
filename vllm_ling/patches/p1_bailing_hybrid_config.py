"""Patch P1: vLLM's config lookup knows ``bailing_hybrid`` (Ling-3.0's model type).

What: adds ``bailing_hybrid`` -> :class:`~vllm_ling.models.configuration.LingHybridConfig`
to ``vllm.transformers_utils.config._CONFIG_REGISTRY``.
Why: transformers 5.19 has no ``bailing_hybrid`` and 5.20's class overwrites ``head_dim``;
vLLM has no public way to register a config class. Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations


def _registry() -> dict:
    from vllm.transformers_utils import config as vllm_config_utils

    return vllm_config_utils._CONFIG_REGISTRY


def is_applied() -> bool:
    from vllm_ling.models.configuration import LING_MODEL_TYPE, LingHybridConfig

    return LING_MODEL_TYPE in _registry() and _registry()[LING_MODEL_TYPE] is LingHybridConfig


def apply() -> None:
    from vllm_ling.models.configuration import LING_MODEL_TYPE, LingHybridConfig

    _registry()[LING_MODEL_TYPE] = LingHybridConfig
