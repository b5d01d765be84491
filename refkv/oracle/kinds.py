"""The kinds of golden file, declared once: :data:`KINDS`.

Everything that differs between kinds -- the schema a file states, where it lies in a
suite, whether arrays sit beside it in an ``.npz``, which policy and dtype it is for,
how a reference is read and how a candidate is checked -- is a field of its
:class:`GoldenKind` entry; :mod:`refkv.oracle.checker` (``refkv golden check``),
:mod:`refkv.oracle.suiteindex`, :mod:`refkv.oracle.staging`,
:mod:`refkv.oracle.generate` and :mod:`refkv.oracle.regenerate` look kinds up here and
name none. A new kind is one entry below plus its reader and its checker module (see
"Adding a golden kind" in ``CONTRIBUTING.rst``).

Kinds that share a file format share the name ``suite.json``, a report and ``--kind``
give them (:attr:`GoldenKind.listed_as`): a schedule golden is an end-to-end file
(schema ``refkv-e2e``, version 2) listed as ``e2e``, but checked round by round, so it is
its own entry; which of the two a reference is, its manifest says (:func:`kind_for`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .e2echeck import check_end_to_end_file
from .endtoend import is_schedule, read_end_to_end
from .io import read_json
from .schedulecheck import check_schedule_file
from .schema import E2E_SCHEMA, VECTORS_SCHEMA
from .vectorcheck import check_vector_file
from .vectors import read_vectors

__all__ = ["BY_NAME", "KINDS", "LISTED", "SUITE_LAYOUTS", "SUITE_PATH", "GoldenKind", "family", "kind_at", "kind_for",
           "kind_of_document"]

#: A name inside a suite path: a policy, or a golden's label.
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.+-]*"


@dataclass(frozen=True)
class GoldenKind:
    """One kind of golden file.

    Attributes
    ----------
    name : str
        The kind's own name.
    listed_as : str
        The kind ``suite.json``, a report line and ``refkv golden check --kind`` give its
        files; kinds that share a file format share it (and its schema, layout, reader,
        ``npz``, ``policy_of`` and ``dtype_of``).
    schema : str
        The ``schema`` its files state (:mod:`refkv.oracle.schema`).
    layout : str
        Its path inside a suite; ``<policy>`` and ``<name>`` stand for names.
    npz : bool
        Its arrays lie beside it in an ``.npz`` (checksummed as ``npz_sha256``).
    policy_of : callable
        ``document -> policy name`` (None if the document names none).
    dtype_of : callable or None
        ``document -> dtype`` of a file with one dtype; None for a kind whose cases each
        have their own (its checker selects the cases of a dtype).
    matches : callable
        ``document -> bool``: whether a file of this schema is of this kind.
    read : callable
        ``path -> golden``: reads and validates a reference file (ValueError if bad).
    check : callable
        ``check(candidate_path, reference_path, *, rel, dtype, declare, tolerance_factor,
        strict_ties, check_dtype, source, **options) -> FileReport``.
    options : tuple of str
        The options of :func:`~refkv.oracle.checker.check_suite` that ``check`` also takes.
    found_anywhere : bool
        A candidate's file may lie anywhere in its folder (found by schema and policy)
        when it is not at the suite's path.
    """

    name: str
    listed_as: str
    schema: str
    layout: str
    npz: bool
    policy_of: Callable[[dict], object]
    dtype_of: Callable[[dict], object] | None
    matches: Callable[[dict], bool]
    read: Callable
    check: Callable
    options: tuple = ()
    found_anywhere: bool = False

    def path(self, policy: str, name: str | None = None) -> str:
        """The suite path of a file of ``policy`` (``name``: its label, for kinds with one)."""
        return self.layout.replace("<policy>", policy).replace("<name>", name or policy)


def _e2e_policy(doc: dict):
    return doc.get("policy", {}).get("name")


KINDS = (
    GoldenKind("vectors", "vectors", VECTORS_SCHEMA, "vectors/<policy>.json", npz=False,
               policy_of=lambda doc: doc.get("policy"), dtype_of=None, matches=lambda doc: True,
               read=read_vectors, check=check_vector_file, options=("case_dtype", "default_params_only"),
               found_anywhere=True),
    GoldenKind("e2e", "e2e", E2E_SCHEMA, "e2e/<policy>/<name>.json", npz=True, policy_of=_e2e_policy,
               dtype_of=lambda doc: doc.get("dtype"), matches=lambda doc: not is_schedule(doc),
               read=read_end_to_end, check=check_end_to_end_file, options=("final_only",)),
    GoldenKind("schedule", "e2e", E2E_SCHEMA, "e2e/<policy>/<name>.json", npz=True, policy_of=_e2e_policy,
               dtype_of=lambda doc: doc.get("dtype"), matches=is_schedule,
               read=read_end_to_end, check=check_schedule_file, options=("final_only",)),
)

#: Each kind by its own name.
BY_NAME = {k.name: k for k in KINDS}
#: The names files are listed under, in the order a suite lists them (each policy's vectors first).
LISTED = tuple(dict.fromkeys(k.listed_as for k in KINDS))
#: The suite paths of every kind, in words: ``"vectors/<policy>.json or e2e/<policy>/<name>.json"``.
SUITE_LAYOUTS = " or ".join(dict.fromkeys(k.layout for k in KINDS))
#: A suite path of any kind (relative, normalised names only).
SUITE_PATH = re.compile("|".join(re.escape(layout).replace("<policy>", _NAME).replace("<name>", _NAME)
                                 for layout in dict.fromkeys(k.layout for k in KINDS)))


def family(listed: str) -> tuple:
    """The kinds listed as ``listed`` (one format); a ValueError for a name no kind is listed as."""
    kinds = tuple(k for k in KINDS if k.listed_as == listed)
    if not kinds:
        raise ValueError(f"kind must be {' or '.join(map(repr, LISTED))}, got {listed!r:.80}")
    return kinds


def kind_for(listed: str, reference_path) -> GoldenKind:
    """The kind of the reference file at ``reference_path``, listed as ``listed``.

    A format with one kind needs no reading; otherwise the reference's JSON says which
    (an unreadable one is a ValueError, as reading it to check it would be).
    """
    kinds = family(listed)
    if len(kinds) == 1:
        return kinds[0]
    doc = read_json(reference_path)
    return next((k for k in kinds if k.matches(doc)), kinds[0])


def kind_of_document(doc: dict) -> GoldenKind | None:
    """The kind of a golden file's JSON document (None if it states no golden schema)."""
    return next((k for k in KINDS if doc.get("schema") == k.schema and k.matches(doc)), None)


def kind_at(rel: str) -> GoldenKind:
    """The kind whose files lie at suite path ``rel`` (by its first folder)."""
    top = rel.split("/", 1)[0]
    return next(k for k in KINDS if k.layout.split("/", 1)[0] == top)
