"""`vllm-ling warmup`: shapes from config.json, CPU behaviour, and what it hands the kernels."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest

from vllm_ling.serving import launch
from vllm_ling.serving.tiny_checkpoint import TINY_CONFIG

from ._tools import REPO, run

FLASH_CONFIG = REPO / "vllm_ling" / "data" / "ling3_flash_fp4_config.json"


def make_model(tmp_path, config_path=FLASH_CONFIG):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(config_path, model / "config.json")
    return model


def cli(*args, env_extra=None):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    env.update(env_extra or {})
    return run([sys.executable, "-m", "vllm_ling.serving.cli", "warmup", *args], env=env)


def test_cpu_without_allow_cpu_exits_2_with_the_reason(tmp_path):
    model = make_model(tmp_path)
    result = cli(str(model), "--device", "cpu")
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--allow-cpu" in result.stderr


def test_cpu_with_allow_cpu_reports_shapes_and_exits_0(tmp_path):
    config = json.loads(FLASH_CONFIG.read_text())
    model = make_model(tmp_path)
    result = cli(str(model), "--device", "cpu", "--allow-cpu", "--tensor-parallel-size", "2")
    assert result.returncode == 0, result.stderr
    assert "nothing to compile" in result.stdout
    per_rank = config["moe_intermediate_size"] // 2
    assert f"expert intermediate {per_rank}" in result.stdout
    assert f"{config['num_experts']} experts, top-{config['num_experts_per_tok']}" in result.stdout
    assert "W4A8" in result.stdout  # the -fp4 checkpoint: fp8 dynamic activations, MXFP4 experts


def test_auto_device_on_this_cpu_machine(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback; this machine has CUDA")
    result = cli(str(make_model(tmp_path, TINY_CONFIG)))
    assert result.returncode == 2 and "no CUDA device" in result.stderr


def test_missing_model_and_bad_config(tmp_path):
    result = cli(str(tmp_path / "absent"), "--allow-cpu")
    assert result.returncode == 2 and str(tmp_path / "absent") in result.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"hidden_size": 8}))
    result = cli(str(broken), "--allow-cpu")
    assert result.returncode == 2 and "moe_intermediate_size" in result.stderr
    result = cli(str(make_model(tmp_path)), "--allow-cpu", "--tensor-parallel-size", "5")
    assert result.returncode == 2 and "does not divide" in result.stderr


def test_shapes_follow_the_config(tmp_path):
    config = json.loads(TINY_CONFIG.read_text())
    shapes = launch.kernel_shapes(config, 1, "auto", TINY_CONFIG)
    assert (shapes.hidden_size, shapes.intermediate_size, shapes.num_experts, shapes.top_k) == (
        config["hidden_size"], config["moe_intermediate_size"], config["num_experts"],
        config["num_experts_per_tok"])
    assert shapes.vocab_rows >= config["vocab_size"] and shapes.vocab_rows % 64 == 0
    bf16 = dict(config, quantization_config={"quant_method": "mxfp4"})
    assert launch.kernel_shapes(bf16, 1, "auto", TINY_CONFIG).w4a8 is False
    assert launch.kernel_shapes(bf16, 1, "on", TINY_CONFIG).w4a8 is True


def test_cuda_path_passes_config_shapes_to_each_kernel_group(tmp_path, monkeypatch, capsys):
    """With a (pretend) GPU, warmup calls the two kernel groups with the checkpoint's shapes
    under the cache lock, in the configured cache, and prints one timing row per group."""
    config = json.loads(FLASH_CONFIG.read_text())
    model = make_model(tmp_path)
    calls = []

    def fake_moe(hidden, intermediate, experts, top_k, *, token_counts, w4a8, swiglu_limits):
        calls.append(("moe", hidden, intermediate, experts, top_k, tuple(token_counts), w4a8,
                      tuple(swiglu_limits)))
        kernel = tmp_path / "cache" / "kernels" / "k1"
        kernel.mkdir(parents=True)
        (kernel / "kernel.cubin").write_bytes(b"x")  # one new kernel in humming's layout

    def fake_head(vocab, hidden, *, row_counts):
        calls.append(("lm_head", vocab, hidden, tuple(row_counts)))

    monkeypatch.setattr(launch, "_load_warmup_functions",
                        lambda: [("moe", fake_moe), ("lm_head", fake_head)])
    monkeypatch.setattr(launch, "cuda_available", lambda: True)
    for var in ("VLLM_LING_HUMMING_CACHE", "HUMMING_CACHE_DIR", "HUMMING_TMP_DIR"):
        # warmup exports these for the kernels; setenv makes pytest restore them afterwards.
        monkeypatch.setenv(var, str(tmp_path / "overridden"))
    rc = launch.warmup_main([str(model), "--device", "auto", "--humming-cache", str(tmp_path / "cache"),
                             "--token-counts", "4,1,4", "--row-counts", "1,4"])
    out = capsys.readouterr().out
    assert rc == 0
    limits = sorted({float(v) for v in config["expert_swiglu_limit_list"] if v})
    assert limits  # Ling-3.0-flash clamps its last routed-expert layers
    assert calls == [
        ("moe", config["hidden_size"], config["moe_intermediate_size"], config["num_experts"],
         config["num_experts_per_tok"], (1, 4), True, (None, *limits)),
        ("lm_head", config["vocab_size"], config["hidden_size"], (1, 4)),  # 157184 = 64 x 2456
    ]
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("moe", "lm_head")}
    assert rows["moe"][2] == "1" and rows["lm_head"][2] == "0"  # new kernels per group
    assert str(tmp_path / "cache" / "kernels") in out


def test_missing_kernel_warmup_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "cuda_available", lambda: True)
    import vllm_ling.ops

    without_warmup = types.ModuleType("vllm_ling.ops.moe")  # an ops.moe lacking warmup_kernels
    monkeypatch.setitem(sys.modules, "vllm_ling.ops.moe", without_warmup)
    monkeypatch.setattr(vllm_ling.ops, "moe", without_warmup, raising=False)
    rc = launch.warmup_main([str(make_model(tmp_path))])
    assert rc == 2
    assert "warmup_kernels" in capsys.readouterr().err


def test_real_kernel_warmup_functions_accept_the_arguments_warmup_passes():
    """Contract with vllm_ling.ops: the call warmup makes binds to the real signatures
    (checked without running them; they need CUDA)."""
    import inspect

    groups = dict(launch._load_warmup_functions())
    shapes = launch.kernel_shapes(json.loads(FLASH_CONFIG.read_text()), 1, "auto", FLASH_CONFIG)
    inspect.signature(groups["moe"]).bind(
        shapes.hidden_size, shapes.intermediate_size, shapes.num_experts, shapes.top_k,
        token_counts=[1, 4], w4a8=shapes.w4a8, swiglu_limits=shapes.swiglu_limits)
    inspect.signature(groups["lm_head"]).bind(shapes.vocab_rows, shapes.hidden_size, row_counts=[1, 4])
