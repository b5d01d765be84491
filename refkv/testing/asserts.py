"""The assertions of :mod:`refkv.testing`: each formats a comparison of :mod:`refkv.oracle`."""

from __future__ import annotations

import numpy as np

from ..formatting import format_position_set
from ..oracle.arrays import as_array, compare_arrays
from ..oracle.candidates import CandidateError
from ..oracle.cases import compare_case, describe_position
from ..oracle.retention import compare_retention
from ..oracle.vectors import VectorCase, as_vector_case

__all__ = ["assert_case", "assert_same_retention", "assert_scores_close"]


def _headline(what: str, err_msg: str) -> str:
    return what + (f" ({err_msg})" if err_msg else "")


def _namer(positions):
    if positions is None:
        def name(index):
            if len(index) == 2:
                return f"head {index[0]}, column {index[1]}"
            return "index " + (str(index[0]) if len(index) == 1 else str(index))
        return name
    return describe_position(as_array(positions, "positions"))


def assert_scores_close(actual, desired, *, rtol: float = 1e-7, atol: float = 0.0, positions=None,
                        check_dtype="kind", err_msg: str = "") -> None:
    """Raise AssertionError unless ``actual`` and ``desired`` scores agree.

    Compared in order: shape, dtype, values (``|actual - desired| <= atol + rtol *
    |desired|``, NaN equal to NaN, infinities only to themselves).

    Parameters
    ----------
    actual, desired : array_like
        Usually ``(Hkv, n)`` eviction scores. NumPy arrays, lists, or tensors with a float
        conversion (torch, including bfloat16; jax) -- see :func:`refkv.oracle.arrays.as_array`.
    rtol, atol : float
        Tolerances (:func:`numpy.testing.assert_allclose`'s defaults); ``atol`` may be an
        array of per-element tolerances.
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
    mismatch = compare_arrays(as_array(actual, "actual"), as_array(desired, "desired"), rtol=rtol, atol=atol,
                              check_dtype=check_dtype, describe_index=_namer(positions))
    if mismatch is not None:
        raise AssertionError(_headline("scores differ", err_msg) + "\n" + mismatch.message)


def assert_same_retention(actual, desired, scores, *, positions=None, protected=None, rtol: float = 1e-7,
                          atol: float = 0.0, tolerance=None, strict_ties: bool = False, err_msg: str = "") -> list:
    """Raise AssertionError unless ``actual`` keeps the same tokens as ``desired``, up to ties.

    Per KV head, where the two kept sets differ, every token kept in place of a reference
    token must have a reference score within the tie threshold of it, and no token the
    reference protects may be evicted. Such swaps are *ties*: accepted and returned, each
    with the rule that accepted it. The threshold is ``tolerance[d] + tolerance[e]`` with
    per-score tolerances (what :func:`assert_case` uses), else
    ``atol + rtol * max(|s_d|, |s_e|)``.

    Parameters
    ----------
    actual, desired : (Hkv, m) int array_like
        Kept column indices (into the ``n`` candidates), candidate's and reference's.
    scores : (Hkv, n) array_like
        The reference scores of the candidates.
    positions : (Hkv, n) int array, optional
        Token positions, for the message.
    protected : (Hkv, n) bool array, optional
        Tokens that must be kept.
    rtol, atol : float
        The tie tolerance, when ``tolerance`` is not given.
    tolerance : (Hkv, n) array, optional
        Per-score tolerances, e.g. :func:`refkv.oracle.tolerance.score_tolerance`.
    strict_ties : bool
        Fail on ties too (the implementation must follow refkv's tie rule exactly).
    err_msg : str
        Added to the first line of the message.

    Returns
    -------
    list of :class:`refkv.oracle.retention.Swap`
        The accepted ties (empty when the kept sets are equal).
    """
    __tracebackhide__ = True
    actual = as_array(actual, "actual")
    desired = as_array(desired, "desired")
    scores = as_array(scores, "scores")
    rule = "the given per-score tolerances" if tolerance is not None else f"rtol={rtol:g}, atol={atol:g}"
    result = compare_retention(actual, desired, scores, positions=positions, protected=protected, rtol=rtol,
                               atol=atol, tolerance=tolerance, rule=rule)
    if result.ok and not (strict_ties and result.ties):
        return result.ties
    lines = [_headline("kept tokens differ from the reference" if not result.ok else
                       "kept tokens differ from the reference by ties (strict_ties=True)", err_msg)]
    if not result.ok:
        lines.append(result.failure)
        n = np.shape(scores)[1]
        in_range = result.head is not None and bool(np.all((actual[result.head] >= 0) & (actual[result.head] < n)))
        if in_range:  # a column out of range is the failure itself: no kept sets to show
            pos = np.broadcast_to(np.arange(n), np.shape(scores)) if positions is None else np.asarray(positions)
            h = result.head
            cand = pos[h][actual[h]]
            ref = pos[h][desired[h]]
            lines.append(f"  head {h}: candidate keeps positions {format_position_set(cand)}")
            lines.append(f"  head {h}: reference keeps positions {format_position_set(ref)}")
            only_c = sorted(set(cand.tolist()) - set(ref.tolist()))
            only_r = sorted(set(ref.tolist()) - set(cand.tolist()))
            lines.append(f"  only the candidate keeps {only_c}; only the reference keeps {only_r}")
    if result.ties:
        lines.append(f"ties accepted before the failure: {len(result.ties)}" if not result.ok else
                     f"{len(result.ties)} ties:")
        lines.extend("  " + t.describe() for t in result.ties[:5])
    raise AssertionError("\n".join(lines))


def assert_case(case: VectorCase | dict, *, scores=None, protected=None, kept=None, dtype=None, declare=None,
                tolerance_factor: float = 1.0, strict_ties: bool = False, check_dtype="kind",
                kept_as: str = "columns") -> list:
    """Check a candidate's outputs for one golden test vector (:func:`refkv.oracle.cases.compare_case`).

    Parameters
    ----------
    case : refkv.oracle.VectorCase or dict
        From :func:`load_cases` or :func:`refkv.oracle.read_vectors`, or what
        :func:`refkv.oracle.encode.encode_case` returns.
    scores : (Hkv, n) array_like, optional
    protected : (Hkv, n) bool array_like, optional
    kept : (Hkv, m) int array_like, optional
        Whatever the implementation produces (NumPy arrays, lists, torch tensors including
        bfloat16, jax arrays); at least one must be given. Column indices into the case's
        ``n`` candidates, or token positions with ``kept_as="positions"``.
    dtype : {"float64", "float32", "bfloat16", "float16"}, optional
        The precision your kernel computed in; default the case's own dtype. The
        tolerances derive from it (``docs/oracle/tolerances.rst``): a correct kernel
        needs no manual factor.
    declare : dict, optional
        Declared differences: ``{"scores": "positive_multiple" | "monotone",
        "pinned": "protected" | [positions], "kept_only": True}`` (:mod:`refkv.oracle.declare`).
    tolerance_factor : float
        Explicit override multiplying every tolerance (finite, > 0).
    strict_ties : bool
        Fail on accepted ties too.
    check_dtype : {"kind", True, False}
        As in :func:`assert_scores_close`.
    kept_as : {"columns", "positions"}
        What ``kept`` holds: column indices (default) or the kept tokens' positions
        (``case.inputs["positions"]``). A column out of range, or a position that is not a
        candidate, fails with a message saying which was expected.

    Returns
    -------
    list of accepted ties (:class:`refkv.oracle.retention.Swap`, each with its ``rule``).

    Raises
    ------
    AssertionError
        What differs first, with the case's label and comment (``"scores differ (keydiff
        case 7 [gqa]: ...)"``), then every failure :class:`~refkv.oracle.cases.CaseResult`
        reports, the accepted ties, the declarations and warnings.
    """
    __tracebackhide__ = True
    candidate = {k: v for k, v in (("scores", scores), ("protected", protected), ("kept", kept)) if v is not None}
    if not candidate:
        raise ValueError("give at least one of scores, protected, kept")
    case = as_vector_case(case)
    try:
        result = compare_case(candidate, case, dtype=dtype, declare=declare, tolerance_factor=tolerance_factor,
                              strict_ties=strict_ties, check_dtype=check_dtype, kept_as=kept_as)
    except CandidateError as err:  # NaN, complex, fractional: the kernel's output, so the kernel fails
        raise AssertionError(_headline("the candidate's outputs are refused", f"{case.label}: {case.comment}")
                             + "\n" + str(err)) from None
    if result.ok:
        return result.ties
    first, *rest = result.messages
    what, _, detail = first.partition(": ")
    lines = [_headline(_HEADLINES.get(what, what), f"{case.label}: {case.comment}"), detail]
    lines += rest
    lines += ["tie accepted: " + t.describe() for t in result.ties if not strict_ties]
    lines += result.notes
    raise AssertionError("\n".join(lines))


_HEADLINES = {"scores": "scores differ", "protected": "protected masks differ",
              "kept": "kept tokens differ from the reference",
              "kept (strict ties)": "kept tokens differ from the reference by ties (strict_ties=True)"}
