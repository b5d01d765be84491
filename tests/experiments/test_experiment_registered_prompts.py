"""The registered per-prompt claims (A1, G1, G2, S1): their grids, their comparisons, and the
per-unit table from which the verdict table is recomputed."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from refkv.experiments import attention_loss, geometry
from refkv.experiments.perplexity import registered_texts
from refkv.experiments.registered import (
    Comparison,
    attention_loss_comparisons,
    comparisons_from_units,
    geometry_comparisons,
    unit_rows,
    verdict_rows,
)
from refkv.experiments.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
REGISTRATION = json.loads((ROOT / "docs" / "experiment_registration.json").read_text(encoding="utf-8"))


def test_the_registered_attention_loss_grid_is_the_registered_one():
    """A1: the 16 verdict texts' first 512 tokens, HashEvict (3 seeds), L2 and H2O token by
    token at N = 256; nothing of the default grid."""
    grid = attention_loss.cells(Settings(registered=True, model="smollm2"))
    assert {c["kind"] for c in grid} == {"step_loss"}
    assert len(grid) == 16 * 5
    assert {(c["text"], c["segment"]) for c in grid} == set(registered_texts("verdict"))
    assert {c["policy"] for c in grid} == {"hashevict:seed=0", "hashevict:seed=1", "hashevict:seed=2", "knorm", "h2o"}
    assert {(c["length"], c["text_length"], c["budget"], c["block"], c["design"]) for c in grid} == {
        (512, 1024, 256, 1, "registered")}


def test_the_registered_geometry_grid_is_the_registered_one():
    grid = geometry.cells(Settings(registered=True, model="smollm2"))
    by_kind = {kind: [c for c in grid if c["kind"] == kind] for kind in ("cosine", "hamming", "retention")}
    assert len(grid) == 16 + 16 + 16 * 5
    texts = set(registered_texts("verdict"))
    for kind, cells in by_kind.items():
        assert {(c["text"], c["segment"]) for c in cells} == texts, kind
    assert {(c["length"], c["text_length"]) for c in by_kind["cosine"] + by_kind["hamming"]} == {(512, 1024)}
    assert {tuple(c["bits"]) for c in by_kind["hamming"]} == {(8, 32)}
    assert {(c["length"], c["budget"], c["block"]) for c in by_kind["retention"]} == {(1024, 256, 128)}
    assert {c["policy"] for c in by_kind["retention"]} == {"keydiff", "snapkv", "tova", "h2o", "sink"}


@pytest.mark.parametrize("experiment", [attention_loss, geometry])
def test_the_registered_grids_refuse_other_axes(experiment):
    with pytest.raises(ValueError, match="fixed by the registered design"):
        experiment.cells(Settings(registered=True, model="tiny", policies=("sink",)))


def test_a_registered_prompt_is_the_start_of_its_perplexity_text():
    from refkv.experiments.text import cell_tokens, prose_tokens

    params = {"model": "tiny", "dtype": "float32", "length": 40, "text_length": 100, "segment": 2,
              "text": "kjv_narrative"}
    tokens = cell_tokens(params)
    assert np.array_equal(tokens, prose_tokens("tiny", "float32", 100, 2, "kjv_narrative")[:40])
    with pytest.raises(ValueError, match="text_length must be >= length"):
        cell_tokens({**params, "text_length": 20})


def _run(experiment, settings):
    """Every registered cell run for real (tiny model), as the runner records them."""
    return [{"params": c, "result": experiment.run_cell(c)} for c in experiment.cells(settings)]


def test_registered_cells_run_into_the_registered_comparisons(tmp_path):
    """On the tiny model with 48-token texts (prompts of 48 tokens, N = 24), every cell
    runs and the records become A1's two, G1's one, S1's one and G2's four comparisons on
    all 16 prompts, which the registered rule turns into verdict rows."""
    settings = Settings(registered=True, model="tiny", options={"text_length": 48})
    steps = [c for c in attention_loss.cells(settings)]
    assert {(c["length"], c["budget"]) for c in steps} == {(48, 24)}
    records = _run(attention_loss, settings)
    a1 = attention_loss_comparisons(records)
    assert [(c.claim, c.a, c.b) for c in a1] == [("A1", "hashevict", "knorm"), ("A1", "h2o", "hashevict")]
    assert all(len(c.a_values) == 16 and np.all(np.isfinite(c.a_values)) for c in a1)
    # HashEvict's per-prompt value is the mean of its three seeds, and B's mean loss is the reference.
    first = records[0]["params"]
    seeds = [r["result"]["mean_loss"] for r in records if r["params"]["policy"].startswith("hashevict")
             and (r["params"]["text"], r["params"]["segment"]) == (first["text"], first["segment"])]
    assert len(seeds) == 3 and a1[0].a_values[0] == pytest.approx(np.mean(seeds))
    assert a1[0].reference == pytest.approx(np.mean(a1[0].b_values))
    # The summary tables count the 16 prompts (two sources share segment numbers).
    attention_loss.summarise(records, tmp_path, settings)
    import csv

    with open(tmp_path / "step_loss.csv", newline="", encoding="utf-8") as f:
        assert {row["prompts"] for row in csv.DictReader(f)} == {"16"}

    records = _run(geometry, settings)
    g = geometry_comparisons(records)
    assert [(c.claim, c.a, c.b) for c in g] == [
        ("G1", "spearman", None), ("S1", "bits=32", "bits=8"), ("G2", "keydiff", "snapkv"),
        ("G2", "keydiff", "tova"), ("G2", "keydiff", "h2o"), ("G2", "keydiff", "sink")]
    assert all(len(c.a_values) == 16 for c in g)
    cosine = next(r for r in records if r["params"]["kind"] == "cosine")
    assert g[0].a_values[0] == pytest.approx(-np.nanmean(cosine["result"]["common_queries"]["spearman"]))
    rows = verdict_rows(REGISTRATION, a1 + g)
    assert [r["claim"] for r in rows] == ["A1", "A1", "G1", "G2", "G2", "G2", "G2", "S1"]
    assert all(r["n"] == 16 and r["unit"] == "prompts" for r in rows)


def _records(kind, policy, values, **extra):
    texts = registered_texts("verdict")
    return [{"params": {"design": "registered", "kind": kind, "text": t, "segment": s, **(
        {"policy": policy} if policy else {}), **extra}, "result": value}
            for (t, s), value in zip(texts, values)]


def test_a1_against_the_paper_and_in_order():
    """H2O < HashEvict < L2 by construction on 16 prompts: both hold; HashEvict's paper effect
    is -(1 - 0.0336 / 0.0340) x L2's mean loss, H2O's -(1 - 0.0139 / 0.0336) x HashEvict's."""
    rng = np.random.default_rng(1)
    base = rng.uniform(0.05, 0.1, 16)
    records = []
    for seed in range(3):
        records += _records("step_loss", f"hashevict:seed={seed}",
                            [{"mean_loss": float(x)} for x in base + 0.01 + 0.001 * seed])
    records += _records("step_loss", "knorm", [{"mean_loss": float(x)} for x in base + 0.03])
    records += _records("step_loss", "h2o", [{"mean_loss": float(x)} for x in base - 0.02 + rng.normal(0, 1e-3, 16)])
    rows = verdict_rows(REGISTRATION, attention_loss_comparisons(records))
    assert [r["verdict"] for r in rows] == ["holds", "holds"]
    assert rows[0]["estimate"] == pytest.approx(-0.019)
    assert rows[0]["paper_effect"] == pytest.approx(-(1 - 0.0336 / 0.0340) * np.mean(base + 0.03))
    assert rows[1]["paper_effect"] == pytest.approx(-(1 - 0.0139 / 0.0336) * np.mean(base + 0.011))
    assert rows[0]["versus_paper"] == "larger than the paper"


def test_a_prompt_missing_on_one_side_is_left_out_of_the_pair():
    records = _records("retention", "keydiff", [{"log_volume": [[1.0, 2.0]]}] * 16)
    records += _records("retention", "sink", [{"log_volume": [[0.0, 1.0]]}] * 15)
    (g2,) = geometry_comparisons(records)
    assert (g2.claim, g2.b, len(g2.a_values)) == ("G2", "sink", 15)
    assert g2.labels[-1] == "pydoc_prose/7"           # kjv_narrative/7, the 16th, is missing


def test_the_unit_table_gives_back_the_same_verdicts():
    """verdict_rows on the comparisons read back from the per-unit table (strings, as in the
    CSV) equals verdict_rows on the original comparisons, digit for digit, for every kind of
    claim: binary (P1), perplexity with its reference (L1), a loss ratio (A1), one sample (G1)."""
    rng = np.random.default_rng(2)
    full = rng.uniform(10, 20, 16)
    comparisons = [
        Comparison("P1", "keydiff", "snapkv", rng.random(60) < 0.7, rng.random(60) < 0.4, "prompts",
                   labels=tuple(f"sample {i}" for i in range(60))),
        Comparison("L1", "keydiff", "tova", full + rng.uniform(1, 3, 16), full + rng.uniform(1, 2, 16), "texts",
                   None, tuple(f"t/{i}" for i in range(16)), full),
        Comparison("A1", "hashevict", "knorm", rng.uniform(0, 0.1, 16), rng.uniform(0, 0.1, 16), "prompts"),
        Comparison("G1", "spearman", None, rng.normal(-0.1, 0.1, 16), None, "prompts"),
    ]
    comparisons[1] = Comparison(**{**comparisons[1].__dict__,
                                   "reference": float(np.mean(comparisons[1].b_values - full))})
    comparisons[2] = Comparison(**{**comparisons[2].__dict__, "reference": float(np.mean(comparisons[2].b_values))})
    rows = [{k: ("" if v is None else v) for k, v in row.items()} for row in unit_rows(comparisons)]
    back = comparisons_from_units(rows, REGISTRATION)
    assert verdict_rows(REGISTRATION, back) == verdict_rows(REGISTRATION, comparisons)


def test_the_published_verdicts_follow_from_the_published_units(tmp_path):
    """The committed verdict table is exactly what the registered rule computes from the
    committed per-unit table (both written by docs/registered_verdicts.py from the records)."""
    import csv

    from refkv.experiments.tables import write_csv

    folder = ROOT / "docs" / "_static" / "experiments" / "registered"
    if not (folder / "units.csv").exists():
        pytest.skip("the registered run's tables are not published yet")
    with open(folder / "units.csv", newline="", encoding="utf-8") as f:
        units = list(csv.DictReader(f))
    rows = verdict_rows(REGISTRATION, comparisons_from_units(units, REGISTRATION))
    published = (folder / "verdicts.csv").read_text(encoding="utf-8")
    recomputed = write_csv(tmp_path / "verdicts.csv", rows, published.splitlines()[0].split(","))
    assert recomputed.read_text(encoding="utf-8") == published


def _verdicts_script():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("registered_verdicts", ROOT / "docs" / "registered_verdicts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["registered_verdicts"] = module
    spec.loader.exec_module(module)
    return module


def test_the_page_blocks_follow_from_the_published_csvs():
    """The results page's included blocks are what docs/registered_verdicts.py writes from
    the committed CSVs (before the run is published, they say so)."""
    module = _verdicts_script()
    folder = ROOT / "docs" / "_static" / "experiments" / "registered"
    assert (folder / "verdicts.inc").read_text(encoding="utf-8") == module.verdict_block(folder, REGISTRATION)
    assert (folder / "run.inc").read_text(encoding="utf-8") == module.run_block(folder)


def test_the_verdict_block_shows_every_registered_column(tmp_path):
    """From a verdict table: one plain-words line per registered claim (the ones not run
    say so) and one table row per comparison with its hypothesis, n in prompts or texts,
    estimate, interval, Holm-adjusted p, paper effect, larger/smaller/consistent and verdict."""
    from refkv.experiments.tables import write_csv

    module = _verdicts_script()
    rng = np.random.default_rng(3)
    full = rng.uniform(10, 20, 16)
    comparisons = [
        Comparison("P1", "keydiff", "snapkv", np.arange(60) < 50, np.arange(60) < 10, "prompts"),
        Comparison("L1", "keydiff", "tova", full + 3 + rng.normal(0, 0.1, 16), full + 1, "texts", 1.0),
        Comparison("G1", "spearman", None, rng.normal(0.0, 0.1, 16), None, "prompts"),
    ]
    rows = verdict_rows(REGISTRATION, comparisons)
    write_csv(tmp_path / "verdicts.csv", rows, module.COLUMNS)
    text = module.verdict_block(tmp_path, REGISTRATION)
    assert "(M1): not run." in text and "(P1): **holds** (KeyDiff - SnapKV +0.667" in text
    # P1's and L1's paper numbers are on another task or metric: no larger/smaller label (issue 35)
    assert "larger than the paper" not in text and "not comparable" in text
    assert "(L1): **reversed** (KeyDiff - TOVA +2" in text
    table = text[text.index(".. list-table::"):]
    assert table.count("   * - ") == 1 + len(rows)
    for needle in ("KeyDiff - SnapKV > 0", "60 prompts", "16 texts", "< 0.0001", "not comparable",
                   "Spearman rho < 0", "n/a", "not resolved"):
        assert needle in table, needle
    assert module.verdict_block(tmp_path / "nothing", REGISTRATION).startswith("The registered run's verdicts are not")


def test_a_passkey_comparison_at_the_floor_is_not_testable(tmp_path):
    """A passkey comparison whose two sides answer fewer than 10% of prompts on average is
    shown 'not testable (floor)' on the page (issue 35), whatever the registered rule said."""
    from refkv.experiments.registered import UNIT_COLUMNS, unit_rows
    from refkv.experiments.tables import write_csv

    module = _verdicts_script()
    comparisons = [Comparison("P1", "keydiff", "snapkv", np.arange(60) < 4, np.zeros(60, bool), "prompts"),
                   Comparison("P1", "keydiff", "tova", np.arange(60) < 30, np.arange(60) < 5, "prompts")]
    write_csv(tmp_path / "verdicts.csv", verdict_rows(REGISTRATION, comparisons), module.COLUMNS)
    write_csv(tmp_path / "units.csv", unit_rows(comparisons), UNIT_COLUMNS)
    text = module.verdict_block(tmp_path, REGISTRATION)
    # 4/60 and 0/60: mean 0.033 < 0.1 -> floor; 30/60 and 5/60: mean 0.29 -> tested (holds)
    assert "**not testable (floor)** (KeyDiff - SnapKV" in text and "**holds** (KeyDiff - TOVA" in text


def test_the_run_block_reads_calibration_choices_and_cost(tmp_path):
    from refkv.experiments.tables import write_csv

    module = _verdicts_script()
    write_csv(tmp_path / "calibration.csv", [{"length": 512, "correct": 60, "prompts": 60, "chosen": False},
                                             {"length": 1024, "correct": 58, "prompts": 60, "chosen": True}])
    write_csv(tmp_path / "choices.csv", [{"calibrated_length": 1024, "mat_spec": "mat:beta=16,shallow_layers=2"}])
    write_csv(tmp_path / "run.csv", [{"experiment": "passkey", "cells": 720, "core_minutes": 70.5,
                                      "wall_minutes": 36.0}])
    text = module.run_block(tmp_path)
    assert "60/60 at 512 tokens, 58/60 at 1,024 tokens" in text and "**L = 1,024**" in text
    assert "``mat:beta=16,shallow_layers=2``" in text and "   * - passkey\n     - 720\n     - 70.5" in text


def test_the_run_wall_time_counts_only_while_a_cell_runs():
    # The passkey calibration and its test phase ran hours apart: the pause is not the run's time.
    module = _verdicts_script()
    assert module._busy_seconds([(0.0, 10.0), (5.0, 12.0), (20.0, 25.0)]) == 17.0  # overlap counted once
    assert module._busy_seconds([(0.0, 10.0), (2.0, 3.0)]) == 10.0                # nested
    assert module._busy_seconds([]) == 0.0


def test_the_verdict_figure_is_drawn_from_the_verdict_table(tmp_path):
    """docs/registered_verdicts.py draws every comparison of verdicts.csv, one panel per claim."""
    import shutil

    module = _verdicts_script()
    folder = ROOT / "docs" / "_static" / "experiments" / "registered"
    rows = module._read(folder / "verdicts.csv")
    assert (folder / "verdicts.svg").exists() == bool(rows)
    if not rows:
        return
    shutil.copy(folder / "verdicts.csv", tmp_path / "verdicts.csv")
    svg = module.draw_verdicts(tmp_path).read_text(encoding="utf-8")
    for claim in {r["claim"] for r in rows}:
        assert f"{claim}: " in svg, claim
    assert svg.count("<g id=\"axes_") >= len({r["claim"] for r in rows})
    assert module.draw_verdicts(tmp_path / "nothing") is None
