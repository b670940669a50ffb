"""benchmarks/serve_h200.py's arithmetic and log reading (CPU; the measurement itself runs on the H200)."""

from __future__ import annotations

import json

import pytest

from benchmarks import serve_h200 as S

LOG = """
INFO 12-02 05:00:01 [default_loader.py:502] Loading weights took 17.95 seconds
INFO 12-02 05:00:02 [gpu_model_runner.py:5150] Model loading took 63.81 GiB memory and 18.402113 seconds
INFO 12-02 05:01:41 [monitor.py:20] torch.compile took 99.12 s in total
INFO 12-02 05:02:00 [kv_cache_utils.py:1] GPU KV cache size: 1,234,560 tokens
INFO 12-02 05:01:45 [kernel_warmup.py:367] Running FlashInfer autotune with 2048 tokens
2026-12-02 05:01:46,628 - INFO - autotuner.py:1069 - flashinfer.jit: [Autotuner]: Autotuning process ends
INFO 12-02 05:02:10 [gpu_model_runner.py:6582] Graph capturing finished in 12 secs, took 0.52 GiB
INFO 12-02 05:02:11 [core.py:403] init engine (profile, create kv cache, warmup model) took 141.20 s
"""


def test_startup_split_is_read_from_vllms_own_lines():
    got = S.parse_startup(LOG)
    assert got == {"load_weights_s": 17.95, "model_load_s": 18.402113, "torch_compile_s": 99.12,
                   "graph_capture_s": 12.0, "engine_init_s": 141.2,
                   # 05:01:45 (the kernel warm-up's last line) to 05:02:10, less the 12 s capture
                   "warmup_steps_s": 13.0}
    assert S.parse_startup("nothing here") == {**dict.fromkeys(S.STARTUP_PATTERNS), "warmup_steps_s": None}


def test_warmup_steps_are_read_from_the_real_lease_log():
    """Lease 2026-12-06d's ours-mtp start: kernel warm-up's last line 16:51:04, capture finished
    16:53:26 in 13 s (the MTP speculator's own capture comes after and is not counted)."""
    from pathlib import Path

    log = (Path(S.__file__).parent / "results" / "serve_h200_runs" / "lease-2026-12-06d"
           / "ours-mtp-server.log").read_text()
    assert S.parse_startup(log)["warmup_steps_s"] == 129.0


def _run(name, composition, mtp, contexts):
    return {"name": name, "composition": composition, "mtp": mtp, "copy_gbs": 4000.0, "copy_how": "test",
            "startup_s": 200.0, "startup": {}, "memory": {}, "stop_rc": 0,
            "verification": {"passed": True, "policy": "strict", "failed": [], "optimizations": {"mtp": mtp}},
            "contexts": contexts}


def _render(tmp_path, runs) -> str:
    """``serve_h200 render`` of these runs (each written as its JSON file): the table's text."""
    files = []
    for run in runs:
        f = tmp_path / f"{run['name']}.json"
        f.write_text(json.dumps(run))
        files.append(str(f))
    out = tmp_path / "table.md"
    S.main(["render", *files, "--out", str(out)])
    return out.read_text()


# a plan at 64 tokens of context: 1-token steps of both heads, the verify window and an MTP draft step
MTP_PLANS = {64: {"heads": {"fp8": {"bytes_per_token_batch1": 4.0e9, "bytes_per_verify_step": 7.0e9,
                                   "head_bytes": 4.0e8},
                           "bf16": {"bytes_per_token_batch1": 4.4e9}},
                  "draft_tokens": 3, "mtp_draft_step_bytes_without_head": 1.0e8}}


def test_table_puts_each_tpot_beside_its_floor_at_the_measured_bandwidth(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "plan_bytes", lambda context: MTP_PLANS[context])
    text = _render(tmp_path, (_run("ours", "ours", False, [{"context": 64, "tpot_ms": 2.0}]),
                              _run("upstream", "upstream", False, [{"context": 64, "tpot_ms": 4.4}]),
                              _run("ours-mtp", "ours", True, [{"context": 64, "tpot_ms": 3.0, "iteration_ms": 3.0,
                                                                "accept_length": 1.1}])))
    # ours: 4.0e9 bytes at 4000 GB/s = 1.000 ms floor; 2.0 ms is 2.00x it, 0.50 of the copy bandwidth;
    # upstream (BF16 head) 4.4e9 bytes = 1.100 ms floor; it is 2.20x slower than ours
    assert "| ours | 64 | 2.000 | 1.000 | 2.00x | 0.50 | 2.20x |" in text
    assert "| upstream | 64 | 4.400 | 1.100 | 4.00x | 0.25 | 1.00x |" in text
    # the MTP iteration: verify 7.0e9 + 3 x (1.0e8 + 4.0e8) = 8.5e9 bytes = 2.125 ms; 1.5x the 1-token step;
    # TPOT at accept length 2.68 = 3.0 / 2.68
    assert f"| 64 | 3.000 | 2.125 | 1.50x | 1.10 | {3.0 / 2.68:.3f} | {3.0 / 3.90:.3f} |" in text


def test_runs_served_with_a_cut_switched_off_keep_their_roles(tmp_path, monkeypatch):
    """A lease serves a cut that failed its GPU tests switched off, under a longer name
    (``ours-mtp-router_topk=vllm``): the run still compares with upstream and its MTP iteration with
    the plain step, by what it is, not by its name."""
    monkeypatch.setattr(S, "plan_bytes", lambda context: MTP_PLANS[context])
    text = _render(tmp_path, (_run("ours-router_topk=vllm", "ours", False, [{"context": 64, "tpot_ms": 2.5}]),
                              _run("upstream", "upstream", False, [{"context": 64, "tpot_ms": 5.0}]),
                              _run("ours-mtp-router_topk=vllm", "ours", True,
                                   [{"context": 64, "tpot_ms": 4.0, "iteration_ms": 4.0}])))
    assert "| ours-router_topk=vllm | 64 | 2.500 | 1.000 | 2.50x | 0.40 | 2.00x |" in text
    assert f"| 64 | 4.000 | 2.125 | 1.60x | - | {4.0 / 2.68:.3f} | {4.0 / 3.90:.3f} |" in text


def test_dspark_iteration_beside_its_floor_and_against_nextn(tmp_path, monkeypatch):
    plans = {64: {**MTP_PLANS[64], "dspark": {"verify_step_bytes": 1.1e10, "draft_cycle_bytes": 2.0e9}}}
    monkeypatch.setattr(S, "plan_bytes", lambda context: plans[context])
    text = _render(tmp_path, (_run("ours", "ours", False, [{"context": 64, "tpot_ms": 2.0}]),
                              _run("ours-mtp", "ours", True, [{"context": 64, "tpot_ms": 3.0, "iteration_ms": 3.0}]),
                              {**_run("ours-dspark", "ours", False, [{"context": 64, "tpot_ms": 4.0,
                                                                      "iteration_ms": 4.0, "accept_length": 1.2}]),
                               "dspark": True}))
    assert "| ours-dspark | 64 |" not in text  # not a plain 1-token row
    # verify 1.1e10 + draft cycle 2.0e9 = 1.3e10 bytes = 3.250 ms at 4000 GB/s; 2.00x the 1-token step;
    # at AL 4.0: 1.000 ms, against NEXTN's 3.0 / 2.68 = 1.119 ms -> 0.89
    assert (f"| 64 | 4.000 | 3.250 | 2.00x | 1.20 | 1.000 | {4 / 5.29:.3f} | {4 / 6.22:.3f} | {4 / 6.40:.3f} | "
            f"{1.0 / (3.0 / 2.68):.2f} |") in text


def test_dspark_run_uses_a_dummy_full_size_drafter(tmp_path):
    drafter = S.dummy_drafter(tmp_path)
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["LingDSparkModel"] and cfg["num_hidden_layers"] == 5 and cfg["block_size"] == 8
    assert not list(drafter.glob("*.safetensors"))  # served with the target's --load-format dummy


def test_a_slice_keeps_the_real_pattern_and_a_limited_layer_and_compares_with_its_own_upstream(tmp_path,
                                                                                               monkeypatch):
    """--layers N: the first N layers of the full config, the last of them with the full model's last
    SwiGLU limits (a limited MoE layer stays in the slice); its rows have no byte floor (the plan's is
    the whole model's) and compare with the upstream run of the same slice only."""
    full = json.loads(S.FULL_CONFIG.read_text())
    cfg = json.loads(S.slice_config(6))
    assert cfg["num_hidden_layers"] == 6 and {k: v for k, v in cfg.items() if k not in (
        "num_hidden_layers", "expert_swiglu_limit_list", "share_expert_swiglu_limit_list")} == {
        k: v for k, v in full.items() if k not in (
            "num_hidden_layers", "expert_swiglu_limit_list", "share_expert_swiglu_limit_list")}
    assert cfg["expert_swiglu_limit_list"] == full["expert_swiglu_limit_list"][:5] + [4]
    assert S.slice_config(None) == S.FULL_CONFIG.read_bytes()
    plans = {64: {"heads": {"fp8": {"bytes_per_token_batch1": 4.0e9}, "bf16": {"bytes_per_token_batch1": 4.4e9}}}}
    monkeypatch.setattr(S, "plan_bytes", lambda context: plans[context])
    files = []
    for run in (_run("ours-L6", "ours", False, [{"context": 64, "tpot_ms": 0.5}]) | {"layers": 6},
                _run("upstream-L6", "upstream", False, [{"context": 64, "tpot_ms": 1.0}]) | {"layers": 6},
                _run("upstream", "upstream", False, [{"context": 64, "tpot_ms": 4.4}])):
        f = tmp_path / f"{run['name']}.json"
        f.write_text(json.dumps(run))
        files.append(str(f))
    out = tmp_path / "table.md"
    S.main(["render", *files, "--out", str(out)])
    text = out.read_text()
    assert "| ours-L6 | 64 | 0.500 | - | - | - | 2.00x |" in text
    assert "| upstream | 64 | 4.400 | 1.100 | 4.00x | 0.25 | 1.00x |" in text


def test_an_ab_runs_switch_must_be_a_known_well_formed_vllm_ling_variable():
    """`run --switch` is the only way a VLLM_LING_* setting reaches the server (the harness passes
    none of its own environment's): a typo or a malformed value stops the run before any start."""
    import argparse

    from benchmarks.serve_h200 import _switch

    assert _switch("VLLM_LING_PREFILL_GRAPH_TOKENS=0") == ("VLLM_LING_PREFILL_GRAPH_TOKENS", "0")
    for bad in ("VLLM_LING_PREFIL_GRAPH_TOKENS=0", "VLLM_LING_PREFILL_GRAPH_TOKENS=many", "VLLM_LING_DENSE_FP8=fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            _switch(bad)


def test_kernels_jit_compiled_while_serving_are_counted_and_listed(tmp_path, monkeypatch):
    """vLLM's JIT monitor lines (as lease 2026-12-06c's servers logged them) become a count per kernel
    in the run's JSON and a line under its verification in the table: a spike a user's request pays."""
    log = "\n".join([
        "(EngineCore pid=4579) WARNING 12-06 14:06:49 [jit_monitor.py:140] Triton kernel JIT compilation during "
        "inference: _per_token_group_quant_fp8_colmajor. This causes a latency spike; consider extending warmup",
        "(EngineCore pid=8530) WARNING 12-06 14:17:57 [jit_monitor.py:140] Triton kernel JIT compilation during "
        "inference: _rejection_kernel. This causes a latency spike; consider extending warmup to cover this",
        "(EngineCore pid=4579) WARNING 12-06 14:07:49 [jit_monitor.py:140] Triton kernel JIT compilation during "
        "inference: _per_token_group_quant_fp8_colmajor. This causes a latency spike",
        "INFO 12-06 14:04:42 [kv_cache_utils.py:2327] GPU KV cache size: 326,701 tokens"])
    counts = S.jit_during_inference(log)
    assert counts == {"_per_token_group_quant_fp8_colmajor": 2, "_rejection_kernel": 1}
    monkeypatch.setattr(S, "plan_bytes", lambda context: MTP_PLANS[context])
    text = _render(tmp_path, (_run("ours", "ours", False, [{"context": 64, "tpot_ms": 2.0}]) |
                              {"jit_during_inference": counts},
                              _run("upstream", "upstream", False, [{"context": 64, "tpot_ms": 4.4}])))
    assert ("  - Triton kernels JIT-compiled while serving requests (vLLM's JIT monitor): "
            "_per_token_group_quant_fp8_colmajor x2, _rejection_kernel x1") in text
    assert text.count("JIT-compiled while serving") == 1  # upstream's run logged none
