"""The drafter switch (VLLM_LING_DRAFTER, VLLM_LING_DSPARK_MODEL): P5 selects and records DSpark when
a drafter is given, MTP otherwise, and refuses before load what cannot serve, with one actionable
message; VLLM_LING_DRAFTER=mtp opts out of a configured drafter."""

from __future__ import annotations

import json
import logging
import types

import pytest

pytest.importorskip("vllm")


def _options(**env):
    from vllm_ling.options import LingOptions

    return LingOptions.from_env({f"VLLM_LING_{k.upper()}": v for k, v in env.items()})


def _target(ckpt, edit=None):
    cfg = {**json.loads((ckpt / "config.json").read_text()), **(edit or {})}
    return types.SimpleNamespace(model=str(ckpt), hf_config=types.SimpleNamespace(to_dict=lambda: cfg))


def _request(options, target, spec=None, pp=1, cuda=True, v2=None):
    from vllm_ling.patches.config_hooks import check_dspark_request

    check_dspark_request(options, spec, spec is not None, target, pp, cuda, v2)


def test_selection_follows_the_drafter_switch():
    from vllm_ling.runtime.spec_policy import Speculation, select_speculation

    assert select_speculation(_options(), False, 1, 1).choice is Speculation.DEFAULT_MTP
    sel = select_speculation(_options(dspark_model="/d"), False, 1, 1)
    assert sel.choice is Speculation.DEFAULT_DSPARK and "/d" in sel.reason
    assert select_speculation(_options(dspark_model="/d", drafter="mtp"), False, 1, 1).choice is Speculation.DEFAULT_MTP
    assert select_speculation(_options(dspark_model="/d"), True, 1, 1).choice is Speculation.USER
    # DSpark needs no NEXTN layer
    assert select_speculation(_options(dspark_model="/d"), False, 0, 1).choice is Speculation.DEFAULT_DSPARK


@pytest.mark.parametrize("env,spec,kwargs,message", [
    ({"drafter": "dspark"}, None, {}, "VLLM_LING_DRAFTER=dspark needs the drafter: set VLLM_LING_DSPARK_MODEL"),
    ({"dspark_model": "DRAFT"}, {"method": "mtp"}, {}, "both choose the speculation"),
    ({"dspark_model": "DRAFT", "mtp": "0"}, None, {}, "VLLM_LING_MTP=0 turns vllm-ling's default speculation off"),
    ({"dspark_model": "DRAFT"}, None, {"cuda": False}, "this is not a CUDA platform"),
    ({"dspark_model": "DRAFT"}, None, {"v2": False}, "VLLM_USE_V2_MODEL_RUNNER=0"),
    ({"dspark_model": "DRAFT"}, None, {"pp": 2}, "--pipeline-parallel-size 2"),
    ({"dspark_model": "/no/such/drafter"}, None, {}, "VLLM_LING_DSPARK_MODEL=/no/such/drafter: no such directory"),
    ({}, {"method": "dspark", "model": "DRAFT", "num_speculative_tokens": 9}, {},
     "num_speculative_tokens 9 > the drafter's block_size 8"),
    ({}, {"method": "dspark", "model": "DRAFT"}, {"cuda": False}, "--speculative-config model=DRAFT"),
])
def test_refusals_before_load(tiny_checkpoint, tiny_dspark, env, spec, kwargs, message):
    from vllm_ling.refusal import Refusal

    env = {k: (str(tiny_dspark) if v == "DRAFT" else v) for k, v in env.items()}
    if spec is not None:
        spec = {k: (str(tiny_dspark) if v == "DRAFT" else v) for k, v in spec.items()}
    with pytest.raises(Refusal) as refused:
        _request(_options(**env), _target(tiny_checkpoint), spec, **kwargs)
    text = str(refused.value).replace(str(tiny_dspark), "DRAFT")
    assert message in text
    if kwargs.get("cuda") is False or "v2" in kwargs or "pp" in kwargs:
        assert text.endswith("set VLLM_LING_DRAFTER=mtp (--drafter mtp) to speculate with the checkpoint's NEXTN "
                             "layer instead.")


def test_drafter_for_another_target_is_refused_before_load(tiny_checkpoint, tiny_dspark):
    from vllm_ling.models.dspark_format import DSparkFormatError

    with pytest.raises(DSparkFormatError, match="hidden_size 256 != 512"):
        _request(_options(dspark_model=str(tiny_dspark)), _target(tiny_checkpoint, {"hidden_size": 512}))


def test_what_can_serve_passes(tiny_checkpoint, tiny_dspark):
    target = _target(tiny_checkpoint)
    _request(_options(dspark_model=str(tiny_dspark)), target)
    _request(_options(dspark_model="inclusionAI/Ling-3.0-flash-dspark"), target)  # a hub id: checked at load
    _request(_options(dspark_model=str(tiny_dspark), drafter="mtp"), target, cuda=False)  # opted out
    _request(_options(), target, {"method": "dspark", "model": str(tiny_dspark), "num_speculative_tokens": 7})
    _request(_options(), target, cuda=False)  # no DSpark asked for


@pytest.fixture
def ling_engine_args(monkeypatch):
    import vllm_ling

    vllm_ling.register()
    for name in ("VLLM_LING_MTP", "VLLM_LING_DRAFTER", "VLLM_LING_DSPARK_MODEL"):
        monkeypatch.delenv(name, raising=False)


def test_on_cpu_a_configured_drafter_is_refused_while_the_config_is_built(ling_engine_args, monkeypatch,
                                                                         tiny_checkpoint, tiny_dspark):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ling.patches.config_hooks import LingConfigError

    monkeypatch.setenv("VLLM_LING_DSPARK_MODEL", str(tiny_dspark))
    with pytest.raises(LingConfigError) as refused:
        EngineArgs(model=str(tiny_checkpoint), enforce_eager=True, max_model_len=256).create_engine_config()
    assert "DSpark speculation cannot run here: this is not a CUDA platform" in str(refused.value)


def test_with_cuda_the_default_is_dspark_recorded(ling_engine_args, monkeypatch, tiny_checkpoint, tiny_dspark):
    """P5 on a (pretended) CUDA platform: vLLM's own SpeculativeConfig for the drafter, with the
    drafter's block_size as draft tokens, and the selection recorded for the verification."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_ling.runtime.spec_policy import Speculation, recorded_speculation

    monkeypatch.setenv("VLLM_LING_DSPARK_MODEL", str(tiny_dspark))
    args = EngineArgs(model=str(tiny_checkpoint), enforce_eager=True, max_model_len=256)
    model_config = args.create_model_config()
    from vllm.config import ParallelConfig

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    spec = args.create_speculative_config(model_config, ParallelConfig())
    assert {k: args.speculative_config[k] for k in ("method", "model")} == {"method": "dspark",
                                                                             "model": str(tiny_dspark)}
    assert "num_speculative_tokens" not in args.speculative_config  # vLLM takes the drafter's block_size
    assert spec.method == "dspark" and spec.num_speculative_tokens == 8
    assert spec.draft_model_config.architecture == "LingDSparkModel"
    assert recorded_speculation(model_config.hf_config).choice is Speculation.DEFAULT_DSPARK


def test_opting_out_keeps_mtp_and_says_so_once(ling_engine_args, monkeypatch, tiny_checkpoint, tiny_dspark):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ling import log
    from vllm_ling.patches import p5_default_mtp
    from vllm_ling.runtime.spec_policy import Speculation, recorded_speculation

    monkeypatch.setenv("VLLM_LING_DSPARK_MODEL", str(tiny_dspark))
    monkeypatch.setenv("VLLM_LING_DRAFTER", "mtp")
    monkeypatch.setattr(log, "_once", set())  # a fresh process's once-only warnings
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    p5_default_mtp.logger.addHandler(handler)
    try:
        config = EngineArgs(model=str(tiny_checkpoint), enforce_eager=True, max_model_len=256).create_engine_config()
    finally:
        p5_default_mtp.logger.removeHandler(handler)
    assert config.speculative_config.method == "mtp"
    assert recorded_speculation(config.model_config.hf_config).choice is Speculation.DEFAULT_MTP
    warned = [r for r in records if "is configured but not used" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
