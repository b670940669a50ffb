"""The KDA layers' gated output norm inside the one-launch decode (``kda_output_norm``).

vLLM 0.32's KDA forward runs its output norm (``FusedRMSNormGated``: RMS norm over each head, times the
norm's weight and ``sigmoid`` of the gate projection) after the core, as a kernel of its own: Inductor's
``triton_per_fused__to_copy_add_dense_fp8_linear_mean_mul_pow_rsqrt_sigmoid_view_0``, 1.9 us per KDA layer
in lease 2026-12-07g's 32K decode step, launched when the KDA decode kernel has finished, and the
out-projection after it streams its weights only when the norm has finished. Here the one-launch decode
(:mod:`vllm_ling.ops.kda_decode`) applies the norm to the head's outputs before it ends, and lets the next
kernel start at once: the out-projection's weights stream while the step runs. Batches the launch does not
serve (prefills) run vLLM's norm kernel inside the layer's op, so the op's output is the normed one either
way.

Its names and its selector (:func:`select_kda_output_norm`) live here; the layer side is
:mod:`vllm_ling.layers.kda_output_norm`. No vLLM import.
"""

from __future__ import annotations

from vllm_ling.options import Choice, opt_out_setting
from vllm_ling.selection import Feature, Platform, Selection

OPTION = "VLLM_LING_KDA_OUTPUT_NORM"
NORM_DESCRIPTION = ("each KDA layer's gated output norm inside its one-launch decode step, the out-projection "
                    "launched during it (prefills: vLLM's norm kernel inside the layer's op)")
GATE_ACTIVATION = "sigmoid"  # Ling's KDA output gate: the one the launch applies


class KdaOutputNorm(Choice):
    """What computes a KDA layer's gated output norm at decode."""

    LING = "ling"  # inside vllm-ling's one-launch decode step
    VLLM = "vllm"  # vLLM's FusedRMSNormGated after the core, compiled with the rest of the forward


def select_kda_output_norm(enabled: bool, platform: Platform, decode_launch: bool,
                           problems: list[str]) -> Selection:
    """The selection for one KDA layer: the norm inside the launch where ``enabled`` (the option) on CUDA,
    for a layer whose decode is vllm-ling's one launch (``decode_launch``) and whose norm it computes
    (``problems``: why not, read from the layer)."""
    def vllm(reason: str, fallback: bool = True) -> Selection:
        return Selection(Feature.KDA_OUTPUT_NORM, KdaOutputNorm.VLLM, reason,
                         fallback_from=KdaOutputNorm.LING if fallback else None)

    if not enabled:
        return vllm(f"opted out ({opt_out_setting(OPTION)})", fallback=False)
    if platform is Platform.CPU:
        return vllm("the CPU platform: vllm-ling's plain-PyTorch KDA", fallback=False)
    if not decode_launch:  # another switch's consequence: not asked for here
        return vllm("the layer's decode is not the one launch (kda_decode): vLLM's norm serves it", fallback=False)
    if problems:
        return vllm("; ".join(problems))
    return Selection(Feature.KDA_OUTPUT_NORM, KdaOutputNorm.LING, NORM_DESCRIPTION)
