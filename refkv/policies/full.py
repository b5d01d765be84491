"""``full``: never evict (the no-eviction baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from .base import Policy, View, register
from .card import PolicyCard

__all__ = ["Full"]


@register
@dataclass(frozen=True)
class Full(Policy):
    """Keep every token. With a budget the engine raises rather than exceed it silently.

    Every token is protected, so running ``full`` with a budget smaller than the
    prompt fails in :func:`refkv.policies.select` with a clear error; use
    ``budget=None`` (the default of the engine) for the unbounded baseline.
    """

    name = "full"
    card = PolicyCard(
        summary="never evict; the no-eviction baseline",
        paper="-",
        label="no eviction",
        citation="no eviction (baseline)",
        score_rule="--",
        protects="everything",
        implements="no eviction (baseline)",
        table_order=0,
    )
    forms = MappingProxyType({"paper": {"source": "no eviction (the baseline)", "proven": None}})
    evicts = False
    nonnegative_scores = True

    def score(self, view: View) -> np.ndarray:
        return np.zeros(view.positions.shape)

    def protected(self, view: View) -> np.ndarray:
        return np.ones(view.positions.shape, dtype=bool)
