"""The merged KDA in-projection (``kda_merged_in_proj``): each KDA layer's q, k, v, f and g
projections, which all read the layer's input, as one column-parallel linear ``qkvfg_proj`` of five
shards in this order. Its names and its selector live here (:func:`select_kda_merged_in_proj`:
the layer records its answer, the dense-shape list of ``vllm-ling warmup`` asks it too); the layer
is :mod:`vllm_ling.layers.kda_merged_in_proj`, the checkpoint mapping
:mod:`vllm_ling.models.kda_merged_in_proj_loading`. No vLLM import."""

from __future__ import annotations

from vllm_ling.options import Choice, opt_out_setting
from vllm_ling.selection import Feature, Selection

OPTION = "VLLM_LING_KDA_MERGED_IN_PROJ"
MERGED_NAME = "qkvfg_proj"  # vLLM's naming of stacked linears (qkv_proj, gate_up_proj): the members' letters
MEMBERS = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")  # shard index = position
MERGED_DESCRIPTION = f"one {MERGED_NAME} linear = [{', '.join(MEMBERS)}] per KDA layer"


class KdaInProj(Choice):
    """What serves a KDA layer's in-projections."""

    MERGED = "merged"  # one qkvfg_proj linear
    VLLM = "vllm"      # vLLM's qkv_proj (or qkvb_proj), f_proj and g_proj


def select_kda_merged_in_proj(enabled: bool, b_proj_separate: bool, bf16_members: tuple[str, ...]) -> Selection:
    """The selection for one KDA layer: merged where ``enabled`` (the option), unless vLLM stacks b
    into ``qkvb_proj`` (``b_proj_separate`` False: b_proj quantized, not the Ling-3.0-flash-fp4 layout;
    its 32-row shard would sit between q, k, v and f, g, off the 128-row grid the W8A16 kernel indexes
    scales by) or the members differ in precision (``bf16_members``: those the checkpoint leaves BF16)."""
    if not enabled:
        return Selection(Feature.KDA_MERGED_IN_PROJ, KdaInProj.VLLM, f"opted out ({opt_out_setting(OPTION)})")
    why = None
    if not b_proj_separate:
        why = ("vLLM stacks q, k, v, b into qkvb_proj (b_proj is not left in BF16 by modules_to_not_convert); "
               "the merge needs b_proj separate, as in Ling-3.0-flash-fp4")
    elif 0 < len(bf16_members) < len(MEMBERS):
        why = f"the projections differ in precision (BF16: {', '.join(bf16_members)})"
    if why is not None:
        return Selection(Feature.KDA_MERGED_IN_PROJ, KdaInProj.VLLM, why, fallback_from=KdaInProj.MERGED)
    return Selection(Feature.KDA_MERGED_IN_PROJ, KdaInProj.MERGED, MERGED_DESCRIPTION)
