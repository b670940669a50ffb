"""Prefill CUDA graphs (patch P13, vllm_ling.runtime.prefill_graphs): vLLM's own
``VllmConfig._set_cudagraph_sizes`` runs on a stand-in config (its sizes are vLLM's, computed here),
then ours adds the prefill ladder; and the verification row that compares the decision with the
sizes in force. The GPU side (graphs captured and replayed) is the GPU end-to-end tests' and the
lease's (`benchmarks/results/prefill_profile_h100.md`)."""

from __future__ import annotations

import logging
import types

import pytest

from vllm_ling.models.names import LING_MODEL_TYPE, TARGET_ARCH


def _config(max_num_seqs=2, max_num_batched_tokens=2048, query_len=1, sizes=None, max_size=None,
            mode="FULL_AND_PIECEWISE", eager=False, arch=TARGET_ARCH):
    """What vLLM's _set_cudagraph_sizes reads, with a real CompilationConfig."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    given = {k: v for k, v in (("cudagraph_capture_sizes", sizes), ("max_cudagraph_capture_size", max_size))
             if v is not None}  # unset: vLLM computes them
    compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode], **given)
    hf = types.SimpleNamespace(model_type=LING_MODEL_TYPE, architectures=[arch])
    spec = types.SimpleNamespace(uses_dynamic_speculative_decoding=lambda: False) if query_len > 1 else None
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=eager, hf_config=hf),
        compilation_config=compilation, speculative_config=spec, uniform_decode_query_len=query_len,
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        performance_mode="balanced", num_speculative_tokens=query_len - 1)


def _vllm_sizes(**kw) -> list[int]:
    """vLLM's own sizes for the same settings (its unwrapped function)."""
    from vllm.config import VllmConfig

    cfg = _config(**kw)
    VllmConfig._set_cudagraph_sizes.__wrapped__(cfg)
    return list(cfg.compilation_config.cudagraph_capture_sizes)


def _ours(**kw):
    from vllm.config import VllmConfig

    from vllm_ling.runtime.prefill_graphs import recorded_prefill_graphs

    cfg = _config(**kw)
    VllmConfig._set_cudagraph_sizes(cfg)
    return cfg, recorded_prefill_graphs(cfg.model_config.hf_config)


@pytest.fixture(autouse=True)
def _patched(monkeypatch):
    import vllm_ling
    from vllm_ling.patches.p13_prefill_graph_sizes import is_applied

    monkeypatch.delenv("VLLM_LING_PREFILL_GRAPH_TOKENS", raising=False)
    vllm_ling.register()
    assert is_applied(), "vllm_ling.register() applies P13 in every process"


def test_the_ladder_reaches_the_limit_and_the_hybrid_chunk():
    from vllm_ling.runtime.prefill_graphs import COARSE_STEP, FINE_UP_TO, prefill_ladder

    for limit in (8, 100, 256, 1000, 1920, 2048, 8192):
        ladder = prefill_ladder(limit)
        assert ladder == sorted(set(ladder)) and ladder[-1] == limit
        gaps = [b - a for a, b in zip(ladder, ladder[1:])]
        assert all(g <= max(a, COARSE_STEP) for a, g in zip(ladder, gaps)), (limit, ladder)  # pads <= 2x, <= 128
        assert all(n % COARSE_STEP == 0 for n in ladder if FINE_UP_TO < n < limit)
    assert 1920 in prefill_ladder(2048)  # the full-size model's prefill chunk (mamba align mode)


def test_vllm_sizes_stay_and_the_prefill_sizes_are_added_up_to_the_batch_limit():
    from vllm_ling.runtime.prefill_graphs import PrefillGraphs, prefill_ladder

    theirs = _vllm_sizes()
    assert theirs[-1] < 64  # vLLM's decode-sized graphs at --max-num-seqs 2
    cfg, rec = _ours()
    sizes = cfg.compilation_config.cudagraph_capture_sizes
    assert set(theirs) <= set(sizes)
    assert set(sizes) - set(theirs) == {n for n in prefill_ladder(2048) if n > theirs[-1]}
    assert cfg.compilation_config.max_cudagraph_capture_size == sizes[-1] == 2048
    assert rec.choice is PrefillGraphs.ADDED and rec.up_to == 2048

    cfg, rec = _ours(max_num_batched_tokens=1000)
    assert cfg.compilation_config.cudagraph_capture_sizes[-1] == 1000 and rec.up_to == 1000


def test_a_dspark_verify_window_keeps_its_decode_sizes():
    """vLLM adds the uniform decode sizes of a 9-token verify window (on no grid); they stay."""
    theirs = _vllm_sizes(query_len=9)
    assert {9, 18} <= set(theirs)
    cfg, _ = _ours(query_len=9)
    assert set(theirs) <= set(cfg.compilation_config.cudagraph_capture_sizes)


def test_a_server_for_many_sequences_keeps_its_dense_decode_grid():
    theirs = _vllm_sizes(max_num_seqs=256)
    assert theirs[-1] == 512
    cfg, rec = _ours(max_num_seqs=256)
    sizes = cfg.compilation_config.cudagraph_capture_sizes
    assert [n for n in sizes if n <= 512] == theirs and sizes[-1] == 2048 and rec.up_to == 2048


def test_user_sizes_the_opt_out_and_no_graphs_leave_vllm_sizes(monkeypatch, caplog):
    from vllm_ling.runtime.prefill_graphs import PrefillGraphs

    cfg, rec = _ours(sizes=[1, 2, 4, 8])
    assert cfg.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8] and rec.choice is PrefillGraphs.USER
    cfg, rec = _ours(max_size=16)
    assert cfg.compilation_config.cudagraph_capture_sizes == _vllm_sizes(max_size=16)
    assert rec.choice is PrefillGraphs.USER

    cfg, rec = _ours(eager=True, mode="NONE")
    assert cfg.compilation_config.cudagraph_capture_sizes == [] and rec.choice is PrefillGraphs.NO_GRAPHS

    monkeypatch.setenv("VLLM_LING_PREFILL_GRAPH_TOKENS", "0")
    monkeypatch.setattr("vllm_ling.log._once", set())
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        cfg, rec = _ours()
    assert cfg.compilation_config.cudagraph_capture_sizes == _vllm_sizes()
    assert rec.choice is PrefillGraphs.OPTED_OUT and "VLLM_LING_PREFILL_GRAPH_TOKENS=0" in rec.reason
    assert [r for r in caplog.records if "Prefill CUDA graphs are OFF" in r.getMessage()]


def test_another_model_and_a_second_sizing_of_the_same_config_are_left_alone():
    from vllm.config import VllmConfig

    cfg, rec = _ours(arch="Qwen3ForCausalLM")
    assert rec is None and cfg.compilation_config.cudagraph_capture_sizes == _vllm_sizes()
    cfg, rec = _ours()
    VllmConfig._set_cudagraph_sizes(cfg)  # vLLM sizing it again sees our sizes as given: the record stands
    from vllm_ling.runtime.prefill_graphs import PrefillGraphs, recorded_prefill_graphs

    assert recorded_prefill_graphs(cfg.model_config.hf_config).choice is PrefillGraphs.ADDED
    assert cfg.compilation_config.cudagraph_capture_sizes[-1] == 2048


def test_the_row_fails_where_the_sizes_in_force_are_not_the_recorded_ones():
    from vllm_ling.runtime.verification.prefill_graphs import check_prefill_graphs, prefill_graphs_entry

    cfg, _ = _ours()
    row = check_prefill_graphs(cfg)
    assert row.passed and "up to 2048 tokens" in row.actual
    assert prefill_graphs_entry(cfg, row) == {"requested": True, "active": True, "detail": row.actual}

    cfg.compilation_config.cudagraph_capture_sizes = [1, 2, 4]  # e.g. replaced after P13 decided
    row = check_prefill_graphs(cfg)
    assert not row.passed and "up to 4 tokens" in row.actual and "up to 2048" in row.expected
    assert prefill_graphs_entry(cfg, row)["active"] is False

    cfg, _ = _ours(eager=True, mode="NONE")
    row = check_prefill_graphs(cfg)
    assert row.passed
    assert prefill_graphs_entry(cfg, row) == {
        "requested": False, "active": False,
        "detail": "not selected: vLLM captures no piecewise CUDA graphs (--enforce-eager)"}
