"""Every tensor of the tiny checkpoint maps onto a parameter, and every parameter is loaded.

The target and the NEXTN draft are built the way vLLM's tests build models (a gloo
process group, ``set_current_vllm_config``), and each checkpoint tensor is fed to
``load_weights`` alone, so a tensor the model silently ignores is caught by name.
"""

from __future__ import annotations

import json
import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def built(tiny_checkpoint, gloo_world):
    from conftest import build_tiny_models

    return build_tiny_models(tiny_checkpoint, load=False)


def _tensors(ckpt):
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_default_config_enables_mtp_with_three_tokens(built):
    vllm_config, _, _ = built
    spec = vllm_config.speculative_config
    assert spec is not None and spec.method == "mtp" and spec.num_speculative_tokens == 3
    assert vllm_config.quant_config.get_name() == "ling_fp8"


def test_every_target_tensor_maps_and_every_parameter_loads(built, tiny_checkpoint):
    _, target, _ = built
    n_layers = json.loads((tiny_checkpoint / "config.json").read_text())["num_hidden_layers"]
    mtp_prefix = f"model.layers.{n_layers}."
    unmapped, loaded = [], set()
    for name, tensor in _tensors(tiny_checkpoint).items():
        if name.startswith(mtp_prefix):
            continue  # the NEXTN layer belongs to the draft
        got = target.load_weights([(name, tensor)])
        if not got:
            unmapped.append(name)
        loaded |= got
    params = {n for n, _ in target.named_parameters()}
    assert unmapped == []
    assert sorted(params - loaded) == []
    assert sorted(loaded - params) == []


def test_every_draft_tensor_maps_and_every_parameter_loads(built, tiny_checkpoint):
    _, _, draft = built
    n_layers = json.loads((tiny_checkpoint / "config.json").read_text())["num_hidden_layers"]
    tensors = _tensors(tiny_checkpoint)
    mtp_names = [n for n in tensors if n.startswith(f"model.layers.{n_layers}.")]
    anchor = f"model.layers.{n_layers}.enorm.weight"  # vLLM's MTP loader insists on an MTP tensor per call
    unmapped, loaded = [], set()
    for name in mtp_names + ["lm_head.weight", "model.word_embeddings.weight"]:
        got = draft.load_weights([(name, tensors[name]), (anchor, tensors[anchor])])
        if not got - {f"model.layers.{n_layers}.enorm.weight"} and name != anchor:
            unmapped.append(name)
        loaded |= got
    params = {n for n, _ in draft.named_parameters()}
    # The draft owns no head and no embedding: it uses the target's modules (shared after load).
    assert unmapped == ["lm_head.weight", "model.word_embeddings.weight"]
    assert sorted(params - loaded) == []
    assert not any(p.shape[0] == 2048 for p in draft.parameters())  # no vocabulary-sized tensor


def test_moe_layers_of_target_and_draft_use_the_ling_method(built):
    from vllm_ling.layers.moe_method import REFERENCE, LingMxfp4MoEMethod

    _, target, draft = built
    methods = {}
    for root, model in (("target", target), ("draft", draft)):
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if type(module).__name__ == "RoutedExperts" or (qm is not None and "experts" in name and hasattr(module, "w13_weight")):
                methods[f"{root}:{name}"] = qm
    assert len([k for k in methods if k.startswith("target:")]) == 4  # layers 2..5
    assert len([k for k in methods if k.startswith("draft:")]) == 1  # the NEXTN layer
    assert all(isinstance(m, LingMxfp4MoEMethod) and m.backend == REFERENCE for m in methods.values()), methods
