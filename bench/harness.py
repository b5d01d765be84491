"""Small helpers shared by the benchmark scripts in ``bench/``: timing, memory, fits, tables.

Benchmarks are plain scripts (``python bench/policies.py``), never timed tests; this module
holds the pieces they share so each script reads as the experiment it runs. The pure
helpers (:func:`growth_exponent`, :func:`rst_table`, :func:`write_json`) have a correctness
test in ``tests/test_bench_harness.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence

import numpy as np

from refkv.files import atomic_write

#: Environment variables that set the BLAS thread count (recorded with every result: on a
#: busy machine a multi-threaded BLAS can be many times slower than a single thread).
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

__all__ = ["THREAD_VARIABLES", "growth_exponent", "machine", "median_time", "peak_extra_bytes", "rst_table",
           "write_json"]


def median_time(fn: Callable[[], object], repeats: int = 5, min_sample: float = 0.02) -> float:
    """Median wall time of one call of ``fn``, in seconds.

    ``fn`` is called once to warm up, then timed in ``repeats`` samples; each sample loops
    over enough calls to last at least ``min_sample`` seconds (so sub-millisecond calls are
    not dominated by the clock's resolution) and is divided by the number of calls. The
    median of the samples resists the outliers a shared machine produces.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    loops = max(1, math.ceil(min_sample / first)) if first > 0 else 1000
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak memory ``fn`` allocates on top of what exists before the call, in bytes.

    Measured with :mod:`tracemalloc`, which sees NumPy's array buffers (NumPy reports them
    to it) as well as Python objects. The result of ``fn`` is dropped before returning,
    but it counts in the peak: an attention matrix a policy materialises is part of its
    cost.
    """
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
        del result
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return max(0, peak - before)


def growth_exponent(sizes: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of ``log(value)`` against ``log(size)``: ``p`` in ``value ~ size^p``.

    Linear cost gives 1, quadratic 2. Needs at least two distinct sizes and positive values.
    """
    x = np.log(np.asarray(sizes, dtype=np.float64))
    y = np.asarray(values, dtype=np.float64)
    if x.shape != y.shape or x.size < 2 or np.ptp(x) == 0:
        raise ValueError(f"need at least two distinct sizes, one value each; got {len(sizes)} sizes "
                         f"and {len(values)} values")
    if not np.all(y > 0):
        raise ValueError("values must be positive to fit a power law")
    y = np.log(y)
    dx = x - x.mean()
    return float(np.sum(dx * (y - y.mean())) / np.sum(dx * dx))


def rst_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A reStructuredText grid table (valid in Sphinx and readable in a terminal).

    Every cell is converted with ``str``; columns are as wide as their widest cell. A cell
    that reStructuredText would read as a bullet list (``-``, ``* x``) gets a backslash.
    """
    cells = [[_cell(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    if any(len(row) != len(headers) for row in cells):
        raise ValueError("every row must have one cell per header")
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(char: str) -> str:
        return "+" + "+".join(char * (w + 2) for w in widths) + "+"

    def text(row: Sequence[str]) -> str:
        return "|" + "|".join(f" {c:<{w}} " for c, w in zip(row, widths)) + "|"

    out = [line("-"), text(cells[0]), line("=")]
    for row in cells[1:]:
        out += [text(row), line("-")]
    return "\n".join(out)


def _cell(value: object) -> str:
    text = str(value)
    bullet = text[:1] in ("-", "*", "+") and text[1:2] in ("", " ")
    return "\\" + text if bullet else text


def write_json(path: str | os.PathLike, data: object) -> None:
    """Write ``data`` as JSON atomically (:func:`refkv.files.atomic_write`)."""
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def positive_ints(text: str) -> list[int]:
    """``argparse`` type of a comma-separated list of integers >= 1 (e.g. prompt lengths)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be an integer >= 1, got {text!r}")
    return values


def finish(results: dict, report: Callable[[dict], str], out: str | None) -> dict:
    """End a benchmark run: note the machine again (load may have changed), print the
    tables, and save the results as JSON when ``out`` is given."""
    results["machine_after"] = machine()
    print()
    print(report(results))
    if out:
        write_json(out, results)
    return results


def machine() -> dict:
    """What the figures depend on: CPU count, load, Python, NumPy and its BLAS."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy: no dict mode
        blas = "unknown"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    threads = {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ}
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in load],
            "python": platform.python_version(), "numpy": np.__version__, "blas": blas,
            "processor": platform.processor() or platform.machine(), "thread_variables": threads}
