"""Statistics (McNemar, bootstrap, percentiles) and Prometheus parsing, against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_ling.bench import scrape as metrics
from vllm_ling.bench.stats import bootstrap_delta, mcnemar_exact, mcnemar_exact_counts, summarize


@pytest.mark.parametrize("b,c,expected", [
    (0, 0, 1.0),  # no discordant pairs: no evidence
    # n = 6, k = 0: P[X <= 0] = 1/64; two-sided 2/64
    (0, 6, 2 / 64),
    # n = 6, k = 1: P[X <= 1] = (C(6,0) + C(6,1)) / 64 = 7/64; two-sided 14/64 = 0.21875
    (1, 5, 14 / 64),
    (5, 1, 14 / 64),  # symmetric
    # n = 12, k = 2: (1 + 12 + 66) / 4096 = 79/4096; two-sided 158/4096 = 0.03857...
    (2, 10, 158 / 4096),
    # n = 10, k = 5: (1+10+45+120+210+252)/1024 = 638/1024 > 1/2, so p is capped at 1
    (5, 5, 1.0),
    # n = 20, k = 3: (1 + 20 + 190 + 1140) / 2**20 = 1351/1048576; two-sided 2702/1048576
    (3, 17, 2702 / 1048576),
])
def test_mcnemar_exact_counts(b, c, expected):
    assert mcnemar_exact_counts(b, c) == pytest.approx(expected, rel=1e-12)


def test_mcnemar_from_per_question_lists_ignores_concordant_pairs():
    # 40 both right, 7 both wrong (concordant: irrelevant), 2 only A right, 10 only B right.
    a = [True] * 40 + [False] * 7 + [True] * 2 + [False] * 10
    b = [True] * 40 + [False] * 7 + [False] * 2 + [True] * 10
    res = mcnemar_exact(a, b)
    assert (res["a_only"], res["b_only"]) == (2, 10)
    assert res["p_value"] == pytest.approx(158 / 4096)
    with pytest.raises(ValueError):
        mcnemar_exact([True], [True, False])


def test_summarize_matches_numpy_percentiles():
    values = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0, float("nan")]
    s = summarize(values)
    clean = np.array([5.0, 1.0, 3.0, 2.0, 4.0, 100.0])
    assert s["n"] == 6
    assert s["mean"] == pytest.approx(115 / 6)
    assert s["p50"] == pytest.approx(3.5)  # between 3 and 4
    assert s["p99"] == pytest.approx(np.percentile(clean, 99))
    assert summarize([])["mean"] is None


def test_bootstrap_paired_constant_shift_is_exact():
    rng = np.random.default_rng(1)
    a = rng.normal(10, 3, 200)
    b = a + 1.5  # every request exactly 1.5 slower: a paired CI has no width
    ci = bootstrap_delta(a, b, "mean", paired=True)
    assert ci["delta"] == pytest.approx(1.5)
    assert ci["low"] == pytest.approx(1.5) and ci["high"] == pytest.approx(1.5)


def test_bootstrap_unpaired_covers_true_difference_and_is_reproducible():
    rng = np.random.default_rng(7)
    a = rng.normal(0.0, 1.0, 400)
    b = rng.normal(0.5, 1.0, 400)
    ci = bootstrap_delta(a, b, "mean")
    # standard error of the difference = sqrt(2/400) = 0.0707: a 95% CI is about +-0.14 wide
    assert ci["low"] < ci["delta"] < ci["high"]
    assert 0.2 < ci["high"] - ci["low"] < 0.36
    assert ci["low"] > 0  # a real 0.5 shift is detected
    assert bootstrap_delta(a, b, "mean") == ci  # fixed seed
    p95 = bootstrap_delta(a, b, "p95")
    assert p95["delta"] == pytest.approx(np.percentile(b, 95) - np.percentile(a, 95))


PROM = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 50.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 40.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 25.0
vllm:num_requests_running{engine="0",model_name="m"} 1 1700000000000
"""


def test_parse_prometheus_and_spec_deltas():
    samples = metrics.parse_prometheus(PROM)
    assert ("vllm:num_requests_running", {"engine": "0", "model_name": "m"}, 1.0) in samples
    after = metrics.spec_counters(PROM)
    assert after["drafts"] == 40.0 and after["accepted"] == 90.0  # summed over engines
    before = {"found": True, "drafts": 20.0, "accepted": 30.0, "draft_tokens": 60.0,
              "per_position": {0: 15.0, 1: 10.0, 2: 5.0}}
    d = metrics.spec_decode_delta(before, after)
    # 20 drafts, 60 accepted over the run: accept length 1 + 60/20 = 4
    assert d["accept_length"] == pytest.approx(4.0)
    assert d["per_position_accept_rate"] == pytest.approx([20 / 20, 20 / 20, 20 / 20])
    assert d["draft_acceptance_rate"] == pytest.approx(60 / 60)
    assert metrics.spec_decode_delta(after, after) is None  # no drafts during the run
    assert metrics.spec_decode_delta({}, metrics.spec_counters("vllm:other 1\n")) is None
    assert not math.isnan(after["draft_tokens"])
