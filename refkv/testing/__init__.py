"""Assertions for checking an eviction implementation against refkv, in your own tests.

In the style of :mod:`numpy.testing`: each ``assert_*`` returns quietly or raises an
:class:`AssertionError` whose message says what differs and where, and each hides its own
frame from pytest tracebacks (``__tracebackhide__``), so a failure points at your test.
Every assertion accepts what kernels return: NumPy arrays, lists, torch tensors
(bfloat16 included) and jax arrays, without importing those libraries.

* :func:`assert_scores_close` -- shape, then dtype, then values within ``rtol``/``atol``;
* :func:`assert_same_retention` -- kept tokens, tie-aware: a different token is accepted
  (and returned as a tie, with the rule that accepted it) when its reference score is
  within tolerance of the one it replaces;
* :func:`assert_case` -- one golden test vector, with tolerances derived from the dtype
  your kernel computed in (``dtype="bfloat16"``) and declared differences (``declare=``);
  it formats :func:`refkv.oracle.cases.compare_case`, the same check ``refkv golden
  check`` runs;
* :func:`load_cases` -- the test vectors of a golden suite, ready for
  ``pytest.mark.parametrize``;
* :func:`round_to` -- round to bfloat16/float16 precision in NumPy, to emulate a
  low-precision kernel;
* :mod:`refkv.testing.strategies` -- hypothesis strategies for KV caches (GQA layouts,
  budgets, block sizes, near ties, zero-norm and duplicate keys, huge logits).

Example::

    import pytest
    from refkv.testing import assert_case, load_cases

    @pytest.mark.parametrize("case", load_cases("golden/vectors/keydiff.json", dtype="float32"), ids=str)
    def test_my_kernel(case):
        scores, kept = my_keydiff(case.inputs["keys"], case.budget)   # a bf16 kernel
        assert_case(case, scores=scores, kept=kept, dtype="bfloat16")
"""

from __future__ import annotations

from ..oracle.tolerance import round_to
from .asserts import assert_case, assert_same_retention, assert_scores_close
from .loading import load_cases

__all__ = ["assert_case", "assert_same_retention", "assert_scores_close", "load_cases", "round_to"]
