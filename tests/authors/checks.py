"""Shared by tests/authors/test_authors_*.py: ``refkv golden check`` of the committed candidates
(written by tools/authors from the authors' own code) against refkv's forms, through the CLI."""

from __future__ import annotations

import json
import pathlib
import re

from refkv.cli import main

HERE = pathlib.Path(__file__).parent


def check(capsys, policy: str, form: str, *, ties: bool = False, strict: bool = True) -> tuple[int, str]:
    """Exit code and report of ``refkv golden check CAND --against REF`` for one policy and form."""
    root = HERE / policy / ("ties" if ties else "")
    args = ["golden", "check", str(root / "candidate"), "--against", str(root / form), "--verbose"]
    rc = main([*args, "--strict-ties"] if strict else args)
    return rc, capsys.readouterr().out


def counts(report: str) -> tuple[int, int]:
    """(cases compared, cases passed) of a one-file report."""
    found = re.search(r"(\d+) cases: (\d+) passed", report)
    assert found, report
    return int(found.group(1)), int(found.group(2))


def strict_tie_heads(report: str) -> int:
    """How many heads a strict check failed only at an exact tie."""
    return report.count("[exact tie: equal reference scores]")


def provenance(policy: str) -> dict:
    return json.loads((HERE / policy / "PROVENANCE.json").read_text())
