"""The dense block-FP8 linears of a Ling-3.0 ``-fp4`` model as vLLM 0.32 builds them (TP=1).

Derived from the checkpoint's tensors (:mod:`checkpoint_format`) and the merges vLLM's
``bailing_moe_v3.py`` makes (``packed_modules_mapping``: ``qkv_proj`` = q, k, v when ``b_proj``
is left in BF16 by ``modules_to_not_convert``, else ``qkvb_proj`` = q, k, v, b;
``gate_up_proj`` = gate, up; the MTP layer's ``eh_proj`` is a ``ReplicatedLinear``), plus
vllm-ling's merge of each KDA layer's q, k, v, f, g into ``qkvfg_proj`` when
``VLLM_LING_KDA_MERGED_IN_PROJ`` is on (:mod:`kda_merged_in_proj`; only where b_proj stays BF16 and all
five are block-FP8, as the layer decides). Each
entry is one weight shape [N, K] with the layers that use it; these are the GEMMs the dense
FP8 decode kernels must cover. ``kv_b_proj`` is listed with ``decode=False``: vLLM's MLA
dequantizes it at load into BF16 W_UK / W_UV and never runs it as a linear at decode.
No vLLM or torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_ling.models.checkpoint_format import FP8_BLOCK, checkpoint_specs, is_kda_layer, is_not_converted
from vllm_ling.models.kda_merged_in_proj import MEMBERS as KDA_MERGED_MEMBERS
from vllm_ling.models.kda_merged_in_proj import MERGED_NAME as KDA_MERGED_NAME
from vllm_ling.models.kda_merged_in_proj import KdaInProj, select_kda_merged_in_proj
from vllm_ling.options import LingOptions

_MERGES = {  # checkpoint projection -> vLLM module it is stacked into (suffix match)
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class DenseLinear:
    module: str                # vLLM module path without "model.layers.{i}.", e.g. "self_attn.qkv_proj"
    out_features: int          # N (merged)
    in_features: int           # K
    layers: tuple[int, ...]    # layer indices (the NEXTN layer is num_hidden_layers)
    members: tuple[str, ...]   # checkpoint projections stacked into it, in order
    tensor_class: str          # checkpoint_format's class ("kda_attention", "shared_expert", ...)
    decode: bool = True        # run as a linear in a decode step

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def weight_bytes(self) -> int:
        """e4m3 weight plus fp32 block scales, for one layer."""
        blocks = -(-self.out_features // 128) * -(-self.in_features // 128)
        return self.out_features * self.in_features + 4 * blocks


def _vllm_module(module: str, layer: int, kda_layer: bool, b_proj_separate: bool,
                 kda_merged: bool = False) -> tuple[str, str]:
    """(vLLM module suffix, checkpoint projection) for a checkpoint module of one layer."""
    local = module.split(f"model.layers.{layer}.", 1)[1].replace("attention.", "self_attn.", 1)
    parent, _, proj = local.rpartition(".")
    if kda_merged and parent == "self_attn" and proj in KDA_MERGED_MEMBERS:
        return f"{parent}.{KDA_MERGED_NAME}", proj
    if kda_layer and parent == "self_attn" and proj in _QKV + ("b_proj",):
        if proj == "b_proj" and b_proj_separate:
            return local, proj
        return f"{parent}.{'qkv_proj' if b_proj_separate else 'qkvb_proj'}", proj
    if proj in _MERGES:
        return f"{parent}.{_MERGES[proj]}".lstrip("."), proj
    return local, proj


def _kda_merges(layer: int, skip: list[str]) -> bool:
    """Whether vllm-ling's KDA layer merges its in-projections: the layer's own selector asked with
    the facts the checkpoint gives (b_proj BF16, else vLLM builds qkvb_proj; which members are BF16)."""
    attention = f"model.layers.{layer}.attention"
    bf16 = tuple(m for m in KDA_MERGED_MEMBERS if is_not_converted(f"{attention}.{m}", skip))
    return select_kda_merged_in_proj(True, is_not_converted(f"{attention}.b_proj", skip), bf16).choice is KdaInProj.MERGED


def dense_fp8_linears(config: dict[str, Any], include_mtp: bool = True,
                      kda_merged_in_proj: bool | None = None) -> list[DenseLinear]:
    """Every dense block-FP8 linear shape with the layers that use it (target, then NEXTN).
    ``kda_merged_in_proj``: whether KDA layers merge q, k, v, f, g (default: the
    ``VLLM_LING_KDA_MERGED_IN_PROJ`` option, as the server reads it)."""
    if kda_merged_in_proj is None:
        kda_merged_in_proj = LingOptions.current().kda_merged_in_proj
    n_layers = config["num_hidden_layers"]
    skip = (config.get("quantization_config") or {}).get("modules_to_not_convert") or []
    merged: dict[tuple[int, str], dict] = {}

    for spec in checkpoint_specs(config, include_mtp=include_mtp):
        if spec.kind != FP8_BLOCK or spec.layer is None:
            continue
        module = spec.name[: -len(".weight")]
        layer = spec.layer
        kda = layer < n_layers and is_kda_layer(layer, config)
        b_separate = is_not_converted(f"model.layers.{layer}.attention.b_proj", skip)
        vllm_name, proj = _vllm_module(module, layer, kda, b_separate,
                                       kda and kda_merged_in_proj and _kda_merges(layer, skip))
        entry = merged.setdefault((layer, vllm_name), {"n": 0, "k": spec.shape[1], "members": [],
                                                       "cls": spec.tensor_class})
        entry["n"] += spec.shape[0]
        entry["members"].append(proj)
        if entry["k"] != spec.shape[1]:
            raise ValueError(f"{module}: K={spec.shape[1]} differs from the other members of {vllm_name}")
    by_shape: dict[tuple[str, int, int, tuple[str, ...]], dict] = {}
    for (layer, name), e in merged.items():
        key = (name, e["n"], e["k"], tuple(e["members"]))
        by_shape.setdefault(key, {"layers": [], "cls": e["cls"].removeprefix("mtp_")})["layers"].append(layer)
    out = [DenseLinear(module=name, out_features=n, in_features=k, layers=tuple(sorted(v["layers"])),
                       members=members, tensor_class=v["cls"], decode=not name.endswith("kv_b_proj"))
           for (name, n, k, members), v in by_shape.items()]
    return sorted(out, key=lambda d: (d.layers[0], d.module))


# vLLM's parallel layouts of these modules (bailing_moe_v3.py): row-parallel ones split K, the
# replicated ones (the MLA compressed-KV projection, the NEXTN eh_proj) split nothing, every
# other (column-parallel, merged or not) splits N
_ROW_PARALLEL = ("o_proj", "dense", "down_proj")
_REPLICATED = ("kv_a_proj_with_mqa", "eh_proj")


def partitioned_shape(linear: DenseLinear, tensor_parallel_size: int) -> tuple[int, int]:
    """The [N, K] weight one tensor-parallel rank holds for ``linear``."""
    n, k = linear.shape
    leaf = linear.module.rsplit(".", 1)[-1]
    if leaf in _REPLICATED:
        return n, k
    if leaf in _ROW_PARALLEL:
        return n, k // tensor_parallel_size
    return n // tensor_parallel_size, k


def distinct_decode_shapes(config: dict[str, Any], include_mtp: bool = True,
                           tensor_parallel_size: int = 1, kda_merged_in_proj: bool | None = None) -> list[tuple[int, int]]:
    """The distinct [N, K] weight shapes (per tensor-parallel rank) run as dense FP8 linears at
    decode, largest first."""
    shapes = {partitioned_shape(d, tensor_parallel_size)
              for d in dense_fp8_linears(config, include_mtp, kda_merged_in_proj) if d.decode}
    return sorted(shapes, key=lambda s: (-s[0] * s[1], s))
