"""``caote``: CAOTE and FastCAOTE (attention-output-error eviction), a meta-policy.

CAOTE turns any non-negative eviction score into an estimate of how much evicting a
token would change the attention output. With the base scores normalised to sum to 1
(CAOTE Eqs. 19-21),

.. math:: a_j = \\frac{h_j}{\\sum_i h_i}, \\qquad
          c_j = \\frac{a_j}{1 - a_j} \\, \\lVert V a - v_j \\rVert_2 ,

where :math:`V a = \\sum_i a_i v_i` plays the attention output (CAOTE Eq. 8). For
attention weights this is exact: evicting token ``j`` renormalises the others by
:math:`1/(1 - a_j)` (Theorem 3.1) and moves the output by exactly :math:`c_j` (Theorem 3.2).
FastCAOTE replaces :math:`V a` by the mean of the values (Eq. 22).

A small :math:`c_j` means evicting ``j`` barely changes the output, so the eviction score
(higher = keep) is :math:`c_j` itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from ..cache import FieldSpec
from ..model.config import ModelConfig
from .base import AttentionNeed, Policy, View, available, get, policy_class, register
from .card import PolicyCard
from .full import Full

__all__ = ["Caote", "caote_scores", "fast_caote_scores", "normalise"]


def normalise(base_scores: np.ndarray) -> np.ndarray:
    """Scale non-negative scores to sum to 1 along the last axis (CAOTE Eq. 21).

    Parameters
    ----------
    base_scores : (..., n) array
        Finite, ``>= 0``. Integer scores are converted to float64.

    Returns
    -------
    (..., n) float array, the dtype of ``base_scores`` (float64 for integers). A row
    that sums to 0 (every score 0) becomes uniform, ``1/n``: with no token preferred,
    every token carries the same weight.

    Raises
    ------
    ValueError
        If a score is negative, NaN or infinite.
    """
    scores = np.asarray(base_scores)
    if not np.issubdtype(scores.dtype, np.floating):
        scores = scores.astype(np.float64)
    if not np.all(np.isfinite(scores)):
        raise ValueError("base scores must be finite for CAOTE's normalisation")
    if scores.size and scores.min() < 0:
        raise ValueError(f"base scores must be non-negative for CAOTE (Eq. 21 divides by their sum); "
                         f"got a minimum of {float(scores.min())!r}")
    n = scores.shape[-1]
    total = scores.sum(axis=-1, keepdims=True)
    positive = total > 0
    uniform = np.full_like(scores, 1.0 / max(n, 1))
    return np.where(positive, scores / np.where(positive, total, 1.0), uniform)


def _norm(x: np.ndarray) -> np.ndarray:
    """Euclidean norm along the last axis, scaled by the largest entry first.

    Squaring tiny (or huge) float32 entries directly would underflow to 0 (or overflow
    to inf) long before the norm itself does.
    """
    scale = np.max(np.abs(x), axis=-1, keepdims=True, initial=0.0)
    unit = x / np.where(scale > 0, scale, 1.0)
    return scale[..., 0] * np.sqrt(np.sum(unit * unit, axis=-1))


def _error_scores(a: np.ndarray, values: np.ndarray, output: np.ndarray) -> np.ndarray:
    """:math:`a_j / (1 - a_j) \\lVert o - v_j \\rVert_2`, with ``+inf`` where ``a_j = 1``."""
    distance = _norm(output[..., None, :] - values)
    whole = a >= 1.0
    gain = a / np.where(whole, 1.0, 1.0 - a)
    return np.where(whole, np.inf, gain * distance)


def _common_dtype(a: np.ndarray, values: np.ndarray):
    values = np.asarray(values)
    if values.ndim < 2 or values.shape[:-1] != a.shape:
        raise ValueError(f"values must have shape {(*a.shape, 'd')}, got {values.shape}")
    dtype = np.result_type(a.dtype, values.dtype)
    return a.astype(dtype, copy=False), values.astype(dtype, copy=False)


def caote_scores(base_scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """CAOTE scores (Eqs. 8, 19-21): :math:`c_j = a_j/(1-a_j) \\lVert V a - v_j \\rVert_2`.

    Parameters
    ----------
    base_scores : (..., n) array
        A base policy's scores, finite and ``>= 0``; normalised with :func:`normalise`.
    values : (..., n, d) array

    Returns
    -------
    (..., n) array in the wider of the two dtypes (an explicit promotion: float64 scores
    with float32 values compute in float64). Lower means evicting the token changes the
    output less. Where :math:`a_j = 1` (all the mass on one token; every other
    :math:`a_i = 0`) the renormalisation of Theorem 3.1 is undefined, evicting ``j``
    would leave nothing to attend to, and :math:`c_j = +\\infty`: the token is kept.
    """
    a, values = _common_dtype(normalise(base_scores), values)
    output = np.sum(a[..., None] * values, axis=-2)  # V a
    return _error_scores(a, values, output)


def fast_caote_scores(base_scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """FastCAOTE scores (Eq. 22): :func:`caote_scores` with :math:`V a` replaced by the mean value.

    Same parameters, return value and ``a_j = 1`` rule as :func:`caote_scores`.
    """
    a, values = _common_dtype(normalise(base_scores), values)
    return _error_scores(a, values, values.mean(axis=-2))


def _build_base(base, base_params) -> Policy:
    if isinstance(base, Policy):
        if base_params:
            raise ValueError("base_params must be empty when base is a policy object")
        policy = base
    elif isinstance(base, str):
        params = {} if base_params is None else base_params
        if not isinstance(params, Mapping):
            raise ValueError(f"base_params must be a dict of parameters, got {type(params).__name__}")
        if any(not isinstance(key, str) for key in params):
            raise ValueError(f"base_params keys must be parameter names (str), got {list(params)!r}")
        policy = get(base, **params)  # ValueError naming an unknown parameter and the allowed ones
    else:
        raise ValueError(f"base must be a policy name or a Policy, got {type(base).__name__}")
    if isinstance(policy, Caote):
        raise ValueError("base must not itself be caote (its scores can be +inf, which cannot be normalised)")
    if isinstance(policy, Full):
        # full protects every token: under a budget it fails at the first eviction, and
        # without one CAOTE has nothing to score. Refused here, where the user named it.
        raise ValueError("caote: base='full' never evicts (it protects every token), so there is nothing for "
                         "CAOTE to score; choose an evicting base such as h2o, tova, snapkv or scissorhands")
    if not policy.nonnegative_scores:
        allowed = ", ".join(name for name in available() if name != "caote" and policy_class(name).evicts
                            and policy_class(name).nonnegative_scores)
        raise ValueError(f"base={policy.name!r} has signed scores (it does not declare nonnegative_scores); "
                         f"CAOTE needs non-negative base scores: one of {allowed}")
    return policy


@register
@dataclass(frozen=True)
class Caote(Policy):
    """CAOTE / FastCAOTE wrapped around a base policy (CAOTE, Eqs. 8, 19-22).

    Score of token ``j`` (higher = keep): :math:`c_j` of :func:`caote_scores` (or of
    :func:`fast_caote_scores` with ``fast=True``), computed per KV head from the base
    policy's scores and the cached values. Protected tokens, per-token state and its
    update are the base policy's.

    Parameters
    ----------
    base : str or Policy, default "h2o"
        The base policy: a registered name (built with ``base_params``) or a policy
        object. Its class must declare ``nonnegative_scores = True`` (H2O, TOVA, SnapKV,
        Scissorhands, sink, full); signed ones (KeyDiff, L2/Knorm, HashEvict, MAT) are
        refused here, and negative scores met at run time raise :class:`ValueError`.
    fast : bool, default False
        FastCAOTE (Eq. 22): the mean of the values instead of :math:`V a`.
    base_params : dict, optional
        Parameters of the base policy when ``base`` is a name. From the command line:
        ``--param base=snapkv --param "base_params={'window': 8}"``.

    Notes
    -----
    * ``needs`` is the base's plus ``"values"``; ``evict_before_attention`` is the base's.
    * **Which tokens**: the normalisation and :math:`V a` run over every token of the head
      at eviction time: the cache *and* the incoming block, protected ones included, as in
      the paper, where the scores of all :math:`b + 1` tokens (the new one too) sum to 1.
    * **Block mode**: CAOTE's derivation evicts one token at a time. With a block the
      scores are computed once and the tokens are evicted together, each scored as if it
      alone were evicted: the paper's own block-prefill setting (App. A, "Limitation").
    * **GQA**: the base scores are already per KV head (group-averaged attention); the
      values are the KV head's, so no further averaging is needed.
    * Zero-sum base scores normalise to uniform weights; :math:`a_j = 1` gives
      :math:`c_j = +\\infty` (see :func:`caote_scores`).
    * The default base is H2O, the base the paper analyses (Eq. 21, Theorem B.1).
    """

    name = "caote"
    card = PolicyCard(
        summary="CAOTE/FastCAOTE meta-policy: attention-output error of evicting each token, over a base policy",
        paper="CAOTE, Eqs. 8, 19-22 (base: h2o by default; fast=True for FastCAOTE)",
        label="CAOTE",
        citation="CAOTE (Goel et al. 2025), meta-policy",
        score_rule="attention-output change if evicted, Eq. 8, over a base's scores",
        protects="the base's",
        implements="CAOTE: Eqs. 8, 19-22 as a meta-policy over any non-negative score; FastCAOTE",
        table_order=100,
        experiment_specs=("caote:base=h2o", "caote:base=tova", "caote:base=snapkv"),
        variants=({"fast": True}, {"base": "tova"},
                  {"base": "snapkv", "base_params": {"window": 4, "kernel": 3}}),
    )
    forms = MappingProxyType({
        "paper": {"source": "Goel et al. 2025, CAOTE Eqs. 8, 19-22 (no code public)", "proven": None},
    })
    needs = frozenset({"attention", "values"})
    nonnegative_scores = True

    base: Any = "h2o"
    fast: bool = False
    base_params: Any = None

    def __post_init__(self):
        if not isinstance(self.fast, (bool, np.bool_)):
            raise ValueError(f"fast must be True or False, got {self.fast!r}")
        base = _build_base(self.base, self.base_params)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "needs", frozenset(base.needs) | {"values"})
        object.__setattr__(self, "evict_before_attention", base.evict_before_attention)

    @property
    def base_policy(self) -> Policy:
        """The wrapped policy object."""
        return self._base

    def params(self) -> dict:
        """Plain parameters: a base given as an object appears as its name and parameters,
        so ``get("caote", **policy.params())`` rebuilds the same policy (and the dict is JSON)."""
        if isinstance(self.base, Policy):
            return {"base": self._base.name, "fast": self.fast, "base_params": self._base.params()}
        return {"base": self.base, "fast": self.fast, "base_params": self.base_params}

    def check(self, budget: int, config: ModelConfig) -> None:
        self._base.check(budget, config)

    def attention_need(self) -> AttentionNeed:
        """The base's (CAOTE reads no weights of its own, only the base's scores)."""
        return self._base.attention_need()

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        return self._base.fields(config)

    def observe(self, view: View) -> dict[str, np.ndarray]:
        return self._base.observe(view)

    def score(self, view: View) -> np.ndarray:
        base_scores = self._base.score(view)
        if np.any(np.asarray(base_scores) < 0):
            raise ValueError(f"base scores of {self._base.name!r} are negative (minimum "
                             f"{float(np.min(base_scores))!r}); CAOTE needs non-negative base scores")
        rule = fast_caote_scores if self.fast else caote_scores
        return rule(base_scores, view.values)

    def protected(self, view: View) -> np.ndarray:
        return self._base.protected(view)
