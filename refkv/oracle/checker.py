"""``refkv golden check``: a candidate's files against a reference suite or folder of case files.

The reference is a suite folder (``suite.json``, checksums verified) or any folder of
golden files without one (a folder of one-shot cases built with
:func:`refkv.oracle.synthetic.replay` and :func:`refkv.oracle.encode.encode_case`); the
candidate mirrors its layout, or holds vectors files of the same policies anywhere
inside it. A file that cannot be read -- malformed, not a regular file (a FIFO, a link to
``/dev/zero``), arrays whose headers declare more than they hold -- fails on its own line;
the check goes on. Each file is checked by its kind's checker (:data:`refkv.oracle.kinds.KINDS`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from ..validation import check_choice, check_float
from .candidates import CandidateError
from .declare import Declarations
from .io import read_json
from .kinds import KINDS, LISTED, GoldenKind, family, kind_for, kind_of_document
from .report import FileReport, SuiteReport
from .specs import manifest_spec, spec_label, spec_matches, spec_name
from .status import Status
from .suiteindex import read_suite
from .tolerance import check_dtype_name

__all__ = ["case_dtype_for", "check_file", "check_suite", "discover_files"]

CASE_DTYPES = ("float32", "float64", "all")


def case_dtype_for(dtype: str | None) -> str | None:
    """The reference cases a candidate computing in ``dtype`` is checked on by default.

    float64: the float64 cases; float32, bfloat16, float16: the float32 cases (the
    suite's lowest precision); None: all.
    """
    name = check_dtype_name(dtype)
    return None if name is None else ("float64" if name == "float64" else "float32")


def check_file(candidate_path, reference_path, kind: str, **options) -> FileReport:
    """Compare one candidate file with the reference file, by the reference's kind's checker.

    ``kind`` is the name the file is listed under (``"vectors"``, ``"e2e"``); which kind of
    that name the reference is (an end-to-end or a schedule golden), it says itself.
    ``options`` are the checker's (see :class:`refkv.oracle.kinds.GoldenKind`).
    """
    return kind_for(kind, reference_path).check(candidate_path, reference_path, **options)


def discover_files(directory) -> list[dict]:
    """Index entries (``path``, ``kind``, ``policy``, ``dtype``) of the golden files in a folder without suite.json.

    ``policy`` is an end-to-end golden's policy with its options (its canonical spec,
    :func:`~refkv.oracle.specs.manifest_spec`), a vectors file's policy name.
    """
    directory = Path(directory)
    entries = []
    for path in sorted(p for p in directory.rglob("*.json") if p.name != "suite.json"):
        doc = read_json(path)
        kind = kind_of_document(doc)
        if kind is None:
            continue
        policy = kind.policy_of(doc)
        if isinstance(policy, str) and isinstance(doc.get("policy"), dict):
            policy = manifest_spec(doc["policy"])
        entry = {"path": path.relative_to(directory).as_posix(), "kind": kind.listed_as,
                 "policy": "?" if policy is None else policy}
        if kind.dtype_of is not None:
            entry["dtype"] = kind.dtype_of(doc)
        entries.append(entry)
    if not entries:
        schemas = " or ".join(dict.fromkeys(k.schema for k in KINDS))
        raise ValueError(f"{directory} has no suite.json and holds no golden files (no *.json of schema "
                         f"{schemas})")
    return entries


def _candidate_files(candidate_dir: Path, kind: GoldenKind) -> dict:
    """Policy -> path of the candidate's files of ``kind`` found anywhere in its folder (unreadable ones skipped)."""
    found = {}
    for path in sorted(candidate_dir.rglob("*.json")):
        try:
            doc = read_json(path)
        except ValueError:
            continue
        if doc.get("schema") == kind.schema and isinstance(kind.policy_of(doc), str):
            found.setdefault(kind.policy_of(doc), path)
    return found


def check_suite(candidate_dir, reference_dir, *, policies: Sequence[str] | None = None,
                kinds: Sequence[str] = LISTED, allow_missing: bool = False,
                tolerance_factor: float = 1.0, strict_ties: bool = False, check_dtype="kind",
                dtype=None, declare=None, case_dtype: str | None = None, default_params_only: bool = False,
                final_only: bool = False, source: str = "argument") -> SuiteReport:
    """Compare every file of a candidate directory with the reference suite (or folder of golden files).

    Parameters
    ----------
    candidate_dir, reference_dir : path-like
    policies, kinds : optional
        Only these policies / kinds of file (``"vectors"``, ``"e2e"``). A policy is a
        canonical spec (:func:`~refkv.oracle.specs.golden_spec`): a bare name selects the
        policy's goldens whatever their options, a spec with options only those.
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
    unknown = sorted(p for p in policies or () if not any(spec_matches(p, k) for k in known))
    if unknown:
        raise ValueError(f"the reference has no policy {', '.join(map(repr, unknown))}; it has: {', '.join(known)}")
    if chosen is not None:
        report.notes.append(f"reference cases compared: {chosen}"
                            + (f" (default for a {name} candidate; --case-dtype all compares every case)"
                               if case_dtype is None else ""))
    if factor != 1.0:
        report.notes.append(f"tolerance factor {factor:g}: every tolerance multiplied (explicit override)")
    found: dict = {}  # listed kind -> the candidate's files found anywhere, by policy
    per_kind = {"case_dtype": chosen, "default_params_only": default_params_only, "final_only": final_only}
    compared_policies: dict[str, None] = {}
    for entry in entries:
        if entry["kind"] not in kinds or (policies and not any(spec_matches(p, entry["policy"]) for p in policies)):
            continue
        listed = family(entry["kind"])[0]  # what every kind listed alike shares
        if chosen is not None and listed.dtype_of is not None and entry.get("dtype", chosen) != chosen:
            continue
        rel = entry["path"]
        cand = candidate_dir / rel
        if not cand.exists() and not cand.is_symlink() and listed.found_anywhere:
            if entry["kind"] not in found:
                found[entry["kind"]] = _candidate_files(candidate_dir, listed)
            cand = found[entry["kind"]].get(spec_name(entry["policy"]), cand)
        label = _policy_label(entry, reference_dir / rel)
        if not cand.exists() and not cand.is_symlink():
            if not allow_missing:
                report.files.append(FileReport(rel, entry["kind"], Status.MISSING, "the candidate has no such file",
                                               policy=label))
            continue
        compared_policies[label] = None
        options = {"tolerance_factor": factor, "strict_ties": strict_ties, "check_dtype": check_dtype, "rel": rel,
                   "dtype": name, "declare": declare, "source": source}
        try:
            kind = kind_for(entry["kind"], reference_dir / rel)
            options.update((key, per_kind[key]) for key in kind.options)
            file_report = kind.check(cand, reference_dir / rel, **options)
        except ValueError as err:  # a malformed or refused candidate file is a failure of that file
            why = "refused" if isinstance(err, CandidateError) else "unreadable"
            file_report = FileReport(rel, entry["kind"], Status.FAIL, failures=[f"{why}: {err}"])
        file_report.policy = label
        report.files.append(file_report)
    if compared_policies:
        report.notes.append(f"policies: {', '.join(compared_policies)}")
    report.seconds = time.perf_counter() - start
    return report


def _policy_label(entry: dict, reference) -> str:
    """The golden's policy with its options, for the report: from its end-to-end manifest
    (the options it was made with), else from the index entry (a vectors file: its spec)."""
    policy = entry.get("policy")
    if family(entry["kind"])[0].npz:
        try:
            doc = read_json(reference)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("policy"), dict):
            policy = manifest_spec(doc["policy"])
    if not isinstance(policy, str):
        return "?"
    try:
        return spec_label(policy)
    except ValueError:  # not a spec refkv can read: shown as it is
        return policy
