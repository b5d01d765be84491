"""``hamming_fraction_moments`` against the binomial pmf summed exactly, in rational arithmetic.

The expectations are computed here from the definition, ``E[(K/c - p)^j]`` over
``K ~ Binomial(c, p)``, with :class:`fractions.Fraction`: independent of the closed forms
the module uses.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from refkv.theory.hashevict import hamming_fraction_moments


def binomial_fraction_moments(p: Fraction, c: int) -> tuple[Fraction, Fraction, Fraction]:
    """Mean, variance and fourth central moment of K / c, K ~ Binomial(c, p), exactly."""
    pmf = [comb(c, k) * p ** k * (1 - p) ** (c - k) for k in range(c + 1)]
    assert sum(pmf) == 1
    mean = sum(w * Fraction(k, c) for k, w in enumerate(pmf))
    central = [sum(w * (Fraction(k, c) - mean) ** j for k, w in enumerate(pmf)) for j in (2, 4)]
    return mean, central[0], central[1]


def test_fourth_moment_at_p_03_c_4_is_the_binomial_sum():
    exact = binomial_fraction_moments(Fraction(3, 10), 4)[2]
    assert exact == Fraction(7415625, 10 ** 9)  # 0.0074156..., summed by hand below
    # k = 0..4: pmf 0.2401, 0.4116, 0.2646, 0.0756, 0.0081; (k/4 - 0.3)^4 = 0.0081, 0.00000625,
    # 0.0016, 0.04100625, 0.2401: sum of products 0.007415625.
    hand = (0.2401 * 0.0081 + 0.4116 * 0.00000625 + 0.2646 * 0.0016 + 0.0756 * 0.04100625 + 0.0081 * 0.2401)
    assert float(exact) == pytest.approx(hand, rel=1e-12)
    assert hamming_fraction_moments(0.3, 4)[2] == pytest.approx(0.007415625, rel=1e-12)


@pytest.mark.parametrize("p", [Fraction(0), Fraction(1, 7), Fraction(3, 10), Fraction(1, 2), Fraction(9, 10),
                               Fraction(1)])
@pytest.mark.parametrize("c", [1, 2, 3, 4, 5, 16, 64])
def test_every_moment_is_the_binomial_sum(p, c):
    mean, variance, fourth = hamming_fraction_moments(float(p), c)
    e_mean, e_variance, e_fourth = binomial_fraction_moments(p, c)
    assert mean == pytest.approx(float(e_mean), rel=1e-12, abs=1e-300)
    assert variance == pytest.approx(float(e_variance), rel=1e-12, abs=1e-300)
    assert fourth == pytest.approx(float(e_fourth), rel=1e-12, abs=1e-300)
