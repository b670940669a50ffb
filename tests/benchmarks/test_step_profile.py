"""The step profiler's trace arithmetic (``benchmarks/step_profile.py``) on hand-made kernel
timelines, CPU only: union of busy intervals, the critical path per op class (PDL overlap owned
by the earlier kernel, idle time as gaps, the shared-expert stream off the path) and the refusal
to attribute when the replay's kernels differ from the eager run's."""

from __future__ import annotations

import pytest

step_profile = pytest.importorskip("benchmarks.step_profile")


def k(name, ts, dur, stream=7):
    return {"name": name, "ts": float(ts), "dur": float(dur), "stream": stream}


def test_covered_time_is_the_union_of_intervals():
    events = [k("a", 0, 10), k("b", 5, 10), k("c", 20, 5), k("d", 21, 1)]
    assert step_profile.covered_us(events) == pytest.approx(15 + 5)
    assert step_profile.covered_us([]) == 0


def test_critical_path_per_class():
    # gemv 0-10; norm PDL-launched at 8 (owns 10-12); idle 12-15; shared expert on another stream
    # 12-40 (off the path); moe 15-30; the second gemv waits for the join: gap 30-41, owns 41-50
    events = [k("gemv", 0, 10), k("norm", 8, 4), k("sh", 12, 28, stream=9), k("moe", 15, 15), k("gemv", 41, 9)]
    sequence = [("gemv", "dense", False), ("norm", "norms", False), ("sh", "dense", True),
                ("moe", "moe", False), ("gemv", "dense", False)]
    classes, note = step_profile.attribute(events, sequence)
    assert "matched" in note
    assert classes == pytest.approx({"dense": 10 + 9, "norms": 2, "gaps": 3 + 11, "moe": 15})
    assert sum(classes.values()) == pytest.approx(50)  # the path covers the span, nothing twice


def test_occurrence_matching_ignores_replay_streams():
    # the graph may put a branch on another stream: classes follow name and occurrence, not stream
    events = [k("gemv", 0, 5, stream=1), k("gemv", 5, 5, stream=2)]
    sequence = [("gemv", "router", False), ("gemv", "dense", False)]
    classes, _ = step_profile.attribute(events, sequence)
    assert classes == pytest.approx({"router": 5, "dense": 5})


def test_different_kernels_are_not_attributed():
    classes, note = step_profile.attribute([k("gemv", 0, 5)], [("gemv", "dense", False), ("norm", "norms", False)])
    assert classes == {} and "different kernels" in note


def test_analysis_counts_gaps_and_pdl_overlap_on_the_busiest_stream():
    events = [k("a", 0, 10), k("b", 8, 4), k("c", 15, 5), k("s", 0, 30, stream=9)]
    a = step_profile.analyse(events)
    assert a["gap_main_us"] == pytest.approx(3) and a["overlap_main_us"] == pytest.approx(2)
    assert a["busy_main_us"] == pytest.approx(17) and a["sum_side_us"] == pytest.approx(30)
    assert a["by_name"]["s"] == [1, 30.0]


def test_bound_puts_only_the_byte_classes_at_their_floors():
    # 1 GB/s: 1 MB takes 1000 us
    row = {"classes": {"dense_fp8": 5000.0, "moe_routed": 3000.0, "head": 900.0, "norms_residual": 200.0,
                       "gaps": 100.0},
           "class_bytes": {"dense_fp8": 2e6, "moe_routed": 1e6, "head": 0.5e6, "router": 1e6}}
    assert step_profile.byte_classes_at_floor_us(row, 1.0) == pytest.approx(2000 + 1000 + 500 + 200 + 100)


def test_a_saved_run_renders_again_without_a_gpu(tmp_path):
    events = [k("gemv", 0, 10), k("norm", 10, 2)]
    classes, note = step_profile.attribute(events, [("gemv", "dense_fp8", False), ("norm", "norms_residual", False)])
    row = {"tokens": 1, "graph_us": 12.0, "serial_shared_us": 13.0, "analysis": step_profile.analyse(events),
           "classes": classes, "attribution_note": note, "class_bytes": {"dense_fp8": 4e3}, "plan_floor_us": 4.0}
    saved = tmp_path / "run.json"
    saved.write_text(__import__("json").dumps({"head": "device X", "copy_gbs": 1.0, "argv": ["--tokens", "1"],
                                                "rows": [row]}))
    out = tmp_path / "run.md"
    assert step_profile.main(["--from-json", str(saved), "--out", str(out)]) == 0
    text = out.read_text()
    # dense at its floor (4 us at 1 GB/s) + norms 2 us = 6 us bound; path 12 us; floor 4 us
    assert "| 1 | 12 | 6 | 4 | 3.00 | 1.50 |" in text and "device X" in text
