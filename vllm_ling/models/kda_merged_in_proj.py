"""The merged KDA in-projection (``kda_merged_in_proj``): each KDA layer's q, k, v, f and g
projections, which all read the layer's input, as one column-parallel linear ``qkvfg_proj`` of five
shards in this order. Its names live here; the layer is :mod:`vllm_ling.layers.kda_merged_in_proj`,
the checkpoint mapping :mod:`vllm_ling.models.kda_merged_in_proj_loading`. No vLLM import."""

from __future__ import annotations

OPTION = "VLLM_LING_KDA_MERGED_IN_PROJ"
MERGED_NAME = "qkvfg_proj"  # vLLM's naming of stacked linears (qkv_proj, gate_up_proj): the members' letters
MEMBERS = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")  # shard index = position
