"""The startup verification's reading of ``kda_direct_output``: whether the model hands each KDA
layer's output on as a value (:mod:`vllm_ling.models.kda_direct_output`, which decides and records
on the layer when the target model is built and whose decoder step reads the same flag)."""

from __future__ import annotations

from vllm_ling.models.kda_direct_output import DIRECT_ATTR, METHOD, OPTION, KdaOutput
from vllm_ling.models.layer_kinds import is_kda_module, kda_layers
from vllm_ling.options import opt_out_setting
from vllm_ling.selection import Feature, Reader, Served


def served(layer) -> Served:
    """What the model's forward hands on for this KDA layer, read from the flag it branches on and the
    method it calls: the layer's returned output, or vLLM's buffer."""
    if not getattr(layer, DIRECT_ATTR, False):
        return Served.of(KdaOutput.BUFFER, label="vLLM's zero-filled buffer")
    if not callable(getattr(layer, METHOD, None)):
        return Served.of(None, label=f"the direct hand-off on a layer without {METHOD}")
    return Served.of(KdaOutput.DIRECT, label="the output the layer returns")


READER = Reader(
    Feature.KDA_DIRECT_OUTPUT, "kda_direct_output", "KDA layers' outputs", is_kda_module, served,
    f"see the WARNING naming the layer, or set {opt_out_setting(OPTION)}; a layer serving other than its "
    "selection is a defect: report it",
    expected=kda_layers, optimization="kda_direct_output", optimizing=frozenset({KdaOutput.DIRECT}))
