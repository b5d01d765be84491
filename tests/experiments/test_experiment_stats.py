"""refkv.experiments.stats against scipy.stats, hand-computed values and simulated coverage."""

import math

import numpy as np
import pytest
from scipy import stats

from refkv.experiments.stats import (
    Interval,
    excluded_effects,
    mcnemar_exact,
    paired_mean_difference,
    paired_proportion_difference,
    perplexity_gap,
    wilson_interval,
)


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (6, 10), (10, 10), (37, 50), (0, 1), (123, 400)])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_wilson_matches_scipy(k, n, confidence):
    ours = wilson_interval(k, n, confidence=confidence)
    ref = stats.binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    assert ours.low == pytest.approx(ref.low, abs=1e-12)
    assert ours.high == pytest.approx(ref.high, abs=1e-12)
    assert ours.estimate == k / n and ours.n == n


def test_wilson_by_hand_at_zero():
    # 0/10: the upper end is z^2 / (n + z^2) with z = 1.959964: 3.841459 / 13.841459.
    assert wilson_interval(0, 10).high == pytest.approx(3.841458820694124 / 13.841458820694124, rel=1e-12)
    assert wilson_interval(0, 10).low == 0.0


@pytest.mark.parametrize("b,c", [(1, 9), (0, 0), (5, 5), (0, 7), (12, 3), (30, 18)])
def test_mcnemar_matches_the_exact_binomial(b, c):
    a = np.array([True] * b + [False] * c + [True] * 4 + [False] * 3)
    bb = np.array([False] * b + [True] * c + [True] * 4 + [False] * 3)
    got_b, got_c, p = mcnemar_exact(a, bb)
    assert (got_b, got_c) == (b, c)
    expected = 1.0 if b + c == 0 else stats.binomtest(min(b, c), b + c, 0.5).pvalue
    assert p == pytest.approx(expected, rel=1e-12)


def test_mcnemar_by_hand():
    # b = 1, c = 9: 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024.
    a = [True] + [False] * 9
    b = [False] + [True] * 9
    assert mcnemar_exact(a, b)[2] == pytest.approx(22 / 1024, rel=1e-14)


def test_paired_t_matches_scipy():
    rng = np.random.default_rng(3)
    a = rng.normal(1.0, 1.0, 15)
    b = a - rng.normal(0.3, 0.5, 15)
    ours = paired_mean_difference(a, b)
    ref = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert (ours.low, ours.high) == pytest.approx((ref.low, ref.high), rel=1e-12)
    assert ours.estimate == pytest.approx(np.mean(a - b), rel=1e-14)


def test_paired_proportion_difference_is_paired():
    # Same answers: the difference is exactly 0 in every replicate.
    x = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=bool)
    iv = paired_proportion_difference(x, x)
    assert (iv.estimate, iv.low, iv.high) == (0.0, 0.0, 0.0)
    # A alone right on 16 of 20 prompts, B alone on 4: the 2.5% quantile of the replicate
    # mean is 2 * 13 / 20 - 1 = 0.3 (P[Bin(20, 0.8) <= 12] = 0.032), above 0.
    a = np.array([1] * 16 + [0] * 4, dtype=bool)
    b = np.array([0] * 16 + [1] * 4, dtype=bool)
    iv = paired_proportion_difference(a, b, seed=1)
    assert iv.estimate == pytest.approx(0.6) and 0.2 <= iv.low <= 0.4


def test_perplexity_gap_point_estimate_by_hand():
    a = [np.full(100, 2.0), np.full(28, 2.0)]
    b = [np.full(100, 1.0), np.full(28, 1.0)]
    iv = perplexity_gap(a, b, block=64, n_boot=200)
    # Constant losses: every replicate has the same means, so the interval collapses.
    assert iv.estimate == pytest.approx(math.exp(2) - math.exp(1), rel=1e-14)
    assert iv.low == pytest.approx(iv.estimate, rel=1e-12) and iv.high == pytest.approx(iv.estimate, rel=1e-12)
    assert iv.n == 128 and "2 texts, 3 blocks of 64 tokens" in iv.method


def test_perplexity_gap_is_zero_for_identical_policies():
    rng = np.random.default_rng(0)
    texts = [rng.gamma(2.0, 1.5, 300) for _ in range(3)]
    iv = perplexity_gap(texts, texts)
    assert (iv.estimate, iv.low, iv.high) == (0.0, 0.0, 0.0)


def _ar1(rng, n, phi, sigma):
    e = rng.normal(0, sigma, n)
    x = np.empty(n)
    x[0] = e[0] / math.sqrt(1 - phi * phi)
    for t in range(1, n):
        x[t] = phi * x[t - 1] + e[t]
    return x


def _coverage(block, reps=120, phi=0.9):
    """How often the interval covers the true gap when token losses are autocorrelated."""
    rng = np.random.default_rng(11)
    mu_a, mu_b, sd = 3.0, 2.9, 0.05
    # Stationary AR(1) noise with marginal sd `sd`; the two policies share most of it
    # (a hard passage is hard for both), which is what pairing exploits.
    truth = math.exp(mu_a) - math.exp(mu_b)
    hits = 0
    for _ in range(reps):
        a, b = [], []
        for _ in range(4):
            shared = _ar1(rng, 512, phi, sd * math.sqrt(1 - phi * phi))
            a.append(mu_a + shared + _ar1(rng, 512, phi, 0.3 * sd * math.sqrt(1 - phi * phi)))
            b.append(mu_b + shared + _ar1(rng, 512, phi, 0.3 * sd * math.sqrt(1 - phi * phi)))
        iv = perplexity_gap(a, b, block=block, n_boot=300, seed=int(rng.integers(1 << 30)))
        hits += iv.contains(truth)
    return hits / reps


@pytest.mark.slow
def test_block_bootstrap_covers_and_token_bootstrap_does_not():
    """Blocks of 64 keep ~95% coverage on autocorrelated losses; resampling single tokens
    (block = 1) treats them as independent and its interval is too narrow."""
    assert _coverage(64) >= 0.85
    assert _coverage(1) < 0.7


def test_excluded_effects_wording():
    iv = Interval(1.0, 0.4, 1.6, 0.95, 100, "tokens", "x")
    assert excluded_effects(iv, {"paper": 2.5, "none": 0.0, "small": 0.5}) == \
        "excludes paper (+2.50), none (+0.00); consistent with small (+0.50)"
    assert iv.format() == "+1.00 [+0.40, +1.60]"


@pytest.mark.parametrize("call,message", [
    (lambda: wilson_interval(11, 10), "successes must be an integer in [0, 10]"),
    (lambda: wilson_interval(1, 0), "n must be an integer >= 1"),
    (lambda: wilson_interval(1, 10, confidence=1.0), "confidence must be a finite number in (0, 1)"),
    (lambda: mcnemar_exact([True], [True, False]), "same length"),
    (lambda: paired_mean_difference([1.0], [2.0]), "length >= 2"),
    (lambda: perplexity_gap([np.ones(5)], [np.ones(4)]), "text 0"),
    (lambda: perplexity_gap([np.ones(5)], [np.ones(5)], block=0), "block must be an integer >= 1"),
    (lambda: perplexity_gap([np.array([1.0, np.nan])], [np.ones(2)]), "finite"),
    (lambda: excluded_effects(Interval(0, 0, 0, 0.95, 1, "", ""), {"x": float("inf")}), "effects['x']"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=None) as err:
        call()
    assert message in str(err.value)
