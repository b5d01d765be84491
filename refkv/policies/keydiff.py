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

import numpy as np

from .base import Policy, View, recent_tokens, register

__all__ = ["ANCHORS", "EPS", "METRICS", "KeyDiff", "anchor", "anchor_scores", "cosine", "pairwise_scores",
           "unit_keys"]

#: App. A.2.1's epsilon in the cosine denominator.
EPS = 1e-8
#: Anchor kinds of :func:`anchor` (``pairwise`` is Eq. 7, handled by :func:`pairwise_scores`).
ANCHORS = ("unit_mean", "mean", "median")
#: Metrics of :func:`anchor_scores`.
METRICS = ("cosine", "dot", "euclidean")


def _check_keys(keys) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"keys must have shape (..., n, d), got {keys.shape}")
    if not np.issubdtype(keys.dtype, np.floating):
        raise ValueError(f"keys must be a float array, got dtype {keys.dtype}")
    return keys


def cosine(a: np.ndarray, b: np.ndarray, eps: float = EPS) -> np.ndarray:
    """``a . b / max(||a|| ||b||, eps)`` over the last axis, broadcasting the others (App. A.2.1)."""
    a, b = np.asarray(a), np.asarray(b)
    dot = np.sum(a * b, axis=-1)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return dot / np.maximum(norms, eps)


def unit_keys(keys: np.ndarray, eps: float = EPS) -> np.ndarray:
    """``k / max(||k||, eps)`` per key: unit vectors, and zero for a zero key."""
    keys = np.asarray(keys)
    return keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), eps)


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
    if metric == "cosine":
        return -cosine(a, keys, eps)
    if metric == "dot":
        return -np.sum(a * keys, axis=-1)
    return np.linalg.norm(keys - a, axis=-1)


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
    norms = np.linalg.norm(keys, axis=-1)
    gram = keys @ np.swapaxes(keys, -1, -2)
    cos = gram / np.maximum(norms[..., :, None] * norms[..., None, :], eps)
    return -cos.sum(axis=-1)


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
    eps : float, default 1e-8
        Floor of the cosine denominator and of the key norms (App. A.2.1).

    Notes
    -----
    See the module docstring: Eq. 7 and Eq. 8 rank identically, zero keys score 0, the
    anchor is formed from all candidates (cache + block), the reserve only adds protection.
    """

    name = "keydiff"
    summary = "KeyDiff: keep keys least similar (cosine) to the mean unit key; attention-free"
    paper = "Park et al. 2025, KeyDiff, Eqs. 7-8, Tables 2, 3, 11; eps = 1e-8 (App. A.2.1)"
    label = "KeyDiff"
    citation = "KeyDiff (Park et al. 2025)"
    score_rule = r":math:`-\cos(k_i, \text{mean unit key})`, Eq. 8"
    protects = "--"
    implements = ("KeyDiff (Park et al. 2025): Eqs. 7-8, anchor and metric ablations (Tables 2, 3), recent reserve "
                  "(Table 11)")
    table_order = 70
    variants = ({"anchor": "pairwise"}, {"anchor": "mean"}, {"anchor": "median"}, {"metric": "dot"},
                {"metric": "euclidean"}, {"reserve": 0.25})
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
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps > 0.0 \
                or not math.isfinite(self.eps):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps!r}")

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
