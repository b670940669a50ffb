"""Efficiency factors read from a decode_step result file (CPU)."""

from __future__ import annotations

import json
import os

import pytest

from vllm_ling.models.measured_efficiency import EfficiencyFileError, load_decode_step

H200 = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "decode_step_h200.json")


def _write(tmp_path, data):
    p = tmp_path / "step.json"
    p.write_text(json.dumps(data))
    return p


def test_factors_from_a_synthetic_file(tmp_path):
    data = {"copy_gbs": 4000.0, "device": "test GPU", "results": [{
        "tokens": 1, "plan_bytes_target": 3.6e9, "plan_bytes_draft": 0.4e9, "plan_bytes_upstream": 5e9,
        "ours": {"us": 2000.0, "launches": 10, "classes": {"dense_fp8": 1000.0, "norms": 50.0},
                 "class_bytes": {"dense_fp8": 2e9}},
        "upstream": {"us": 4000.0, "classes": {}}}]}
    eff = load_decode_step(_write(tmp_path, data))
    # 4e9 bytes in 2 ms = 2 TB/s = half of the 4 TB/s copy bandwidth
    assert eff.step_fraction == pytest.approx(0.5)
    assert eff.predict_us(4e9, 4000.0) == pytest.approx(2000.0)
    assert eff.predict_us(2e9, 1000.0) == pytest.approx(4000.0)
    assert eff.classes["dense_fp8"].fraction(eff.copy_gbs) == pytest.approx(0.5)
    assert eff.classes["norms"].fraction(eff.copy_gbs) is None
    assert "test GPU" in eff.describe() and "step.json" in eff.describe()
    # floor at the copy bandwidth 1 ms, measured 2 ms, 10 launches: 100 us each; on a 1 TB/s device
    # the same bytes take 4 ms, plus the launches' 1 ms
    assert eff.launch_overhead_us == pytest.approx(100.0)
    assert eff.predict_with_launches_us(4e9, 1000.0) == pytest.approx(5000.0)
    up = load_decode_step(_write(tmp_path, data), composition="upstream")
    assert up.step_fraction == pytest.approx(5e9 / 4e-3 / 4e12)
    assert up.launch_overhead_us is None and up.predict_with_launches_us(4e9, 1000.0) is None  # no count


def test_errors_name_the_file_and_what_is_missing(tmp_path):
    with pytest.raises(EfficiencyFileError, match="missing.json"):
        load_decode_step(tmp_path / "missing.json")
    p = _write(tmp_path, {"copy_gbs": 1.0, "results": [{"tokens": 1, "ours": {}}]})
    with pytest.raises(EfficiencyFileError, match="no 4-token step"):
        load_decode_step(p, tokens=4)
    with pytest.raises(EfficiencyFileError, match="not a decode_step result"):
        load_decode_step(p)


def test_the_committed_h200_run_reads():
    for tokens in (1, 4):
        for comp in ("ours", "upstream"):
            eff = load_decode_step(H200, tokens=tokens, composition=comp)
            assert 0.0 < eff.step_fraction < 1.0
            assert eff.launches > 0 and "dense_fp8" in eff.classes
            for c in eff.classes.values():
                f = c.fraction(eff.copy_gbs)
                assert f is None or 0.0 < f < 1.2
