"""P12: vLLM builds vllm-ling's LingModel for Ling's target, which returns the residual stream at the
input of the layers vLLM sets (what DSpark reads) and vLLM's own output otherwise."""

from __future__ import annotations

import types

import pytest
import torch

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")


class _Layer(torch.nn.Module):
    """A stand-in decoder layer with vLLM's (hidden, positions, residual) contract and distinct
    outputs per layer, so any capture at the wrong place shows."""

    def __init__(self, i: int):
        super().__init__()
        self.i = i

    def forward(self, hidden, positions, residual):
        residual = hidden if residual is None else hidden + residual
        return torch.tanh(residual * (1 + 0.1 * self.i)) + self.i, residual


def _model(cls, n: int = 6):
    """An instance of ``cls`` (vLLM's BailingMoeV3Model or LingModel) around stand-in layers,
    built without vLLM's constructor (the loop is what is tested)."""
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.word_embeddings = torch.nn.Embedding(32, 8)
    model.layers = torch.nn.ModuleList(_Layer(i) for i in range(n))
    model.start_layer, model.end_layer = 0, n
    model.norm = lambda h, r=None: (h + r, r) if r is not None else h
    return model


@pytest.fixture
def pp_single(monkeypatch):
    from vllm.model_executor.models import bailing_moe_v3

    import vllm_ling.models.ling3 as ling3

    group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    monkeypatch.setattr(bailing_moe_v3, "get_pp_group", lambda: group)
    monkeypatch.setattr(ling3, "get_pp_group", lambda: group)


def test_capture_is_the_input_of_each_set_layer_and_the_output_is_vllms(pp_single):
    from vllm_ling.models.ling3 import LingModel

    upstream = LingModel.__mro__[2]  # vLLM's BailingMoeV3Model (P12 may have replaced the module's name)
    assert upstream.__name__ == "BailingMoeV3Model" and upstream.__module__.startswith("vllm.")
    ids, pos = torch.tensor([3, 5, 7]), torch.arange(3)
    theirs = _model(upstream)
    ours = _model(LingModel)
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        want = upstream.forward(theirs, ids, pos)
        assert torch.equal(LingModel.forward(ours, ids, pos), want)  # no layers set: vLLM's output
        ours._set_aux_hidden_state_layers((4, 2))
        hidden, aux = LingModel.forward(ours, ids, pos)
        assert torch.equal(hidden, want)
        # the stream entering layer i: embeddings, then hidden + residual after each earlier layer
        h, r, inputs = ours.word_embeddings(ids), None, []
        for layer in ours.layers:
            inputs.append(h if r is None else h + r)
            h, r = layer(h, pos, r)
    assert len(aux) == 2 and torch.equal(aux[0], inputs[2]) and torch.equal(aux[1], inputs[4])


def test_target_is_built_as_ling_model_only_with_p12(monkeypatch, tiny_mla_checkpoint, gloo_world):
    from vllm.model_executor.models import bailing_moe_v3
    from vllm.model_executor.models.interfaces import supports_eagle3

    from vllm_ling.models.ling3 import LingModel
    from vllm_ling.patches import p12_bailing_aux_hidden_states as p12
    from vllm_ling.patches.registry import apply_all

    from conftest import build_tiny_models

    import vllm_ling

    vllm_ling.register()
    monkeypatch.setenv("VLLM_LING_MTP", "0")
    monkeypatch.setattr(bailing_moe_v3, "BailingMoeV3Model", LingModel.__mro__[2])
    assert not p12.is_applied()
    _, target, _ = build_tiny_models(tiny_mla_checkpoint, load=False)
    assert type(target.model) is LingModel.__mro__[2]  # vLLM's model: no capture
    with pytest.raises(AssertionError, match="EagleModelMixin"):
        target.set_aux_hidden_state_layers((1, 2))

    assert apply_all("register", ids=("P12",)) == ["P12 bailing-aux-hidden-states"]
    _, target, _ = build_tiny_models(tiny_mla_checkpoint, load=False)
    assert type(target.model) is LingModel and supports_eagle3(target)
    target.set_aux_hidden_state_layers((4, 2))
    assert target.model.aux_hidden_state_layers == (2, 4)


def test_p12_refuses_a_changed_upstream_model(monkeypatch):
    from vllm.model_executor.models import bailing_moe_v3

    import vllm_ling
    from vllm_ling.models.ling3 import LingModel

    vllm_ling.register()
    upstream = LingModel.__mro__[2]
    monkeypatch.setattr(bailing_moe_v3, "BailingMoeV3Model", upstream)
    assert_refuses_changed_source(monkeypatch, "P12", lambda: bailing_moe_v3.BailingMoeV3Model is upstream)
