"""The staging of a regenerated suite: a transaction that publishes it whole or not at all.

Every file is first written into the staging folder ``<suite>/.refkv-generate/`` (each
written atomically), the new ``suite.json`` too; then a commit record is written
(atomically) and the files are moved into place with :func:`os.replace`, ``suite.json``
last, and the stale files are deleted. A run killed before the commit record leaves the
old suite untouched (the staging folder is deleted by the next run); killed after it,
:func:`recover` finishes the move. Nothing outside the suite folder is ever touched: every
path is checked by :func:`safe_path` first.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from ..files import OutputFolder
from .io import dumps, read_json
from .kinds import SUITE_LAYOUTS, SUITE_PATH
from .schema import require

__all__ = ["COMMITTED", "STAGING", "commit", "recover", "safe_path"]

# -- paths inside the suite folder -----------------------------------------------------------------
#: The folder inside a suite where a generation stages its files.
STAGING = ".refkv-generate"
#: The commit record: once it exists in the staging folder, the new suite is complete there.
COMMITTED = "COMMITTED.json"


def safe_path(root: Path, rel, where: str) -> str:
    """``rel`` if it names a suite file inside ``root``; otherwise a ValueError (nothing touched).

    A suite file lies where its kind's layout says (:data:`refkv.oracle.kinds.SUITE_PATH`): relative,
    already normalised (no ``..``, ``.``, empty parts or backslashes), and it must resolve
    inside ``root`` (a symlinked folder pointing out of the suite is refused too).
    """
    if not isinstance(rel, str) or not SUITE_PATH.fullmatch(rel) or posixpath.normpath(rel) != rel:
        raise ValueError(f"{where}: path {rel!r} is not a suite file ({SUITE_LAYOUTS} inside the suite "
                         f"folder); refusing to touch it")
    base = root.resolve()
    for target in (root / rel, (root / rel).with_suffix(".npz")):
        resolved = target.resolve()
        if resolved != base and base not in resolved.parents:
            raise ValueError(f"{where}: path {rel!r} leads outside the suite folder {root} (to {resolved}); "
                             f"refusing to touch it")
    return rel



# -- the transaction ---------------------------------------------------------------------------------------
def _apply(out: Path) -> None:
    """Move a committed staging folder's files into place, suite.json last; remove the stale files.

    Idempotent: after an interruption it is run again and finishes the same move. Every
    move and deletion goes through the suite's :class:`refkv.files.OutputFolder`, which
    follows no link below the suite folder.
    """
    folder = OutputFolder(out, what="suite folder")
    stage = out / STAGING
    where = str(stage / COMMITTED)
    try:
        journal = read_json(stage / COMMITTED)
        moves = [safe_path(out, rel, where) for rel in _journal_list(journal, "files", where)]
        stale = [safe_path(out, rel, where) for rel in _journal_list(journal, "remove", where)]
    except ValueError as err:
        # Nothing was moved yet: dropping the staging folder leaves the old suite as it was,
        # and no state that only deleting .refkv-generate by hand would repair.
        folder.remove(STAGING)
        raise ValueError(f"{err} (the unfinished generation in {stage} was discarded; the suite is as "
                         f"before it)") from None
    for rel in moves:
        for name in (rel, rel[:-len(".json")] + ".npz"):
            if folder.path(f"{STAGING}/{name}").exists():
                folder.replace(f"{STAGING}/{name}", name)
    if folder.path(f"{STAGING}/suite.json").exists():
        folder.replace(f"{STAGING}/suite.json", "suite.json")  # the new suite is published here
    for rel in stale:
        for name in (rel, rel[:-len(".json")] + ".npz"):
            folder.remove(name)
    folder.remove(STAGING)
    for parent in sorted({(out / rel).parent for rel in stale}, reverse=True):
        if parent != out and parent.is_dir() and not parent.is_symlink() and not any(parent.iterdir()):
            parent.rmdir()


def _journal_list(journal: dict, key: str, where: str) -> list:
    value = require(journal, key, where)
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key} must be a list of suite files, got {type(value).__name__}")
    return value


def recover(out) -> bool:
    """Finish or discard a generation that was interrupted in folder ``out``.

    A staging folder with its commit record is rolled forward (its files were complete);
    one without is deleted (the old suite was never touched; a symlink there is removed
    itself, never what it points to). Returns whether anything was found.
    """
    out = Path(out)
    stage = out / STAGING
    if not (stage.exists() or stage.is_symlink()):
        return False
    if stage.is_dir() and not stage.is_symlink() and (stage / COMMITTED).is_file():
        _apply(out)
    else:
        OutputFolder(out, what="suite folder").remove(STAGING)
    return True


def commit(out: Path, files: dict[str, bytes], index: dict, stale: list[str]) -> None:
    """Publish ``files`` and ``index`` into suite folder ``out`` and remove ``stale``, as one transaction."""
    folder = OutputFolder(out, what="suite folder")
    folder.remove(STAGING)
    for rel in sorted(rel for rel in files if rel.endswith(".json")) + stale:  # refused before anything is written
        safe_path(out, rel, f"generating into {out}")
        folder.path(rel[:-len(".json")] + ".npz")
    for rel, data in files.items():
        folder.write_bytes(f"{STAGING}/{rel}", data)
    folder.write_bytes(f"{STAGING}/suite.json", dumps(index).encode("utf-8"))
    manifests = sorted(rel for rel in files if rel.endswith(".json"))
    # The commit point: once this record exists the new suite is complete on disk.
    folder.write_bytes(f"{STAGING}/{COMMITTED}", dumps({"files": manifests, "remove": stale}).encode("utf-8"))
    _apply(out)
