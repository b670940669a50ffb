"""Install a vllm-ling subclass in place of a vLLM layer through vLLM's out-of-tree layer
mechanism (``PluggableLayer.register_oot``, keyed by the in-tree class name)."""

from __future__ import annotations

import logging

from vllm_ling.log import get_logger, log_once

logger = get_logger("layers")


def install_out_of_tree(in_tree_name: str, cls: type, description: str) -> list[str]:
    """Register ``cls`` for ``in_tree_name``. Idempotent (vLLM loads plugins in every process,
    sometimes twice); another plugin's replacement is left in place with one WARNING. Returns
    ``[description]`` when ``cls`` serves, else []."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    present = op_registry_oot.get(in_tree_name)
    if present is None:
        PluggableLayer.register_oot(cls, name=in_tree_name)
    elif present is not cls:
        log_once(logger, logging.WARNING, f"foreign-{in_tree_name}-{cls.__qualname__}",
                 "%s already has an out-of-tree replacement (%s.%s); leaving it in place, so vllm_ling's %s is "
                 "NOT used", in_tree_name, present.__module__, present.__qualname__, cls.__qualname__)
        return []
    return [description]
