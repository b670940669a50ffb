"""When each request is sent: all at once (bounded by the concurrency) or as a Poisson process.

A Poisson process at rate R has independent exponential gaps with mean 1/R, which is how
independent users arrive; vLLM's own ``benchmark_serving`` uses the same model. The times are
offsets in seconds from the start of the run, drawn from a seeded generator so a rerun sends
on the same schedule.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(num_requests: int, rate: float | None, seed: int) -> list[float]:
    """Send offsets (seconds, non-decreasing, the first at gap 1) for ``num_requests`` requests.

    ``rate`` None or infinite: every offset is 0 (the concurrency limit alone paces the run).
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if rate is None or math.isinf(rate):
        return [0.0] * num_requests
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append(t)
    return out
