"""FlashAttention's decode split bound in CUDA graphs (vllm_ling.runtime.decode_splits): raised for
small decode batches within the split buffers' budget, vLLM's own elsewhere, the user's and the
opt-out respected, and the report entry confirmed against the metadata builders after warm-up."""

from __future__ import annotations

import logging
import types

import pytest

from vllm_ling.options import LingOptions
from vllm_ling.runtime import decode_splits as D
from vllm_ling.runtime.verification.decode_splits import confirm_builders

VLLM_BOUND = 32  # vLLM 0.32's flash_attn_max_num_splits_for_cuda_graph (read from vLLM below)


def test_vllm_default_is_read_from_vllm():
    from vllm.config.attention import AttentionConfig

    assert D.vllm_default_bound() == AttentionConfig().flash_attn_max_num_splits_for_cuda_graph == VLLM_BOUND


def _config(max_num_seqs=4, spec_tokens=3, tp=1, heads=32, lora=512, bound=None, eager=False, mode=None):
    from vllm.config.attention import AttentionConfig

    attention = AttentionConfig() if bound is None else AttentionConfig(flash_attn_max_num_splits_for_cuda_graph=bound)
    hf = types.SimpleNamespace(num_attention_heads=heads, kv_lora_rank=lora)
    return types.SimpleNamespace(
        attention_config=attention, model_config=types.SimpleNamespace(hf_config=hf, enforce_eager=eager),
        compilation_config=types.SimpleNamespace(cudagraph_mode=mode, mode=None, inductor_compile_config={}),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
        speculative_config=None if spec_tokens is None else types.SimpleNamespace(num_speculative_tokens=spec_tokens))


@pytest.mark.parametrize("wanted,per_split", [(128, 1 << 20), (128, 3 << 20), (128, 64 << 20), (100, 3 << 20),
                                              (16, 1 << 20)])
def test_the_bound_is_the_largest_halving_that_fits_never_below_vllms(wanted, per_split):
    bound = D.bound_within_budget(wanted, VLLM_BOUND, per_split)
    assert bound >= VLLM_BOUND
    if bound > VLLM_BOUND:
        assert bound * per_split <= D.ACCUM_BUDGET_BYTES
    if bound < wanted:  # halved: the next size up did not fit
        assert 2 * bound * per_split > D.ACCUM_BUDGET_BYTES or bound == VLLM_BOUND


def test_split_buffers_count_fp32_output_and_lse_per_head_and_token():
    # 32 heads x 16 tokens x (512 latent values + 1 LSE) x 4 bytes
    assert D.split_bytes(32, 16, 512) == 32 * 16 * 513 * 4


def test_a_small_batch_server_gets_the_wanted_bound_applied_and_recorded(monkeypatch):
    monkeypatch.delenv("VLLM_LING_DECODE_SPLITS", raising=False)
    cfg = _config(max_num_seqs=4, spec_tokens=3)  # 16 decode tokens: 128 splits take 128 MiB
    sel = D.decide_decode_splits(cfg, LingOptions.current(), on_cuda=True)
    assert sel.choice is D.DecodeSplits.RAISED and sel.bound == LingOptions.current().decode_splits == 128
    assert cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph == 128
    assert D.recorded_decode_splits(cfg.model_config.hf_config) == sel
    assert D.bound_in_force(cfg) == 128


def test_a_second_build_of_the_same_config_keeps_the_decision(monkeypatch):
    """vLLM may run its config hooks again on a config that already holds the raised bound: it is
    not the user's bound then."""
    cfg = _config()
    first = D.decide_decode_splits(cfg, LingOptions(), on_cuda=True)
    again = D.decide_decode_splits(cfg, LingOptions(), on_cuda=True)
    assert again == first and again.choice is D.DecodeSplits.RAISED


def test_the_bound_shrinks_with_the_decode_batch_and_grows_with_tensor_parallelism():
    wide = D.decide_decode_splits(_config(max_num_seqs=8, spec_tokens=3), LingOptions(), on_cuda=True)
    assert wide.choice is D.DecodeSplits.RAISED and VLLM_BOUND < wide.bound < 128
    split = D.decide_decode_splits(_config(max_num_seqs=8, spec_tokens=3, tp=2), LingOptions(), on_cuda=True)
    assert split.bound == 2 * wide.bound  # half the heads per rank, half the bytes per split


def test_a_large_batch_server_keeps_vllms_bound_as_a_fallback_with_one_warning(monkeypatch, caplog):
    from vllm_ling import log as ling_log

    monkeypatch.setattr(ling_log, "_once", set())
    cfg = _config(max_num_seqs=256, spec_tokens=3)
    with caplog.at_level(logging.WARNING):
        sel = D.decide_decode_splits(cfg, LingOptions(), on_cuda=True)
    assert sel.choice is D.DecodeSplits.BUDGET and sel.bound == VLLM_BOUND
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--max-num-seqs" in warnings[0] and "--attention-config" in warnings[0]
    assert cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph == VLLM_BOUND
    assert "1024 decode tokens" in sel.reason and "--max-num-seqs" in sel.reason


def test_a_switch_value_not_above_vllms_keeps_vllms_bound_and_names_the_way_to_lower_it():
    cfg = _config()
    sel = D.decide_decode_splits(cfg, LingOptions(decode_splits=16), on_cuda=True)
    assert sel.choice is D.DecodeSplits.KEPT and sel.bound == VLLM_BOUND
    assert "VLLM_LING_DECODE_SPLITS=16 is not above it" in sel.reason and "--attention-config" in sel.reason
    assert cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph == VLLM_BOUND


def test_the_users_bound_wins():
    cfg = _config(bound=8)
    sel = D.decide_decode_splits(cfg, LingOptions(), on_cuda=True)
    assert sel.choice is D.DecodeSplits.USER and sel.bound == 8
    assert cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph == 8


def test_the_opt_out_keeps_vllms_bound_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_LING_DECODE_SPLITS", "0")
    cfg = _config()
    with caplog.at_level(logging.WARNING):
        sel = D.decide_decode_splits(cfg, LingOptions.current(), on_cuda=True)
    assert sel.choice is D.DecodeSplits.OPTED_OUT and sel.bound == VLLM_BOUND
    assert cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph == VLLM_BOUND
    assert "VLLM_LING_DECODE_SPLITS=0" in sel.reason


@pytest.mark.parametrize("how", ["eager", "PIECEWISE", "NONE"])
def test_without_full_graphs_no_bound_is_asked_for(how):
    from vllm.config.compilation import CUDAGraphMode

    cfg = _config(eager=how == "eager", mode=None if how == "eager" else CUDAGraphMode[how])
    sel = D.decide_decode_splits(cfg, LingOptions(), on_cuda=True)
    assert sel.choice is D.DecodeSplits.NO_FULL_GRAPHS
    assert cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph == VLLM_BOUND


def test_a_cudagraph_mode_with_full_graphs_gets_the_bound():
    from vllm.config.compilation import CUDAGraphMode

    sel = D.decide_decode_splits(_config(mode=CUDAGraphMode.FULL_AND_PIECEWISE), LingOptions(), on_cuda=True)
    assert sel.choice is D.DecodeSplits.RAISED


def test_off_cuda_nothing_changes():
    cfg = _config()
    sel = D.decide_decode_splits(cfg, LingOptions(), on_cuda=False)
    assert sel.choice is D.DecodeSplits.NOT_CUDA
    assert cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph == VLLM_BOUND


def test_an_option_above_flashattentions_limit_is_refused():
    from vllm_ling.options import LingOptionError

    with pytest.raises(LingOptionError, match="VLLM_LING_DECODE_SPLITS=300 must be <= 256"):
        LingOptions.from_env({"VLLM_LING_DECODE_SPLITS": "300"})


def _runner(target_bounds, draft_bounds=()):
    def groups(bounds):
        builders = [types.SimpleNamespace(max_num_splits=b) for b in bounds]
        builders.append(types.SimpleNamespace(name="a mamba builder without a split bound"))
        return [[types.SimpleNamespace(metadata_builders=builders)]]

    class FlashAttnMLAMetadataBuilder(types.SimpleNamespace):
        pass

    runner = types.SimpleNamespace(attn_groups=[[types.SimpleNamespace(metadata_builders=[
        FlashAttnMLAMetadataBuilder(max_num_splits=b) for b in target_bounds])]])
    runner.speculator = types.SimpleNamespace(attn_groups=groups(draft_bounds))
    return runner


def test_builder_bounds_reads_the_target_and_drafter_builders():
    assert D.builder_bounds(_runner([128], [128])) == {"FlashAttnMLAMetadataBuilder": [128], "SimpleNamespace": [128]}
    # builders of one class holding different bounds are all reported, not the last one read
    assert D.builder_bounds(_runner([128, 0, 128])) == {"FlashAttnMLAMetadataBuilder": [0, 128]}
    assert D.builder_bounds(types.SimpleNamespace()) == {}


REQUESTED = {"requested": True, "active": True, "detail": "FlashAttention decode splits in CUDA graphs at most 128"}


def test_the_entry_stays_active_where_the_builders_hold_the_bound():
    entry = confirm_builders(REQUESTED, {"FlashAttnMLAMetadataBuilder": [128]}, 128)
    assert entry["active"] and "metadata builders: FlashAttnMLAMetadataBuilder 128" in entry["detail"]
    # a builder for steps outside full graphs (0: no cap passed) beside the capped ones
    assert confirm_builders(REQUESTED, {"FlashAttnMLAMetadataBuilder": [0, 128]}, 128)["active"]


@pytest.mark.parametrize("builders,says", [
    ({"FlashAttnMLAMetadataBuilder": [32]}, "the metadata builders hold FlashAttnMLAMetadataBuilder 32"),
    ({"FlashAttnMLAMetadataBuilder": [0]}, "the metadata builders hold FlashAttnMLAMetadataBuilder 0"),
    ({"FlashAttnMLAMetadataBuilder": [128], "FlashAttentionMetadataBuilder": [32]},
     "FlashAttentionMetadataBuilder 32"),
    ({}, "no FlashAttention metadata builder serves here")])
def test_the_entry_turns_inactive_with_a_warning_where_the_builders_do_not(builders, says, caplog):
    with caplog.at_level(logging.WARNING):
        entry = confirm_builders(REQUESTED, builders, 128)
    assert not entry["active"] and says in entry["detail"]
    assert any("not in force" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_the_budgets_fallback_is_requested_and_inactive_in_the_report():
    from vllm_ling.runtime.verification.checks import Check
    from vllm_ling.runtime.verification.decode_splits import check_decode_splits, decode_splits_entry

    cfg = _config(max_num_seqs=256, spec_tokens=3)
    cfg.model_config.hf_config.num_attention_heads = 32
    D.decide_decode_splits(cfg, LingOptions(), on_cuda=True)
    row = check_decode_splits(cfg)
    assert isinstance(row, Check) and row.passed  # vLLM's bound is in force, as recorded
    entry = decode_splits_entry(cfg, row)
    assert entry["requested"] and not entry["active"] and entry["detail"].startswith("fallback: vLLM's 32")
    # after warm-up the fallback stays as it was said, whatever the builders hold
    assert confirm_builders(entry, {"FlashAttnMLAMetadataBuilder": [32]}, 32) == entry


def test_an_entry_not_requested_is_left_as_it_is():
    entry = {"requested": False, "active": False, "detail": "not selected: opted out"}
    assert confirm_builders(entry, {}, 32) == entry


@pytest.mark.parametrize("held,active", [([128], True), ([32], False)])
def test_after_warm_up_the_reports_entry_says_what_the_builders_hold(monkeypatch, tmp_path, held, active):
    """startup_facts.record_after_warmup (patch P8) reads the worker's builders into the report: the
    entry the verification wrote stays active only where they hold the bound in force, and the startup
    section still validates."""
    import json

    from vllm_ling.runtime.report import REPORT_JSON_SCHEMA, write_report
    from vllm_ling.runtime.startup_facts import record_after_warmup

    path = tmp_path / "report.json"
    write_report({"passed": True, "memory": {"weights_bytes": 7}, "optimizations": {"decode_splits": REQUESTED}},
                 str(path))
    monkeypatch.setenv("VLLM_LING_REPORT_PATH", str(path))
    runner = _runner(held)
    runner.kv_caches = []
    worker = types.SimpleNamespace(model_runner=runner, vllm_config=_config(bound=128))
    record_after_warmup(worker)
    report = json.loads(path.read_text())
    assert report["optimizations"]["decode_splits"]["active"] is active
    assert report["startup"]["decode_split_bounds"] == {"FlashAttnMLAMetadataBuilder": held}
    pytest.importorskip("jsonschema").validate(report["startup"], REPORT_JSON_SCHEMA["properties"]["startup"])
