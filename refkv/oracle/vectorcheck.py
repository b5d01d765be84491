"""The check of a vectors file (kind ``vectors``): a candidate's cases against the reference's,
matched by id, each compared by :func:`refkv.oracle.cases.compare_case`."""

from __future__ import annotations

from dataclasses import replace

from ..policies import get
from .candidates import CandidateError, validate_case_candidate
from .cases import compare_case
from .filecheck import candidate_settings
from .report import FileReport
from .status import Status
from .vectors import json_params, read_vectors

__all__ = ["check_vector_file"]


def check_vector_file(candidate_path, reference_path, *, dtype=None, declare=None, tolerance_factor: float = 1.0,
                      strict_ties: bool = False, check_dtype="kind", rel: str | None = None,
                      case_dtype: str | None = None, default_params_only: bool = False,
                      source: str = "argument") -> FileReport:
    """Compare a candidate vectors file with the reference one, case by case (matched by id).

    ``case_dtype`` (``"float32"``, ``"float64"``) and ``default_params_only`` select the
    reference cases compared; the others are not compared even if the candidate has them.
    ``dtype`` and ``declare`` override the candidate file's ``computed_dtype`` and
    ``declare``.
    """
    rel = rel or str(reference_path)
    ref = read_vectors(reference_path)
    cand = read_vectors(candidate_path, candidate=True)
    name, decl, notes = candidate_settings(cand.meta, str(candidate_path), dtype, declare, source)
    all_ids = {c.id for c in ref.cases}
    if case_dtype is not None or default_params_only:
        defaults = json_params(get(ref.policy).params()) if default_params_only else None
        ref = replace(ref, cases=[c for c in ref.cases if (case_dtype is None or c.dtype == case_dtype)
                                  and (defaults is None or c.params == defaults)])
    report = FileReport(rel, "vectors", Status.OK, notes=notes + decl.lines())
    if cand.policy != ref.policy:
        report.status = Status.FAIL
        report.failures.append(f"candidate file is for policy {cand.policy!r}, the reference for {ref.policy!r}")
        return report
    by_id = {c.id: c for c in cand.cases}
    n_fail = n_tie = 0
    warnings = 0
    for case in ref.cases:
        if case.id not in by_id:
            report.failures.append(f"{case.label}: missing from the candidate")
            n_fail += 1
            continue
        try:  # refused before comparison: one line naming the file, the case and the array
            outputs = validate_case_candidate(by_id[case.id].outputs, case, declare=decl,
                                              source=f"{candidate_path}: case {case.id}")
        except CandidateError as err:
            report.failures.append(f"{case.label}: refused: {err}")
            n_fail += 1
            continue
        res = compare_case(outputs, case, dtype=name, declare=decl, tolerance_factor=tolerance_factor,
                           strict_ties=strict_ties, check_dtype=check_dtype)
        warnings += sum(n.startswith("warning") for n in res.notes)
        if res.status is Status.FAIL:
            n_fail += 1
            report.failures.append(f"{res.label}:\n    " + "\n    ".join(m.replace("\n", "\n    ")
                                                                         for m in res.messages))
        elif res.status is Status.TIE:
            n_tie += 1
            report.ties.extend(f"{res.label}: {t.describe()}" for t in res.ties)
    unknown = sorted(set(by_id) - all_ids)
    if unknown:
        report.failures.append(f"candidate has case ids the reference does not: {unknown}")
        n_fail += 1
    if warnings:
        report.notes.append(f"warning: in {warnings} case(s) the tie rule accepts any swap at this precision "
                            f"(every pair of scores within tolerance)")
    report.status = Status.of(n_fail, n_tie)
    report.compared = len(ref.cases)
    if not ref.cases:
        report.notes.append("warning: nothing compared: no reference case matches the selection"
                            + (" (default parameters only)" if default_params_only else "")
                            + (f" (case dtype {case_dtype})" if case_dtype else ""))
    report.summary = (f"{len(ref.cases)} cases: {len(ref.cases) - n_fail} passed"
                      + (f" ({n_tie} with accepted ties)" if n_tie else "") + (f", {n_fail} failed" if n_fail else ""))
    return report
