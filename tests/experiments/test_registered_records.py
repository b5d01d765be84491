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


def _load(name: str):
    """The script ``docs/NAME.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _script():
    return _load("registered_records")


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
    from refkv.experiments.registered import attention_loss_comparisons, step_losses

    rng = np.random.default_rng(5)
    records = []
    for text, segment in registered_texts("verdict"):
        for policy in ("hashevict:seed=0", "hashevict:seed=1", "hashevict:seed=2", "knorm", "h2o"):
            params = {"design": "registered", "kind": "step_loss", "text": text, "segment": segment,
                      "policy": policy}
            records.append({"params": params, "result": {"mean_loss": float(rng.uniform(0, 0.2))}})
    script = _script()
    rows = script.seed_rows("A1", step_losses(records[:-1]))   # the last prompt without its H2O: still every seed
    assert len(rows) == 16 and rows[0]["segment"] == 0
    a1 = {c.b: c for c in attention_loss_comparisons(records)}["hashevict"]   # H2O - HashEvict
    for row, value in zip(rows, a1.b_values):
        assert row["mean"] == pytest.approx(value, rel=1e-15)
        assert row["mean"] == pytest.approx(np.mean([row["seed=0"], row["seed=1"], row["seed=2"]]), rel=1e-15)
    assert len(script.seed_rows("A1", step_losses(records[:-3]))) == 15   # a prompt missing seed 2 is left out


#: The hand-made perplexity grid: (policy, block, how much higher its token losses run than the full cache's).
_GRID = [("full", 32, 0.0), ("keydiff", 32, 0.30), ("snapkv", 32, 0.20), ("tova", 32, 0.25), ("h2o", 32, 0.40),
         ("caote:base=h2o", 32, 0.35), ("caote:base=tova", 32, 0.22), ("caote:base=snapkv", 32, 0.18),
         ("hashevict:seed=0", 1, 0.10), ("hashevict:seed=1", 1, 0.12), ("hashevict:seed=2", 1, 0.14),
         ("knorm:recent=10,sink=4", 1, 0.20), ("sink", 1, 0.15), ("mat:beta=16,shallow_layers=2", 1, 0.11)]


def _perplexity_records(seed: int = 0, tokens: int = 256) -> list[dict]:
    """Registered perplexity cells of every verdict text and MAT's two-spec selection, with token
    losses (``ppl`` is exp of their mean, as the experiment writes it)."""
    rng = np.random.default_rng(seed)

    def record(text, segment, policy, block, nll):
        params = {"design": "registered", "text": text, "segment": segment, "policy": policy, "block": block,
                  "budget": 128, "length": tokens + 1}
        result = {"nll": nll.tolist(), "ppl": math.exp(nll.mean()), "tokens": tokens}
        return json.loads(json.dumps(make_record("perplexity", cell_key(params), params, result, 1.0, 1.0)))

    out = []
    for text, segment in registered_texts("verdict"):
        base = rng.gamma(1.5, 1.5, size=tokens)
        for policy, block, extra in _GRID:
            out.append(record(text, segment, policy, block, base + extra * rng.uniform(0.5, 1.5, size=tokens)))
    for text, segment in registered_texts("selection"):
        base = rng.gamma(1.5, 1.5, size=tokens)
        for spec, extra in (("mat:beta=16,shallow_layers=2", 0.1), ("mat:beta=32,shallow_layers=0", 0.3)):
            out.append(record(text, segment, spec, 32, base + extra))
    return out


def test_h1_seed_rows_give_each_seeds_perplexity_and_the_mean_h1_tests():
    from refkv.experiments.registered import perplexity_comparisons

    records = _perplexity_records()
    script = _script()
    rows = script.seed_rows("H1", script.perplexity_seeds(records))
    h1 = {c.claim: c for c in perplexity_comparisons(records)}["H1"]
    assert len(rows) == 16 and {r["claim"] for r in rows} == {"H1"}
    assert [r["mean"] for r in rows] == pytest.approx(list(h1.a_values), rel=1e-15)
    by_text = {(r["params"]["text"], r["params"]["segment"], r["params"]["policy"]): r["result"]["ppl"]
               for r in records}
    assert rows[3]["seed=1"] == by_text[(rows[3]["text"], rows[3]["segment"], "hashevict:seed=1")]
    dropped = [r for r in records if (r["params"]["policy"], r["params"]["segment"]) != ("hashevict:seed=2", 0)]
    assert len(script.seed_rows("H1", script.perplexity_seeds(dropped))) == 16 - 2     # both sources' segment 0


def test_the_registered_hashevict_seeds_are_the_registrations():
    from refkv.experiments.attention_loss import REGISTERED_STEP_POLICIES
    from refkv.experiments.perplexity import REGISTERED_TOKEN_BY_TOKEN
    from refkv.experiments.registered import REGISTERED_HASHEVICT, read_registration

    registration = read_registration(ROOT / "docs" / "experiment_registration.json")
    assert len(REGISTERED_HASHEVICT) == registration["samples"]["hashevict_seeds"]
    assert set(REGISTERED_HASHEVICT) <= set(REGISTERED_TOKEN_BY_TOKEN) & set(REGISTERED_STEP_POLICIES)


def test_the_bootstrap_display_is_the_two_stage_bootstrap_of_each_perplexity_claim():
    from refkv.experiments.registered import perplexity_comparisons, perplexity_token_losses
    from refkv.experiments.stats import two_stage_bootstrap

    records = _perplexity_records(1)
    rows = _script().bootstrap_rows(records, n_boot=4000, seeds=3)
    comparisons = perplexity_comparisons(records)
    assert [(r["claim"], r["a"], r["b"]) for r in rows] == [(c.claim, c.a, c.b) for c in comparisons]
    for row, comparison in zip(rows, comparisons):
        difference = np.mean(comparison.a_values - comparison.b_values)
        assert row["estimate"] == pytest.approx(difference, rel=1e-12)           # the t interval's estimate
        assert row["t_low"] < difference < row["t_high"] and row["texts"] == 16
        assert row["low_min"] <= row["low"] <= row["low_max"] < row["estimate"] < row["high_min"] <= row["high"] \
            <= row["high_max"]
        assert (row["seeds"], row["resamples"]) == (3, 4000)
    # with one run a side it is phase one's "texts, then 64-token blocks within a text" bootstrap
    # (stats.two_stage_bootstrap): the same distribution, other random draws
    l1 = comparisons[0]
    a, b = perplexity_token_losses(records, l1)
    assert a.shape == b.shape == (1, 16, 1, 256)
    direct = two_stage_bootstrap(list(a[0, :, 0]), list(b[0, :, 0]), block=64, n_boot=4000, seed=7)
    width = direct.high - direct.low
    assert (rows[0]["low"], rows[0]["high"]) == pytest.approx((direct.low, direct.high), abs=0.08 * width)
    # HashEvict's side holds its three seeds
    h1 = next(c for c in comparisons if c.claim == "H1")
    assert perplexity_token_losses(records, h1)[0].shape == (3, 16, 1, 256)


def test_the_bootstrap_of_equal_sides_is_a_point_at_zero():
    records = _perplexity_records(2)
    snap = {(r["params"]["text"], r["params"]["segment"]): r for r in records if r["params"]["policy"] == "snapkv"}
    for r in records:
        if r["params"]["policy"] == "keydiff":
            key = (r["params"]["text"], r["params"]["segment"])
            r["result"] = dict(snap[key]["result"])
    row = next(r for r in _script().bootstrap_rows(records, n_boot=200, seeds=2) if r["b"] == "snapkv")
    assert row["estimate"] == row["low_min"] == row["high_max"] == 0.0


def test_unequal_token_counts_are_a_clear_error():
    from refkv.experiments.registered import perplexity_comparisons, perplexity_token_losses

    records = _perplexity_records(3)
    records[0]["result"]["nll"] = records[0]["result"]["nll"][:-1]       # the first text's full cache
    l1 = perplexity_comparisons(records)[0]
    records[1]["result"]["nll"] = records[1]["result"]["nll"][:-1]       # its KeyDiff
    with pytest.raises(ValueError, match="lengths \\[255, 256\\]"):
        perplexity_token_losses(records, l1)


def test_mat_rows_rederive_the_choice_and_name_the_published_one(tmp_path):
    script = _script()
    records = _perplexity_records(4)
    rows = script.mat_rows(records, "mat:beta=32,shallow_layers=0")
    assert [(r["spec"], r["texts"], r["chosen"], r["published"]) for r in rows] == [
        ("mat:beta=16,shallow_layers=2", 4, True, False), ("mat:beta=32,shallow_layers=0", 4, False, True)]
    assert rows[0]["mean_ppl"] < rows[1]["mean_ppl"]
    choices = tmp_path / "choices.csv"
    choices.write_text('calibrated_length,mat_spec\n1024,"mat:beta=8,shallow_layers=10"\n', encoding="utf-8")
    assert script.published_mat(choices) == "mat:beta=8,shallow_layers=10"
    choices.write_text("calibrated_length\n1024\n", encoding="utf-8")
    with pytest.raises(ValueError, match="mat_spec"):
        script.published_mat(choices)


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


PERPLEXITY = REGISTERED / "records" / "perplexity.jsonl.gz"


@pytest.mark.skipif(not PERPLEXITY.is_file(), reason="phase one's perplexity records are not committed")
def test_the_committed_records_rederive_mats_published_choice_and_h1s_seed_means():
    rows = list(csv.DictReader(io.StringIO((REGISTERED / "mat_selection.csv").read_text(encoding="utf-8"))))
    assert len(rows) == 15 and all(r["texts"] == "4" for r in rows)          # the 15-cell grid, 4 selection texts
    assert [r["spec"] for r in rows if r["chosen"] == "True"] == [r["spec"] for r in rows if r["published"] == "True"]
    units = _script().published_units(REGISTERED / "units.csv")
    seeds = [r for r in csv.DictReader(io.StringIO((REGISTERED / "seeds.csv").read_text(encoding="utf-8")))
             if r["claim"] == "H1"]
    assert len(seeds) == 16
    for r in seeds:
        published = units[("H1", "hashevict", "knorm:recent=10,sink=4", f"{r['text']}/{r['segment']}")]
        assert float(r["mean"]) == pytest.approx(float(published["value_a"]), rel=1e-5)   # shown to 6 digits
    boot = list(csv.DictReader(io.StringIO((REGISTERED / "bootstrap.csv").read_text(encoding="utf-8"))))
    assert [r["claim"] for r in boot] == ["L1"] * 3 + ["C1"] * 3 + ["H1", "M1"]
    assert all(r["seeds"] == "20" and r["resamples"] == "10000" and r["texts"] == "16" for r in boot)


def _verdict_script():
    return _load("registered_verdicts")


@pytest.mark.skipif(not PERPLEXITY.is_file(), reason="phase one's perplexity records are not committed")
def test_every_phase_one_verdict_recomputes_from_the_committed_records_alone(capsys):
    """docs/registered_verdicts.py on the committed records folder reproduces verdicts.csv,
    units.csv, calibration.csv, choices.csv and the page block byte for byte; only the cost
    table is the first run's (the regenerated records carry their rerun's times)."""
    script = _verdict_script()
    folder = str(REGISTERED / "records")
    assert script.main([folder, "--published-cost", "--check"]) == 0, capsys.readouterr().out
    assert script.main([folder, "--check"]) == 1
    assert sorted(line.rsplit("/", 1)[1] for line in capsys.readouterr().out.splitlines()
                  if line.startswith("differs:")) == ["run.csv", "run.inc"]


def test_the_verdict_script_reads_a_committed_records_folder(tmp_path, capsys):
    script = _verdict_script()
    records = [{"key": f"k{i}", "params": {"i": i}, "result": {}} for i in range(3)]
    (tmp_path / "geometry.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps(r) + "\n" for r in records[:2]).encode()))
    (tmp_path / "passkey-calibration.jsonl").write_text(json.dumps(records[0]) + "\n", encoding="utf-8")
    (tmp_path / "passkey-test.jsonl").write_text(json.dumps(records[2]) + "\n", encoding="utf-8")
    assert [r["key"] for r in script.experiment_records(tmp_path, "geometry")] == ["k0", "k1"]
    assert [r["key"] for r in script.experiment_records(tmp_path, "passkey")] == ["k0", "k2"]
    assert script.experiment_records(tmp_path, "perplexity") == []
    (tmp_path / "geometry.jsonl").write_text(json.dumps(records[2]) + "\n", encoding="utf-8")
    assert [r["key"] for r in script.experiment_records(tmp_path, "geometry")] == ["k2"]   # the run's own file first
    with pytest.raises(SystemExit) as exit_:
        script.main([str(tmp_path), "--published-cost", "--check", "--out", str(tmp_path / "none")])
    assert exit_.value.code == 2 and "--published-cost" in capsys.readouterr().err


def test_the_verdict_script_names_a_record_without_a_field_the_rule_reads(tmp_path, capsys):
    records = _perplexity_records(5)
    del records[3]["result"]["ppl"]
    (tmp_path / "perplexity.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps(r) + "\n" for r in records).encode()))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        _verdict_script().main([str(tmp_path), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "lacks or mistypes a field" in err and "Traceback" not in err
    assert not out.exists()


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
