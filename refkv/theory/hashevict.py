"""HashEvict's Eq. 3, the SimHash collision law (Goemans and Williamson; Charikar), and the
concentration bounds its tests use.

:func:`angle_fraction`, :func:`hamming_fraction_moments`, :func:`hoeffding_radius`,
:func:`bernstein_radius`. Tests: ``tests/theory/test_theory_hashevict.py``; page:
``docs/theory/hashevict.rst``.
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import _vector, check_float, check_int

__all__ = [
    "angle_fraction",
    "bernstein_radius",
    "hamming_fraction_moments",
    "hoeffding_radius",
]


def angle_fraction(x, y) -> float:
    """``theta_{x,y} / pi``: HashEvict Eq. 3's right side, the expected fraction of differing bits.

    The cosine is clipped to [-1, 1] before ``arccos`` (rounding can push it out by an ulp).
    """
    x = _vector("x", x)
    y = _vector("y", y)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same shape, got {x.shape} and {y.shape}")
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    if nx == 0 or ny == 0:
        raise ValueError("x and y must be non-zero (the angle to a zero vector is undefined)")
    c = float(np.clip((x @ y) / (nx * ny), -1.0, 1.0))
    return math.acos(c) / math.pi


def hamming_fraction_moments(p: float, c: int) -> tuple[float, float, float]:
    """Exact moments of ``d_H / c`` when each of the ``c`` bits differs independently w.p. ``p``.

    With Gaussian planes the ``c`` bits are independent and each differs with probability
    ``p = theta / pi`` (Eq. 3), so ``d_H ~ Binomial(c, p)``.

    Returns
    -------
    mean : ``p``
    variance : ``p (1 - p) / c`` (the spread shrinks as ``1 / c``)
    fourth_central : ``p q (1 + 3 (c - 2) p q) / c^3`` with ``q = 1 - p``
        (the binomial's fourth central moment divided by ``c^4``).
    """
    p = check_float("p", p, 0.0, 1.0)
    c = check_int("c", c, 1)
    pq = p * (1.0 - p)
    return p, pq / c, pq * (1.0 + 3.0 * (c - 2) * pq) / c ** 3


def hoeffding_radius(n: int, delta: float, span: float = 1.0) -> float:
    """Hoeffding: the mean of ``n`` independent draws in an interval of width ``span`` is within
    ``span * sqrt(ln(2 / delta) / (2 n))`` of its expectation with probability at least ``1 - delta``."""
    n = check_int("n", n, 1)
    delta = check_float("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    span = check_float("span", span, 0.0, low_open=True)
    return span * math.sqrt(math.log(2.0 / delta) / (2.0 * n))


def bernstein_radius(n: int, delta: float, variance: float, span: float) -> float:
    """Bernstein: the mean of ``n`` independent draws with variance ``<= variance`` and
    ``|X - E X| <= span`` is within ``sqrt(2 variance L / n) + 2 span L / (3 n)``, ``L = ln(2 / delta)``,
    of its expectation with probability at least ``1 - delta``."""
    n = check_int("n", n, 1)
    delta = check_float("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    span = check_float("span", span, 0.0, low_open=True)
    variance = check_float("variance", variance, 0.0)
    log_term = math.log(2.0 / delta)
    return math.sqrt(2.0 * variance * log_term / n) + 2.0 * span * log_term / (3.0 * n)
