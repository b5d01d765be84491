"""Speed of the decoder on the real model, next to the machine's limits measured in the same run.

Runs SmolLM2-135M-Instruct (float32) through the engine with no eviction:

* **prefill**: a ``--prompt-tokens`` prompt (default 2,048; ``2048,8192`` for both
  lengths), real English prose from :func:`refkv.model.english_prose`, in blocks of
  ``--block`` (default 128);
* **decode**: ``--decode-tokens`` greedy tokens (``B = 1``) after that prompt.

and, in the same run, the two limits they are held to:

* **GEMM rate**: FLOP/s of the model's own matrix products on one thread: the seven
  projections of a layer (q, k, v, o, gate, up, down) for a block of ``--block`` rows,
  each timed on its own, total FLOPs over total time. Prefill's fraction is its useful
  FLOPs per second over this rate (target >= 0.8 at 2K tokens).
* **memory bandwidth**: bytes per second of a streaming read of an array as large as the
  weights (the faster of ``np.sum`` over it and a matrix-vector product with it, one
  thread). A decoding step must read every weight once and the whole KV cache, so its
  fraction is ``(weight bytes + cache bytes) x tokens/s`` over this bandwidth (target
  >= 0.9 at 2K and 8K).

* **exp rate**: elements per second of ``np.exp`` on float32 shifted logits, one tile of
  ``(H, block, 1024)``. Softmax needs one exponential per (query head, visible key) pair
  and SiLU one per MLP activation, and NumPy computes them one element at a time in SIMD
  lanes, not at the GEMM rate. So no NumPy decoder runs faster than its FLOPs at the GEMM
  rate plus its exponentials at this rate; the **ceiling** rows give that fraction (and
  the same for decode, with bytes at the bandwidth): the target is reachable only where
  the ceiling is above it.
* **cache read rate**: bytes per second of reading a KV cache shaped like the engine's
  (every layer's keys and values, ``(Hkv, n, d)`` each, ``n`` = the prompt length) one KV
  head at a time, as attention over it must (each head meets its own queries): the cache
  comes in 0.5 MB pieces at 2K tokens, not as one stream.

The FLOP count of a forward pass is the useful work: ``2 m n k`` for every projection of
every token, ``4 d`` per (query head, visible key) pair for attention (``q k`` and
``a v``), and the LM head of the last token of each block (the engine computes no other
logits). Masked-out future keys inside a block are not counted, though block attention
computes them, so the fraction is conservative.

Repetitions are interleaved (limits, then prefill and decode, then again), each in a
fresh process that loads the model, so a burst of load on a shared machine hits every
figure alike; medians are reported. Every figure is timed twice: by wall time, and by the
process's CPU time. With one BLAS thread the CPU time is the time the process actually
ran, which on a machine shared with other work (load above the core count) is far
steadier than wall time, which also counts waiting for a core; the fractions are given
by both clocks, each against limits measured with the same clock. ``--baseline DIR`` runs another checkout of refkv
(e.g. ``git worktree add /tmp/before HEAD~3``) in alternation with this one and adds its
figures and the ratio. ``--threads`` sets the BLAS threads of everything but the
single-thread GEMM rate (default 1). ``--phases`` also splits a prefill's time into the
parts of a layer.

Run ``python bench/decoder.py`` (about two minutes on 2 cores; ``--prompt-tokens
2048,8192`` takes several more). The table prints the load average: on a busy machine
every figure drops, the fractions much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, positive_ints, rst_table, write_json

ROOT = Path(__file__).resolve().parent.parent


# -- the limits ---------------------------------------------------------------------------
def now() -> dict:
    """Both clocks: wall time and this process's CPU time (all its threads)."""
    return {"wall": time.perf_counter(), "cpu": time.process_time()}


def since(start: dict) -> dict:
    end = now()
    return {clock: end[clock] - start[clock] for clock in start}


def _best_seconds(fn, repeats: int) -> dict:
    """Shortest wall and CPU seconds of ``fn`` over ``repeats`` calls (after a warm-up)."""
    fn()  # warm up threads and caches
    best = {"wall": float("inf"), "cpu": float("inf")}
    for _ in range(repeats):
        start = now()
        fn()
        best = {clock: min(best[clock], t) for clock, t in since(start).items()}
    return best


def projection_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of a layer's seven projections: q, k, v, o, gate, up, down."""
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    return [(cfg.d_model, q), (cfg.d_model, kv), (cfg.d_model, kv), (q, cfg.d_model),
            (cfg.d_model, cfg.d_ff), (cfg.d_model, cfg.d_ff), (cfg.d_ff, cfg.d_model)]


def gemm_rate(cfg, rows: int, repeats: int = 5) -> dict:
    """Single-thread fp32 FLOP/s of the layer's projections for ``rows`` tokens, per clock.

    Total FLOPs over the total of each projection's best time.
    """
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    flops, seconds = 0.0, {"wall": 0.0, "cpu": 0.0}
    with threadpool_limits(limits=1, user_api="blas"):
        for n_in, n_out in projection_shapes(cfg):
            x = rng.standard_normal((rows, n_in), dtype=np.float32)
            w = rng.standard_normal((n_in, n_out), dtype=np.float32)
            best = _best_seconds(lambda x=x, w=w: x @ w, repeats)
            seconds = {clock: seconds[clock] + best[clock] for clock in seconds}
            flops += 2.0 * rows * n_in * n_out
    return {clock: flops / t for clock, t in seconds.items()}


def bandwidth(n_bytes: int, width: int, repeats: int = 3) -> dict:
    """Streaming-read bytes/s over a float32 array of ``n_bytes``, one thread, per clock.

    The faster of ``np.sum`` over the array and a matrix-vector product with it.
    """
    from threadpoolctl import threadpool_limits

    rows = max(1, n_bytes // (4 * width))
    a = np.ones((rows, width), dtype=np.float32)  # written once, so every page is really there
    x = np.ones(width, dtype=np.float32)
    with threadpool_limits(limits=1, user_api="blas"):
        kernels = {"sum": _best_seconds(lambda: a.sum(), repeats), "matvec": _best_seconds(lambda: a @ x, repeats)}
    return {clock: max(a.nbytes / k[clock] for k in kernels.values()) for clock in ("wall", "cpu")}


def exp_rate(cfg, block: int, repeats: int = 5) -> dict:
    """``np.exp`` elements per second on float32 logits in [-30, 0] of one (H, block, 1024) tile, per clock."""
    tile = np.random.default_rng(0).uniform(-30.0, 0.0, (cfg.n_heads, block, 1024)).astype(np.float32)
    out = np.empty_like(tile)
    best = _best_seconds(lambda: np.exp(tile, out=out), repeats)
    return {clock: tile.size / t for clock, t in best.items()}


def cache_read_rate(cfg, context: int, repeats: int = 3) -> dict:
    """Bytes/s of reading every layer's keys and values (Hkv, context, d), one KV head per ``np.sum``, per clock."""
    shape = (cfg.n_kv_heads, context, cfg.d_head)
    layers = [(np.ones(shape, np.float32), np.ones(shape, np.float32)) for _ in range(cfg.n_layers)]
    total = sum(k.nbytes + v.nbytes for k, v in layers)

    def sweep():
        for keys, values in layers:
            for head in range(cfg.n_kv_heads):
                keys[head].sum()
                values[head].sum()

    best = _best_seconds(sweep, repeats)
    return {clock: total / t for clock, t in best.items()}


# -- the work ----------------------------------------------------------------------------
def layer_flops(cfg, queries: int, keys_seen: int) -> float:
    """FLOPs of one layer for ``queries`` tokens that together see ``keys_seen`` (query, key) pairs."""
    dense = 2.0 * queries * sum(n_in * n_out for n_in, n_out in projection_shapes(cfg))
    attention = 4.0 * cfg.d_head * cfg.n_heads * keys_seen
    return dense + attention


def prefill_flops(cfg, tokens: int, block: int) -> float:
    """Useful FLOPs of block prompt processing with no eviction (causal pairs only)."""
    total = 0.0
    for start in range(0, tokens, block):
        b = min(block, tokens - start)
        pairs = b * start + b * (b + 1) // 2  # each query sees the cache and the block up to itself
        total += cfg.n_layers * layer_flops(cfg, b, pairs) + 2.0 * cfg.d_model * cfg.vocab_size
    return total


def prefill_exps(cfg, tokens: int, block: int) -> float:
    """Exponentials block prompt processing cannot avoid: one per (query head, causal pair), one per MLP activation."""
    total = 0.0
    for start in range(0, tokens, block):
        b = min(block, tokens - start)
        pairs = b * start + b * (b + 1) // 2
        total += cfg.n_layers * (cfg.n_heads * pairs + cfg.d_ff * b)
    return total


def decode_exps(cfg, context: int) -> float:
    """Exponentials of one decoding step over ``context`` cached tokens (softmax and SiLU)."""
    return float(cfg.n_layers * (cfg.n_heads * context + cfg.d_ff))


def decode_bytes(model, context: int) -> float:
    """Bytes a decoding step at ``context`` cached tokens must read: every weight once, the KV cache."""
    cfg = model.config
    weights = model_bytes(model)
    cache = 2 * cfg.n_layers * cfg.n_kv_heads * context * cfg.d_head * model.dtype.itemsize
    return float(weights + cache)


def model_bytes(model) -> int:
    """Bytes of the weights a forward step reads (the tied embedding counts once, as the LM head)."""
    w = model.weights
    arrays = [w.final_norm, w.embed if w.lm_head is None else w.lm_head]
    for lw in w.layers:
        arrays += [getattr(lw, name) for name in vars(lw)]
    return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))


class Phases:
    """Wall time spent in each model method while active (wraps the bound methods)."""

    def __init__(self, model):
        self.model, self.seconds = model, defaultdict(float)
        self._saved = {}

    def __enter__(self):
        import refkv.engine as engine_module

        for name in ("qkv", "attn_out", "mlp", "head"):
            self._saved[name] = getattr(self.model, name)
            setattr(self.model, name, self._timed(name, self._saved[name]))
        self._saved["attend"] = engine_module.attend
        engine_module.attend = self._timed("attention", engine_module.attend)
        return self

    def __exit__(self, *exc):
        import refkv.engine as engine_module

        for name in ("qkv", "attn_out", "mlp", "head"):
            delattr(self.model, name)  # back to the class's method
        engine_module.attend = self._saved["attend"]

    def _timed(self, key, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
        return wrapper


def run_model(model, prompt, block: int, decode_tokens: int, threads: int, phases: bool = False) -> dict:
    """Prefill ``prompt`` in blocks then decode greedily: seconds of each (one run)."""
    from threadpoolctl import threadpool_limits

    from refkv.engine import Engine

    engine = Engine(model)
    with threadpool_limits(limits=threads, user_api="blas"):
        if phases:
            with Phases(model) as timer:
                start = now()
                logits = engine.prefill(prompt, block)
                prefill = since(start)
            split = dict(timer.seconds)
        else:
            start = now()
            logits = engine.prefill(prompt, block)
            prefill = since(start)
        start = now()
        # generate() runs decode_tokens - 1 forward steps: the first token comes from the prefill logits.
        engine.generate(logits, decode_tokens + 1)
        decode = since(start)
    out = {"prefill_seconds": prefill, "decode_seconds": decode, "decode_steps": decode_tokens}
    if phases:  # wall seconds
        out["phases"] = {**split, "rest (engine, cache, RoPE)": prefill["wall"] - sum(split.values())}
    return out


def measure(model, prompts: dict[int, list[int]], block: int, decode_tokens: int, threads: int,
            phases: bool = False) -> dict:
    """One repetition: the limits, then prefill and decode at each prompt length."""
    cfg = model.config
    result = {"gemm_flops": gemm_rate(cfg, block), "bandwidth": bandwidth(model_bytes(model), cfg.d_model),
              "exp_rate": exp_rate(cfg, block), "load_average": list(os.getloadavg()), "lengths": {}}
    for length, prompt in prompts.items():
        run = run_model(model, prompt, block, decode_tokens, threads, phases)
        run["cache_read_rate"] = cache_read_rate(cfg, length)
        run["prefill_flops"] = prefill_flops(cfg, length, block)
        run["prefill_exps"] = prefill_exps(cfg, length, block)
        # the cache grows from length + 1 to length + decode_tokens during the timed steps
        run["decode_bytes"] = sum(decode_bytes(model, length + i + 1) for i in range(decode_tokens))
        run["decode_exps"] = sum(decode_exps(cfg, length + i + 1) for i in range(decode_tokens))
        result["lengths"][str(length)] = run
    return result


# -- one repetition in a fresh process -----------------------------------------------------
def child(spec: dict) -> dict:
    from refkv.model import english_prose, load_with_tokenizer

    model, tokenizer = load_with_tokenizer(spec["model"], dtype=np.float32)
    longest = max(spec["lengths"])
    tokens = tokenizer.encode(english_prose(6 * longest))
    if len(tokens) < longest:
        raise SystemExit(f"only {len(tokens)} prose tokens available")
    prompts = {n: tokens[:n] for n in spec["lengths"]}
    return measure(model, prompts, spec["block"], spec["decode_tokens"], spec["threads"], spec["phases"])


def run_child(tree: Path, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"a run in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the report ----------------------------------------------------------------------------
def summarise(runs: list[dict], clock: str = "cpu") -> dict:
    """Medians over repetitions of every rate and fraction, timed by ``clock`` ("cpu" or "wall").

    Each repetition's fractions use the limits measured in that repetition.
    """
    med = statistics.median
    out = {"clock": clock, "gemm_flops": med(r["gemm_flops"][clock] for r in runs),
           "bandwidth": med(r["bandwidth"][clock] for r in runs),
           "exp_rate": med(r["exp_rate"][clock] for r in runs), "lengths": {}}

    def ceiling(work: float, rate: float, exps: float, r: dict) -> float:
        """Fraction of ``rate`` reached if the work ran at it and the exponentials at the exp rate."""
        return (work / rate) / (work / rate + exps / r["exp_rate"][clock])

    for length in runs[0]["lengths"]:
        rows = [r["lengths"][length] for r in runs]
        n = int(length)
        out["lengths"][length] = {
            "prefill_ceiling": med(ceiling(x["prefill_flops"], r["gemm_flops"][clock], x["prefill_exps"], r)
                                   for x, r in zip(rows, runs)),
            "decode_ceiling": med(ceiling(x["decode_bytes"], r["bandwidth"][clock], x["decode_exps"], r)
                                  for x, r in zip(rows, runs)),
            "cache_read_gb_per_s": med(x["cache_read_rate"][clock] for x in rows) / 1e9,
            "prefill_tokens_per_s": med(n / x["prefill_seconds"][clock] for x in rows),
            "prefill_fraction": med(x["prefill_flops"] / x["prefill_seconds"][clock] / r["gemm_flops"][clock]
                                    for x, r in zip(rows, runs)),
            "decode_tokens_per_s": med(x["decode_steps"] / x["decode_seconds"][clock] for x in rows),
            "decode_fraction": med(x["decode_bytes"] / x["decode_seconds"][clock] / r["bandwidth"][clock]
                                   for x, r in zip(rows, runs)),
        }
    return out


def report(summaries: dict[str, dict], block: int) -> str:
    """One table: every figure of each checkout (by the summaries' clock), and their ratio."""
    labels = list(summaries)
    headers = ["figure"] + [f"{label}" for label in labels]
    if len(labels) == 2:
        headers.append(f"{labels[0]} / {labels[1]}")

    def row(name, values, fmt):
        cells = [name] + [fmt(v) for v in values]
        if len(values) == 2:
            cells.append(f"{values[0] / values[1]:.2f}")
        return cells

    s = [summaries[label] for label in labels]
    per = "CPU second" if s[0]["clock"] == "cpu" else "second"
    rows = [row(f"GEMM rate, 1 thread, layer shapes at M={block} (GFLOP per {per})", [x["gemm_flops"] / 1e9 for x in s],
                lambda v: f"{v:.1f}"),
            row(f"bandwidth, streaming read of the weights' size (GB per {per})", [x["bandwidth"] / 1e9 for x in s],
                lambda v: f"{v:.1f}"),
            row(f"exp rate, np.exp on float32 (G elements per {per})", [x["exp_rate"] / 1e9 for x in s],
                lambda v: f"{v:.2f}")]
    for length in s[0]["lengths"]:
        for key, name, fmt in [("prefill_tokens_per_s", f"prefill T={length} (tokens per {per})", "{:.0f}"),
                               ("prefill_fraction", f"prefill T={length}: fraction of GEMM rate", "{:.2f}"),
                               ("prefill_ceiling", f"prefill T={length}: ceiling (GEMM rate + exp rate)", "{:.2f}"),
                               ("decode_tokens_per_s", f"decode after {length} (tokens per {per})", "{:.1f}"),
                               ("decode_fraction", f"decode after {length}: fraction of bandwidth", "{:.2f}"),
                               ("decode_ceiling", f"decode after {length}: ceiling (bandwidth + exp rate)", "{:.2f}"),
                               ("cache_read_gb_per_s", f"cache of {length} read per KV head (GB per {per})", "{:.1f}")]:
            rows.append(row(name, [x["lengths"][length][key] for x in s], fmt.format))
    return rst_table(headers, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or GGUF path (default smollm2)")
    parser.add_argument("--prompt-tokens", type=positive_ints, default=[2048],
                        help="prompt length(s), comma-separated (default 2048)")
    parser.add_argument("--block", type=int, default=128, help="B for the prompt (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens timed (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; medians (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads for prefill/decode (default 1)")
    parser.add_argument("--baseline", help="another refkv checkout to run in alternation with this one")
    parser.add_argument("--phases", action="store_true", help="also time the parts of a layer")
    parser.add_argument("--out", help="write the figures as JSON to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    for name in ("block", "decode_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    trees = {"this checkout": ROOT}
    if args.baseline:
        if not (Path(args.baseline) / "refkv" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline} is not a refkv checkout (no refkv/__init__.py)")
        trees["baseline"] = Path(args.baseline).resolve()
    spec = {"model": args.model, "lengths": args.prompt_tokens, "block": args.block,
            "decode_tokens": args.decode_tokens, "threads": args.threads, "phases": args.phases}
    info = machine()
    runs = {label: [] for label in trees}
    for rep in range(args.repeats):
        for label, tree in trees.items():  # alternate: a burst of load hits both alike
            runs[label].append(run_child(tree, spec))
            print(f"repetition {rep + 1}/{args.repeats} of {label} done (load {os.getloadavg()[0]:.2f})",
                  file=sys.stderr)
    summaries = {clock: {label: summarise(r, clock) for label, r in runs.items()} for clock in ("cpu", "wall")}
    loads = [r["load_average"][0] for rs in runs.values() for r in rs]
    print(f"model {args.model} (float32), {args.threads} BLAS thread(s), blocks of {args.block}, "
          f"{args.decode_tokens} decode tokens; median of {args.repeats} interleaved repetitions; "
          f"{info['cpus']} CPUs, 1-min load average {min(loads):.2f}-{max(loads):.2f}, {info['blas']}")
    print("\nTimed by CPU time (the time the cores gave this process; with one thread, wall time on an idle "
          "machine):")
    print(report(summaries["cpu"], args.block))
    print("\nTimed by wall time (includes waiting for a core on a busy machine):")
    print(report(summaries["wall"], args.block))
    if args.phases:
        for label, rs in runs.items():
            for length in rs[0]["lengths"]:
                parts = {k: statistics.median(r["lengths"][length]["phases"][k] for r in rs)
                         for k in rs[0]["lengths"][length]["phases"]}
                total = sum(parts.values())
                print(f"\n{label}, prefill T={length}: median seconds per part")
                print(rst_table(["part", "seconds", "share"],
                                [[k, f"{v:.2f}", f"{v / total:.0%}"] for k, v in
                                 sorted(parts.items(), key=lambda kv: -kv[1])]))
    if args.out:
        write_json(args.out, {"machine": info, "spec": spec, "trees": {k: str(v) for k, v in trees.items()},
                              "runs": runs, "summaries": summaries})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
