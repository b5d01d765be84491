"""Assertions for checking an eviction implementation against refkv, in your own tests.

In the style of :mod:`numpy.testing`: each ``assert_*`` returns quietly or raises an
:class:`AssertionError` whose message says what differs and where, and each hides its own
frame from pytest tracebacks (``__tracebackhide__``), so a failure points at your test.

* :func:`assert_scores_close` -- shape, then dtype, then values within ``rtol``/``atol``;
* :func:`assert_same_retention` -- kept tokens, tie-aware: a different token is accepted
  (and returned as a tie) when its reference score is within tolerance of the one it
  replaces;
* :func:`assert_case` -- both, for one golden test vector, with the case's own tolerances;
* :func:`load_cases` -- the test vectors of a golden suite, ready for
  ``pytest.mark.parametrize``;
* :mod:`refkv.testing.strategies` -- hypothesis strategies for KV caches (GQA layouts,
  budgets, block sizes, near ties, zero-norm and duplicate keys, huge logits).

Example::

    import pytest
    from refkv.testing import assert_case, load_cases

    @pytest.mark.parametrize("case", load_cases("golden/vectors/keydiff.json", dtype="float32"), ids=str)
    def test_my_kernel(case):
        scores, kept = my_keydiff(case.inputs["keys"], case.budget)
        assert_case(case, scores=scores, kept=kept)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..oracle.compare import compare_arrays, compare_retention
from ..oracle.vectors import VectorCase, json_params, read_vectors

__all__ = ["assert_case", "assert_same_retention", "assert_scores_close", "load_cases"]


def _headline(what: str, err_msg: str) -> str:
    return what + (f" ({err_msg})" if err_msg else "")


def _position_namer(positions):
    if positions is None:
        def name(index):
            if len(index) == 2:
                return f"head {index[0]}, column {index[1]}"
            return "index " + (str(index[0]) if len(index) == 1 else str(index))
        return name
    positions = np.asarray(positions)

    def name(index):
        if len(index) == 2 and positions.ndim == 2:
            return f"head {index[0]}, position {int(positions[index])} (column {index[1]})"
        return "index " + str(index)
    return name


def assert_scores_close(actual, desired, *, rtol: float = 1e-7, atol: float = 0.0, positions=None,
                        check_dtype="kind", err_msg: str = "") -> None:
    """Raise AssertionError unless ``actual`` and ``desired`` scores agree.

    Compared in order: shape, dtype, values (``|actual - desired| <= atol + rtol *
    |desired|``, NaN equal to NaN, infinities only to themselves).

    Parameters
    ----------
    actual, desired : array_like
        Usually ``(Hkv, n)`` eviction scores.
    rtol, atol : float
        Tolerances (:func:`numpy.testing.assert_allclose`'s defaults).
    positions : (Hkv, n) int array, optional
        Token positions, so the message names "head 1, position 37" rather than a column.
    check_dtype : {"kind", True, False}
        ``"kind"`` (default): both float (or both integer, both bool); ``True``: equal
        dtypes; ``False``: no check.
    err_msg : str
        Added to the first line of the message.

    Examples
    --------
    >>> import numpy as np
    >>> from refkv.testing import assert_scores_close
    >>> assert_scores_close(np.array([[0.5, 0.25]]), np.array([[0.5, 0.25 + 1e-12]]))
    """
    __tracebackhide__ = True
    mismatch = compare_arrays(actual, desired, rtol=rtol, atol=atol, check_dtype=check_dtype,
                              describe_index=_position_namer(positions))
    if mismatch is not None:
        raise AssertionError(_headline("scores differ", err_msg) + "\n" + mismatch.message)


def _ranges(values) -> str:
    from ..formatting import format_ranges

    return format_ranges(np.sort(np.asarray(values)))


def assert_same_retention(actual, desired, scores, *, positions=None, protected=None, rtol: float = 1e-7,
                          atol: float = 0.0, strict_ties: bool = False, err_msg: str = "") -> list:
    """Raise AssertionError unless ``actual`` keeps the same tokens as ``desired``, up to ties.

    Per KV head, where the two kept sets differ, every token kept in place of a reference
    token must have a reference score within tolerance of it,
    ``|s_ref_kept - s_cand_kept| <= atol + rtol * max(|.|, |.|)``, and no token the
    reference protects may be evicted. Such swaps are *ties*: accepted and returned.

    Parameters
    ----------
    actual, desired : (Hkv, m) int arrays
        Kept column indices (into the ``n`` candidates), candidate's and reference's.
    scores : (Hkv, n) array
        The reference scores of the candidates.
    positions : (Hkv, n) int array, optional
        Token positions, for the message.
    protected : (Hkv, n) bool array, optional
        Tokens that must be kept.
    rtol, atol : float
        The tie tolerance.
    strict_ties : bool
        Fail on ties too (the implementation must follow refkv's tie rule exactly).
    err_msg : str
        Added to the first line of the message.

    Returns
    -------
    list of :class:`refkv.oracle.compare.Swap`
        The accepted ties (empty when the kept sets are equal).
    """
    __tracebackhide__ = True
    result = compare_retention(actual, desired, scores, positions=positions, protected=protected, rtol=rtol,
                               atol=atol)
    if result.ok and not (strict_ties and result.ties):
        return result.ties
    lines = [_headline("kept tokens differ from the reference" if result.ok is False else
                       "kept tokens differ from the reference by ties (strict_ties=True)", err_msg)]
    if not result.ok:
        lines.append(result.failure)
        if result.head is not None:
            pos = (np.broadcast_to(np.arange(np.shape(scores)[1]), np.shape(scores)) if positions is None
                   else np.asarray(positions))
            h = result.head
            cand = pos[h][np.asarray(actual)[h]]
            ref = pos[h][np.asarray(desired)[h]]
            lines.append(f"  head {h}: candidate keeps positions {_ranges(cand)}")
            lines.append(f"  head {h}: reference keeps positions {_ranges(ref)}")
            only_c = sorted(set(cand.tolist()) - set(ref.tolist()))
            only_r = sorted(set(ref.tolist()) - set(cand.tolist()))
            lines.append(f"  only the candidate keeps {only_c}; only the reference keeps {only_r}")
    if result.ties:
        lines.append(f"ties accepted before the failure: {len(result.ties)}" if not result.ok else
                     f"{len(result.ties)} ties:")
        lines.extend("  " + t.describe() for t in result.ties[:5])
    raise AssertionError("\n".join(lines))


def assert_case(case: VectorCase, *, scores=None, protected=None, kept=None, tolerance_factor: float = 1.0,
                strict_ties: bool = False, check_dtype="kind") -> list:
    """Check a candidate's outputs for one golden test vector, with the case's tolerances.

    Parameters
    ----------
    case : refkv.oracle.VectorCase
        From :func:`load_cases` or :func:`refkv.oracle.read_vectors`.
    scores : (Hkv, n) array, optional
    protected : (Hkv, n) bool array, optional
    kept : (Hkv, m) int array, optional
        Whatever the implementation produces; at least one must be given.
    tolerance_factor : float
        Multiplies the case's ``rtol`` and ``atol``.
    strict_ties, check_dtype
        As in :func:`assert_same_retention` and :func:`assert_scores_close`.

    Returns
    -------
    list of accepted ties.
    """
    __tracebackhide__ = True
    if scores is None and protected is None and kept is None:
        raise ValueError("give at least one of scores, protected, kept")
    ref = case.outputs
    rtol, atol = case.tolerance["rtol"] * tolerance_factor, case.tolerance["atol"] * tolerance_factor
    positions = case.inputs["positions"]
    label = f"{case.label}: {case.comment}"
    if scores is not None:
        assert_scores_close(scores, ref["scores"], rtol=rtol, atol=atol, positions=positions,
                            check_dtype=check_dtype, err_msg=label)
    if protected is not None:
        mismatch = compare_arrays(protected, ref["protected"], check_dtype=check_dtype,
                                  describe_index=_position_namer(positions))
        if mismatch is not None:
            raise AssertionError(_headline("protected masks differ", label) + "\n" + mismatch.message)
    if kept is None:
        return []
    return assert_same_retention(kept, ref["kept"], ref["scores"], positions=positions,
                                 protected=ref["protected"], rtol=rtol, atol=atol, strict_ties=strict_ties,
                                 err_msg=label)


def load_cases(path, *, policy: str | None = None, dtype: str | None = None, flags=(),
               params: dict | None = None) -> list:
    """The test vectors of a vectors file or of a suite directory, filtered.

    Parameters
    ----------
    path : path-like
        A ``vectors/<policy>.json`` file, or a suite directory (its ``vectors/`` folder).
    policy : str, optional
        Only this policy (for a directory).
    dtype : {"float32", "float64"}, optional
    flags : iterable of str
        Only cases carrying all of these flags.
    params : dict, optional
        Only cases whose group parameters equal these, e.g. the defaults
        ``refkv.policies.get(name).params()`` (compared in JSON form: tuples as lists).

    Returns
    -------
    list of :class:`refkv.oracle.VectorCase`; ``str(case)`` is a short id for pytest.
    """
    path = Path(path)
    if params is not None:
        params = json_params(params)
    if path.is_dir():
        folder = path / "vectors" if (path / "vectors").is_dir() else path
        files = sorted(folder.glob("*.json")) if policy is None else [folder / f"{policy}.json"]
    else:
        files = [path]
    out = []
    wanted = set(flags)
    for file in files:
        vf = read_vectors(file)
        if policy is not None and vf.policy != policy:
            continue
        for case in vf.cases:
            if dtype is not None and case.dtype != dtype:
                continue
            if not wanted <= set(case.flags):
                continue
            if params is not None and case.params != params:
                continue
            out.append(case)
    return out

