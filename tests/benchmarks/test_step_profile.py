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
