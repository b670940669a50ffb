"""The fused KDA short convolutions (``kda_fused_conv``): each KDA layer's q, k and v causal
convolutions as one launch of vLLM's ``causal_conv1d_update`` (decode, verify windows) or
``causal_conv1d_fn`` (prefill) over the three channel blocks (the convolution is depthwise: each
channel reads only its own weights and state, so one launch over [q | k | v] computes exactly the
three), and at prefill the new sequences' zero states chosen without vLLM's host sync. Its names
and its selector live here (:func:`select_kda_fused_conv`); the layer is
:mod:`vllm_ling.layers.kda_fused_conv`. No vLLM import.
"""

from __future__ import annotations

from vllm_ling.options import Choice, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection

OPTION = "VLLM_LING_KDA_FUSED_CONV"
WEIGHT_ATTR = "ling_qkv_conv_weight"  # on a KDA layer: the [3 P, W] weight the fused launch reads (None: not fused)
FUSED_DESCRIPTION = ("q, k and v short convolutions as one launch per KDA layer (decode, verify windows, prefill); "
                     "a prefill's new sequences start from zero states without a host sync")


class KdaConv(Choice):
    """How a KDA layer runs its q, k and v short convolutions."""

    FUSED = "fused"        # one launch over the three channel blocks (verify windows with prefills: vLLM's three)
    SEPARATE = "separate"  # three launches (vLLM's forward; the CPU layer's plain PyTorch)


def select_kda_fused_conv(enabled: bool, platform: Platform, merged_in_proj: bool, conv_problems: list[str]
                          ) -> Selection:
    """The selection for one KDA layer: fused where ``enabled`` (the option) on CUDA, for a layer
    whose in-projection is merged (its forward is vllm-ling's) and whose three convolutions can
    share one weight (``conv_problems``: why not, read from the layer)."""
    def separate(reason: str, fallback: bool = True) -> Selection:
        return Selection(Feature.KDA_FUSED_CONV, KdaConv.SEPARATE, reason,
                         fallback_from=KdaConv.FUSED if fallback else None)

    if not enabled:
        return separate(f"opted out ({opt_out_setting(OPTION)})", fallback=False)
    if platform is Platform.CPU:
        return separate("the CPU platform: vllm-ling's plain-PyTorch KDA", fallback=False)
    if not merged_in_proj:  # another switch's (or layout's) consequence: not asked for here
        return separate("the in-projection is not merged (kda_merged_in_proj): the layer runs vLLM's forward",
                        fallback=False)
    if conv_problems:
        return separate("; ".join(conv_problems))
    return Selection(Feature.KDA_FUSED_CONV, KdaConv.FUSED, FUSED_DESCRIPTION)
