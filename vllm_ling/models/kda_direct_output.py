"""The KDA layers' output handed on as a value (``kda_direct_output``).

vLLM 0.32's decoder layer gives a KDA layer a ``zeros_like`` buffer that the layer's forward copies
its output into (``output[:] = o_proj(...)``). Under vLLM's piecewise compilation the buffer is made in
the graph piece before the KDA op (a splitting point) and written in the piece after it, so it is an
input that piece mutates: Inductor keeps both the zero fill and the copy, fused into the
post-attention residual norm (``triton_red_fused_add_copy__fused_add_rms_norm``: 4.5 us against 1.9
for the plain fused add-norm, 33 per step in lease 2026-12-07c's 32K step). Here the target model
(:class:`vllm_ling.models.ling3.LingModel`) runs a KDA decoder layer as vLLM's does, except that the
attention's output (``attention_output``, vllm-ling's KDA layers) goes straight to the norm: the same
operations on the same values, without the buffer.

Its names, its selector (:func:`select_kda_direct_output`) and the decoder step live here; the
reader is :mod:`vllm_ling.layers.kda_direct_output`. No vLLM import.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import Choice, LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Selection, record

logger = get_logger("kda")

OPTION = "VLLM_LING_KDA_DIRECT_OUTPUT"
DIRECT_ATTR = "ling_direct_output"  # on a KDA layer: True where the model hands its output on as a value
METHOD = "attention_output"  # a KDA layer's forward that returns its output (vllm-ling's layers have it)
DIRECT_DESCRIPTION = ("each KDA layer's output goes to the post-attention norm as a value, not through a "
                      "zero-filled buffer the layer copies into")


class KdaOutput(Choice):
    """How a KDA decoder layer hands its attention output to the post-attention norm."""

    DIRECT = "direct"  # the value the layer returns
    BUFFER = "buffer"  # vLLM's zero-filled buffer, written by the layer


def select_kda_direct_output(enabled: bool, returns_output: bool) -> Selection:
    """The selection for one KDA layer: its output as a value where ``enabled`` (the option) and the
    layer can return it (``returns_output``: vllm-ling's KDA layer, not vLLM's own class)."""
    if not enabled:
        return Selection(Feature.KDA_DIRECT_OUTPUT, KdaOutput.BUFFER, f"opted out ({opt_out_setting(OPTION)})")
    if not returns_output:
        return Selection(Feature.KDA_DIRECT_OUTPUT, KdaOutput.BUFFER,
                         f"the layer is vLLM's own class (no {METHOD}): vLLM's buffer", fallback_from=KdaOutput.DIRECT)
    return Selection(Feature.KDA_DIRECT_OUTPUT, KdaOutput.DIRECT, DIRECT_DESCRIPTION)


def install(decoder_layers: Iterable[torch.nn.Module]) -> None:
    """Decide and record on each KDA layer of the model's stage (the reader and the model's forward read
    :data:`DIRECT_ATTR`); said once: the opt-out and a fallback each one WARNING."""
    for decoder_layer in decoder_layers:
        if not getattr(decoder_layer, "is_kda_layer", False):
            continue
        attn = decoder_layer.self_attn
        selection = record(attn, select_kda_direct_output(LingOptions.current().kda_direct_output,
                                                          callable(getattr(attn, METHOD, None))))
        setattr(attn, DIRECT_ATTR, selection.choice is KdaOutput.DIRECT)
        if selection.choice is KdaOutput.DIRECT:
            log_once(logger, logging.INFO, "kda-direct-output", "KDA output: %s.", DIRECT_DESCRIPTION)
        elif selection.fallback_from is None:
            log_once(logger, logging.WARNING, "kda-direct-output-opt-out",
                     "KDA layers' output goes through vLLM's zero-filled buffer by explicit choice (%s); the startup "
                     "report marks kda_direct_output inactive.", opt_out_setting(OPTION))
        else:
            log_once(logger, logging.WARNING, "kda-direct-output-fallback",
                     "KDA layers' output goes through vLLM's zero-filled buffer for %s and similar layers: %s (the "
                     "startup check kda_direct_output reports it).", attn.prefix, selection.reason)


def hands_output_directly(decoder_layer: torch.nn.Module) -> bool:
    """The decoder layer is a KDA layer whose output the model hands on as a value (its recorded flag)."""
    return bool(getattr(decoder_layer, "is_kda_layer", False)
                and getattr(decoder_layer.self_attn, DIRECT_ATTR, False))


def decoder_step(decoder_layer: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM 0.32's ``BailingMoeV3DecoderLayer.forward`` computes for a KDA layer (input norm with
    the residual add, attention, post-attention norm with the residual add, MLP), with the attention's
    output taken as the value :data:`METHOD` returns. (KDA ignores positions, as vLLM's layer does.)"""
    if residual is None:
        residual = hidden_states
        hidden_states = decoder_layer.input_layernorm(hidden_states)
    else:
        hidden_states, residual = decoder_layer.input_layernorm(hidden_states, residual)
    attn_output = getattr(decoder_layer.self_attn, METHOD)(hidden_states)
    hidden_states, residual = decoder_layer.post_attention_layernorm(attn_output, residual)
    return decoder_layer.mlp(hidden_states), residual
