"""Bad input and faults against ``refkv golden generate`` (issue 13, items 1, 2 and 12).

Each test attacks the generator the way the issue found it broken: a planted ``suite.json``
that points outside the folder, a subset generation into an existing suite, a ``kill -9``
at every point of the publication, repeated or empty policy lists, and the umask.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from refkv.cli import main
from refkv.oracle import generate as generate_module
from refkv.oracle.generate import generate_suite
from refkv.oracle.io import read_json, write_json
from refkv.oracle.staging import STAGING, recover
from refkv.oracle.suiteindex import read_suite

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture(scope="module")
def small_suite(tmp_path_factory):
    """A suite of sink and knorm (generated once; tests copy it)."""
    root = tmp_path_factory.mktemp("suite") / "golden"
    generate_suite(root, ["sink", "knorm"])
    return root


def _snapshot(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- item 1: nothing outside the output folder is ever touched -------------------------------------
@pytest.mark.parametrize("planted", ["../victim.json", "ABSOLUTE", "vectors/../../victim.json",
                                     "e2e/sink/../../../victim.json", "vectors//sink.json", "./vectors/x.json",
                                     "notes.txt"])
def test_attack_13_01_a_planted_suite_json_cannot_touch_files_outside_the_folder(capsys, tmp_path, small_suite,
                                                                              planted):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    path = str(victim) if planted == "ABSOLUTE" else planted
    index = read_json(out / "suite.json")
    index["files"].append({"path": path, "kind": "vectors", "policy": "tova", "sha256": "0" * 64})
    write_json(out / "suite.json", index)
    before = _snapshot(out)
    code, text = _run(capsys, "golden", "generate", "--out", str(out), "--policies", "tova", "--quiet")
    assert code == 2 and "is not a suite file" in text and "refusing to touch it" in text, text
    assert "Traceback" not in text
    assert victim.read_text() == "precious"
    assert _snapshot(out) == before and not (out / STAGING).exists()  # refused before anything was written


def test_attack_13_01_a_symlinked_folder_leading_out_is_refused(tmp_path, small_suite):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "N8-B4-float64.json").write_text("precious")
    shutil.rmtree(out / "e2e" / "sink")
    (out / "e2e" / "sink").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="leads outside the suite folder"):
        generate_suite(out, ["sink"])
    assert (outside / "N8-B4-float64.json").read_text() == "precious"


# -- item 2: a subset merges; an interrupted generation leaves the old or the new suite ----------------
def test_attack_13_02_generating_a_subset_keeps_the_other_policies(tmp_path, small_suite):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    knorm = {k: v for k, v in _snapshot(out).items() if "knorm" in k}
    generate_suite(out, ["tova"])
    index = read_suite(out)  # every checksum holds
    assert index["policies"] == ["knorm", "sink", "tova"]
    assert {k: v for k, v in _snapshot(out).items() if "knorm" in k} == knorm
    assert {e["policy"] for e in index["files"]} == {"knorm", "sink", "tova"}


def test_attack_13_02_a_corrupted_kept_policy_is_refused_before_anything_is_written(tmp_path, small_suite):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    (out / "vectors" / "knorm.json").write_text("{}")
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"knorm.json: missing or checksum mismatch .* regenerate policy 'knorm'"):
        generate_suite(out, ["sink"])
    assert _snapshot(out) == before


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (no ``except Exception`` catches it)."""


def _dying(real_replace, k: int):
    """``os.replace`` that "kills" the process at its ``k``-th call."""
    count = [0]

    def replace(a, b, **dir_fds):
        count[0] += 1
        if count[0] == k:
            raise _Killed
        real_replace(a, b, **dir_fds)
    return replace


def _memoised(monkeypatch, changed: bool):
    """Cache the generator's work (so each simulated kill costs milliseconds) and, for the new
    generation, make its files differ from the old ones and drop one end-to-end golden (a stale
    file to delete)."""
    vectors, e2e = generate_module.policy_vectors, generate_module.policy_end_to_end
    cache: dict = {}

    def policy_vectors(name, **kw):
        if ("v", name) not in cache:
            cache[("v", name)] = vectors(name, **kw)
        doc, skips = cache[("v", name)]
        if changed:
            doc = {**doc, "description": [*doc["description"], "regenerated"]}
        return doc, skips

    def policy_end_to_end(name, model="tiny"):
        if ("e", name) not in cache:
            cache[("e", name)] = e2e(name, model)
        runs, skips = cache[("e", name)]
        if changed:
            runs = [(label, {**m, "note": "regenerated"}, a) for label, m, a in runs[1:]]
        return runs, skips

    monkeypatch.setattr(generate_module, "policy_vectors", policy_vectors)
    monkeypatch.setattr(generate_module, "policy_end_to_end", policy_end_to_end)


@pytest.mark.slow
def test_attack_13_02_a_kill_at_any_point_leaves_the_old_or_the_new_suite(monkeypatch, tmp_path, small_suite):
    _memoised(monkeypatch, changed=True)
    new_dir = tmp_path / "new"
    shutil.copytree(small_suite, new_dir)
    real_replace = os.replace
    calls = []
    monkeypatch.setattr(os, "replace", lambda a, b, **fds: (calls.append(1), real_replace(a, b, **fds))[1])
    generate_suite(new_dir, ["sink"])
    total = len(calls)
    old_index, new_index = read_json(small_suite / "suite.json"), read_json(new_dir / "suite.json")
    assert old_index["files"] != new_index["files"] and total > 10

    outcomes = set()
    for k in range(1, total + 1):
        out = tmp_path / f"k{k}"
        shutil.copytree(small_suite, out)
        monkeypatch.setattr(os, "replace", _dying(real_replace, k))
        with pytest.raises(_Killed):
            generate_suite(out, ["sink"])
        monkeypatch.setattr(os, "replace", real_replace)
        recover(out)  # the writer finishes a committed publication (a reader refuses it)
        index = read_suite(out)  # every checksum must hold
        assert index["files"] in (old_index["files"], new_index["files"]), k
        outcomes.add("new" if index["files"] == new_index["files"] else "old")
        listed = {e["path"] for e in index["files"]} | {e["path"][:-5] + ".npz" for e in index["files"]
                                                        if e["kind"] == "e2e"}
        on_disk = {p for p in _snapshot(out) if not p.startswith(STAGING)} - {"suite.json"}
        assert on_disk == listed, k  # no stale or half-published file
        if (out / STAGING).exists():  # killed before the commit point: the next run clears it
            assert not (out / STAGING / "COMMITTED.json").exists()
            generate_suite(out, ["sink"])
            assert not (out / STAGING).exists() and read_json(out / "suite.json")["files"] == new_index["files"]
        shutil.rmtree(out)
    assert outcomes == {"old", "new"}  # kills before and after the commit point were both tried


def test_attack_13_02_kill_9_while_publishing_is_refused_by_readers_and_finished_by_the_writer(tmp_path, small_suite):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    before = read_json(out / "suite.json")
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from refkv.oracle import generate, goldens
real, calls = os.replace, [0]
def replace(a, b, **dir_fds):
    calls[0] += 1
    # moving published files into place (a staged file, not a temporary file being written)
    if str(b).endswith('.npz') and not str(a).endswith('.tmp'):
        os.kill(os.getpid(), signal.SIGKILL)
    real(a, b, **dir_fds)
os.replace = replace
goldens.MODEL_SEED = 1  # new content: other end-to-end weights
generate.generate_suite({str(out)!r}, ["sink"])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (out / STAGING / "COMMITTED.json").exists()  # killed after the commit point, mid-publication
    with pytest.raises(ValueError, match="a check never writes"):
        read_suite(out)  # a reader refuses an unfinished publication, touching nothing
    assert (out / STAGING / "COMMITTED.json").exists()
    recover(out)  # the writer rolls the publication forward
    index = read_suite(out)
    assert not (out / STAGING).exists()
    assert index["files"] != before["files"]
    assert all(e["policy"] != "sink" or e["kind"] != "e2e" or json.loads((out / e["path"]).read_text())
               ["model"]["seed"] == 1 for e in index["files"])


# -- item 12: policy lists and file permissions -------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--policies", "sink", "sink"], "policies lists 'sink' more than once"),
    (["--policies", "sink,knorm,sink"], "policies lists 'sink' more than once"),
    (["--policies", ""], "policies must name at least one policy"),
    (["--policies", ","], "policies must name at least one policy"),
])
def test_attack_13_12_repeated_or_empty_policy_lists_are_refused(capsys, tmp_path, argv, message):
    code, text = _run(capsys, "golden", "generate", "--out", str(tmp_path / "out"), *argv, "--quiet")
    assert code == 2 and message in text and "Traceback" not in text
    assert not (tmp_path / "out" / "suite.json").exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_attack_13_12_golden_files_honour_the_umask(monkeypatch, tmp_path, umask, mode):
    _memoised(monkeypatch, changed=False)
    old = os.umask(umask)
    try:
        generate_suite(tmp_path, ["sink"])
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and {oct(p.stat().st_mode & 0o777) for p in files} == {oct(mode)}


def test_an_existing_file_as_out_is_a_clear_error(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    code, text = _run(capsys, "golden", "generate", "--out", str(target), "--policies", "sink", "--quiet")
    assert code == 2 and "exists and is not a folder" in text and target.read_text() == "x"
