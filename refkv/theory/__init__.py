"""The quantities the seed papers' theorems speak of, computed the slow, literal way.

The policies compute closed forms (CAOTE Eq. 8, KeyDiff Eq. 8, ...); this module computes
what those closed forms claim to equal or to optimise, by an independent route, so that the
tests in ``tests/theory/test_theory_*.py`` can compare the two. Nothing here is used by the engine.
One module per paper, matching ``docs/theory/`` and ``tests/theory/test_theory_*.py``; every name is
also importable from :mod:`refkv.theory` itself.

CAOTE (:mod:`refkv.theory.caote`)
    :func:`attention_output` (Eqs. 10-11), :func:`attention_after_eviction` (Thm 3.1:
    softmax recomputed without token ``j``),
    :func:`eviction_errors` (Eq. 9: ``||X_attn - X'_attn,j||`` by recomputing attention),
    :func:`attention_only_logits` (App. B.2 case 1: a one-layer decoder without norms).
KeyDiff (:mod:`refkv.theory.keydiff`)
    :func:`unit_rows`, :func:`cosine_matrix`, :func:`pairwise_cosine_sums` (Eq. 7), :func:`pairwise_objective`
    (Eq. 9), :func:`relaxed_objective` (Eq. 10), :func:`brute_force_minimum`,
    :func:`keydiff_choice`, :func:`eq9_optimality_rate`, :func:`attention_weight_of`,
    :func:`c1_bound` and :func:`c1_bound_corrected` (Thm C.1 / Lemma 3.1),
    :func:`cosine_square_sum` (Lemma C.2), :func:`c3_bound` and :func:`c3_bound_tight`
    (Thm C.3).
HashEvict (Eq. 3, the SimHash collision law: :mod:`refkv.theory.hashevict`)
    :func:`angle_fraction`, :func:`hamming_fraction_moments`, :func:`hoeffding_radius`,
    :func:`bernstein_radius`.

Notes
-----
* Cosines here are the exact ``<a, b> / (||a|| ||b||)``: a zero vector is a ValueError, not
  the policies' ``max(||a|| ||b||, eps)`` convention (KeyDiff App. A.2.1), because the
  theorems are statements about real cosines.
* KeyDiff's App. C models an attention logit as ``k . q`` with no ``1 / sqrt(d)`` (the scale is
  absorbed into the norm bound ``M``); :func:`attention_weight_of` follows it.
* Every function works in the dtype of its input where that makes sense; the brute-force and
  statistical helpers work in float64.
"""

from .caote import (
    AttentionOnlyOutput,
    attention_after_eviction,
    attention_only_logits,
    attention_output,
    eviction_errors,
)
from .hashevict import angle_fraction, bernstein_radius, hamming_fraction_moments, hoeffding_radius
from .keydiff import (
    attention_weight_of,
    brute_force_minimum,
    c1_bound,
    c1_bound_corrected,
    c3_bound,
    c3_bound_tight,
    cosine_matrix,
    cosine_square_sum,
    eq9_optimality_rate,
    keydiff_choice,
    pairwise_cosine_sums,
    pairwise_objective,
    relaxed_objective,
    unit_rows,
)

__all__ = [
    "AttentionOnlyOutput",
    "angle_fraction",
    "attention_after_eviction",
    "attention_only_logits",
    "attention_output",
    "attention_weight_of",
    "bernstein_radius",
    "brute_force_minimum",
    "c1_bound",
    "c1_bound_corrected",
    "c3_bound",
    "c3_bound_tight",
    "cosine_matrix",
    "cosine_square_sum",
    "eq9_optimality_rate",
    "eviction_errors",
    "hamming_fraction_moments",
    "hoeffding_radius",
    "keydiff_choice",
    "pairwise_cosine_sums",
    "pairwise_objective",
    "relaxed_objective",
    "unit_rows",
]
