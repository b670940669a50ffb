"""The merged KDA in-projection on the loaded tiny model: each checkpoint projection lands in its
own shard (against a plain-PyTorch dequantization written here), nothing under a merged layer is
dropped silently, MLA's own BF16 g_proj is untouched, and layers of another pipeline stage pass
through to vLLM.

Tolerance: the CPU path serves BF16 weights (dequantized once at load) and BF16 outputs, so
each shard agrees with the fp32 reference to 1e-2 relative L2 (two BF16 roundings, 2**-9 each);
a shard in the wrong place (two random projections) differs at order 1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

KDA_LAYERS = (0, 1, 2, 3, 4)  # the tiny config: layer 5 is MLA
MEMBERS = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")
REL = 1e-2


@pytest.fixture(scope="module")
def checkpoint_tensors(tiny_checkpoint):
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(tiny_checkpoint.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] with one scale per 128 x 128 block -> fp32."""
    n, k = weight.shape
    blocks = scale_inv.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return weight.float() * blocks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_every_projection_lands_in_its_own_shard(loaded_tiny_models, checkpoint_tensors):
    from vllm_ling.models.kda_merged_in_proj import KdaInProj
    from vllm_ling.selection import Feature, recorded

    _, target, _ = loaded_tiny_models
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for i in KDA_LAYERS:
        layer = target.model.layers[i].self_attn
        assert type(layer).__name__ == "CpuBailingMoeV3KimiDeltaAttention"
        assert recorded(layer, Feature.KDA_MERGED_IN_PROJ).choice is KdaInProj.MERGED
        assert layer.qkvfg_proj.output_partition_sizes == [1024] * 5
        with torch.no_grad():
            parts = layer.qkvfg_proj(x)[0].split(1024, dim=-1)
        refs = []
        for member, part in zip(MEMBERS, parts):
            prefix = f"model.layers.{i}.attention.{member}"
            w = dequantize(checkpoint_tensors[f"{prefix}.weight"], checkpoint_tensors[f"{prefix}.weight_scale_inv"])
            refs.append(x.float() @ w.t())
            assert rel(part, refs[-1]) < REL, (i, member, rel(part, refs[-1]))
        assert rel(parts[3], refs[4]) > 0.5  # f and g differ: a swap would be seen


def test_mla_g_proj_is_left_to_vllm(loaded_tiny_models, checkpoint_tensors):
    """MLA layers have a BF16 g_proj of their own: the router hands it to vLLM unchanged."""
    from vllm_ling.models.kda_merged_in_proj_loading import MergedInProjRouter

    _, target, _ = loaded_tiny_models
    assert not hasattr(target.model.layers[5].self_attn, "qkvfg_proj")
    router = MergedInProjRouter(target)
    assert "model.layers.5.self_attn" not in router.layers and len(router.layers) == len(KDA_LAYERS)
    mla = [(n, t) for n, t in checkpoint_tensors.items() if n.startswith("model.layers.5.attention.g_proj")]
    mapped = [(n.replace(".attention.", ".self_attn."), t) for n, t in mla]
    assert mapped and [(n, t) for n, t in router.route(mapped)] == mapped and not router.loaded


@pytest.mark.parametrize("name", ["model.layers.0.attention.h_proj.weight",   # unknown module
                                  "model.layers.3.attention.f_proj.bias",     # no such parameter
                                  "model.layers.1.attention.q_proj.input_scale"])
def test_a_tensor_no_parameter_takes_fails_naming_it(loaded_tiny_models, name):
    from vllm_ling.models.kda_merged_in_proj_loading import UnroutedCheckpointTensor

    _, target, _ = loaded_tiny_models
    with pytest.raises(UnroutedCheckpointTensor, match=name.replace(".", r"\.").replace("attention", "self_attn")):
        target.load_weights([(name, torch.zeros(4))])


def test_loaded_shards_are_recorded_for_the_startup_check(loaded_tiny_models):
    from vllm_ling.models.kda_merged_in_proj_loading import missing_shards

    _, target, _ = loaded_tiny_models
    linear = target.model.layers[0].self_attn.qkvfg_proj
    assert missing_shards(linear) == []
    got = set(linear.ling_loaded_shards)
    assert got == {(p, m) for p in ("weight", "weight_scale_inv") for m in MEMBERS}
    partial = type("Linear", (), {"ling_loaded_shards": got - {("weight_scale_inv", "g_proj")}})()
    assert missing_shards(partial) == ["weight_scale_inv.g_proj"]


class _Recorder(torch.nn.Module):
    """A merged linear stand-in: its parameters record what the loader hands them."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.weight.weight_loader = lambda param, tensor, shard: self.calls.append((tensor, shard))
        self.calls = []


def test_router_routes_this_stages_layers_and_passes_the_rest():
    """Pipeline parallelism: layer 0 lives on another stage (vLLM's PPMissingLayer, no merged
    linear here), so its tensors go to vLLM untouched; layer 1's members go to their shards."""
    from vllm_ling.models.kda_merged_in_proj_loading import MergedInProjRouter

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Module()])
    model.model.layers[1].self_attn = torch.nn.Module()
    model.model.layers[1].self_attn.qkvfg_proj = recorder = _Recorder()
    model.model.layers[1].self_attn.A_log = torch.nn.Parameter(torch.zeros(1))
    router = MergedInProjRouter(model)
    tensors = {f"model.layers.{i}.self_attn.{m}.weight": torch.full((1,), 10.0 * i + j)
               for i in (0, 1) for j, m in enumerate(MEMBERS)}
    tensors["model.layers.1.self_attn.A_log"] = torch.zeros(1)
    passed = [n for n, _ in router.route(tensors.items())]
    assert passed == [f"model.layers.0.self_attn.{m}.weight" for m in MEMBERS] + ["model.layers.1.self_attn.A_log"]
    assert [(float(t), shard) for t, shard in recorder.calls] == [(10.0 + j, j) for j in range(5)]
    assert router.loaded == {"model.layers.1.self_attn.qkvfg_proj.weight"}
