"""The phase-two population (issue 35 A) and its registration (issue 35 B)."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from refkv.experiments import documents
from refkv.experiments.models import smollm2_installed
from refkv.experiments.registered import read_registration

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "refkv" / "data" / "documents"
PHASE2 = ROOT / "docs" / "experiment_registration_phase2.json"


def test_at_least_eight_documents_of_at_least_four_kinds_with_provenance():
    entries = documents.provenance()
    assert len(entries) >= 8
    assert len({e["kind"] for e in entries}) >= 4
    assert {e["kind"] for e in entries} <= set(documents.DOCUMENT_KINDS)
    for e in entries:
        for key in ("author", "title", "package", "licence", "extraction", "sha256"):
            assert e[key], (e["name"], key)
        data = (DATA / f"{e['name']}.txt").read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
        assert len(data.decode("utf-8")) == e["characters"]
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 2_000_000     # modest


def test_documents_are_distinct_texts():
    texts = [documents.document_text(name) for name in documents.document_names()]
    # no 200-character passage of one document appears in another
    for i, text in enumerate(texts):
        probe = text[len(text) // 2:len(text) // 2 + 200]
        assert sum(probe in other for other in texts) == 1, documents.document_names()[i]


def test_a_tampered_document_is_refused(monkeypatch):
    name = documents.document_names()[0]
    monkeypatch.setitem(documents._TEXT, name, None)
    documents._TEXT.pop(name)
    entries = documents.provenance()
    entries[0] = dict(entries[0], sha256="0" * 64)
    monkeypatch.setattr(documents, "provenance", lambda: entries)
    with pytest.raises(ValueError, match="SHA-256"):
        documents.document_text(name)
    with pytest.raises(ValueError, match="document must be one of"):
        documents.document_kind("no such document")


def test_windows_do_not_overlap_and_are_bounded():
    n = documents.document_windows("tiny", "float32", "hamlet", 512)
    first, second = (documents.document_window("tiny", "float32", "hamlet", 512, i) for i in (0, 1))
    assert first.shape == (512,) and second.shape == (512,)
    with pytest.raises(ValueError, match="index must be in"):
        documents.document_window("tiny", "float32", "hamlet", 512, n)


@pytest.mark.skipif(not smollm2_installed(), reason="the real model's tokenizer is not installed")
def test_every_document_holds_the_registered_windows():
    reg = json.loads(PHASE2.read_text(encoding="utf-8"))
    need = 11                           # 2 perplexity + 2 calibration + 7 test windows
    assert reg["samples"]["passkey_prompts"] == 7 * reg["samples"]["documents"]
    for name in documents.document_names():
        assert documents.document_windows("smollm2", "float32", name, 1024) >= need, name


def test_phase_two_registration_is_valid_and_matches_its_power_analysis():
    reg = read_registration(PHASE2)
    assert reg["samples"]["documents"] == len(documents.document_names())
    ids = [c["id"] for c in reg["claims"]]
    assert {"P1", "P2", "L1", "C1", "M1", "H1", "A1", "A1-unmatched", "G1", "G1-all", "G2", "S1"} == set(ids)
    claims = {c["id"]: c for c in reg["claims"]}
    # matched protection is A1's primary comparison, the unmatched one secondary
    assert ["hashevict", "knorm:recent=10,sink=4"] in claims["A1"]["comparisons"]
    assert claims["A1-unmatched"].get("secondary") is True
    # a paper effect only where the paper's metric is the same
    for cid in ("P1", "L1", "H1"):
        assert claims[cid]["paper"] is None and "not comparable" in claims[cid]["paper_note"]
    spec = importlib.util.spec_from_file_location("phase2_power", ROOT / "docs" / "phase2_power.py")
    power = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(power)
    assert power.PASSKEY_PROMPTS == reg["samples"]["passkey_prompts"]
    assert power.DOCUMENTS == reg["samples"]["documents"]
    with open(ROOT / "docs" / "_static" / "experiments" / "phase2" / "power.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # every passkey comparison reaches the target at the registered n
    for r in rows:
        if r["claim"] in ("P1", "P2"):
            assert int(r["n_needed"]) <= int(r["n_registered"]) and float(r["power_registered"]) >= 0.8
    # the registration names exactly the claims whose power falls short with 21 documents
    short = {(r["claim"], r["b"]) for r in rows if float(r["power_registered"]) < 0.8}
    assert short == {("L1", "snapkv"), ("L1", "tova"), ("C1", "h2o"), ("H1", "knorm:recent=10,sink=4"),
                     ("A1", "knorm:recent=10,sink=4"), ("A1 (secondary)", "knorm"), ("G2", "snapkv"),
                     ("G2", "sink")}


def test_power_csv_is_the_scripts_output():
    spec = importlib.util.spec_from_file_location("phase2_power", ROOT / "docs" / "phase2_power.py")
    power = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(power)
    with open(ROOT / "docs" / "_static" / "experiments" / "phase2" / "power.csv", newline="") as f:
        committed = [(r["claim"], r["b"], r["n_needed"]) for r in csv.DictReader(f)]
    assert committed == [(r["claim"], r["b"], str(r["n_needed"])) for r in power.rows()]
