"""Issue 36, the reading half: lengths against the model, models, records and manifests, text
leaving refkv, unclear messages (``test_read_36_<NN>_*``, one per row of the issue-36 reading
table of ``docs/guide/reliability.rst``). Each failed on the code issue 36 was filed against."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from refkv.cli import main
from refkv.formatting import html_text, terminal_text
from refkv.validation import check_lengths

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
SCHEDULE = GOLDEN / "e2e" / "keydiff" / "sched-oneshot-K4-N16-float64"


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def _clear(code: int, text: str, *needles: str) -> None:
    """Exit 2 with one ``error:`` line holding every needle, no traceback."""
    assert code == 2 and "Traceback" not in text, text
    lines = [line for line in text.splitlines() if "error:" in line]
    assert len(lines) == 1, text
    for needle in needles:
        assert needle in lines[0], (needle, text)


# -- 1: lengths against the model's context and the hard cap, before anything is loaded ----------------
@pytest.mark.parametrize("argv, needles", [
    (["golden", "generate", "--model", "tiny", "--prompt-length", 4090, "--new-tokens", 64, "--budget", 8,
      "--policies", "keydiff"], ["--prompt-length 4090 + --new-tokens 64 = 4154", "4096"]),
    (["golden", "generate", "--new-tokens", 10**9, "--policies", "keydiff"], ["--new-tokens", "131072"]),
    (["golden", "generate", "--prompt-length", 10**9, "--policies", "keydiff"], ["--prompt-length", "131072"]),
    (["golden", "generate", "--interval", 10**18, "--policies", "keydiff"], ["--interval", "131072"]),
    (["golden", "generate", "--model", "qwen2", "--prompt-length", 250, "--new-tokens", 10], ["256"]),
    (["show", "--model", "tiny", "--passkey", 5000], ["--passkey 5000", "4096"]),
    (["show", "--model", "tiny", "--example", "--max-new-tokens", 10**8], ["--max-new-tokens", "131072"]),
    (["run", "--prompt-len", 4090, "--new-tokens", 20], ["--prompt-len 4090 + --new-tokens 20", "4096"]),
    (["generate", "--model", "tiny", "--max-new-tokens", 10**8, "hi"], ["--max-new-tokens", "131072"]),
])
def test_read_36_01_lengths_against_the_model(tmp_path, capsys, argv, needles):
    code, text = _cli(capsys, *argv, *(["--out", tmp_path / "o"] if argv[0] in ("golden", "show") else []))
    _clear(code, text, *needles)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").rglob("*.json"))


def test_read_36_01_check_lengths_correct_result():
    assert check_lengths({"a": (4000, 1), "b": (96, 0)}, 4096, within=("a", "b")) == {"a": 4000, "b": 96}
    assert check_lengths({"a": (None, 1)}, 10) == {}
    with pytest.raises(ValueError, match=r"a 4000 \+ b 97 = 4097 tokens"):
        check_lengths({"a": (4000, 1), "b": (97, 0)}, 4096, within=("a", "b"))


# -- 2: models ----------------------------------------------------------------------------------------
def test_read_36_02_unknown_model_type_and_fifo(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bogus", "architectures": ["LlamaForCausalLM"]}))
    code, text = _cli(capsys, "golden", "generate", "--out", tmp_path / "o", "--model", folder, "--prompt-length", 24)
    _clear(code, text, "model_type 'bogus'", "config.json")
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    code, text = _cli(capsys, "golden", "generate", "--out", tmp_path / "o", "--model", fifo, "--prompt-length", 24)
    _clear(code, text, "is a FIFO")


def test_read_36_02_edited_model_builder():
    pytest.importorskip("kvpress")
    from refkv.interop.kvpress.models import model_of

    manifest = json.loads(SCHEDULE.with_suffix(".json").read_text())
    assert model_of(manifest).config.n_layers == manifest["model"]["config"]["n_layers"]
    for builder, needle in (("qwen2", "unlike its model.config"), (["tiny"], "model.builder must be")):
        manifest["model"]["builder"] = builder
        with pytest.raises(ValueError, match=needle):
            model_of(manifest)


# -- 3: records and manifests through a schema check ----------------------------------------------------
def _overlap_records(path: Path, *results) -> list:
    from refkv.experiments.overlap import EXPERIMENT
    from refkv.experiments.records import read_records

    path.write_text("".join(json.dumps({"key": f"k{i}", "params": {"policy": "sink"}, "result": r}) + "\n"
                            for i, r in enumerate(results)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_records(path, EXPERIMENT.check_result)
    return records, [str(w.message) for w in caught]


@pytest.mark.parametrize("result, needle", [
    ({}, "result must hold"), ({"tokens": 6, "kept": [[[10**9]]]}, "position"),
    ({"tokens": 6, "kept": "abc"}, "result.kept must be"), ({"tokens": 6, "kept": [[list(range(7))]]}, "at most 6")])
def test_read_36_03_overlap_records(tmp_path, result, needle):
    path = tmp_path / "overlap.jsonl"
    good = {"tokens": 6, "kept": [[[0, 1, 5]]]}
    records, messages = _overlap_records(path, good, result)
    assert [r["key"] for r in records] == ["k0"]  # the bad record is not a finished cell
    assert len(messages) == 1 and f"{path}:2" in messages[0] and needle in messages[0], messages


def test_read_36_03_overlap_all_skipped(tmp_path, capsys):
    code, text = _cli(capsys, "experiment", "overlap", "--policies", "adakv", "pyramidkv", "--quick",
                      "--out", tmp_path / "r")
    _clear(code, text, "no pair of policies", "every cell was skipped", "adakv")


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(alpha=2), "alpha must be a finite number in (0, 1)"),
    (lambda d: d.update(alpha="0.05"), "alpha"),
    (lambda d: d["samples"].update(passkey_ceiling_required=float("nan")), "NaN"),
    (lambda d: d.update(claims=[]), "claims must be a list of 1 to"),
    (lambda d: d["claims"][0].update(id=["P1"]), "claims[0].id must be a non-empty string"),
])
def test_read_36_03_registration(tmp_path, edit, needle):
    from refkv.experiments.registered import read_registration

    doc = json.loads((ROOT / "docs" / "experiment_registration.json").read_text())
    edit(doc)
    path = tmp_path / "reg.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as info:
        read_registration(path)
    message = str(info.value)
    assert str(path) in message and needle in message and "\n" not in message, message
    assert read_registration(ROOT / "docs" / "experiment_registration.json")["alpha"] == 0.05


def _schedule_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "ref" / "e2e" / "keydiff"
    folder.mkdir(parents=True)
    for ext in (".json", ".npz"):
        shutil.copy(SCHEDULE.with_suffix(ext), folder / (SCHEDULE.name + ext))
    return folder


def test_read_36_03_schedule_manifest_bounded(tmp_path, capsys):
    folder = _schedule_folder(tmp_path)
    manifest = json.loads((folder / (SCHEDULE.name + ".json")).read_text())
    manifest["model"]["config"]["d_head"] = 10**9
    (folder / (SCHEDULE.name + ".json")).write_text(json.dumps(manifest))
    ref = tmp_path / "ref"
    code, text = _cli(capsys, "golden", "check", ref, "--against", ref)
    assert code == 1 and "model.config.d_head must be an integer in [1, 262144], got 1000000000" in text, text
    assert "Traceback" not in text


def test_read_36_03_corrupted_npz_not_swallowed(tmp_path):
    pytest.importorskip("kvpress")
    from refkv.interop.kvpress.schedules import schedule_goldens

    folder = _schedule_folder(tmp_path)
    (folder / "other.json").write_text(json.dumps({"schema": "refkv-weights"}))  # not a golden: passed over
    assert [rel for rel, _ in schedule_goldens(tmp_path / "ref")] == [f"e2e/keydiff/{SCHEDULE.name}.json"]
    npz = folder / (SCHEDULE.name + ".npz")
    npz.write_bytes(npz.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(ValueError, match=r"checksum mismatch|not a readable"):
        schedule_goldens(tmp_path / "ref")


# -- 4: text leaves refkv safe ---------------------------------------------------------------------------
def test_read_36_04_bidi_in_the_page(tmp_path, capsys):
    out = tmp_path / "page.html"
    code, text = _cli(capsys, "show", "--model", "tiny", "--budget", 8, "--block", 8, "--max-new-tokens", 0,
                      "--policy", "sink", "--out", out, "abc \u202edef\u2066 <b>x</b> \x1b[31m")
    assert code == 0, text
    page = out.read_text()
    assert not re.search("[\u202a-\u202e\u2066-\u2069\u200e\u200f\x1b]", page)
    assert "&lt;U+202E&gt;" in page and "<b>x</b>" not in page
    assert html_text("a\u202eb<") == "a&lt;U+202E&gt;b&lt;"


def test_read_36_04_escape_in_model_path(tmp_path, capsys):
    code, text = _cli(capsys, "generate", "--model", tmp_path / "\x1b]0;pwned\x07\x1b[31mred", "hi")
    _clear(code, text, "\\x1b]0;pwned\\x07")
    assert "\x1b" not in text and "\x07" not in text
    assert terminal_text("a\u202eb\x9b\tc\n") == "a<U+202E>b\\x9b\tc\n"


# -- 5: unclear messages made clear ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["golden", "generate", "--prefill", "0"], "--prefill must be 'oneshot' or a block size >= 1"),
    (["golden", "weights", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
])
def test_read_36_05_messages_name_the_option(tmp_path, capsys, argv, needle):
    code, text = _cli(capsys, *argv[:2], "--out", tmp_path / "o", *argv[2:])
    _clear(code, text, needle)
    assert "--block-size" not in text


def test_read_36_05_overlap_kept_named_with_file(tmp_path):
    from refkv.experiments.overlap import summarise
    from refkv.experiments.settings import Settings

    records = [{"params": {"budget": 8, "block": 8, "segment": 0, "policy": p}, "result": {"tokens": 6, "kept": k}}
               for p, k in (("sink", [[[0, 1]]]), ("knorm", [[[0], [1]]]))]
    (tmp_path / "overlap").mkdir()
    with pytest.raises(ValueError, match=r"overlap\.jsonl: the records of sink and knorm .* disagree"):
        summarise(records, tmp_path / "overlap", Settings())
    assert np.isclose(summarise.__globals__["mean_jaccard"]([[[0, 1]]], [[[1, 2]]]), 1 / 3)


def test_read_36_table():
    """Every row of the issue-36 reading table has tests ``test_read_36_<NN>_*`` and every such test a row."""
    text = (ROOT / "docs" / "guide" / "reliability.rst").read_text()
    table = text[text.index(".. table:: Issue 36, reading"):]
    table = table[:table.index("Each row's tests")]
    rows = {int(m.group(1)): (int(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^\s+(\d+)\s{2,}.+?\s{2,}\w+\s+(\d+)\s+(\d+)\s*$", table, re.MULTILINE)}
    assert sorted(rows) == list(range(1, 6)) and all(tried == clear for tried, clear in rows.values())
    tested = {int(n) for n in re.findall(r"^def test_read_36_(\d\d)_", Path(__file__).read_text(), re.MULTILINE)}
    assert tested == set(rows)
