"""``refkv.model.load``: one entry point for every model refkv can run."""

from __future__ import annotations

import numpy as np

from .config import TINY
from .decoder import Model
from .weights import random_weights

__all__ = ["builtin_model", "load"]


def builtin_model(seed: int = 0, dtype=np.float64) -> Model:
    """The built-in ``tiny`` model (:data:`refkv.model.TINY`) with seeded random weights."""
    return Model(TINY, random_weights(TINY, seed=seed, dtype=dtype))


def load(name: str = "tiny", *, dtype=None, seed: int = 0) -> Model:
    """Load a model by name.

    Parameters
    ----------
    name : str
        ``"tiny"``: the built-in random model (no download, runs anywhere).
    dtype : float32 or float64, optional
        Default float64 for ``tiny`` (a reference computation).
    seed : int
        Seed of the random weights of ``tiny``.
    """
    if name == "tiny":
        return builtin_model(seed=seed, dtype=np.float64 if dtype is None else dtype)
    raise ValueError(f"unknown model {name!r}; known: 'tiny'")
