"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023).

H2O keeps the "heavy hitters", the tokens with the largest attention accumulated over
every query that has seen them, plus a window of recent tokens. In the notation of
KeyDiff App. A.1 the score after a block with attention ``A`` (``B`` queries by ``n``
keys) is

.. math:: \\phi_{\\mathrm{H2O}}(A) = A_{\\mathrm{prev}} + A^\\top \\mathbf{1},

where :math:`A_{\\mathrm{prev}}` is the accumulated score carried from earlier blocks. The
accumulator is per-token state, a cache field evicted together with its token.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..cache import FieldSpec
from ..model.config import ModelConfig
from ..validation import check_choice
from .base import AttentionNeed, Policy, View, check_int, recent_tokens, register
from .card import PolicyCard

__all__ = ["FIELD", "FORMS", "H2O", "accumulated_attention"]

#: The forms of :class:`H2O`: the paper's and the authors' real-drop cache's.
FORMS = ("paper", "authors")

#: Where the authors' form was read (docs/policies/h2o.rst, "Authors' code").
AUTHORS_CODE = "FMInference/H2O@ac75c2a8a9e76832b2a4139b9363373b56336bfb"

#: Name of the cache field holding the accumulated attention (float64).
FIELD = "h2o_accumulated"


def accumulated_attention(attention_by_kv_head: np.ndarray) -> np.ndarray:
    """One block's contribution :math:`A^\\top \\mathbf{1}`: the sum over the block's queries.

    Parameters
    ----------
    attention_by_kv_head : (..., B, n) array
        Attention weights of the block's ``B`` queries over ``n`` keys (for GQA, already
        averaged over each KV head's query group: :meth:`refkv.policies.View.attention_by_kv_head`).

    Returns
    -------
    (..., n) array: column sums, the same dtype. A key in a query's future has weight 0
    for that query, so each token collects only from the queries that saw it.
    """
    return attention_by_kv_head.sum(axis=-2)


@register
@dataclass(frozen=True)
class H2O(Policy):
    """H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
    Inference of Large Language Models"; KeyDiff App. A.1).

    Score of token ``j`` (higher = keep): its accumulated attention
    :math:`h_j = \\sum_{t} \\bar A_{t, j}` over every query ``t`` that has attended to it
    while it was in the cache, with :math:`\\bar A` the mean over the KV head's query group
    (KeyDiff App. B.2). The most recent ``recent`` tokens are protected; the other
    ``N - recent`` slots go to the heavy hitters.

    Parameters
    ----------
    recent : int or None, default None
        Size ``r`` of the protected recent window. ``None`` means ``N // 2`` of the budget
        ``N`` of each eviction (H2O's even split between heavy hitters and recent tokens).
        An explicit ``recent`` must be smaller than the budget (at least one heavy-hitter
        slot): :meth:`check` raises :class:`ValueError` otherwise.
    form : {"paper", "authors"}, default "paper"
        ``"authors"`` reproduces the decisions of the authors' real-drop cache
        (FMInference/H2O@ac75c2a8:h2o_hf/utils_real_drop/modify_llama.py:242-329,
        ``H2OKVCache_LayerWise``): the same accumulated scores, the last ``recent_size``
        kept and the ``hh_size`` largest of the rest (lines 271-276), ties at that boundary
        to the older token as CUDA ``torch.topk`` orders them (line 272; :meth:`tie_order`).
        Use ``recent=recent_size`` and the budget ``hh_size + recent_size``. That cache runs
        on models without GQA only (its per-query-head mask cannot index GQA keys, 282).

    Notes
    -----
    * **Block mode** (``B > 1``): after each block, every cached token adds the column sum
      of the block's (group-averaged) attention, :math:`A_{\\mathrm{prev}} + A^\\top\\mathbf{1}`
      (KeyDiff App. A.1). Processing a block at once or its queries one by one therefore
      gives the same accumulators as long as nothing is evicted in between.
    * The update happens after the block's attention and before its eviction, so the
      block's own tokens are scored with the attention they received inside the block.
    * Later tokens have been seen by fewer queries and so score lower; this is H2O's
      known bias and the reason for the protected recent window.
    * The accumulator is kept in float64 whatever the model dtype (an explicit cast of each
      block's float32 sum), so long sums are not a source of disagreement between runs.
    * **Deviation from the official code**: the official code keeps one accumulator per
      attention head of models without GQA, and gives the split between heavy hitters and
      recent tokens as ratios of the sequence length; here a KV head's query group is
      averaged (the seed papers' rule) and ``r`` is counted in tokens of the budget.
    * **Cost**: it reads only the column sums of the weights (:meth:`attention_need`), so
      the engine adds them up one query tile at a time; in one-shot prefill of ``T`` tokens
      that holds ``O(T x tile)`` weights per head at once, not ``T^2`` (the work is still
      every weight, ``O(T^2)``).
    """

    name = "h2o"
    card = PolicyCard(
        summary="H2O: accumulated attention (heavy hitters) + last r tokens (r = N // 2)",
        paper="Zhang et al. 2023, H2O; phi = A_prev + A^T 1 (KeyDiff App. A.1)",
        label="H2O",
        citation="H2O (Zhang et al. 2023)",
        score_rule="attention accumulated over all queries so far",
        protects="last :math:`N/2`",
        implements="H2O (Zhang et al. 2023): accumulated attention + recent window",
        table_order=30,
        variants=({"recent": 2}, {"recent": 2, "form": "authors"}),
    )
    forms = MappingProxyType({
        "paper": {"source": "Zhang et al. 2023, Alg. 1 / Sec. 4 (KeyDiff App. A.1: A_prev + A^T 1)",
                  "proven": None},
        "authors": {"source": f"{AUTHORS_CODE}:h2o_hf/utils_real_drop/modify_llama.py (H2OKVCache_LayerWise)",
                    "proven": "run: identical kept sets and scores on 72 decisions of 5 configurations, no GQA "
                              "(their cache raises on GQA); at exact ties CPU topk differs "
                              "(tests/authors/test_authors_h2o.py)"},
    })
    needs = frozenset({"attention"})
    #: Scores are sums of attention weights, >= 0 (CAOTE may wrap this policy).
    nonnegative_scores = True

    recent: int | None = None
    form: str = "paper"

    def __post_init__(self):
        if self.recent is not None:
            check_int("recent", self.recent, 0)
        check_choice("form", self.form, FORMS)

    def tie_order(self) -> str:
        """``"older"`` for the authors' form (CUDA ``torch.topk``, modify_llama.py:272), else the shared rule."""
        return "older" if self.form == "authors" else "recent"

    def recent_window(self, budget: int) -> int:
        """``r`` for an eviction keeping ``budget`` tokens: ``recent`` or ``budget // 2``."""
        return budget // 2 if self.recent is None else int(self.recent)

    def check(self, budget: int, config: ModelConfig) -> None:
        if self.recent is not None and self.recent >= budget:
            raise ValueError(f"recent must be < budget={budget} (room for heavy hitters), got {self.recent}")

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        return {FIELD: FieldSpec(dtype=np.float64, shape=(), fill=0.0)}

    def attention_need(self) -> AttentionNeed:
        """The column sums of the weights (over all the block's queries), no rows."""
        return AttentionNeed(rows=0, column_sums=True)

    def observe(self, view: View) -> dict[str, np.ndarray]:
        # accumulated_attention of the group-averaged weights, A-bar^T 1 (View.attention_column_sums)
        block = view.attention_column_sums().astype(np.float64)
        return {FIELD: view.fields[FIELD] + block}

    def score(self, view: View) -> np.ndarray:
        return view.fields[FIELD]

    def protected(self, view: View) -> np.ndarray:
        return recent_tokens(view, self.recent_window(view.keep))
