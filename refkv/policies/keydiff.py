"""``keydiff``: keep the keys least similar to the cache's anchor (KeyDiff, Park et al. 2025).

KeyDiff evicts the keys most similar to the rest of the cache, keeping a geometrically
diverse set. Exact form, Eq. 7: score each key by minus its summed cosine similarity to
every key,

.. math:: s = -\\mathrm{CosSim}(K)\\,\\mathbf{1}, \\qquad \\mathrm{CosSim}(K)_{ij} =
          \\frac{\\langle k_i, k_j\\rangle}{\\lVert k_i\\rVert \\lVert k_j\\rVert},

and efficient form, Eq. 8: score by minus the cosine to the anchor
:math:`\\mu(\\hat K) = \\frac1n \\sum_i k_i / \\lVert k_i\\rVert`, the mean of the unit keys,

.. math:: s_i = -\\mathrm{CosSim}(\\mu(\\hat K), k_i), \\qquad
          \\mathrm{CosSim}(a, k) = \\frac{a \\cdot k}{\\max(\\lVert a\\rVert \\lVert k\\rVert, \\epsilon)},
          \\ \\epsilon = 10^{-8}\\ \\text{(App. A.2.1)}.

The ablations vary the anchor (Table 2: pairwise Eq. 7, median; Sec. 3.2: mean of the raw
keys) and the metric (Table 3: dot product, Euclidean distance), and Table 11 reserves a
fraction of the budget for the most recent tokens.

Notes
-----
* **Eq. 7 and Eq. 8 rank identically.** :math:`\\sum_j \\cos(k_i, k_j) = \\hat k_i \\cdot
  n\\mu(\\hat K) = n \\lVert\\mu(\\hat K)\\rVert \\cos(\\mu(\\hat K), k_i)` for nonzero keys, so
  the pairwise scores are the anchor scores times the positive constant
  :math:`n\\lVert\\mu\\rVert`: the relaxation of Sec. 3.3 is exact for the ranking (tested). The
  small differences between "Pairwise" and "KeyDiff" in Table 2 can only come from numerics
  or implementation details, not from the selection rule.
* **Self-similarity.** :func:`pairwise_scores` includes :math:`j = i` (Eq. 7 literally:
  ``CosSim(K) 1`` sums the whole row), which adds 1 to every nonzero key's sum and 0 to a
  zero key's.
* **Zero-norm keys.** Unit keys are :math:`k / \\max(\\lVert k\\rVert, \\epsilon)`, so a zero key
  contributes the zero vector to the anchor (it still counts in ``n``) and its cosine with
  anything is ``0 / eps = 0``: its cosine score is 0. If the anchor itself is zero (keys that
  cancel), every cosine score is 0 and the tie rule keeps the most recent tokens.
* **Which keys form the anchor.** All candidates of this eviction: in block prompt
  processing (KeyDiff Eq. 6) that is the cache *and* the new block, the ``C_i`` to which
  :math:`\\pi_N` is applied; the anchor is recomputed at every eviction, per KV head.
* **Metrics.** ``cosine`` (default) is scale-free; ``dot`` scores :math:`-a\\cdot k_i` and
  ``euclidean`` scores :math:`+\\lVert k_i - a\\rVert` (far from the anchor = keep), both on
  the raw keys, so they also weigh the key norms (Table 3).
* **Anchors.** ``unit_mean`` (Eq. 8, default), ``mean`` (raw keys, "can be replaced with
  µ(K)", Sec. 3.2), ``median`` (coordinate-wise median of the raw keys, Table 2),
  ``pairwise`` (Eq. 7; cosine only).
* **Reserve (Table 11).** ``reserve = X`` protects the ``floor(X * N)`` most recent tokens
  (``N`` = this eviction's budget); the remaining ``N - floor(X * N)`` places go to the
  highest KeyDiff scores. The scores are the plain KeyDiff scores over all candidates
  (the reserved tokens also shape the anchor): the reserve only adds protection.
* **GQA.** Keys are per KV head, so nothing is averaged: the query heads play no part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..validation import check_float
from .base import Policy, View, recent_tokens, register
from .card import PolicyCard

__all__ = ["ANCHORS", "EPS", "MAX_EPS", "METRICS", "KeyDiff", "anchor", "anchor_scores", "cosine", "pairwise_scores",
           "unit_keys"]

#: App. A.2.1's epsilon in the cosine denominator.
EPS = 1e-8
#: Anchor kinds of :func:`anchor` (``pairwise`` is Eq. 7, handled by :func:`pairwise_scores`).
ANCHORS = ("unit_mean", "mean", "median")
#: Metrics of :func:`anchor_scores`.
METRICS = ("cosine", "dot", "euclidean")


#: Largest ``eps`` the policy accepts: the floor must stay far below the norms it guards
#: (an ``eps`` of 1 or more would replace every unit key's norm and zero the scores).
MAX_EPS = 1e-3


def _check_keys(keys) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"keys must have shape (..., n, d), got {keys.shape}")
    if not np.issubdtype(keys.dtype, np.floating):
        raise ValueError(f"keys must be a float array, got dtype {keys.dtype}")
    if not np.isfinite(keys).all():
        raise ValueError("keys must be finite (they contain NaN or inf)")
    return keys


def _split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Write each vector (last axis) as ``x = s u`` in float64 and return ``s``, ``u``, ``||u||``.

    ``s = max |x_i|``, so ``max |u_i| = 1`` and ``1 <= ||u|| <= sqrt(d)`` (``u = 0`` for a zero
    vector): squaring ``u`` can neither overflow nor lose the vector to underflow, whatever
    the magnitude or precision of ``x`` (float16 keys of 1e-5, float64 keys of 1e200). The
    norm is ``s ||u||``; dot products are ``s_a s_b (u_a . u_b)``. Shapes: ``s`` and ``||u||``
    keep a trailing axis of 1.
    """
    x = np.asarray(x, dtype=np.float64)
    s = np.max(np.abs(x), axis=-1, keepdims=True)
    u = np.divide(x, s, out=np.zeros_like(x), where=s > 0)
    return s, u, np.sqrt(np.sum(u * u, axis=-1, keepdims=True))


def _floored_ratio(dot_u: np.ndarray, scale: np.ndarray, norm_u: np.ndarray, eps: float) -> np.ndarray:
    """``dot / max(norms, eps)`` where ``dot = scale * dot_u`` and ``norms = scale * norm_u``.

    Where the norms clear the floor the scales cancel and the ratio is ``dot_u / norm_u``
    (no overflow); below it the ratio is ``scale * dot_u / eps``, a product that is then
    below ``eps`` and cannot overflow either.
    """
    eps = check_float("eps", eps, 0.0, MAX_EPS, low_open=True)  # every public function comes here
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        clear = scale * norm_u >= eps  # an overflow to inf still compares right
        small = scale * dot_u / eps    # only read where it is below eps: no overflow there
    big = np.divide(dot_u, norm_u, out=np.zeros_like(dot_u), where=clear & (norm_u > 0))
    return np.where(clear, big, small)


def cosine(a: np.ndarray, b: np.ndarray, eps: float = EPS) -> np.ndarray:
    """``a . b / max(||a|| ||b||, eps)`` over the last axis, broadcasting the others (App. A.2.1).

    Computed from scaled vectors (:func:`_split`) in float64, so neither the dot product
    nor the norms overflow or underflow; returned in the inputs' common dtype.
    """
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a, b)
    sa, ua, na = _split(a)
    sb, ub, nb = _split(b)
    dot_u = np.sum(ua * ub, axis=-1)
    with np.errstate(over="ignore", under="ignore"):
        scale = (sa * sb)[..., 0]
    return _floored_ratio(dot_u, scale, (na * nb)[..., 0], eps).astype(dtype, copy=False)


def unit_keys(keys: np.ndarray, eps: float = EPS) -> np.ndarray:
    """``k / max(||k||, eps)`` per key: unit vectors, and zero for a zero key.

    The norm is computed without overflow or underflow (:func:`_split`); the result has
    the keys' dtype.
    """
    keys = np.asarray(keys)
    s, u, nu = _split(keys)
    # k / max(||k||, eps) = s u / max(s ||u||, eps): scales cancel above the floor.
    return _floored_ratio(u, s, nu, eps).astype(keys.dtype, copy=False)


def anchor(keys: np.ndarray, kind: str = "unit_mean", eps: float = EPS) -> np.ndarray:
    """The anchor vector of each set of keys.

    Parameters
    ----------
    keys : (..., n, d) float array
    kind : {"unit_mean", "mean", "median"}
        ``unit_mean``: mean of the unit keys, :math:`\\mu(\\hat K)` (Eq. 8). ``mean``: mean of
        the raw keys, :math:`\\mu(K)`. ``median``: coordinate-wise median of the raw keys.
    eps : float
        Floor of the key norms when normalising (a zero key contributes zero).

    Returns
    -------
    (..., d) array of the keys' dtype
    """
    keys = _check_keys(keys)
    if keys.shape[-2] < 1:
        raise ValueError("keys must hold at least one key to form an anchor")
    if kind == "unit_mean":
        return unit_keys(keys, eps).mean(axis=-2)
    if kind == "mean":
        return keys.mean(axis=-2)
    if kind == "median":
        return np.median(keys, axis=-2)
    raise ValueError(f"anchor kind must be one of {', '.join(ANCHORS)}, got {kind!r}")


def anchor_scores(keys: np.ndarray, anchor_kind: str = "unit_mean", metric: str = "cosine",
                  eps: float = EPS) -> np.ndarray:
    """KeyDiff eviction scores against an anchor (Eq. 8 and its variants); higher = keep.

    Parameters
    ----------
    keys : (..., n, d) float array
    anchor_kind : {"unit_mean", "mean", "median"}
        See :func:`anchor`.
    metric : {"cosine", "dot", "euclidean"}
        ``cosine``: :math:`-\\cos(a, k_i)` with the ``eps`` floor. ``dot``: :math:`-a \\cdot k_i`.
        ``euclidean``: :math:`+\\lVert k_i - a\\rVert`.
    eps : float

    Returns
    -------
    (..., n) array of the keys' dtype
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    keys = _check_keys(keys)
    a = anchor(keys, anchor_kind, eps)[..., None, :]
    if not np.isfinite(a).all():
        raise ValueError(f"the {anchor_kind!r} anchor of these keys overflows {keys.dtype}; "
                         f"use anchor='unit_mean' (scale-free)")
    if metric == "cosine":
        return -cosine(a, keys, eps)
    with np.errstate(over="ignore", invalid="ignore"):
        if metric == "dot":
            scores = -np.sum(a * keys, axis=-1)
        else:
            scores = np.linalg.norm(keys - a, axis=-1)
    if not np.isfinite(scores).all():
        raise ValueError(f"metric={metric!r} scores overflow {keys.dtype} for keys of magnitude "
                         f"{float(np.abs(keys).max()):.3g}; use metric='cosine' (scale-free)")
    return scores


def pairwise_scores(keys: np.ndarray, eps: float = EPS) -> np.ndarray:
    """Eq. 7: :math:`-\\mathrm{CosSim}(K)\\,\\mathbf 1`, minus each key's summed cosine to every key.

    Self-similarity is included (the row sum of the full matrix), as Eq. 7 is written.
    ``O(n^2 d)``: the reference the anchor form (Eq. 8) is checked against.

    Parameters
    ----------
    keys : (..., n, d) float array
    eps : float

    Returns
    -------
    (..., n) array of the keys' dtype
    """
    keys = _check_keys(keys)
    s, u, nu = _split(keys)                                  # (..., n, 1), (..., n, d), (..., n, 1)
    gram_u = u @ np.swapaxes(u, -1, -2)                      # (..., n, n)
    with np.errstate(over="ignore", under="ignore"):
        scale = s * np.swapaxes(s, -1, -2)                   # s_i s_j
    cos = _floored_ratio(gram_u, scale, nu * np.swapaxes(nu, -1, -2), eps)
    return (-cos.sum(axis=-1)).astype(keys.dtype, copy=False)


@register
@dataclass(frozen=True)
class KeyDiff(Policy):
    """KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"), Eqs. 7-8.

    Keeps, per KV head, the ``N`` candidates (cache + block) with the highest score
    ``-cos(anchor, k_i)``: the keys least aligned with the mean unit key. Attention-free:
    it reads only the keys (and positions, for the reserve and the tie rule).

    Parameters
    ----------
    anchor : {"unit_mean", "mean", "median", "pairwise"}, default "unit_mean"
        The anchor (Eq. 8, Sec. 3.2, Table 2); ``pairwise`` is Eq. 7 (cosine only).
    metric : {"cosine", "dot", "euclidean"}, default "cosine"
        Table 3's similarity metrics.
    reserve : float in [0, 1), default 0.0
        Fraction of the budget kept for the most recent tokens (Table 11): ``floor(reserve *
        N)`` tokens are protected.
    eps : float in (0, 1e-3], default 1e-8
        Floor of the cosine denominator and of the key norms (App. A.2.1).

    Notes
    -----
    See the module docstring: Eq. 7 and Eq. 8 rank identically, zero keys score 0, the
    anchor is formed from all candidates (cache + block), the reserve only adds protection.
    """

    name = "keydiff"
    card = PolicyCard(
        summary="KeyDiff: keep keys least similar (cosine) to the mean unit key; attention-free",
        paper="Park et al. 2025, KeyDiff, Eqs. 7-8, Tables 2, 3, 11; eps = 1e-8 (App. A.2.1)",
        label="KeyDiff",
        citation="KeyDiff (Park et al. 2025)",
        score_rule=r":math:`-\cos(k_i, \text{mean unit key})`, Eq. 8",
        protects="--",
        implements=("KeyDiff (Park et al. 2025): Eqs. 7-8, anchor and metric ablations (Tables 2, 3), recent reserve "
                    "(Table 11)"),
        table_order=70,
        variants=({"anchor": "pairwise"}, {"anchor": "mean"}, {"anchor": "median"}, {"metric": "dot"},
                  {"metric": "euclidean"}, {"reserve": 0.25}),
    )
    forms = MappingProxyType({
        "paper": {"source": "Park et al. 2025, KeyDiff Eq. 8, block mode (no authors' code public)", "proven": None},
        "kvpress": {"source": "kvpress 0.5.5 KeyDiffPress (third-party; = paper form's score)",
                    "proven": "tests/interop/test_interop_kvpress.py"},
    })
    needs = frozenset({"keys", "positions"})

    anchor: str = "unit_mean"
    metric: str = "cosine"
    reserve: float = 0.0
    eps: float = EPS

    def __post_init__(self):
        kinds = (*ANCHORS, "pairwise")
        if self.anchor not in kinds:
            raise ValueError(f"anchor must be one of {', '.join(kinds)}, got {self.anchor!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if self.anchor == "pairwise" and self.metric != "cosine":
            raise ValueError(f"anchor='pairwise' is Eq. 7, defined with metric='cosine'; got metric={self.metric!r}")
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, (int, float)) \
                or not 0.0 <= self.reserve < 1.0:
            raise ValueError(f"reserve must be a number in [0, 1), got {self.reserve!r}")
        check_float("eps", self.eps, 0.0, MAX_EPS, low_open=True)

    def reserved(self, budget: int) -> int:
        """Tokens protected as recent when ``budget`` tokens are kept: ``floor(reserve * budget)``.

        Always ``< budget`` since ``reserve < 1``, so the reserve fits in any budget.
        """
        return math.floor(float(self.reserve) * budget)

    def score(self, view: View) -> np.ndarray:
        eps = float(self.eps)
        if self.anchor == "pairwise":
            return pairwise_scores(view.keys, eps)
        return anchor_scores(view.keys, self.anchor, self.metric, eps)

    def protected(self, view: View) -> np.ndarray:
        return recent_tokens(view, self.reserved(view.keep))
