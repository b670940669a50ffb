"""The tiny checkpoint is the real -fp4 format, and bad checkpoints fail before loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_ling.models.checkpoint_check import CheckpointFormatError, check_checkpoint
from vllm_ling.models.checkpoint_format import checkpoint_specs, is_kda_layer

DATA = Path(__file__).resolve().parents[2] / "vllm_ling" / "data"


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_full_size_parameter_counts_match_the_brief():
    cfg = json.loads((DATA / "ling3_flash_fp4_config.json").read_text())
    target = sum(s.numel for s in checkpoint_specs(cfg, include_mtp=False))
    mtp = sum(s.numel for s in checkpoint_specs(cfg, include_mtp=True)) - target
    assert 123e9 < target < 125e9  # "124B total parameters"
    assert 3.0e9 < mtp < 3.3e9  # "about 3.1B params"
    mla = [i for i in range(42) if not is_kda_layer(i, cfg)]
    assert mla == [5, 11, 17, 23, 29, 35, 41]
    head = next(s for s in checkpoint_specs(cfg) if s.name == "lm_head.weight")
    assert head.shape == (157184, 2560) and head.numel * 2 == pytest.approx(805e6, rel=1e-3)


def test_tiny_checkpoint_is_deterministic(tmp_path, tiny_checkpoint):
    from vllm_ling.models.tiny_checkpoint import make_tiny

    again = make_tiny(tmp_path / "again", seed=0)
    for f in sorted(p.name for p in tiny_checkpoint.iterdir()):
        assert (tiny_checkpoint / f).read_bytes() == (again / f).read_bytes(), f
    other = make_tiny(tmp_path / "other", seed=1)
    assert (other / "model-00001-of-00002.safetensors").read_bytes() != \
        (tiny_checkpoint / "model-00001-of-00002.safetensors").read_bytes()


def test_tiny_checkpoint_storage_format(tiny_checkpoint):
    cfg = _config(tiny_checkpoint)
    t = {}
    for shard in tiny_checkpoint.glob("*.safetensors"):
        t.update(load_file(str(shard)))
    # layer pattern: KDA layers 0-4, MLA layer 5, dense MLP in layers 0-1, NEXTN layer 6
    assert "model.layers.0.attention.q_conv1d.weight" in t
    assert "model.layers.5.attention.kv_a_proj_with_mqa.weight" in t
    assert "model.layers.1.mlp.gate_proj.weight" in t and "model.layers.2.mlp.gate.expert_bias" in t
    assert "model.layers.6.eh_proj.weight" in t and "model.layers.6.mlp.experts.0.up_proj.weight" in t
    # dense: FP8 e4m3 with power-of-two (UE8M0) 128x128 block scales
    w, s = t["model.layers.0.attention.q_proj.weight"], t["model.layers.0.attention.q_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (8, 2)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    # realistic magnitudes: weights ~N(0, 0.02) -> amax ~0.1 -> scale 2**-12 .. 2**-11
    assert (s > 2 ** -14).all() and (s < 2 ** -9).all()
    # routed experts: e2m1 packed two per byte, one E8M0 scale per 32 inputs
    p, e = t["model.layers.2.mlp.experts.3.gate_proj.weight"], t["model.layers.2.mlp.experts.3.gate_proj.weight_scale_inv"]
    assert p.dtype == torch.uint8 and p.shape == (128, 128)  # [moe_inter, hidden/2]
    assert e.dtype == torch.float8_e8m0fnu and e.shape == (128, 8)  # [moe_inter, hidden/32]
    exps = e.view(torch.uint8).int() - 127
    # group amax of 32 draws of N(0, 0.02) is 0.02..0.1, so 2**ceil(log2(amax / 6)) is 2**-8 .. 2**-5
    assert exps.min() >= -8 and exps.max() <= -5, (exps.min(), exps.max())
    # unquantized modules_to_not_convert: head, embeddings, b_proj, router, MLA g_proj
    assert t["lm_head.weight"].dtype == torch.bfloat16
    assert t["model.word_embeddings.weight"].dtype == torch.bfloat16
    assert t["model.layers.0.attention.b_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.5.attention.g_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.2.mlp.gate.weight"].dtype == torch.float32
    assert cfg["quantization_config"]["modules_to_not_convert"][:4] == ["lm_head", "model.word_embeddings", "b_proj", "mlp.gate"]


def test_tokenizer_is_local_and_covers_the_vocabulary(tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    assert len(tok) == _config(tiny_checkpoint)["vocab_size"]
    ids = tok("hello world 42")["input_ids"]
    assert tok.decode(ids) == "hello world 42"
    assert tok.eos_token_id == _config(tiny_checkpoint)["eos_token_id"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<role>ASSISTANT</role>\n<think>")


def test_check_accepts_the_tiny_checkpoint(tiny_checkpoint):
    assert check_checkpoint(tiny_checkpoint, _config(tiny_checkpoint), include_mtp=True) == []


def test_the_routable_tiny_checkpoint_is_the_format_and_the_top_k_kernel_holds_it(tmp_path):
    """``make-tiny --routable`` (the GPU end-to-end test of the decode cuts serves it): the -fp4 format
    with 64 experts in 2 groups, a routing the grouped top-k kernel takes, the default tiny's not."""
    from vllm_ling.cli.make_tiny import main
    from vllm_ling.ops.router_topk.kernel import shape_problems

    assert main([str(tmp_path / "routable"), "--routable", "--agreeing"]) == 0
    config = _config(tmp_path / "routable")
    assert check_checkpoint(tmp_path / "routable", config, include_mtp=True) == []
    routing = (config["num_experts"], config["n_group"], config["topk_group"], config["num_experts_per_tok"])
    assert routing == (64, 2, 1, 2) and shape_problems(*routing) == []
    default = json.loads((DATA / "ling3_tiny_fp4_config.json").read_text())
    assert shape_problems(default["num_experts"], default["n_group"], default["topk_group"],
                          default["num_experts_per_tok"])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_names_the_file(tmp_path, tiny_checkpoint):
    d = _copy(tiny_checkpoint, tmp_path / "ckpt")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match=r"model-00002-of-00002.safetensors: shard listed in "
                                                    r"model.safetensors.index.json is missing"):
        check_checkpoint(d, _config(d))


def test_truncated_shard_with_intact_header_names_the_file(tmp_path, tiny_checkpoint):
    """An interrupted copy: the header is whole, the data is cut short by 1000 bytes."""
    d = _copy(tiny_checkpoint, tmp_path / "ckpt")
    shard = d / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointFormatError) as err:
        check_checkpoint(d, _config(d))
    assert f"{shard}: shard is truncated: {size - 1000} bytes on disk, its header describes {size}" \
        in str(err.value)
    # safetensors itself refuses the file too (what the check gets ahead of).
    with pytest.raises(Exception, match="incomplete metadata"):
        load_file(str(shard))


def _rewrite_tensor(d: Path, name: str, new: torch.Tensor) -> str:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][name]
    tensors = load_file(str(d / shard))
    tensors[name] = new
    save_file(tensors, str(d / shard))
    return shard


def test_scale_with_wrong_dtype_names_file_and_tensor(tmp_path, tiny_checkpoint):
    d = _copy(tiny_checkpoint, tmp_path / "ckpt")
    name = "model.layers.3.mlp.experts.1.down_proj.weight_scale_inv"
    shard = _rewrite_tensor(d, name, torch.zeros(256, 4, dtype=torch.bfloat16))
    with pytest.raises(CheckpointFormatError) as err:
        check_checkpoint(d, _config(d))
    assert f"{d / shard}: tensor {name} has dtype bfloat16, expected float8_e8m0fnu" in str(err.value)


def test_scale_with_wrong_shape_names_file_and_tensor(tmp_path, tiny_checkpoint):
    d = _copy(tiny_checkpoint, tmp_path / "ckpt")
    name = "model.layers.0.attention.o_proj.weight_scale_inv"
    shard = _rewrite_tensor(d, name, torch.ones(3, 3))
    with pytest.raises(CheckpointFormatError) as err:
        check_checkpoint(d, _config(d))
    assert f"{d / shard}: tensor {name} has shape [3, 3], expected [2, 8]" in str(err.value)


def test_inspect_reports_bytes_per_decode_token(tiny_checkpoint, capsys):
    from vllm_ling.cli.inspect import main, summarize

    s = summarize(tiny_checkpoint)
    experts = s["classes"]["routed_experts"]
    # 4 MoE layers x 16 experts x 3 matrices x 128x256 params; MXFP4 = 0.5 B + 1 B per 32 params
    assert experts["bytes"] == 4 * 16 * 3 * 128 * 256 * (0.5 + 1 / 32)
    assert experts["decode_bytes"] == pytest.approx(experts["bytes"] * 2 / 16)  # top-2 of 16
    assert s["classes"]["head"]["decode_bytes"] == 2048 * 256 * 2
    assert s["classes"]["embeddings"]["decode_bytes"] == 256 * 2
    assert main([str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "| routed_experts | float8_e8m0fnu, uint8 | 384 |" in out
