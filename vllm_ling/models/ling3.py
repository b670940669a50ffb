"""Ling-3.0 target model: vLLM's BailingMoeV3ForCausalLM, owned by vllm-ling."""

from __future__ import annotations

import logging
import os
from typing import Iterable

import torch

from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.activation import SwigluStepAndMul
from vllm.model_executor.models import bailing_moe_v3
from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3ForCausalLM
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
from vllm.sequence import IntermediateTensors

from vllm_ling.log import get_logger, log_once
from vllm_ling.models import kda_direct_output, loaded, shared_swiglu
from vllm_ling.models.kda_merged_in_proj import MEMBERS, MERGED_NAME
from vllm_ling.models.kda_merged_in_proj_loading import MergedInProjRouter
from vllm_ling.selection import serving_platform

logger = get_logger("models")


def check_local_checkpoint(vllm_config: VllmConfig, include_mtp: bool) -> None:
    """Validate shards against config.json before any module is built or weight read."""
    from vllm_ling.models.checkpoint_check import check_checkpoint

    model_config = vllm_config.model_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    if load_format == "dummy":
        return
    model_dir = model_config.model
    if not os.path.isdir(model_dir):
        log_once(logger, logging.INFO, f"nocheck-{model_dir}",
                 "%s is not a local directory: the -fp4 format is checked while loading.", model_dir)
        return
    config = model_config.hf_config.to_dict()
    unexpected = check_checkpoint(model_dir, config, include_mtp=include_mtp)
    if unexpected:
        log_once(logger, logging.WARNING, f"unexpected-{model_dir}",
                 "%d checkpoint tensor(s) in %s are not part of the Ling-3.0 -fp4 format and "
                 "will be ignored, e.g. %s", len(unexpected), model_dir, unexpected[:5])


class LingModel(EagleModelMixin, bailing_moe_v3.BailingMoeV3Model):
    """vLLM's ``BailingMoeV3Model`` that also returns the residual stream at the input of the
    layers vLLM asks for (``set_aux_hidden_state_layers``): what the DSpark drafter reads.

    vLLM 0.32's model has no such capture (vllm#54174 adds it in-tree); its constructor names the
    model class directly, so patch P12 makes it build this one (registry.PATCHES). The loop is
    vLLM's, plus the capture (``EagleModelMixin._maybe_add_hidden_state``: ``hidden + residual``);
    with no layers set the output is vLLM's, unchanged. KDA layers hand their output to the
    post-attention norm as a value where recorded (:mod:`vllm_ling.models.kda_direct_output`).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        kda_direct_output.install(self.layers[self.start_layer: self.end_layer])

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None):
        if get_pp_group().is_first_rank:
            hidden_states = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        aux_hidden_states: list[torch.Tensor] = []
        for idx, layer in enumerate(self.layers[self.start_layer: self.end_layer], start=self.start_layer):
            aux_hidden_states = self._maybe_add_hidden_state(aux_hidden_states, idx, hidden_states, residual)
            if kda_direct_output.hands_output_directly(layer):
                hidden_states, residual = kda_direct_output.decoder_step(layer, hidden_states, residual)
            else:
                hidden_states, residual = layer(hidden_states, positions, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        if residual is not None:
            hidden_states, _ = self.norm(hidden_states, residual)
        else:
            hidden_states = self.norm(hidden_states)
        if self.aux_hidden_state_layers:  # vLLM's runner expects the pair whenever it set layers
            return hidden_states, aux_hidden_states
        return hidden_states


class LingForCausalLM(BailingMoeV3ForCausalLM, SupportsEagle3):
    """The Ling-3.0 target as registered by vllm-ling (with auxiliary hidden states for DSpark:
    vLLM's ``set_eagle3_aux_hidden_state_layers`` sets them on :class:`LingModel`). Its constructor decides,
    before vLLM builds the layers, what computes the shared experts' clamped SwiGLU
    (:mod:`vllm_ling.models.shared_swiglu`)."""

    # vLLM's merges plus the KDA in-projection (vllm_ling.layers.kda_merged_in_proj): the quant
    # config reads this to decide a merged linear's precision from its members'
    packed_modules_mapping = {**BailingMoeV3ForCausalLM.packed_modules_mapping, MERGED_NAME: list(MEMBERS)}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_local_checkpoint(vllm_config, include_mtp=False)
        swiglu = shared_swiglu.decide(vllm_config.compilation_config, serving_platform())
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        shared_swiglu.install((m for m in self.modules() if isinstance(m, SwigluStepAndMul)), swiglu)
        loaded.remember("target", self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loader, with the merged KDA layers' q/k/v/f/g routed into their shards
        (:mod:`vllm_ling.models.kda_merged_in_proj_loading`)."""
        router = MergedInProjRouter(self)
        if not router.layers:
            return super().load_weights(weights)
        return super().load_weights(router.route(self.hf_to_vllm_mapper.apply(weights))) | router.loaded
