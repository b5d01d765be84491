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

**Writing** (:class:`OutputFolder`; :func:`atomic_write` and :func:`check_write_target`
for a file the user named by itself).

Every writer in refkv writes through one :class:`OutputFolder`, the folder the user named
(``--out``, ``--publish``, a docs script's output folder). It resolves every path under
that root and walks to it one component at a time with ``O_NOFOLLOW`` on open folder
descriptors, so a symlinked component *below* the root (``OUT/e2e/keydiff -> elsewhere``),
a ``..`` or an absolute path is refused before a byte is written, and a link swapped in
between a check and the write is not followed either. It never replaces a file the user
named as input (``refkv show --prompt-file p.txt --out p.txt``), and a writer that would
replace a file made with other settings compares them first and refuses
(:meth:`OutputFolder.refuse_other_settings`). Every refusal is a one-line ``ValueError``
naming the path.

A file refkv writes (a golden, a record table, a plot, a generated docs table, a tutorial
figure) is either as it was or complete, never torn: the bytes go to a temporary file in
the same folder, are flushed to disk, and the temporary file is renamed over the target
(``os.replace`` is atomic on POSIX and Windows within one file system). The result gets
the permissions a plain ``open(path, "w")`` would give (``0o666`` less the umask), not
the 0600 of a temporary file.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import secrets
import shutil
import stat
from pathlib import Path, PurePath

__all__ = ["MAX_JSON_DEPTH", "MAX_JSON_ITEMS", "OutputFolder", "Target", "atomic_write", "check_write_target",
           "file_kind", "file_mode", "load_json", "parse_json", "read_regular", "target_of"]

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

    ``path`` is a plain path (a file the user named by itself: its folder is the root, and
    a symlink at ``path`` is refused) or a :class:`Target` of an :class:`OutputFolder`
    (``folder / "table.csv"``: guarded below that folder's root). Returns the path
    written. On any error the temporary file is removed and the target is left as it was.
    """
    folder, relative = target_of(path)
    return folder.write_bytes(relative, data)


def target_of(path) -> tuple[OutputFolder, str]:
    """The folder and relative path a writer writes ``path`` through.

    A :class:`Target` keeps its folder; a plain path is written through an
    :class:`OutputFolder` rooted at its own parent folder.
    """
    if isinstance(path, Target):
        return path.folder, path.relative
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise ValueError(f"{path}: not a file name to write")
    return OutputFolder(path.parent), path.name


class Target(os.PathLike):
    """A path below an :class:`OutputFolder` (``folder / "name.csv"``), written through it.

    It is an ``os.PathLike`` (``Path(target)`` is the file's path, for reading) that
    :func:`atomic_write` and the writers built on it (the experiments' tables and plots,
    golden files) write through its folder's guards.
    """

    __slots__ = ("folder", "relative")

    def __init__(self, folder: OutputFolder, relative: str):
        self.folder, self.relative = folder, relative

    def __fspath__(self) -> str:
        return str(self.folder.root / self.relative)

    def __truediv__(self, other) -> Target:
        return Target(self.folder, posixpath.join(self.relative, os.fspath(other)))

    def __repr__(self) -> str:
        return f"Target({self.folder.root!s}, {self.relative!r})"

    @property
    def name(self) -> str:
        return posixpath.basename(self.relative)

    def with_suffix(self, suffix: str) -> Target:
        stem, _ = posixpath.splitext(self.relative)
        return Target(self.folder, stem + suffix)


_MISSING = object()


class OutputFolder:
    """The one folder a writer may write in: guarded, atomic, never over the user's inputs.

    Parameters
    ----------
    root : path-like
        The folder the user named. It may itself be a symlink (the user named it); it is
        created, with its parents, on the first write (not before: a writer that refuses
        its inputs leaves no empty folder behind).
    inputs : iterable of path-like, optional
        Files (or folders) the user named as inputs. None of them is ever written,
        replaced or removed, and nothing is written inside an input folder.
    what : str
        What the folder is, for messages (``"--out"``, ``"--publish folder"``).

    Notes
    -----
    Paths are given relative to the root, with ``/`` between components
    (``"e2e/keydiff/x.json"``). Refused, each with a one-line ``ValueError`` naming the
    path: an absolute path, ``..``, an empty name; a component below the root that is a
    symlink or not a folder; a target that is a symlink, not a regular file, or one of
    ``inputs``. The walk opens each folder with ``O_NOFOLLOW`` relative to its parent's
    descriptor and creates the temporary file there with ``O_EXCL | O_NOFOLLOW``, so the
    guard holds even if a link is planted while the writer runs.
    """

    def __init__(self, root, *, inputs=(), what: str = "output folder"):
        self.root = Path(root)
        self.what = what
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"{self.root}: the {what} exists and is not a folder")
        self._inputs: dict[tuple[int, int], Path] = {}
        self._input_folders: list[Path] = []
        for item in inputs:
            if item is None:
                continue
            self.add_input(item)
        self._top, self._prefix = self.root, ()

    # -- construction --------------------------------------------------------------------------
    def add_input(self, path) -> None:
        """Name one more input (a file or folder) this folder must never write."""
        path = Path(path)
        try:
            st = os.stat(path)
        except OSError:
            return  # a missing input is its reader's error; nothing of it can be overwritten
        if stat.S_ISDIR(st.st_mode):
            self._input_folders.append(path.resolve())
        else:
            self._inputs[(st.st_dev, st.st_ino)] = path

    def sub(self, relative) -> OutputFolder:
        """The folder ``relative`` below this one, guarded from this folder's root."""
        parts = self._split(relative)
        child = object.__new__(OutputFolder)
        child.root, child.what = self.root.joinpath(*parts), self.what
        child._inputs, child._input_folders = self._inputs, self._input_folders
        child._top, child._prefix = self._top, self._prefix + parts
        return child

    def __truediv__(self, relative) -> Target:
        return Target(self, "/".join(self._split(relative)))

    def __fspath__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"OutputFolder({str(self.root)!r})"

    # -- paths -----------------------------------------------------------------------------------
    def _split(self, relative) -> tuple[str, ...]:
        text = os.fspath(relative) if isinstance(relative, (str, PurePath, os.PathLike)) else None
        if not isinstance(text, str):
            raise ValueError(f"{self.root}: a path to write must be a relative path, got {relative!r}")
        if "\x00" in text or os.path.isabs(text):
            raise ValueError(f"{self.root / text}: a path to write must be relative to the {self.what} "
                             f"{self.root}; refusing to write it")
        parts = tuple(p for p in text.split("/") if p not in ("", "."))
        if ".." in parts:
            raise ValueError(f"{self.root / text}: a path to write may not contain '..' (it would lead out of the "
                             f"{self.what} {self.root}); refusing to write it")
        return parts

    def _display(self, parts) -> Path:
        return self._top.joinpath(*parts)

    def path(self, relative="") -> Path:
        """``root / relative``, after checking that no existing component below the root is a symlink."""
        parts = self._split(relative)
        whole = self._prefix + parts
        for depth in range(1, len(whole) + 1):
            here = self._display(whole[:depth])
            try:
                st = os.lstat(here)
            except FileNotFoundError:
                break
            self._refuse_link(here, st, last=depth == len(whole))
        return self._display(whole)

    def _refuse_link(self, here: Path, st, *, last: bool) -> None:
        if stat.S_ISLNK(st.st_mode):
            raise ValueError(f"{here}: is a symlink (to {os.readlink(here)}) below the {self.what} {self._top}; "
                             f"refusing to write through it -- remove it or use another folder")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{here}: must be a folder to write below it, but it is {file_kind(st.st_mode)}")

    def _open_dir(self, parts: tuple[str, ...], *, create: bool) -> int:
        """A descriptor of folder ``top/parts``, walked without following any link below the top."""
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
        nofollow = getattr(os, "O_NOFOLLOW", 0)
        if create:
            self._top.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self._top, flags)
        except FileNotFoundError:
            raise ValueError(f"{self._top}: no such folder ({self.what})") from None
        except NotADirectoryError:
            raise ValueError(f"{self._top}: the {self.what} exists and is not a folder") from None
        try:
            for depth, name in enumerate(parts, 1):
                try:
                    child = os.open(name, flags | nofollow, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise ValueError(f"{self._display(parts[:depth])}: no such folder") from None
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass
                    child = os.open(name, flags | nofollow, dir_fd=fd)
                except OSError as err:
                    if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    here = self._display(parts[:depth])
                    self._refuse_link(here, os.lstat(name, dir_fd=fd), last=False)
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_target(self, dfd: int, name: str, parts: tuple[str, ...]) -> None:
        """Refuse to replace ``name`` in folder ``dfd``: a symlink, a non-file, an input."""
        here = self._display(parts)
        if self._input_folders:
            folder = Path(os.path.realpath(self._display(parts[:-1])))
            for inside in self._input_folders:
                if folder == inside or inside in folder.parents:
                    raise ValueError(f"{here}: lies in {inside}, a folder named as input; an input is never an "
                                     f"output -- choose another output")
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        self._refuse_link(here, st, last=True)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{here}: must be a regular file to be replaced, but it is {file_kind(st.st_mode)}")
        named = self._inputs.get((st.st_dev, st.st_ino))
        if named is not None:
            also = "" if os.path.abspath(named) == os.path.abspath(here) else f" (as {named})"
            raise ValueError(f"{here}: is a file named as input{also}; an input is never an output -- choose "
                             f"another output file")

    def check_replaceable(self, relative) -> Path:
        """Refuse now what :meth:`write_bytes` would refuse for ``relative``; return its path.

        For writers that fail before working: every target is checked (symlinked
        components, a symlink or non-file at the target, an input) before any model runs.
        Nothing is created.
        """
        parts = self._prefix + self._split(relative)
        self.path(relative)
        try:
            dfd = self._open_dir(parts[:-1], create=False)
        except ValueError:
            return self._display(parts)  # its folder does not exist yet: nothing there to replace
        try:
            self._check_target(dfd, parts[-1], parts)
        finally:
            os.close(dfd)
        return self._display(parts)

    # -- writing -------------------------------------------------------------------------------------
    def mkdir(self, relative="") -> Path:
        """Create folder ``relative`` (and the root) without following links; return its path."""
        parts = self._prefix + self._split(relative)
        os.close(self._open_dir(parts, create=True))
        return self._display(parts)

    def write_bytes(self, relative, data: bytes | str) -> Path:
        """Write ``data`` (text as UTF-8) to ``relative`` atomically; return its path.

        The bytes go to a temporary file in the same folder (created with
        ``O_EXCL | O_NOFOLLOW``), are flushed to disk, and the file is renamed over the
        target (:func:`os.replace`). It gets the permissions of a plain ``open(path, "w")``.
        """
        parts = self._prefix + self._split(relative)
        if not parts or parts == self._prefix:
            raise ValueError(f"{self.root}: a file to write needs a name below the {self.what}")
        if isinstance(data, str):
            data = data.encode("utf-8")
        dfd = self._open_dir(parts[:-1], create=True)
        try:
            name = parts[-1]
            self._check_target(dfd, name, parts)
            tmp = f".{name}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666,
                         dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                raise
        finally:
            os.close(dfd)
        return self._display(parts)

    def write_text(self, relative, text: str) -> Path:
        """:meth:`write_bytes` of ``text`` as UTF-8."""
        return self.write_bytes(relative, text.encode("utf-8"))

    def write_json(self, relative, obj, *, indent: int = 1) -> Path:
        """Write ``obj`` as standard JSON (sorted keys, no NaN) atomically."""
        return self.write_bytes(relative, json.dumps(obj, indent=indent, sort_keys=True, allow_nan=False) + "\n")

    def replace(self, source, destination) -> Path:
        """Move file ``source`` over ``destination`` (both relative, both guarded) atomically."""
        src, dst = self._prefix + self._split(source), self._prefix + self._split(destination)
        sfd = self._open_dir(src[:-1], create=False)
        try:
            dfd = self._open_dir(dst[:-1], create=True)
            try:
                self._check_target(dfd, dst[-1], dst)
                os.replace(src[-1], dst[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)
        return self._display(dst)

    def remove(self, relative) -> bool:
        """Delete file (or folder tree) ``relative`` if it exists, never following a link; whether it did.

        A symlink there is removed itself, not what it points to.
        """
        parts = self._prefix + self._split(relative)
        try:
            dfd = self._open_dir(parts[:-1], create=False)
        except ValueError:
            return False  # its folder is missing: nothing to remove
        try:
            self._check_target_folder(parts)
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=dfd)
            else:
                named = self._inputs.get((st.st_dev, st.st_ino))
                if named is not None:
                    raise ValueError(f"{self._display(parts)}: is {named}, a file named as input; refusing to "
                                     f"remove it")
                os.unlink(parts[-1], dir_fd=dfd)
            return True
        finally:
            os.close(dfd)

    def _check_target_folder(self, parts) -> None:
        folder = Path(os.path.realpath(self._display(parts)))
        for inside in self._input_folders:
            if folder == inside or inside in folder.parents:
                raise ValueError(f"{self._display(parts)}: lies in {inside}, a folder named as input; refusing "
                                 f"to remove it")

    def differing(self, files: dict) -> list[str]:
        """The names of ``files`` (relative path -> bytes or text) whose file here differs or is missing.

        Reads only (a check mode's answer): nothing is created or written.
        """
        stale = []
        for relative, data in files.items():
            data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
            path = self.path(relative)
            try:
                same = path.is_file() and read_regular(path, len(data), what="published file") == data
            except ValueError:
                same = False
            if not same:
                stale.append(relative)
        return stale

    def publish(self, files: dict, *, check: bool = False) -> list[str]:
        """Write the ``files`` that differ (each atomically), or with ``check`` only name them.

        Returns the relative paths that differ (were rewritten, or would be). With ``check``
        nothing is written and no folder is created.
        """
        stale = self.differing(files)
        if not check:
            for relative in stale:
                self.write_bytes(relative, files[relative])
        return stale

    def refuse_other_settings(self, relative, mine: dict, theirs: dict | None, *, what: str = "file") -> None:
        """Refuse to replace ``relative`` when the file there was made with other settings.

        ``theirs`` is what the existing file records (read by the caller from its
        manifest; None when there is no file). The first setting that differs is named in
        a one-line ValueError: replacing the file would silently lose a result the user
        made with other settings.
        """
        if theirs is None:
            return
        for key in sorted(set(mine) | set(theirs)):
            before, now = theirs.get(key, _MISSING), mine.get(key, _MISSING)
            if before != now:
                shown = ["(none)" if v is _MISSING else _short(v) for v in (before, now)]
                raise ValueError(f"{self._display(self._prefix + self._split(relative))}: holds a {what} made with "
                                 f"other settings ({key}: {shown[0]} there, {shown[1]} now); refusing to replace "
                                 f"it -- use another folder or remove it")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
