"""The exploratory kept-set overlap experiment: the Jaccard arithmetic, its anchors, a tiny run."""

import csv
import io

import pytest

from refkv.cli import main
from refkv.experiments import overlap, runner
from refkv.experiments.registry import get_experiment, suite
from refkv.experiments.settings import Settings


def test_jaccard_by_hand():
    # {0,1,2,3} and {2,3,4,5}: 2 shared of 6 distinct.
    assert overlap.jaccard([0, 1, 2, 3], [2, 3, 4, 5]) == pytest.approx(2 / 6)
    assert overlap.jaccard([7], [8]) == 0.0
    assert overlap.jaccard([], []) == 1.0
    # Two layers of two heads: (1 + 1/3) / 2 and (0 + 1) / 2 -> mean 7/12.
    a = [[[0, 1], [0, 1, 2, 3]], [[5], [9, 10]]]
    b = [[[1, 0], [2, 3, 4, 5]], [[6], [10, 9]]]
    assert overlap.mean_jaccard(a, b) == pytest.approx((1 + 1 / 3 + 0 + 1) / 4)
    with pytest.raises(ValueError, match="same layers and heads"):
        overlap.mean_jaccard(a, b[:1])


def _cell(policy, budget, block=16):
    params = {"model": "tiny", "dtype": "float64", "seed": 0, "length": 64, "segment": 0, "policy": policy,
              "budget": budget, "block": block}
    return overlap.run_cell(params)


def test_a_policy_agrees_with_itself_and_the_full_cache_holds_n_of_t():
    sink, knorm = _cell("sink", 24)["kept"], _cell("knorm", 24)["kept"]
    full = _cell("full", None)
    assert full["tokens"] == 64 and all(row == list(range(64)) for layer in full["kept"] for row in layer)
    assert overlap.mean_jaccard(sink, sink) == 1.0
    assert all(len(row) == 24 for layer in sink for row in layer)
    assert overlap.mean_jaccard(full["kept"], knorm) == pytest.approx(24 / 64)   # N / T, every layer and head
    # The sink keeps the first 4 and the most recent 20; the L2 policy keeps the smallest key norms:
    # they agree on some tokens, not all.
    assert 0 < overlap.mean_jaccard(sink, knorm) < 1


def test_overlap_is_declared_and_left_out_of_all():
    experiment = get_experiment("overlap")
    assert experiment.exploratory and experiment not in suite()
    assert [o.flag for o in experiment.options] == ["--overlap-prompts"]
    with pytest.raises(ValueError, match="no registered design"):
        overlap.cells(Settings(registered=True, model="tiny"))
    grid = overlap.cells(Settings(quick=True, model="tiny", options={"overlap_prompts": 2}))
    assert {c["segment"] for c in grid} == {0, 1} and len(grid) == 2 * 3


def test_a_tiny_run_writes_one_row_per_pair(tmp_path, capsys):
    assert main(["experiment", "overlap", "--quick", "--model", "tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "overlap.csv" in printed and "jaccard" in printed
    with open(tmp_path / "overlap" / "overlap.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy_a"], r["policy_b"]) for r in rows] == [("sink", "knorm"), ("sink", "keydiff"),
                                                               ("knorm", "keydiff")]
    assert all(0 <= float(r["jaccard"]) <= 1 and r["prompts"] == "1" for r in rows)
    # The summary is a function of the records: rerunning reads them back and writes the same table.
    before = (tmp_path / "overlap" / "overlap.csv").read_bytes()
    runner.run(get_experiment("overlap"), Settings(quick=True, model="tiny"), out=tmp_path, stream=io.StringIO())
    assert (tmp_path / "overlap" / "overlap.csv").read_bytes() == before
