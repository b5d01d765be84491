"""``refkv golden check``: a candidate's files against a reference suite or folder of case files.

The reference is a suite folder (``suite.json``, checksums verified) or any folder of
golden files without one (a folder of one-shot cases built with
:func:`refkv.oracle.synthetic.replay` and :func:`refkv.oracle.vectors.encode_case`); the
candidate mirrors its layout, or holds vectors files of the same policies anywhere
inside it. A file that cannot be read -- malformed, not a regular file (a FIFO, a link to
``/dev/zero``), arrays whose headers declare more than they hold -- fails on its own line;
the check goes on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..validation import check_choice, check_float
from .cases import compare_case
from .declare import Declarations
from .report import FileReport, SuiteReport
from .status import Status
from .tolerance import check_dtype_name

__all__ = ["case_dtype_for", "check_end_to_end_file", "check_suite", "check_vector_file", "discover_files"]

CASE_DTYPES = ("float32", "float64", "all")


def case_dtype_for(dtype: str | None) -> str | None:
    """The reference cases a candidate computing in ``dtype`` is checked on by default.

    float64: the float64 cases; float32, bfloat16, float16: the float32 cases (the
    suite's lowest precision); None: all.
    """
    name = check_dtype_name(dtype)
    return None if name is None else ("float64" if name == "float64" else "float32")


def _settings(meta: dict, where: str, dtype, declare, source: str):
    """Computed dtype and declarations: the candidate file's, overridden by the caller's."""
    notes = []
    file_dtype = meta.get("computed_dtype")
    if file_dtype is not None:
        try:
            file_dtype = check_dtype_name(file_dtype)
        except ValueError as err:
            raise ValueError(f"{where}: computed_dtype: {err}") from None
    try:
        decl = Declarations.parse(meta.get("declare"), "candidate file")
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if declare is not None:
        decl = decl.merged(Declarations.parse(declare, source))
    name = check_dtype_name(dtype) or file_dtype
    if name is not None:
        origin = source if dtype is not None else "candidate file"
        notes.append(f"computed dtype {name} ({origin})"
                     + (f"; overrides the candidate file's {file_dtype}" if dtype is not None and file_dtype
                        and file_dtype != name else ""))
    return name, decl, notes


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
    from ..policies import get
    from .vectors import json_params, read_vectors

    rel = rel or str(reference_path)
    ref = read_vectors(reference_path)
    cand = read_vectors(candidate_path, candidate=True)
    name, decl, notes = _settings(cand.meta, str(candidate_path), dtype, declare, source)
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
        res = compare_case(by_id[case.id].outputs, case, dtype=name, declare=decl, tolerance_factor=tolerance_factor,
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


def check_end_to_end_file(candidate_path, reference_path, *, dtype=None, declare=None,
                          tolerance_factor: float = 1.0, strict_ties: bool = False, final_only: bool = False,
                          check_dtype="kind", rel: str | None = None, source: str = "argument") -> FileReport:
    """Compare a candidate end-to-end golden with the reference one (per block, or ``final_only``)."""
    from .endtoend import is_schedule, read_end_to_end
    from .walk import compare_end_to_end

    rel = rel or str(reference_path)
    ref = read_end_to_end(reference_path)
    if is_schedule(ref.manifest):
        return _check_schedule_file(candidate_path, ref, dtype=dtype, declare=declare,
                                    tolerance_factor=tolerance_factor, strict_ties=strict_ties,
                                    final_only=final_only, check_dtype=check_dtype, rel=rel, source=source)
    cand = _read_candidate_e2e(candidate_path, final_only)
    name, decl, notes = _settings(cand.manifest, str(candidate_path), dtype, declare, source)
    res = compare_end_to_end(cand.arrays, ref.arrays, ref.manifest, dtype=name, declare=decl,
                             tolerance_factor=tolerance_factor, strict_ties=strict_ties, final_only=final_only,
                             check_dtype=check_dtype)
    report = FileReport(rel, "e2e", Status.OK, notes=notes + res.notes, compared=res.decisions)
    report.notes.insert(len(notes), f"form: {res.form}" + (" (weaker: only the final cache is compared)"
                                                           if final_only else " (every block's kept sets)"))
    steps = "layers' final caches" if final_only else "(block, layer) steps"
    head = f"{ref.label}: {res.decisions} {steps} compared"
    if res.unchecked:
        head += f", {res.unchecked} downstream of a tie not compared"
    return _finish(report, res, head)


def _check_schedule_file(candidate_path, ref, *, dtype, declare, tolerance_factor, strict_ties, final_only,
                         check_dtype, rel, source) -> FileReport:
    """A candidate's rounds against a schedule golden (:mod:`refkv.oracle.rounds`)."""
    from .endtoend import read_end_to_end
    from .rounds import compare_schedule

    if final_only:  # not compared (counted as such: a check of schedule goldens only compares nothing and fails)
        return FileReport(rel, "e2e", Status.OK, notes=["warning: not compared: a schedule golden has no final-only "
                                                        "form (the kept positions after every round are needed)"],
                          compared=0)
    cand = read_end_to_end(candidate_path, candidate=True)
    name, decl, notes = _settings(cand.manifest, str(candidate_path), dtype, declare, source)
    res = compare_schedule(cand.arrays, ref.arrays, ref.manifest, dtype=name, declare=decl,
                           tolerance_factor=tolerance_factor, strict_ties=strict_ties, check_dtype=check_dtype)
    report = FileReport(rel, "e2e", Status.OK, notes=notes + res.notes, compared=res.decisions)
    report.notes.insert(len(notes), f"form: every round of the schedule ({ref.manifest.get('schedule_text', '')}); "
                                    f"kept positions as sets, {res.rows_checked} rows' keys checked, "
                                    f"{res.scores_checked} scores compared")
    head = f"{ref.label}: {res.decisions} (round, layer) steps compared"
    if res.unchecked:
        head += f", {res.unchecked} downstream of a tie or divergence not compared"
    return _finish(report, res, head)


def _read_candidate_e2e(path, final_only: bool):
    """A candidate's end-to-end file; in the final-only form its manifest need not list shapes."""
    from .endtoend import CANDIDATE_ARRAYS, EndToEnd, read_end_to_end
    from .io import read_json, read_npz
    from .schema import E2E_SCHEMA, check_header, require

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


def discover_files(directory) -> list[dict]:
    """Index entries (``path``, ``kind``, ``policy``, ``dtype``) of the golden files in a folder without suite.json."""
    from .io import read_json
    from .schema import E2E_SCHEMA, VECTORS_SCHEMA

    directory = Path(directory)
    entries = []
    for path in sorted(p for p in directory.rglob("*.json") if p.name != "suite.json"):
        doc = read_json(path)
        rel = path.relative_to(directory).as_posix()
        if doc.get("schema") == VECTORS_SCHEMA:
            entries.append({"path": rel, "kind": "vectors", "policy": doc.get("policy", "?")})
        elif doc.get("schema") == E2E_SCHEMA:
            entries.append({"path": rel, "kind": "e2e", "policy": doc.get("policy", {}).get("name", "?"),
                            "dtype": doc.get("dtype")})
    if not entries:
        raise ValueError(f"{directory} has no suite.json and holds no golden files (no *.json of schema "
                         f"{VECTORS_SCHEMA} or {E2E_SCHEMA})")
    return entries


def _candidate_vectors(candidate_dir: Path) -> dict:
    """Policy -> path of the candidate's vectors files found anywhere in its folder (unreadable ones skipped)."""
    from .io import read_json
    from .schema import VECTORS_SCHEMA

    found = {}
    for path in sorted(candidate_dir.rglob("*.json")):
        try:
            doc = read_json(path)
        except ValueError:
            continue
        if doc.get("schema") == VECTORS_SCHEMA and isinstance(doc.get("policy"), str):
            found.setdefault(doc["policy"], path)
    return found


def check_suite(candidate_dir, reference_dir, *, policies: Sequence[str] | None = None,
                kinds: Sequence[str] = ("vectors", "e2e"), allow_missing: bool = False,
                tolerance_factor: float = 1.0, strict_ties: bool = False, check_dtype="kind",
                dtype=None, declare=None, case_dtype: str | None = None, default_params_only: bool = False,
                final_only: bool = False, source: str = "argument") -> SuiteReport:
    """Compare every file of a candidate directory with the reference suite (or folder of golden files).

    Parameters
    ----------
    candidate_dir, reference_dir : path-like
    policies, kinds : optional
        Only these policies / kinds of file (``"vectors"``, ``"e2e"``).
    allow_missing : bool
        Skip reference files the candidate lacks (otherwise each is a failure). If nothing
        is compared at all, the report fails.
    tolerance_factor : float
        Explicit override multiplying every tolerance; finite and > 0.
    strict_ties : bool
    check_dtype : {"kind", True, False}
    dtype : str, optional
        The precision the candidate computed in (overrides its files' ``computed_dtype``).
    declare : dict, optional
        Declared differences (override its files' ``declare``).
    case_dtype : {"float32", "float64", "all"}, optional
        Reference cases compared; default from ``dtype`` (:func:`case_dtype_for`), all
        without one.
    default_params_only : bool
        Only vector cases with the policies' default parameters.
    final_only : bool
        End-to-end goldens in the final-cache form.
    source : str
        Where ``dtype``/``declare`` came from, for the report ("command line").
    """
    from .suiteindex import read_suite

    start = time.perf_counter()
    factor = check_float("tolerance_factor", tolerance_factor, 0.0, low_open=True)
    name = check_dtype_name(dtype)
    if case_dtype is not None:
        check_choice("case_dtype", case_dtype, CASE_DTYPES)
    chosen = case_dtype_for(name) if case_dtype is None else (None if case_dtype == "all" else case_dtype)
    Declarations.parse(declare)  # a bad declaration is a usage error, before anything is read
    candidate_dir, reference_dir = Path(candidate_dir), Path(reference_dir)
    if not candidate_dir.is_dir():
        raise ValueError(f"candidate directory {candidate_dir} does not exist")
    if not reference_dir.is_dir():
        raise ValueError(f"reference directory {reference_dir} does not exist")
    report = SuiteReport(str(candidate_dir), str(reference_dir))
    if (reference_dir / "suite.json").exists():
        suite = read_suite(reference_dir)
        entries, known = suite["files"], suite["policies"]
    else:
        entries = discover_files(reference_dir)
        known = sorted({e["policy"] for e in entries})
        report.notes.append("the reference has no suite.json: its files were found by their schema and are not "
                            "checksummed")
    unknown = sorted(set(policies or ()) - set(known))
    if unknown:
        raise ValueError(f"the reference has no policy {', '.join(map(repr, unknown))}; it has: {', '.join(known)}")
    if chosen is not None:
        report.notes.append(f"reference cases compared: {chosen}"
                            + (f" (default for a {name} candidate; --case-dtype all compares every case)"
                               if case_dtype is None else ""))
    if factor != 1.0:
        report.notes.append(f"tolerance factor {factor:g}: every tolerance multiplied (explicit override)")
    cand_vectors = None
    for entry in entries:
        if entry["kind"] not in kinds or (policies and entry["policy"] not in policies):
            continue
        if chosen is not None and entry["kind"] == "e2e" and entry.get("dtype", chosen) != chosen:
            continue
        rel = entry["path"]
        cand = candidate_dir / rel
        if not cand.exists() and not cand.is_symlink() and entry["kind"] == "vectors":
            if cand_vectors is None:
                cand_vectors = _candidate_vectors(candidate_dir)
            cand = cand_vectors.get(entry["policy"], cand)
        if not cand.exists() and not cand.is_symlink():
            if not allow_missing:
                report.files.append(FileReport(rel, entry["kind"], Status.MISSING, "the candidate has no such file"))
            continue
        options = {"tolerance_factor": factor, "strict_ties": strict_ties, "check_dtype": check_dtype, "rel": rel,
                   "dtype": name, "declare": declare, "source": source}
        try:
            if entry["kind"] == "vectors":
                result = check_vector_file(cand, reference_dir / rel, case_dtype=chosen,
                                           default_params_only=default_params_only, **options)
            else:
                result = check_end_to_end_file(cand, reference_dir / rel, final_only=final_only, **options)
            report.files.append(result)
        except ValueError as err:  # a malformed candidate file is a failure of that file
            report.files.append(FileReport(rel, entry["kind"], Status.FAIL, failures=[f"unreadable: {err}"]))
    report.seconds = time.perf_counter() - start
    return report


def _finish(report, res, head: str):
    """An end-to-end file's report from its result: the summary line (``head`` and the
    logits), FAIL with the failure, TIE with the accepted ties, or as it was."""
    report.summary = head + (f"; logits {res.logits}" if res.logits else "")
    if res.failure:
        report.status = Status.FAIL
        report.failures.append(res.failure)
    elif res.ties:
        report.status = Status.TIE
    report.ties = [t.describe() for t in res.ties]
    return report
