"""Ling's default speculative configuration and its cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

DATA = Path(__file__).resolve().parents[2] / "vllm_ling" / "data"


def _engine_config(checkpoint, **kwargs):
    import vllm_ling
    from vllm.engine.arg_utils import EngineArgs

    vllm_ling.register()
    return EngineArgs(model=str(checkpoint), enforce_eager=True, max_model_len=256,
                      **kwargs).create_engine_config()


def test_absent_user_config_gets_mtp_three_tokens(tiny_checkpoint, monkeypatch):
    from vllm_ling.runtime.spec_policy import default_applied

    monkeypatch.delenv("VLLM_LING_MTP", raising=False)
    cfg = _engine_config(tiny_checkpoint)
    assert cfg.speculative_config.method == "mtp"
    assert cfg.speculative_config.num_speculative_tokens == 3
    assert default_applied(cfg)


def test_user_config_wins(tiny_checkpoint):
    from vllm_ling.runtime.spec_policy import default_applied

    cfg = _engine_config(tiny_checkpoint, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert cfg.speculative_config.num_speculative_tokens == 1
    assert not default_applied(cfg)


def test_off_switch_and_override(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("VLLM_LING_MTP", "0")
    assert _engine_config(tiny_checkpoint).speculative_config is None
    monkeypatch.setenv("VLLM_LING_MTP", "1")
    monkeypatch.setenv("VLLM_LING_NUM_SPEC_TOKENS", "2")
    assert _engine_config(tiny_checkpoint).speculative_config.num_speculative_tokens == 2
    monkeypatch.setenv("VLLM_LING_MTP", "maybe")
    with pytest.raises(Exception, match=r"VLLM_LING_MTP='maybe' is not a boolean"):
        _engine_config(tiny_checkpoint)


def test_cost_model_is_the_planners_bytes_scaled_to_the_studys_batch1_point():
    from vllm_ling.models.cost_model import build_plan, mtp_model
    from vllm_ling.runtime.spec_policy import CONTEXT_TOKENS, STUDY_VERIFY_COST_BATCH1, CostModel, load_config

    cfg = load_config()
    model = CostModel(cfg, 3)
    assert model.break_even(1) == pytest.approx(STUDY_VERIFY_COST_BATCH1)
    # unscaled, batch 1 is exactly `vllm-ling plan`'s break-even (verify + draft ratios)
    plan = build_plan(cfg, context=CONTEXT_TOKENS, verify_tokens=4)
    assert model.raw_ratio(1) == pytest.approx(mtp_model(plan, "fp8", 3)["break_even_accept_length"])
    # verifying at batch 8 touches far more distinct experts than the plain step: dearer
    assert model.break_even(8) > model.break_even(1)


def test_disable_threshold_follows_break_even():
    """Speculation is on exactly where the modelled break-even accept length is below the
    accept length the model reaches (2.68 on GSM8K), and the schedule says so to vLLM."""
    from vllm_ling.runtime.spec_policy import (STUDY_ACCEPT_LENGTH_GSM8K, CostModel, load_config,
                                               speculative_schedule)

    model = CostModel(load_config(), 3)
    schedule = speculative_schedule(max_batch=64)
    assert schedule[0][0] == 1 and schedule[0][2] == 3  # batch 1: break-even 2.26 < 2.68
    assert any(k == 0 for _, _, k in schedule)
    for start, end, k in schedule:
        for b in (start, end):
            assert (k == 3) == (model.break_even(b) < STUDY_ACCEPT_LENGTH_GSM8K)
    # with a better draft (synthetic prompts reach 3.90) speculation pays at every batch size
    assert speculative_schedule(max_batch=64, expected_accept_length=3.9) == [(1, 64, 3)]


def test_default_schedule_reaches_vllm(tmp_path, monkeypatch):
    """On the full-size config the default carries vLLM's dynamic schedule (speculation off
    where it does not pay); the tiny model's schedule is all-on, so vLLM gets none."""
    from vllm_ling.models.configuration import LingHybridConfig
    from vllm_ling.options import LingOptions
    from vllm_ling.patches.config_hooks import default_speculative_config

    full = LingHybridConfig(**json.loads((DATA / "ling3_flash_fp4_config.json").read_text()))
    spec = default_speculative_config(LingOptions(), full, max_num_seqs=64)
    assert spec["method"] == "mtp" and spec["num_speculative_tokens"] == 3
    first = spec["num_speculative_tokens_per_batch_size"][0]
    assert first[0] == 1 and first[2] == 3  # MTP at batch 1
    assert any(k == 0 for _, _, k in spec["num_speculative_tokens_per_batch_size"])
    tiny = LingHybridConfig(**json.loads((DATA / "ling3_tiny_fp4_config.json").read_text()))
    assert "num_speculative_tokens_per_batch_size" not in default_speculative_config(LingOptions(), tiny, 4)


def _without_nextn(tiny_checkpoint, tmp_path):
    """The tiny checkpoint with num_nextn_predict_layers: 0 in its config.json."""
    model = tmp_path / "no-nextn"
    model.mkdir()
    for item in tiny_checkpoint.iterdir():
        (model / item.name).symlink_to(item)
    (model / "config.json").unlink()
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_checkpoint_without_nextn_layers_gets_no_default_speculation(tiny_checkpoint, tmp_path,
                                                                    monkeypatch, caplog):
    """Today's ZeroDivisionError from vLLM's SpeculativeConfig: the default MTP is off instead,
    logged, and remembered for the report."""
    import logging

    from vllm_ling.runtime.spec_policy import default_applied, no_nextn_layers

    monkeypatch.delenv("VLLM_LING_MTP", raising=False)
    model = _without_nextn(tiny_checkpoint, tmp_path)
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        cfg = _engine_config(model)
    assert cfg.speculative_config is None
    assert no_nextn_layers(cfg) and not default_applied(cfg)
    assert "num_nextn_predict_layers=0" in caplog.text


def test_explicit_mtp_without_nextn_layers_is_one_clear_error(tiny_checkpoint, tmp_path):
    from vllm_ling.patches.config_hooks import LingConfigError

    model = _without_nextn(tiny_checkpoint, tmp_path)
    with pytest.raises(LingConfigError, match=r"method 'mtp' drafts with the checkpoint's NEXTN layers, "
                                              r"but .*no-nextn/config.json has num_nextn_predict_layers=0"):
        _engine_config(model, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_a_method_without_draft_model_is_served_as_given(tiny_checkpoint):
    from vllm_ling.runtime.spec_policy import default_applied

    cfg = _engine_config(tiny_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                             "prompt_lookup_max": 3})
    assert cfg.speculative_config.method == "ngram" and not default_applied(cfg)


def test_pipeline_parallel_gets_no_default_mtp_and_refuses_an_explicit_draft(tiny_checkpoint, monkeypatch, caplog):
    """vLLM 0.32 builds the draft on the last pipeline stage only and reads it on every stage:
    under PP the default MTP is off (logged, remembered for the report) and a user's draft-model
    config is one clear error before any engine process starts; ngram still works."""
    import logging

    from vllm_ling.patches.config_hooks import LingConfigError
    from vllm_ling.runtime.spec_policy import default_applied, pp_no_draft

    monkeypatch.delenv("VLLM_LING_MTP", raising=False)
    # PP=1 keeps the default (and sets vLLM's logging up before caplog watches)
    assert _engine_config(tiny_checkpoint).speculative_config.method == "mtp"
    logger = logging.getLogger("vllm.ling")
    logger.addHandler(caplog.handler)  # vLLM's "vllm" logger does not propagate to caplog's root handler
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.ling"):
            cfg = _engine_config(tiny_checkpoint, pipeline_parallel_size=2)
    finally:
        logger.removeHandler(caplog.handler)
    assert cfg.speculative_config is None and pp_no_draft(cfg) and not default_applied(cfg)
    assert "NEXTN MTP speculation is off: --pipeline-parallel-size 2" in caplog.text
    with pytest.raises(LingConfigError, match=r"method 'mtp' with --pipeline-parallel-size 2: vLLM 0.32 cannot run "
                                              r"a draft model with pipeline parallelism"):
        _engine_config(tiny_checkpoint, pipeline_parallel_size=2,
                       speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    ngram = _engine_config(tiny_checkpoint, pipeline_parallel_size=2,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert ngram.speculative_config.method == "ngram"
