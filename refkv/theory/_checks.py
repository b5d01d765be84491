"""Array checks and the deliberately independent softmax and norm the theory modules share.

The theory modules recompute what the policies compute in closed form, by another route;
so they do not borrow the library's softmax (:func:`refkv.attention.softmax`) or norms, and
keep these few lines of their own. Scalar parameters are checked with
:mod:`refkv.validation`, like everywhere else.
"""

from __future__ import annotations

import numpy as np

from ..validation import check_float, check_int

__all__ = ["check_float", "check_int"]


def _finite_float(name: str, x: np.ndarray) -> np.ndarray:
    """``x`` as floats (integers become float64), refusing NaN and inf."""
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return x


def _vector(name: str, x, min_len: int = 1) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 1 or x.shape[0] < min_len:
        raise ValueError(f"{name} must be a 1-D array with at least {min_len} entries, got shape {x.shape}")
    return _finite_float(name, x)


def _matrix(name: str, x, min_rows: int = 1) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] < min_rows or x.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D (n, d) array with n >= {min_rows} and d >= 1, got shape {x.shape}")
    return _finite_float(name, x)


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


def _norm(x: np.ndarray) -> float:
    """Euclidean norm scaled by the largest entry, so squares neither underflow nor overflow."""
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    if scale == 0.0:
        return 0.0
    return scale * float(np.sqrt(np.sum(np.square(x / scale))))


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - np.max(logits))
    return e / np.sum(e)
