"""The check of an end-to-end golden (kind ``e2e``): a candidate's kept sets block by block, or
its final cache only, walked by :func:`refkv.oracle.walk.compare_end_to_end`."""

from __future__ import annotations

from pathlib import Path

from .candidates import validate_end_to_end_candidate
from .endtoend import CANDIDATE_ARRAYS, EndToEnd, read_end_to_end
from .filecheck import candidate_settings, finish_end_to_end, npz_path
from .io import read_json, read_npz
from .report import FileReport
from .schema import E2E_SCHEMA, check_header, require
from .status import Status
from .walk import compare_end_to_end

__all__ = ["check_end_to_end_file"]


def check_end_to_end_file(candidate_path, reference_path, *, dtype=None, declare=None,
                          tolerance_factor: float = 1.0, strict_ties: bool = False, final_only: bool = False,
                          check_dtype="kind", rel: str | None = None, source: str = "argument") -> FileReport:
    """Compare a candidate end-to-end golden with the reference one (per block, or ``final_only``).

    The reference is a per-block golden (kind ``e2e``); a schedule golden is checked by
    :func:`refkv.oracle.schedulecheck.check_schedule_file` (:func:`refkv.oracle.checker.check_file`
    picks the checker from the reference).
    """
    rel = rel or str(reference_path)
    ref = read_end_to_end(reference_path)
    cand = _read_candidate_e2e(candidate_path, final_only)
    name, decl, notes = candidate_settings(cand.manifest, str(candidate_path), dtype, declare, source)
    arrays = validate_end_to_end_candidate(cand.arrays, ref.arrays, ref.manifest, final_only=final_only,
                                           source=npz_path(cand))
    res = compare_end_to_end(arrays, ref.arrays, ref.manifest, dtype=name, declare=decl,
                             tolerance_factor=tolerance_factor, strict_ties=strict_ties, final_only=final_only,
                             check_dtype=check_dtype)
    report = FileReport(rel, "e2e", Status.OK, notes=notes + res.notes, compared=res.decisions)
    report.notes.insert(len(notes), f"form: {res.form}" + (" (weaker: only the final cache is compared)"
                                                           if final_only else " (every block's kept sets)"))
    steps = "layers' final caches" if final_only else "(block, layer) steps"
    head = f"{ref.label}: {res.decisions} {steps} compared"
    if res.unchecked:
        head += f", {res.unchecked} downstream of a tie not compared"
    return finish_end_to_end(report, res, head)


def _read_candidate_e2e(path, final_only: bool):
    """A candidate's end-to-end file; in the final-only form its manifest need not list shapes."""
    if not final_only:
        return read_end_to_end(path, candidate=True)
    path = Path(path)
    manifest = read_json(path)
    check_header(manifest, E2E_SCHEMA, str(path))
    npz = path.parent / require(require(manifest, "arrays", str(path)), "file", f"{path}: arrays")
    arrays = read_npz(npz)
    for name in CANDIDATE_ARRAYS:
        if name not in arrays:
            raise ValueError(f"{npz}: missing array {name!r}")
    return EndToEnd(str(path), manifest, arrays)
