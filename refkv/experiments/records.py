"""The results file of an experiment: one JSON record per finished cell, appended safely.

Every finished cell is one JSON object on one line of ``OUT/<experiment>.jsonl``
(:func:`make_record`): the experiment name, the cell key, every parameter (model, dtype,
seed, policy, budget, block size, ...), the result, the wall time, the cell process's CPU
time and the refkv / NumPy / Python versions. On a shared machine the CPU time is the
better estimate of the cost.

* **Durable.** Each record is appended as one ``write`` of a complete line, then flushed
  and ``fsync``-ed (:func:`append_record`); a run killed mid-write leaves at most a
  partial last line, which :func:`read_records` ignores and :func:`cut_partial_tail` cuts
  off before the next run appends.
* **One writer.** :func:`locked` holds an advisory lock beside the file while a run
  writes it (where the platform has one), so two runs on one file fail fast.
* **Keys.** A cell's key is the canonical JSON of its parameters (:func:`cell_key`:
  sorted keys, no spaces), so two grids that share a cell share its record. If the same
  key appears twice, the later record wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
import warnings
from pathlib import Path

import numpy as np

from .. import __version__
from ..files import check_write_target, file_mode, parse_json, read_regular

__all__ = [
    "MAX_RECORDS_BYTES",
    "MAX_RECORD_BYTES",
    "append_record",
    "cell_key",
    "cut_partial_tail",
    "locked",
    "make_record",
    "read_records",
]

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None

#: ``os.O_NOFOLLOW`` where the platform has it: records and locks are never opened through a symlink.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def cell_key(params: dict) -> str:
    """The canonical JSON of a cell's parameters: its identity in the results file."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)


#: Largest results file read (a record is a few kB; the full grid has a few thousand cells).
MAX_RECORDS_BYTES = 2**30
#: Largest single record line.
MAX_RECORD_BYTES = 1 << 24


def read_records(path, check=None) -> list[dict]:
    """All complete records of a JSON-lines results file (``[]`` if it does not exist).

    A partial last line (a run killed mid-write) is ignored silently; a last line that
    is a complete record whose newline was lost is kept; an unreadable line elsewhere is
    skipped with a warning naming the file and line (its cell runs again). A record is
    readable when it is standard JSON (no ``NaN``, at most :data:`refkv.files.MAX_JSON_DEPTH`
    levels) holding a string ``key``, a ``params`` object and a ``result`` object. Records
    with the same key: the last wins. The file must be a regular file (a FIFO or device is
    refused, a symlink out of its folder too) of at most :data:`MAX_RECORDS_BYTES`.

    ``check(params, result)``, where given (the experiment's
    :attr:`~refkv.experiments.design.Experiment.check_result`), validates each record's result
    too: a record it refuses is skipped the same way, so a tampered or truncated result
    (``"result": {}``, positions of 10**9) is never counted as a finished cell.
    """
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return []
    data = read_regular(path, MAX_RECORDS_BYTES, what="results file", root=path.parent)
    lines = data.split(b"\n")
    complete = lines[:-1]  # after the last "\n": empty, a partial line, or a whole record
    if _whole_record(lines[-1]):
        complete.append(lines[-1])
    by_key: dict[str, dict] = {}
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = _parse_record(line, f"{path}:{number}")
            if check is not None:
                check(record.get("params", {}), record.get("result", {}))
        except ValueError as err:
            warnings.warn(f"{path}:{number}: skipping an unreadable record ({err}); its cell runs again",
                          stacklevel=2)
            continue
        by_key[record["key"]] = record
    return list(by_key.values())


def _parse_record(line: bytes, where: str) -> dict:
    """One record line, checked for the fields the runner and the summaries use."""
    if len(line) > MAX_RECORD_BYTES:
        raise ValueError(f"{where}: a record of {len(line)} bytes, more than {MAX_RECORD_BYTES}")
    record = parse_json(line, where)
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        raise ValueError(f"{where}: a record must be an object with a string key")
    for name in ("params", "result"):
        if name in record and not isinstance(record[name], dict):
            raise ValueError(f"{where}: the record's {name} must be an object, got {type(record[name]).__name__}")
    return record


def _whole_record(line: bytes) -> bool:
    """True if ``line`` (no newline) is one complete record: a JSON object with a key.

    A torn write is a prefix of such a line; no proper prefix of a JSON object is a
    JSON object, so a torn line is never mistaken for a whole one.
    """
    if not line.strip():
        return False
    try:
        _parse_record(line, "record")
    except ValueError:
        return False
    return True


def cut_partial_tail(path) -> None:
    """Make the file end on a fresh line before appending.

    A partial last line (no trailing newline) is cut; a complete last record whose
    newline was lost gets its newline back instead (it is a finished cell).
    """
    path = Path(path)
    if not path.exists():
        return
    fd = os.open(path, os.O_RDWR | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        tail = _last_line(f, size)
        if _whole_record(tail):
            f.seek(size)
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
            return
        # Walk back to the last newline; the bytes after it are a torn write.
        position = size
        chunk = 4096
        end = 0
        while position > 0:
            start = max(0, position - chunk)
            f.seek(start)
            block = f.read(position - start)
            index = block.rfind(b"\n")
            if index >= 0:
                end = start + index + 1
                break
            position = start
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())


def _last_line(f, size: int, limit: int = 1 << 24) -> bytes:
    """The bytes after the last newline of an open file (up to ``limit``: a record is small)."""
    start = max(0, size - limit)
    f.seek(start)
    block = f.read(size - start)
    return block[block.rfind(b"\n") + 1:]


def append_record(path, record: dict) -> None:
    """Append one record as one line, then flush and fsync (durable before returning)."""
    line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, file_mode())
    with os.fdopen(fd, "ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def locked(path: Path):
    """Advisory exclusive lock on ``.NAME.lock`` beside ``path`` (POSIX); two runs on one file fail fast."""
    if fcntl is None:  # pragma: no cover - Windows: no lock
        yield
        return
    lock_path = check_write_target(path.with_name(f".{path.name}.lock"), path.parent, what="lock file")
    # Opened without truncating, without following a symlink and without blocking on a FIFO.
    fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), file_mode())
    with os.fdopen(fd, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"another refkv experiment run is writing {path}; wait for it or use another --out")\
                from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def make_record(experiment: str, key: str, params: dict, result: dict, wall: float, cpu: float) -> dict:
    """The record of one finished cell: what it ran, its result, its times and the versions."""
    return {"experiment": experiment, "key": key, "params": params, "result": result,
            "wall_time_s": round(wall, 3), "cpu_time_s": round(cpu, 3),
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "refkv_version": __version__, "numpy_version": np.__version__,
            "python_version": platform.python_version()}
