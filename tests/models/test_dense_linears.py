"""The dense block-FP8 linear shapes of Ling-3.0-flash as vLLM 0.32 builds them (CPU).

Checked against the structure read from vLLM's ``bailing_moe_v3.py`` (KDA: qkv_proj, f_proj,
g_proj, o_proj; MLA: q_proj, kv_a_proj_with_mqa, kv_b_proj, dense; MLPs: gate_up_proj,
down_proj; NEXTN: eh_proj), with vllm-ling's KDA merge (qkvfg_proj) on and off, and against
the independent byte model of ``plan`` (the same bytes per layer class)."""

from __future__ import annotations

import json
import os

from vllm_ling.models.dense_linears import dense_fp8_linears, distinct_decode_shapes

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "vllm_ling", "data")
FULL = json.load(open(os.path.join(DATA, "ling3_flash_fp4_config.json")))


def _by_module(merged=False):
    return {d.module: d for d in dense_fp8_linears(FULL, kda_merged_in_proj=merged)}


def test_full_model_shapes_and_layer_counts():
    m = _by_module()
    kda = [i for i in range(42) if (i + 1) % 6]
    mla = [i for i in range(42) if (i + 1) % 6 == 0] + [42]
    assert m["self_attn.qkv_proj"].shape == (12288, 2560) and list(m["self_attn.qkv_proj"].layers) == kda
    assert m["self_attn.qkv_proj"].members == ("q_proj", "k_proj", "v_proj")
    for name in ("self_attn.f_proj", "self_attn.g_proj"):
        assert m[name].shape == (4096, 2560) and len(m[name].layers) == 35
    assert m["self_attn.o_proj"].shape == (2560, 4096)
    assert m["self_attn.q_proj"].shape == (6144, 2560) and list(m["self_attn.q_proj"].layers) == mla
    assert m["self_attn.kv_a_proj_with_mqa"].shape == (576, 2560)
    assert m["self_attn.kv_b_proj"].shape == (8192, 512) and not m["self_attn.kv_b_proj"].decode
    assert m["self_attn.dense"].shape == (2560, 4096)
    assert m["mlp.gate_up_proj"].shape == (12288, 2560) and m["mlp.gate_up_proj"].layers == (0, 1)
    assert m["mlp.down_proj"].shape == (2560, 6144)
    assert m["mlp.shared_experts.gate_up_proj"].shape == (1536, 2560)
    assert len(m["mlp.shared_experts.gate_up_proj"].layers) == 41  # 40 MoE layers + NEXTN
    assert m["mlp.shared_experts.down_proj"].shape == (2560, 768)
    assert m["eh_proj"].shape == (2560, 5120) and m["eh_proj"].layers == (42,)
    # left in BF16 by modules_to_not_convert: KDA b_proj, MLA g_proj, routers
    assert not any(name.endswith(("b_proj", ".gate")) and not name.endswith("kv_b_proj") for name in m)
    assert "self_attn.g_proj" in m and m["self_attn.g_proj"].shape == (4096, 2560)


def test_distinct_decode_shapes():
    assert distinct_decode_shapes(FULL, kda_merged_in_proj=False) == [
        (12288, 2560), (2560, 6144), (6144, 2560), (2560, 5120), (2560, 4096), (4096, 2560), (1536, 2560),
        (2560, 768), (576, 2560)]
    # the merge: KDA's q|k|v (12288), f and g (4096 each) become one 20480 x 2560; 12288 x 2560 stays
    # (the dense MLP's gate_up_proj), 4096 x 2560 goes
    assert distinct_decode_shapes(FULL, kda_merged_in_proj=True) == [
        (20480, 2560), (12288, 2560), (2560, 6144), (6144, 2560), (2560, 5120), (2560, 4096), (1536, 2560),
        (2560, 768), (576, 2560)]


def test_kda_merge_follows_the_option_and_the_layers_rule(monkeypatch):
    m = _by_module(merged=True)
    kda = [i for i in range(42) if (i + 1) % 6]
    assert m["self_attn.qkvfg_proj"].shape == (20480, 2560) and list(m["self_attn.qkvfg_proj"].layers) == kda
    assert m["self_attn.qkvfg_proj"].members == ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")
    assert not {"self_attn.qkv_proj", "self_attn.f_proj"} & set(m)
    assert "self_attn.g_proj" not in m  # MLA's g_proj is BF16; KDA's is in the merge
    assert sum(d.weight_bytes for n, d in m.items() if n.startswith("self_attn.qkvfg")) == sum(
        d.weight_bytes for n, d in _by_module().items() if n in ("self_attn.qkv_proj", "self_attn.f_proj",
                                                                  "self_attn.g_proj") and 0 in d.layers)
    # default: the server's option
    monkeypatch.setenv("VLLM_LING_KDA_MERGED_IN_PROJ", "0")
    assert (4096, 2560) in distinct_decode_shapes(FULL) and (20480, 2560) not in distinct_decode_shapes(FULL)
    monkeypatch.delenv("VLLM_LING_KDA_MERGED_IN_PROJ")
    assert (20480, 2560) in distinct_decode_shapes(FULL)
    # layers the KDA layer refuses to merge keep vLLM's linears: b_proj FP8 (vLLM's qkvb_proj) ...
    cfg = json.loads(json.dumps(FULL))
    cfg["quantization_config"]["modules_to_not_convert"].remove("b_proj")
    assert "self_attn.qkvfg_proj" not in _by_module_of(cfg, merged=True)
    # ... or one member in BF16 (layer 3's f_proj)
    cfg = json.loads(json.dumps(FULL))
    cfg["quantization_config"]["modules_to_not_convert"].append("3.attention.f_proj")
    m = _by_module_of(cfg, merged=True)
    assert 3 not in m["self_attn.qkvfg_proj"].layers and m["self_attn.qkv_proj"].layers == (3,)


def test_b_proj_in_fp8_merges_into_qkvb():
    cfg = json.loads(json.dumps(FULL))
    cfg["quantization_config"]["modules_to_not_convert"].remove("b_proj")
    m = _by_module_of(cfg)
    assert m["self_attn.qkvb_proj"].shape == (12288 + 32, 2560)
    assert m["self_attn.qkvb_proj"].members == ("q_proj", "k_proj", "v_proj", "b_proj")


def _by_module_of(cfg, merged=False):
    return {d.module: d for d in dense_fp8_linears(cfg, kda_merged_in_proj=merged)}


def test_bytes_agree_with_the_plan_byte_model():
    from vllm_ling.models import cost_model as plan

    skip = FULL["quantization_config"]["modules_to_not_convert"]
    kda_proj, _ = plan._kda_weight_bytes(FULL, "model.layers.0.attention", skip)
    m = _by_module()
    ours = sum(m[f"self_attn.{p}"].weight_bytes for p in ("qkv_proj", "f_proj", "g_proj", "o_proj"))
    b_proj_bf16 = 32 * 2560 * 2
    assert ours + b_proj_bf16 == kda_proj
    _, shared, _ = plan._moe_bytes(FULL, "model.layers.2.mlp", skip, 8)
    assert m["mlp.shared_experts.gate_up_proj"].weight_bytes + m["mlp.shared_experts.down_proj"].weight_bytes == shared


def test_tiny_config_enumerates():
    tiny = json.load(open(os.path.join(DATA, "ling3_tiny_fp4_config.json")))
    shapes = distinct_decode_shapes(tiny)
    assert shapes and all(n > 0 and k % 128 == 0 for n, k in shapes)
    # the tiny KDA shards (16 heads x 64 = 1024 rows) sit on the 128-row block grid, like the full model's
    merged = {d.module: d for d in dense_fp8_linears(tiny, kda_merged_in_proj=True)}["self_attn.qkvfg_proj"]
    assert merged.shape == (5 * 1024, 256) and 1024 % 128 == 0


def test_tensor_parallel_shapes_follow_vllms_layouts():
    import json
    from pathlib import Path

    from vllm_ling.models.dense_linears import dense_fp8_linears, distinct_decode_shapes, partitioned_shape

    config = json.loads((Path(__file__).resolve().parents[2] / "vllm_ling" / "data"
                         / "ling3_flash_fp4_config.json").read_text())
    by_module = {d.module: d for d in dense_fp8_linears(config, kda_merged_in_proj=False)}
    assert partitioned_shape(by_module["self_attn.qkv_proj"], 2) == (6144, 2560)       # column: N / 2
    merged = {d.module: d for d in dense_fp8_linears(config, kda_merged_in_proj=True)}["self_attn.qkvfg_proj"]
    assert partitioned_shape(merged, 2) == (5 * 4096 // 2, 2560)  # per rank: the five local shards
    assert partitioned_shape(by_module["mlp.shared_experts.down_proj"], 2) == (2560, 384)  # row: K / 2
    assert partitioned_shape(by_module["self_attn.kv_a_proj_with_mqa"], 2) == (576, 2560)  # replicated
    assert partitioned_shape(by_module["eh_proj"], 2) == (2560, 5120)                  # replicated
    assert distinct_decode_shapes(config, tensor_parallel_size=1) == distinct_decode_shapes(config)
    assert (2560, 384) in distinct_decode_shapes(config, tensor_parallel_size=2)
