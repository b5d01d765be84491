"""``scissorhands``: Scissorhands (Liu et al., 2023), persistence of importance.

Scissorhands rests on the "persistence of importance" hypothesis: a token that received
a large attention weight at one step keeps mattering later. A token counts as important
at a step when the step's query gives it at least the uniform weight ``1/n`` over the
``n`` keys the query sees; the policy counts those steps over a history of the last ``m``
steps and evicts the tokens that were least often important.

Per-token state: a ring buffer of ``m`` booleans per token (cache field
``scissorhands_important``). The slot of step ``t`` (the query's position) is
``t mod m``; writing step ``t`` overwrites step ``t - m``, so the buffer always holds
exactly the last ``m`` steps.

The buffer costs ``m`` bytes per token, KV head and layer, so ``m`` is bounded by
:data:`MAX_HISTORY` (10 times the paper's 400): a history of ``10**6`` would hold about
a megabyte per cached token and head before any eviction could help.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..cache import FieldSpec
from ..model.config import ModelConfig
from .base import AttentionNeed, Policy, View, check_int, first_tokens, recent_tokens, register
from .card import PolicyCard

__all__ = ["FIELD", "MAX_HISTORY", "Scissorhands", "importance", "record_steps"]

#: Name of the cache field holding the (Hkv, n, m) ring buffer of importance bits.
FIELD = "scissorhands_important"
#: Largest history ``m``: 4000 bytes of state per cached token, KV head and layer
#: (SmolLM2-135M at N = 1024 holds 30 x 3 x ~1100 tokens: about 400 MB at this bound).
MAX_HISTORY = 4000


def importance(attention_by_kv_head: np.ndarray, positions: np.ndarray, query_positions: np.ndarray) -> np.ndarray:
    """Which tokens each query found important: weight ``>= 1/n_visible``.

    Parameters
    ----------
    attention_by_kv_head : (Hkv, B, n) array
    positions : (Hkv, n) int array
        Key positions.
    query_positions : (B,) int array

    Returns
    -------
    (Hkv, B, n) bool array. ``n_visible`` counts the keys at or before the query's position
    (the ones its softmax spread over); keys in its future are never important. The
    threshold ``1/n_visible`` is rounded to the attention dtype, so a uniform row is
    important everywhere in float32 as in float64.
    """
    visible = positions[:, None, :] <= query_positions[None, :, None]
    n_visible = visible.sum(axis=-1, keepdims=True)
    threshold = (1.0 / np.maximum(n_visible, 1)).astype(attention_by_kv_head.dtype)
    return visible & (attention_by_kv_head >= threshold)


def record_steps(history: np.ndarray, important: np.ndarray, query_positions: np.ndarray) -> np.ndarray:
    """Write each query's importance bits into the ring buffer slot ``position mod m``.

    Parameters
    ----------
    history : (Hkv, n, m) bool array
        The buffer before the block (not modified).
    important : (Hkv, B, n) bool array
        :func:`importance` of the block's queries.
    query_positions : (B,) int array, consecutive

    Returns
    -------
    (Hkv, n, m) bool array. When ``B > m`` only the last ``m`` queries survive, exactly as
    if the queries had been written one by one.
    """
    m = history.shape[-1]
    out = history.copy()
    last = important[:, -m:, :]
    slots = query_positions[-m:] % m  # distinct: at most m consecutive positions
    out[:, :, slots] = last.transpose(0, 2, 1)
    return out


@register
@dataclass(frozen=True)
class Scissorhands(Policy):
    """Scissorhands (Liu et al., 2023, "Scissorhands: Exploiting the Persistence of
    Importance Hypothesis for LLM KV Cache Compression at Test Time").

    Score of token ``j`` (higher = keep): the number of steps ``t`` among the last
    ``history`` steps with :math:`\\bar A_{t, j} \\ge 1 / n_t`, where :math:`\\bar A` is the
    attention averaged over the KV head's query group (KeyDiff App. B.2) and :math:`n_t`
    the number of keys query ``t`` sees. The first ``sink`` tokens and the last ``recent``
    are protected.

    Parameters
    ----------
    history : int in [1, MAX_HISTORY], default 400
        ``m``, steps remembered (``m`` bytes of state per token, KV head and layer).
    sink : int, default 4
        ``g``, initial tokens protected (positions ``< g``).
    recent : int, default 10
        ``r``, most recent tokens protected.

    Notes
    -----
    * **A step is a query.** In block mode each query of the block is one step (its
      position is the step index), so a block of ``B`` queries advances the history by
      ``B`` steps and ``B = 1`` is the paper's per-token generation. A token that did not
      exist yet at a step (or lay in that query's future) was not important at it.
    * **Counting important steps.** Over a fixed window of ``m`` steps, the steps at which
      a token was important and those at which it was not add up to ``m`` once steps before
      the token existed count as unimportant (its causal weight there is 0), so keeping
      the most often important tokens is the same as dropping the most often unimportant
      ones. A young token has had fewer chances and scores lower; the recent window
      protects it meanwhile.
    * The ``sink`` tokens follow refkv's design table (StreamingLLM's observation that the
      first tokens collect attention); ``sink=0`` turns them off.
    * ``n_t`` is the number of keys in the (evicted) cache that query ``t`` attends to,
      i.e. the uniform weight over what it actually sees, not ``1/t``.
    * Ties in the count (frequent: counts are small integers) keep the more recent token
      (the shared tie rule).
    * ``sink + recent`` must be smaller than the budget (:meth:`check`).
    * **Cost**: only the last ``m`` steps survive in the buffer, so it reads the last ``m``
      rows of the weights (:meth:`attention_need`); in one-shot prefill of ``T > m`` tokens
      the engine forms ``O(T x max(m, tile))`` weights per head, not ``T^2``.
    """

    name = "scissorhands"
    card = PolicyCard(
        summary="Scissorhands: count of steps with attention >= 1/n over the last m; first g, last r kept",
        paper="Liu et al. 2023, Scissorhands; m = 400, g = 4, r = 10",
        label="Scissorhands",
        citation="Scissorhands (Liu et al. 2023)",
        score_rule=r"steps with attention :math:`\ge 1/n` over the last :math:`m = 400`",
        protects="first 4, last 10",
        implements="Scissorhands (Liu et al. 2023): importance counts over a history window",
        table_order=50,
        variants=({"history": 6, "sink": 1, "recent": 2},),
    )
    forms = MappingProxyType({
        "paper": {"source": "Liu et al. 2023, Scissorhands Alg. 1-2 (no authors' code public)", "proven": None},
    })
    needs = frozenset({"attention"})
    #: Scores are counts, >= 0 (CAOTE may wrap this policy).
    nonnegative_scores = True

    history: int = 400
    sink: int = 4
    recent: int = 10

    def __post_init__(self):
        check_int("history", self.history, 1, MAX_HISTORY)
        check_int("sink", self.sink, 0)
        check_int("recent", self.recent, 0)

    def check(self, budget: int, config: ModelConfig) -> None:
        if self.sink + self.recent >= budget:
            raise ValueError(f"sink + recent must be < budget={budget} (room for scored tokens), "
                             f"got sink={self.sink}, recent={self.recent}")

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        return {FIELD: FieldSpec(dtype=np.bool_, shape=(self.history,), fill=False)}

    def attention_need(self) -> AttentionNeed:
        """The last ``m`` rows of the weights: the steps the ring buffer keeps."""
        return AttentionNeed(rows=self.history)

    def observe(self, view: View) -> dict[str, np.ndarray]:
        rows = view.attention_last_rows(self.history)  # (Hkv, g, r, n), r = min(m, B)
        steps = view.query_positions[view.query_positions.shape[0] - rows.shape[2]:]  # their positions, (r,)
        important = importance(rows.mean(axis=1), view.positions, steps)
        return {FIELD: record_steps(view.fields[FIELD], important, steps)}

    def score(self, view: View) -> np.ndarray:
        return view.fields[FIELD].sum(axis=-1).astype(np.float64)

    def protected(self, view: View) -> np.ndarray:
        return first_tokens(view, self.sink) | recent_tokens(view, self.recent)
