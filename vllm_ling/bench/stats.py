"""Summary statistics, bootstrap confidence intervals and the exact McNemar test (numpy only)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

BOOTSTRAP_SEED = 20261029
BOOTSTRAP_SAMPLES = 2000


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, P50, P95, P99 (linear interpolation, numpy's default), min, max, count."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "min": None, "max": None}
    return {
        "n": int(arr.size),
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


# Each reduces the last axis, so a (samples, n) matrix of resamples is done in one call.
STATISTICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": lambda a: np.mean(a, axis=-1),
    "p50": lambda a: np.percentile(a, 50, axis=-1),
    "p95": lambda a: np.percentile(a, 95, axis=-1),
    "p99": lambda a: np.percentile(a, 99, axis=-1),
}


def bootstrap_delta(
    a: Sequence[float],
    b: Sequence[float],
    statistic: str = "mean",
    *,
    paired: bool = False,
    confidence: float = 0.95,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, float | None]:
    """Percentile-bootstrap CI of stat(b) - stat(a), resampling requests with a fixed seed.

    `paired`: a[i] and b[i] are the same request (same question); resample the pairs together,
    which removes the between-question variance from the interval.
    """
    fn = STATISTICS[statistic]
    xa = np.asarray(a, dtype=float)
    xb = np.asarray(b, dtype=float)
    if xa.size == 0 or xb.size == 0:
        return {"delta": None, "low": None, "high": None, "relative": None}
    delta = float(fn(xb) - fn(xa))
    base = float(fn(xa))
    rng = np.random.default_rng(seed)
    if paired:
        if xa.size != xb.size:
            raise ValueError("paired bootstrap needs equally long samples")
        idx = rng.integers(0, xa.size, (samples, xa.size))
        boots = fn(xb[idx]) - fn(xa[idx])
    else:
        boots = fn(xb[rng.integers(0, xb.size, (samples, xb.size))]) - fn(
            xa[rng.integers(0, xa.size, (samples, xa.size))])
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(boots, [alpha, 1.0 - alpha])
    return {
        "delta": float(delta),
        "low": float(low),
        "high": float(high),
        "relative": float(delta / base) if base else None,
    }


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict[str, float | int]:
    """Exact (binomial) two-sided McNemar test on paired per-question correctness.

    Only discordant pairs carry information: b = A right & B wrong, c = A wrong & B right.
    Under H0 (same accuracy) b ~ Binomial(b + c, 1/2); p = min(1, 2 * P[X <= min(b, c)]).
    """
    if len(a_correct) != len(b_correct):
        raise ValueError("McNemar needs the same questions in both runs")
    b = sum(1 for x, y in zip(a_correct, b_correct) if x and not y)
    c = sum(1 for x, y in zip(a_correct, b_correct) if y and not x)
    return {"a_only": b, "b_only": c, "p_value": mcnemar_exact_counts(b, c)}


def mcnemar_exact_counts(b: int, c: int) -> float:
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2.0 * tail)
