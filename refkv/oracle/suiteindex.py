"""The suite's index, ``suite.json``: read back and checked, for a check or for a merge.

The index lists every file of a suite with its kind, policy and sha256 (see
``docs/oracle/format.rst``); :mod:`refkv.oracle.generate` writes it.
"""

from __future__ import annotations

from pathlib import Path

from .io import read_json, sha256
from .kinds import LISTED, family
from .schema import SUITE_SCHEMA, check_header, require
from .staging import COMMITTED, STAGING, safe_path

__all__ = ["existing_index", "read_suite"]


def read_suite(directory, *, verify: bool = True) -> dict:
    """Read ``suite.json`` of a suite directory; with ``verify``, check every file's sha256.

    Never writes: a generation interrupted after its commit point (see
    :func:`refkv.oracle.generate.generate_suite`) is refused, to be finished by the writer
    (:func:`refkv.oracle.staging.recover`, which ``refkv golden generate`` runs first).

    Raises
    ------
    ValueError
        For an unknown schema version, a missing field, a missing file, or a file whose
        checksum differs from the index (edited or corrupted after generation).
    """
    directory = Path(directory)
    stage = directory / STAGING
    if (stage / COMMITTED).exists() or (stage / COMMITTED).is_symlink():
        # A reader never writes: finishing the publication (moving and deleting files) is
        # left to the writer, refkv golden generate, which checks the commit record first.
        raise ValueError(f"{directory}: a generation was interrupted while publishing its files "
                         f"({stage / COMMITTED} exists); a check never writes, so finish it with refkv golden "
                         f"generate --out {directory} (or refkv.oracle.staging.recover) and check again")
    path = directory / "suite.json"
    if not path.exists():
        raise ValueError(f"{directory} is not a golden suite: it has no suite.json")
    where = str(path)
    index = read_json(path)
    check_header(index, SUITE_SCHEMA, where)
    require(index, "policies", where)
    for i, entry in enumerate(require(index, "files", where)):
        for key in ("path", "kind", "policy", "sha256"):
            require(entry, key, f"{where}: files[{i}]")
        if entry["kind"] not in LISTED:
            raise ValueError(f"{where}: files[{i}]: kind must be {' or '.join(map(repr, LISTED))}, got "
                             f"{entry['kind']!r}")
        safe_path(directory, entry["path"], f"{where}: files[{i}]")
        if verify:
            file = directory / entry["path"]
            if not file.exists():
                raise ValueError(f"{where}: lists {entry['path']}, which does not exist")
            if sha256(file.read_bytes()) != entry["sha256"]:
                raise ValueError(f"{file}: checksum mismatch with suite.json (edited or corrupted after "
                                 f"generation; regenerate with refkv golden generate)")
            npz = file.with_suffix(".npz")
            if "npz_sha256" in entry and (not npz.is_file() or sha256(npz.read_bytes()) != entry["npz_sha256"]):
                raise ValueError(f"{npz}: missing or checksum mismatch with suite.json (regenerate with refkv "
                                 f"golden generate)")
    return index



def existing_index(out: Path, regenerated: set[str]) -> dict | None:
    """The existing ``suite.json`` of ``out``, every field the merge uses checked (None if there is none).

    Checked before anything is generated: ``policies`` a list of names, every entry an
    object with a suite-file ``path``, a listed ``kind`` (``vectors``, ``e2e``) and a
    ``policy`` named in ``policies``, ``skipped`` a list. The files of the policies that
    are kept must match their checksums, the ``.npz`` of an end-to-end golden too: a merge
    never publishes a suite that fails them.
    """
    path = out / "suite.json"
    if not path.exists():
        return None
    where = str(path)
    index = read_json(path)
    check_header(index, SUITE_SCHEMA, where)
    policies = index.get("policies", [])
    if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
        raise ValueError(f"{where}: policies must be a list of policy names, got {policies!r:.80}")
    files = require(index, "files", where)
    if not isinstance(files, list):
        raise ValueError(f"{where}: files must be a list")
    if not isinstance(index.get("skipped", []), list):
        raise ValueError(f"{where}: skipped must be a list, got {index['skipped']!r:.80}")
    for i, entry in enumerate(files):
        at = f"{where}: files[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object")
        safe_path(out, require(entry, "path", at), at)
        policy = require(entry, "policy", at)
        if not isinstance(policy, str) or policy not in policies:
            raise ValueError(f"{at}: policy {policy!r:.80} is not one of the suite's policies")
        if entry.get("kind") not in LISTED:
            raise ValueError(f"{at}: kind must be {' or '.join(map(repr, LISTED))}, got {entry.get('kind')!r:.80}")
    for entry in files:
        if entry["policy"] in regenerated:
            continue
        checked = [(out / entry["path"], entry.get("sha256"))]
        if family(entry["kind"])[0].npz:
            checked.append(((out / entry["path"]).with_suffix(".npz"), entry.get("npz_sha256")))
        for file, digest in checked:
            if not file.is_file() or sha256(file.read_bytes()) != digest:
                raise ValueError(f"{file}: missing or checksum mismatch with {where}, so the existing suite cannot "
                                 f"be merged into; regenerate policy {entry['policy']!r} too (or every policy)")
    return index

