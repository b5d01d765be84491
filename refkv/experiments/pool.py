"""Where an experiment's cells run: this process, local worker processes, or any executor.

* **Parallel = serial.** ``jobs > 1`` runs cells in that many local processes
  (``spawn``, each with the BLAS threads it is given, one by default, so ``jobs``
  processes use ``jobs`` cores). Every cell is a pure function of its parameters (all
  randomness is seeded from them), so parallel and serial runs give the same results; only
  the order of the records and the wall times differ.
* **No orphans.** Workers die with their parent: the kernel kills them when it dies
  (Linux ``PR_SET_PDEATHSIG``), and a watch thread in each waits on the pipe only the
  parent holds open and checks the parent's pid, so a ``kill`` or ``kill -9`` of the run
  leaves nobody computing for nobody.
* **One writer.** Whatever runs the cells (local processes or a Dask cluster,
  :mod:`refkv.experiments.cluster`), the results come back to this process, which hands
  each to a ``finish`` callback (the runner appends the record and advances the bar).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
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


#: Seconds between a worker's checks that its parent still runs (the fallback of the watch).
WATCH_INTERVAL = 0.5
#: ``prctl`` option: the signal the kernel sends this process when its parent dies (Linux).
PR_SET_PDEATHSIG = 1


def _death_signal() -> bool:
    """Ask the kernel (Linux) to SIGKILL this process the moment its parent dies; whether it took.

    ``prctl(PR_SET_PDEATHSIG)`` is delivered when the thread that started this process
    ends; :func:`run_parallel` starts its workers from the thread that waits for them, so
    that is the run itself. Elsewhere (macOS, a libc without ``prctl``) it returns False
    and the watch thread alone ends the worker.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_with_parent() -> None:
    """Worker initializer: end this process as soon as its parent dies, however it died.

    Three guards, each enough on its own where it applies: the kernel's parent-death
    signal (:func:`_death_signal`, Linux: SIGKILL when the parent dies, even in the middle
    of a C call that holds the GIL); a daemon thread waiting on the read end of a pipe
    whose write end only the parent holds (:func:`multiprocessing.parent_process`'s
    sentinel: readable when the parent is gone); and, every :data:`WATCH_INTERVAL`
    seconds, the parent's pid (a worker whose parent died is re-parented, so ``getppid``
    changes) in case another process inherited the pipe. A parent that died before this
    initializer ran is caught at once by the pid check.
    """
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None and parent.pid else os.getppid()
    _death_signal()
    if os.getppid() != parent_pid:  # the parent died while this worker started
        os._exit(1)
    sentinel = None if parent is None else parent.sentinel

    def watch() -> None:
        while True:
            if sentinel is not None:
                if wait_ready([sentinel], timeout=WATCH_INTERVAL):
                    os._exit(1)
            else:
                time.sleep(WATCH_INTERVAL)
            if os.getppid() != parent_pid:
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

