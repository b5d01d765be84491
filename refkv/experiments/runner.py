"""Running an experiment grid: plan the cells still to run, run them, record, summarise.

An *experiment* (:class:`~refkv.experiments.design.Experiment`) is three functions:
``cells(settings)`` lists the grid as plain parameter dicts, ``run(params)`` computes one
cell's result, and ``summarise(records, folder, settings)`` turns the finished records into
CSV tables and plots. :func:`run` connects them:

* **Records** (:mod:`refkv.experiments.records`): one JSON line per finished cell in
  ``OUT/<experiment>.jsonl``, durable before the next cell is reported done.
* **Resumable.** :func:`plan` reads the file and skips every cell whose key is already
  there; the most expensive cells are started first so a pool stays busy.
* **Where cells run** (:mod:`refkv.experiments.pool`): this process, ``jobs`` local
  processes, or any executor (a Dask cluster's); only this process writes records.
* **Published files.** Tables and plots are written to a temporary file in the same
  folder and renamed over the old one, so a run killed during the summary leaves each
  file either as it was or complete.
* **Progress** (:class:`~refkv.experiments.progress.Progress`): a bar with ETA on stderr,
  weighted by each cell's estimated cost.

Notes
-----
Two grids that share a cell share its record: a ``--quick`` run and the default run may
use the same output folder. Summaries only read the records of the current grid
(:func:`grid_records`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..files import OutputFolder, check_write_target
from ..validation import check_int
from .design import Experiment
from .pool import drain, run_cell, run_parallel
from .progress import Progress
from .records import append_record, cell_key, cut_partial_tail, locked, make_record, read_records
from .registry import check_options
from .settings import Settings

__all__ = ["Task", "grid_records", "plan", "run"]


@dataclass(frozen=True)
class Task:
    """One cell still to run: its experiment, the module of its ``run``, parameters, key,
    estimated cost and results file."""

    experiment: str
    module: str
    params: dict
    key: str
    cost: float
    path: Path


def plan(experiments: Sequence[Experiment], settings: Settings, out) -> tuple[list[Task], int]:
    """The cells still to run (most expensive first) and the number already finished.

    The settings' options are checked first (:func:`~refkv.experiments.registry.check_options`),
    so a bad value fails before any grid is listed.
    """
    check_options(settings)
    out = Path(out)
    tasks, done = [], 0
    for experiment in experiments:
        path = out / f"{experiment.name}.jsonl"
        finished = {r["key"] for r in read_records(path, experiment.check_result)}
        seen = set()
        for params in experiment.cells(settings):
            key = cell_key(params)
            if key in seen:
                continue
            seen.add(key)
            if key in finished:
                done += 1
                continue
            tasks.append(Task(experiment.name, experiment.run.__module__, params, key,
                              float(experiment.cost(params)), path))
    tasks.sort(key=lambda t: -t.cost)  # longest first: the pool's tail is short cells
    return tasks, done


def run(experiments: Iterable[Experiment] | Experiment, settings: Settings | None = None, *, out="results",
        jobs: int = 1, summarise: bool = True, stream=None, threads_per_job: int = 1,
        executor=None) -> dict[str, list[dict]]:
    """Run (or resume) experiments and write their summaries.

    Parameters
    ----------
    experiments : Experiment or iterable of Experiment
    settings : Settings, optional
    out : path
        Folder of the results: ``<name>.jsonl`` per experiment and a ``<name>/`` folder
        of tables and plots.
    jobs : int
        Worker processes; ``1`` runs in this process.
    summarise : bool
        Write tables and plots after the cells finish.
    stream : file, optional
        Where the progress bar goes (default stderr).
    threads_per_job : int
        BLAS threads of each worker process (``jobs > 1`` only).
    executor : concurrent.futures.Executor, optional
        Run the cells there instead (``jobs`` is then ignored): any executor whose
        ``submit`` returns :class:`concurrent.futures.Future` objects, e.g. a Dask cluster's
        (:func:`refkv.experiments.cluster.dask_executor`). Records, resume and progress are
        the same as a local run: only this process writes records.

    Returns
    -------
    dict of experiment name to the records of its current grid.
    """
    if isinstance(experiments, Experiment):
        experiments = [experiments]
    experiments = list(experiments)
    settings = settings or Settings()
    check_int("jobs", jobs, 1)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out must be a folder, but {out} exists and is not one")
    root = OutputFolder(out, what="--out")
    root.mkdir()
    with contextlib.ExitStack() as stack:
        for experiment in experiments:
            path = check_write_target(out / f"{experiment.name}.jsonl", out, what="results file")
            if summarise and (out / experiment.name).is_symlink():  # tables and plots go there: never through a link
                raise ValueError(f"{out / experiment.name}: the summary folder is a symlink (to "
                                 f"{os.readlink(out / experiment.name)}); refusing to write through it -- remove it "
                                 f"or use another --out")
            if summarise:
                root.path(experiment.name)  # no symlinked component on the way either
            stack.enter_context(locked(path))
            cut_partial_tail(path)
        tasks, done = plan(experiments, settings, out)
        stream = sys.stderr if stream is None else stream
        if done:
            stream.write(f"refkv experiment: {done} cells already finished in {out}, {len(tasks)} to run\n")
        progress = Progress(len(tasks), sum(t.cost for t in tasks), stream=stream)

        def finish(task: Task, result: dict, wall: float, cpu: float) -> None:
            append_record(task.path, make_record(task.experiment, task.key, task.params, result, wall, cpu))
            progress.advance(task.cost, task.experiment)

        if executor is not None:
            drain(executor, tasks, finish)
        elif jobs == 1 or len(tasks) <= 1:
            for task in tasks:
                finish(task, *run_cell(task.module, task.experiment, task.params))
        else:
            run_parallel(tasks, jobs, threads_per_job, finish)
    records = {}
    for experiment in experiments:
        records[experiment.name] = grid_records(experiment, settings, out)
        if summarise:
            # Tables and plots are written through the guarded folder: ``folder / "x.csv"``
            # is a Target that the writers (tables.write_csv, plots) write through its guards.
            root.mkdir(experiment.name)
            experiment.summarise(records[experiment.name], root.sub(experiment.name), settings)
    return records


def grid_records(experiment: Experiment, settings: Settings, out) -> list[dict]:
    """The finished records of the experiment's current grid, in grid order."""
    by_key = {r["key"]: r for r in read_records(Path(out) / f"{experiment.name}.jsonl", experiment.check_result)}
    keys = dict.fromkeys(cell_key(p) for p in experiment.cells(settings))
    return [by_key[k] for k in keys if k in by_key]
