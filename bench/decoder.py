"""Speed of the decoder on the real model: prefill and decode tokens/s next to the machine's GEMM rate.

Runs SmolLM2-135M-Instruct (float32) through the engine with no eviction:

* **prefill**: a ``--prompt-tokens`` prompt (default 2,048, real English prose from
  :func:`refkv.model.english_prose`) in blocks of ``--block`` (default 128);
* **decode**: ``--decode-tokens`` greedy steps (``B = 1``) after that prompt.

Next to each rate it prints the FLOPs per second the run achieved and their ratio to
the fp32 matrix-multiply rate measured in the same run (a square ``np.matmul`` of
``--gemm-size``). The FLOP count is the useful work of a forward pass: ``2 m n k`` for
every projection of every token, ``4 d`` per (query head, visible key) pair for
attention (``q k`` and ``a v``), and the LM head of the last token of each block (the
engine computes no other logits). Masked-out future keys inside a block are not
counted, though block attention computes them, so the ratio is conservative. The
target is a prefill ratio of at least 0.5 for a 2,048-token prompt.

``--phases`` also times each part of a layer (q/k/v, attention, output projection,
MLP) and the LM head during prefill, by wrapping the model's methods.

Run ``python bench/decoder.py`` (about a minute on 2 cores). Figures depend on the load
of the machine: a multi-threaded BLAS on a busy machine can be many times slower, so
the table prints the load average, and ``OPENBLAS_NUM_THREADS=1`` is worth comparing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, rst_table, write_json

import refkv.engine as engine_module
from refkv.engine import Engine
from refkv.model import english_prose, load_with_tokenizer


def gemm_rate(n: int, repeats: int) -> float:
    """Best fp32 FLOP/s of an ``n x n`` by ``n x n`` matmul over ``repeats`` runs."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up threads and caches
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2.0 * n ** 3 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def layer_flops(cfg, queries: int, keys_seen: int) -> float:
    """FLOPs of one layer for ``queries`` tokens that together see ``keys_seen`` (query, key) pairs."""
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    dense = 2.0 * queries * (cfg.d_model * (q + 2 * kv) + q * cfg.d_model + 3 * cfg.d_model * cfg.d_ff)
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


def decode_flops(cfg, prompt: int, steps: int) -> float:
    """FLOPs of ``steps`` single-token steps after a ``prompt``-token prefix."""
    return sum(cfg.n_layers * layer_flops(cfg, 1, prompt + i + 1) + 2.0 * cfg.d_model * cfg.vocab_size
               for i in range(steps))


class Phases:
    """Wall time spent in each model method while active (wraps the bound methods)."""

    def __init__(self, model):
        self.model, self.seconds = model, defaultdict(float)
        self._saved = {}

    def __enter__(self):
        for name in ("qkv", "attn_out", "mlp", "head"):
            self._saved[name] = getattr(self.model, name)
            setattr(self.model, name, self._timed(name, self._saved[name]))
        self._saved["attend"] = engine_module.attend
        engine_module.attend = self._timed("attention", engine_module.attend)
        return self

    def __exit__(self, *exc):
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or GGUF path (default smollm2)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--block", type=int, default=128, help="B for the prompt (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the best is kept")
    parser.add_argument("--gemm-size", type=int, default=2048)
    parser.add_argument("--phases", action="store_true", help="also time the parts of a layer")
    parser.add_argument("--out", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    for name in ("prompt_tokens", "block", "decode_tokens", "repeats", "gemm_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    start = time.perf_counter()
    model, tokenizer = load_with_tokenizer(args.model, dtype=np.float32)
    load_seconds = time.perf_counter() - start
    cfg = model.config
    text = english_prose(6 * args.prompt_tokens)
    prompt = tokenizer.encode(text)[:args.prompt_tokens]
    if len(prompt) < args.prompt_tokens:
        parser.error(f"only {len(prompt)} prose tokens available")

    gemm = gemm_rate(args.gemm_size, args.repeats)

    prefill_times, decode_times = [], []
    for _ in range(args.repeats):
        engine = Engine(model)
        start = time.perf_counter()
        logits = engine.prefill(prompt, args.block)
        middle = time.perf_counter()
        engine.generate(logits, args.decode_tokens)  # no stop ids: exactly decode_tokens tokens
        prefill_times.append(middle - start)
        decode_times.append(time.perf_counter() - middle)
    t_prefill, t_decode = min(prefill_times), min(decode_times)
    # generate() runs decode_tokens - 1 forward steps: the first token comes from the prefill logits.
    steps = args.decode_tokens - 1
    f_prefill = prefill_flops(cfg, len(prompt), args.block)
    f_decode = decode_flops(cfg, len(prompt), steps)

    rows = [
        ["fp32 GEMM", f"{args.gemm_size}^3 matmul", "", f"{gemm / 1e9:.1f}", "1.00"],
        ["prefill", f"T={len(prompt)}, B={args.block}", f"{len(prompt) / t_prefill:.0f}",
         f"{f_prefill / t_prefill / 1e9:.1f}", f"{f_prefill / t_prefill / gemm:.2f}"],
        ["decode", f"B=1 after {len(prompt) + 1}", f"{steps / t_decode:.1f}" if steps else "-",
         f"{f_decode / t_decode / 1e9:.1f}" if steps else "-", f"{f_decode / t_decode / gemm:.2f}" if steps else "-"],
    ]
    info = machine()
    print(f"model {cfg.name} ({model.dtype}), loaded in {load_seconds:.1f} s; best of {args.repeats}; "
          f"{info['cpus']} CPUs, load average {info['load_average']}, {info['blas']}, "
          f"threads {info['thread_variables'] or 'default'}")
    print(rst_table(["run", "shape", "tokens/s", "GFLOP/s", "ratio to GEMM"], rows))
    result = {"machine": info, "load_seconds": load_seconds, "gemm_flops": gemm, "prompt_tokens": len(prompt),
              "block": args.block, "prefill_seconds": prefill_times, "decode_seconds": decode_times,
              "decode_steps": steps, "prefill_flops": f_prefill, "decode_flops": f_decode}

    if args.phases:
        engine = Engine(model)
        with Phases(model) as phases:
            total = _seconds(lambda: engine.prefill(prompt, args.block))
        other = total - sum(phases.seconds.values())
        parts = [*sorted(phases.seconds.items(), key=lambda kv: -kv[1]), ("rest (engine, cache, RoPE)", other)]
        print()
        print(rst_table(["prefill phase", "seconds", "share"],
                        [[k, f"{v:.2f}", f"{v / total:.0%}"] for k, v in parts]))
        result["phases"] = dict(parts)
    if args.out:
        write_json(args.out, result)
    print(f"\nprefill runs (s): {', '.join(f'{t:.2f}' for t in prefill_times)}; "
          f"median {statistics.median(prefill_times):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
