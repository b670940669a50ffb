"""The merged KDA in-projection's checkpoint mapping (:mod:`vllm_ling.models.kda_merged_in_proj`:
one column-parallel linear per KDA layer holding the q, k, v, f and g projections, in this order).

The checkpoint keeps ``q_proj``/``k_proj``/``v_proj``/``f_proj``/``g_proj`` (+ ``weight_scale_inv``).
vLLM 0.32's ``BailingMoeV3ForCausalLM.load_weights`` maps q/k/v through its stacked mappings into
``qkv_proj``/``qkvb_proj`` and loads every other name by exact match, silently skipping names it
does not know; with the merge those modules do not exist, so :class:`MergedInProjRouter` takes the
five projections of every merged layer out of the stream and hands each to the merged
parameter's own loader with its shard index (vLLM's ``MergedColumnParallelLinear`` loader slices
tensor-parallel shards and block scales). Whatever else arrives under a merged layer must be a
parameter of that layer, else loading fails naming the tensor: nothing is dropped silently.
Layers that are not merged (another pipeline stage, the opt-out, the MLA layers with their own
BF16 ``g_proj``) pass through to vLLM untouched.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from vllm_ling.models.kda_merged_in_proj import MEMBERS, MERGED_NAME, OPTION
from vllm_ling.options import opt_out_setting

_MEMBER_NAME = re.compile(r"^(?P<layer>.+)\.(?P<proj>[qkvfg]_proj)\.(?P<param>[A-Za-z0-9_]+)$")


class UnroutedCheckpointTensor(ValueError):
    """A checkpoint tensor of a merged KDA layer that no parameter takes."""


def merged_layer_prefixes(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{"model.layers.N.self_attn": merged in-projection module} for this rank's merged KDA layers."""
    return {name.rsplit(".", 1)[0]: module for name, module in model.named_modules()
            if name.endswith("." + MERGED_NAME)}


class MergedInProjRouter:
    """Routes the merged layers' q/k/v/f/g tensors into their shards (see the module docstring).

    ``route(weights)`` yields every tensor it does not load itself; afterwards ``loaded`` holds the
    merged parameters' names (for vLLM's loaded-parameter set). Each merged linear records the
    (parameter, member) pairs it received in ``ling_loaded_shards`` (cumulative over calls: vLLM
    may feed the checkpoint in pieces); :func:`missing_shards` reads it for the startup check.
    """

    def __init__(self, model: torch.nn.Module):
        self.layers = merged_layer_prefixes(model)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.loaded: set[str] = set()

    def route(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            layer = self._merged_layer_of(name)
            if layer is None:
                yield name, tensor
                continue
            match = _MEMBER_NAME.match(name)
            if match and match["layer"] == layer and match["proj"] in MEMBERS:
                self._load(name, tensor, layer, MEMBERS.index(match["proj"]), match["param"])
            elif name in self.params:
                yield name, tensor
            else:
                raise UnroutedCheckpointTensor(
                    f"checkpoint tensor {name!r} belongs to merged KDA layer {layer} but no parameter takes it "
                    f"(the layer holds {sorted(n[len(layer) + 1:] for n in self.params if n.startswith(layer + '.'))}); "
                    f"it would be dropped. Fix the checkpoint, or serve with {opt_out_setting(OPTION)}")

    def _merged_layer_of(self, name: str) -> str | None:
        layer = name.rpartition(".")[0]
        while layer:
            if layer in self.layers:
                return layer
            layer = layer.rpartition(".")[0]
        return None

    def _load(self, name: str, tensor: torch.Tensor, layer: str, shard: int, param_name: str) -> None:
        target = f"{layer}.{MERGED_NAME}.{param_name}"
        param = self.params.get(target)
        if param is None:
            raise UnroutedCheckpointTensor(
                f"checkpoint tensor {name!r}: the merged KDA in-projection {layer}.{MERGED_NAME} has no "
                f"parameter {param_name!r} (it has {sorted(n for n, _ in self.layers[layer].named_parameters())}); "
                f"it would be dropped. Fix the checkpoint, or serve with {opt_out_setting(OPTION)}")
        param.weight_loader(param, tensor, shard)
        self.loaded.add(target)
        module = self.layers[layer]
        if not hasattr(module, "ling_loaded_shards"):
            module.ling_loaded_shards = set()
        module.ling_loaded_shards.add((param_name, MEMBERS[shard]))


def missing_shards(linear: torch.nn.Module) -> list[str]:
    """``param.member`` pairs a merged linear has not received from the checkpoint, for every
    parameter that received at least one shard (nothing loaded at all, e.g. dummy weights: [])."""
    got = getattr(linear, "ling_loaded_shards", set())
    return [f"{param}.{m}" for param in sorted({p for p, _ in got}) for m in MEMBERS if (param, m) not in got]
