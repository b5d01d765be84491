"""``mat``: Managing Anchor Tokens (MAT, Algorithm 1, Eqs. 3-5).

MAT observes that in deep layers a few *anchor* tokens draw large attention logits from
everything after them, while the logits *between* anchors are low (its Sec. 3.1). The first
token is always an anchor, so a token whose own query gives the first key a low logit is
likely an anchor too. Each token's logit to the first key is stored when the token is
processed (Eq. 3):

.. math:: \\pi_i = \\frac{q_i^\\top k_0}{\\sqrt d}, \\qquad \\mathcal A = \\{\\pi_i\\}.

The cache of a **deep** layer holds an anchor cache of ``β`` tokens, which always contains
the first token, and a window of the last ``N - β``. When a token arrives at a full cache,
the token leaving the window joins the anchor candidates and the candidate with the highest
logit is evicted (Eq. 4, with the cache indexed from 0 and index 0 the first token):

.. math:: r = \\arg\\max_{1 \\le i \\le \\beta} \\pi_i, \\qquad
          K \\leftarrow [K_{:,-r}, k_t],\\ V \\leftarrow [V_{:,-r}, v_t],\\
          \\mathcal A \\leftarrow \\mathcal A_{-r} \\cup \\{\\pi_t\\}.

A **shallow** layer (diffuse attention, Sec. 3.2) keeps StreamingLLM's first ``s`` tokens and
moves the window (Eq. 5: evict index ``s``).

**Closed form.** Repeating Eq. 4 keeps, of every token that has left the window, the
``β - 1`` with the lowest logits (removing the maximum of a set each time a new element
arrives keeps the smallest ones). So a deep layer holds

* the first token,
* the last ``N - β`` tokens,
* the ``β - 1`` tokens of lowest :math:`\\pi` among the rest,

which is what :class:`MAT` selects: score :math:`-\\pi_i`, protected = first token + window.
:func:`streaming_keep` simulates Eq. 4 literally and a test shows it equals
:func:`closed_form_keep`.

Notes
-----
* **Sizes.** The anchor cache has ``β`` places *including the first token* ("it is always
  kept in the anchor cache"; Fig. 3 keeps "Bottom-β ... anchor tokens, and ... the last
  c - β"), which is why ``argmax`` ranges over indices ``1..β`` of a 0-indexed cache: the
  ``β - 1`` other anchors plus the token just pushed out of the window. Deep layers thus
  keep ``1 + (β - 1) + (N - β) = N``.
* **Defaults.** ``L_s = 2`` shallow layers (Alg. 1's "#shallow layers"; the paper shows
  layers 0 and 1 as diffuse), so layers ``0 .. L_s - 1`` are shallow and the paper's
  ``l <= L_s`` is read with 1-based layers. ``β = max(1, N // 4)`` (the paper grid-searches β
  and finds ``β`` in [32, 96] equally good at ``c = 256``). ``s = 4`` (StreamingLLM's
  sinks; the paper's figure uses 2). ``L_s = 0`` is the paper's "MAT (w. anchor)",
  ``L_s = n_layers`` its "MAT (w. sink)", i.e. StreamingLLM.
* **Before attention.** Eq. 4 updates the cache and the token then attends over the
  updated cache (Sec. 4.1), so ``evict_before_attention = True``: the engine evicts to
  ``N - B`` before a block of ``B`` is appended. The window then covers the block and
  the last ``N - β - B`` cached tokens. With ``B <= N - β`` every eviction keeps the same
  set as the token-by-token Eq. 4 (tested); with ``B > N - β`` (an extension) the block
  alone fills the window and the anchor cache shrinks to ``N - B - 1`` tokens for that
  step. ``B <= N - 1`` is needed so that the first token stays.
* **GQA.** Eq. 3 has one query per token; with GQA refkv stores for each KV head the mean
  of the logits of its ``g`` query heads, :math:`\\pi_i = \\frac1g \\sum_h q_{h,i} \\cdot
  k_0 / \\sqrt d` (the KV-group average every attention-based score uses).
* **Queries and keys** are the ones attention uses: after RoPE at their positions, so
  :math:`\\pi_i` is exactly the attention logit of token ``i`` to token 0.
* **Ties.** Equal logits keep the more recent token, i.e. ``argmax`` evicts the oldest of the
  tied candidates (the first index, as ``torch.argmax`` returns).
* **State.** :math:`\\pi` is the per-token cache field ``mat_logit`` (float64), written for
  the block's tokens after they attend; it is NaN in shallow layers, which never read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..cache import FieldSpec
from ..model.config import ModelConfig
from .base import Policy, View, check_int, first_tokens, recent_tokens, register, select
from .card import PolicyCard

__all__ = ["LOGIT_FIELD", "MAT", "anchor_logits", "closed_form_keep", "default_beta", "streaming_keep"]

#: Name of the cache field holding each token's logit to the first key.
LOGIT_FIELD = "mat_logit"


def anchor_logits(queries: np.ndarray, first_key: np.ndarray) -> np.ndarray:
    """Eq. 3: :math:`\\pi_i = q_i \\cdot k_0 / \\sqrt d`.

    Parameters
    ----------
    queries : (..., n, d)
    first_key : (..., d)
        The first token's key, broadcast against the leading axes of ``queries``.

    Returns
    -------
    (..., n) array
    """
    queries, first_key = np.asarray(queries), np.asarray(first_key)
    if queries.ndim < 2 or first_key.ndim < 1 or queries.shape[-1] != first_key.shape[-1]:
        raise ValueError(f"queries (..., n, d) and first_key (..., d) must share d, got {queries.shape} "
                         f"and {first_key.shape}")
    d = queries.shape[-1]
    return (queries @ first_key[..., :, None])[..., 0] * (1.0 / math.sqrt(d))


def default_beta(budget: int) -> int:
    """``β = max(1, N // 4)``: the anchor cache size used when ``beta`` is not given."""
    return max(1, budget // 4)


def _check_sizes(budget, beta) -> None:
    check_int("budget", budget, 2)
    check_int("beta", beta, 1, budget - 1)


def _as_rows(pi, positions):
    pi, positions = np.asarray(pi), np.asarray(positions)
    if pi.shape != positions.shape or pi.ndim not in (1, 2):
        raise ValueError(f"pi and positions must have the same shape (n,) or (rows, n), got {pi.shape} "
                         f"and {positions.shape}")
    if np.isnan(pi).any():
        raise ValueError("pi contains NaN")
    if pi.ndim == 1:
        return pi[None], positions[None], True
    return pi, positions, False


def closed_form_keep(pi: np.ndarray, positions: np.ndarray, budget: int, beta: int) -> np.ndarray:
    """Deep-layer MAT as one selection: first token + last ``N - β`` + ``β - 1`` lowest ``π``.

    Parameters
    ----------
    pi : (n,) or (rows, n) float
        The logits of the tokens, in position order.
    positions : same shape, int
        Their positions, increasing; the first token is the one at position 0.
    budget : int
        ``N >= 2``.
    beta : int
        Anchor cache size, ``1 <= β <= N - 1``.

    Returns
    -------
    Kept column indices, increasing: (min(N, n),) or (rows, min(N, n)).
    """
    _check_sizes(budget, beta)
    pi, positions, flat = _as_rows(pi, positions)
    protected = (positions == 0)
    if budget - beta > 0:
        protected[:, -(budget - beta):] = True
    kept = select(-pi.astype(np.float64), positions, budget, protected)
    return kept[0] if flat else kept


def streaming_keep(pi: np.ndarray, positions: np.ndarray, budget: int, beta: int) -> np.ndarray:
    """Algorithm 1 (deep layer) token by token, literally: Eq. 4's ``argmax`` eviction.

    The tokens arrive in column order. While the cache holds fewer than ``N`` they are
    appended; afterwards, for each arriving token, the candidate ``r = argmax_{1 <= i <= β}
    π_i`` of the 0-indexed cache is deleted (the first index among equal maxima) and the
    token appended.

    Parameters and returns as :func:`closed_form_keep`; ``positions`` must put the first
    token (position 0) in column 0.
    """
    _check_sizes(budget, beta)
    pi, positions, flat = _as_rows(pi, positions)
    rows = []
    for row_pi, row_pos in zip(pi, positions):
        if len(row_pos) and row_pos[0] != 0:
            raise ValueError("streaming_keep expects the first token (position 0) in column 0")
        cache: list[int] = []
        for token in range(len(row_pi)):
            if len(cache) == budget:
                candidates = cache[1:beta + 1]
                values = [row_pi[c] for c in candidates]
                r = values.index(max(values))  # first index of the maximum: the oldest tied candidate
                del cache[1 + r]
            cache.append(token)
        rows.append(cache)
    kept = np.array(rows, dtype=np.int64).reshape(len(rows), -1)
    return kept[0] if flat else kept


@register
@dataclass(frozen=True)
class MAT(Policy):
    """MAT ("Unlocking KV Cache Efficiency via Managing Anchor Tokens"), Algorithm 1, Eqs. 3-5.

    Deep layers (``layer >= shallow_layers``) keep the first token, the last ``N - β``
    tokens and the ``β - 1`` others of lowest logit to the first key; shallow layers keep
    the first ``sink`` tokens and the last ``N - sink``. Evicts before attention.

    Parameters
    ----------
    shallow_layers : int, default 2
        ``L_s``: layers ``0 .. L_s - 1`` are shallow; ``0 <= L_s <= n_layers``.
    beta : int or None, default None
        ``β``, the anchor cache size including the first token, ``1 <= β <= N - 1``;
        ``None`` means ``max(1, N // 4)``.
    sink : int, default 4
        ``s``, sink tokens of the shallow layers.
    """

    name = "mat"
    card = PolicyCard(
        summary="MAT: deep layers keep first token + window + tokens of lowest logit to the first key",
        paper="MAT (Managing Anchor Tokens), Algorithm 1, Eqs. 3-5; L_s = 2, beta = N // 4, s = 4",
        label="MAT",
        citation="MAT (anchor tokens)",
        score_rule=r"deep layers: :math:`-q_i\cdot k_0/\sqrt d`; shallow: recency",
        protects="first token + last :math:`N - N/4` (deep); first 4 + window (shallow)",
        implements=("MAT: Algorithm 1, Eqs. 3-5, deep/shallow layers; closed form and the literal streaming argmax, "
                    "proven equal by a test"),
        table_order=90,
        variants=({"beta": 2},),
    )
    forms = MappingProxyType({
        "paper": {"source": "MAT (anonymous ACL submission), Alg. 1, Eqs. 3-5 (no code public)", "proven": None},
    })
    needs = frozenset({"keys", "queries", "positions"})
    evict_before_attention = True

    shallow_layers: int = 2
    beta: int | None = None
    sink: int = 4

    def __post_init__(self):
        check_int("shallow_layers", self.shallow_layers, 0)
        if self.beta is not None:
            check_int("beta", self.beta, 1)
        check_int("sink", self.sink, 0)

    def check(self, budget: int, config: ModelConfig) -> None:
        check_int("shallow_layers", self.shallow_layers, 0, config.n_layers)
        if budget < 2:
            raise ValueError(f"budget must be >= 2 for mat (the first token and a window), got {budget}")
        beta = self.anchor_size(budget)
        if beta >= budget:
            raise ValueError(f"beta must be < budget={budget}, got beta={beta}")
        if self.shallow_layers > 0 and budget <= self.sink:
            raise ValueError(f"budget must be > sink={self.sink} (room for the shallow layers' window), "
                             f"got {budget}")

    def max_block(self, budget: int, config: ModelConfig) -> int:
        """``B <= N - 1`` for deep layers (the first token stays), ``B <= N - sink`` for shallow ones."""
        limits = []
        if self.shallow_layers < config.n_layers:
            limits.append(budget - 1)
        if self.shallow_layers > 0:
            limits.append(budget - self.sink)
        return min(limits)

    def anchor_size(self, budget: int) -> int:
        """``β`` for a budget ``N``: ``beta``, or ``max(1, N // 4)`` when it is None."""
        return default_beta(budget) if self.beta is None else int(self.beta)

    def deep(self, layer: int) -> bool:
        """Whether ``layer`` is a deep layer (anchor rule) rather than a shallow one."""
        return layer >= self.shallow_layers

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        return {LOGIT_FIELD: FieldSpec(dtype=np.float64, shape=(), fill=np.nan)}

    def observe(self, view: View) -> dict[str, np.ndarray]:
        """Store :math:`\\pi` of the block's tokens (Alg. 1 line 3); deep layers only."""
        if not self.deep(view.layer):
            return {}
        if not (view.positions[:, 0] == 0).all():
            raise ValueError("mat: the first token (position 0) is not in this deep layer's cache")
        b = view.block_keys.shape[1]
        first_key = view.keys[:, 0]  # (Hkv, d)
        logits = anchor_logits(view.queries_by_kv_head(), first_key[:, None, :])  # (Hkv, g, B)
        table = view.fields[LOGIT_FIELD].copy()
        table[:, -b:] = logits.mean(axis=1)
        return {LOGIT_FIELD: table}

    def score(self, view: View) -> np.ndarray:
        if self.deep(view.layer):
            return -view.fields[LOGIT_FIELD]
        return view.positions.astype(np.float64)

    def protected(self, view: View) -> np.ndarray:
        keep = view.keep
        if keep < 1:
            raise ValueError(f"a block of B={len(view.query_positions)} leaves no cache place for mat's first "
                             "token; use B <= N - 1")
        if self.deep(view.layer):
            # The window after the block is appended is the last N - β tokens; at this
            # eviction (keeping N - B) that is the last N - β - B cached ones.
            beta = self.anchor_size(view.budget)
            return first_tokens(view, 1) | recent_tokens(view, max(keep - beta, 0))
        if keep < self.sink:
            raise ValueError(f"a block of B={len(view.query_positions)} leaves N - B = {keep} cache places, "
                             f"fewer than mat's sink={self.sink} tokens of a shallow layer; use B <= N - sink")
        return first_tokens(view, self.sink) | recent_tokens(view, keep - self.sink)
