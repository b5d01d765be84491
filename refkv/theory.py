"""The quantities the seed papers' theorems speak of, computed the slow, literal way.

The policies compute closed forms (CAOTE Eq. 8, KeyDiff Eq. 8, ...); this module computes
what those closed forms claim to equal or to optimise, by an independent route, so that the
tests in ``tests/test_theory_*.py`` can compare the two. Nothing here is used by the engine.

CAOTE (Goel et al., "CAOTE: KV Caching through Attention Output-Based Token Eviction")
    :func:`attention_output` (Eqs. 10-11), :func:`attention_after_eviction` (Thm 3.1:
    softmax recomputed without token ``j``),
    :func:`eviction_errors` (Eq. 9: ``||X_attn - X'_attn,j||`` by recomputing attention),
    :func:`attention_only_logits` (App. B.2 case 1: a one-layer decoder without norms).
KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction ...")
    :func:`unit_rows`, :func:`cosine_matrix`, :func:`pairwise_cosine_sums` (Eq. 7), :func:`pairwise_objective`
    (Eq. 9), :func:`relaxed_objective` (Eq. 10), :func:`brute_force_minimum`,
    :func:`keydiff_choice`, :func:`eq9_optimality_rate`, :func:`attention_weight_of`,
    :func:`c1_bound` and :func:`c1_bound_corrected` (Thm C.1 / Lemma 3.1),
    :func:`cosine_square_sum` (Lemma C.2), :func:`c3_bound` and :func:`c3_bound_tight`
    (Thm C.3).
HashEvict (Eq. 3, the SimHash collision law of Goemans and Williamson / Charikar)
    :func:`angle_fraction`, :func:`hamming_fraction_moments`, :func:`hoeffding_radius`,
    :func:`bernstein_radius`.

Notes
-----
* Cosines here are the exact ``<a, b> / (||a|| ||b||)``: a zero vector is a ValueError, not
  the policies' ``max(||a|| ||b||, eps)`` convention (KeyDiff App. A.2.1), because the
  theorems are statements about real cosines.
* KeyDiff's App. C models an attention logit as ``k . q`` with no ``1 / sqrt(d)`` (the scale is
  absorbed into the norm bound ``M``); :func:`attention_weight_of` follows it.
* Every function works in the dtype of its input where that makes sense; the brute-force and
  statistical helpers work in float64.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "AttentionOnlyOutput",
    "angle_fraction",
    "attention_after_eviction",
    "attention_only_logits",
    "attention_output",
    "attention_weight_of",
    "bernstein_radius",
    "brute_force_minimum",
    "c1_bound",
    "c1_bound_corrected",
    "c3_bound",
    "c3_bound_tight",
    "cosine_matrix",
    "cosine_square_sum",
    "eq9_optimality_rate",
    "eviction_errors",
    "hamming_fraction_moments",
    "hoeffding_radius",
    "keydiff_choice",
    "pairwise_cosine_sums",
    "pairwise_objective",
    "relaxed_objective",
    "unit_rows",
]


# ------------------------------------------------------------------------------------
# validation helpers
# ------------------------------------------------------------------------------------
def _vector(name: str, x, min_len: int = 1) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 1 or x.shape[0] < min_len:
        raise ValueError(f"{name} must be a 1-D array with at least {min_len} entries, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return x


def _matrix(name: str, x, min_rows: int = 1) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] < min_rows or x.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D (n, d) array with n >= {min_rows} and d >= 1, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return x


def _subset(name: str, subset, n: int) -> np.ndarray:
    idx = np.asarray(subset)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D sequence of integer indices, got {subset!r}")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"{name} indices must be in [0, {n - 1}], got {subset!r}")
    if np.unique(idx).size != idx.size:
        raise ValueError(f"{name} must not repeat an index, got {subset!r}")
    return idx


def _index(name: str, j, n: int) -> int:
    if isinstance(j, bool) or not isinstance(j, (int, np.integer)) or not 0 <= j < n:
        raise ValueError(f"{name} must be an integer in [0, {n - 1}], got {j!r}")
    return int(j)


def _probability(name: str, p, *, open_low: bool = True, open_high: bool = True) -> float:
    p = float(p)
    low_ok = p > 0.0 if open_low else p >= 0.0
    high_ok = p < 1.0 if open_high else p <= 1.0
    if not (low_ok and high_ok):
        lo, hi = "(0" if open_low else "[0", "1)" if open_high else "1]"
        raise ValueError(f"{name} must be in {lo}, {hi}, got {p!r}")
    return p


def _norm(x: np.ndarray) -> float:
    """Euclidean norm scaled by the largest entry, so squares neither underflow nor overflow."""
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    if scale == 0.0:
        return 0.0
    return scale * float(np.sqrt(np.sum(np.square(x / scale))))


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - np.max(logits))
    return e / np.sum(e)


# ------------------------------------------------------------------------------------
# CAOTE
# ------------------------------------------------------------------------------------
def attention_output(logits, values, keep=None) -> np.ndarray:
    """Attention output of one query: ``softmax(logits[keep]) @ values[keep]``.

    Parameters
    ----------
    logits : (n,) array
        The query's attention logits over the ``n`` cached tokens.
    values : (n, d) array
    keep : sequence of int, optional
        Tokens that remain; default all. The softmax is recomputed over them alone, which
        is what a cache without the other tokens would do.

    Returns
    -------
    (d,) array: CAOTE Eq. 10 (``keep`` = all) or Eq. 11 (``keep`` = all but ``j``).
    """
    logits = _vector("logits", logits)
    values = _matrix("values", values)
    if values.shape[0] != logits.shape[0]:
        raise ValueError(f"values must have {logits.shape[0]} rows (one per logit), got {values.shape[0]}")
    if keep is None:
        return _softmax(logits) @ values
    idx = _subset("keep", keep, logits.shape[0])
    if idx.size == 0:
        raise ValueError("keep must hold at least one token (attention over nothing is undefined)")
    return _softmax(logits[idx]) @ values[idx]


def attention_after_eviction(logits, j) -> np.ndarray:
    """Attention weights after token ``j`` leaves the cache, recomputed from the logits.

    CAOTE Thm 3.1 states that they equal ``a_i / (1 - a_j)`` with ``a = softmax(logits)``;
    this function does not use that formula: it takes the softmax of the remaining logits.

    Parameters
    ----------
    logits : (n,) array, n >= 2
    j : int
        The evicted token.

    Returns
    -------
    (n,) array with entry ``j`` set to 0 and the others summing to 1.
    """
    logits = _vector("logits", logits, min_len=2)
    j = _index("j", j, logits.shape[0])
    rest = np.delete(np.arange(logits.shape[0]), j)
    out = np.zeros_like(logits)
    out[rest] = _softmax(logits[rest])
    return out


def eviction_errors(logits, values) -> np.ndarray:
    """CAOTE Eq. 9 for every token: ``e_j = ||X_attn - X'_attn,j||_2``, by recomputation.

    ``X_attn`` is the attention output with all ``n`` tokens (Eq. 10), ``X'_attn,j`` the output
    of attention recomputed over the cache without token ``j`` (Eq. 11). Thm 3.2 claims
    ``e_j`` equals the closed-form CAOTE score (Eq. 8).

    Parameters
    ----------
    logits : (n,) array, n >= 2
        One query's logits over the cache (the last token's, during generation).
    values : (n, d) array

    Returns
    -------
    (n,) array of float

    Notes
    -----
    Recomputation subtracts two nearly equal vectors when ``a_j`` is tiny, so its absolute
    error is about ``eps * max_i ||v_i||`` whatever ``e_j`` is; compare against it with an
    absolute tolerance of that size. The norm is scaled by the largest entry, so values as
    small as 1e-300 do not underflow when squared.
    """
    logits = _vector("logits", logits, min_len=2)
    values = _matrix("values", values)
    n = logits.shape[0]
    full = attention_output(logits, values)
    return np.array([_norm(full - attention_output(logits, values, np.delete(np.arange(n), j)))
                     for j in range(n)], dtype=full.dtype)


class AttentionOnlyOutput(NamedTuple):
    """What :func:`attention_only_logits` returns (shapes for ``H`` query heads, ``Hkv`` KV heads).

    Attributes
    ----------
    logits : (vocab,)
        Logits of the last token.
    head_outputs : (H, d)
        The last token's per-head attention outputs ``X_A`` (before ``W_O``).
    weights : (H, m)
        The last token's attention weights over the ``m`` tokens it attended to.
    values : (Hkv, m, d)
        Their values.
    """

    logits: np.ndarray
    head_outputs: np.ndarray
    weights: np.ndarray
    values: np.ndarray


def attention_only_logits(model, tokens, evict: int | None = None) -> AttentionOnlyOutput:
    """Last-token logits of a one-layer decoder *without norms and without MLP* (CAOTE App. B.2).

    Built from refkv's decoder pieces: the model's embedding, its layer-0 projections
    ``W_Q, W_K, W_V, W_O``, RoPE (:meth:`refkv.model.Model.rope`), causal attention
    (:func:`refkv.attention.attend`) and the LM head ``W_H`` (tied embedding or
    ``lm_head``). The RMSNorms and the MLP are skipped, which is the paper's case 1
    (one head) and case 2 (several heads):

    .. math:: l_{b+1} = W_H \\left(x_{b+1} + W_O X_{A,b+1}\\right)

    (written here with row vectors: ``(x + o W_O) W_H``).

    Parameters
    ----------
    model : refkv.model.Model
        Must have ``n_layers == 1``.
    tokens : sequence of int
        The ``b + 1`` tokens; the last one is the query.
    evict : int, optional
        Column removed from every KV head's cache before the last token attends (it may be
        the last token itself). ``None`` attends to all ``b + 1``.

    Returns
    -------
    AttentionOnlyOutput
    """
    from .attention import attend
    from .model.layers import apply_rope

    cfg = model.config
    if cfg.n_layers != 1:
        raise ValueError(f"model must have exactly one layer (CAOTE App. B.2 case 1/2), got n_layers={cfg.n_layers}")
    tokens = model.check_tokens(tokens)
    t = len(tokens)
    positions = np.arange(t, dtype=np.int64)
    lw = model.weights.layers[0]
    x = model.embed(tokens)  # no attention norm: the paper ignores layer norms
    cos, sin = model.rope(positions)

    def heads(h, count):
        return h.reshape(t, count, cfg.d_head).transpose(1, 0, 2)

    q = apply_rope(heads(x @ lw.wq, cfg.n_heads), cos, sin)
    k = apply_rope(heads(x @ lw.wk, cfg.n_kv_heads), cos, sin)
    v = heads(x @ lw.wv, cfg.n_kv_heads)
    keep = np.arange(t)
    if evict is not None:
        keep = np.delete(keep, _index("evict", evict, t))
    k_pos = np.broadcast_to(positions[keep], (cfg.n_kv_heads, keep.size))
    out, weights = attend(q[:, -1:], k[:, keep], v[:, keep], positions[-1:], k_pos, return_weights=True)
    w_h = model.weights.embed.T if model.weights.lm_head is None else model.weights.lm_head
    logits = (x[-1:] + model.attn_out(0, out)) @ w_h  # no final norm either
    return AttentionOnlyOutput(logits[0], out[:, 0], weights.reshape(cfg.n_heads, keep.size), v[:, keep])


# ------------------------------------------------------------------------------------
# KeyDiff
# ------------------------------------------------------------------------------------
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
    from .policies.base import select
    from .policies.keydiff import anchor_scores

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
    w = _probability("w", w)
    n = _count("n", n)
    m = _positive("m", m)
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
    w = _probability("w", w)
    n = _count("n", n)
    m = _positive("m", m)
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
    a, b = _cosine_value("alpha_q", alpha_q), _cosine_value("beta_q", beta_q)
    return 1.0 + a * b - 0.5 * a * a - 0.5 * b * b


def c3_bound_tight(alpha_q: float, beta_q: float) -> float:
    """The exact maximum of ``CosSim(k-bar, k*)`` given the two cosines to ``q`` (Cauchy-Schwarz).

    ``alpha_q beta_q + sqrt((1 - alpha_q^2)(1 - beta_q^2)) = cos(|angle(k-bar, q) - angle(k*, q)|)``,
    attained when ``k-bar``, ``k*`` and ``q`` are coplanar on the same side; it never exceeds
    :func:`c3_bound` (AM-GM), which is the step the paper's proof takes.
    """
    a, b = _cosine_value("alpha_q", alpha_q), _cosine_value("beta_q", beta_q)
    return a * b + math.sqrt(max(0.0, (1.0 - a * a) * (1.0 - b * b)))


def _count(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    return int(n)


def _positive(name: str, x) -> float:
    x = float(x)
    if not (x > 0.0 and math.isfinite(x)):
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return x


def _cosine_value(name: str, x) -> float:
    x = float(x)
    if not -1.0 <= x <= 1.0:
        raise ValueError(f"{name} must be a cosine in [-1, 1], got {x!r}")
    return x


# ------------------------------------------------------------------------------------
# SimHash (HashEvict Eq. 3)
# ------------------------------------------------------------------------------------
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
    p = _probability("p", p, open_low=False, open_high=False)
    c = _count("c", c)
    pq = p * (1.0 - p)
    return p, pq / c, pq * (1.0 + 3.0 * (c - 2) * pq) / c ** 3


def hoeffding_radius(n: int, delta: float, span: float = 1.0) -> float:
    """Hoeffding: the mean of ``n`` independent draws in an interval of width ``span`` is within
    ``span * sqrt(ln(2 / delta) / (2 n))`` of its expectation with probability at least ``1 - delta``."""
    n = _count("n", n)
    delta = _probability("delta", delta)
    span = _positive("span", span)
    return span * math.sqrt(math.log(2.0 / delta) / (2.0 * n))


def bernstein_radius(n: int, delta: float, variance: float, span: float) -> float:
    """Bernstein: the mean of ``n`` independent draws with variance ``<= variance`` and
    ``|X - E X| <= span`` is within ``sqrt(2 variance L / n) + 2 span L / (3 n)``, ``L = ln(2 / delta)``,
    of its expectation with probability at least ``1 - delta``."""
    n = _count("n", n)
    delta = _probability("delta", delta)
    span = _positive("span", span)
    variance = float(variance)
    if not (variance >= 0.0 and math.isfinite(variance)):
        raise ValueError(f"variance must be a finite number >= 0, got {variance!r}")
    log_term = math.log(2.0 / delta)
    return math.sqrt(2.0 * variance * log_term / n) + 2.0 * span * log_term / (3.0 * n)
