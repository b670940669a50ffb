"""Which of a Ling config's decoder layers, and which loaded modules, are of which kind, by vLLM's own
rule and classes (read from vLLM's model module, never re-derived): what the startup verification
expects each stage to hold and reads back."""

from __future__ import annotations


def kda_layers(config, stage, draft_here: bool) -> int:
    """The KDA layers of the stage's layer range (the NEXTN draft has none)."""
    from vllm.model_executor.models.bailing_moe_v3 import _is_kda_layer as is_kda

    return sum(1 for i in range(stage.start, stage.end) if is_kda(i, config.layer_group_size, config.num_hidden_layers))


def is_kda_module(module) -> bool:
    """``module`` is a KDA layer (vLLM's class or any subclass: vllm-ling's are)."""
    from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3KimiDeltaAttention

    return isinstance(module, BailingMoeV3KimiDeltaAttention)
