"""KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction ...").

:func:`unit_rows`, :func:`cosine_matrix`, :func:`pairwise_cosine_sums` (Eq. 7),
:func:`pairwise_objective` (Eq. 9), :func:`relaxed_objective` (Eq. 10),
:func:`brute_force_minimum`, :func:`keydiff_choice`, :func:`eq9_optimality_rate`,
:func:`attention_weight_of`, :func:`c1_bound` and :func:`c1_bound_corrected` (Thm C.1 /
Lemma 3.1), :func:`cosine_square_sum` (Lemma C.2), :func:`c3_bound` and
:func:`c3_bound_tight` (Thm C.3). Tests: ``tests/theory/test_theory_keydiff.py``; page:
``docs/theory/keydiff.rst``.

KeyDiff's App. C models an attention logit as ``k . q`` with no ``1 / sqrt(d)`` (the scale is
absorbed into the norm bound ``M``); :func:`attention_weight_of` follows it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from ._checks import _matrix, _softmax, _subset, _vector, check_float, check_int

__all__ = [
    "attention_weight_of",
    "brute_force_minimum",
    "c1_bound",
    "c1_bound_corrected",
    "c3_bound",
    "c3_bound_tight",
    "cosine_matrix",
    "cosine_square_sum",
    "eq9_optimality_rate",
    "keydiff_choice",
    "pairwise_cosine_sums",
    "pairwise_objective",
    "relaxed_objective",
    "unit_rows",
]


def unit_rows(keys) -> np.ndarray:
    """``k_i / ||k_i||`` (KeyDiff's ``k-hat``); a zero key is a ValueError."""
    keys = _matrix("keys", keys)
    norms = np.linalg.norm(keys, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError("keys must be non-zero (the cosine of a zero vector is undefined)")
    return keys / norms


def cosine_matrix(keys) -> np.ndarray:
    """``CosSim(K)_ij = <k_i, k_j> / (||k_i|| ||k_j||)`` (KeyDiff Eq. 7), diagonal included."""
    keys = _matrix("keys", keys)
    norms = np.linalg.norm(keys, axis=1)
    if np.any(norms == 0):
        raise ValueError("keys must be non-zero (the cosine of a zero vector is undefined)")
    return (keys @ keys.T) / np.outer(norms, norms)


def pairwise_cosine_sums(keys) -> np.ndarray:
    """``CosSim(K) 1`` (KeyDiff Eq. 7): for each key, the sum of its cosines to all keys.

    Self-similarity (``cos(k_i, k_i) = 1``) is included, as ``CosSim(K) 1`` with the full
    matrix implies. KeyDiff keeps the ``N`` keys with the smallest sums.
    """
    return cosine_matrix(keys).sum(axis=1)


def pairwise_objective(keys, subset) -> float:
    """KeyDiff Eq. 9: ``sum_{i in S} sum_{j in S} cos(k_i, k_j)`` (diagonal terms included).

    Parameters
    ----------
    keys : (n, d) array of non-zero keys
    subset : sequence of int
        ``S``, the retained tokens.
    """
    c = cosine_matrix(keys)
    idx = _subset("subset", subset, c.shape[0])
    return float(c[np.ix_(idx, idx)].sum())


def relaxed_objective(keys, subset) -> float:
    """KeyDiff Eq. 10: ``sum_{i in S} k-hat_i . mu(K-hat)`` with the mean over *all* n keys."""
    kh = unit_rows(keys)
    idx = _subset("subset", subset, kh.shape[0])
    mu = kh.mean(axis=0)
    return float((kh[idx] @ mu).sum())


def brute_force_minimum(objective: Callable[[np.ndarray, np.ndarray], float], keys, budget: int,
                        tol: float = 1e-9, max_subsets: int = 200_000) -> tuple[float, list[tuple[int, ...]]]:
    """Minimise ``objective(keys, S)`` over every subset ``S`` of size ``budget``.

    Parameters
    ----------
    objective : callable
        ``objective(keys, subset) -> float``, e.g. :func:`pairwise_objective`.
    keys : (n, d) array
    budget : int
        ``N``, in ``[1, n]``.
    tol : float
        Subsets whose value is within ``tol`` of the minimum are all reported.
    max_subsets : int
        Refuse problems with more than this many subsets (``C(n, N)``).

    Returns
    -------
    best : float
        The minimum.
    argmins : list of tuple
        Every subset (sorted indices) attaining it up to ``tol``.
    """
    keys = _matrix("keys", keys)
    n = keys.shape[0]
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= n:
        raise ValueError(f"budget must be an integer in [1, {n}], got {budget!r}")
    if math.comb(n, int(budget)) > max_subsets:
        raise ValueError(f"C({n}, {budget}) = {math.comb(n, int(budget))} subsets exceed max_subsets={max_subsets}")
    values = {s: objective(keys, np.array(s)) for s in itertools.combinations(range(n), int(budget))}
    best = min(values.values())
    return best, [s for s, v in values.items() if v <= best + tol]


def keydiff_choice(keys, budget: int, positions: Sequence[int] | None = None, **options) -> np.ndarray:
    """The tokens KeyDiff keeps: the policy's Eq. 8 scores through the shared ``select``.

    Parameters
    ----------
    keys : (n, d) array
    budget : int
    positions : sequence of int, optional
        Default ``0 .. n-1`` (they only break ties).
    **options
        Passed to :func:`refkv.policies.keydiff.anchor_scores` (``anchor_kind``, ``metric``).

    Returns
    -------
    (min(budget, n),) int64 array of kept indices, increasing.
    """
    from ..policies.base import select
    from ..policies.keydiff import anchor_scores

    keys = _matrix("keys", keys)
    n = keys.shape[0]
    pos = np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
    scores = anchor_scores(keys[None], **options)
    return select(np.asarray(scores).reshape(1, n), pos.reshape(1, n), budget)[0]


def eq9_optimality_rate(n: int, budget: int, d: int, trials: int, seed: int = 0, *, mean_shift: float = 0.0,
                        tol: float = 1e-9) -> dict:
    """How often KeyDiff's choice solves the true pairwise problem (Eq. 9): a seeded experiment.

    Keys are ``mean_shift * 1 + z`` with ``z ~ N(0, I_d)`` (``mean_shift = 0``: isotropic;
    larger: keys clustered around a common direction, as KeyDiff App. C observes in trained
    models). Each trial compares the Eq. 9 objective of KeyDiff's kept set with the minimum
    over all ``C(n, N)`` subsets.

    Returns
    -------
    dict with ``rate`` (fraction of trials where KeyDiff is optimal up to ``tol``),
    ``mean_gap`` and ``max_gap`` (Eq. 9 value of KeyDiff minus the optimum), ``mean_optimum``,
    ``mean_random_gap`` (the gap of a uniformly random subset, for scale) and the inputs.
    """
    for name, value, low in (("n", n, 2), ("budget", budget, 1), ("d", d, 1), ("trials", trials, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if budget >= n:
        raise ValueError(f"budget must be in [1, {n - 1}] (something must be evicted), got {budget}")
    rng = np.random.default_rng(seed)
    gaps, optima, random_gaps = [], [], []
    for _ in range(trials):
        keys = float(mean_shift) + rng.standard_normal((n, d))
        best, _ = brute_force_minimum(pairwise_objective, keys, budget)
        chosen = pairwise_objective(keys, keydiff_choice(keys, budget))
        rand = pairwise_objective(keys, rng.choice(n, size=budget, replace=False))
        gaps.append(chosen - best)
        optima.append(best)
        random_gaps.append(rand - best)
    gaps = np.array(gaps)
    return {"n": n, "budget": budget, "d": d, "trials": trials, "seed": seed, "mean_shift": float(mean_shift),
            "rate": float(np.mean(gaps <= tol)), "mean_gap": float(gaps.mean()), "max_gap": float(gaps.max()),
            "mean_optimum": float(np.mean(optima)), "mean_random_gap": float(np.mean(random_gaps))}


def attention_weight_of(q, k_star, keys) -> float:
    """KeyDiff Thm C.1's ``w``: the softmax weight of ``k*`` among ``{k*} U {k_i}``, logits ``k . q``."""
    q = _vector("q", q)
    k_star = _vector("k_star", k_star)
    keys = _matrix("keys", keys)
    if not q.shape[0] == k_star.shape[0] == keys.shape[1]:
        raise ValueError(f"q, k_star and keys must share the width d, got {q.shape[0]}, {k_star.shape[0]}, "
                         f"{keys.shape[1]}")
    logits = np.concatenate([[k_star @ q], keys @ q])
    return float(_softmax(logits)[0])


def c1_bound(w: float, n: int, m: float) -> float:
    """KeyDiff Thm C.1 (Lemma 3.1 of the arXiv version) as printed.

    ``(log(n / (n + 1)) - log(1 - w)) / (2 M) - 1``, claimed to be a lower bound on
    ``CosSim(k*, q)`` when ``||q|| = 1`` and every squared key norm is below ``M``.
    It is *not* a valid bound in general; see docs/theory/keydiff.rst.

    Parameters
    ----------
    w : float in (0, 1)
    n : int >= 1
        Number of other keys.
    m : float > 0
        ``M``, the bound on squared key norms.
    """
    w = check_float("w", w, 0.0, 1.0, low_open=True, high_open=True)
    n = check_int("n", n, 1)
    m = check_float("m", m, 0.0, low_open=True)
    return (math.log(n / (n + 1)) - math.log1p(-w)) / (2.0 * m) - 1.0


def c1_bound_corrected(w: float, n: int, m: float) -> float:
    """A valid version of KeyDiff Thm C.1 (derived in docs/theory/keydiff.rst).

    With ``||q|| = 1`` and ``||k||^2 < M`` for ``k*`` and every ``k_i``, the logits satisfy
    ``|k_i . q| < sqrt(M)``, so ``w / (1 - w) = exp(k* . q) / sum_i exp(k_i . q)`` gives
    ``k* . q > t := log(n w / (1 - w)) - sqrt(M)``. If ``t >= 0`` then
    ``CosSim(k*, q) > t / sqrt(M)``. If ``t < 0`` no lower bound above -1 holds in general
    (a short ``k*`` can point away from ``q``), and this function returns -1.

    Returns
    -------
    float in [-1, 1]
    """
    w = check_float("w", w, 0.0, 1.0, low_open=True, high_open=True)
    n = check_int("n", n, 1)
    m = check_float("m", m, 0.0, low_open=True)
    root = math.sqrt(m)
    t = math.log(n) + math.log(w) - math.log1p(-w) - root
    return min(t / root, 1.0) if t >= 0 else -1.0


def cosine_square_sum(basis, y) -> float:
    """KeyDiff Lemma C.2's left side: ``sum_i CosSim(x_i, y)^2`` over the rows ``x_i`` of ``basis``."""
    basis = _matrix("basis", basis)
    y = _vector("y", y)
    if basis.shape[1] != y.shape[0]:
        raise ValueError(f"basis rows and y must have the same width, got {basis.shape[1]} and {y.shape[0]}")
    ny = np.linalg.norm(y)
    nx = np.linalg.norm(basis, axis=1)
    if ny == 0 or np.any(nx == 0):
        raise ValueError("y and the basis vectors must be non-zero (the cosine of a zero vector is undefined)")
    return float(np.sum(((basis @ y) / (nx * ny)) ** 2))


def c3_bound(alpha_q: float, beta_q: float) -> float:
    """KeyDiff Thm C.3's bound: ``1 + alpha_q beta_q - alpha_q^2 / 2 - beta_q^2 / 2``.

    Claimed upper bound on ``CosSim(k-bar, k*)`` given ``alpha_q = CosSim(k-bar, q)`` and
    ``beta_q = CosSim(k*, q)``. It equals ``1 - (alpha_q - beta_q)^2 / 2``.
    """
    a, b = check_float("alpha_q", alpha_q, -1.0, 1.0), check_float("beta_q", beta_q, -1.0, 1.0)
    return 1.0 + a * b - 0.5 * a * a - 0.5 * b * b


def c3_bound_tight(alpha_q: float, beta_q: float) -> float:
    """The exact maximum of ``CosSim(k-bar, k*)`` given the two cosines to ``q`` (Cauchy-Schwarz).

    ``alpha_q beta_q + sqrt((1 - alpha_q^2)(1 - beta_q^2)) = cos(|angle(k-bar, q) - angle(k*, q)|)``,
    attained when ``k-bar``, ``k*`` and ``q`` are coplanar on the same side; it never exceeds
    :func:`c3_bound` (AM-GM), which is the step the paper's proof takes.
    """
    a, b = check_float("alpha_q", alpha_q, -1.0, 1.0), check_float("beta_q", beta_q, -1.0, 1.0)
    return a * b + math.sqrt(max(0.0, (1.0 - a * a) * (1.0 - b * b)))
