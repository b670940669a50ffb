"""Patch P11: vLLM keeps a ``LingDSparkModel`` drafter a Qwen3-shaped DSpark draft.

What: adds ``qwen3`` -> :class:`~vllm_ling.patches.config_hooks.LingDSparkArchConfigConvertor`
to ``MODEL_ARCH_CONFIG_CONVERTORS``: for a config naming ``LingDSparkModel`` it appends vLLM's
``Qwen3DSparkModel`` after it (any other ``qwen3`` config reads as vLLM's base convertor reads it).
Why: ``SpeculativeConfig.__post_init__`` (method ``dspark``) rewrites every draft whose
architectures name none of ``Qwen3DSparkModel``, ``Qwen3OmniDSparkModel``, ``Gemma4DSparkModel``
or ``K3DSparkModel`` into a DeepSeek-V4 drafter (``model_type`` ``deepseek_v4``,
``DSparkDraftModel``), which cannot load Ling's drafter. With the second name the check passes and
vLLM still resolves the first, vllm-ling's class. Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

from vllm_ling.models.names import DSPARK_MODEL_TYPE


def _convertor():
    from vllm_ling.patches.config_hooks import LingDSparkArchConfigConvertor

    return LingDSparkArchConfigConvertor


def _map() -> dict:
    from vllm.config.model import MODEL_ARCH_CONFIG_CONVERTORS

    return MODEL_ARCH_CONFIG_CONVERTORS


def is_applied() -> bool:
    return _map().get(DSPARK_MODEL_TYPE) is _convertor()


def apply() -> None:
    _map()[DSPARK_MODEL_TYPE] = _convertor()
