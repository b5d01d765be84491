"""Writing and reading golden files: atomic, deterministic, never pickled.

* Writes go to a temporary file in the destination directory, are flushed to disk, and
  then renamed over the destination with :func:`os.replace`, so a reader never sees a
  half-written file and an interrupted run leaves the old file intact.
* The same content gives the same bytes: JSON keys keep their insertion order, arrays are
  written one per line, and ``.npz`` members carry a fixed timestamp (NumPy's own
  ``savez`` stamps the current time).
* ``.npz`` files are read with ``allow_pickle=False``; JSON is read with a parser that
  refuses the non-standard ``NaN``/``Infinity`` tokens.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .schema import ARRAY_DTYPES

__all__ = ["atomic_write", "dumps", "npz_bytes", "read_json", "read_npz", "sha256", "write_json", "write_npz"]

# A fixed member timestamp (the earliest a zip file can hold) makes .npz bytes reproducible.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def _umask() -> int:
    """The process's file-creation mask (read by setting it and restoring it at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same directory + rename).

    The file gets the permissions a plain ``open(path, "w")`` would give (``0o666`` less
    the umask: 0644 under umask 022), not the 0600 of a temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _is_encoded_array(obj) -> bool:
    return isinstance(obj, Mapping) and set(obj) == {"dtype", "shape", "data"}


def _leaf(obj) -> str:
    return json.dumps(obj, allow_nan=False, ensure_ascii=False)


def _dump(obj, indent: int, out: list) -> None:
    pad = " " * indent
    if _is_encoded_array(obj) or not isinstance(obj, (Mapping, list)):
        out.append(_leaf(obj))
    elif isinstance(obj, list) and not any(isinstance(x, (Mapping, list)) for x in obj):
        out.append(_leaf(obj))  # a list of scalars stays on one line
    elif isinstance(obj, Mapping):
        if not obj:
            out.append("{}")
            return
        out.append("{\n")
        for i, (key, value) in enumerate(obj.items()):
            if not isinstance(key, str):
                raise ValueError(f"JSON object keys must be strings, got {key!r}")
            out.append(f"{pad}  {_leaf(key)}: ")
            _dump(value, indent + 2, out)
            out.append(",\n" if i < len(obj) - 1 else "\n")
        out.append(pad + "}")
    else:
        out.append("[\n")
        for i, value in enumerate(obj):
            out.append(pad + "  ")
            _dump(value, indent + 2, out)
            out.append(",\n" if i < len(obj) - 1 else "\n")
        out.append(pad + "]")


def dumps(obj) -> str:
    """JSON text with the structure indented and every array on one line (deterministic)."""
    out: list[str] = []
    _dump(obj, 0, out)
    out.append("\n")
    return "".join(out)


def write_json(path, obj) -> bytes:
    """Write ``obj`` as JSON atomically; return the bytes written."""
    data = dumps(obj).encode("utf-8")
    atomic_write(path, data)
    return data


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}; non-finite floats are written as strings")


def read_json(path) -> dict:
    """Parse a JSON file; ValueError (naming the file) if it is not valid standard JSON."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: the top level must be a JSON object")
    return obj


def write_npz(path, arrays: Mapping[str, np.ndarray]) -> bytes:
    """Write ``arrays`` as an ``.npz`` (deflated zip of ``.npy``) atomically and reproducibly.

    Members are written in sorted name order with a fixed timestamp. Returns the bytes.
    """
    data = npz_bytes(arrays)
    atomic_write(path, data)
    return data


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """The bytes :func:`write_npz` writes for ``arrays`` (same content, same bytes)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in sorted(arrays):
            array = np.ascontiguousarray(arrays[name])
            if array.dtype.name not in ARRAY_DTYPES:
                raise ValueError(f"array {name!r}: dtype {array.dtype} not allowed; allowed: {', '.join(ARRAY_DTYPES)}")
            member = io.BytesIO()
            np.lib.format.write_array(member, array, allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return buf.getvalue()


def read_npz(path) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` file, loaded with ``allow_pickle=False``."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npz file: {err}") from None
    except ValueError as err:  # e.g. an object array, refused without pickle
        raise ValueError(f"{path}: {err}") from None


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
