"""Kernel timelines read from profiler traces: the time covered by at least one of them, and each
kernel's share of it."""

from __future__ import annotations


def wall_shares(events) -> list[float]:
    """Each event's share of the time covered by ``events`` (dicts with ``ts`` and ``dur``, us), in
    start order: what it adds beyond the events that started before it. Overlapping events (a
    programmatic-dependent launch started early and waiting, another stream's work) count once, so the
    shares sum to the covered time, where the durations sum to more."""
    out = [0.0] * len(events)
    covered = None
    for i in sorted(range(len(events)), key=lambda i: events[i]["ts"]):
        start, end = events[i]["ts"], events[i]["ts"] + events[i]["dur"]
        out[i] = end - start if covered is None else max(0.0, end - max(start, covered))
        covered = end if covered is None else max(covered, end)
    return out


def covered_us(events) -> float:
    """Union of the intervals ``[ts, ts + dur]`` of ``events``."""
    return sum(wall_shares(list(events)))
