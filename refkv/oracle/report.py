"""Reports of ``refkv golden check``: per file, per suite, and their text."""

from __future__ import annotations

from dataclasses import dataclass, field

from .status import Status

__all__ = ["FileReport", "SuiteReport"]


@dataclass
class FileReport:
    """Outcome of one golden file.

    ``status`` is a :class:`~refkv.oracle.status.Status` (``OK``, ``TIE``, ``FAIL`` or
    ``MISSING``); ``notes`` say how the file was compared (dtype, declarations, the
    end-to-end form, warnings); ``compared`` counts the vector cases or end-to-end
    decisions compared (None: not counted); ``policy`` is the golden's policy with its
    options (``"adakv(base=keydiff, form=kvpress)"``, :func:`refkv.oracle.specs.spec_label`),
    printed after the path.
    """

    path: str
    kind: str
    status: Status
    summary: str = ""
    failures: list = field(default_factory=list)
    ties: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    compared: int | None = None
    policy: str = ""

    def __post_init__(self):
        self.status = Status(self.status)


@dataclass
class SuiteReport:
    """Outcome of :func:`refkv.oracle.checker.check_suite`."""

    candidate: str
    reference: str
    files: list = field(default_factory=list)
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def nothing_compared(self) -> bool:
        """No file, or no file with a case or decision compared (a filter left none)."""
        return all(f.compared == 0 for f in self.files)

    @property
    def ok(self) -> bool:
        """Every file passed, and something was compared (nothing compared is no pass)."""
        return not self.nothing_compared and all(f.status.passed for f in self.files)

    def counts(self) -> dict:
        out = {s.value: 0 for s in (Status.OK, Status.TIE, Status.FAIL, Status.MISSING)}
        for f in self.files:
            out[f.status.value] += 1
        return out

    def format(self, *, verbose: bool = False) -> str:
        """The report as text: failures in full, ties listed with their rule, a one-line verdict."""
        lines = [f"refkv golden check: {self.candidate} against {self.reference}"]
        lines += ["  " + n for n in self.notes]
        for f in self.files:
            quiet = f.status is Status.OK and not verbose
            where = f.path + (f" [{f.policy}]" if f.policy else "")
            if not quiet:
                lines.append(f"{f.status.tag} {where}" + (f": {f.summary}" if f.summary else ""))
            for note in f.notes:
                if not quiet or note.startswith(("declared", "overridden", "warning")):
                    lines.append(("     " if not quiet else f"ok   {where}: ") + note)
            for msg in f.failures:
                lines.append("     " + msg.replace("\n", "\n     "))
            for t in f.ties[:5 if not verbose else None]:
                lines.append("     tie accepted: " + t)
            if len(f.ties) > 5 and not verbose:
                lines.append(f"     ... {len(f.ties) - 5} more ties (--verbose lists them)")
        c = self.counts()
        n_ties = sum(len(f.ties) for f in self.files)
        n = len(self.files)
        ties = f" ({c['tie']} with {n_ties} accepted ties)" if n_ties else ""
        lines.append(f"{n} file{'s' if n != 1 else ''}: {c['ok'] + c['tie']} passed{ties}, {c['fail']} failed, "
                     f"{c['missing']} missing; {self.seconds:.2f} s")
        if self.ok:
            lines.append("PASS")
        elif not self.files:
            lines.append("FAIL (nothing was compared)")
        elif self.nothing_compared:
            lines.append("FAIL (nothing was compared: no reference case matched the selection -- --default-params, "
                         "--case-dtype or --dtype)")
        else:
            lines.append("FAIL")
        return "\n".join(lines)
