"""``tova``: Token Omission Via Attention (Oren et al., 2024).

TOVA keeps the tokens that the *current* query attends to most. In the unified
notation of KeyDiff App. A.1 its aggregation of the attention matrix ``A`` is its last
row,

.. math:: \\phi_{\\mathrm{TOVA}}(A) = A_{-1,:},

so the score of token ``j`` is the attention weight that the block's last query gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..validation import check_choice
from .base import AttentionNeed, Policy, View, register
from .card import PolicyCard

__all__ = ["FORMS", "TOVA", "last_query_attention"]

#: The forms of :class:`TOVA`: the paper's (group mean per KV head) and the authors' code's.
FORMS = ("paper", "authors")

#: Where the authors' form was read (docs/policies/tova.rst, "Authors' code").
AUTHORS_CODE = "schwartz-lab-NLP/TOVA@9c7d09bfff64cfc92cfb5f9d7e138cb04866e5a7"


def last_query_attention(attention: np.ndarray) -> np.ndarray:
    """The attention row of the block's last query: ``A[..., -1, :]`` (KeyDiff App. A.1).

    Parameters
    ----------
    attention : (..., B, n) array
        Attention weights of a block's ``B`` queries over ``n`` keys.

    Returns
    -------
    (..., n) array, the same dtype.
    """
    return attention[..., -1, :]


@register
@dataclass(frozen=True)
class TOVA(Policy):
    """TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"; KeyDiff App. A.1).

    Score of token ``j`` (higher = keep): :math:`s_j = \\bar A_{B, j}`, the attention weight
    of the block's last query, with :math:`\\bar A` the mean over the query heads that share
    the KV head (KeyDiff App. B.2). Nothing is protected.

    Parameters
    ----------
    all_heads : bool, default False
        Average the last query's weights over *all* query heads of the layer (what the
        official TOVA code does) instead of over each KV head's query group. Every KV head
        then gets the same scores, so all heads keep the same tokens.
    form : {"paper", "authors"}, default "paper"
        ``"authors"`` reproduces the decisions of the authors' ``TOVACache.reduce``
        (schwartz-lab-NLP/TOVA@9c7d09bf:src/tova_cache.py:31-51): the mean over all query
        heads (line 44; it implies ``all_heads=True``) and ``torch.topk``'s CUDA tie order
        (line 45), the older token kept (:meth:`tie_order`).

    Notes
    -----
    * **Block mode** (``B > 1``): the block's last query is the only one that sees every
      candidate (the causal mask hides later block tokens from earlier queries), so its
      row is the score; this is KeyDiff App. A.1's :math:`A_{-1,:}`. With ``B = 1`` it is
      the paper's per-token rule.
    * **GQA**: the group mean is taken before the scores are compared (KeyDiff App. B.2);
      selection is per KV head.
    * ``all_heads=True`` requires that every KV head holds the same tokens (columns must
      mean the same token in every head); it does whenever the whole run used
      ``all_heads=True``, and a :class:`ValueError` is raised otherwise.
    * **Deviation from the official code**: besides the head averaging above, the official
      code has no attention-sink protection either; neither does this policy.
    * **Cost**: it reads one row of the weights (:meth:`attention_need`), so the engine
      forms the weights of the last query tile only; in one-shot prefill of ``T`` tokens
      that is ``O(T)`` weights per head, not ``T^2``.
    """

    name = "tova"
    card = PolicyCard(
        summary="TOVA: attention of the block's last query (group mean); nothing protected",
        paper="Oren et al. 2024, Transformers are Multi-State RNNs; KeyDiff App. A.1",
        label="TOVA",
        citation="TOVA (Oren et al. 2024)",
        score_rule="attention of the block's last query",
        protects="--",
        implements="TOVA (Oren et al. 2024): last query's attention (KeyDiff App. A.1)",
        table_order=20,
        variants=({"all_heads": True}, {"form": "authors"}),
    )
    forms = MappingProxyType({
        "paper": {"source": "Oren et al. 2024, Sec. 3.3 (KeyDiff App. A.1: A[-1, :]), group mean per KV head",
                  "proven": None},
        "authors": {"source": f"{AUTHORS_CODE}:src/tova_cache.py (TOVACache.reduce)",
                    "proven": "run: identical kept sets on 88 decisions of 7 configurations, GQA and not; at exact "
                              "ties CPU topk differs (tests/authors/test_authors_tova.py)"},
        "kvpress": {"source": "kvpress 0.5.5 TOVAPress (= all_heads=True, last token pinned)",
                    "proven": "tests/interop/test_interop_kvpress.py"},
    })
    needs = frozenset({"attention"})
    #: Scores are attention weights, >= 0 (CAOTE may wrap this policy).
    nonnegative_scores = True

    all_heads: bool = False
    form: str = "paper"

    def __post_init__(self):
        if not isinstance(self.all_heads, (bool, np.bool_)):
            raise ValueError(f"all_heads must be True or False, got {self.all_heads!r}")
        check_choice("form", self.form, FORMS)

    def tie_order(self) -> str:
        """``"older"`` for the authors' form (CUDA ``torch.topk``, tova_cache.py:45), else the shared rule."""
        return "older" if self.form == "authors" else "recent"

    def attention_need(self) -> AttentionNeed:
        """The last query's row of the weights."""
        return AttentionNeed(rows=1)

    def score(self, view: View) -> np.ndarray:
        last = view.attention_last_rows(1)  # (Hkv, g, 1, n); raises if the view has no weights
        if not (self.all_heads or self.form == "authors"):
            return last_query_attention(last.mean(axis=1))
        if not np.array_equal(view.positions, np.broadcast_to(view.positions[:1], view.positions.shape)):
            raise ValueError("all_heads=True needs every KV head to hold the same tokens; "
                             "these heads hold different positions")
        row = last_query_attention(last).mean(axis=(0, 1))  # (Hkv, g, n) -> (n,)
        return np.broadcast_to(row, view.positions.shape).copy()
