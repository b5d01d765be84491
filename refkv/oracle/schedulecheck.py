"""The check of a schedule golden (kind ``schedule``, listed as ``e2e``): a candidate's kept
positions after every round of a compression schedule (:mod:`refkv.schedule`), compared
by :func:`refkv.oracle.rounds.compare_schedule`."""

from __future__ import annotations

from .candidates import validate_schedule_candidate
from .endtoend import read_end_to_end
from .filecheck import candidate_settings, finish_end_to_end, npz_path
from .report import FileReport
from .rounds import compare_schedule
from .status import Status

__all__ = ["check_schedule_file"]


def check_schedule_file(candidate_path, reference_path, *, dtype=None, declare=None, tolerance_factor: float = 1.0,
                        strict_ties: bool = False, final_only: bool = False, check_dtype="kind",
                        rel: str | None = None, source: str = "argument") -> FileReport:
    """Compare a candidate's rounds with a schedule golden (:func:`refkv.oracle.rounds.compare_schedule`).

    A schedule golden has no final-only form: with ``final_only`` nothing is compared
    (the report says so, and counts nothing compared).
    """
    rel = rel or str(reference_path)
    ref = read_end_to_end(reference_path)
    if final_only:  # not compared (counted as such: a check of schedule goldens only compares nothing and fails)
        return FileReport(rel, "e2e", Status.OK, notes=["warning: not compared: a schedule golden has no final-only "
                                                        "form (the kept positions after every round are needed)"],
                          compared=0)
    cand = read_end_to_end(candidate_path, candidate=True)
    name, decl, notes = candidate_settings(cand.manifest, str(candidate_path), dtype, declare, source)
    arrays = validate_schedule_candidate(cand.arrays, ref.arrays, ref.manifest, npz_path(cand), declare=decl)
    res = compare_schedule(arrays, ref.arrays, ref.manifest, dtype=name, declare=decl,
                           tolerance_factor=tolerance_factor, strict_ties=strict_ties, check_dtype=check_dtype)
    report = FileReport(rel, "e2e", Status.OK, notes=notes + res.notes, compared=res.decisions)
    own = bool(res.per_round)
    report.notes.insert(len(notes), f"form: every round of the schedule ({ref.manifest.get('schedule_text', '')}); "
                                    + ("each decision judged on the candidate's own state (refkv's decision on the "
                                       "rows, keys and queries it had, at its dtype's rounding)" if own else
                                       "kept positions as sets against the reference's")
                                    + f", {res.rows_checked} rows' keys checked, {res.scores_checked} scores compared")
    report.notes[len(notes) + 1:len(notes) + 1] = _round_lines(res.per_round)
    head = f"{ref.label}: {res.decisions} (round, layer) decisions " + ("judged" if own else "compared")
    if res.unchecked:
        head += f", {res.unchecked} downstream of a tie or divergence not compared"
    evicting = sum(r["evicting"] for r in res.per_round)
    if own and res.decisions and evicting == 0:
        report.notes.append("warning: no judged decision evicted anything (every state fit its budget): this check "
                            "judged too little to mean anything")
    flat = sum(r["flat"] for r in res.per_round)
    if own and evicting and flat * 2 > evicting:
        report.notes.append(f"warning: in {flat} of {evicting} evicting decisions the tie rule accepts any swap in "
                            f"some head at this dtype: those kept sets are not a meaningful check")
    return finish_end_to_end(report, res, head)


def _round_lines(per_round: list) -> list[str]:
    """One line per round: decisions judged (how many evicted), ties accepted, the keys' drift."""
    return [f"round {r['round']}: {r['judged']} decisions judged on the candidate's own state ({r['evicting']} "
            f"evicting), {r['ties']} tie(s) accepted; kept keys' drift from the reference where they differ: "
            f"{r['drift']:.3g} of the largest fingerprint (measured, not a verdict)" for r in per_round]
