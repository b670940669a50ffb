"""Startup verification of the merged KDA in-projection: what the loaded KDA layers of this rank
hold, read from the modules (:mod:`vllm_ling.layers.kda_merged_in_proj`), and the report's
``kda_merged_in_proj`` optimization entry.

A merged layer counts only if its ``qkvfg_proj`` has five shards of ``heads * head_dim / tp``
rows, vLLM's ``qkv_proj``/``f_proj``/``g_proj`` are gone, and every parameter that received
checkpoint shards received all five (recorded by the loader, :mod:`vllm_ling.models.kda_merged_in_proj_loading`).
A layer the merge refuses for a checkpoint property passes with its reason, but the optimization
is active only where every KDA layer of this rank runs merged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_ling.models.kda_merged_in_proj import OPTION
from vllm_ling.options import opt_out_setting

CHECK_NAME = "kda_merged_in_proj"
OPT_OUT = opt_out_setting(OPTION)


@dataclasses.dataclass
class KdaInProjState:
    layers: int
    merged: list[str]           # one qkvfg_proj of five equal shards, vLLM's three linears gone
    malformed: list[str]        # says merged but the shards, leftovers or loaded members differ
    unmerged: dict[str, int]    # reason -> layer count (the layer's own WARNING states it)
    foreign: list[str]          # not vllm-ling's KDA class (no reason recorded)
    detail: str

    @property
    def all_merged(self) -> bool:
        return 0 < len(self.merged) == self.layers


def kda_in_proj_state(target) -> KdaInProjState:
    from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3KimiDeltaAttention

    from vllm_ling.models.kda_merged_in_proj import MEMBERS, MERGED_NAME
    from vllm_ling.models.kda_merged_in_proj_loading import missing_shards

    layers = [(n, m) for n, m in target.named_modules() if isinstance(m, BailingMoeV3KimiDeltaAttention)]
    merged, malformed, foreign, unmerged = [], [], [], {}
    shapes, methods = set(), set()
    for name, layer in layers:
        if not hasattr(layer, "ling_in_proj_merged"):
            foreign.append(name)
        elif not layer.ling_in_proj_merged:
            unmerged[layer.ling_in_proj_reason] = unmerged.get(layer.ling_in_proj_reason, 0) + 1
        else:
            linear = getattr(layer, MERGED_NAME, None)
            sizes = list(getattr(linear, "output_partition_sizes", None) or [])
            leftovers = [a for a in ("qkv_proj", "f_proj", "g_proj") if getattr(layer, a, None) is not None]
            unloaded = missing_shards(linear)
            if sizes != [layer.projection_size_per_partition] * len(MEMBERS) or leftovers or unloaded:
                malformed.append(f"{name} ({'; '.join(leftovers + unloaded) or sizes})")
                continue
            merged.append(name)
            shapes.add(f"{sum(sizes)}x{linear.input_size_per_partition} = {len(MEMBERS)} x {sizes[0]} rows")
            methods.add(type(linear.quant_method).__name__)
    detail = f"{len(merged)} of {len(layers)} KDA layers run one {MERGED_NAME} linear"
    if merged:
        detail += f" ({', '.join(sorted(shapes))}; {', '.join(sorted(methods))})"
    detail += "".join(f"; {count} unmerged: {why}" for why, count in unmerged.items())
    if malformed:
        detail += f"; malformed merge (shard sizes, leftover linears or shards the checkpoint did not fill): {malformed[:3]}"
    if foreign:
        detail += f"; not vllm-ling's KDA layer ({type(dict(layers)[foreign[0]]).__name__}): {foreign[:3]}"
    return KdaInProjState(len(layers), merged, malformed, unmerged, foreign, detail)


def check_kda_in_proj(state: KdaInProjState, requested: bool, config, start: int, end: int
                      ) -> tuple[bool, str, str, str]:
    """(passed, expected, actual, fix) for layers [start, end) of ``config``: requested, every KDA
    layer merged except those a checkpoint property refuses with a stated reason; not requested,
    none merged."""
    from vllm.model_executor.models.bailing_moe_v3 import _is_kda_layer

    expected = sum(1 for i in range(start, end)
                   if _is_kda_layer(i, config.layer_group_size, config.num_hidden_layers))
    counted = state.layers == expected
    detail = state.detail if counted else f"{state.detail}; expected {expected} KDA layers"
    if not requested:
        return (not state.merged and counted, f"vLLM's qkv_proj, f_proj, g_proj ({OPT_OUT})", detail,
                f"the KDA layer merged although {OPT_OUT}")
    return (counted and not state.malformed and not state.foreign,
            f"{expected} KDA layers with one q|k|v|f|g linear (or a stated reason not to)", detail,
            f"see the WARNING naming the layer, or set {OPT_OUT}")


def optimization_entry(state: KdaInProjState, passed: bool, requested: bool, actual: str) -> dict[str, Any]:
    return {"requested": requested, "active": requested and passed and state.all_merged,
            "detail": actual if requested else f"opted out ({OPT_OUT}): vLLM's qkv_proj, f_proj, g_proj"}
