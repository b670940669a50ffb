"""The Ling-3.0 DSpark drafter (``LingDSparkModel``) on vLLM 0.32's own D-Spark runtime.

The drafter is Qwen3-shaped (docs/dspark.md, section 1), so this is vLLM's
``Qwen3DSparkForCausalLM`` (DFlash backbone, Markov head, confidence head, everything vLLM's
``DSparkSpeculator`` calls) with three differences:

- Before any module is built it checks the drafter against the target (fields and, for a local
  directory, the shards' headers): a drafter for another target, or a config vLLM would misread,
  is one refusal naming the field or tensor (:mod:`vllm_ling.models.dspark_format`).
- It never owns an input embedding or an LM head. The checkpoint's two vocabulary matrices are
  frozen copies of the target's, and vLLM's ``load_dspark_model`` keeps a drafter's own copy
  whenever the checkpoint holds one and it differs from the target's weight: with vllm-ling's FP8
  head it always differs (FP8 vs BF16 bytes), so stock vLLM would keep a private 805 MB BF16 head.
  Here both are :class:`~vllm_ling.models.ling3_mtp.TargetModuleSlot` placeholders and the
  checkpoint's copies are skipped, so vLLM shares the target's whole modules (the FP8 head with its
  scales and kernel) and the startup verification reads their identity.
- Its attention layers size their KV blocks to the hybrid target's page
  (:mod:`vllm_ling.models.dspark_blocks`).

It records the drafter feature on itself (:mod:`vllm_ling.models.dspark_selection`) and keeps the
target and the config it was built for, from which its reader
(:mod:`vllm_ling.layers.dspark_drafter`) reads back what serves.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

from vllm_ling.log import get_logger, log_once
from vllm_ling.models import loaded
from vllm_ling.models.checkpoint_format import is_kda_layer
from vllm_ling.models.dspark_blocks import size_draft_blocks
from vllm_ling.models.dspark_format import (SHARED_WITH_TARGET, DSparkFields, check_against_target,
                                            check_dspark_checkpoint, read_fields)
from vllm_ling.models.dspark_selection import dspark_selection
from vllm_ling.models.ling3_mtp import TargetModuleSlot
from vllm_ling.models.names import MARKOV_PROJECTION_ATTR
from vllm_ling.selection import record

logger = get_logger("models")


def drafter_fields(vllm_config: VllmConfig) -> DSparkFields:
    """The drafter's fields, checked against the target (DSparkFormatError otherwise)."""
    draft = vllm_config.speculative_config.draft_model_config
    source = f"{draft.model}/config.json"
    fields = read_fields(draft.hf_config.to_dict(), source)
    target = vllm_config.model_config
    check_against_target(fields, target.hf_config.to_dict(), f"{target.model}/config.json")
    return fields


def check_local_drafter(vllm_config: VllmConfig, fields: DSparkFields) -> None:
    """The drafter's shards against its config before any weight is read (a hub id is checked by
    vLLM's loader instead)."""
    draft_dir = vllm_config.speculative_config.draft_model_config.model
    if str(getattr(vllm_config.load_config, "load_format", "auto")) == "dummy" or not os.path.isdir(draft_dir):
        return
    unexpected = check_dspark_checkpoint(draft_dir, fields)
    if unexpected:
        log_once(logger, logging.WARNING, f"dspark-unexpected-{draft_dir}",
                 "%d tensor(s) in the DSpark drafter %s are not part of its format and will be ignored, e.g. %s",
                 len(unexpected), draft_dir, unexpected[:5])


def has_kda_layers(target_config) -> bool:
    """Whether the target has KDA layers (their state must roll back across a verify window)."""
    groups = {"layer_group_size": target_config.layer_group_size, "num_hidden_layers": target_config.num_hidden_layers}
    return any(is_kda_layer(i, groups) for i in range(target_config.num_hidden_layers))


class LingDSparkForCausalLM(Qwen3DSparkForCausalLM):
    """The Ling-3.0 DSpark drafter as registered by vllm-ling."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        from vllm_ling.models.ling3 import LingForCausalLM

        fields = drafter_fields(vllm_config)
        check_local_drafter(vllm_config, fields)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ling_fields = fields
        # Free the copies vLLM's constructors build; the target's modules take their place.
        self.lm_head = TargetModuleSlot("LM head")
        self.model.embed_tokens = TargetModuleSlot("embedding")
        for layer in self.model.layers:
            size_draft_blocks(layer.self_attn.attn, LingForCausalLM)
        setattr(self.model.markov_head.markov_w2, MARKOV_PROJECTION_ATTR, True)
        # vLLM builds the target first, in this process: what the reader compares the drafter with
        target = loaded.get("target")
        self.ling_target = weakref.ref(target) if target is not None else lambda: None
        self.ling_vllm_config = vllm_config
        self.ling_sharing_path = "vLLM's load_dspark_model (the drafter declares no head or embedding of its own)"
        target_config = vllm_config.model_config.hf_config
        record(self, dspark_selection(target_config, int(vllm_config.speculative_config.num_speculative_tokens),
                                      fields.block_size, fields.aux_layers, has_kda_layers(target_config)))
        loaded.remember("draft", self)

    def heads(self) -> list[torch.nn.Module]:
        """The head module the drafter computes its base logits with."""
        return [self.lm_head]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """vLLM's loader without the checkpoint's copies of the target's embedding and head: the
        drafter then declares no module of its own and vLLM shares the target's."""
        return super().load_weights((name, w) for name, w in weights
                                    if name.removeprefix("model.") not in SHARED_WITH_TARGET)
