"""Experiment throughput: finished cells per core-hour, for this checkout and a baseline.

Runs a subset of the default experiment suite (``refkv experiment NAME`` with the
options given, default: ``perplexity``, ``attention_loss`` and ``geometry`` restricted to
``--policies keydiff h2o --budgets 256``: 23 cells of prompt processing, eviction and
scoring on SmolLM2 over 1,024-token prompts) with one worker and one BLAS thread, into
a fresh folder, and reads the runner's records: each cell's CPU time (``cpu_time_s``,
the cell process's own time, so other work on a shared machine inflates it far less
than wall time) is summed, and ``cells / (CPU seconds / 3600)`` is the throughput in
cells per core-hour. With ``--baseline DIR`` the same runs alternate between this
checkout and ``DIR`` (another refkv checkout), so both see the same load, and the table
gives the ratio.

Run ``python bench/throughput.py --baseline /path/to/old/checkout`` (tens of minutes on
a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, rst_table, write_json

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ("perplexity", "attention_loss", "geometry")
OPTIONS = ("--policies", "keydiff", "h2o", "--budgets", "256")


def run_suite(tree: Path, experiments, options, model: str | None) -> dict:
    """Run the experiments with ``tree``'s refkv into a fresh folder; cells and CPU seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cells = cpu = 0.0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="refkv-throughput-") as out:
        for name in experiments:
            command = [sys.executable, "-m", "refkv", "experiment", name, "--jobs", "1", "--out", out,
                       "--no-summary", *options] + (["--model", model] if model else [])
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(command)} failed in {tree}:\n{done.stderr[-2000:]}")
            for line in (Path(out) / f"{name}.jsonl").read_text().splitlines():
                record = json.loads(line)
                cells += 1
                cpu += record["cpu_time_s"]
    return {"cells": int(cells), "cpu_seconds": cpu, "wall_seconds": time.perf_counter() - start}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another refkv checkout to run in alternation with this one")
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS), help="comma-separated experiment names")
    parser.add_argument("--options", default=" ".join(OPTIONS), help="options passed to every `refkv experiment`")
    parser.add_argument("--model", help="model (default: the experiments' default)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating repetitions (default 1)")
    parser.add_argument("--out", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    trees = {"this checkout": ROOT}
    if args.baseline:
        if not (Path(args.baseline) / "refkv" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline} is not a refkv checkout (no refkv/__init__.py)")
        trees["baseline"] = Path(args.baseline).resolve()
    experiments, options = args.experiments.split(","), args.options.split()
    runs = {label: [] for label in trees}
    loads = []
    for rep in range(args.repeats):
        for label in reversed(list(trees)):  # baseline first in each round
            loads.append(os.getloadavg()[0])
            runs[label].append(run_suite(trees[label], experiments, options, args.model))
            r = runs[label][-1]
            print(f"round {rep + 1}: {label}: {r['cells']} cells, {r['cpu_seconds']:.0f} CPU s, "
                  f"{r['wall_seconds']:.0f} s wall", file=sys.stderr)
    rate = {label: statistics.median(3600 * r["cells"] / r["cpu_seconds"] for r in rs) for label, rs in runs.items()}
    rows = [[label, rs[0]["cells"], f"{statistics.median(r['cpu_seconds'] for r in rs):.0f}",
             f"{statistics.median(r['wall_seconds'] for r in rs):.0f}", f"{rate[label]:.0f}"]
            for label, rs in runs.items()]
    info = machine()
    print(f"refkv experiment {{{','.join(experiments)}}} {' '.join(options)}; 1 worker, 1 BLAS thread; "
          f"{args.repeats} round(s); {info['cpus']} CPUs, 1-min load average {min(loads):.2f}-{max(loads):.2f}")
    print(rst_table(["refkv", "cells", "CPU seconds", "wall seconds", "cells per core-hour"], rows))
    if len(rate) == 2:
        print(f"this checkout / baseline: {rate['this checkout'] / rate['baseline']:.2f}")
    result = {"machine": info, "experiments": experiments, "options": options, "runs": runs, "rate": rate,
              "load_average": loads}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
