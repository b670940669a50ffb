"""`vllm-ling plan` against hand computations for the tiny config, and its CLI."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from vllm_ling.cli import plan as plan_cli
from vllm_ling.models import cost_model as plan

TINY = json.loads((resources.files("vllm_ling") / "data" / "ling3_tiny_fp4_config.json").read_text())
FLASH = json.loads((resources.files("vllm_ling") / "data" / "ling3_flash_fp4_config.json").read_text())


def component(p: plan.Plan, prefix: str) -> plan.Component:
    (c,) = [c for c in p.components if c.name.startswith(prefix)]
    return c


@pytest.fixture(scope="module")
def tiny_plan() -> plan.Plan:
    return plan.build_plan(TINY, context=1000, verify_tokens=4)


def test_tiny_layer_pattern(tiny_plan):
    c = tiny_plan.counts
    # 6 layers, group 6: layer 5 is MLA; first_k_dense_replace 2: layers 0-1 dense MLP
    assert c.kda_layers == [0, 1, 2, 3, 4] and c.mla_layers == [5]
    assert c.dense_layers == [0, 1] and c.moe_layers == [2, 3, 4, 5]


def test_tiny_routed_experts_by_hand(tiny_plan):
    # One expert: 3 * 256 * 128 = 98,304 params at 0.5 B + 1/32 B (E8M0 per 32) = 52,224 B.
    # Batch 1: 4 MoE layers * top-2 = 8 experts -> 417,792 B.
    c = component(tiny_plan, "routed experts")
    assert c.batch1_bytes == 417_792
    # Verify window of 4 tokens, uniform routing over 16 experts, top-2:
    # 16 * (1 - (14/16)^4) = 16 * 1695/4096 = 6.62109375 experts per layer -> 4 * 6.621... * 52,224
    assert tiny_plan.distinct_experts_verify == pytest.approx(6.62109375)
    assert c.verify_bytes == pytest.approx(1_383_120)


def test_tiny_head_by_hand(tiny_plan):
    # 2048 x 256 head: BF16 1,048,576 B; FP8 524,288 B + 2,048 BF16 channel scales; fp32 2,097,152 B
    assert tiny_plan.head_bytes == {"bf16": 1_048_576, "fp8": 528_384, "fp32": 2_097_152}


def test_tiny_shared_expert_and_state_by_hand(tiny_plan):
    # gate_up 256 -> [128, 128] FP8: 65,536 B + 2 shards * 1 * 2 blocks * 4 B = 65,552 B
    # down 128 -> 256: 32,768 B + 2 * 1 blocks * 4 B = 32,776 B; times 4 MoE layers
    assert component(tiny_plan, "shared expert").batch1_bytes == 4 * (65_552 + 32_776)
    # KDA recurrent state fp32: 5 layers * 16 heads * 64 * 64 * 4 B
    assert component(tiny_plan, "KDA recurrent state fp32 (read)").batch1_bytes == 5 * 262_144
    # written once per token at batch 1, once per window position in a verify step
    assert component(tiny_plan, "KDA recurrent state fp32 (write)").verify_bytes == 4 * 5 * 262_144
    # MLA KV cache: 1 MLA layer * 1000 tokens * (512 + 64) * 2 B
    assert component(tiny_plan, "MLA KV cache").batch1_bytes == 1_152_000


def test_tiny_attention_projections_by_hand(tiny_plan):
    # KDA layer: qkv 256 -> 3x1024 FP8 786,432 + 3*8*2 scales*4 = 786,624; b_proj stays BF16
    # (modules_to_not_convert) 256*16*2 = 8,192; f, g, o each 262,144 + 16 scales*4 = 262,208
    assert component(tiny_plan, "KDA projections").batch1_bytes == 5 * (786_624 + 8_192 + 3 * 262_208)
    # MLA layer 5: q 256 -> 3072 786,624; kv_a 256 -> 576 147,456 + 5*2*4 = 147,496;
    # W_UK/W_UV BF16 512*16*256*2 = 4,194,304; g_proj head-wise BF16 ("5.attention.g_proj"
    # excluded) 256*16*2 = 8,192; dense 2048 -> 256 524,288 + 2*16*4 = 524,416; kv_a norm 1,024
    assert component(tiny_plan, "MLA projections").batch1_bytes == (
        786_624 + 147_496 + 4_194_304 + 8_192 + 524_416 + 1_024)


def test_floor_and_mtp_model(tiny_plan):
    d = plan.plan_to_dict(tiny_plan, 100.0, "test", draft_tokens=3, verify_ratio_override=None)
    fp8 = d["heads"]["fp8"]
    total = sum(c.batch1_bytes for c in tiny_plan.components) + 528_384
    assert fp8["bytes_per_token_batch1"] == pytest.approx(total)
    assert fp8["floor_tpot_ms"] == pytest.approx(total / 100e9 * 1e3)
    m = fp8["mtp"]
    assert m["break_even_accept_length"] == pytest.approx(m["verify_cost_ratio"] + m["draft_cost_ratio"])
    assert plan.mtp_speedup(m["break_even_accept_length"], m["verify_cost_ratio"], m["draft_cost_ratio"]) == (
        pytest.approx(1.0))
    assert plan.mtp_speedup(4.0, 1.5, 0.5) == 2.0


def test_flash_shapes_match_the_brief():
    p = plan.build_plan(FLASH, context=32768, verify_tokens=4)
    assert len(p.counts.kda_layers) == 35 and p.counts.mla_layers == [5, 11, 17, 23, 29, 35, 41]
    assert len(p.counts.moe_layers) == 40
    # 8 experts of 3 * 2560 * 768 params at 17/32 B: 25.07 MB per layer (the brief's 25.1 MB)
    assert component(p, "routed experts").batch1_bytes / 40 == pytest.approx(25_067_520)
    assert p.head_bytes["bf16"] == 157184 * 2560 * 2  # 805 MB


def test_suffix_exclusion_respects_component_boundaries():
    skip = ["b_proj", "5.attention.g_proj"]
    assert plan._is_not_converted("model.layers.3.attention.b_proj", skip)
    assert not plan._is_not_converted("model.layers.3.attention.q_b_proj", skip)
    assert plan._is_not_converted("model.layers.5.attention.g_proj", skip)
    assert not plan._is_not_converted("model.layers.15.attention.g_proj", skip)


def test_spark_reproduces_the_studys_order(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--device", "spark", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Model vs the study's DGX Spark measurements" in text
    d = json.loads(out.read_text())
    fp32, bf16, fp8 = (d["heads"][h]["floor_tpot_ms"] for h in ("fp32", "bf16", "fp8"))
    # floors are lower bounds of the measurements, within the range real kernels reach
    assert 0.6 * 27.71 < fp32 < 27.71
    assert 0.6 * 22.76 < fp8 < 22.76
    # measured FP8-head saving (25.35 -> 22.76 ms) lies between the BF16- and fp32-head predictions
    assert bf16 - fp8 < 25.35 - 22.76 < fp32 - fp8
    assert d["study_comparison"]


def test_cli_errors(tmp_path, capsys):
    assert plan_cli.main(["--config", str(tmp_path / "nope.json")]) == 2
    assert "--config" in capsys.readouterr().err
    assert plan_cli.main([str(tmp_path)]) == 2  # a directory without config.json
    assert "no config.json" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"]}))
    assert plan_cli.main([str(tmp_path)]) == 2
    assert "LlamaForCausalLM" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["--bandwidth-gbs", "-5"])
    with pytest.raises(SystemExit):
        plan_cli.main(["--device", "tpu"])


def test_checkpoint_dir_and_custom_bandwidth(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert plan_cli.main([str(tmp_path), "--bandwidth-gbs", "100", "--context", "1000", "--head", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "custom (100 GB/s)" in text and "LM head bf16" in text
    assert "study" not in text  # the study comparison only applies to the full-size model on a Spark


def test_efficiency_from_a_decode_step_result(capsys, tmp_path):
    plan_main = plan_cli.main
    h200 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "decode_step_h200.json"
    out_json = tmp_path / "plan.json"
    assert plan_main(["--device", "h200", "--no-study", "--efficiency", str(h200), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "measured efficiency (ours composition" in text and "H200" in text
    measured = json.loads(out_json.read_text())["measured_efficiency"]
    assert [m["tokens"] for m in measured] == [1, 4]
    for m in measured:
        assert m["predicted_ms"] == pytest.approx(m["floor_ms"] / m["efficiency"])
        assert 0 < m["efficiency"] < 1
        assert m["predicted_with_launches_ms"] == pytest.approx(
            m["floor_ms"] + m["launches"] * m["launch_overhead_us"] / 1e3)
    # the per-launch cost is the run's time above its own bytes at its own copy bandwidth
    run = json.loads(h200.read_text())
    for m in measured:
        r = next(r for r in run["results"] if r["tokens"] == m["tokens"])
        above_us = r["ours"]["us"] - (r["plan_bytes_target"] + r["plan_bytes_draft"]) / (run["copy_gbs"] * 1e3)
        assert m["launches"] == r["ours"]["launches"]
        assert m["launch_overhead_us"] == pytest.approx(above_us / r["ours"]["launches"])
    capsys.readouterr()
    assert plan_main(["--efficiency", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err
    # a file without the verify window's token count is an error naming both
    assert plan_main(["--efficiency", str(h200), "--draft-tokens", "5"]) == 2
    assert "no 6-token step" in capsys.readouterr().err


def test_dspark_draft_cycle_by_hand():
    """The full-size drafter's bytes per draft cycle (8 tokens, 4096 context), by hand from its shapes."""
    from vllm_ling.models.dspark_format import read_fields

    fields = read_fields(json.loads((resources.files("vllm_ling") / "data" / "ling3_flash_dspark_config.json")
                                    .read_text()), "packaged")
    parts = {c.name: c.batch1_bytes for c in plan.dspark_draft_components(fields, 4096, 8)}
    # 5 layers x (4 x 4096 x 2560 attention + 3 x 6144 x 2560 MLP) x 2 B
    assert parts["draft layers BF16 (attention + MLP)"] == 5 * (4 * 4096 * 2560 + 3 * 6144 * 2560) * 2
    # vLLM's fused context K/V weight: 5 layers x (K + V) 4096 x 2560 x 2 B
    assert parts["draft fused context K/V projection copy"] == 5 * 2 * 4096 * 2560 * 2
    # its KV cache: 5 layers x (K + V) x 32 heads x 128 x 2 B per token
    assert parts["draft KV cache BF16 @ 4096 tokens"] == 4096 * 5 * 2 * 4096 * 2
    # markov_w2 [157184, 256] BF16 read at each of the 8 sequential steps
    assert parts["Markov head: markov_w2 x 8 steps"] == 8 * 157184 * 256 * 2


def test_dspark_plan_cli(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--drafter", "dspark", "--device", "h200", "--context", "4096", "--no-study",
                          "--json", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())["dspark"]
    assert result["draft_tokens"] == 8  # the drafter's block_size
    assert result["break_even_accept_length"] == pytest.approx(result["verify_cost_ratio"] + result["draft_cost_ratio"])
    assert result["verify_cost_ratio"] > 2.0  # 9 positions touch ~68 experts per layer under uniform routing
    tpot = result["published"]["model card, GSM8K"]
    assert tpot["tpot_ms"] == pytest.approx(result["floor_tpot_ms"] * result["break_even_accept_length"] / 6.40)
    assert "verify window 9 tokens" in text and "model card, GSM8K" in text
    assert plan_cli.main(["--drafter", "dspark", "--dspark-tokens", "9"]) == 2  # more than its block


def test_kv_per_request_in_vllms_pages_for_each_speculation_mode(capsys, tmp_path):
    """`plan` prints what one request of the context takes in vLLM's pages on CUDA (the memory guard's
    model, whose known answers are the H100 servers' logged capacities): 0.43 GB without speculation and
    0.79 GB with MTP x 3 at 33,024 tokens, DSpark's row with --drafter dspark; the JSON has the bytes."""
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--device", "h100", "--context", "33024", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("KV cache + KDA state per 33024-token request on CUDA (vLLM's pages, TP 1): no speculation 0.43 GB, "
            "MTP x 3 0.79 GB") in text and "DSpark" not in text.split("KV cache + KDA state")[1]
    assert json.loads(out.read_text())["kv_bytes_per_request_cuda"] == {"no speculation": 433520640,
                                                                      "MTP x 3": 792723456}
    assert plan_cli.main(["--device", "h100", "--context", "33024", "--drafter", "dspark"]) == 0
    assert "MTP x 3 0.79 GB, DSpark x 8 4.16 GB" in capsys.readouterr().out
    # a config without KDA layers (make-tiny --all-mla) keeps vLLM's plain block: no state pages
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "layer_group_size": 1}))
    assert plan_cli.main([str(tmp_path), "--draft-tokens", "0"]) == 0
    assert "no speculation" in capsys.readouterr().out
