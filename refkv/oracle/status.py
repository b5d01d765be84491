"""The one vocabulary of verdicts the oracle's comparisons report."""

from __future__ import annotations

from enum import Enum

__all__ = ["Outcome", "Status"]


class Status(str, Enum):
    """Outcome of a comparison, from a single head to a whole suite.

    A ``str`` enum, so ``Status.OK == "ok"`` and old code comparing with strings keeps
    working.

    * ``EQUAL``: identical decisions (retention level only);
    * ``OK``: passed;
    * ``TIE``: passed, with accepted ties (the candidate kept other tokens whose
      reference scores are within tolerance of the ones it replaces);
    * ``FAIL``: a real difference;
    * ``MISSING``: the candidate has no such file (suite level only).
    """

    EQUAL = "equal"
    OK = "ok"
    TIE = "tie"
    FAIL = "fail"
    MISSING = "missing"

    @classmethod
    def of(cls, failed, tied) -> Status:
        """The verdict of a comparison: ``FAIL`` if anything failed, else ``TIE`` if a tie was
        accepted, else ``OK`` (the one rule every level uses)."""
        return cls.FAIL if failed else (cls.TIE if tied else cls.OK)

    @property
    def passed(self) -> bool:
        return self in (Status.EQUAL, Status.OK, Status.TIE)

    @property
    def tag(self) -> str:
        """The four-character tag a report line starts with."""
        return {"equal": "ok  ", "ok": "ok  ", "tie": "TIE ", "fail": "FAIL", "missing": "MISS"}[self.value]


class Outcome:
    """What a comparison's result class shares: ``ok`` and ``status`` from its ``failure``
    (a message or None) and its accepted ``ties`` (a list), by :meth:`Status.of`."""

    failure: str | None
    ties: list

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def status(self) -> Status:
        return Status.of(self.failure, self.ties)
