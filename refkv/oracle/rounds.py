"""Schedule goldens: a candidate's compression rounds against the reference, row by row.

A schedule golden (:func:`refkv.oracle.recorder.run_schedule_golden`) records, per
compression round, layer and KV head, the positions the reference holds, the candidates
of its eviction with their scores, and a fingerprint of the key and value each kept
position holds. A candidate gives, per round (arrays indexed like the golden's):

* ``kept`` (R, L, Hkv, K) int, required: the position each **cache row** holds after the
  round, in the candidate's own row order (kvpress's ``topk`` + ``gather`` leaves rows in
  score order), padded with -1 beyond ``kept_count``. Compared as sets: a permutation of
  the right positions passes.
  For a policy that allocates a layer's budget across its KV heads (AdaKV: it overrides
  ``head_budgets``), the layer's kept ``(head, position)`` pairs are compared as one set:
  a token moving between heads is a tie within the two reference scores' tolerances.
* ``kept_count`` (R, L) int and ``logits`` (vocab,), required.
* ``row_keys``, ``row_values`` (R, L, Hkv, K, d_head) float, optional: what each row
  holds. Row ``i`` must hold the key (value) of the position ``kept`` says it holds: its
  fingerprint (:data:`refkv.oracle.endtoend.PRINT_RULE`) must match the reference's for
  that position within ``tolerance.prints``.
* ``scores`` with ``score_positions`` (R, L, Hkv, C), optional: the candidate's scores at
  the round's eviction, for the positions it gives (-1 padding; ``candidates`` is read in
  place of ``score_positions``, the golden's layout); compared with the reference's scores
  of the same positions (exact scores: a declaration other than ``scores=exact`` or
  ``kept_only`` skips them, with a note).

Every divergence is reported with its round, layer, head and kind -- **protected
position evicted**, **kept-set difference beyond ties**, **score beyond tolerance**,
**row holds the wrong key** (or value), or a **count** difference -- the first in full and
the rest counted by round and kind. A divergence or an accepted tie at (round ``r``,
layer ``l``) changes the candidate's cache from there on, so the decisions at rounds
after ``r`` in layers ``>= l`` (and for a policy that evicts before attention, deeper
layers of round ``r``) are not compared; the report counts them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..formatting import format_position_set
from ..policies.base import Policy
from ..validation import check_float
from .arrays import as_array, fmt
from .declare import Declarations
from .endtoend import fingerprints, policy_from_manifest
from .models import is_checkpoint
from .retention import compare_kept, compare_uneven
from .status import Status
from .tolerance import check_dtype_name, decision_tolerance, e2e_rtol, scaled_atol, tolerance_rule
from .walk import EndToEndResult, compare_final_logits, downstream

__all__ = ["KINDS", "Divergence", "compare_schedule"]

#: The kinds of divergence, in the words of the report.
KINDS = ("protected position evicted", "kept-set difference beyond ties", "score beyond tolerance",
         "row holds the wrong key", "row holds the wrong value", "kept count differs")


@dataclass(frozen=True)
class Divergence:
    """One place where the candidate differs from the reference beyond tolerance."""

    round: int
    layer: int
    head: int | None
    kind: str
    message: str

    @property
    def where(self) -> str:
        return f"round {self.round}, layer {self.layer}" + ("" if self.head is None else f", head {self.head}")


@dataclass
class ScheduleResult(EndToEndResult):
    """:class:`~refkv.oracle.walk.EndToEndResult` plus every divergence found (``divergences``)."""

    divergences: list = field(default_factory=list)
    first_round: int | None = None
    rows_checked: int = 0
    scores_checked: int = 0


def _optional(candidate: dict, name: str):
    return as_array(candidate[name], name) if name in candidate else None


def compare_schedule(candidate: dict, reference: dict, manifest: dict, *, dtype=None, declare=None,
                     tolerance_factor: float = 1.0, strict_ties: bool = False,
                     check_dtype="kind") -> ScheduleResult:
    """Compare a candidate's rounds (module docstring) with a schedule golden's arrays."""
    factor = check_float("tolerance_factor", tolerance_factor, 0.0, low_open=True)
    decl = Declarations.parse(declare)
    golden_dtype = manifest.get("dtype", "float64")
    name = check_dtype_name(dtype) or golden_dtype
    tol = manifest["tolerance"]
    real = is_checkpoint(manifest)
    rtol = factor * e2e_rtol(tol["scores"]["rtol"], golden_dtype, name, checkpoint=real)
    p_rtol = factor * e2e_rtol(tol["prints"]["rtol"], golden_dtype, name, checkpoint=real)
    res = ScheduleResult(form="every round")
    res.notes += decl.lines()
    if factor != 1.0:
        res.notes.append(f"tolerance factor {factor:g} (explicit override of the {name} tolerances)")
    rule = tolerance_rule(name, factor, factor_name="")
    before = bool(manifest["policy"].get("evict_before_attention", False))

    kept_r, counts_r = reference["kept"], reference["kept_count"]
    n_rounds, n_layers, hkv, _ = kept_r.shape
    counts_c = as_array(candidate["kept_count"], "kept_count")
    kept_c = as_array(candidate["kept"], "kept")
    if counts_c.shape != counts_r.shape:
        res.failure = f"kept_count: shape mismatch: actual {counts_c.shape}, desired {counts_r.shape} (rounds, layers)"
        return res
    if kept_c.ndim != 4 or kept_c.shape[:3] != kept_r.shape[:3] or kept_c.dtype.kind not in "iu":
        res.failure = (f"kept: must be integer positions of shape {kept_r.shape[:3]} + (K,) (rounds, layers, KV heads, "
                       f"rows), got {kept_c.dtype} {kept_c.shape}")
        return res
    row_keys, row_values = _optional(candidate, "row_keys"), _optional(candidate, "row_values")
    for label, rows in (("row_keys", row_keys), ("row_values", row_values)):
        if rows is not None and (rows.shape[:4] != kept_c.shape or rows.ndim != 5):
            res.failure = f"{label}: shape must be kept's {kept_c.shape} + (d_head,), got {rows.shape}"
            return res
    cand_scores, score_pos = _optional(candidate, "scores"), _optional(candidate, "score_positions")
    if score_pos is None and cand_scores is not None and "candidates" in candidate:
        score_pos = as_array(candidate["candidates"], "candidates")  # the golden's own layout
    if (cand_scores is None) != (score_pos is None):
        res.failure = "scores and score_positions go together: give both or neither"
        return res
    if cand_scores is not None and (cand_scores.shape != score_pos.shape or cand_scores.shape[:3] != kept_r.shape[:3]):
        res.failure = (f"scores, score_positions: shapes must be equal and start with {kept_r.shape[:3]}, got "
                       f"{cand_scores.shape} and {score_pos.shape}")
        return res
    compare_scores = cand_scores is not None and not decl.kept_only and decl.scores in (None, "exact")
    if cand_scores is not None and not compare_scores:
        res.notes.append("candidate scores not compared (declared " + ("kept_only" if decl.kept_only else
                                                                        f"scores={decl.scores}") + ")")
    if row_keys is None:
        res.notes.append("rows: no row_keys given, so which key each row holds is not checked")
    cand_pos, cand_n = reference["candidates"], reference["candidate_count"]
    scores, protected = reference["scores"], reference["protected"]
    d_head = int(manifest["model"]["config"]["d_head"])
    across = allocates_across_heads(manifest)

    taint: list[tuple[int, int]] = []

    def tainted(r: int, l: int) -> bool:
        return downstream(r, l, taint, before)

    def diverge(r, l, h, kind, message):
        res.divergences.append(Divergence(r, l, h, kind, message))

    for r in range(n_rounds):
        for l in range(n_layers):
            if tainted(r, l):
                res.unchecked += 1
                continue
            res.decisions += 1
            k = int(counts_r[r, l])
            found = len(res.divergences)
            tie_here = False
            kc = int(counts_c[r, l])
            # A budget allocated across heads (AdaKV) may widen the widest head by a tie: the
            # pooled comparison below checks the layer's total instead.
            if kc != k and not across:
                diverge(r, l, None, "kept count differs", f"round {r}, layer {l}: candidate holds "
                        f"{int(counts_c[r, l])} tokens per head, the reference {k}")
                taint.append((r, l))
                continue
            c = int(cand_n[r, l])
            pooled = None
            if across and c:
                pooled = _pooled_heads(kept_c[r, l, :, :kc], kept_r[r, l, :, :k], cand_pos[r, l, :, :c],
                                       scores[r, l, :, :c], protected[r, l, :, :c], rtol, rule)
                if pooled is not None and pooled.failure:
                    swap = pooled.swap
                    kind = ("protected position evicted" if swap is not None and swap.dropped_protected
                            else "kept count differs" if pooled.failure.startswith("the layer's total differs")
                            else "kept-set difference beyond ties")
                    diverge(r, l, None, kind, f"round {r}, layer {l}: {pooled.failure}")
                    taint.append((r, l))
                    continue
                if pooled is not None and pooled.ties:
                    res.ties.extend(pooled.ties)
                    tie_here = True
                    if strict_ties:
                        diverge(r, l, None, "kept-set difference beyond ties",
                                "strict ties: " + pooled.ties[0].describe())
                        taint.append((r, l))
                        continue
            for h in range(hkv):
                where = f"round {r}, layer {l}, head {h}"
                a_rows, r_pos = kept_c[r, l, h, :kc], kept_r[r, l, h, :k]
                # A head of an uneven budget (AdaKV, PyramidKV) holds fewer tokens than the widest
                # head of its layer: -1 pads its row (after the real positions, in the reference).
                a_real, r_pos = a_rows[a_rows >= 0], r_pos[r_pos >= 0]
                a_set = np.sort(a_real)
                if len(np.unique(a_real)) != len(a_real):
                    diverge(r, l, h, "kept-set difference beyond ties",
                            f"{where}: candidate rows claim a position twice ({format_position_set(a_real)})")
                    continue
                if pooled is None and len(a_real) != len(r_pos):  # (pooled: compared above)
                    diverge(r, l, h, "kept count differs",
                            f"{where}: candidate holds {len(a_real)} tokens in this head, the reference "
                            f"{len(r_pos)} (an uneven budget allocated differently)")
                    continue
                if pooled is None and not np.array_equal(a_set, r_pos):
                    if c == 0:
                        diverge(r, l, h, "kept-set difference beyond ties",
                                f"{where}: kept positions differ but the reference did not evict in this round "
                                f"(candidate {format_position_set(a_rows)}, reference {format_position_set(r_pos)})")
                        continue
                    pos_row = cand_pos[r, l, h, :c]
                    in_a, in_r = np.isin(a_set, pos_row), np.isin(r_pos, pos_row)
                    if not np.array_equal(a_set[~in_a], r_pos[~in_r]):
                        odd = sorted(set(a_set[~in_a].tolist()) ^ set(r_pos[~in_r].tolist()))
                        diverge(r, l, h, "kept-set difference beyond ties",
                                f"{where}: position {odd[0]} is held by one side only and was not among this "
                                f"round's candidates")
                        continue
                    row = scores[r, l, h, :c]
                    status, swap, message = compare_kept(
                        np.searchsorted(pos_row, a_set[in_a]), np.searchsorted(pos_row, r_pos[in_r]), row, pos_row,
                        protected[r, l, h, :c], tolerance=decision_tolerance(row, rtol), rule=rule, where=where)
                    if status is Status.FAIL:
                        kind = ("protected position evicted" if swap is not None and swap.dropped_protected
                                else "kept-set difference beyond ties")
                        diverge(r, l, h, kind, message)
                        continue
                    if status is Status.TIE:
                        res.ties.append(swap)
                        tie_here = True
                        if strict_ties:
                            diverge(r, l, h, "kept-set difference beyond ties", "strict ties: " + swap.describe())
                            continue
                _check_rows(res, r, l, h, where, a_rows, r_pos, reference, row_keys, row_values, d_head, p_rtol,
                            manifest["tolerance"]["prints"], diverge)
                if compare_scores and c:
                    _check_scores(res, r, l, h, where, cand_scores[r, l, h], score_pos[r, l, h],
                                  cand_pos[r, l, h, :c], scores[r, l, h, :c], rtol, diverge)
            if len(res.divergences) > found or tie_here:
                taint.append((r, l))

    if res.divergences:
        res.first_round = res.divergences[0].round
        res.failure = _summary(res.divergences, manifest)
        return res
    if decl.kept_only:
        res.logits = "not compared (declared kept_only)"
        return res
    steps = reference["round_step"]
    final = _final_step(manifest)
    if any(int(steps[tr]) < final or (before and int(steps[tr]) == final) for tr, _ in taint):
        res.logits = "not compared (downstream of an accepted tie)"
        return res
    logits_rtol = factor * e2e_rtol(tol["logits"]["rtol"], golden_dtype, name, checkpoint=real)
    compare_final_logits(res, candidate, reference, logits_rtol, check_dtype,
                         "final logits (after every round matched)")
    return res


def allocates_across_heads(manifest: dict) -> bool:
    """Whether the golden's policy allocates a layer's budget across its KV heads (it overrides
    ``head_budgets``, as AdaKV does): its kept sets are then compared with the heads pooled."""
    try:
        policy = policy_from_manifest(manifest)
    except (KeyError, TypeError, ValueError):
        return False
    return type(policy).head_budgets is not Policy.head_budgets


def _pooled_heads(kept_c, kept_r, cand_pos, scores, protected, rtol, rule):
    """One layer's kept sets with its KV heads pooled (a budget allocated across heads).

    A token may move from one head to another when the allocation is one selection over
    the layer's scores (AdaKV): the layer's kept ``(head, position)`` pairs are compared as
    one set, a move between heads accepted only within the tie threshold of the two
    reference scores (:func:`refkv.oracle.retention.compare_uneven`). Returns None where a
    head holds a position that was not among the round's candidates on one side only (the
    per-head comparison then reports it), else the :class:`RetentionResult`.
    """
    hkv = kept_r.shape[0]
    actual, desired, lengths = [], [], []
    for h in range(hkv):
        pos_row = cand_pos[h][cand_pos[h] >= 0]               # this head's candidates (-1 pads uneven heads)
        a, d = np.sort(kept_c[h][kept_c[h] >= 0]), kept_r[h][kept_r[h] >= 0]
        in_a, in_d = np.isin(a, pos_row), np.isin(d, pos_row)
        if not np.array_equal(a[~in_a], d[~in_d]) or len(np.unique(a)) != len(a):
            return None
        actual.append(np.searchsorted(pos_row, a[in_a]))
        desired.append(np.searchsorted(pos_row, d[in_d]))
        lengths.append(len(pos_row))
    width = cand_pos.shape[1]
    tolerance = np.zeros((hkv, width))
    for h, n_h in enumerate(lengths):
        tolerance[h, :n_h] = decision_tolerance(scores[h, :n_h], rtol)
    return compare_uneven(actual, desired, scores, positions=cand_pos, protected=protected,
                          lengths=np.asarray(lengths), tolerance=tolerance, rule=rule)


def _final_step(manifest: dict) -> int:
    """Index of the last forward call: prefill blocks, then one per decoded token."""
    t = int(manifest["prompt"]["length"])
    b = manifest["schedule"].get("block_size")
    n_blocks = 1 if b is None else -(-t // int(b))
    return n_blocks + int(manifest["decode"]["length"]) - 1


def _check_rows(res, r, l, h, where, a_rows, r_pos, reference, row_keys, row_values, d_head, p_rtol, ptol, diverge):
    """Each candidate row's key (value) fingerprint against the reference's for the position it claims."""
    index = {int(p): i for i, p in enumerate(r_pos)}
    for name, rows, prints in (("key", row_keys, reference["key_print"]), ("value", row_values,
                                                                        reference["value_print"])):
        if rows is None:
            continue
        held = [(i, index[int(p)]) for i, p in enumerate(a_rows) if int(p) in index]
        if not held:
            continue
        res.rows_checked += len(held) if name == "key" else 0
        rows_here = np.asarray([rows[r, l, h, i] for i, _ in held], dtype=np.float64)
        got = fingerprints(rows_here, d_head)
        want = np.asarray([prints[r, l, h, j] for _, j in held])
        atol = scaled_atol(ptol, p_rtol)
        bad = np.abs(got - want) > atol + p_rtol * np.abs(want)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            row = held[i][0]
            owner = [int(p) for p, w in zip(r_pos, prints[r, l, h, :len(r_pos)])
                     if abs(w - got[i]) <= atol + p_rtol * abs(w)]
            hint = (f"; it matches the reference's {name} of position {owner[0]}" if owner else "")
            diverge(r, l, h, f"row holds the wrong {name}",
                    f"{where}: row {row} claims position {int(a_rows[row])} but holds another {name}: fingerprint "
                    f"{fmt(got[i])}, the reference's {fmt(want[i])} (tolerance {fmt(atol + p_rtol * abs(want[i]), 3)})"
                    f"{hint}" + (f"; {int(bad.sum()) - 1} more such rows in this head" if bad.sum() > 1 else ""))


def _check_scores(res, r, l, h, where, cand_scores, cand_positions, ref_positions, ref_scores, rtol, diverge):
    """The candidate's scores at the positions it gives against the reference's scores there."""
    tolerance = decision_tolerance(ref_scores, rtol)
    col = {int(p): i for i, p in enumerate(ref_positions)}
    for s, p in zip(np.asarray(cand_scores, dtype=np.float64), np.asarray(cand_positions)):
        if int(p) < 0 or int(p) not in col:
            continue
        res.scores_checked += 1
        i = col[int(p)]
        want = float(ref_scores[i])
        if not (s == want or abs(s - want) <= tolerance[i]):
            diverge(r, l, h, "score beyond tolerance",
                    f"{where}: position {int(p)}: candidate score {fmt(s)}, reference {fmt(want)} "
                    f"(|difference| {fmt(abs(s - want), 3)} > tolerance {fmt(tolerance[i], 3)})")
            return


def _summary(divergences: list, manifest: dict) -> str:
    """The first divergence in full, then every other counted by round and kind."""
    first = divergences[0]
    rounds = manifest.get("rounds") or []
    info = rounds[first.round] if first.round < len(rounds) else {}
    at = (f" ({info.get('phase', '?')} step {info.get('step', '?')}, {info.get('position', '?')} tokens seen, "
          f"budget {info.get('budget', '?')})" if info else "")
    lines = [f"first diverged at round {first.round}{at}: {first.kind}", "  " + first.message]
    rest = divergences[1:]
    if rest:
        groups = Counter((d.round, d.kind) for d in rest)
        places = {}
        for d in rest:
            places.setdefault((d.round, d.kind), set()).add((d.layer, d.head))
        lines.append(f"  {len(rest)} more divergence(s):")
        for (r, kind), n in sorted(groups.items()):
            heads = sorted(places[(r, kind)], key=lambda x: (x[0], -1 if x[1] is None else x[1]))
            shown = ", ".join(f"layer {a}" + ("" if b is None else f" head {b}") for a, b in heads[:6])
            more = f", ... ({len(heads) - 6} more)" if len(heads) > 6 else ""
            lines.append(f"    round {r}: {n} x {kind} ({shown}{more})")
    return "\n".join(lines)
