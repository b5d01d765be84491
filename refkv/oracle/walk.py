"""End to end: walk a run's decisions in order of block, layer and KV head.

Two forms:

* **per block** (the stronger check): the candidate gives the kept positions after every
  block (``kept``, ``kept_count``; in any order within a head: they are compared as sets)
  and the final logits. Decisions are walked in order
  with the reference scores recorded at each. An accepted tie changes the cache, so what
  follows may legitimately differ: a tie at (block ``b``, layer ``l``) makes every
  decision at (``b' > b``, ``l' >= l``) -- and, for a policy that evicts before
  attention, at (``b``, ``l' > l``) -- and the final logits, if they depend on it,
  *unchecked*; the report counts them.
* **final only** (``final_only=True``), for backends that expose only their final cache:
  the candidate gives the kept positions after the last block (``kept`` of shape
  ``(L, Hkv, K)`` or ``(1, L, Hkv, K)``, ``kept_count`` ``(L,)`` or ``(1, L)``) and the
  logits. Per layer and head, each token only the candidate holds must pair with a token
  only the reference holds that was a candidate of the same reference eviction (the one
  that evicted the first) with reference scores within the tie threshold. A tie before
  the last block (or any, for a policy that evicts before attention) leaves the deeper
  layers and the logits unchecked. Weaker: a difference that cancels out within the run
  is not seen.

Score tolerances are :func:`refkv.oracle.tolerance.decision_tolerance` per decision
(``tol_i = rtol * max(|s_i|, m)``, ``m`` the median magnitude of that decision's scores),
with ``rtol`` from :func:`refkv.oracle.tolerance.e2e_rtol`; a swap is a tie when
``|s_i - s_j| <= tol_i + tol_j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..formatting import format_ranges
from ..validation import check_float
from .arrays import Mismatch, as_array, compare_arrays, fmt
from .candidates import validate_end_to_end_candidate
from .declare import Declarations
from .models import is_checkpoint
from .retention import compare_kept
from .status import Outcome, Status
from .tolerance import (
    check_dtype_name,
    decision_tolerance,
    e2e_rtol,
    scale_floor,
    tie_rule_meaningless,
    tolerance_rule,
)

__all__ = ["EndToEndResult", "compare_end_to_end"]


@dataclass
class EndToEndResult(Outcome):
    """Outcome of an end-to-end comparison; ``form`` is ``"per block"`` or ``"final only"``."""

    failure: str | None = None
    ties: list = field(default_factory=list)
    decisions: int = 0
    unchecked: int = 0
    logits: str = ""
    form: str = "per block"
    notes: list = field(default_factory=list)


def compare_end_to_end(candidate: dict, reference: dict, manifest: dict, *, dtype=None, declare=None,
                       tolerance_factor: float = 1.0, strict_ties: bool = False, final_only: bool = False,
                       check_dtype="kind") -> EndToEndResult:
    """Compare a candidate's ``kept``, ``kept_count``, ``logits`` with a reference golden's arrays.

    ``dtype`` is the candidate's precision (default: the golden's); ``declare`` may hold
    ``kept_only`` (the logits are then not compared); ``final_only`` selects the weaker
    final-cache form (module docstring).
    """
    factor = check_float("tolerance_factor", tolerance_factor, 0.0, low_open=True)
    decl = Declarations.parse(declare)
    candidate = validate_end_to_end_candidate(candidate, reference, manifest, final_only=final_only)
    golden_dtype = manifest.get("dtype", "float64")
    name = check_dtype_name(dtype) or golden_dtype
    tol = manifest["tolerance"]
    real = is_checkpoint(manifest)
    rtol = factor * e2e_rtol(tol["scores"]["rtol"], golden_dtype, name, checkpoint=real)
    res = EndToEndResult(form="final only" if final_only else "per block")
    res.notes += decl.lines()
    if factor != 1.0:
        res.notes.append(f"tolerance factor {factor:g} (explicit override of the {name} tolerances)")
    rule = tolerance_rule(name, factor, factor_name="")
    before = bool(manifest["policy"].get("evict_before_attention", False))
    walk = _walk_final if final_only else _walk_blocks
    ties_at = walk(res, candidate, reference, rtol, rule, before, strict_ties)
    if res.failure:
        return res
    if decl.kept_only:
        res.logits = "not compared (declared kept_only)"
        return res
    n_blocks = reference["kept"].shape[0]
    last = n_blocks - 1
    if any(tb < last or (before and tb == last) for tb, _ in ties_at):
        res.logits = "not compared (downstream of an accepted tie)"
        return res
    logits_rtol = factor * e2e_rtol(tol["logits"]["rtol"], golden_dtype, name, checkpoint=real)
    compare_final_logits(res, candidate, reference, logits_rtol, check_dtype, "logits")
    return res


def compare_final_logits(res, candidate: dict, reference: dict, rtol: float, check_dtype, what: str) -> None:
    """The candidate's final logits against the reference's, within ``rtol`` relative to each
    logit and ``rtol`` times the largest finite reference logit absolute: sets ``res.failure``
    (prefixed by ``what``) or ``res.logits`` (the largest difference). Shared by the per-block
    walk and the schedule checker (:mod:`refkv.oracle.rounds`)."""
    ref_logits = np.asarray(reference["logits"], dtype=np.float64)
    atol = rtol * scale_floor(ref_logits)
    logits = as_array(candidate["logits"], "logits")
    mm = compare_arrays(logits, reference["logits"], rtol=rtol, atol=atol, check_dtype=check_dtype,
                        describe_index=lambda i: f"token id {i[0]}")
    if mm:
        res.failure = f"{what}: " + mm.message.replace("\n", "\n  ")
        return
    diff = np.abs(logits.astype(np.float64) - ref_logits)
    res.logits = f"max |diff| {fmt(diff.max()) if diff.size else 0}"


def _check_counts(res, counts_c, counts_r, what="kept_count") -> bool:
    mm = compare_arrays(counts_c, counts_r, check_dtype=False)
    if mm and mm.kind == "values":
        idx = mm.index
        place = f"block {idx[0]}, layer {idx[1]}" if len(idx) == 2 else f"layer {idx[0]}"
        mm = Mismatch("values", f"{place}: candidate holds {int(counts_c[idx])} tokens per head, "
                                f"the reference {int(counts_r[idx])}")
    if mm:
        res.failure = f"{what}: {mm.message}"
        return False
    return True


def _check_kept_array(res, kept_c, shape) -> bool:
    if kept_c.shape != shape:
        res.failure = f"kept: shape mismatch: actual {kept_c.shape}, desired {shape}"
        return False
    if kept_c.dtype.kind not in "iu":
        res.failure = f"kept: dtype mismatch: kept positions must be integers, got {kept_c.dtype}"
        return False
    return True


def _note_meaningless(res, scores, rtol, where):
    if tie_rule_meaningless(scores, decision_tolerance(scores, rtol)):
        res.notes.append(f"warning: at {where} the tie rule accepts any swap (every pair of scores is within "
                         f"tolerance): not a meaningful check there")


def downstream(step: int, layer: int, marks, before: bool) -> bool:
    """Whether the decision at (``step``, ``layer``) follows one marked in ``marks`` (pairs of
    step and layer where an accepted tie or a divergence changed the cache): every later
    step at that layer or above, and, for a policy that evicts before attention, the
    layers above it in the same step. Such a decision may legitimately differ."""
    return any((step > s and layer >= m) or (before and step == s and layer > m) for s, m in marks)


def _walk_blocks(res, candidate, reference, rtol, rule, before, strict_ties) -> list:
    counts_c = as_array(candidate["kept_count"], "kept_count")
    counts_r = reference["kept_count"]
    if not _check_counts(res, counts_c, counts_r):
        return []
    kept_c, kept_r = as_array(candidate["kept"], "kept"), reference["kept"]
    if not _check_kept_array(res, kept_c, kept_r.shape):
        return []
    cand_pos, cand_n = reference["candidates"], reference["candidate_count"]
    scores, protected = reference["scores"], reference["protected"]
    n_blocks, n_layers, hkv, _ = kept_r.shape
    tie_at: list[tuple[int, int]] = []

    def tainted(b: int, l: int) -> bool:
        return downstream(b, l, tie_at, before)

    for b in range(n_blocks):
        for l in range(n_layers):
            if tainted(b, l):
                res.unchecked += 1
                continue
            res.decisions += 1
            k = int(counts_r[b, l])
            tie_here = False
            for h in range(hkv):
                # Kept positions are a set: a cache whose rows are a permutation of them holds the
                # same tokens (kvpress gathers rows in score order).
                a_pos, r_pos = _as_set(kept_c[b, l, h, :k]), kept_r[b, l, h, :k]
                if np.array_equal(a_pos, r_pos):
                    continue
                where = f"block {b}, layer {l}, head {h}"
                c = int(cand_n[b, l])
                if c == 0:
                    res.failure = (f"{where}: kept positions differ but the reference did not evict here "
                                   f"(candidate {format_ranges(a_pos)}, reference {format_ranges(r_pos)})")
                    return tie_at
                # Tokens that arrived after an evict-before-attention decision are not
                # among its candidates; those must simply agree.
                pos_row = cand_pos[b, l, h, :c]
                in_a, in_r = np.isin(a_pos, pos_row), np.isin(r_pos, pos_row)
                if not np.array_equal(np.sort(a_pos[~in_a]), r_pos[~in_r]):
                    odd = sorted(set(a_pos[~in_a].tolist()) ^ set(r_pos[~in_r].tolist()))
                    res.failure = (f"{where}: position {odd[0]} is held by one side only and was not among "
                                   f"this eviction's candidates")
                    return tie_at
                row = scores[b, l, h, :c]
                status, swap, message = compare_kept(
                    np.searchsorted(pos_row, a_pos[in_a]), np.searchsorted(pos_row, r_pos[in_r]), row, pos_row,
                    protected[b, l, h, :c], tolerance=decision_tolerance(row, rtol), rule=rule, where=where)
                if status is Status.FAIL:
                    res.failure = message
                    return tie_at
                if status is Status.TIE:
                    res.ties.append(swap)
                    tie_here = True
                    _note_meaningless(res, row, rtol, where)
                    if strict_ties:
                        res.failure = "strict ties: " + swap.describe()
                        return tie_at
            if tie_here:
                tie_at.append((b, l))
    return tie_at


def _final_arrays(candidate):
    kept_c = as_array(candidate["kept"], "kept")
    counts_c = as_array(candidate["kept_count"], "kept_count")
    if kept_c.ndim == 4 and kept_c.shape[0] >= 1:
        kept_c = kept_c[-1]
    if counts_c.ndim == 2 and counts_c.shape[0] >= 1:
        counts_c = counts_c[-1]
    return kept_c, counts_c


def _walk_final(res, candidate, reference, rtol, rule, before, strict_ties) -> list:
    kept_c, counts_c = _final_arrays(candidate)
    kept_all, counts_all = reference["kept"], reference["kept_count"]
    n_blocks, n_layers, hkv, width = kept_all.shape
    last = n_blocks - 1
    if not _check_counts(res, counts_c, counts_all[last], "final kept_count"):
        return []
    if not _check_kept_array(res, kept_c, (n_layers, hkv, width)):
        return []
    cand_pos, cand_n = reference["candidates"], reference["candidate_count"]
    scores, protected = reference["scores"], reference["protected"]
    tie_at: list[tuple[int, int]] = []
    for l in range(n_layers):
        if any(tl < l and (tb < last or before) for tb, tl in tie_at):
            res.unchecked += 1
            continue
        res.decisions += 1
        k = int(counts_all[last, l])
        for h in range(hkv):
            a_pos, r_pos = kept_c[l, h, :k], kept_all[last, l, h, :k]
            extra = sorted(set(a_pos.tolist()) - set(r_pos.tolist()))
            dropped = sorted(set(r_pos.tolist()) - set(a_pos.tolist()))
            if len(set(a_pos.tolist())) != k:
                res.failure = f"final cache, layer {l}, head {h}: candidate holds a position twice"
                return tie_at
            for e in extra:
                where = f"final cache, layer {l}, head {h}"
                evicted = _evicting_block(e, l, h, cand_pos, cand_n, kept_all, counts_all)
                if evicted is None:
                    res.failure = (f"{where}: candidate holds position {e}, which the reference never had "
                                   f"as a candidate of an eviction")
                    return tie_at
                b = evicted
                c = int(cand_n[b, l])
                row_pos, row = cand_pos[b, l, h, :c], scores[b, l, h, :c]
                options = [d for d in dropped if d in set(row_pos.tolist())]
                if not options:
                    res.failure = (f"{where} (reference eviction at block {b}): candidate holds position {e} "
                                   f"instead of {format_ranges(dropped)}, none of which was a candidate of that "
                                   "eviction")
                    return tie_at
                col = {int(p): i for i, p in enumerate(row_pos)}
                d = min(options, key=lambda p: abs(row[col[p]] - row[col[e]]))
                status, swap, message = compare_kept(
                    np.array([col[e]]), np.array([col[d]]), row, row_pos, protected[b, l, h, :c],
                    tolerance=decision_tolerance(row, rtol), rule=rule,
                    where=f"{where} (reference eviction at block {b})")
                if status is Status.FAIL:
                    res.failure = message
                    return tie_at
                dropped.remove(d)
                res.ties.append(swap)
                tie_at.append((b, l))
                _note_meaningless(res, row, rtol, f"block {b}, layer {l}, head {h}")
                if strict_ties:
                    res.failure = "strict ties: " + swap.describe()
                    return tie_at
    return tie_at


def _evicting_block(position, layer, head, cand_pos, cand_n, kept, counts) -> int | None:
    """The reference eviction (block) at ``layer``/``head`` that had ``position`` as a candidate and dropped it."""
    for b in range(kept.shape[0]):
        c = int(cand_n[b, layer])
        if c == 0 or position not in cand_pos[b, layer, head, :c]:
            continue
        if position not in kept[b, layer, head, :int(counts[b, layer])]:
            return b
    return None


def _as_set(row: np.ndarray) -> np.ndarray:
    """A kept row in the reference's order: its positions sorted, then its ``-1`` padding
    (a head of an uneven budget holds fewer tokens than the widest head of its layer)."""
    row = np.asarray(row)
    return np.concatenate([np.sort(row[row >= 0]), row[row < 0]])
