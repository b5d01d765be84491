"""HashEvict Eq. 3 (the SimHash collision law) with rigorous statistical bounds, and its corollaries.

Eq. 3: for x, y in R^d and h(x) = Heaviside(R x) with R (c x d) standard normal,
E[d_H(h(x), h(y))] / c = theta_{x,y} / pi.

The checks are concentration inequalities at a fixed seed, not loose tolerances: for each
pair (x, y) the assertion fails with probability at most DELTA over the draw of the planes
(Hoeffding / Bernstein), and hypothesis tries at most a few hundred pairs, chosen without
seeing the planes, so a correct implementation fails with probability below 1e-8 per run
(union bound) -- and, the seed being fixed, a run that passes once passes always.
"""

import itertools
import math
from functools import cache

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from refkv.lsh import gaussian_planes, hamming, hamming_unpacked, pack_codes, simhash, unpack_codes
from refkv.theory.hashevict import angle_fraction, bernstein_radius, hamming_fraction_moments, hoeffding_radius

#: Failure probability allowed per checked pair (union bound over <= 100 pairs: < 1e-9).
DELTA = 1e-11
#: Independent draws of the c planes, and bits per draw, for the Eq. 3 test.
DRAWS = 100_000
BITS = 8
SEED = 20240917


def bounded(low, high):
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


@cache
def planes_for(d, draws=DRAWS, bits=BITS, seed=SEED):
    """``draws`` independent R's of ``bits`` planes each, stacked: (draws * bits, d)."""
    return gaussian_planes(draws * bits, d, seed=seed)


def hamming_fractions(x, y, planes, bits):
    """d_H(h(x), h(y)) / c for each draw, through the library path (hash, pack, popcount)."""
    draws = planes.shape[0] // bits
    hx = simhash(x, planes).reshape(draws, bits)
    hy = simhash(y, planes).reshape(draws, bits)
    return hamming(pack_codes(hx), pack_codes(hy)) / bits


@st.composite
def vector_pairs(draw, max_d=8):
    d = draw(st.integers(2, max_d))
    x = draw(arrays(np.float64, d, elements=bounded(-10, 10)))
    y = draw(arrays(np.float64, d, elements=bounded(-10, 10)))
    assume(np.linalg.norm(x) > 1e-3 and np.linalg.norm(y) > 1e-3)
    return x, y


@given(pair=vector_pairs())
@example(pair=(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0])))      # theta = 0
@example(pair=(np.array([1.0, 2.0, 3.0]), np.array([-1.0, -2.0, -3.0])))   # theta = pi
@example(pair=(np.array([1.0, 0.0]), np.array([0.0, 5.0])))               # theta = pi / 2
@example(pair=(np.array([1.0, 0.0]), np.array([0.5, math.sqrt(3) / 2])))  # theta = pi / 3
@settings(max_examples=40)
def test_eq3_mean_hamming_fraction_is_angle_over_pi(pair):
    """Hoeffding: the mean of DRAWS independent d_H / c in [0, 1] is within
    sqrt(ln(2 / DELTA) / (2 DRAWS)) = 0.0114 of theta / pi with probability >= 1 - DELTA."""
    x, y = pair
    fractions = hamming_fractions(x, y, planes_for(x.shape[0]), BITS)
    radius = hoeffding_radius(DRAWS, DELTA)
    assert radius < 0.0115
    assert abs(fractions.mean() - angle_fraction(x, y)) <= radius


def test_eq3_extreme_angles_are_exact():
    """theta = 0 gives d_H = 0 and theta = pi gives d_H = c on every draw (R x = 0 has probability 0)."""
    x = np.array([0.3, -1.2, 2.0, 0.7])
    planes = planes_for(4)
    np.testing.assert_array_equal(hamming_fractions(x, 2.5 * x, planes, BITS), 0.0)
    np.testing.assert_array_equal(hamming_fractions(x, -x, planes, BITS), 1.0)


def test_eq3_fails_for_planes_that_are_not_rotation_invariant():
    """The test above can fail: with planes drawn uniformly from [0, 1]^d (all in one orthant,
    not rotation invariant) two orthogonal vectors in that orthant never disagree (d_H = 0
    on every draw), far from theta / pi = 1/2."""
    rng = np.random.default_rng(0)
    skewed = rng.uniform(0.0, 1.0, (DRAWS * BITS, 2))
    x, y = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    fractions = hamming_fractions(x, y, skewed, BITS)
    assert abs(fractions.mean() - angle_fraction(x, y)) > 10 * hoeffding_radius(DRAWS, DELTA)


@pytest.mark.parametrize("theta", [math.pi / 3, 0.9 * math.pi])
def test_eq3_spread_shrinks_like_one_over_c(theta):
    """Var(d_H / c) = p (1 - p) / c with p = theta / pi (d_H ~ Binomial(c, p): the c planes are
    independent). Checked for c = 1, 4, 16, 64 with Bernstein's inequality on the squared
    deviations (their exact variance follows from the binomial fourth moment); the bounds are
    disjoint, so the spread provably shrinks as c grows."""
    draws = 12_000
    rng = np.random.default_rng(1)
    rotation, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    x = rotation @ np.array([1.0, 0.0, 0.0, 0.0])
    y = rotation @ np.array([math.cos(theta), math.sin(theta), 0.0, 0.0])
    p = angle_fraction(x, y)
    assert p == pytest.approx(theta / math.pi, abs=1e-12)
    intervals = []
    for c in (1, 4, 16, 64):
        fractions = hamming_fractions(x, y, gaussian_planes(draws * c, 4, seed=SEED + c), c)
        squared = (fractions - p) ** 2
        mean, variance, fourth = hamming_fraction_moments(p, c)
        assert mean == p and variance == pytest.approx(p * (1 - p) / c)
        var_of_squared = fourth - variance ** 2
        span = max(p, 1 - p) ** 2
        radius = bernstein_radius(draws, DELTA, var_of_squared, span)
        assert abs(squared.mean() - variance) <= radius
        intervals.append((squared.mean() - radius, squared.mean() + radius))
    for (low, _), (_, high) in itertools.pairwise(intervals):
        assert high < low  # every interval lies strictly below the previous one


@given(x=arrays(np.float64, st.integers(1, 8), elements=bounded(-1e3, 1e3)), power=st.integers(-20, 20),
       scale=bounded(1e-3, 1e3))
def test_codes_are_invariant_to_positive_scaling(x, power, scale):
    """h(a x) = h(x) for a > 0. Exact for a = 2^k (every product and sum scales exactly); for
    other a, exact on every bit whose projection is not within rounding (d eps |r| |x|) of 0."""
    x = np.where(np.abs(x) < 1e-100, 0.0, x)  # no subnormal projections, whose scaling is inexact
    planes = gaussian_planes(64, x.shape[0], seed=3)
    codes = simhash(x, planes)
    np.testing.assert_array_equal(simhash(x * 2.0 ** power, planes), codes)
    projections = planes @ x
    margin = 4 * x.shape[0] * np.finfo(np.float64).eps * np.linalg.norm(planes, axis=1) * np.linalg.norm(x)
    clear = np.abs(projections) > margin
    np.testing.assert_array_equal(simhash(x * scale, planes)[clear], codes[clear])


@given(codes=arrays(np.bool_, st.tuples(st.integers(1, 5), st.integers(1, 70))), data=st.data())
def test_packed_hamming_equals_unpacked_count(codes, data):
    """popcount(XOR) of the packed bytes = number of differing bits, for any code length
    (padding bits of the last byte are zero on both sides); broadcasting included."""
    other = data.draw(arrays(np.bool_, codes.shape))
    pa, pb = pack_codes(codes), pack_codes(other)
    assert pa.shape == (codes.shape[0], math.ceil(codes.shape[1] / 8))
    np.testing.assert_array_equal(unpack_codes(pa, codes.shape[1]), codes)
    by_hand = np.array([sum(int(u != v) for u, v in zip(row_a, row_b)) for row_a, row_b in zip(codes, other)])
    np.testing.assert_array_equal(hamming(pa, pb), by_hand)
    np.testing.assert_array_equal(hamming_unpacked(codes, other), by_hand)
    # All pairs at once: (k, 1, bytes) against (1, k, bytes).
    np.testing.assert_array_equal(hamming(pa[:, None], pb[None]), hamming_unpacked(codes[:, None], other[None]))


@pytest.mark.parametrize("call, message", [
    (lambda: hoeffding_radius(0, 0.1), "n must be an integer >= 1"),
    (lambda: hoeffding_radius(10, 1.0), r"delta must be a finite number in \(0, 1\)"),
    (lambda: bernstein_radius(10, 0.1, -1.0, 1.0), r"variance must be a finite number in \[0, inf\)"),
    (lambda: hamming_fraction_moments(1.5, 4), r"p must be a finite number in \[0, 1\]"),
    (lambda: angle_fraction([0.0, 0.0], [1.0, 0.0]), "must be non-zero"),
])
def test_statistics_helpers_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
