"""Reading and writing files safely: the routines every module that touches a file uses.

**Reading** (:func:`read_regular`, :func:`load_json`, :func:`parse_json`). A file opened
for reading must be a regular file: a FIFO would block the reader forever and a device
such as ``/dev/zero`` would be read until memory runs out, so both are refused before a
byte is read (the file is opened non-blocking and checked with ``fstat`` on the open
descriptor, so a swap between the check and the read changes nothing). With ``root``, a
symlink leading out of the folder the user named is refused too. Every read has a size
cap stated by its caller per kind of file, and JSON is parsed with a depth cap
(:data:`MAX_JSON_DEPTH`), a cap on its number of values (:data:`MAX_JSON_ITEMS`), no
``NaN``/``Infinity`` tokens and no duplicate keys (``{"kept": [1], "kept": [2]}`` would
otherwise silently mean the last one). Every refusal is a one-line ``ValueError`` naming
the file.

**Writing** (:func:`atomic_write`, :func:`check_write_target`).

A file refkv writes (a golden, a record table, a plot, a generated docs table, a tutorial
figure) is either as it was or complete, never torn: the bytes go to a temporary file in
the same folder, are flushed to disk, and the temporary file is renamed over the target
(``os.replace`` is atomic on POSIX and Windows within one file system). The result gets
the permissions a plain ``open(path, "w")`` would give (``0o666`` less the umask), not
the 0600 of a temporary file.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["MAX_JSON_DEPTH", "MAX_JSON_ITEMS", "atomic_write", "check_write_target", "file_kind", "file_mode",
           "load_json", "parse_json", "read_regular"]

#: Deepest nesting of a JSON document refkv reads (its own files nest fewer than 10 levels).
MAX_JSON_DEPTH = 64
#: Most values (objects, arrays and list items, counted by their separators) in one JSON
#: document: a cap on the memory parsing may take, whatever the file's size (a golden
#: vectors file holds about 10**5).
MAX_JSON_ITEMS = 2**22


def file_kind(mode: int) -> str:
    """A word for what a ``st_mode`` is (for messages)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _inside(path: Path, root: Path) -> bool:
    resolved, base = path.resolve(), Path(root).resolve()
    return resolved == base or base in resolved.parents


def read_regular(path, max_bytes: int, *, what: str = "file", root=None) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``max_bytes`` bytes.

    Parameters
    ----------
    path : path-like
    max_bytes : int
        The size cap of this kind of file, stated by the caller.
    what : str
        What the file is, for messages (``"config.json"``, ``"results file"``).
    root : path-like, optional
        The folder the user named: a symlink leading out of it is refused.

    Raises
    ------
    ValueError
        Naming the file: missing, unreadable, not a regular file (FIFO, device, folder,
        socket), a symlink out of ``root``, or larger than ``max_bytes``.
    """
    path = Path(path)
    if root is not None and path.is_symlink() and not _inside(path, root):
        raise ValueError(f"{path}: {what} is a symlink leading out of {root} (to {path.resolve()}); refusing to "
                         f"read it")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file ({what})") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read {what}: {err.strerror or err}") from None
    st = os.fstat(fd)  # before fdopen, which raises IsADirectoryError on a folder
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{path}: {what} must be a regular file, but it is {file_kind(st.st_mode)}")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > max_bytes:
            raise ValueError(f"{path}: {what} has {st.st_size} bytes, more than the {max_bytes} allowed")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while read
        raise ValueError(f"{path}: {what} has more than the {max_bytes} bytes allowed")
    return data


def _depth(obj, limit: int) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit), stopping past ``limit``."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def _pairs_no_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


class _DuplicateKey(Exception):
    pass


def _no_constant(name: str):
    raise _BadConstant(name)


class _BadConstant(Exception):
    pass


def parse_json(data: bytes | str, where: str, *, max_depth: int = MAX_JSON_DEPTH,
               max_items: int = MAX_JSON_ITEMS, allow_constants: bool = False):
    """Parse standard JSON safely; ValueError naming ``where`` for anything else.

    Refused: text that is not UTF-8 or not JSON, ``NaN``/``Infinity`` (unless
    ``allow_constants``: model configs written by Python may hold them, and their field
    checks then refuse the value naming the key), a key repeated in one object, more than
    ``max_items`` values (counted from the separators before parsing, so the cap holds
    before any memory is taken), nesting deeper than ``max_depth``.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    items = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if items > max_items:
        raise ValueError(f"{where}: JSON with about {items} values, more than the {max_items} allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 text: {err}") from None
    try:
        obj = json.loads(text, parse_constant=float if allow_constants else _no_constant,
                         object_pairs_hook=_pairs_no_duplicates)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested deeper than the {max_depth} levels allowed") from None
    except _DuplicateKey as err:
        raise ValueError(f"{where}: JSON object has the key {err.args[0]!r} twice") from None
    except _BadConstant as err:
        raise ValueError(f"{where}: non-standard JSON constant {err.args[0]}") from None
    if _depth(obj, max_depth) > max_depth:
        raise ValueError(f"{where}: JSON nested deeper than the {max_depth} levels allowed")
    return obj


def load_json(path, max_bytes: int, *, what: str = "JSON file", root=None, max_depth: int = MAX_JSON_DEPTH,
              max_items: int = MAX_JSON_ITEMS, allow_constants: bool = False):
    """:func:`read_regular` then :func:`parse_json`: a JSON file read within stated caps."""
    data = read_regular(path, max_bytes, what=what, root=root)
    return parse_json(data, str(path), max_depth=max_depth, max_items=max_items, allow_constants=allow_constants)


def check_write_target(path, root, *, what: str = "file") -> Path:
    """Refuse to write (or append to, or lock) ``path`` unless it stays inside folder ``root``.

    A symlink at ``path`` is refused outright: writing through it would change a file the
    user never named (``open(path, "w")`` truncates the target, ``"a"`` appends to it). A
    path that exists and is not a regular file (a FIFO would block the writer) is refused
    too. Returns ``path``.
    """
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"{path}: {what} is a symlink (to {os.readlink(path)}); refusing to write through it "
                         f"-- remove it or use another folder")
    if not _inside(path.parent, root):
        raise ValueError(f"{path}: {what} leads outside {root}; refusing to write it")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: {what} must be a regular file, but it is {file_kind(st.st_mode)}")
    return path


def file_mode() -> int:
    """Permissions an ordinary new file gets here: ``0o666`` less the process's umask."""
    mask = os.umask(0o022)  # reading the umask means setting it; restore it at once
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically; create its folder.

    Returns the path written. On any error the temporary file is removed and the target is
    left as it was.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
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
    return path
