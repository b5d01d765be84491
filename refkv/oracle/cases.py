"""One vector case: a candidate's scores, protected mask and kept set against the reference.

:func:`compare_case` is the one implementation; :func:`refkv.testing.assert_case` and
``refkv golden check`` both format its :class:`CaseResult`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..formatting import format_ranges
from ..validation import check_choice, check_float
from .arrays import as_array, compare_arrays
from .candidates import validate_case_candidate
from .declare import Declarations
from .retention import compare_ranking, compare_retention
from .status import Status
from .tolerance import check_dtype_name, score_tolerance, tie_rule_meaningless, tolerance_rule
from .vectors import as_vector_case

__all__ = ["KEPT_AS", "CaseResult", "compare_case", "compare_scores", "describe_position"]

#: How a candidate's ``kept`` names its tokens: column indices into the case's candidates
#: (the format's own), or the tokens' positions (``inputs["positions"]``).
KEPT_AS = ("columns", "positions")


@dataclass
class CaseResult:
    """Outcome of one vector case.

    Attributes
    ----------
    label : str
    status : Status
        ``OK``, ``TIE`` (ok with accepted ties) or ``FAIL``.
    messages : list of str
        The failures, one per comparison that failed.
    ties : list of Swap
        Accepted ties, each with the rule that accepted it.
    notes : list of str
        What was compared and how: the dtype, declarations, an override factor, and a
        warning where the tie rule cannot tell any two tokens apart.
    """

    label: str
    status: Status
    messages: list = field(default_factory=list)
    ties: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status.passed

    def format(self) -> str:
        """The result as text: a first line with the verdict, then failures, ties and notes."""
        lines = [f"{self.label}: {self.status.value.upper()}"]
        lines += ["  " + m.replace("\n", "\n    ") for m in self.messages]
        lines += ["  tie accepted: " + t.describe() for t in self.ties]
        lines += ["  " + n for n in self.notes]
        return "\n".join(lines)


def describe_position(positions: np.ndarray) -> Callable[[tuple], str]:
    """An index namer: ``(h, c)`` -> ``"head h, position p (column c)"``."""
    positions = np.asarray(positions)

    def describe(index: tuple) -> str:
        if len(index) == 2 and positions.ndim == 2:
            h, c = index
            return f"head {h}, position {int(positions[h, c])} (column {c})"
        return "index " + (str(index[0]) if len(index) == 1 else str(tuple(int(i) for i in index)))
    return describe


def compare_case(candidate: dict, reference, *, dtype=None, declare=None, tolerance_factor: float = 1.0,
                 strict_ties: bool = False, check_dtype="kind", kept_as: str = "columns") -> CaseResult:
    """Compare a candidate's outputs with a reference :class:`~refkv.oracle.vectors.VectorCase`.

    Parameters
    ----------
    candidate : dict
        Any of ``"scores"`` (Hkv, n), ``"protected"`` (Hkv, n) bool, ``"kept"`` (Hkv, m)
        column indices (or positions, ``kept_as``); array-likes
        (:func:`refkv.oracle.arrays.as_array`).
    reference : VectorCase or dict
        A case, or what :func:`refkv.oracle.encode.encode_case` returns
        (:func:`refkv.oracle.vectors.as_vector_case`).
    dtype : {"float64", "float32", "bfloat16", "float16"}, optional
        The precision the candidate computed in; default the case's own dtype. Score
        tolerances derive from it (:func:`refkv.oracle.tolerance.score_tolerance`).
    declare : dict or Declarations, optional
        Declared differences (:mod:`refkv.oracle.declare`).
    tolerance_factor : float
        Explicit override: multiplies every tolerance; finite and > 0.
    strict_ties : bool
        Accepted ties fail too.
    check_dtype : {"kind", True, False}
        As in :func:`refkv.oracle.arrays.compare_arrays`.
    kept_as : {"columns", "positions"}
        What ``kept`` holds: column indices into the case's ``n`` candidates (default, the
        format's), or the kept tokens' positions (``inputs["positions"]``), converted per
        head. A column outside ``[0, n - 1]`` or a position that is not a candidate fails
        with a message naming which was expected.
    """
    factor = check_float("tolerance_factor", tolerance_factor, 0.0, low_open=True)
    kept_as = check_choice("kept_as", kept_as, KEPT_AS)
    reference = as_vector_case(reference)
    name = check_dtype_name(dtype) or reference.dtype
    decl = Declarations.parse(declare)
    unknown = sorted(set(candidate) - {"scores", "protected", "kept"})
    if unknown:
        raise ValueError(f"candidate has unknown entries {unknown}; allowed: scores, protected, kept")
    candidate = validate_case_candidate(candidate, reference, declare=decl)
    ref = reference.outputs
    positions = reference.inputs["positions"]
    result = CaseResult(reference.label, Status.OK)
    result.notes += decl.lines()
    if factor != 1.0:
        result.notes.append(f"tolerance factor {factor:g} (explicit override of the {name} tolerances)")
    describe = describe_position(positions)
    tol_cache: list = []

    def tolerance() -> np.ndarray:
        if not tol_cache:
            tol_cache.append(factor * score_tolerance(reference, name))
        return tol_cache[0]

    ref_scores = np.asarray(ref["scores"], dtype=np.float64)
    if "scores" in candidate and not decl.kept_only:
        cand = as_array(candidate["scores"], "scores")
        pinned = decl.pinned_mask(positions, ref["protected"])
        message = compare_scores(cand, ref["scores"], decl.scores, pinned, tolerance, describe, positions,
                                  check_dtype)
        if message:
            result.messages.append(message)
    if "protected" in candidate:
        mm = compare_arrays(as_array(candidate["protected"], "protected"), ref["protected"],
                            check_dtype=check_dtype, describe_index=describe)
        if mm:
            result.messages.append("protected: " + mm.message.replace("\n", "\n  "))
    uneven = "kept" in candidate and (reference.head_budgets is not None or _ragged(candidate["kept"]))
    if uneven:
        _compare_uneven(result, candidate["kept"], reference, ref_scores, positions, kept_as, tolerance,
                        tolerance_rule(name, factor), strict_ties)
    kept, problem = (_kept_columns(as_array(candidate["kept"], "kept"), positions, kept_as)
                     if "kept" in candidate and not uneven else (None, None))
    if problem:
        result.messages.append("kept: " + problem)
    elif kept is not None:
        exact = kept.shape == ref["kept"].shape and np.array_equal(kept, ref["kept"])
        ret = compare_retention(kept, ref["kept"], ref_scores, positions=positions, protected=ref["protected"],
                                tolerance=None if exact else tolerance(), rule=tolerance_rule(name, factor))
        if not ret.ok:
            result.messages.append("kept: " + ret.failure + _kept_sets(ret.head, kept, ref["kept"], positions)
                                   + _positions_hint(kept, positions, ref["kept"], kept_as))
        result.ties = ret.ties
        if strict_ties and ret.ties:
            result.messages.extend("kept (strict ties): " + t.describe() for t in ret.ties)
    if factor != 1.0:
        tolerance()  # an override is checked for meaning even where nothing differs
    if tol_cache:
        heads = [h for h in range(ref_scores.shape[0])
                 if tie_rule_meaningless(ref_scores[h], tol_cache[0][h], ~np.asarray(ref["protected"][h]))]
        if heads:
            result.notes.append(f"warning: at {name} precision{f' x {factor:g}' if factor != 1 else ''} the tie "
                                f"rule accepts any swap in head(s) {heads} (every pair of scores is within "
                                f"tolerance): kept sets there are not a meaningful check")
    if result.messages:
        result.status = Status.FAIL
    elif result.ties:
        result.status = Status.TIE
    return result


def _ragged(kept) -> bool:
    """Whether a candidate's ``kept`` is rows of different lengths (a head keeping fewer tokens).

    (An array padded with ``-1`` is read as uneven only against a reference with
    ``head_budgets``; against an even one, a ``-1`` is a column outside the candidates.)
    """
    return (isinstance(kept, (list, tuple)) and len(kept) > 0
            and all(isinstance(row, (list, tuple, np.ndarray)) for row in kept)
            and len({len(row) for row in kept}) > 1)


def _rows(kept, hkv: int) -> list[np.ndarray] | str:
    """A candidate's kept rows without their ``-1`` padding, or the reason they cannot be read."""
    try:
        rows = [np.asarray(row) for row in kept]
    except TypeError:
        return f"kept must hold one row per KV head ({hkv}), got {type(kept).__name__}"
    if len(rows) != hkv or any(row.ndim != 1 for row in rows):
        return f"kept must hold {hkv} rows (one per KV head), got {len(rows)}"
    for h, row in enumerate(rows):
        if row.size and row.dtype.kind not in "iu":
            return f"head {h}: kept must hold integers, got {row.dtype}"
    return [row[row != -1].astype(np.int64) for row in rows]


def _compare_uneven(result, kept, reference, ref_scores, positions, kept_as, tolerance, rule, strict_ties) -> None:
    """Kept sets of a case whose heads keep different counts (uneven budgets, AdaKV).

    Each head's tokens are compared with :func:`~refkv.oracle.retention.compare_uneven`:
    per head where the counts agree, pooled over the layer's heads where they differ (the
    allocation moved tokens between heads; accepted only as ties of the reference scores).
    """
    from .retention import compare_uneven

    hkv, n = positions.shape
    lengths = np.count_nonzero(positions != -1, axis=1)
    ref_kept = reference.outputs["kept"]
    counts = reference.head_budgets or tuple([min(reference.budget, n)] * hkv)
    desired = [np.asarray(ref_kept[h][:c], dtype=np.int64) for h, c in enumerate(counts)]
    rows = _rows(kept, hkv)
    if isinstance(rows, str):
        result.messages.append("kept: " + rows)
        return
    if kept_as == "positions":
        converted = []
        for h, row in enumerate(rows):
            column_of = {int(p): c for c, p in enumerate(positions[h][:lengths[h]])}
            missing = [int(p) for p in row if int(p) not in column_of]
            if missing:
                result.messages.append(f"kept: head {h}: candidate keeps position {missing[0]}, which is not among "
                                       f"the case's candidates: with kept_as='positions' kept must hold token "
                                       f"positions (inputs['positions']), not column indices")
                return
            converted.append(np.array([column_of[int(p)] for p in row], dtype=np.int64))
        rows = converted
    ret = compare_uneven(rows, desired, ref_scores, positions=positions, protected=reference.outputs["protected"],
                         lengths=lengths, tolerance=tolerance(), rule=rule)
    if not ret.ok:
        result.messages.append("kept: " + ret.failure)
    result.ties = ret.ties
    if strict_ties and ret.ties:
        result.messages.extend("kept (strict ties): " + t.describe() for t in ret.ties)


def _kept_columns(kept: np.ndarray, positions: np.ndarray, kept_as: str):
    """``(columns, None)``, or ``(None, message)`` where ``kept`` cannot name candidates as ``kept_as`` says.

    Arrays of the wrong shape or dtype pass through: the retention comparison reports those.
    """
    hkv, n = positions.shape
    if kept.ndim != 2 or kept.shape[0] != hkv or kept.dtype.kind not in "iu":
        return kept, None
    if kept_as == "columns":
        outside = np.argwhere((kept < 0) | (kept >= n))
        if outside.size:
            h, i = outside[0]
            hint = (" (they look like token positions: pass kept_as='positions')"
                    if _as_positions(kept, positions) is not None else "")
            return None, (f"head {h}: candidate keeps column {int(kept[h, i])}, outside [0, {n - 1}]: kept must "
                          f"hold column indices into the case's {n} candidates, not token positions{hint}")
        return kept, None
    columns = _as_positions(kept, positions)
    if columns is None:
        for h in range(hkv):
            missing = sorted(set(kept[h].tolist()) - set(positions[h].tolist()))
            if missing:
                return None, (f"head {h}: candidate keeps position {missing[0]}, which is not among the case's "
                              f"candidates: with kept_as='positions' kept must hold token positions "
                              f"(inputs['positions']), not column indices")
    return columns, None


def _as_positions(kept: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
    """Per head, the columns holding the positions ``kept`` names; None if one is not a candidate."""
    columns = np.empty(kept.shape, dtype=np.int64)
    for h in range(positions.shape[0]):
        column_of = {int(p): c for c, p in enumerate(positions[h])}
        try:
            columns[h] = [column_of[int(p)] for p in kept[h]]
        except KeyError:
            return None
    return columns


def _positions_hint(kept, positions, desired, kept_as) -> str:
    """A hint when failing column indices, read as positions, would be exactly the reference's kept set."""
    if kept_as != "columns" or kept.shape != desired.shape:
        return ""
    as_columns = _as_positions(kept, positions)
    if as_columns is None or not all(set(a.tolist()) == set(d.tolist()) for a, d in zip(as_columns, desired)):
        return ""
    return "\n  kept holds the reference's kept positions: pass kept_as='positions' if they are positions"


def _kept_sets(h, kept, desired, positions) -> str:
    """The two kept sets of the failing head, by position (empty if the failure is not per head)."""
    if h is None:
        return ""
    cand, ref = np.sort(positions[h][kept[h]]), np.sort(positions[h][desired[h]])
    only_c = sorted(set(cand.tolist()) - set(ref.tolist()))
    only_r = sorted(set(ref.tolist()) - set(cand.tolist()))
    return (f"\n  head {h}: candidate keeps positions {format_ranges(cand)}"
            f"\n  head {h}: reference keeps positions {format_ranges(ref)}"
            f"\n  only the candidate keeps {only_c}; only the reference keeps {only_r}")


def compare_scores(cand, ref, relation, pinned, tolerance, describe, positions, check_dtype) -> str | None:
    """A candidate's scores ``cand`` against the reference's ``ref`` (Hkv, n) by the declared
    ``relation`` (``"exact"``: within ``tolerance()``; ``"positive_multiple"``: after rescaling by
    the median ratio per head; ``"monotone"``: the same order); the failure's text, or None.
    ``pinned`` columns are not compared. Shared by vector cases and schedule rounds."""
    ref = np.asarray(ref)
    if cand.shape != ref.shape:
        return f"scores: shape mismatch: actual {cand.shape}, desired {ref.shape}"
    if relation == "exact":
        if np.array_equal(cand, ref, equal_nan=True) and cand.dtype.kind == ref.dtype.kind:
            return None
        actual = np.where(pinned, ref, cand) if pinned.any() else cand
        mm = compare_arrays(actual, ref, atol=tolerance(), check_dtype=check_dtype, describe_index=describe)
        return None if mm is None else "scores: " + mm.message.replace("\n", "\n  ")
    if cand.dtype.kind != "f" and check_dtype:
        return f"scores: dtype mismatch: candidate scores must be floats, got {cand.dtype}"
    a = cand.astype(np.float64)
    s = ref.astype(np.float64)
    tol = tolerance()
    compared = ~pinned & np.isfinite(s)
    if relation == "positive_multiple":
        rescaled = np.empty_like(a)
        rel = np.empty(a.shape[0])
        for h in range(a.shape[0]):
            use = compared[h] & (np.abs(s[h]) > tol[h]) & np.isfinite(a[h])
            if not use.any():
                rescaled[h], rel[h] = a[h], 0.0
                continue
            c = float(np.median(a[h, use] / s[h, use]))
            if not (np.isfinite(c) and c > 0):
                return f"scores (declared positive_multiple): head {h}: the ratio to the reference is {c:g}, not > 0"
            rescaled[h] = a[h] / c
            rel[h] = float(np.median(tol[h, use] / np.abs(s[h, use])))
        slack = tol + rel[:, None] * np.abs(s)  # the estimated c carries the tolerance of a typical score
        mm = compare_arrays(np.where(compared, rescaled, s), s, atol=slack, check_dtype=False,
                            describe_index=describe)
        if mm:
            return ("scores (declared positive_multiple, rescaled by the median ratio per head): "
                    + mm.message.replace("\n", "\n  "))
        return None
    message = compare_ranking(a, s, tol, positions, compared)
    return None if message is None else "scores (declared monotone): " + message
