"""Phase two's verdict script (docs/phase2_verdicts.py) on synthetic records in the records' exact
format, checked against hand-computed values; and, once the run's records are committed, a rerun
of the script on them that must reproduce the committed CSVs."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import io
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from refkv.experiments import phase2_passkey, phase2_texts
from refkv.experiments.documents import document_kind, document_names
from refkv.experiments.phase2_analysis import document_bootstrap, read_gzip_records
from refkv.experiments.records import cell_key, make_record
from refkv.experiments.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PHASE2 = ROOT / "docs" / "_static" / "experiments" / "phase2"
SETTINGS = Settings(model="tiny")


def _script():
    spec = importlib.util.spec_from_file_location("phase2_verdicts", ROOT / "docs" / "phase2_verdicts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["phase2_verdicts"] = module
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, name: str, experiment: str, cells: list[dict], result) -> None:
    """Records of ``cells`` as the runner writes them (make_record), gzip-compressed."""
    lines = [json.dumps(make_record(experiment, cell_key(p), p, result(p), 1.0, 1.0), sort_keys=True) for p in cells]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def _rows(folder: Path, name: str) -> list[dict]:
    with open(folder / name, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _run(tmp_path: Path, records: Path) -> Path:
    out = tmp_path / "out"
    assert _script().main(["--records", str(records), "--out", str(out), "--resamples", "200", "--seeds", "2"]) == 0
    return out


# -- passkey ------------------------------------------------------------------------------------------
def _passkey_calibration(acc: dict) -> list[dict]:
    """Calibration cells, answered right on the first round(acc * 42) prompts of each setting."""
    cells = phase2_passkey.cells(SETTINGS)
    order = {(p["document"], p["window"]): i for i, p in enumerate(c for c in cells if c["policy"] == "full")}
    for p in cells:
        share = acc.get((p["policy"], p["budget"], p["block"] is None), 0.5)
        p["_right"] = order[(p["document"], p["window"])] < round(share * 42)
    return cells


def _answer(p: dict) -> dict:
    return {"answer": "x", "correct": bool(p.pop("_right")), "key": 1, "predicted": ""}


def _passkey_records(folder: Path, calibration: dict, test_right) -> None:
    cal = _passkey_calibration(calibration)
    test = phase2_passkey.cells(Settings(model="tiny", options={"passkey_budget": 256}))
    for p in test:
        p["_right"] = test_right(p)
    _write(folder, "passkey2-calibration.jsonl.gz", "passkey2", cal, _answer)
    _write(folder, "passkey2-test.jsonl.gz", "passkey2", test, _answer)


def test_passkey_claim_against_hand_computed_values(tmp_path):
    """At N = 256 every comparison is testable; KeyDiff answers all 147 test prompts and SnapKV
    only window 4 of each document (21), so KeyDiff - SnapKV = 126/147 with 126 discordant pairs
    all for KeyDiff: McNemar p = 2 * 2**-126; the other P1 sides answer nothing, P2 ties."""
    records = tmp_path / "records"
    _passkey_records(records, {("full", None, True): 1.0}, lambda p: (
        p["policy"] in ("keydiff", "full") or (p["policy"] == "snapkv" and p["block"] is not None
                                               and p["window"] == 4)))
    out = _run(tmp_path, records)
    rows = {(r["claim"], r["a"], r["b"]): r for r in _rows(out, "verdicts.csv")}
    snap = rows[("P1", "keydiff", "snapkv")]
    assert int(snap["n"]) == 147 and snap["unit"] == "prompts"
    assert float(snap["estimate"]) == pytest.approx(126 / 147, rel=1e-5)
    assert float(snap["p"]) == pytest.approx(2 * 0.5 ** 126, rel=1e-5)
    # Holm over P1's three p-values: 2 * 2**-147 twice (147 discordant, x3) and 2 * 2**-126 last (x1)
    assert float(snap["p_holm"]) == pytest.approx(2 * 0.5 ** 126, rel=1e-5)
    assert snap["verdict"] == "holds" and snap["versus_paper"] == "not comparable"
    assert snap["setting"] == "N = 256, B = 16"
    # P2: one-shot and blocks both wrong everywhere but SnapKV blocks on window 4: one-shot - blocks = -21/147
    p2 = rows[("P2", "snapkv@oneshot", "snapkv@blocks")]
    assert float(p2["estimate"]) == pytest.approx(-21 / 147, rel=1e-5) and p2["verdict"] == "reversed"
    tova = rows[("P2", "tova@oneshot", "tova@blocks")]
    assert float(tova["p"]) == 1.0 and tova["verdict"] == "not resolved"
    assert float(tova["power"]) == pytest.approx(0.820643, rel=1e-5)   # power.csv's, beside "not resolved"
    # per document: SnapKV right on 1 of 7 prompts of each document; no interaction (all discordance one way)
    strata = [r for r in _rows(out, "strata.csv") if (r["a"], r["b"], r["stratum_type"]) ==
              ("keydiff", "snapkv", "document")]
    assert len(strata) == 21 and all(float(r["estimate"]) == pytest.approx(6 / 7, rel=1e-5) for r in strata)
    assert float(snap["p_interaction_document"]) == 1.0 and float(snap["p_interaction_kind"]) == 1.0
    units = [r for r in _rows(out, "units.csv") if (r["claim"], r["b"]) == ("P1", "snapkv")]
    assert len(units) == 147 and {r["kind"] for r in units} == {document_kind(d) for d in document_names()}
    # the cost table adds the records' own times (1 s per synthetic cell)
    cost = {r["part"]: r for r in _rows(out, "cost.csv")}
    assert cost["test"]["cells"] == "1176" and float(cost["test"]["cell_core_minutes"]) == 19.6
    assert cost["calibration"]["cells"] == "630" and float(cost["calibration"]["cpu_minutes"]) == 10.5
    # the results page's words say what the table says
    words = (out / "verdicts.inc").read_text(encoding="utf-8")
    p1 = next(line for line in words.splitlines() if "(P1; N = 256, B = 16)" in line)
    assert "**holds** (``keydiff`` - ``snapkv`` +0.857 [" in p1 and "n = 147 prompts, Holm p 2.4e-38" in p1
    p2 = next(line for line in words.splitlines() if "(P2; " in line)
    assert "**reversed** (``snapkv@oneshot`` - ``snapkv@blocks`` -0.143 [" in p2
    assert "**not resolved** (``tova@oneshot`` - ``tova@blocks`` 0 [" in p2 and "registered power 0.82" in p2
    # the figure draws every comparison with records (text stays text in the SVG)
    if importlib.util.find_spec("matplotlib") is not None:
        svg = (out / "verdicts.svg").read_text(encoding="utf-8")
        assert "P1 (147 prompts; N = 256, B = 16)" in svg and "keydiff - snapkv" in svg and "L1 (" not in svg
    # the README's sentence (docs/experiment_numbers.py) counts the same answers
    shutil.copytree(records, out / "records")
    spec = importlib.util.spec_from_file_location("experiment_numbers", ROOT / "docs" / "experiment_numbers.py")
    numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numbers)
    sentence = " ".join(numbers.phase2_values(out)["p2_passkey"].split())
    assert ("(147 prompts from 21 documents of 6 kinds, ``N = 256`` of 1,024 tokens, blocks of 16; without "
            "eviction 147/147), KeyDiff in blocks answered 147/147, SnapKV 21/147 (0/147 in one shot)") in sentence
    assert ("(P1): SnapKV holds, TOVA holds, H2O holds (the kind x policy interaction p: 1, 1, 1); one-shot "
            "better than blocks (P2): SnapKV reversed") in sentence


def test_floor_rule(tmp_path):
    """KeyDiff and TOVA in blocks answer 2 and 0 of 42 at both budgets: their mean accuracy 1/42 is
    under 0.1 at both, so no budget makes all testable; the tie goes to 256, where P1's KeyDiff - TOVA
    is 'not testable (floor)' and never tested (no p), and the others are tested."""
    floor = {("full", None, True): 1.0}
    for budget in (256, 512):
        floor[("keydiff", budget, False)] = 2 / 42
        floor[("tova", budget, False)] = 0.0
        floor[("snapkv", budget, False)] = 0.5
        floor[("h2o", budget, False)] = 0.5
    records = tmp_path / "records"
    _passkey_records(records, floor, lambda p: p["window"] % 2 == 0)
    out = _run(tmp_path, records)
    rows = {(r["claim"], r["a"], r["b"]): r for r in _rows(out, "verdicts.csv")}
    assert rows[("P1", "keydiff", "tova")]["verdict"] == "not testable (floor)"
    assert rows[("P1", "keydiff", "tova")]["p"] == ""
    assert rows[("P1", "keydiff", "snapkv")]["verdict"] == "not resolved"      # every answer alike: p = 1
    calibration = _rows(out, "calibration.csv")
    chosen = [r for r in calibration if r["budget"] == "chosen"]
    assert chosen[0]["a"] == "256"
    at = {(r["budget"], r["a"], r["b"]): r for r in calibration}
    assert float(at[("256", "keydiff", "tova")]["mean_accuracy"]) == pytest.approx(1 / 42, rel=1e-5)


def test_ceiling_not_met(tmp_path):
    """The full cache answers 39 of 42 (under 95%): the passkey claims are not run."""
    records = tmp_path / "records"
    _passkey_records(records, {("full", None, True): 39 / 42}, lambda p: True)
    rows = _rows(_run(tmp_path, records), "verdicts.csv")
    assert {r["verdict"] for r in rows if r["claim"] in ("P1", "P2")} == {"not run (ceiling not met)"}


# -- a per-document mean ---------------------------------------------------------------------------------
def _perplexity_records(folder: Path, ppl) -> None:
    cells = [p for p in phase2_texts.perplexity_cells(SETTINGS) if p["policy"] in ("full", "keydiff", "snapkv")]

    def result(p):
        value = ppl(p)
        return {"document_kind": document_kind(p["document"]), "tokens": 1023, "ppl": value,
                "peak_cache_tokens": 160, "nll": [math.log(value)] * 1023}
    _write(folder, "perplexity2.jsonl.gz", "perplexity2", cells, result)


def test_mean_claim_against_hand_computed_values(tmp_path):
    """L1 KeyDiff - SnapKV: document i's windows differ by d_i - 0.1 and d_i + 0.1, so its value
    is d_i = -1 + 0.5 (i mod 3); the paired t over the 21 documents is computed here by hand."""
    names = document_names()

    def ppl(p):
        i = names.index(p["document"])
        if p["policy"] == "full":
            return 10.0
        if p["policy"] == "snapkv":
            return 12.0 + 0.01 * i
        return 12.0 + 0.01 * i - 1 + 0.5 * (i % 3) + (0.1 if p["window"] else -0.1)

    records = tmp_path / "records"
    _perplexity_records(records, ppl)
    out = _run(tmp_path, records)
    rows = {(r["claim"], r["a"], r["b"]): r for r in _rows(out, "verdicts.csv")}
    row = rows[("L1", "keydiff", "snapkv")]
    d = np.array([-1 + 0.5 * (i % 3) for i in range(21)])
    mean, sd = d.sum() / 21, math.sqrt(((d - d.sum() / 21) ** 2).sum() / 20)
    from scipy import stats

    t = mean / (sd / math.sqrt(21))
    half = stats.t.ppf(0.975, 20) * sd / math.sqrt(21)
    assert int(row["n"]) == 21 and row["unit"] == "documents"
    assert float(row["estimate"]) == pytest.approx(mean, rel=1e-5)
    assert float(row["low"]) == pytest.approx(mean - half, rel=1e-5)
    assert float(row["p"]) == pytest.approx(2 * stats.t.sf(abs(t), 20), rel=1e-4)
    assert row["versus_paper"] == "not comparable"
    # the two other L1 comparisons and every other claim have no records: not run, never dropped
    assert rows[("L1", "keydiff", "tova")]["verdict"] == "not run"
    assert rows[("G1", "spearman", "")]["verdict"] == "not run"
    assert len(rows) == 24
    # per kind: drama is documents 0-4, d = -1, -0.5, 0, -1, -0.5
    kind = {r["stratum"]: r for r in _rows(out, "strata.csv") if r["claim"] == "L1"}
    assert float(kind["drama"]["estimate"]) == pytest.approx(-0.6, rel=1e-5)
    # within each document the two windows differ by 0.2 around d_i: the ANOVA across documents
    # has between-document variance only from d, within-document sum 21 * 2 * 0.1**2
    within = 21 * 2 * 0.01 / (42 - 21)
    between = 2 * ((d - d.mean()) ** 2).sum() / 20
    assert float(row["p_interaction_document"]) == pytest.approx(stats.f.sf(between / within, 20, 21), rel=1e-3,
                                                                   abs=1e-300)
    boot = _rows(out, "bootstrap.csv")[0]
    assert (boot["claim"], boot["a"], boot["b"]) == ("L1", "keydiff", "snapkv")
    assert float(boot["estimate"]) == pytest.approx(mean, rel=1e-5)
    assert float(boot["low"]) <= mean <= float(boot["high"])


def test_nothing_run_writes_not_run_rows(tmp_path):
    out = _run(tmp_path, tmp_path / "none")
    rows = _rows(out, "verdicts.csv")
    assert len(rows) == 24 and {r["verdict"] for r in rows} == {"not run"}
    assert _rows(out, "calibration.csv")[0]["budget"] == "not run"


def test_document_bootstrap_by_hand():
    """Two documents of one window and one block each: a replicate is x1, x2 or their mean, so
    the 95% interval runs from the smaller difference to the larger."""
    a = np.log(np.array([[[[5.0] * 8], [[9.0] * 8]]]))      # (1 run, 2 documents, 1 window, 8 tokens)
    b = np.log(np.array([[[[4.0] * 8], [[4.0] * 8]]]))
    interval = document_bootstrap(a, b, block=64, n_boot=2000, seed=1)
    assert interval.estimate == pytest.approx(3.0)
    assert (interval.low, interval.high) == (pytest.approx(1.0), pytest.approx(5.0))


def test_gzip_records_are_read_within_caps(tmp_path):
    path = tmp_path / "x.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"key": "a", "params": {}, "result": {}}\n' * 50))
    assert len(read_gzip_records(path)) == 1
    with pytest.raises(ValueError, match="decompresses to more than"):
        read_gzip_records(path, max_bytes=200)
    path.write_bytes(gzip.compress(b'{"key": "a"}\n'))
    with pytest.raises(ValueError, match=r"x.jsonl.gz:1: a record must be"):
        read_gzip_records(path)


# -- the committed records -----------------------------------------------------------------------------
@pytest.mark.skipif(not any((PHASE2 / "records").glob("*.jsonl.gz")), reason="phase two's records are not "
                    "committed yet")
def test_committed_records_reproduce_committed_tables():
    """The script, rerun on the committed records, writes the committed CSVs byte for byte (the
    bootstrap display aside: 20 x 10,000 resamples take minutes; its t columns are checked)."""
    _reproduces(PHASE2 / "records", PHASE2)


def test_reproduction_check_on_synthetic_records(tmp_path):
    """The check above, on synthetic records the script has just published."""
    records = tmp_path / "records"
    _passkey_records(records, {("full", None, True): 1.0}, lambda p: p["window"] % 3 == 0)
    _perplexity_records(records, lambda p: 10.0 + (p["policy"] == "snapkv") + 0.1 * p["window"])
    _reproduces(records, _run(tmp_path, records))


def _reproduces(records: Path, published: Path) -> None:
    files = _script().table_files(records, PHASE2 / "power.csv", bootstrap=False, figure=False)
    for name, text in files.items():
        if name != "bootstrap.csv":
            assert (published / name).read_text(encoding="utf-8") == text, name
    verdicts = {(r["claim"], r["a"], r["b"]): r for r in csv.DictReader(io.StringIO(files["verdicts.csv"]))}
    for row in _rows(published, "bootstrap.csv"):
        if row["claim"] != "not run":
            assert (row["t_low"], row["t_high"]) == (verdicts[(row["claim"], row["a"], row["b"])]["low"],
                                                     verdicts[(row["claim"], row["a"], row["b"])]["high"])


def test_every_claim_with_records_gets_a_verdict(tmp_path):
    """Random records of every grid: each registered comparison is tested (or is secondary), the
    paper effects of C1, M1, A1 and S1 are scaled, HashEvict's seeds are published per document."""
    rng = np.random.default_rng(5)
    records = tmp_path / "records"
    _passkey_records(records, {("full", None, True): 1.0}, lambda p: p["window"] % 2 == 0)
    _perplexity_records(records, lambda p: 10.0 + (p["policy"] != "full") * (1.0 + rng.random()))
    cells = [p for p in phase2_texts.perplexity_cells(SETTINGS) if p["policy"] not in ("full", "keydiff", "snapkv")]
    _write(records, "perplexity2-more.jsonl.gz", "perplexity2", cells, lambda p: {
        "ppl": 11.0 + rng.random(), "nll": [math.log(11.0 + rng.random())] * 1023})
    _write(records, "attention_loss2.jsonl.gz", "attention_loss2", phase2_texts.attention_cells(SETTINGS),
           lambda p: {"mean_loss": 0.03 + 0.01 * rng.random(), "loss_by_layer": [0.03]})

    def geometry(p):
        if p["kind"] == "cosine":
            return {"common_queries": {"spearman": rng.normal(0, 0.1, (4, 2)).tolist()},
                    "spearman_anchor": rng.normal(0, 0.1, (4, 2)).tolist()}
        if p["kind"] == "hamming":
            return {"pearson": {"8": rng.normal(0.2, 0.05, (4, 4)).tolist(),
                                "32": rng.normal(0.3, 0.05, (4, 4)).tolist()}}
        return {"log_volume": rng.normal(-50, 1, (4, 2)).tolist()}
    _write(records, "geometry2.jsonl.gz", "geometry2", phase2_texts.geometry_cells(SETTINGS), geometry)
    out = _run(tmp_path, records)
    rows = _rows(out, "verdicts.csv")
    assert len(rows) == 24 and not any(r["verdict"].startswith("not") and r["verdict"] != "not resolved"
                                       for r in rows)
    by = {(r["claim"], r["a"], r["b"]): r for r in rows}
    for key in (("C1", "caote:base=h2o", "h2o"), ("M1", "mat@selected", "sink"), ("S1", "bits=32", "bits=8"),
                ("A1", "h2o", "hashevict")):
        assert by[key]["paper_effect"] and by[key]["versus_paper"] in ("larger than the paper", "smaller than "
                                                                        "the paper", "consistent with the paper")
    assert by[("S1", "bits=32", "bits=8")]["paper_effect"] == "0.18"
    assert by[("G1-all", "spearman_all", "")]["verdict"] == "secondary (no verdict)"
    assert by[("G1-all", "spearman_all", "")]["p_holm"] == ""
    assert len(_rows(out, "seeds.csv")) == 2 * 21
    assert len(_rows(out, "bootstrap.csv")) == 8


def test_panel_titles_shorten_long_settings():
    """A setting over the limit loses its parenthetical remarks, then is cut with an ellipsis;
    a short one is kept whole."""
    short = _script()._short
    assert short("token by token (B = 1), N = 128") == "token by token (B = 1), N = 128"
    assert short("N = 256 (the first 512 tokens; a mean (nested) over 2 prompts) of 512", limit=30) == "N = 256 of 512"
    assert short("a" * 40, limit=10) == "a" * 9 + "\u2026"
