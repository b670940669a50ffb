"""`vllm-ling warmup`: shapes from config.json, CPU behaviour, and what it hands the kernels."""

from __future__ import annotations

import functools
import json
import shutil
import sys
import types

import pytest
import torch

from vllm_ling.cli import serve as launch
from vllm_ling.cli import warmup
from vllm_ling.models.tiny_checkpoint import TINY_CONFIG
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP

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
    return run([sys.executable, "-m", "vllm_ling.cli.main", "warmup", *args], env=env)


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
    # The server runs W4A16 unless VLLM_LING_MOE_W4A8=1, whatever the checkpoint: so does warmup.
    assert "MoE W4A16" in result.stdout
    w4a8 = cli(str(model), "--device", "cpu", "--allow-cpu", env_extra={"VLLM_LING_MOE_W4A8": "1"})
    assert w4a8.returncode == 0, w4a8.stderr
    assert "MoE W4A8" in w4a8.stdout


def _plan(tmp_path, config, env, **changes):
    """The warm-up plan for ``config`` changed by ``changes``, under the environment ``env``."""
    model = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return warmup.plan_warmup(warmup.build_warmup_parser().parse_args([str(model)]), env)


def test_router_gemv_plan_follows_the_switch_and_the_gate_shape(tmp_path):
    config = json.loads(FLASH_CONFIG.read_text())
    plan = functools.partial(_plan, tmp_path, config)

    on = plan({})
    assert on.router and f"router GEMV {config['num_experts']} x {config['hidden_size']}" in on.describe()
    off = plan({"VLLM_LING_ROUTER_GEMV": "vllm"})
    assert not off.router and "router GEMV skipped (opted out (VLLM_LING_ROUTER_GEMV=vllm)" in off.describe()
    wide = plan({}, hidden_size=8192)  # the server keeps GateLinear's path for a gate it cannot hold
    assert not wide.router and "router GEMV skipped (K=8192 exceeds 4096" in wide.describe()
    # the BF16 linears (b_proj, MLA g_proj): heads per tensor-parallel rank x hidden
    assert on.bf16_linears and f"BF16 linears small GEMV {config['num_attention_heads']} x " \
        f"{config['hidden_size']}" in on.describe()
    off = plan({"VLLM_LING_BF16_GEMV": "vllm"})
    assert not off.bf16_linears and "BF16 linears skipped (opted out (VLLM_LING_BF16_GEMV=vllm)" in off.describe()
    assert wide.bf16_linears  # a BF16 row of 8192 still fits a warp's registers
    wider = plan({}, hidden_size=16384)
    assert not wider.bf16_linears and "BF16 linears skipped (K=16384 exceeds 8192" in wider.describe()


def test_router_topk_plan_follows_the_switch_and_the_routing(tmp_path):
    config = json.loads(FLASH_CONFIG.read_text())
    plan = functools.partial(_plan, tmp_path, config)

    on = plan({})
    assert on.router_topk and (f"router top-k {config['num_experts']} experts, {config['n_group']} groups keep "
                               f"{config['topk_group']}") in on.describe()
    off = plan({"VLLM_LING_ROUTER_TOPK": "vllm"})
    assert not off.router_topk and "router top-k skipped (opted out (VLLM_LING_ROUTER_TOPK=vllm)" in off.describe()
    odd = plan({}, num_experts=48, n_group=4)  # the server keeps vLLM's grouped_topk where the kernel cannot route
    assert not odd.router_topk and "router top-k skipped (48 experts is not a multiple of 32" in odd.describe()


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


def test_a_packed_copy_the_shapes_cannot_serve_is_refused_as_on_the_server(tmp_path):
    """The MoE selector refuses VLLM_LING_MOE_DECODE=copy for an expert intermediate (per GPU) that
    is not a multiple of 64; warm-up asks the same selector, so it refuses the same way (exit 2)."""
    config = json.loads(FLASH_CONFIG.read_text())
    model = tmp_path / "odd"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 800}))
    result = cli(str(model), "--allow-cpu", env_extra={"VLLM_LING_MOE_DECODE": "copy"})
    assert result.returncode == 2
    assert "VLLM_LING_MOE_DECODE=copy cannot run for the routed experts: hidden 2560 / expert intermediate 800" \
        in result.stderr, result.stderr


def test_shapes_follow_the_config(tmp_path):
    config = json.loads(TINY_CONFIG.read_text())
    shapes = warmup.kernel_shapes(config, 1, TINY_CONFIG)
    assert (shapes.hidden_size, shapes.intermediate_size, shapes.num_experts, shapes.top_k) == (
        config["hidden_size"], config["moe_intermediate_size"], config["num_experts"],
        config["num_experts_per_tok"])
    assert shapes.vocab_rows >= config["vocab_size"] and shapes.vocab_rows % 64 == 0


def test_residual_norm_plan_follows_the_switch_and_the_width(tmp_path):
    config = json.loads(FLASH_CONFIG.read_text())
    plan = functools.partial(_plan, tmp_path, config)

    on = plan({})
    assert on.residual_norm and f"residual norm {config['hidden_size']}" in on.describe()
    off = plan({"VLLM_LING_RESIDUAL_NORM": "vllm"})
    assert not off.residual_norm and "residual norm skipped (VLLM_LING_RESIDUAL_NORM=vllm" in off.describe()
    odd = plan({}, hidden_size=2568)  # not whole warps of 16-byte chunks: the server keeps vLLM's norm
    assert not odd.residual_norm and "residual norm skipped (hidden size 2568" in odd.describe()


def test_cuda_path_passes_config_shapes_to_each_kernel_group(tmp_path, monkeypatch, capsys):
    """With a (pretend) GPU, warmup calls the two kernel groups with the checkpoint's shapes
    under the cache lock, in the configured cache, and prints one timing row per group."""
    config = json.loads(FLASH_CONFIG.read_text())
    model = make_model(tmp_path)
    calls = []

    def fake_moe(hidden, intermediate, experts, top_k, *, token_counts, w4a8, swiglu_limits,
                 decode, decode_max_tokens, clamp):
        calls.append(("moe", hidden, intermediate, experts, top_k, tuple(token_counts), w4a8,
                      tuple(swiglu_limits), decode, decode_max_tokens, clamp))
        kernel = tmp_path / "cache" / "kernels" / "k1"
        kernel.mkdir(parents=True)
        (kernel / "kernel.cubin").write_bytes(b"x")  # one new kernel in humming's layout

    def fake_head(vocab, hidden, *, row_counts):
        calls.append(("lm_head", vocab, hidden, tuple(row_counts)))

    def fake_dense(shapes):
        calls.append(("dense_fp8", tuple(shapes)))

    def fake_router(hidden, experts):
        calls.append(("router", hidden, experts))

    monkeypatch.setattr(warmup, "_load_warmup_functions",
                        lambda: [("moe", fake_moe), ("lm_head", fake_head), ("dense_fp8", fake_dense),
                                 ("router", fake_router)])
    monkeypatch.setattr(launch, "cuda_available", lambda: True)
    monkeypatch.delenv("VLLM_LING_KDA_MERGED_IN_PROJ", raising=False)  # the default: merged
    for var in ("VLLM_LING_HUMMING_CACHE", "HUMMING_CACHE_DIR", "HUMMING_TMP_DIR"):
        # warmup exports these for the kernels; setenv makes pytest restore them afterwards.
        monkeypatch.setenv(var, str(tmp_path / "overridden"))
    rc = warmup.warmup_main([str(model), "--device", "auto", "--humming-cache", str(tmp_path / "cache"),
                             "--token-counts", "4,1,4", "--row-counts", "1,4"])
    out = capsys.readouterr().out
    assert rc == 0
    limits = sorted({float(v) for v in config["expert_swiglu_limit_list"] if v})
    assert limits  # Ling-3.0-flash clamps its last routed-expert layers
    assert calls == [
        ("moe", config["hidden_size"], config["moe_intermediate_size"], config["num_experts"],
         config["num_experts_per_tok"], (1, 4), False, (None, *limits), "auto", 32, ROUTED_EXPERT_CLAMP),
        ("lm_head", config["vocab_size"], config["hidden_size"], (1, 4)),  # 157184 = 64 x 2456
        # every block-FP8 dense linear the model runs at decode, as vLLM merges them plus the KDA
        # in-projection merge (on by default: q|k|v|f|g = 20480 x 2560, no 4096 x 2560 left)
        ("dense_fp8", ((20480, 2560), (12288, 2560), (2560, 6144), (6144, 2560), (2560, 5120),
                       (2560, 4096), (1536, 2560), (2560, 768), (576, 2560))),
        ("router", config["hidden_size"], config["num_experts"]),  # the fp32 gate, replicated on every rank
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
    rc = warmup.warmup_main([str(make_model(tmp_path))])
    assert rc == 2
    assert "warmup_kernels" in capsys.readouterr().err


def test_real_kernel_warmup_functions_accept_the_arguments_warmup_passes():
    """Contract with vllm_ling.ops: the call warmup makes binds to the real signatures
    (checked without running them; they need CUDA)."""
    import inspect

    groups = dict(warmup._load_warmup_functions())
    shapes = warmup.kernel_shapes(json.loads(FLASH_CONFIG.read_text()), 1, FLASH_CONFIG)
    kwargs = {"w4a8": False, "decode": "auto", "decode_max_tokens": 32, "clamp": ROUTED_EXPERT_CLAMP}
    inspect.signature(groups["moe"]).bind(
        shapes.hidden_size, shapes.intermediate_size, shapes.num_experts, shapes.top_k,
        token_counts=[1, 4], swiglu_limits=shapes.swiglu_limits, **kwargs)
    inspect.signature(groups["lm_head"]).bind(shapes.vocab_rows, shapes.hidden_size, row_counts=[1, 4])
    inspect.signature(groups["dense_fp8"]).bind([(12288, 2560)])
    inspect.signature(groups["router"]).bind(shapes.hidden_size, shapes.num_experts)
    inspect.signature(groups["residual_norm"]).bind(shapes.hidden_size)


COMBINATIONS = [
    {},
    {"VLLM_LING_MOE_W4A8": "1"},
    {"VLLM_LING_MOE_DECODE": "off"},
    {"VLLM_LING_MOE_DECODE": "copy", "VLLM_LING_MOE_DECODE_MAX_TOKENS": "8"},
    {"VLLM_LING_MOE_W4A8": "1", "VLLM_LING_MOE_DECODE": "off", "VLLM_LING_FP8_HEAD": "0"},
    {"VLLM_LING_MOE_BACKEND": "vllm", "VLLM_LING_DENSE_FP8": "vllm", "VLLM_LING_ROUTER_GEMV": "vllm"},
    {"VLLM_LING_KDA_MERGED_IN_PROJ": "0"},
]


@pytest.mark.parametrize("env", COMBINATIONS, ids=lambda e: ",".join(f"{k[10:]}={v}" for k, v in e.items()) or "defaults")
def test_warmup_compiles_what_the_server_runs(tmp_path, monkeypatch, env):
    """For each option combination, warmup's kernel set equals what the server's quantization
    config builds from the same environment (its real selection code, on a pretend GPU where
    humming is available): MoE method on/off with its W4A8/decode switches, FP8 head on/off."""
    from vllm_ling.layers import moe_method
    from vllm_ling.ops.moe.selection import MoePath
    from vllm_ling.options import DenseFp8, LingOptions, MoeDecode
    from vllm_ling.selection import Feature, recorded

    for name in list(env) + ["VLLM_LING_MOE_W4A8", "VLLM_LING_MOE_DECODE", "VLLM_LING_MOE_BACKEND",
                             "VLLM_LING_MOE_DECODE_MAX_TOKENS", "VLLM_LING_FP8_HEAD", "VLLM_LING_DENSE_FP8",
                             "VLLM_LING_ROUTER_GEMV", "VLLM_LING_KDA_MERGED_IN_PROJ"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plan = warmup.plan_warmup(warmup.build_warmup_parser().parse_args([str(make_model(tmp_path))]),
                              dict(__import__("os").environ))

    # The server side: the method LingFp8Config would attach to a routed-expert layer.
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(moe_method.moe_ops, "humming_status", lambda w4a8=False: (True, "pretend GPU"))
    layer = types.SimpleNamespace(moe_config=types.SimpleNamespace(
        moe_backend="auto", hidden_dim=2560, intermediate_size_per_partition=768))
    options = LingOptions.from_env()
    method = moe_method.choose_moe_method(layer, "model.layers.3.mlp.experts", options)
    server = recorded(layer, Feature.MOE)  # what the layer recorded, the same selector as warm-up's
    assert plan.moe == (method is not None) == (server.choice is MoePath.HUMMING)
    assert plan.moe_selection.kernel_kwargs() == server.kernel_kwargs()
    if method is not None:  # the method serves the recorded switches
        assert (method.w4a8, method.decode, method.decode_max_tokens) == (
            options.moe_w4a8, options.moe_decode, 0 if options.moe_decode is MoeDecode.OFF else options.moe_decode_max_tokens)
    assert plan.head == options.fp8_head
    # the dense FP8 group follows the server's switch, on every decode shape of the model
    assert plan.dense == (options.dense_fp8 is DenseFp8.LING) and len(plan.dense_shapes) == 9
    # the KDA shapes follow the same switch as the server's KDA layer: one merged 20480 x 2560, or three
    assert ((20480, 2560) in plan.dense_shapes) == options.kda_merged_in_proj
    assert ((4096, 2560) in plan.dense_shapes) != options.kda_merged_in_proj
    # the router group follows the server's decision for Ling's gate (kernel available: pretend GPU)
    from vllm_ling.layers import router_gate_cuda
    from vllm_ling.ops.small_gemv import router as router_ops

    monkeypatch.setattr(router_ops, "unavailable_reason", lambda device=None: None)
    config = json.loads(FLASH_CONFIG.read_text())
    gate = router_gate_cuda.GateFacts(prefix="model.layers.3.mlp.gate", num_experts=config["num_experts"],
                                      hidden_size=config["hidden_size"], weight_dtype=torch.float32,
                                      has_bias=False, unquantized=True, out_dtype=torch.float32)
    assert plan.router_selection() == router_gate_cuda.decide(gate, options)  # the same selector, the same answer


def test_a_kernel_group_computing_wrong_numbers_stops_warmup_nonzero(tmp_path, monkeypatch, capsys):
    # the dense group's real output check raising (tests/ops/dense_fp8/test_warmup_check.py), as
    # the warm-up meets it: one error line naming the group, exit 5, no later group run
    import torch

    from vllm_ling.ops.dense_fp8.warmup import check_outputs

    later = []

    def wrong_dense(shapes):
        x = torch.ones((1, 128), dtype=torch.bfloat16)
        weight = torch.ones((128, 128)).to(torch.float8_e4m3fn)
        check_outputs(torch.zeros((1, 128), dtype=torch.bfloat16), x, weight, torch.ones((1, 1)), "128x128 at 1 rows")

    monkeypatch.setattr(warmup, "_load_warmup_functions",
                        lambda: [("dense_fp8", wrong_dense), ("router", lambda *a: later.append(a))])
    monkeypatch.setattr(launch, "cuda_available", lambda: True)
    for var in ("VLLM_LING_HUMMING_CACHE", "HUMMING_CACHE_DIR", "HUMMING_TMP_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "overridden"))  # warmup exports these; restored afterwards
    rc = warmup.warmup_main([str(make_model(tmp_path)), "--device", "auto", "--humming-cache", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == warmup.EXIT_KERNEL_FAILED == 5 and not later
    assert err.count("vllm-ling warmup: error: kernel group dense_fp8: dense FP8 warmup: wrong outputs for "
                     "128x128 at 1 rows") == 1
