"""Patch P9: vLLM refuses a ``bailing_hybrid`` config naming another architecture once.

What: adds ``bailing_hybrid`` -> :class:`~vllm_ling.patches.config_hooks.LingArchConfigConvertor`
to ``vllm.transformers_utils.model_arch_config_convertor.MODEL_ARCH_CONFIG_CONVERTORS``.
Why: vLLM 0.32's ``get_config`` retries the config parse on any exception (``with_retry``,
no fatal errors), so a refusal raised by the config class was logged twice with a 2 s sleep
between. ``ModelConfig`` runs the model type's convertor right after the parse, outside the
retry and before it resolves the architecture; vLLM has no public way to register one.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations


def _convertor():
    from vllm_ling.patches.config_hooks import LingArchConfigConvertor

    return LingArchConfigConvertor


def _map() -> dict:
    # The dict ModelConfig.get_model_arch_config reads (the convertor module's own object).
    from vllm.config.model import MODEL_ARCH_CONFIG_CONVERTORS

    return MODEL_ARCH_CONFIG_CONVERTORS


def is_applied() -> bool:
    from vllm_ling.models.configuration import LING_MODEL_TYPE

    return _map().get(LING_MODEL_TYPE) is _convertor()


def apply() -> None:
    from vllm_ling.models.configuration import LING_MODEL_TYPE

    _map()[LING_MODEL_TYPE] = _convertor()
