"""Peak resident memory of block prompt processing on the real model (issue 9, part 2).

SmolLM2-135M-Instruct (float32) processes prompts of ``T`` = 2K, 4K and 8K tokens of real
English (CPython's ``pydoc_data.topics``, :func:`refkv.model.english_prose`, tokenized with
the model's own tokenizer) with a budget of ``N = 2048`` tokens per layer and KV head, in
blocks of ``B = 128`` (KeyDiff Eq. 6). The cache never holds more than ``N + B`` tokens
and nothing else grows with ``T``, so the peak should be flat in ``T``, for attention-free
policies (KeyDiff, sink) and attention-based ones (TOVA, H2O, SnapKV: their weights are
(Hkv, g, B, N + B) per layer call) alike.

Each configuration runs in a fresh subprocess, which

1. loads the model, returns the C heap's free memory to the OS (glibc ``malloc_trim``, so
   freed loading temporaries do not hide later allocations) and records its resident set
   size (``VmRSS``);
2. resets the kernel's peak-RSS mark (``/proc/self/clear_refs``, Linux >= 4.0), so the
   transient peak of dequantizing the GGUF file is not mistaken for the prompt's;
3. runs :meth:`refkv.engine.Engine.prefill` and reads
   ``resource.getrusage(RUSAGE_SELF).ru_maxrss``.

The report gives the absolute peak and the peak minus the RSS after loading. If the peak
cannot be reset (another OS), the report says so and the load peak is shown beside it.

The contrast, ``B = None`` (the whole prompt as one block, then eviction: kvpress's
one-shot setting), holds ``T`` keys per layer. Until issue 27 the attention-based
policies materialised the (Hkv, g, T, T) weights there (``9 T^2`` floats per layer call,
2.25 GiB at ``T = 8K`` in float32); now the engine forms only the rows or column sums a
policy reads, one query tile of 128 at a time (``bench/oneshot.py`` sets one-shot beside
blocks). It runs for the attention-free policies at every length and for the
attention-based ones up to ``--one-shot-max-tokens`` (default 8192); a length beyond it
gets a figure extrapolated from ``a + b T^2`` through the two longest runs, marked as
such (an overestimate now that the growth is no longer quadratic).

Run ``python bench/memory.py`` (tens of minutes on 2 cores), ``--out FILE.json`` to keep
the raw figures, ``--report A.json B.json`` to print the tables of saved runs (merged),
``--quick`` for T = 256, 512 with N = 128, B = 32.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import finish, machine, rst_table

POLICIES = ("keydiff", "sink", "tova", "h2o", "snapkv")
ATTENTION_FREE = ("keydiff", "sink")
LENGTHS = (2048, 4096, 8192)
MiB = 1024 * 1024


# -- the child: one configuration in a fresh process -------------------------------------
def _status_bytes(key: str) -> int | None:
    """A ``kB`` line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _maxrss_bytes() -> int:
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


def _trim_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc ``malloc_trim``), if available.

    Loading frees large temporaries; glibc may keep that memory in its heap, where it
    counts in the RSS and is reused silently by later allocations, hiding them. Trimming
    first makes the RSS after loading a fair baseline.
    """
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


def _reset_peak() -> bool:
    """Reset the peak-RSS mark to the current RSS (Linux's ``clear_refs`` value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def child(spec: dict) -> dict:
    import numpy as np

    from refkv.engine import Engine
    from refkv.model import load

    tokens = np.load(spec["tokens_file"])[: spec["length"]]
    if len(tokens) < spec["length"]:
        raise SystemExit(f"the token file holds {len(tokens)} tokens, fewer than {spec['length']}")
    start = time.perf_counter()
    model = load("smollm2", dtype=spec["dtype"])
    load_seconds = time.perf_counter() - start
    gc.collect()
    trimmed = _trim_heap()
    load_peak = _maxrss_bytes()
    loaded = _status_bytes("VmRSS")
    reset = _reset_peak()
    engine = Engine(model, spec["policy"], spec["budget"])
    start = time.perf_counter()
    engine.prefill(tokens, spec["block"])
    seconds = time.perf_counter() - start
    peak = _maxrss_bytes()
    return {**spec, "load_seconds": load_seconds, "load_peak_bytes": load_peak, "loaded_rss_bytes": loaded,
            "heap_trimmed": trimmed, "peak_reset": reset, "peak_bytes": peak,
            "extra_bytes": None if loaded is None else peak - loaded,
            "vm_hwm_bytes": _status_bytes("VmHWM"), "prefill_seconds": seconds,
            "tokens_per_second": spec["length"] / seconds,
            "attention_materialised": engine.stats.attention_materialised,
            "attention_calls": engine.stats.attention_calls, "peak_cache_tokens": engine.stats.peak_cache_tokens}


# -- the parent: tokens, the grid of subprocesses, the report ----------------------------
def write_tokens(path: str, length: int) -> int:
    """Tokenize enough real prose for ``length`` tokens; save them as .npy; return the count."""
    import numpy as np

    from refkv.model import english_prose
    from refkv.model.loading import model_path
    from refkv.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model_path("smollm2"))
    chars = 6 * length
    while True:
        ids = tokenizer.encode(english_prose(chars))
        if len(ids) >= length:
            break
        chars *= 2
    np.save(path, np.asarray(ids[:length], dtype=np.int64))
    return length


def run_child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        return {**spec, "error": done.stderr.strip().splitlines()[-5:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def one_shot_estimate(points: dict[int, float], length: int) -> float | None:
    """``a + b T^2`` through two measured (T, bytes) points, evaluated at ``length``."""
    if len(points) < 2:
        return None
    (t1, m1), (t2, m2) = sorted(points.items())[-2:]
    b = (m2 - m1) / (t2 * t2 - t1 * t1)
    return m1 + b * (length * length - t1 * t1)


def _mib(n_bytes) -> str:
    return "n/a" if n_bytes is None else f"{n_bytes / MiB:.0f}"


def report(results: dict) -> str:
    lengths = results["lengths"]
    rows_by = {}
    for r in results["runs"]:
        rows_by.setdefault((r["policy"], r["block"]), {}).setdefault(r["length"], []).append(r)
    out = []
    reset_everywhere = all(r.get("peak_reset") for r in results["runs"] if "error" not in r)
    if not reset_everywhere:
        out += ["WARNING: the peak-RSS mark could not be reset after loading in some runs; their "
                "peaks include the load peak.", ""]

    def k(t):
        return f"{t // 1024}K" if t % 1024 == 0 else str(t)

    for block in (results["block"], None):
        headers = ["policy", *(f"T = {k(t)}" for t in lengths), "spread of extra (max - min) / min"]
        rows = []
        for policy in results["policies"]:
            cells, extras = [], []
            for t in lengths:
                runs = [r for r in rows_by.get((policy, block), {}).get(t, []) if "error" not in r]
                if not runs:
                    estimate = results.get("one_shot_estimates", {}).get(policy) if block is None else None
                    cells.append("not run" if estimate is None else f"~{_mib(estimate)} extra (extrapolated)")
                    continue
                peak, extra = median_of(runs, "peak_bytes"), median_of(runs, "extra_bytes")
                extras.append(extra)
                cells.append(f"{_mib(peak)} ({_mib(extra)} extra)")
            spread = "n/a" if len(extras) < 2 or None in extras else \
                f"{100 * (max(extras) - min(extras)) / min(extras):.0f}%"
            rows.append([policy, *cells, spread])
        title = (f"B = {block}: peak RSS in MiB (extra over the RSS after loading)" if block is not None else
                 "B = None (one-shot prefill): peak RSS in MiB (extra over the RSS after loading)")
        out += [title, "", rst_table(headers, rows), ""]

    runs = [r for r in results["runs"] if "error" not in r]
    if runs:
        out += [f"Model loaded: RSS {_mib(median_of(runs, 'loaded_rss_bytes'))} MiB, load peak "
                f"{_mib(median_of(runs, 'load_peak_bytes'))} MiB (before the reset), "
                f"{median_of(runs, 'load_seconds'):.0f} s to load.", ""]
    errors = [r for r in results["runs"] if "error" in r]
    for r in errors:
        out.append(f"FAILED {r['policy']} T={r['length']} B={r['block']}: {' | '.join(r['error'])}")
    return "\n".join(out)


def merge_results(paths) -> dict:
    """Saved runs (``--out``) merged into one: the first file's settings, every file's runs."""
    merged = None
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        if merged is None:
            merged = results
            continue
        merged["runs"] += results["runs"]
        merged["lengths"] = sorted(set(merged["lengths"]) | set(results["lengths"]))
        merged["policies"] += [p for p in results["policies"] if p not in merged["policies"]]
    covered = {(r["policy"], r["length"]) for r in merged["runs"] if r["block"] is None and "error" not in r}
    merged["one_shot_estimates"] = {p: e for p, e in merged.get("one_shot_estimates", {}).items()
                                    if (p, max(merged["lengths"])) not in covered}
    return merged


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--budget", type=int, default=2048, help="N, tokens per layer and KV head")
    parser.add_argument("--block", type=int, default=128, help="B, tokens per block")
    parser.add_argument("--no-one-shot", action="store_true", help="skip the B = None contrast")
    parser.add_argument("--one-shot-only", action="store_true", help="run only the B = None contrast")
    parser.add_argument("--one-shot-max-tokens", type=int, default=8192,
                        help="longest prompt run with B = None for attention-based policies")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (the median is shown)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="T = 256, 512, N = 128, B = 32")
    parser.add_argument("--out", default=None, help="write the raw figures to this JSON file")
    parser.add_argument("--report", nargs="+", default=None, metavar="FILE.json",
                        help="print the tables of saved runs (from --out, merged) and exit")
    args = parser.parse_args(argv)
    if args.report:
        results = merge_results(args.report)
        print(report(results))
        return results
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return {}
    if args.quick:
        args.budget, args.block = 128, 32
        args.one_shot_max_tokens = min(args.one_shot_max_tokens, 512)
    lengths = args.lengths or ((256, 512) if args.quick else LENGTHS)
    policies = tuple(args.policies.split(","))

    grid = [] if args.one_shot_only else [(p, t, args.block) for t in lengths for p in policies]
    if not args.no_one_shot:
        grid += [(p, t, None) for t in lengths for p in policies
                 if p in ATTENTION_FREE or t <= args.one_shot_max_tokens]
    results = {"machine": machine(), "lengths": list(lengths), "policies": list(policies), "budget": args.budget,
               "block": args.block, "dtype": args.dtype, "runs": []}
    with tempfile.TemporaryDirectory() as folder:
        tokens_file = os.path.join(folder, "tokens.npy")
        write_tokens(tokens_file, max(lengths))
        for i in range(args.repeats):
            for policy, length, block in grid:
                spec = {"policy": policy, "length": length, "block": block, "budget": args.budget,
                        "dtype": args.dtype, "tokens_file": tokens_file, "repeat": i}
                run = run_child(spec, args.timeout)
                results["runs"].append(run)
                if "error" in run:
                    print(f"  {policy:8s} T={length:5d} B={block}: FAILED {run['error'][-1:]}", flush=True)
                else:
                    print(f"  {policy:8s} T={length:5d} B={block}: peak {_mib(run['peak_bytes'])} MiB, extra "
                          f"{_mib(run['extra_bytes'])} MiB, {run['tokens_per_second']:.1f} tok/s", flush=True)
    estimates = {}
    for policy in policies:
        if policy in ATTENTION_FREE:
            continue
        points = {}
        for run in results["runs"]:
            if run["policy"] == policy and run["block"] is None and "error" not in run:
                points.setdefault(run["length"], []).append(run["extra_bytes"])
        points = {t: statistics.median(v) for t, v in points.items()}
        if points and max(points) < max(lengths):
            estimates[policy] = one_shot_estimate(points, max(lengths))
    results["one_shot_estimates"] = estimates
    return finish(results, report, args.out)


if __name__ == "__main__":
    main()
