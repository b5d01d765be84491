"""Schedule goldens: a candidate's compression rounds against the reference, row by row.

A schedule golden (:func:`refkv.oracle.recorder.run_schedule_golden`) records, per
compression round, layer and KV head, the positions the reference holds, the candidates
of its eviction with their scores, and a fingerprint of the key and value each kept
position holds. A candidate gives, per round (arrays indexed like the golden's):

* ``kept`` (R, L, Hkv, K) int, required: the position each **cache row** holds after the
  round, in the candidate's own row order (kvpress's ``topk`` + ``gather`` leaves rows in
  score order), padded with -1 beyond ``kept_count``. Compared as sets: a permutation of
  the right positions passes.
  For a policy that allocates a layer's budget across its KV heads in one selection (AdaKV,
  ``shares_layer_budget``), the layer's kept ``(head, position)`` pairs are compared as one set:
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

import re
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from ..cache import EMPTY
from ..formatting import format_position_set
from ..model.config import ModelConfig
from ..validation import check_float
from .arrays import as_array, fmt
from .candidates import validate_schedule_candidate
from .cases import compare_case, compare_scores
from .declare import Declarations
from .endtoend import fingerprints, policy_from_manifest
from .models import is_checkpoint
from .ownstate import (
    OffBranch,
    query_rows,
    replay_layer,
    replayable,
    round_case,
    state_given,
    tokens_given,
    unjudgeable,
    view_case,
)
from .retention import compare_kept, compare_uneven
from .status import Status
from .tolerance import check_dtype_name, decision_tolerance, e2e_rtol, scale_floor, scaled_atol, tolerance_rule
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
    per_round: list = field(default_factory=list)


def _optional(candidate: dict, name: str):
    return as_array(candidate[name], name) if name in candidate else None


def compare_schedule(candidate: dict, reference: dict, manifest: dict, *, dtype=None, declare=None,
                     tolerance_factor: float = 1.0, strict_ties: bool = False,
                     check_dtype="kind") -> ScheduleResult:
    """Compare a candidate's rounds (module docstring) with a schedule golden's arrays."""
    factor = check_float("tolerance_factor", tolerance_factor, 0.0, low_open=True)
    decl = Declarations.parse(declare)
    candidate = validate_schedule_candidate(candidate, reference, manifest, declare=decl)
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
    # Declared relations (rescaled scores, a monotone transform) are compared as declared.
    compare_scores = None if cand_scores is None or decl.kept_only else (decl.scores or "exact")
    if cand_scores is not None and compare_scores is None:
        res.notes.append("candidate scores not compared (declared kept_only)")
    elif compare_scores not in (None, "exact"):
        res.notes.append(f"candidate scores compared as declared: scores={compare_scores}")
    if row_keys is None:
        res.notes.append("rows: no row_keys given, so which key each row holds is not checked")
    d_head = int(manifest["model"]["config"]["d_head"])

    def diverge(r, l, h, kind, message):
        res.divergences.append(Divergence(r, l, h, kind, message))

    policy, how, why_not = _judged_policy(manifest, candidate)
    if why_not is None:
        res.form = "every round, on the candidate's own state" + (" (its tokens replayed)" if how == "replay" else "")
        taint = _judge_own_state(res, candidate, reference, manifest, policy, how, kept_c, counts_c, row_keys,
                                 row_values, cand_scores, score_pos, name, decl, factor, strict_ties, p_rtol, d_head,
                                 diverge)
    else:
        res.notes.append(_blind_spot_note(why_not, name, rtol, real))
        taint = _compare_with_reference(res, reference, manifest, kept_c, counts_c, row_keys, row_values, cand_scores,
                                        score_pos, compare_scores, rtol, rule, before, strict_ties, p_rtol, d_head,
                                        diverge)

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
        res.logits = ("not compared: the candidate's kept sets left the reference's at round "
                      f"{min(tr for tr, _ in taint)} (each decision judged on its own state); "
                      + _logits_drift(candidate, reference))
        return res
    logits_rtol = factor * e2e_rtol(tol["logits"]["rtol"], golden_dtype, name, checkpoint=real)
    compare_final_logits(res, candidate, reference, logits_rtol, check_dtype,
                         "final logits (after every round matched)")
    return res


def _compare_with_reference(res, reference, manifest, kept_c, counts_c, row_keys, row_values, cand_scores, score_pos,
                            compare_scores, rtol, rule, before, strict_ties, p_rtol, d_head, diverge) -> list:
    """Each (round, layer) against the reference's decision, at the model-level tolerance ``rtol``.

    The check for a candidate that gives no state (or a policy :mod:`refkv.oracle.ownstate`
    cannot judge): a decision after a divergence or an accepted tie at (``r``, ``l``) sees
    another cache than the reference's, so it is not compared (counted in ``res.unchecked``).
    Returns the (round, layer) pairs where the candidate left the reference's trajectory.
    """
    cand_pos, cand_n = reference["candidates"], reference["candidate_count"]
    scores, protected = reference["scores"], reference["protected"]
    kept_r, counts_r = reference["kept"], reference["kept_count"]
    n_rounds, n_layers, hkv, _ = kept_r.shape
    across = allocates_across_heads(manifest)

    taint: list[tuple[int, int]] = []

    def tainted(r: int, l: int) -> bool:
        return downstream(r, l, taint, before)

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
                                  cand_pos[r, l, h, :c], scores[r, l, h, :c], rtol, diverge, compare_scores)
            if len(res.divergences) > found or tie_here:
                taint.append((r, l))

    return taint


def _judged_policy(manifest: dict, candidate: dict):
    """``(policy, how, None)`` if the candidate's decisions can be judged on its own state --
    ``how`` is ``"state"`` (the rounds' recorded state) or ``"replay"`` (its tokens replayed) --
    else ``(policy, None, why not)``."""
    try:
        policy = policy_from_manifest(manifest)
    except (KeyError, TypeError, ValueError) as err:
        return None, None, f"the golden's policy cannot be built here ({err})"
    cfg = ModelConfig(**manifest["model"]["config"])
    why = unjudgeable(policy, cfg)
    if state_given(candidate) and why is None:
        if query_rows(policy) and "state_queries" not in candidate:
            return policy, None, f"{policy.name} reads attention rows and the candidate gives no state_queries"
        return policy, "state", None
    if tokens_given(candidate):
        return policy, "replay", None
    if why is not None and replayable(policy, cfg):
        return policy, None, (f"{why}: it is judged by replaying the candidate's tokens, and the candidate gives "
                              f"no token_queries, token_keys, token_values")
    return policy, None, ("the candidate gives no state (state_positions, state_keys, state_values"
                          + (", state_queries" if query_rows(policy) else "") + ") and no tokens (token_queries, "
                          "token_keys, token_values)")


def _blind_spot_note(why_not: str, dtype: str, rtol: float, checkpoint: bool) -> str:
    """What a check against the reference's decisions can miss, said plainly."""
    return (f"warning: decisions compared with the reference's, not judged on the candidate's own state: {why_not}. "
            f"The tolerance is the model's measured drift in {dtype}"
            + (" on a checkpoint" if checkpoint else "")
            + f" (rtol {fmt(rtol, 3)}): a score error up to about {fmt(rtol, 3)} x a typical score of a decision "
            f"can pass unseen, and a decision after an accepted tie is not compared")


def _logits_drift(candidate: dict, reference: dict) -> str:
    """``"logits drift: max |diff| x (y of the largest logit)"``: measured, never a verdict."""
    got = np.asarray(as_array(candidate["logits"], "logits"), dtype=np.float64)
    want = np.asarray(reference["logits"], dtype=np.float64)
    if got.shape != want.shape:
        return f"logits drift: not measured (shape {got.shape}, the reference's {want.shape})"
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    return f"logits drift: max |diff| {fmt(diff, 3)} ({fmt(diff / scale_floor(want), 3)} of the largest logit)"


def _judge_own_state(res, candidate, reference, manifest, policy, how, kept_c, counts_c, row_keys, row_values,
                     cand_scores, score_pos, dtype, decl, factor, strict_ties, p_rtol, d_head, diverge) -> list:
    """Every (round, layer) decision on the candidate's own state (:mod:`refkv.oracle.ownstate`).

    Per decision: refkv's decision on what the candidate had -- the round's recorded state,
    which must continue the previous round (its positions are the previous kept positions
    plus the tokens fed since), or for a policy with per-token state a replay of the
    candidate's own tokens -- against the candidate's kept set
    (:func:`refkv.oracle.cases.compare_case`, the decision's own rounding in ``dtype`` as
    tolerance); each kept row holds, bit for bit, the key and value the candidate had for
    the position it claims. While the candidate's kept sets are the reference's, its rows
    are also held to the reference's fingerprints (model-level tolerance ``p_rtol``);
    after, their distance is reported as drift only.
    Returns the (round, layer) pairs where the candidate's kept set is not the reference's.
    """
    kept_r, counts_r = reference["kept"], reference["kept_count"]
    n_rounds, n_layers, hkv, _ = kept_r.shape
    source = (_replayed_decisions if how == "replay" else _state_decisions)(
        candidate, reference, manifest, policy, kept_c, counts_c)
    taint: list[tuple[int, int]] = []
    for r in range(n_rounds):
        judged = ties = evicting = flat = 0
        drift = 0.0
        for l in range(n_layers):
            where = f"round {r}, layer {l}"
            kc = int(counts_c[r, l])
            rows = [row[row >= 0] for row in kept_c[r, l, :, :kc]]
            decision = source.get((r, l))
            if decision is None:  # its layer left the candidate's own branch at an earlier round (reported there)
                res.unchecked += 1
                continue
            if decision[0] == "problem":
                diverge(r, l, None, decision[1], f"{where}: {decision[2]}")
                continue
            _, case, held = decision
            if case.stage == "before-attention":
                # the eviction precedes the step's own tokens, which the round's kept set must hold
                first = int(case.inputs["query_positions"][0])
                lost = [int(p) for row in rows for p in range(first, int(reference["round_position"][r]))
                        if p not in set(row.tolist())]
                if lost:
                    diverge(r, l, None, "kept-set difference beyond ties",
                            f"{where}: the candidate evicted position {lost[0]}, a token of the step itself, which "
                            f"{policy.name} evicts before attention and never drops")
                    continue
                rows = [row[row < first] for row in rows]
            judged += 1
            res.decisions += 1
            evicting += int(case.sizes["n"] > case.budget)
            if case.head_budgets is None and {len(row) for row in rows} != {case.outputs["kept"].shape[1]}:
                diverge(r, l, None, "kept count differs",
                        f"{where}: candidate holds {', '.join(str(len(row)) for row in rows)} tokens in its "
                        f"{hkv} KV heads; refkv's decision on its state keeps {case.outputs['kept'].shape[1]} "
                        f"per head (layer budget {case.budget}, {case.sizes['n']} candidates)")
                continue
            cand = {"kept": rows if case.head_budgets is not None else np.stack(rows) if rows else
                    np.zeros((hkv, 0), dtype=np.int64)}
            mapped = _scores_on_case(cand_scores, score_pos, r, l, case)
            if mapped is not None:
                cand["scores"] = mapped
                res.scores_checked += int(np.isfinite(mapped).sum())
            out = compare_case(cand, case, dtype=dtype, declare=decl, tolerance_factor=factor,
                               strict_ties=strict_ties, kept_as="positions")
            ties += len(out.ties)
            res.ties.extend(_placed(t, where) for t in out.ties)
            flat += any(n.startswith("warning") for n in out.notes)
            # the kept set first: what a cache holds matters more than how its scores were written
            for message in sorted(out.messages, key=lambda m: m.startswith("scores")):
                diverge(r, l, _head_of(message), _kind(message), f"{where}, {message}")
            for kind, message in _rows_hold_their_state(r, l, kept_c[r, l], *held, row_keys, row_values):
                diverge(r, l, None, kind, f"{where}, {message}")
            if row_keys is not None:
                res.rows_checked += sum(len(row) for row in rows)
            same = all(np.array_equal(np.sort(a), kept_r[r, l, h][kept_r[r, l, h] >= 0])
                       for h, a in enumerate(rows)) and kc == int(counts_r[r, l])
            if same and not any(tr < r and tl <= l for tr, tl in taint):
                found = len(res.divergences)
                for h in range(hkv):
                    _check_rows(res, r, l, h, f"{where}, head {h}", kept_c[r, l, h, :kc],
                                kept_r[r, l, h][kept_r[r, l, h] >= 0], reference, row_keys, row_values, d_head,
                                p_rtol, manifest["tolerance"]["prints"], diverge)
                del res.divergences[found + 1:]  # one fingerprint failure per decision is enough
            else:
                if not same:
                    taint.append((r, l))
                drift = max(drift, _print_drift(kept_c[r, l, :, :kc], kept_r[r, l], reference["key_print"][r, l],
                                                row_keys, r, l, d_head))
        res.per_round.append({"round": r, "judged": judged, "evicting": evicting, "ties": ties,
                              "flat": flat, "drift": drift})
    return taint


def _state_decisions(candidate, reference, manifest, policy, kept_c, counts_c) -> dict:
    """(round, layer) -> ``("case", case, held)`` from the recorded state, or ``("problem", kind, text)``.

    ``held`` is what the candidate's rows may hold: the state's positions, keys and values.
    """
    state_pos = as_array(candidate["state_positions"], "state_positions")
    state_keys = as_array(candidate["state_keys"], "state_keys")
    state_values = as_array(candidate["state_values"], "state_values")
    queries = _optional(candidate, "state_queries")
    n_rounds, n_layers = reference["kept"].shape[:2]
    after = reference["round_position"]
    out = {}
    for r in range(n_rounds):
        for l in range(n_layers):
            positions = state_pos[r, l]
            problem = _state_continues(positions, None if r == 0 else kept_c[r - 1, l, :, :int(counts_c[r - 1, l])],
                                       0 if r == 0 else int(after[r - 1]), int(after[r]))
            if problem is None and r > 0:
                problem = _state_carries_rows(positions, state_keys[r, l], state_values[r, l], kept_c[r - 1, l],
                                              int(counts_c[r - 1, l]), candidate, r - 1, l)
            if problem:
                out[r, l] = ("problem", "state does not continue the previous round", problem)
                continue
            case = round_case(policy, manifest, r, l, positions, state_keys[r, l], state_values[r, l],
                              None if queries is None else queries[r, l])
            out[r, l] = ("case", case, (positions, state_keys[r, l], state_values[r, l]))
    return out


def _state_carries_rows(positions, keys, values, kept_before, count, candidate, before: int, layer: int) -> str | None:
    """Why a round's state does not hold, bit for bit, the keys and values the candidate's rows held
    after round ``before`` for the positions it kept then (None if it does, or without
    ``row_keys`` / ``row_values``): a cache whose rows moved between compressions."""
    for name, state in (("key", keys), ("value", values)):
        rows = candidate.get(f"row_{name}s")
        if rows is None:
            continue
        for h in range(positions.shape[0]):
            column = {int(p): c for c, p in enumerate(positions[h]) if p >= 0}
            for i, p in enumerate(kept_before[h, :count]):
                if p >= 0 and int(p) in column and not np.array_equal(rows[before, layer, h, i],
                                                                        state[h, column[int(p)]]):
                    return (f"head {h}: its {name} of position {int(p)} is not the {name} row {i} held for it after "
                            f"round {before}")
    return None


def _replayed_decisions(candidate, reference, manifest, policy, kept_c, counts_c) -> dict:
    """(round, layer) -> ``("case", case, held)`` from a replay of the candidate's own tokens
    (:func:`refkv.oracle.ownstate.replay_layer`), or ``("problem", kind, text)`` where the
    candidate kept a position its own cache could not hold (later rounds of that layer absent).

    ``held`` is every token's position, key and value at the layer, as the candidate computed them.
    """
    queries = as_array(candidate["token_queries"], "token_queries")
    keys = as_array(candidate["token_keys"], "token_keys")
    values = as_array(candidate["token_values"], "token_values")
    n_layers = reference["kept"].shape[1]
    hkv, n_tokens = keys.shape[1], keys.shape[2]
    everything = np.broadcast_to(np.arange(n_tokens, dtype=np.int64), (hkv, n_tokens))
    out = {}
    for l in range(n_layers):
        try:
            for r, view in replay_layer(policy, manifest, l, queries[l], keys[l], values[l], kept_c[:, l],
                                        counts_c[:, l]):
                case = view_case(policy, view, r * n_layers + l, f"round {r}, layer {l}, replayed")
                out[r, l] = ("case", case, (everything, keys[l], values[l]))
        except OffBranch as err:
            out[err.round, l] = ("problem", "kept-set difference beyond ties", str(err))
    return out


def _state_continues(positions, kept_before, first_new: int, end: int) -> str | None:
    """Why a round's state positions are not the previous round's kept positions plus the
    tokens ``first_new .. end - 1`` fed since (None if they are)."""
    new = np.arange(first_new, end)
    for h in range(positions.shape[0]):
        got = positions[h][positions[h] >= 0]
        if len(np.unique(got)) != len(got):
            return f"head {h}: the state holds a position twice"
        held = np.empty(0, dtype=np.int64) if kept_before is None else kept_before[h][kept_before[h] >= 0]
        want = np.union1d(held, new)
        if not np.array_equal(np.sort(got), want):
            extra = sorted(set(got.tolist()) - set(want.tolist()))
            lost = sorted(set(want.tolist()) - set(got.tolist()))
            return (f"head {h}: the state before this round's eviction should hold the previous round's kept "
                    f"positions and positions {first_new}..{end - 1}; "
                    + (f"it also holds {format_position_set(np.array(extra))}" if extra else "")
                    + ("; " if extra and lost else "")
                    + (f"it lacks {format_position_set(np.array(lost))}" if lost else ""))
    return None


def _scores_on_case(cand_scores, score_pos, r, l, case):
    """The candidate's scores of round ``r``, layer ``l`` in the case's column order, or None
    where it gave none (or not one for every state position)."""
    if cand_scores is None:
        return None
    pos = case.inputs["positions"]
    out = np.full(pos.shape, np.nan)
    for h in range(pos.shape[0]):
        given = {int(p): float(s) for p, s in zip(score_pos[r, l, h], cand_scores[r, l, h]) if p >= 0}
        for c, p in enumerate(pos[h]):
            if p == EMPTY or p < 0:
                continue
            if int(p) not in given:
                return None
            out[h, c] = given[int(p)]
    if np.isnan(out).all():
        return None
    return np.where(np.isnan(out), case.outputs["scores"], out) if case.head_budgets is not None else out


def _placed(swap, where: str):
    """A tie's Swap with its round and layer in front of its head."""
    return replace(swap, where=f"{where}, {swap.where}")


def _head_of(message: str) -> int | None:
    """The KV head a :func:`compare_case` message names first (``head 2: ...``), if any."""
    found = re.search(r"\bhead (\d+)", message)
    return None if found is None else int(found.group(1))


def _kind(message: str) -> str:
    """The divergence kind of one of :func:`compare_case`'s messages."""
    if message.startswith("scores"):
        return "score beyond tolerance"
    if "which the reference protects" in message:
        return "protected position evicted"
    if "tokens, the reference" in message or "total differs" in message:
        return "kept count differs"
    return "kept-set difference beyond ties"


def _rows_hold_their_state(r, l, kept_rows, positions, keys, values, row_keys, row_values) -> list:
    """Each kept row's key (value) against the state's key (value) of the position it claims: bit for bit."""
    out = []
    for name, got_all, state in (("key", row_keys, keys), ("value", row_values, values)):
        if got_all is None:
            continue
        for h in range(positions.shape[0]):
            column = {int(p): c for c, p in enumerate(positions[h]) if p >= 0}
            bad = []
            for i, p in enumerate(kept_rows[h]):
                if p < 0 or int(p) not in column:
                    continue
                if not np.array_equal(got_all[r, l, h, i], state[h, column[int(p)]]):
                    bad.append((i, int(p)))
            if bad:
                i, p = bad[0]
                owner = [int(q) for q, c in column.items() if np.array_equal(got_all[r, l, h, i], state[h, c])]
                hint = (f"; it is the state's {name} of position {owner[0]}" if owner
                        else f"; it matches no {name} of the state")
                out.append((f"row holds the wrong {name}",
                            f"head {h}: row {i} claims position {p} but does not hold the {name} the candidate's "
                            f"state held for it{hint}" + (f"; {len(bad) - 1} more such rows" if len(bad) > 1 else "")))
    return out


def _print_drift(kept_c, kept_r, prints_r, row_keys, r, l, d_head) -> float:
    """Largest relative distance of the candidate's kept keys from the reference's, over the
    positions both hold: ``|print_c - print_r| / max(|print_r|)`` (0 without ``row_keys``)."""
    if row_keys is None:
        return 0.0
    worst = 0.0
    scale = max(float(np.nanmax(np.abs(prints_r))) if np.isfinite(prints_r).any() else 1.0, 1e-300)
    for h in range(kept_c.shape[0]):
        index = {int(p): j for j, p in enumerate(kept_r[h]) if p >= 0}
        for i, p in enumerate(kept_c[h]):
            if p >= 0 and int(p) in index:
                got = float(fingerprints(row_keys[r, l, h, i][None], d_head)[0])
                worst = max(worst, abs(got - float(prints_r[h, index[int(p)]])) / scale)
    return worst


def allocates_across_heads(manifest: dict) -> bool:
    """Whether the golden's policy allocates a layer's budget across its KV heads in one selection
    (:attr:`~refkv.policies.Policy.shares_layer_budget`, AdaKV): its kept sets are then compared
    with the heads pooled."""
    try:
        policy = policy_from_manifest(manifest)
    except (KeyError, TypeError, ValueError):
        return False
    return bool(policy.shares_layer_budget)


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


def _check_scores(res, r, l, h, where, cand_scores, cand_positions, ref_positions, ref_scores, rtol, diverge,
                  relation: str = "exact"):
    """The candidate's scores at the positions it gives against the reference's scores there,
    by the declared ``relation`` (:data:`refkv.oracle.declare.SCORE_RELATIONS`): equal within
    tolerance, a positive multiple (rescaled by the median ratio), or in the same order."""
    tolerance = decision_tolerance(ref_scores, rtol)
    col = {int(p): i for i, p in enumerate(ref_positions)}
    given = [(float(s), col[int(p)]) for s, p in zip(np.asarray(cand_scores, dtype=np.float64),
                                                      np.asarray(cand_positions)) if int(p) >= 0 and int(p) in col]
    if not given:
        return
    res.scores_checked += len(given)
    if relation != "exact":
        cols = np.array([c for _, c in given])
        got = np.array([v for v, _ in given])[None]
        message = compare_scores(got, np.asarray(ref_scores, dtype=np.float64)[cols][None], relation,
                                  np.zeros(got.shape, dtype=bool), lambda: tolerance[cols][None],
                                  lambda i: f"position {int(ref_positions[cols[i[-1]]])}",
                                  np.asarray(ref_positions)[cols][None], False)
        if message:
            diverge(r, l, h, "score beyond tolerance", f"{where}: {message}")
        return
    for s, i in given:
        want = float(ref_scores[i])
        if not (s == want or abs(s - want) <= tolerance[i]):
            diverge(r, l, h, "score beyond tolerance",
                    f"{where}: position {int(ref_positions[i])}: candidate score {fmt(s)}, reference {fmt(want)} "
                    f"(|difference| {fmt(abs(s - want), 3)} > tolerance {fmt(tolerance[i], 3)})")
            return


def _summary(divergences: list, manifest: dict) -> str:
    """The first divergence in full, then every other counted by round and kind."""
    first = divergences[0]
    rounds = manifest.get("rounds") or []
    info = rounds[first.round] if first.round < len(rounds) else {}
    budget = info.get("budget", "?")
    try:  # the layer's own budget where the policy moves budget between layers (PyramidKV)
        tokens = int(info["position"]) if info.get("phase") == "prefill" and info.get("step") == 0 else None
        own = policy_from_manifest(manifest).layer_budget(int(budget), first.layer,
                                                          int(manifest["model"]["config"]["n_layers"]), tokens=tokens)
        budget = budget if own == budget else f"{own} in layer {first.layer} (N = {budget})"
    except (KeyError, TypeError, ValueError):
        pass
    at = (f" ({info.get('phase', '?')} step {info.get('step', '?')}, {info.get('position', '?')} tokens seen, "
          f"budget {budget})" if info else "")
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
