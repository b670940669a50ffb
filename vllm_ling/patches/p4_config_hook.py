"""Patch P4: vLLM runs Ling's configuration hook while it builds ``VllmConfig``.

What: adds ``BailingMoeV3ForCausalLM`` -> ``LingConfigHook`` to
``vllm.model_executor.models.config.MODELS_CONFIG_MAP``.
Why: it is the one per-architecture hook vLLM runs while building the config (front-end
process, before any engine process starts): conflicting options fail with a message
naming both, before weights load, and on CPU the hybrid model runs without prefix caching
(vLLM's ``align`` mamba cache mode needs Triton). vLLM has no public way for an
out-of-tree model to register one. Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

from vllm_ling.models.names import TARGET_ARCH


def _hook():
    from vllm_ling.patches.config_hooks import LingConfigHook

    return LingConfigHook


def _map() -> dict:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    return MODELS_CONFIG_MAP


def is_applied() -> bool:
    return _map().get(TARGET_ARCH) is _hook()


def apply() -> None:
    _map()[TARGET_ARCH] = _hook()
