"""Issue 26, writers and the suite: data loss, merges, tampered manifests (``test_attack_26_<NN>_*``).

Each test failed on the code issue 26 was filed against. The table of
``docs/guide/reliability.rst`` lists these groups; ``test_reliability_26_table`` in
``tests/test_reliability_inputs.py`` keeps it and the tests in step.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest

from refkv.cli import main
from refkv.experiments import records, registry, runner
from refkv.experiments.design import Experiment
from refkv.experiments.settings import Settings
from refkv.oracle import generate as generate_module
from refkv.oracle.generate import generate_suite
from refkv.oracle.io import read_json, write_json
from refkv.oracle.staging import STAGING, recover
from refkv.oracle.suiteindex import read_suite

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def _toy(name="toy26"):
    """A two-cell experiment that costs nothing (the writer is under attack, not the model)."""
    return registry.register_experiment(Experiment(name=name, title="toy", cells=_toy_cells, run=_toy_cell,
                                                 summarise=lambda records, folder, settings: []))


def _toy_cells(settings):
    return [{"i": 0}, {"i": 1}]


def _toy_cell(params):
    return {"value": params["i"]}


@pytest.fixture(scope="module")
def small_suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite26") / "golden"
    generate_suite(root, ["sink", "knorm"])
    return root


def _snapshot(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- 1: a symlinked lock file never truncates its target -------------------------------------------
def test_attack_26_01_symlinked_lock_file_is_refused_not_truncated(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    (out / ".toy26.jsonl.lock").symlink_to(victim)
    with pytest.raises(ValueError, match="lock file is a symlink"):
        runner.run(_toy(), Settings(quick=True), out=out, stream=open(os.devnull, "w"))
    assert victim.read_text() == "precious\n"


def test_attack_26_01_symlinked_lock_file_from_the_command(capsys, tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    (out / ".perplexity.jsonl.lock").symlink_to(victim)
    code, text = _run(capsys, "experiment", "perplexity", "--quick", "--model", "tiny", "--out", out)
    assert code == 2 and "symlink" in text and "Traceback" not in text, text
    assert victim.read_text() == "precious\n"


# -- 2: a symlinked records file is never cut or appended to ---------------------------------------
def test_attack_26_02_symlinked_records_file_is_refused(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.jsonl"
    out.mkdir()
    victim.write_text('{"a": 1}\nlast line without newline')
    before = victim.read_bytes()
    (out / "toy26.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match="results file is a symlink"):
        runner.run(_toy(), Settings(quick=True), out=out, stream=open(os.devnull, "w"))
    assert victim.read_bytes() == before


def test_attack_26_02_records_are_appended_without_following_a_symlink(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.jsonl"
    out.mkdir()
    victim.write_text("")
    (out / "toy26.jsonl").symlink_to(victim)
    with pytest.raises(OSError):  # O_NOFOLLOW: a symlink planted between the check and the write
        records.append_record(out / "toy26.jsonl", {"key": "k"})
    assert victim.read_text() == ""


def test_attack_26_02_a_symlinked_summary_folder_is_refused_before_any_cell(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "toy26").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="summary folder is a symlink"):
        runner.run(_toy(), Settings(quick=True), out=out, stream=open(os.devnull, "w"))
    assert list(elsewhere.iterdir()) == [] and not (out / "toy26.jsonl").exists()


# -- 3: a check never writes ----------------------------------------------------------------------------
def test_attack_26_03_check_refuses_a_pending_generation_and_deletes_nothing(capsys, tmp_path, small_suite):
    suite = tmp_path / "suite"
    shutil.copytree(small_suite, suite)
    (suite / STAGING).mkdir()
    (suite / STAGING / "COMMITTED.json").write_text(json.dumps({"files": [], "remove": ["vectors/sink.json"]}))
    before = _snapshot(suite)
    code, text = _run(capsys, "golden", "check", small_suite, "--against", suite)
    assert code == 2 and "a check never writes" in text and "Traceback" not in text, text
    assert _snapshot(suite) == before
    with pytest.raises(ValueError, match="a check never writes"):
        read_suite(suite)
    assert _snapshot(suite) == before


# -- 8: a merge verifies every file it keeps, and refuses a bad kind ----------------------------------
@pytest.mark.parametrize("damage", ["delete-npz", "corrupt-npz", "bogus-kind"])
def test_attack_26_08_merge_verifies_every_kept_file(capsys, tmp_path, small_suite, damage, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    index = read_json(out / "suite.json")
    entry = next(e for e in index["files"] if e["kind"] == "e2e" and e["policy"] == "knorm")
    npz = out / (entry["path"][:-5] + ".npz")
    if damage == "delete-npz":
        npz.unlink()
    elif damage == "corrupt-npz":
        npz.write_bytes(npz.read_bytes()[:-3] + b"xyz")
    else:
        entry["kind"] = "bogus"
        write_json(out / "suite.json", index)
    generated = []
    monkeypatch.setattr(generate_module, "policy_vectors", lambda name, **kw: generated.append(name) or (None, []))
    before = _snapshot(out)
    code, text = _run(capsys, "golden", "generate", "--out", out, "--policies", "sink", "--quiet")
    assert code == 2 and "Traceback" not in text, text
    assert ("kind must be" in text) if damage == "bogus-kind" else ("missing or checksum mismatch" in text), text
    assert generated == []  # refused before generating
    assert _snapshot(out) == before


# -- 20: a tampered suite.json is refused before the generation runs ----------------------------------
@pytest.mark.parametrize("tamper, message", [
    (lambda i: i.__setitem__("policies", "knorm"), "policies must be a list"),
    (lambda i: i.__setitem__("policies", 7), "policies must be a list"),
    (lambda i: i["files"][0].__setitem__("policy", ["knorm"]), "is not one of the suite's policies"),
    (lambda i: i.__setitem__("policies", ["sink"]), "policy 'knorm' is not one of the suite's policies"),
    (lambda i: i.__setitem__("skipped", 5), "skipped must be a list"),
])
def test_attack_26_20_tampered_suite_json_is_refused_before_generating(capsys, tmp_path, small_suite, tamper,
                                                                       message, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    index = read_json(out / "suite.json")
    tamper(index)
    write_json(out / "suite.json", index)
    generated = []
    monkeypatch.setattr(generate_module, "policy_vectors", lambda name, **kw: generated.append(name) or (None, []))
    code, text = _run(capsys, "golden", "generate", "--out", out, "--policies", "sink", "--quiet")
    assert code == 2 and message in text and "Traceback" not in text, text
    assert generated == []


# -- 25: a symlinked e2e/<policy> folder leaves no journal behind -----------------------------------------
def test_attack_26_25_symlinked_policy_folder_refused_before_any_journal(capsys, tmp_path, small_suite,
                                                                           monkeypatch):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    shutil.copytree(small_suite, out)
    elsewhere.mkdir()
    (out / "e2e" / "h2o").symlink_to(elsewhere, target_is_directory=True)
    generated = []
    monkeypatch.setattr(generate_module, "policy_vectors", lambda name, **kw: generated.append(name) or (None, []))
    code, text = _run(capsys, "golden", "generate", "--out", out, "--policies", "h2o", "--quiet")
    assert code == 2 and "leads outside the suite folder" in text, text
    assert not (out / STAGING).exists() and list(elsewhere.iterdir()) == [] and generated == []


def test_attack_26_25_an_unsafe_commit_record_is_discarded_not_kept(tmp_path, small_suite):
    out = tmp_path / "out"
    shutil.copytree(small_suite, out)
    (out / STAGING).mkdir()
    (out / STAGING / "COMMITTED.json").write_text(json.dumps({"files": ["../x.json"], "remove": []}))
    with pytest.raises(ValueError, match="was discarded"):
        recover(out)
    assert not (out / STAGING).exists()
    assert read_suite(out)["policies"] == read_json(small_suite / "suite.json")["policies"]
