"""Where an experiment's cells run: this process, local worker processes, or any executor.

* **Parallel = serial.** ``jobs > 1`` runs cells in that many local processes
  (``spawn``, each with the BLAS threads it is given, one by default, so ``jobs``
  processes use ``jobs`` cores). Every cell is a pure function of its parameters (all
  randomness is seeded from them), so parallel and serial runs give the same results; only
  the order of the records and the wall times differ.
* **No orphans.** Workers watch their parent (they wait on the pipe it holds open) and
  exit as soon as it dies, so a ``kill -9`` of the run leaves nobody computing for nobody.
* **One writer.** Whatever runs the cells (local processes or a Dask cluster,
  :mod:`refkv.experiments.cluster`), the results come back to this process, which hands
  each to a ``finish`` callback (the runner appends the record and advances the bar).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing.connection import wait as wait_ready

from .registry import get_experiment

__all__ = ["THREAD_VARIABLES", "drain", "run_cell", "run_parallel"]

#: Environment variables that cap the BLAS/OpenMP threads of a worker process.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

#: ``finish(task, result, wall_s, cpu_s)``: what the parent does with each finished cell.
Finish = Callable[[object, dict, float, float], None]


def run_cell(module: str, experiment_name: str, params: dict) -> tuple[dict, float, float]:
    """Worker entry point: the result of one cell, its wall time and its CPU time.

    ``module`` is the module of the experiment's ``run`` function: importing it in a fresh
    worker registers an experiment defined outside the registry's list (a test's).
    """
    importlib.import_module(module)
    experiment = get_experiment(experiment_name)
    start, cpu = time.perf_counter(), time.process_time()
    result = experiment.run(params)
    return result, time.perf_counter() - start, time.process_time() - cpu


def _exit_with_parent() -> None:
    """Worker initializer: end this process as soon as its parent dies.

    A spawned worker holds the read end of a pipe whose write end only the parent holds
    (:func:`multiprocessing.parent_process`'s sentinel); it becomes readable when the
    parent is gone, however it died. A daemon thread waits on it and exits at once, also
    in the middle of a cell (whose result nobody could record any more).
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        wait_ready([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="refkv-exit-with-parent", daemon=True).start()


@contextlib.contextmanager
def _thread_environment(threads: int):
    """Set the BLAS thread variables while spawned workers start (they read them at import)."""
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_parallel(tasks: list, jobs: int, threads: int, finish: Finish) -> None:
    """Run ``tasks`` in ``jobs`` spawned processes of ``threads`` BLAS threads each."""
    context = multiprocessing.get_context("spawn")
    # Workers start lazily, on submit, and their bootstrap imports NumPy (and with it the
    # BLAS thread pool) before any initializer runs: the variables must be set while the
    # pool lives, not only while it is constructed.
    with _thread_environment(threads):
        executor = ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_exit_with_parent)
        try:
            drain(executor, tasks, finish)
        except BaseException:  # an error, or Ctrl-C: the finished cells are recorded already
            _stop_workers(executor)  # first: shutdown() forgets the worker processes
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        executor.shutdown(wait=True)


def _stop_workers(executor: ProcessPoolExecutor) -> None:
    """End the worker processes now, in the middle of their cells.

    ``shutdown(cancel_futures=True)`` cancels only cells not yet started; the running ones
    would hold the interpreter's exit until they finish (minutes), and their results could
    not be recorded anyway. A Ctrl-C typed in a terminal reaches the workers too, but
    ``kill -INT`` of the parent alone (or a supervisor's SIGINT) does not, hence this.
    """
    terminate = getattr(executor, "terminate_workers", None)  # Python >= 3.14
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.terminate()


def drain(executor, tasks: list, finish: Finish) -> None:
    """Submit every cell to ``executor`` and ``finish`` each result here, as it finishes.

    The one loop shared by local processes and external executors (Dask): whatever runs
    the cells, only this process sees the results, so resume and the record format do not
    depend on where the cells ran. A task has the ``module``, ``experiment`` and ``params``
    of its cell. On an error the cells not yet started are cancelled.
    """
    pending = {executor.submit(run_cell, t.module, t.experiment, t.params): t for t in tasks}
    try:
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                task = pending.pop(future)
                result, wall, cpu = future.result()
                finish(task, result, wall, cpu)
    finally:
        for future in pending:
            future.cancel()

