"""Retention compared tie-aware: kept sets, swaps, and the rule that accepted each tie.

Per KV head, let ``dropped`` be the tokens the reference keeps and the candidate evicts,
and ``extra`` the tokens the candidate keeps instead. The head passes if the sets are
equal; it is a **tie** (accepted, and reported with the rule that accepted it) if nothing
protected was dropped and every pair ``(d, e)`` of ``dropped x extra`` has reference
scores within the tie threshold; else it fails, and the report names the pair that is
furthest outside it.

The threshold of a pair is, in order of preference:

* ``tol_d + tol_e`` with per-token tolerances (:func:`refkv.oracle.tolerance.score_tolerance`:
  the candidate's dtype at each score's own scale) -- the oracle's rule;
* ``atol + rtol * max(|s_d|, |s_e|)`` with tolerances you give (:mod:`refkv.testing`).

Equal reference scores are always a tie ("at most", so an exact tie is accepted even at
tolerance 0), and the rule says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from .arrays import fmt, fmt_pair
from .status import Outcome, Status

__all__ = ["RetentionResult", "Swap", "compare_kept", "compare_ranking", "compare_retention", "compare_uneven"]

EXACT_RULE = "exact tie: equal reference scores"


@dataclass(frozen=True)
class Swap:
    """A token the candidate keeps (``kept_*``) in place of one the reference keeps (``dropped_*``).

    ``rule`` says what accepted (or would have accepted) the swap.
    """

    where: str
    kept_position: int
    kept_score: float
    dropped_position: int
    dropped_score: float
    gap: float
    threshold: float
    dropped_protected: bool = False
    rule: str = ""

    @property
    def accepted(self) -> bool:
        return not self.dropped_protected and (self.gap == 0.0 or abs(self.gap) <= self.threshold)

    def describe(self) -> str:
        if self.dropped_protected:
            return (f"{self.where}: candidate evicts position {self.dropped_position}, which the reference "
                    f"protects (must stay), and keeps position {self.kept_position} "
                    f"(reference score {fmt(self.kept_score)})")
        kept, dropped = fmt_pair(self.kept_score, self.dropped_score)
        text = (f"{self.where}: candidate keeps position {self.kept_position} (reference score {kept}) "
                f"instead of position {self.dropped_position} (reference score {dropped}); |difference| "
                f"{fmt(abs(self.gap), 4)} {'<=' if self.accepted else '>'} tolerance {fmt(self.threshold, 4)}")
        return text + (f" [{self.rule}]" if self.rule else "")


@dataclass
class RetentionResult(Outcome):
    """Outcome of a retention comparison: accepted ties, and the first failure if any."""

    ties: list = field(default_factory=list)
    failure: str | None = None
    swap: Swap | None = None
    head: int | None = None



def _threshold(sd: float, se: float, cd: int, ce: int, tolerance, rtol: float, atol: float) -> float:
    if tolerance is not None:
        return float(tolerance[cd] + tolerance[ce])
    finite = [abs(v) for v in (sd, se) if np.isfinite(v)]
    return atol + rtol * (max(finite) if finite else 0.0)


def compare_kept(actual_cols, desired_cols, scores, positions, protected, *, rtol: float = 0.0, atol: float = 0.0,
                 tolerance=None, rule: str = "", where: str) -> tuple[Status, Swap | None, str | None]:
    """Compare one head's kept columns; return ``(status, swap, message)``.

    ``status`` is ``Status.EQUAL``, ``Status.TIE`` or ``Status.FAIL``; ``swap`` the
    deciding pair (for a tie or a score failure); ``message`` a failure's text.
    ``tolerance`` (one per column) takes precedence over ``rtol``/``atol``; ``rule``
    names it in the report.
    """
    n = len(scores)
    actual_cols = np.asarray(actual_cols)
    out = actual_cols[(actual_cols < 0) | (actual_cols >= n)]
    if out.size:
        return Status.FAIL, None, f"{where}: candidate keeps column {int(out[0])}, outside [0, {n - 1}]"
    values, counts = np.unique(actual_cols, return_counts=True)
    if (counts > 1).any():
        col = int(values[counts > 1][0])
        return Status.FAIL, None, f"{where}: candidate keeps position {int(positions[col])} (column {col}) twice"
    a, d = set(actual_cols.tolist()), set(np.asarray(desired_cols).tolist())
    extra, dropped = sorted(a - d), sorted(d - a)
    if not extra and not dropped:
        return Status.EQUAL, None, None
    if len(extra) != len(dropped):
        return Status.FAIL, None, f"{where}: candidate keeps {len(a)} tokens, the reference {len(d)}"
    prot = [c for c in dropped if protected[c]]
    if prot:
        worst = min(extra, key=lambda c: (scores[c], positions[c]))
        s = Swap(where, int(positions[worst]), float(scores[worst]), int(positions[prot[0]]),
                 float(scores[prot[0]]), np.inf, 0.0, dropped_protected=True)
        return Status.FAIL, s, s.describe()
    worst_swap, worst_excess = None, -np.inf
    for dc in dropped:
        for ec in extra:
            sd, se = float(scores[dc]), float(scores[ec])
            gap = 0.0 if sd == se else sd - se  # nan or inf when a score is not finite: never a tie
            threshold = _threshold(sd, se, dc, ec, tolerance, rtol, atol)
            excess = (abs(gap) - threshold if gap else -np.inf) if np.isfinite(gap) else np.inf
            if worst_swap is None or excess > worst_excess:
                worst_excess = excess
                worst_swap = Swap(where, int(positions[ec]), se, int(positions[dc]), sd, gap, threshold,
                                  rule=EXACT_RULE if gap == 0.0 else rule)
    if worst_excess <= 0:
        return Status.TIE, worst_swap, None
    return Status.FAIL, worst_swap, worst_swap.describe()


def _head_where(h: int) -> str:
    return f"head {h}"


def compare_retention(actual, desired, scores, *, positions=None, protected=None, rtol: float = 0.0,
                      atol: float = 0.0, tolerance=None, rule: str = "",
                      where: Callable[[int], str] = _head_where) -> RetentionResult:
    """Tie-aware comparison of kept column indices, (Hkv, m) each, over (Hkv, n) reference scores.

    Shape and dtype (integer) are checked first. Returns every accepted tie and the first
    failing head (in head order). ``tolerance`` is an optional (Hkv, n) array of per-score
    tolerances (used instead of ``rtol``/``atol``).
    """
    from .arrays import as_array

    actual, desired = as_array(actual, "kept"), np.asarray(desired)
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2:
        raise ValueError(f"scores must have shape (Hkv, n), got {scores.shape}")
    if positions is None:
        positions = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    if protected is None:
        protected = np.zeros(scores.shape, dtype=bool)
    positions, protected = np.asarray(positions), np.asarray(protected)
    arrays = (("positions", positions), ("protected", protected))
    if tolerance is not None:
        tolerance = np.asarray(tolerance, dtype=np.float64)
        arrays += (("tolerance", tolerance),)
    for name, arr in arrays:
        if arr.shape != scores.shape:
            raise ValueError(f"{name} must have the shape of scores {scores.shape}, got {arr.shape}")
    result = RetentionResult()
    if actual.shape != desired.shape:
        result.failure = f"shape mismatch: candidate kept {actual.shape}, reference kept {desired.shape}"
        return result
    if actual.size and actual.dtype.kind not in "iu":
        result.failure = f"dtype mismatch: kept indices must be integers, got {actual.dtype}"
        return result
    if desired.ndim != 2 or desired.shape[0] != scores.shape[0]:
        raise ValueError(f"kept must have shape (Hkv, m) with Hkv = {scores.shape[0]}, got {desired.shape}")
    for h in range(scores.shape[0]):
        status, swap, message = compare_kept(actual[h], desired[h], scores[h], positions[h], protected[h],
                                             rtol=rtol, atol=atol, rule=rule, where=where(h),
                                             tolerance=None if tolerance is None else tolerance[h])
        if status is Status.TIE:
            result.ties.append(swap)
        elif status is Status.FAIL:
            result.failure, result.swap, result.head = message, swap, h
            return result
    return result


def compare_uneven(actual: list, desired: list, scores, *, positions, protected, lengths, tolerance=None,
                   rule: str = "") -> RetentionResult:
    """Kept sets when the heads keep different counts (uneven budgets, AdaKV).

    Parameters
    ----------
    actual, desired : list of ``Hkv`` 1-D int arrays
        Column indices each head keeps (candidate, reference).
    scores, positions, protected, tolerance : (Hkv, n) arrays
        As for :func:`compare_retention`; columns at or past ``lengths[h]`` are empty slots.
    lengths : (Hkv,) ints
        Real candidates per head.

    Where every head keeps the reference's count, each head is compared as
    :func:`compare_retention` does. Where the counts differ but the layer's total agrees,
    the heads are **pooled** (the allocation is one selection over the whole layer, so a
    token may move from one head to another): the layer's kept tokens are compared as one
    set, a swap between heads accepted only within the tie threshold of the two reference
    scores. A different total fails, and the message states both allocations.
    """
    scores = np.asarray(scores, dtype=np.float64)
    hkv = scores.shape[0]
    result = RetentionResult()
    c_counts, r_counts = [len(a) for a in actual], [len(d) for d in desired]
    state = (f"candidate keeps {c_counts} per head (total {sum(c_counts)}), "
             f"the reference {r_counts} (total {sum(r_counts)})")
    if sum(c_counts) != sum(r_counts):
        result.failure = f"the layer's total differs: {state}"
        return result
    for h in range(hkv):
        if len(actual[h]) and (actual[h].min() < 0 or actual[h].max() >= lengths[h]):
            bad = int(actual[h][(actual[h] < 0) | (actual[h] >= lengths[h])][0])
            result.failure = (f"head {h}: candidate keeps column {bad}, outside the head's {int(lengths[h])} real "
                              f"candidates [0, {int(lengths[h]) - 1}] (past them are empty slots)")
            result.head = h
            return result
    tol = None if tolerance is None else np.asarray(tolerance, dtype=np.float64)
    if c_counts == r_counts:
        for h in range(hkv):
            n_h = int(lengths[h])
            status, swap, message = compare_kept(actual[h], desired[h], scores[h, :n_h], positions[h, :n_h],
                                                 protected[h, :n_h], rule=rule, where=_head_where(h),
                                                 tolerance=None if tol is None else tol[h, :n_h])
            if status is Status.TIE:
                result.ties.append(swap)
            elif status is Status.FAIL:
                result.failure, result.swap, result.head = message, swap, h
                return result
        return result
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = [np.concatenate([scores[h, :lengths[h]] for h in range(hkv)]),
            np.concatenate([positions[h, :lengths[h]] for h in range(hkv)]),
            np.concatenate([protected[h, :lengths[h]] for h in range(hkv)])]
    status, swap, message = compare_kept(
        np.concatenate([offsets[h] + actual[h] for h in range(hkv)]),
        np.concatenate([offsets[h] + desired[h] for h in range(hkv)]), *flat, rule=rule,
        where=f"heads pooled ({state})",
        tolerance=None if tol is None else np.concatenate([tol[h, :lengths[h]] for h in range(hkv)]))
    if swap is not None:
        # Name the heads: the pooled row's positions alone do not say which head moved.
        moved_in = [h for h in range(hkv) if swap.kept_position in positions[h, actual[h]]
                    and swap.kept_position not in positions[h, desired[h]]]
        moved_out = [h for h in range(hkv) if swap.dropped_position in positions[h, desired[h]]
                     and swap.dropped_position not in positions[h, actual[h]]]
        if moved_in and moved_out:
            heads = (f"head {moved_in[0]}" if moved_in[0] == moved_out[0] else
                     f"kept in head {moved_in[0]}, evicted from head {moved_out[0]}")
            swap = replace(swap, where=f"heads pooled, {heads} ({state})")
            message = swap.describe() if status is Status.FAIL else message
    if status is Status.TIE:
        result.ties.append(swap)
    elif status is Status.FAIL:
        result.failure, result.swap = message, swap
    return result


def compare_ranking(actual, desired, tolerance, positions, compared) -> str | None:
    """First pair the reference orders beyond tolerance and the candidate orders the other way.

    For declared ``monotone`` scores: if ``s_i - s_j > tol_i + tol_j`` then the candidate
    must not score ``i`` below ``j`` (equal is allowed: a monotone transform may merge
    values). Only ``compared`` columns (not pinned, finite in the reference) take part, and
    there the candidate's score must be finite too: a monotone transform of a finite score
    is finite, and a NaN compares false with everything (all-NaN scores would otherwise
    flip no pair and pass). Returns the failure's text, or None.
    """
    for h in range(desired.shape[0]):
        bad = np.flatnonzero(compared[h] & np.isfinite(desired[h]) & ~np.isfinite(actual[h]))
        if bad.size:
            c = bad[0]
            return (f"head {h}: position {int(positions[h, c])} has the non-finite score {actual[h, c]} in the "
                    f"candidate, {desired[h, c]:g} in the reference ({bad.size} such positions in this head)")
        cols = np.flatnonzero(compared[h] & np.isfinite(desired[h]))
        s, a, t = desired[h, cols], actual[h, cols], tolerance[h, cols]
        ordered = (s[:, None] - s[None, :]) > (t[:, None] + t[None, :])
        flipped = ordered & (a[:, None] < a[None, :])
        if flipped.any():
            i, j = np.argwhere(flipped)[np.argmax((s[:, None] - s[None, :])[flipped])]
            ci, cj = cols[i], cols[j]
            si, sj = fmt_pair(s[i], s[j])
            ai, aj = fmt_pair(a[i], a[j])
            return (f"head {h}: the reference ranks position {int(positions[h, ci])} (score {si}) above position "
                    f"{int(positions[h, cj])} (score {sj}) beyond tolerance, the candidate below ({ai} < {aj})")
    return None
