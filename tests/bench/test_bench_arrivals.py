"""The arrival process: seeded Poisson arrivals, checked statistically (tolerances stated)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_ling.bench.arrivals import arrival_offsets

N = 20000
RATE = 5.0


def gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], offsets]))


def test_same_seed_same_schedule_other_seed_other_schedule():
    assert arrival_offsets(50, RATE, seed=1) == arrival_offsets(50, RATE, seed=1)
    assert arrival_offsets(50, RATE, seed=1) != arrival_offsets(50, RATE, seed=2)


def test_offsets_increase_from_zero():
    off = arrival_offsets(1000, RATE, seed=3)
    assert off[0] > 0 and all(b >= a for a, b in zip(off, off[1:]))


@pytest.mark.parametrize("seed", [0, 7, 12345])
def test_gaps_are_exponential_with_mean_one_over_rate(seed):
    g = gaps(arrival_offsets(N, RATE, seed))
    # Mean: the standard error of an exponential mean is mean/sqrt(N) = 0.7% here; allow 4%.
    assert g.mean() == pytest.approx(1 / RATE, rel=0.04)
    # Coefficient of variation of an exponential is 1 (a constant-rate schedule would give 0).
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)
    # Kolmogorov-Smirnov distance to the exponential CDF below the 99.9% critical value 1.95/sqrt(N).
    x = np.sort(g)
    cdf = 1 - np.exp(-RATE * x)
    i = np.arange(1, N + 1)
    d = max(np.max(i / N - cdf), np.max(cdf - (i - 1) / N))
    assert d < 1.95 / math.sqrt(N)


def test_counts_per_second_are_poisson():
    off = np.asarray(arrival_offsets(N, RATE, seed=11))
    counts = np.bincount(off.astype(int))[:-1]  # whole seconds only
    # Poisson counts: mean = variance = rate. Relative errors of ~4000 windows: mean 1.1%, var ~3%.
    assert counts.mean() == pytest.approx(RATE, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.12)


def test_total_duration_matches_rate():
    off = arrival_offsets(N, 50.0, seed=5)
    assert off[-1] == pytest.approx(N / 50.0, rel=0.04)


def test_no_rate_sends_everything_at_once():
    assert arrival_offsets(4, None, seed=0) == [0.0] * 4
    assert arrival_offsets(3, math.inf, seed=0) == [0.0] * 3


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_bad_rate_is_refused(rate):
    with pytest.raises(ValueError, match="--request-rate must be > 0"):
        arrival_offsets(3, rate, seed=0)
