"""Kernel timelines read from profiler traces: the time covered by at least one of them."""

from __future__ import annotations


def covered_us(events) -> float:
    """Union of the intervals ``[ts, ts + dur]`` of ``events`` (dicts with ``ts`` and ``dur``, us)."""
    total, start, end = 0.0, None, None
    for e in sorted(events, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, t
        else:
            end = max(end, t)
    if end is not None:
        total += end - start
    return total
