"""Phase one's regenerated records (docs/registered_records.py): on hand-made records its comparison
with units.csv finds a changed value and a unit units.csv lacks, and G1-all is the one-sample t of
minus each prompt's mean ``spearman_anchor``; on the committed records it must reproduce the
committed CSVs, and every value it recomputes must equal the published one."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from refkv.experiments.perplexity import registered_texts
from refkv.experiments.records import cell_key, make_record

ROOT = Path(__file__).resolve().parents[2]
REGISTERED = ROOT / "docs" / "_static" / "experiments" / "registered"


def _script():
    spec = importlib.util.spec_from_file_location("registered_records", ROOT / "docs" / "registered_records.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["registered_records"] = module
    spec.loader.exec_module(module)
    return module


def _cosine_records(anchor: dict, common: dict) -> list[dict]:
    """Registered cosine cells, one per verdict prompt, with 2 layers x 2 KV heads of statistics."""
    out = []
    for text, segment in registered_texts("verdict"):
        params = {"design": "registered", "kind": "cosine", "text": text, "segment": segment, "length": 512}
        result = {"spearman_anchor": anchor[(text, segment)],
                  "common_queries": {"spearman": common[(text, segment)]}}
        out.append(json.loads(json.dumps(make_record("geometry", cell_key(params), params, result, 1.0, 1.0))))
    return out


def _statistics(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {unit: rng.uniform(-0.5, 0.5, size=(2, 2)).tolist() for unit in registered_texts("verdict")}


def _units(records: list[dict]) -> str:
    """A units.csv holding exactly what the records give for G1 (its published text)."""
    from refkv.experiments.registered import UNIT_COLUMNS, geometry_comparisons, unit_rows
    from refkv.experiments.tables import csv_text

    return csv_text(unit_rows(geometry_comparisons(records)), UNIT_COLUMNS)


def test_g1_all_is_the_one_sample_t_of_minus_the_mean_anchor_correlation():
    anchor, common = _statistics(1), _statistics(2)
    row = _script().g1_all_row(_cosine_records(anchor, common))
    values = [-np.mean(anchor[u]) for u in registered_texts("verdict")]   # the registered prompts' order
    t = stats.ttest_1samp(values, 0.0)
    half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    assert row["n"] == 16 and row["claim"] == "G1-all"
    assert row["estimate"] == pytest.approx(np.mean(values), abs=1e-15)
    assert (row["low"], row["high"]) == pytest.approx((np.mean(values) - half, np.mean(values) + half), abs=1e-12)
    assert row["p"] == pytest.approx(t.pvalue, rel=1e-9)


def test_agreement_counts_identical_values_and_finds_a_changed_one(tmp_path):
    script = _script()
    records = _cosine_records(_statistics(1), _statistics(2))
    units = tmp_path / "units.csv"
    units.write_text(_units(records), encoding="utf-8")
    published = script.published_units(units)
    [row] = script.agreement("geometry", records, published)
    assert (row["claim"], row["units_published"], row["units_regenerated"]) == ("G1", 16, 16)
    assert row["values_compared"] == row["values_identical"] == 16 and row["max_relative_difference"] == 0.0

    changed = json.loads(json.dumps(records))
    stat = changed[3]["result"]["common_queries"]["spearman"]
    stat[0][0] = stat[0][0] * (1 + 1e-9)          # one layer's one head, in the ninth digit
    [row] = script.agreement("geometry", changed, published)
    assert row["values_identical"] == 15
    assert 0 < row["max_relative_difference"] < 1e-8


def test_a_unit_units_csv_lacks_is_an_error_and_a_missing_one_is_counted(tmp_path):
    script = _script()
    records = _cosine_records(_statistics(1), _statistics(2))
    units = tmp_path / "units.csv"
    units.write_text(_units(records[:10]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"which units\.csv does not"):
        script.agreement("geometry", records, script.published_units(units))
    units.write_text(_units(records), encoding="utf-8")
    [row] = script.agreement("geometry", records[:10], script.published_units(units))
    assert (row["units_published"], row["units_regenerated"]) == (16, 10)


def test_the_script_writes_both_csvs_and_check_finds_a_stale_one(tmp_path, capsys):
    script = _script()
    records = _cosine_records(_statistics(1), _statistics(2))
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "geometry.jsonl.gz").write_bytes(
        gzip.compress(("\n".join(json.dumps(r, sort_keys=True) for r in records) + "\n").encode()))
    units = tmp_path / "units.csv"
    units.write_text(_units(records), encoding="utf-8")
    out = tmp_path / "out"
    args = ["--records", str(folder), "--units", str(units), "--out", str(out), "--passkey", str(tmp_path / "none")]
    assert script.main(args) == 0
    assert "16 of 16 published values recomputed bit for bit" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["g1_all.csv", "regenerated.csv"]   # no passkey records
    assert script.main([*args, "--check"]) == 0
    (out / "g1_all.csv").write_text("claim\n", encoding="utf-8")
    assert script.main([*args, "--check"]) == 1
    assert "differs:" in capsys.readouterr().out and (out / "g1_all.csv").read_text() == "claim\n"


def test_no_regenerated_records_is_a_clear_error(tmp_path, capsys):
    units = tmp_path / "units.csv"
    units.write_text("claim,a,b,unit,value_a,value_b,value_full\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        _script().main(["--records", str(tmp_path), "--units", str(units), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "nothing to compare" in capsys.readouterr().err


def test_a_record_without_a_field_the_rule_reads_is_a_one_line_error(tmp_path, capsys):
    records = _cosine_records(_statistics(1), _statistics(2))
    units = tmp_path / "units.csv"
    units.write_text(_units(records), encoding="utf-8")
    del records[5]["result"]["common_queries"]
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "geometry.jsonl.gz").write_bytes(
        gzip.compress(("\n".join(json.dumps(r, sort_keys=True) for r in records) + "\n").encode()))
    with pytest.raises(SystemExit) as exit_:
        _script().main(["--records", str(folder), "--units", str(units), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "lacks or mistypes a field" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_seed_rows_give_each_seeds_loss_and_the_mean_a1_tests():
    from refkv.experiments.registered import attention_loss_comparisons

    rng = np.random.default_rng(5)
    records = []
    for text, segment in registered_texts("verdict"):
        for policy in ("hashevict:seed=0", "hashevict:seed=1", "hashevict:seed=2", "knorm", "h2o"):
            params = {"design": "registered", "kind": "step_loss", "text": text, "segment": segment,
                      "policy": policy}
            records.append({"params": params, "result": {"mean_loss": float(rng.uniform(0, 0.2))}})
    rows = _script().seed_rows(records[:-1])          # the last prompt without its H2O: still every seed
    assert len(rows) == 16 and rows[0]["segment"] == 0
    a1 = {c.b: c for c in attention_loss_comparisons(records)}["hashevict"]   # H2O - HashEvict
    for row, value in zip(rows, a1.b_values):
        assert row["mean"] == pytest.approx(value, rel=1e-15)
        assert row["mean"] == pytest.approx(np.mean([row["seed=0"], row["seed=1"], row["seed=2"]]), rel=1e-15)
    assert len(_script().seed_rows(records[:-3])) == 15   # a prompt missing seed 2 is left out


def test_distinctiveness_rows_pair_the_full_caches_needle_score_with_each_settings_answer():
    def record(sample, policy, block, correct, **extra):
        params = {"design": "registered", "purpose": "test", "sample": sample, "policy": policy, "block": block,
                  "budget": None if policy == "full" else 128}
        return {"params": params, "result": {"correct": correct, "source": "kjv_narrative", "depth": 0.25, **extra}}

    records = [record(1, "full", 128, True, needle_distinctiveness=0.75), record(1, "keydiff", 128, False),
               record(1, "snapkv", None, True), record(0, "full", 128, False, needle_distinctiveness=0.5),
               {"params": {"design": "registered", "purpose": "calibration", "sample": 0, "policy": "full",
                           "block": 128}, "result": {"correct": True, "needle_distinctiveness": 0.9}},
               {"params": {"design": "registered", "purpose": "test", "sample": 0, "policy": "tova", "block": 128},
                "result": {"skipped": "too long"}}]
    rows = _script().distinctiveness_rows(records)
    assert [r["sample"] for r in rows] == [0, 1]
    assert rows[0] == {"sample": 0, "source": "kjv_narrative", "depth": 0.25, "full": False, "distinctiveness": 0.5}
    assert rows[1]["distinctiveness"] == 0.75 and rows[1]["full"] is True
    assert (rows[1]["keydiff@blocks"], rows[1]["snapkv@oneshot"]) == (False, True)


# -- the committed records ----------------------------------------------------------------------------
COMMITTED = sorted((REGISTERED / "records").glob("*.jsonl.gz"))


@pytest.mark.skipif(not COMMITTED, reason="no regenerated phase-one records are committed")
def test_the_committed_records_reproduce_the_committed_csvs(capsys):
    assert _script().main(["--check"]) == 0, capsys.readouterr().out


@pytest.mark.skipif(not COMMITTED, reason="no regenerated phase-one records are committed")
def test_every_regenerated_value_equals_the_published_one():
    rows = list(csv.DictReader(io.StringIO((REGISTERED / "regenerated.csv").read_text(encoding="utf-8"))))
    parts = {r["part"] for r in rows}
    assert parts == {p.name.removesuffix(".jsonl.gz") for p in COMMITTED}
    for r in rows:
        where = f"{r['part']} {r['claim']} {r['a']} - {r['b']}"
        assert r["units_regenerated"] == r["units_published"], where       # a committed part is whole
        assert r["values_identical"] == r["values_compared"] != "0", where
        assert float(r["max_relative_difference"]) == 0.0, where


def test_the_published_distinctiveness_table_covers_every_test_prompt():
    rows = list(csv.DictReader(io.StringIO((REGISTERED / "distinctiveness.csv").read_text(encoding="utf-8"))))
    assert [int(r["sample"]) for r in rows] == list(range(60))
    assert all(0 <= float(r["distinctiveness"]) <= 1 for r in rows)
    script = _script()
    counts = {s: sum(r[s] == "True" for r in rows) for s in script.SETTINGS}
    # the registered run's answers (records README): blocks KeyDiff 2, SnapKV 2, TOVA 0, H2O 0;
    # one-shot KeyDiff 7, SnapKV 19, TOVA 0, H2O 0; the full cache 60
    assert counts == {"keydiff@blocks": 2, "snapkv@blocks": 2, "tova@blocks": 0, "h2o@blocks": 0,
                      "keydiff@oneshot": 7, "snapkv@oneshot": 19, "tova@oneshot": 0, "h2o@oneshot": 0}
    assert all(r["full"] == "True" for r in rows)
