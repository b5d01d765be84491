"""The phase-two statistics (issue 35 B): power, the source as a stratum, the interaction, the
two-stage bootstrap; each checked against a value computed by hand or published, and run
end to end on a tiny synthetic record set."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from refkv.experiments.stats import (
    discordance_homogeneity,
    mcnemar_exact,
    mcnemar_power,
    mcnemar_power_normal,
    one_way_anova,
    paired_t_power,
    rank_auc,
    sample_size,
    stratified_binary,
    stratified_mean,
    two_stage_bootstrap,
)


def test_mcnemar_power_by_hand():
    # n = 2, every prompt discordant with chance 1/2, always for A (delta = 1/2): the test
    # rejects (p < 0.6) only when both prompts are discordant for A: p = 2 * (1/2)^2 = 0.5.
    # P(both discordant) = 1/4, then both for A with chance 1: power 1/4.
    assert mcnemar_power(2, 0.5, 0.5, 0.6) == pytest.approx(0.25)
    # at alpha 0.5 the same table (p = 0.5) is not below alpha: power 0
    assert mcnemar_power(2, 0.5, 0.5, 0.5) == 0.0


def test_mcnemar_power_three_prompts_by_hand():
    # n = 3, p_d = 1, delta = 0 (q = 1/2), alpha 0.3: with m = 3, b in {0, 3} gives
    # p = 2 * 1/8 = 0.25 < 0.3; P(b in {0, 3}) = 2/8. So the size is 1/4.
    assert mcnemar_power(3, 1.0, 0.0, 0.3) == pytest.approx(0.25)


def test_mcnemar_power_agrees_with_simulation():
    rng = np.random.default_rng(5)
    n, p10, p01, alpha = 40, 0.3, 0.08, 0.05
    reject = 0
    for _ in range(4000):
        u = rng.random(n)
        a = u < p10 + 0.4                       # A right: p10 + both
        b = (u >= p10) & (u < p10 + 0.4 + p01)  # B right: both + p01
        reject += mcnemar_exact(a, b)[2] < alpha
    assert mcnemar_power(n, p10 + p01, p10 - p01, alpha) == pytest.approx(reject / 4000, abs=0.025)


def test_mcnemar_power_normal_formula():
    # Connor (1987): Phi((0.2 sqrt(100) - 1.959964 sqrt(0.4)) / sqrt(0.4 - 0.04)) = Phi(1.2676...)
    z = (0.2 * 10 - 1.959964 * math.sqrt(0.4)) / math.sqrt(0.36)
    expected = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    assert mcnemar_power_normal(100, 0.4, 0.2, 0.05) == pytest.approx(expected, abs=1e-5)


def test_mcnemar_power_rejects_an_impossible_effect():
    with pytest.raises(ValueError, match="delta"):
        mcnemar_power(10, 0.2, 0.3, 0.05)


def test_paired_t_power_published_value():
    # G*Power: one-sample (paired) t, d = 1, n = 10, alpha 0.05 two-sided: power 0.8031
    assert paired_t_power(10, 1.0, 1.0, 0.05) == pytest.approx(0.8031, abs=5e-4)
    # no effect: the power is the level
    assert paired_t_power(12, 0.0, 1.0, 0.05) == pytest.approx(0.05, abs=1e-9)


def test_sample_size_is_the_first_n_reaching_the_target():
    power = {2: 0.1, 3: 0.85, 4: 0.79, 5: 0.9}
    assert sample_size(lambda n: power.get(n, 1.0), 0.8, 2, 5) == 3
    assert sample_size(lambda n: 0.1, 0.8, 2, 5) is None


def test_discordance_homogeneity_by_hand():
    # two documents, 3 discordant prompts each, all for A in one and all for B in the other.
    # Given 3 for A of 6, the count in document 1 is hypergeometric: P(3) = P(0) = 1/20;
    # only those two tables have a chi-square as large (6.0), so p = 1/10.
    chi, p = discordance_homogeneity([3, 0], [0, 3])
    assert chi == pytest.approx(6.0)
    assert p == pytest.approx(0.1)
    # the same split everywhere: chi-square 0, p 1
    assert discordance_homogeneity([2, 2], [1, 1]) == (pytest.approx(0.0), pytest.approx(1.0))
    # one informative stratum: nothing to compare
    assert discordance_homogeneity([2, 0], [1, 0]) == (0.0, 1.0)


def test_one_way_anova_by_hand():
    # groups {1, 2, 3} and {4, 5, 6}: means 2 and 5, grand mean 3.5; between = 3 * 1.5^2 * 2
    # = 13.5 on 1 df; within = 2 + 2 = 4 on 4 df; F = 13.5 / 1 = 13.5
    f, df1, df2, p = one_way_anova([[1, 2, 3], [4, 5, 6]])
    assert (f, df1, df2) == (pytest.approx(13.5), 1, 4)
    # p = P(F(1, 4) > 13.5) = P(|t_4| > sqrt(13.5))
    from scipy import stats

    assert p == pytest.approx(2 * stats.t.sf(math.sqrt(13.5), 4))


def test_stratified_binary_on_a_tiny_record_set():
    # two documents of 4 prompts: in "a" A is right where B is wrong twice; in "b" the reverse once
    a = np.array([1, 1, 0, 1, 0, 0, 1, 1], bool)
    b = np.array([0, 0, 0, 1, 1, 0, 1, 1], bool)
    out = stratified_binary(a, b, ["a"] * 4 + ["b"] * 4)
    assert out["strata"]["a"]["only_a"] == 2 and out["strata"]["a"]["only_b"] == 0
    assert out["strata"]["a"]["estimate"] == pytest.approx(0.5)
    assert out["strata"]["b"]["estimate"] == pytest.approx(-0.25)
    # 2 for A of 3 discordant: tables (2,1 | 0) chi 3.0 and (0 | ...) impossible beyond m;
    # b1 ~ hypergeometric(3 total, 2 in doc a, 2 for A): P(b1=2) = 1/3, P(b1=1) = 2/3;
    # chi-square of (2 | 0) = 3.0, of (1 | 1) = 0.75: p = 1/3
    assert out["chi_square"] == pytest.approx(3.0)
    assert out["p_interaction"] == pytest.approx(1 / 3)


def test_stratified_mean_on_a_tiny_record_set():
    a = np.array([2.0, 3.0, 4.0, 10.0, 10.0, 13.0])
    b = np.array([1.0, 1.0, 1.0, 5.0, 4.0, 6.0])
    out = stratified_mean(a, b, ["x", "x", "x", "y", "y", "y"])
    # differences {1, 2, 3} and {5, 6, 7}: means 2 and 6; F = (3*4 + 3*4) / 1 / (4 / 4) = 24
    assert out["strata"]["x"]["estimate"] == pytest.approx(2.0)
    assert out["strata"]["y"]["estimate"] == pytest.approx(6.0)
    assert out["f"] == pytest.approx(24.0)
    assert out["df"] == (1, 4)


def test_two_stage_bootstrap_equal_differences_give_a_point():
    # each text: A's losses are B's plus log 2, constant: every block's difference is the same
    # ratio, but perplexity differences depend on the text: make texts identical instead
    nll_b = [np.full(128, 1.0), np.full(128, 1.0)]
    nll_a = [x + 0.5 for x in nll_b]
    out = two_stage_bootstrap(nll_a, nll_b, block=64, n_boot=200)
    expected = math.exp(1.5) - math.exp(1.0)
    assert out.estimate == pytest.approx(expected)
    assert out.low == pytest.approx(expected) and out.high == pytest.approx(expected)


def test_two_stage_bootstrap_resamples_texts():
    # two texts with different gaps: the interval spans the two per-text gaps' range
    nll_b = [np.zeros(64), np.zeros(64)]
    nll_a = [np.full(64, 0.1), np.full(64, 0.7)]
    out = two_stage_bootstrap(nll_a, nll_b, block=64, n_boot=2000, seed=1)
    low_gap, high_gap = math.exp(0.1) - 1, math.exp(0.7) - 1
    assert out.low == pytest.approx(low_gap) and out.high == pytest.approx(high_gap)
    assert out.estimate == pytest.approx((low_gap + high_gap) / 2)


def test_rank_auc_by_hand():
    # positives 0.9, 0.4; negatives 0.5, 0.1: pairs won 1 + 1 + 0 + 1 = 3 of 4
    auc, p = rank_auc([0.9, 0.4, 0.5, 0.1], [True, True, False, False])
    assert auc == pytest.approx(0.75)
    assert 0 < p <= 1


def _enumerated_homogeneity(only_a, only_b):
    """The exact tail by enumerating every table with the same margins (the definition)."""
    import itertools
    import math

    a, b = np.asarray(only_a), np.asarray(only_b)
    m = a + b
    a, m = a[m > 0], m[m > 0]
    total, favour = int(m.sum()), int(a.sum())
    q = favour / total

    def chi(x):
        return float(np.sum((np.asarray(x) - m * q) ** 2 / (m * q * (1 - q))))

    observed = chi(a)
    tail = sum(math.prod(math.comb(int(mi), xi) for mi, xi in zip(m, x))
               for x in itertools.product(*[range(int(mi) + 1) for mi in m])
               if sum(x) == favour and chi(x) >= observed - 1e-9 * max(1.0, observed))
    return observed, tail / math.comb(total, favour)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=2, max_size=5))
def test_discordance_homogeneity_equals_the_enumeration_of_every_table(pairs):
    only_a, only_b = zip(*pairs)
    m = np.add(only_a, only_b)
    assume((m > 0).sum() >= 2 and 0 < np.sum(only_a) < m.sum())
    chi, p = discordance_homogeneity(only_a, only_b)
    chi_e, p_e = _enumerated_homogeneity(only_a, only_b)
    assert chi == pytest.approx(chi_e, rel=1e-12, abs=1e-12)
    assert p == pytest.approx(p_e, rel=1e-12, abs=1e-15)


def test_discordance_homogeneity_decides_21_documents_of_7_prompts():
    """Phase two's per-document interaction (21 strata of up to 7 discordant prompts: about 8^21
    tables) is computed, not given up: A winning every discordant prompt in 10 documents and B in
    the other 11 is an interaction; one document against the rest, among 21, is not."""
    chi, p = discordance_homogeneity([4] * 10 + [0] * 11, [0] * 10 + [4] * 11)
    assert chi == pytest.approx(84.0) and 0 < p < 1e-12
    chi, p = discordance_homogeneity([7] + [1] * 20, [0] + [3] * 20)
    assert chi == pytest.approx(16.916666666666668) and 0.5 < p < 0.9
    # the same split in every document is no evidence of an interaction
    assert discordance_homogeneity([2] * 21, [2] * 21)[1] == pytest.approx(1.0)
