"""Prefill with 1 and 2 BLAS threads, on a quiet machine and with one core kept busy.

A multi-threaded BLAS splits each matrix product between its threads and waits for the
slowest; when another process holds one of the cores, the thread that shares it runs
only part of the time and the whole product waits for it. So the thread count that is
best on an idle machine can be many times slower on a busy one. This measures it on the
real model (SmolLM2-135M, float32): a ``--tokens`` prompt (default 512) in blocks of
``--block`` (default 128), with 1 and with 2 threads (threadpoolctl), in two conditions:

* **as is**: nothing added (the machine's own load, printed);
* **one core busy**: a second process spins a pure-Python loop for the whole measurement
  (it is started here and stopped at the end).

Runs are interleaved (1 thread, 2 threads, again) and the table gives medians. When
:mod:`refkv.threads` exists (the CLI's thread choice), the script also asks
:func:`refkv.threads.choose_threads` under each condition what it would pick and how far
that is from the better of the two measured counts (the target: within 10%); when the
module is missing, that column says so.

Run ``python bench/contention.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, rst_table, write_json

CONDITIONS = ("as is", "one core busy")
THREADS = (1, 2)
BUSY_LOOP = "while True:\n    pass\n"


@contextmanager
def busy_core(active: bool):
    """Keep one core busy with a spinning child process while the block runs (if ``active``)."""
    if not active:
        yield None
        return
    spinner = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        time.sleep(0.5)  # let it get scheduled
        yield spinner.pid
    finally:
        spinner.terminate()  # only the process started above
        spinner.wait(timeout=10)


def thread_chooser():
    """``refkv.threads.choose_threads``, or None with the reason when the module is absent."""
    try:
        from refkv.threads import choose_threads
    except ImportError as error:
        return None, f"refkv.threads is not in this checkout ({error}); no thread-choice column"
    return choose_threads, ""


def prefill_seconds(model, prompt, block: int, threads: int) -> float:
    from threadpoolctl import threadpool_limits

    from refkv.engine import Engine

    with threadpool_limits(limits=threads, user_api="blas"):
        engine = Engine(model)
        start = time.perf_counter()
        engine.prefill(prompt, block)
        return time.perf_counter() - start


def measure(model, prompt, block: int, repeats: int, conditions=CONDITIONS) -> dict:
    """Median prefill seconds per (condition, threads), and the thread choice under each condition."""
    choose, note = thread_chooser()
    out = {"note": note, "conditions": {}}
    for condition in conditions:
        with busy_core(condition == "one core busy"):
            loads = [os.getloadavg()[0]]
            choice = None
            if choose is not None:
                picked = choose(model.config)
                choice = {"n": picked.n, "reason": picked.reason}
            prefill_seconds(model, prompt[:block], block, 2)  # warm up both pools
            times = {n: [] for n in THREADS}
            for _ in range(repeats):
                for n in THREADS:  # interleaved
                    times[n].append(prefill_seconds(model, prompt, block, n))
                    loads.append(os.getloadavg()[0])
        medians = {n: statistics.median(t) for n, t in times.items()}
        out["conditions"][condition] = {"seconds": times, "median_seconds": medians, "choice": choice,
                                        "load_average": [min(loads), max(loads)]}
    return out


def report(result: dict, tokens: int) -> str:
    rows = []
    for condition, c in result["conditions"].items():
        med = c["median_seconds"]
        best = min(med.values())
        if c["choice"] is None:
            choice = "n/a (no refkv.threads)"
        else:
            n = c["choice"]["n"]
            if n in med:
                choice = f"{n} thread(s): {med[n] / best:.2f} x the best"
            else:
                choice = f"{n} thread(s) (not measured here)"
        rows.append([condition, f"{c['load_average'][0]:.2f}-{c['load_average'][1]:.2f}",
                     f"{med[1]:.2f} s ({tokens / med[1]:.0f} tok/s)", f"{med[2]:.2f} s ({tokens / med[2]:.0f} tok/s)",
                     f"{med[2] / med[1]:.2f}", choice])
    return rst_table(["condition", "load average", "1 thread", "2 threads", "2 threads / 1 thread",
                      "choose_threads picks"], rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or GGUF path (default smollm2)")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--block", type=int, default=128, help="prompt block size (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--out", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    for name in ("tokens", "block", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    from refkv.model import english_prose, load_with_tokenizer

    model, tokenizer = load_with_tokenizer(args.model, dtype=np.float32)
    prompt = tokenizer.encode(english_prose(6 * args.tokens))[:args.tokens]
    if len(prompt) < args.tokens:
        parser.error(f"only {len(prompt)} prose tokens available")
    result = measure(model, prompt, args.block, args.repeats)
    info = machine()
    print(f"{args.model} float32, prefill of {len(prompt)} tokens in blocks of {args.block}; medians of "
          f"{args.repeats} interleaved runs; {info['cpus']} CPUs, {info['blas']}")
    print(report(result, len(prompt)))
    if result["note"]:
        print(result["note"])
    if args.out:
        write_json(args.out, {"machine": info, "args": vars(args), **result})
    return result


if __name__ == "__main__":
    main()
