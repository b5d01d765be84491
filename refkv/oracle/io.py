"""Writing and reading golden files: atomic, deterministic, never pickled.

* Writes go through :func:`refkv.files.atomic_write`: to a temporary file in the
  destination directory, flushed to disk, and then renamed over the destination with
  :func:`os.replace`, so a reader never sees a half-written file and an interrupted run
  leaves the old file intact.
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
import math
import os
import stat
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..files import atomic_write, parse_json, read_regular
from .schema import ARRAY_DTYPES

__all__ = ["dumps", "npz_bytes", "read_json", "read_npz", "sha256", "write_json", "write_npz"]

# A fixed member timestamp (the earliest a zip file can hold) makes .npz bytes reproducible.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


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


def _regular_file(path: Path) -> os.stat_result:
    """``path``'s stat if it is a regular file (after symlinks); ValueError otherwise.

    Checked before opening: a FIFO would block the reader forever, and a device such as
    ``/dev/zero`` would be read until memory runs out.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read: {err.strerror or err}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket"
                if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise ValueError(f"{path}: not a regular file ({kind}); golden files must be regular files")
    return st


#: Largest JSON file read (a golden vectors file is about 100 kB).
MAX_JSON_BYTES = 256 * 2**20
#: Largest total of array bytes an ``.npz`` may declare (the committed goldens hold kilobytes).
MAX_NPZ_BYTES = 2**30


def read_json(path, *, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """Parse a JSON file; ValueError (naming the file) if it is not valid standard JSON.

    Read with :func:`refkv.files.read_regular` and :func:`refkv.files.parse_json`: anything
    but a regular file, and files over ``max_bytes``, are refused before reading; more than
    :data:`refkv.files.MAX_JSON_ITEMS` values before parsing; nesting deeper than
    :data:`refkv.files.MAX_JSON_DEPTH`, ``NaN``/``Infinity`` and a key given twice in one
    object (``"kept"`` twice would otherwise silently mean the last) are refused too.
    """
    path = Path(path)
    _regular_file(path)  # the golden files' own wording for a FIFO, device or folder
    data = read_regular(path, max_bytes, what="golden JSON file")
    obj = parse_json(data, str(path))
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


def npz_bytes(arrays: Mapping[str, np.ndarray], compresslevel: int = 9) -> bytes:
    """The bytes :func:`write_npz` writes for ``arrays`` (same content, same bytes).

    ``compresslevel`` 9 for goldens (small, committed); a candidate's tens of megabytes of
    float rows compress little and level 9 took 45% of a SmolLM2 adapter run: 1 there.
    """
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
            zf.writestr(info, member.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=compresslevel)
    return buf.getvalue()


def _member_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> tuple[tuple, np.dtype]:
    """Shape and dtype of one ``.npy`` member, from its header alone (nothing else is read)."""
    with zf.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"{path}: member {info.filename}: unsupported .npy version {version}")
        header_bytes = f.tell()
    if dtype.hasobject:
        raise ValueError(f"{path}: member {info.filename}: object arrays are refused (they need pickle)")
    need = math.prod(shape) * dtype.itemsize
    if need + header_bytes != info.file_size:
        raise ValueError(f"{path}: member {info.filename} declares shape {shape} of {dtype} ({need} bytes) but "
                         f"holds {info.file_size - header_bytes} bytes of data")
    return shape, dtype


def read_npz(path, *, max_bytes: int = MAX_NPZ_BYTES) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` file, loaded with ``allow_pickle=False``.

    Before any array is read: the path must be a regular file, and every member's header
    must declare a shape whose bytes match the member's size, ``max_bytes`` in all at
    most (a forged header of shape ``(10**11,)`` is refused instead of allocated).
    """
    path = Path(path)
    _regular_file(path)
    try:
        with zipfile.ZipFile(path) as zf:
            total = 0
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    raise ValueError(f"{path}: member {info.filename!r} is not an .npy array")
                shape, dtype = _member_header(zf, info, path)
                total += math.prod(shape) * dtype.itemsize
                if total > max_bytes:
                    raise ValueError(f"{path}: arrays declare more than {max_bytes} bytes in all "
                                     f"(member {info.filename} has shape {shape} of {dtype})")
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npz file: {err}") from None
    except ValueError as err:  # e.g. an object array, refused without pickle
        msg = str(err)
        raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
