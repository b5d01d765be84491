"""Writing files atomically: the one routine every module that writes a file uses.

A file refkv writes (a golden, a record table, a plot, a generated docs table, a tutorial
figure) is either as it was or complete, never torn: the bytes go to a temporary file in
the same folder, are flushed to disk, and the temporary file is renamed over the target
(``os.replace`` is atomic on POSIX and Windows within one file system). The result gets
the permissions a plain ``open(path, "w")`` would give (``0o666`` less the umask), not
the 0600 of a temporary file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "file_mode"]


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
