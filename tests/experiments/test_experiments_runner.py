"""The experiment runner: records, resume, interruption, parallel = serial, progress, CLI."""

import csv
import io
import json

import numpy as np
import pytest

from refkv.cli import main
from refkv.experiments import registry, runner
from refkv.experiments.design import Experiment
from refkv.experiments.progress import Progress
from refkv.experiments.records import append_record, cell_key, cut_partial_tail, read_records
from refkv.experiments.settings import Settings
from refkv.experiments.tables import write_csv

CALLS: list[int] = []


def _toy_cells(settings):
    n = 3 if settings.quick else 6
    return [{"x": i, "seed": settings.seed} for i in range(n)]


def _toy_run(params):
    CALLS.append(params["x"])
    if params["x"] == FAIL_AT.get("x"):
        raise RuntimeError("interrupted")
    rng = np.random.default_rng([params["seed"], params["x"]])
    return {"square": params["x"] ** 2, "draw": float(rng.random())}


def _toy_summary(records, folder, settings):
    return [write_csv(folder / "toy.csv", [{"x": r["params"]["x"], **r["result"]} for r in records])]


FAIL_AT: dict = {}
TOY = Experiment(name="toy", title="toy", cells=_toy_cells, run=_toy_run, summarise=_toy_summary,
                 cost=lambda p: 1.0 + p["x"])
registry.register_experiment(TOY)


@pytest.fixture(autouse=True)
def _reset():
    CALLS.clear()
    FAIL_AT.clear()


def _lines(path):
    return path.read_text().splitlines()


def test_each_record_has_every_parameter_versions_and_times(tmp_path):
    from refkv import __version__

    runner.run(TOY, Settings(quick=True, seed=3), out=tmp_path, stream=io.StringIO())
    records = read_records(tmp_path / "toy.jsonl")
    assert len(records) == 3
    for r in records:
        assert r["experiment"] == "toy"
        assert r["params"]["seed"] == 3
        assert r["key"] == cell_key(r["params"])
        assert r["result"]["square"] == r["params"]["x"] ** 2
        assert r["refkv_version"] == __version__ and r["numpy_version"] == np.__version__
        assert r["wall_time_s"] >= 0 and r["cpu_time_s"] >= 0
    assert (tmp_path / "toy" / "toy.csv").read_text().startswith("x,draw,square")


def test_rerun_skips_finished_cells(tmp_path):
    runner.run(TOY, Settings(quick=True), out=tmp_path, stream=io.StringIO())
    assert sorted(CALLS) == [0, 1, 2]
    CALLS.clear()
    runner.run(TOY, Settings(quick=True), out=tmp_path, stream=io.StringIO())
    assert CALLS == []
    # The larger grid shares its first three cells with the quick one.
    out = io.StringIO()
    records = runner.run(TOY, Settings(quick=False), out=tmp_path, stream=out)
    assert sorted(CALLS) == [3, 4, 5]
    assert "3 cells already finished" in out.getvalue()
    assert [r["params"]["x"] for r in records["toy"]] == [0, 1, 2, 3, 4, 5]
    assert len(_lines(tmp_path / "toy.jsonl")) == 6


def test_an_interrupted_run_keeps_every_finished_cell(tmp_path):
    FAIL_AT["x"] = 2  # cells run most expensive first: 5, 4, 3, then 2 fails
    with pytest.raises(RuntimeError, match="interrupted"):
        runner.run(TOY, Settings(), out=tmp_path, stream=io.StringIO())
    assert sorted(r["params"]["x"] for r in read_records(tmp_path / "toy.jsonl")) == [3, 4, 5]
    FAIL_AT.clear()
    CALLS.clear()
    runner.run(TOY, Settings(), out=tmp_path, stream=io.StringIO())
    assert sorted(CALLS) == [0, 1, 2]


def test_a_partial_last_line_is_ignored_then_cut_before_appending(tmp_path):
    path = tmp_path / "toy.jsonl"
    runner.run(TOY, Settings(quick=True), out=tmp_path, stream=io.StringIO())
    whole = path.read_bytes()
    torn = json.dumps({"key": cell_key({"x": 3, "seed": 0}), "result": {"square": 9}}).encode()[:25]
    path.write_bytes(whole + torn)  # a run killed in the middle of writing cell 3
    assert len(read_records(path)) == 3
    CALLS.clear()
    runner.run(TOY, Settings(), out=tmp_path, stream=io.StringIO())
    assert sorted(CALLS) == [3, 4, 5]
    lines = _lines(path)
    assert len(lines) == 6 and all(json.loads(line)["key"] for line in lines)


def test_cut_partial_tail_keeps_complete_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"key": "a"}\n{"key": "b"}\n{"ke')
    cut_partial_tail(path)
    assert path.read_bytes() == b'{"key": "a"}\n{"key": "b"}\n'
    cut_partial_tail(path)  # nothing more to cut
    assert path.read_bytes() == b'{"key": "a"}\n{"key": "b"}\n'
    path.write_bytes(b'{"ke')
    cut_partial_tail(path)
    assert path.read_bytes() == b""


def test_read_records_skips_a_corrupt_middle_line_with_a_warning_and_last_duplicate_wins(tmp_path):
    path = tmp_path / "r.jsonl"
    append_record(path, {"key": "a", "result": {"v": 1}})
    with open(path, "ab") as f:
        f.write(b"not json\n")
    append_record(path, {"key": "a", "result": {"v": 2}})
    with pytest.warns(UserWarning, match="unreadable"):
        records = read_records(path)
    assert records == [{"key": "a", "result": {"v": 2}}]
    assert read_records(tmp_path / "missing.jsonl") == []


def test_cell_key_is_canonical():
    assert cell_key({"b": 1, "a": [1, None]}) == cell_key({"a": [1, None], "b": 1}) == '{"a":[1,null],"b":1}'
    with pytest.raises(ValueError):
        cell_key({"a": float("nan")})


def test_parallel_jobs_give_the_same_records_as_serial(tmp_path):
    from refkv.experiments.registry import get_experiment

    experiments = [get_experiment("passkey"), get_experiment("perplexity")]
    settings = Settings(quick=True, model="tiny", dtype="float64")
    serial = runner.run(experiments, settings, out=tmp_path / "serial", jobs=1, summarise=False,
                        stream=io.StringIO())
    parallel = runner.run(experiments, settings, out=tmp_path / "parallel", jobs=2, summarise=False,
                          stream=io.StringIO())
    for name in ("passkey", "perplexity"):
        assert len(serial[name]) == len(parallel[name]) > 0
        a = {r["key"]: r["result"] for r in serial[name]}
        b = {r["key"]: r["result"] for r in parallel[name]}
        assert a == b


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_eta_is_weighted_by_cost():
    clock, out = _Clock(), io.StringIO()
    bar = Progress(3, 10.0, stream=out, width=10, clock=clock)
    assert bar.eta() is None
    clock.now += 20.0
    bar.advance(2.0, "first")  # 2 of 10 cost units in 20 s -> 80 s to go
    assert bar.eta() == pytest.approx(80.0)
    assert out.getvalue() == "[##........] 1/3 cells 0m20s elapsed, ETA 1m20s  first\n"
    clock.now += 60.0
    bar.advance(8.0)
    assert bar.eta() == pytest.approx(0.0)
    assert out.getvalue().splitlines()[-1].startswith("[##########] 2/3 cells 1m20s elapsed, ETA 0m00s")


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="dtype"):
        Settings(dtype="float16")
    with pytest.raises(ValueError, match="budgets"):
        Settings(budgets=(0,))
    with pytest.raises(ValueError, match="seed"):
        Settings(seed=-1)
    with pytest.raises(ValueError, match="jobs"):
        runner.run(TOY, Settings(), out="unused", jobs=0)


def test_cli_runs_resumes_and_reports(tmp_path, capsys):
    out = tmp_path / "res"
    args = ["experiment", "perplexity", "--quick", "--model", "tiny", "--out", str(out),
            "--policies", "sink", "--budgets", "40", "none"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "perplexity: 3 cells" in text and "wall time" in text
    table = (out / "perplexity" / "ppl.csv").read_text().splitlines()
    assert table[0].startswith("policy,label,configuration,budget,block,peak_cache_tokens,ppl,delta_ppl,gap,gap_low")
    rows = {(r["policy"], r["budget"]): r for r in csv.DictReader(table)}
    sink = rows[("sink", "40")]
    assert sink["label"] == "sink (StreamingLLM)" and sink["configuration"].startswith("sink=4")
    assert float(sink["gap_low"]) <= float(sink["gap"]) <= float(sink["gap_high"])
    assert sink["tokens"] == "191" and sink["peak_cache_tokens"] == "56"   # N + B with B = 16
    # No eviction (budget none): the gap is exactly 0 with a zero-width interval.
    assert float(rows[("sink", "")]["gap_low"]) == float(rows[("sink", "")]["gap_high"]) == 0.0
    # A budget of 'none' with an evicting policy never evicts: the same perplexity as no eviction.
    records = read_records(out / "perplexity.jsonl")
    ppl = {(r["params"]["policy"], r["params"]["budget"]): r["result"]["ppl"] for r in records}
    assert ppl[("sink", None)] == ppl[("full", None)]
    assert main([*args, "--dry-run"]) == 0
    assert "0 cells to run, 3 finished" in capsys.readouterr().err
    # A rerun has nothing to compute; --publish copies the tables and plots.
    assert main([*args, "--publish", str(tmp_path / "pub")]) == 0
    assert (tmp_path / "pub" / "perplexity" / "ppl.csv").read_text() == "\n".join(table) + "\n"
    assert not list((tmp_path / "pub").rglob("*.jsonl"))


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["experiment", "passkey", "--quick", "--model", "tiny", "--budgets", "0",
                 "--out", str(tmp_path)]) == 2
    assert "integer >= 1" in capsys.readouterr().err
    assert main(["experiment", "passkey", "--quick", "--model", "tiny", "--policies", "nope",
                 "--out", str(tmp_path)]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["experiment", "nonexistent"])


def test_results_page_commands_and_files_exist():
    """Every ``refkv experiment`` command on the results page parses; every file it shows exists."""
    import re
    import shlex
    from pathlib import Path

    from refkv.cli import build_parser

    docs = Path(__file__).resolve().parents[2] / "docs"
    page = (docs / "guide" / "experiments.rst").read_text(encoding="utf-8")
    commands = re.findall(r"(?:\$ |``)(refkv experiment [^`#\n]*)", page)
    assert len(commands) >= 6
    for command in commands:
        build_parser().parse_args(shlex.split(command)[1:])  # SystemExit on an unknown option
    files = re.findall(r"(?::file:|\.\. image::|\.\. figure::|\.\. rounded-csv::) \.\./(_static/\S+)", page)
    files += re.findall(r":download:`[^<`]*<\.\./(_static/[^>]+)>`", page)
    assert len(files) >= 15
    for name in files:
        assert (docs / name).is_file(), name


def test_summaries_write_tables_without_matplotlib(tmp_path, monkeypatch):
    """Plots are optional (the ``plot`` extra): without matplotlib the CSV tables are still written."""
    from refkv.experiments import plots
    from refkv.experiments.registry import get_experiment

    monkeypatch.setattr(plots, "available", lambda: False)
    runner.run(get_experiment("perplexity"), Settings(quick=True, model="tiny"), out=tmp_path, stream=io.StringIO())
    written = sorted(p.name for p in (tmp_path / "perplexity").iterdir())
    assert written == ["ppl.csv", "ppl_pairs.csv"]


@pytest.mark.slow
def test_dask_local_cluster_gives_the_same_records_as_serial(tmp_path):
    """The quick grid (tiny model) on a Dask LocalCluster: the same records as a serial run,
    byte for byte in everything but the timings, host facts and finishing times."""
    pytest.importorskip("distributed", reason="Dask sweeps need the sweeps extra")
    from refkv.experiments.cluster import dask_executor
    from refkv.experiments.registry import get_experiment

    experiments = [get_experiment("passkey"), get_experiment("perplexity")]
    settings = Settings(quick=True, model="tiny", dtype="float64")
    serial = runner.run(experiments, settings, out=tmp_path / "serial", jobs=1, summarise=False,
                        stream=io.StringIO())
    with dask_executor("local", n_workers=2) as executor:
        dask = runner.run(experiments, settings, out=tmp_path / "dask", summarise=False, stream=io.StringIO(),
                          executor=executor)
    varying = {"wall_time_s", "cpu_time_s", "finished_utc"}
    for name in ("passkey", "perplexity"):
        assert len(serial[name]) == len(dask[name]) > 0

        def canonical(records):
            return sorted(json.dumps({k: v for k, v in r.items() if k not in varying}, sort_keys=True)
                          for r in records)

        assert canonical(serial[name]) == canonical(dask[name])
    # A resumed run on the same folder finds every cell finished and submits nothing.
    with dask_executor("local", n_workers=1) as executor:
        out = io.StringIO()
        runner.run(experiments, settings, out=tmp_path / "dask", summarise=False, stream=out, executor=executor)
    assert "0 to run" in out.getvalue()


@pytest.mark.parametrize("bad", ["", "localhost:8786", "http://x:1", 3])
def test_scheduler_address_is_checked(bad):
    from refkv.experiments.cluster import check_scheduler

    with pytest.raises(ValueError, match="scheduler must be 'local' or a Dask scheduler address"):
        check_scheduler(bad)


def test_cli_scheduler_error_exits_2(tmp_path, capsys):
    code = main(["experiment", "passkey", "--quick", "--model", "tiny", "--scheduler", "nowhere",
                 "--out", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "scheduler must be" in err and "Traceback" not in err


def test_cli_full_grid_and_sample_size_options(tmp_path, capsys):
    out = str(tmp_path / "res")
    assert main(["experiment", "perplexity", "--full", "--model", "tiny", "--dry-run", "--out", out]) == 0
    lines = capsys.readouterr().out.splitlines()
    texts = {(p["text"], p["segment"]) for p in (json.loads(line.split("\t")[2]) for line in lines)}
    assert len(texts) == 8 and {t for t, _ in texts} == {"pydoc_prose", "kjv_narrative"}  # 8 texts, 2 sources
    args = ["experiment", "perplexity", "--model", "tiny", "--dry-run", "--out", out, "--policies", "sink",
            "--budgets", "40", "--texts", "3", "--text-length", "100"]
    assert main(args) == 0
    cells = [json.loads(line.split("\t")[2]) for line in capsys.readouterr().out.splitlines()]
    assert len({(c["text"], c["segment"]) for c in cells}) == 3 and {c["length"] for c in cells} == {100}
    assert main(["experiment", "passkey", "--quick", "--full", "--model", "tiny", "--dry-run", "--out", out]) == 2
    assert "error: quick and full are exclusive" in capsys.readouterr().err
