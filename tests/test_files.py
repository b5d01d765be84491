"""refkv.files: the routines every reader and writer uses, tested on their own.

The attacks through the CLI and the loaders are in test_bad_input*.py and
test_reliability_*.py; here each routine's contract is pinned directly.
"""

import json
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv.files import (
    MAX_JSON_DEPTH,
    atomic_write,
    check_write_target,
    file_kind,
    file_mode,
    load_json,
    parse_json,
    read_regular,
)


def test_read_regular_reads_a_file_within_its_cap(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc")
    assert read_regular(path, 3) == b"abc"
    with pytest.raises(ValueError, match=r"a.bin: results file has 3 bytes, more than the 2 allowed$"):
        read_regular(path, 2, what="results file")


def test_read_regular_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"pipe: config.json must be a regular file, but it is a FIFO$"):
        read_regular(fifo, 100, what="config.json")


def test_read_regular_refuses_a_folder_a_missing_file_and_a_device(tmp_path):
    with pytest.raises(ValueError, match="must be a regular file, but it is a directory"):
        read_regular(tmp_path, 100)
    with pytest.raises(ValueError, match=r"nope: no such file \(file\)$"):
        read_regular(tmp_path / "nope", 100)
    with pytest.raises(ValueError, match="but it is a device"):
        read_regular("/dev/zero", 100)


def test_read_regular_refuses_a_symlink_out_of_the_named_folder(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "inside.txt").write_text("ok")
    (folder / "out").symlink_to(outside)
    (folder / "in").symlink_to(folder / "inside.txt")
    with pytest.raises(ValueError, match="is a symlink leading out of"):
        read_regular(folder / "out", 100, root=folder)
    assert read_regular(folder / "in", 100, root=folder) == b"ok"
    assert read_regular(folder / "out", 100) == b"secret"  # no folder named: no such rule


def test_parse_json_refuses_what_json_loads_would_take_silently():
    with pytest.raises(ValueError, match=r"^f: JSON object has the key 'kept' twice$"):
        parse_json('{"kept": [1], "kept": [2]}', "f")
    with pytest.raises(ValueError, match=r"^f: non-standard JSON constant NaN$"):
        parse_json('{"x": NaN}', "f")
    assert parse_json('{"x": NaN}', "f", allow_constants=True)["x"] != 0  # NaN is kept for a field check
    with pytest.raises(ValueError, match=r"^f: not UTF-8 text"):
        parse_json(b'"\xff"', "f")
    with pytest.raises(ValueError, match=r"^f: not valid JSON"):
        parse_json("{", "f")


@given(st.integers(1, 3 * MAX_JSON_DEPTH))
def test_parse_json_depth_cap_is_exact(depth):
    text = "[" * depth + "]" * depth
    if depth <= MAX_JSON_DEPTH:
        assert parse_json(text, "f") is not None
    else:
        with pytest.raises(ValueError, match=rf"^f: JSON nested deeper than the {MAX_JSON_DEPTH} levels allowed$"):
            parse_json(text, "f")


def test_parse_json_item_cap_holds_before_parsing():
    with pytest.raises(ValueError, match=r"^f: JSON with about 10 values, more than the 9 allowed$"):
        parse_json("[" + ",".join("1" * 10) + "]", "f", max_items=9)


def test_load_json_is_read_regular_then_parse_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"a": [1, 2]}))
    assert load_json(path, 100) == {"a": [1, 2]}
    with pytest.raises(ValueError, match="more than the 5 allowed"):
        load_json(path, 5)


def test_atomic_write_writes_whole_files_with_ordinary_permissions(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    assert atomic_write(target, "héllo") == target
    assert target.read_bytes() == "héllo".encode()
    assert stat.S_IMODE(target.stat().st_mode) == file_mode()
    atomic_write(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]  # no temporary file left


def test_atomic_write_leaves_the_target_as_it_was_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "out.txt"
    target.write_text("before")

    def broken_replace(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write(target, "after")
    assert target.read_text() == "before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_check_write_target_stays_inside_the_named_folder(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    assert check_write_target(folder / "x.csv", folder) == folder / "x.csv"
    with pytest.raises(ValueError, match="leads outside"):
        check_write_target(folder / ".." / "x.csv", folder)
    (folder / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="is a symlink"):
        check_write_target(folder / "link", folder)
    os.mkfifo(folder / "fifo")
    with pytest.raises(ValueError, match="must be a regular file, but it is a FIFO"):
        check_write_target(folder / "fifo", folder)


def test_file_kind_names_each_kind():
    assert file_kind(stat.S_IFREG) == "a regular file"
    assert file_kind(stat.S_IFDIR) == "a directory"
    assert file_kind(stat.S_IFIFO) == "a FIFO"
    assert file_kind(stat.S_IFCHR) == file_kind(stat.S_IFBLK) == "a device"
    assert file_kind(stat.S_IFSOCK) == "a socket"
