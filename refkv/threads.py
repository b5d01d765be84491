"""How many BLAS threads to use: measured, not assumed.

refkv's matrices are small (SmolLM2-135M: ``d_model = 576``, ``d_ff = 1536``), so a
multi-threaded BLAS gains little on them, and on a machine whose cores are busy with
other work it loses badly: OpenBLAS's threads spin waiting for each other, and a prompt
that takes 2 s on one thread took 15-35 s with the default two threads on a loaded
2-core machine. On an idle larger machine, on the other hand, several threads do speed
up the prompt's block matrix products.

So :func:`choose_threads` measures. It times the matrix products of one decoder layer
at this model's sizes -- a block of :data:`BLOCK_ROWS` tokens and :data:`DECODE_ROWS`
single-token steps, the two shapes a run spends its time in -- with one thread and with
each candidate count up to the usable cores, interleaved, :data:`REPEATS` runs each, and
compares their **mean** times. It picks more than one thread only if that was at least
:data:`MARGIN` faster than one thread, so the choice is never slower than one thread by
more than the measurement's noise. The measurement takes a fraction of a second on an
idle machine, about a second on a busy one.

Why the mean and not the fastest run: with another process busy on one of two cores,
two BLAS threads usually run as fast as on an idle machine, but now and then one of
them loses its core for a scheduler time slice and the other waits for it. The fastest
of a few runs misses those stalls (it picked two threads, 1.9 times slower than one over
a real prompt, in ``bench/contention.py``); the mean counts them at the rate a long
prompt meets them (measured: 1 thread 7-14 ms, 2 threads 22-28 ms per run). Even the
mean of a second's runs can miss them, so first, where the system reports it (Linux's
``/proc/stat``), :func:`idle_cores` counts the cores other processes leave idle over
:data:`IDLE_WINDOW` seconds, and no more threads than those are candidates.

``requested`` (the CLI's ``--threads N``) skips the measurement. Nothing here changes the
process's thread count by itself: :func:`blas_threads` applies a choice for a ``with``
block (through :mod:`threadpoolctl`), and the thread count outside it is left as it was.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from .validation import check_int, shown

__all__ = [
    "BLOCK_ROWS",
    "DECODE_ROWS",
    "IDLE_FRACTION",
    "IDLE_WINDOW",
    "MARGIN",
    "MAX_THREADS",
    "REPEATS",
    "ThreadChoice",
    "blas_threads",
    "check_threads",
    "choose_threads",
    "idle_cores",
    "usable_cores",
]

#: Rows of the block product timed (a typical prompt block ``B``).
BLOCK_ROWS = 32
#: Single-row (decoding) products timed per block product.
DECODE_ROWS = 4
#: Timed runs per candidate, interleaved; their mean counts (see the module notes).
REPEATS = 20
#: More threads are chosen only when they are at least this much faster than one.
MARGIN = 0.1
#: Seconds over which :func:`idle_cores` watches the machine.
IDLE_WINDOW = 0.1
#: A core counts as idle when others leave at least this fraction of it unused.
IDLE_FRACTION = 0.75


@dataclass(frozen=True)
class ThreadChoice:
    """A BLAS thread count and why it was chosen.

    Attributes
    ----------
    n : int
        Threads to use (``>= 1``).
    reason : str
        One short phrase for the statistics line, e.g. ``"measured: 1 thread 4.1 ms,
        2 threads 6.3 ms"`` or ``"--threads"``.
    """

    n: int
    reason: str


#: Most BLAS threads ever asked for (a documented bound, checked before any C call sees the
#: number; the BLAS may allow fewer, which :func:`check_threads` finds out and says).
MAX_THREADS = 1024


def check_threads(name: str, n) -> int:
    """A thread count in ``[1, MAX_THREADS]`` that this machine's BLAS really runs.

    OpenBLAS silently caps the count at the maximum it was built for (64 is common): a
    larger request is refused, naming that maximum, instead of being reported as used.
    """
    n = check_int(name, n, 1)
    most = _blas_max_threads(min(n, MAX_THREADS))  # never more than MAX_THREADS reaches the C library
    high = MAX_THREADS if most is None else min(most, MAX_THREADS)
    if n > high:
        raise ValueError(f"{name} must be an integer in [1, {high}] (the most threads this machine's BLAS "
                         f"runs), got {shown(n)}")
    return n


def _blas_max_threads(n: int) -> int | None:
    """The thread count the BLAS reports after being asked for ``n`` (None without a BLAS pool)."""
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        return None
    with threadpool_limits(limits=n, user_api="blas"):
        counts = [info["num_threads"] for info in threadpool_info() if info.get("user_api") == "blas"]
    return min(counts) if counts else None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _read_proc_stat() -> str | None:
    """The first line of ``/proc/stat`` (all CPUs' times), or None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            return stat.readline()
    except OSError:
        return None


def _cpu_times() -> tuple[float, float] | None:
    """(idle, total) jiffies of all CPUs from ``/proc/stat``'s ``cpu`` line, or None.

    The line is ``cpu user nice system idle iowait irq softirq steal guest guest_nice``;
    guest time is already counted in user and nice, so the total is the first eight.
    """
    line = _read_proc_stat()
    try:
        fields = [float(x) for x in (line or "").split()[1:9]]  # user .. steal
    except ValueError:
        return None
    if len(fields) < 5 or not all(math.isfinite(x) and x >= 0 for x in fields):
        return None  # not the counters of a real /proc/stat (nan, inf, negative): no measurement
    return fields[3] + fields[4], sum(fields)  # idle + iowait, all


def idle_cores(window: float = IDLE_WINDOW) -> float | None:
    """Cores left idle by every other process over ``window`` seconds (this one sleeps).

    From the change in ``/proc/stat``'s idle time, scaled to the usable cores; ``None``
    where the system has no ``/proc/stat`` (macOS, Windows).
    """
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(window)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return None
    idle_share = (after[0] - before[0]) / (after[1] - before[1])
    if not 0.0 <= idle_share <= 1.0:
        return None
    return idle_share * min(usable_cores(), os.cpu_count() or 1)


def _blas_controllable() -> bool:
    from threadpoolctl import threadpool_info

    return any(info.get("user_api") == "blas" for info in threadpool_info())


@contextlib.contextmanager
def blas_threads(n: int):
    """Run the ``with`` block with ``n`` BLAS threads, then restore the previous count.

    Parameters
    ----------
    n : int
        Thread count, ``>= 1``.

    Examples
    --------
    >>> import numpy as np
    >>> from refkv.threads import blas_threads
    >>> with blas_threads(1):
    ...     product = np.ones((64, 64)) @ np.ones((64, 64))
    >>> float(product[0, 0])
    64.0
    """
    from threadpoolctl import threadpool_limits

    n = check_int("threads", n, 1, MAX_THREADS)
    with threadpool_limits(limits=n, user_api="blas"):
        yield


def _layer_weights(config, rng) -> list[np.ndarray]:
    """Random matrices of one decoder layer's shapes (q, k, v, o, gate, up, down) in float32."""
    d, h, hkv, dh, ff = config.d_model, config.n_heads, config.n_kv_heads, config.d_head, config.d_ff
    shapes = [(d, h * dh + 2 * hkv * dh), (h * dh, d), (d, 2 * ff), (ff, d)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _one_layer(x: np.ndarray, weights: list[np.ndarray]) -> None:
    qkv, out, gate_up, down = weights
    y = x @ qkv                              # (rows, (H + 2 Hkv) dh)
    x = y[:, :out.shape[0]] @ out            # (rows, d)
    z = x @ gate_up                          # (rows, 2 d_ff)
    z[:, :down.shape[0]] @ down              # (rows, d)


def _time_workload(n: int, block: np.ndarray, row: np.ndarray, weights) -> float:
    with blas_threads(n):
        start = time.perf_counter()
        _one_layer(block, weights)
        for _ in range(DECODE_ROWS):
            _one_layer(row, weights)
        return time.perf_counter() - start


def _candidates(cores: int) -> list[int]:
    counts, n = [1], 2
    while n < cores:
        counts.append(n)
        n *= 2
    if cores > 1:
        counts.append(cores)
    return counts


def choose_threads(config, *, requested: int | None = None) -> ThreadChoice:
    """The BLAS thread count fastest for ``config``'s matrix sizes on this machine, now.

    Parameters
    ----------
    config : ModelConfig
        The model whose layer shapes are timed (``d_model``, heads, ``d_ff``).
    requested : int or None
        A thread count the user asked for (``--threads N``); returned as is, unmeasured.

    Returns
    -------
    ThreadChoice

    Examples
    --------
    >>> import refkv
    >>> from refkv.threads import choose_threads
    >>> choice = choose_threads(refkv.load("tiny").config)
    >>> choice.n >= 1
    True
    >>> choose_threads(refkv.load("tiny").config, requested=3)
    ThreadChoice(n=3, reason='--threads')
    """
    if requested is not None:
        return ThreadChoice(check_threads("--threads", requested), "--threads")
    cores = usable_cores()
    if cores == 1:
        return ThreadChoice(1, "1 usable core")
    if not _blas_controllable():
        return ThreadChoice(1, "no BLAS thread pool found")
    rng = np.random.default_rng(0)
    weights = _layer_weights(config, rng)
    block = rng.standard_normal((BLOCK_ROWS, config.d_model)).astype(np.float32)
    row = block[:1].copy()
    idle = idle_cores()
    if idle is not None:  # threads beyond the idle cores would share a core with other work
        free = max(1, int(idle + (1.0 - IDLE_FRACTION)))
        if free == 1:
            return ThreadChoice(1, f"{idle:.1f} idle cores of {cores}")
        cores = min(cores, free)
    candidates = _candidates(cores)
    total = {n: 0.0 for n in candidates}
    for n in candidates:  # warm-up: the first call at a new count starts its threads
        _time_workload(n, block, row, weights)
    for _ in range(REPEATS):  # interleaved, so a burst of load hits every candidate alike
        for n in candidates:
            total[n] += _time_workload(n, block, row, weights)
    mean = {n: t / REPEATS for n, t in total.items()}
    fastest = min(candidates, key=lambda n: (mean[n], n))
    chosen = fastest if mean[fastest] <= (1.0 - MARGIN) * mean[1] else 1
    times = ", ".join(f"{n}: {mean[n] * 1e3:.1f} ms" for n in candidates)
    return ThreadChoice(chosen, f"measured, mean of {REPEATS} ({times})")
