"""What the checks of every golden kind share: a candidate file's settings, and an
end-to-end file's verdict from its walk's result."""

from __future__ import annotations

from pathlib import Path

from .declare import Declarations
from .report import FileReport
from .status import Status
from .tolerance import check_dtype_name

__all__ = ["candidate_settings", "finish_end_to_end", "npz_path"]


def candidate_settings(meta: dict, where: str, dtype, declare, source: str):
    """Computed dtype and declarations: the candidate file's, overridden by the caller's.

    Parameters
    ----------
    meta : dict
        The candidate file's top-level fields (``computed_dtype``, ``declare``).
    where : str
        The candidate file, for error messages.
    dtype, declare : optional
        The caller's computed dtype and declarations; they win over the file's.
    source : str
        Where the caller's settings came from, for the notes ("command line").

    Returns
    -------
    tuple
        ``(dtype name or None, Declarations, notes)``.
    """
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


def finish_end_to_end(report: FileReport, res, head: str) -> FileReport:
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


def npz_path(golden) -> str:
    """The ``.npz`` beside an end-to-end file read back (what a refusal of its arrays names)."""
    return str(Path(golden.path).parent / golden.manifest["arrays"]["file"])
