"""The one-launch KDA decode step (``kda_decode``): at decode and in verify windows, each KDA layer's
short convolutions, gate, beta, L2 norms and delta-rule recurrence as one Triton launch
(:mod:`vllm_ling.ops.kda_decode`) in place of vLLM's three kernels after the in-projection. Its names
and its selector live here (:func:`select_kda_decode`); the layer side is
:mod:`vllm_ling.layers.kda_decode`. No vLLM import.
"""

from __future__ import annotations

from vllm_ling.options import Choice, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection

OPTION = "VLLM_LING_KDA_DECODE"
DECODE_DESCRIPTION = ("one launch per KDA layer at decode and in verify windows: short convolutions, gate, beta, "
                      "L2 norms and the delta-rule recurrence (prefill: vLLM's chunked kernels)")


class KdaDecode(Choice):
    """What runs a KDA layer's decode step after its in-projection."""

    LING = "ling"  # vllm-ling's one launch
    VLLM = "vllm"  # vLLM's conv, gate and recurrence kernels (the CPU layer: plain PyTorch)


def select_kda_decode(enabled: bool, platform: Platform, fused_conv: bool, problems: list[str]) -> Selection:
    """The selection for one KDA layer: vllm-ling's launch where ``enabled`` (the option) on CUDA, for
    a layer whose forward is vllm-ling's fused op (``fused_conv``: the fused convolutions' weight and
    op) and whose shapes the kernel takes (``problems``: why not, read from the layer)."""
    def vllm(reason: str, fallback: bool = True) -> Selection:
        return Selection(Feature.KDA_DECODE, KdaDecode.VLLM, reason, fallback_from=KdaDecode.LING if fallback else None)

    if not enabled:
        return vllm(f"opted out ({opt_out_setting(OPTION)})", fallback=False)
    if platform is Platform.CPU:
        return vllm("the CPU platform: vllm-ling's plain-PyTorch KDA", fallback=False)
    if not fused_conv:  # another switch's consequence: not asked for here
        return vllm("the layer's convolutions are not fused (kda_fused_conv): vLLM's forward serves it",
                    fallback=False)
    if problems:
        return vllm("; ".join(problems))
    return Selection(Feature.KDA_DECODE, KdaDecode.LING, DECODE_DESCRIPTION)
