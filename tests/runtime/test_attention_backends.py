"""The report's attention backends: what each attention layer of the loaded tiny models holds, read
from the layers (a layer given another backend shows up as such), merged over pipeline stages, and
exported as ``vllm_ling:attention_backend_layers``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")


class _PlantedBackend:
    """A backend class as vLLM's layers hold them (only its registry name is read)."""

    @staticmethod
    def get_name() -> str:
        return "PLANTED_MLA"


class _PlantedPrefill:
    @staticmethod
    def get_name() -> str:
        return "PLANTED_PREFILL"


def _report(models):
    from vllm_ling.options import LingOptions
    from vllm_ling.runtime.verification import build_report

    vllm_config, target, draft = models
    return build_report(target, draft, vllm_config, LingOptions())


def _mla_layers(model):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return [m for m in model.modules() if isinstance(m, MLAAttention)]


def _by_key(entries):
    return {(e["model"], e["layer"], e["backend"], e["prefill"]): e["layers"] for e in entries}


def test_every_attention_layer_is_counted_once_under_its_backend(loaded_tiny_models):
    """Counts from vLLM's own layer rule (the config's KDA layers, the rest MLA; the NEXTN layer's MLA
    in the draft), each MLA backend one vLLM registers as MLA, and the report's note says the same."""
    from vllm.model_executor.models.bailing_moe_v3 import _is_kda_layer
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_config, target, draft = loaded_tiny_models
    config = vllm_config.model_config.hf_config
    kda = sum(_is_kda_layer(i, config.layer_group_size, config.num_hidden_layers)
              for i in range(config.num_hidden_layers))
    report = _report(loaded_tiny_models)
    entries = report["attention_backends"]
    counted = {}
    for e in entries:
        counted[(e["model"], "mla" if e["layer"] == "MLAAttention" else "other")] = (
            counted.get((e["model"], "mla" if e["layer"] == "MLAAttention" else "other"), 0) + e["layers"])
    assert counted == {("target", "mla"): config.num_hidden_layers - kda, ("target", "other"): kda,
                       ("draft", "mla"): config.num_nextn_predict_layers}, entries
    for e in entries:
        if e["layer"] == "MLAAttention":
            assert AttentionBackendEnum[e["backend"]].get_class().is_mla(), e
            assert e["prefill"], e  # MLA layers name their prefill backend
        else:
            assert e["prefill"] is None, e
    (note,) = [n for n in report["notes"] if n.startswith("attention backends: ")]
    mla = next(e for e in entries if e["model"] == "target" and e["layer"] == "MLAAttention")
    assert f"target MLAAttention x{mla['layers']}: {mla['backend']} (prefill {mla['prefill']})" in note, note


def test_a_layer_holding_another_backend_is_reported_as_such(loaded_tiny_models, monkeypatch):
    """The report reads each layer: one target MLA layer given another decode and prefill backend is
    its own entry; a layer whose backend cannot be read is reported unreadable, not a crash."""
    _, target, draft = loaded_tiny_models
    before = _by_key(_report(loaded_tiny_models)["attention_backends"])
    first, *rest = _mla_layers(target)
    old = ("target", "MLAAttention", first.get_attn_backend().get_name(), type(first.prefill_backend).get_name())
    monkeypatch.setattr(first, "attn_backend", _PlantedBackend)
    monkeypatch.setattr(first, "prefill_backend", _PlantedPrefill())
    after = _by_key(_report(loaded_tiny_models)["attention_backends"])
    assert after.pop(("target", "MLAAttention", "PLANTED_MLA", "PLANTED_PREFILL")) == 1
    assert after.get(old, 0) == before[old] - 1
    assert {k: v for k, v in after.items() if k != old} == {k: v for k, v in before.items() if k != old}

    def broken():
        raise RuntimeError("no backend\nsecond line")

    monkeypatch.setattr(first, "get_attn_backend", broken)
    entries = _report(loaded_tiny_models)["attention_backends"]
    assert [e["backend"] for e in entries if e["backend"].startswith("unreadable")] == [
        "unreadable (RuntimeError: no backend second line)"], entries


def test_pipeline_stages_add_up_and_tensor_parallel_ranks_count_once():
    from vllm_ling.runtime.verification.attention_backends import merge_stages
    from vllm_ling.runtime.verification.ranks import merge_ranks

    def rank(i, tp, pp, mla, kda):
        return {"rank": i, "tp_rank": tp, "pp_rank": pp, "node_ip": "10.0.0.1", "passed": True,
                "optimizations": {}, "options": {},
                "attention_backends": [
                    {"model": "target", "layer": "MLAAttention", "layers": mla, "backend": "FLASHMLA",
                     "prefill": "FLASH_ATTN"},
                    {"model": "target", "layer": "KDA", "layers": kda, "backend": "KDA_ATTN", "prefill": None}]}

    ranks = [rank(0, 0, 0, 4, 20), rank(1, 1, 0, 4, 20), rank(2, 0, 1, 3, 15), rank(3, 1, 1, 3, 15)]
    assert _by_key(merge_stages(ranks)) == {("target", "MLAAttention", "FLASHMLA", "FLASH_ATTN"): 7,
                                            ("target", "KDA", "KDA_ATTN", None): 35}
    report = {"passed": True, "checks": [], "optimizations": {},
              "notes": ["prefix caching is off", "attention backends: this rank's only"]}
    merge_ranks(report, ranks)
    assert report["notes"] == ["prefix caching is off", "attention backends: target MLAAttention x7: FLASHMLA "
                               "(prefill FLASH_ATTN); target KDA x35: KDA_ATTN"]


def test_the_metric_has_one_series_per_entry(monkeypatch, tmp_path):
    from prometheus_client import REGISTRY
    from test_stat_logger import fake_config, sample_report  # tests/runtime/test_stat_logger.py

    from vllm_ling.runtime import stat_logger as metrics
    from vllm_ling.runtime.report import REPORT_JSON_SCHEMA

    entries = [{"model": "target", "layer": "MLAAttention", "layers": 5, "backend": "FLASHMLA", "prefill": "FLASH_ATTN"},
               {"model": "draft", "layer": "MLAAttention", "layers": 1, "backend": "FLASHMLA", "prefill": "FLASH_ATTN"},
               {"model": "target", "layer": "KDA", "layers": 35, "backend": "KDA_ATTN", "prefill": None}]
    report = sample_report(attention_backends=entries)
    pytest.importorskip("jsonschema").validate(report, REPORT_JSON_SCHEMA)
    monkeypatch.setenv(metrics.ENV_REPORT_PATH, str(tmp_path / "report.json"))
    (tmp_path / "report.json").write_text(json.dumps(report))
    try:
        metrics.LingStatLogger(fake_config(), [0]).log()
        for e in entries:
            labels = {"model_name": "tiny", "model": e["model"], "layer": e["layer"], "backend": e["backend"],
                      "prefill": e["prefill"] or "none"}
            assert REGISTRY.get_sample_value("vllm_ling:attention_backend_layers", labels) == e["layers"]
    finally:
        metrics.unregister_vllm_ling_metrics()
