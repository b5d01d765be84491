"""refkv against PyTorch's transformers on the same model, side by side in one run.

Both run SmolLM2-135M-Instruct in float32 from the same GGUF file: refkv loads it, and a
``transformers.LlamaForCausalLM`` is built from a config matching its metadata and given
refkv's dequantized weights (no download; the construction that
``tests/model/test_conformance_hf.py`` checks for equal logits). Each implementation, in the
same regime,

* **prefills** a prompt of real English prose (:func:`refkv.model.english_prose`),
  ``one-shot`` (the whole prompt in one forward call: refkv's ``block_size=None``,
  transformers' single call) and in ``blocks`` of ``--block`` tokens (default 128: refkv's
  engine with no eviction; transformers with a ``DynamicCache`` carried from block to
  block); transformers computes only the last position's logits (``logits_to_keep=1``), as
  refkv does;
* **decodes** ``--decode-tokens`` greedy tokens (default 16) one at a time.

transformers runs twice, with ``eager`` and with ``sdpa`` attention. Within a run all use
the same BLAS thread count (``--threads``, default ``1,2``: ``torch.set_num_threads`` and
threadpoolctl for NumPy). Repetitions are interleaved (refkv, eager, sdpa, for each
regime and thread count, then again), so a burst of load on a shared machine hits all
three; the table gives medians of tokens/s and refkv's speed-up over each (their time /
refkv's, paired by repetition), one-shot first, and the 1-minute load average over the
runs.
Times are taken by the process's CPU time, steady on a machine shared with other work
(with one thread it equals the wall time of an idle machine), and the wall-time
speed-ups are printed beside them. The greedy tokens of all three are compared too.

Run ``python bench/compare.py`` (several minutes on 2 cores; ``--lengths 2048,8192`` for
both lengths, much longer: 8K one-shot eager forms 9 x 8K x 8K weights per layer;
``--regimes one-shot --threads 1`` for the headline figure). It needs torch and
transformers: ``pip install -e ".[interop]"`` from a clone (pins ``torch==2.13.0``; take
the CPU build with ``--index-url https://download.pytorch.org/whl/cpu`` -- a plain ``pip install torch`` pulls a
multi-gigabyte CUDA build).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This checkout's refkv, not an installed one: `python bench/compare.py` puts bench/, not
# the repository root, on sys.path (issue 27's first figures timed an installed copy).
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from harness import machine, positive_ints, rst_table, write_json

INSTALL_HINT = ('bench/compare.py needs torch and transformers: pip install -e ".[interop]" from a clone '
                "(torch==2.13.0; for the CPU build add --index-url https://download.pytorch.org/whl/cpu "
                "--extra-index-url https://pypi.org/simple)")
IMPLEMENTATIONS = ("refkv", "transformers eager", "transformers sdpa")
REGIMES = ("one-shot", "blocks")


def import_torch():
    """torch and transformers, or a SystemExit that says how to install them."""
    try:
        import torch
        import transformers
    except ImportError as error:
        raise SystemExit(f"{INSTALL_HINT}\n(missing: {error.name})") from None
    return torch, transformers


def transformers_model(model, attention: str):
    """A ``LlamaForCausalLM`` holding ``model``'s weights (float32), with ``attention`` ("eager"/"sdpa")."""
    torch, transformers = import_torch()
    cfg = model.config
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.d_head, hidden_act="silu", max_position_embeddings=max(cfg.max_positions, 16384),
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
        attention_bias=False, mlp_bias=False)
    config._attn_implementation = attention
    hf = transformers.LlamaForCausalLM(config).to(torch.float32).eval()

    def tensor(a):  # a writable copy (refkv's arrays may be read-only); callers transpose (in, out) -> (out, in)
        return torch.from_numpy(np.array(a, dtype=np.float32, order="C"))

    w = model.weights
    state = {"model.embed_tokens.weight": tensor(w.embed), "model.norm.weight": tensor(w.final_norm),
             "lm_head.weight": tensor(w.embed if w.lm_head is None else w.lm_head.T)}
    names = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
             "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
             "mlp.down_proj": "w_down"}
    for i, lw in enumerate(w.layers):
        prefix = f"model.layers.{i}."
        state[prefix + "input_layernorm.weight"] = tensor(lw.attn_norm)
        state[prefix + "post_attention_layernorm.weight"] = tensor(lw.mlp_norm)
        for theirs, ours in names.items():
            state[prefix + theirs + ".weight"] = tensor(getattr(lw, ours).T)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights did not map onto transformers: missing {missing}, unexpected {unexpected}")
    return hf


def now() -> dict:
    """Both clocks: wall time and this process's CPU time (all its threads)."""
    return {"wall": time.perf_counter(), "cpu": time.process_time()}


def _between(start: dict, end: dict) -> dict:
    return {clock: end[clock] - start[clock] for clock in start}


def run_refkv(model, prompt, block: int | None, decode_tokens: int) -> dict:
    from refkv.engine import Engine

    engine = Engine(model)
    start = now()
    logits = engine.prefill(prompt, block)
    middle = now()
    tokens = engine.generate(logits, decode_tokens + 1)  # decode_tokens forward steps after the first
    end = now()
    return {"prefill_seconds": _between(start, middle), "decode_seconds": _between(middle, end), "tokens": tokens}


def run_transformers(hf, prompt, block: int | None, decode_tokens: int) -> dict:
    """``block=None``: the whole prompt in one forward call (one-shot)."""
    torch, transformers = import_torch()
    ids = torch.tensor(np.asarray(prompt, dtype=np.int64)[None, :])
    block = ids.shape[1] if block is None else block
    with torch.inference_mode():
        cache = transformers.DynamicCache(config=hf.config)
        start = now()
        for i in range(0, ids.shape[1], block):
            out = hf(input_ids=ids[:, i:i + block], past_key_values=cache, use_cache=True, logits_to_keep=1)
        middle = now()
        token = int(out.logits[0, -1].argmax())
        tokens = [token]
        for _ in range(decode_tokens):
            out = hf(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
        end = now()
    return {"prefill_seconds": _between(start, middle), "decode_seconds": _between(middle, end), "tokens": tokens}


def _key(regime: str, threads: int, length: int) -> str:
    return f"{regime}/{threads}/{length}"


def summarise(runs: dict, keys, decode_tokens: int, clock: str = "cpu") -> dict:
    """Median tokens/s per (implementation, case) and refkv's speed-up over each, timed by ``clock``.

    ``keys`` are the cases, ``regime/threads/length`` (:func:`_key`). The speed-up is the
    median over repetitions of (their seconds / refkv's seconds) in the same repetition,
    so each ratio compares runs made moments apart.
    """
    med = statistics.median
    out = {}
    for key in keys:
        length = int(key.rsplit("/", 1)[1])
        rates = {impl: {"prefill": med(length / r["prefill_seconds"][clock] for r in runs[impl][key]),
                        "decode": med(decode_tokens / r["decode_seconds"][clock] for r in runs[impl][key])}
                 for impl in runs}
        ratios = {impl: {phase: med(r[f"{phase}_seconds"][clock] / o[f"{phase}_seconds"][clock]
                                    for r, o in zip(runs[impl][key], runs["refkv"][key]))
                         for phase in ("prefill", "decode")} for impl in runs if impl != "refkv"}
        same = {impl: all(r["tokens"] == o["tokens"] for r, o in zip(runs[impl][key], runs["refkv"][key]))
                for impl in runs if impl != "refkv"}
        out[key] = {"rates": rates, "ratios": ratios, "same_tokens": same}
    return out


def report(summary: dict, wall: dict | None = None) -> str:
    """The table: rates and speed-ups of ``summary``; with ``wall``, the wall-clock speed-ups beside."""
    rows = []
    for key, s in summary.items():
        regime, threads, length = key.split("/")
        for impl, rate in s["rates"].items():
            ratio = s["ratios"].get(impl)
            cells = [regime, length, threads, impl, f"{rate['prefill']:.0f}", f"{rate['decode']:.1f}",
                     "1" if ratio is None else f"{ratio['prefill']:.2f}",
                     "1" if ratio is None else f"{ratio['decode']:.2f}"]
            if wall is not None:
                w = wall[key]["ratios"].get(impl)
                cells.append("1" if w is None else f"{w['prefill']:.2f} / {w['decode']:.2f}")
            cells.append("" if impl == "refkv" else ("yes" if s["same_tokens"][impl] else "no"))
            rows.append(cells)
    headers = ["prefill", "prompt tokens", "threads", "implementation", "prefill tok/s", "decode tok/s",
               "refkv speed-up, prefill", "refkv speed-up, decode"]
    if wall is not None:
        headers.append("speed-up by wall time (prefill / decode)")
    return rst_table([*headers, "same greedy tokens"], rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or GGUF path (default smollm2)")
    parser.add_argument("--lengths", type=positive_ints, default=[2048], help="prompt lengths, comma-separated "
                        "(default 2048; 2048,8192 for both)")
    parser.add_argument("--block", type=int, default=128, help="prompt block size of the blocks regime (128)")
    parser.add_argument("--regimes", default=",".join(REGIMES),
                        help="one-shot, blocks or both, comma-separated (default one-shot,blocks)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens decoded (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--threads", type=positive_ints, default=[1, 2],
                        help="BLAS thread counts, comma-separated, each for all three (default 1,2)")
    parser.add_argument("--out", help="write every run as JSON to this file")
    args = parser.parse_args(argv)
    for name in ("block", "decode_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    regimes = [r.strip() for r in args.regimes.split(",")]
    if not regimes or set(regimes) - set(REGIMES):
        parser.error(f"--regimes must name some of {', '.join(REGIMES)}, got {args.regimes!r}")
    torch, transformers = import_torch()
    from threadpoolctl import threadpool_limits

    from refkv.model import english_prose, load_with_tokenizer

    model, tokenizer = load_with_tokenizer(args.model, dtype=np.float32)
    tokens = tokenizer.encode(english_prose(6 * max(args.lengths)))
    if len(tokens) < max(args.lengths):
        parser.error(f"only {len(tokens)} prose tokens available")
    hf = {"transformers eager": transformers_model(model, "eager"),
          "transformers sdpa": transformers_model(model, "sdpa")}
    # One untimed round on a short prompt first: the first forward call of each
    # implementation pays one-off costs (first touch of the weights, torch's lazy set-up).
    for impl in IMPLEMENTATIONS:
        with threadpool_limits(limits=1, user_api="blas"):
            torch.set_num_threads(1)
            warm = tokens[:min(256, max(args.lengths))]
            if impl == "refkv":
                run_refkv(model, warm, None, 1)
            else:
                run_transformers(hf[impl], warm, None, 1)
    keys = [_key(regime, threads, length) for regime in regimes for threads in args.threads
            for length in args.lengths]
    runs = {impl: {key: [] for key in keys} for impl in IMPLEMENTATIONS}
    loads = []
    for rep in range(args.repeats):
        for key in keys:
            regime, threads, length = key.split("/")
            threads, length = int(threads), int(length)
            prompt, block = tokens[:length], (None if regime == "one-shot" else args.block)
            torch.set_num_threads(threads)
            with threadpool_limits(limits=threads, user_api="blas"):
                for impl in IMPLEMENTATIONS:  # interleaved: a burst of load hits all three alike
                    loads.append(os.getloadavg()[0])
                    if impl == "refkv":
                        run = run_refkv(model, prompt, block, args.decode_tokens)
                    else:
                        run = run_transformers(hf[impl], prompt, block, args.decode_tokens)
                    run["load_average"] = loads[-1]
                    runs[impl][key].append(run)
                    print(f"repetition {rep + 1}/{args.repeats}, {regime}, {threads} thread(s), {length} tokens, "
                          f"{impl}: prefill {run['prefill_seconds']['cpu']:.2f} CPU s "
                          f"({run['prefill_seconds']['wall']:.2f} s), decode {run['decode_seconds']['cpu']:.2f} CPU s, "
                          f"load {loads[-1]:.2f}", file=sys.stderr)
    summary = {clock: summarise(runs, keys, args.decode_tokens, clock) for clock in ("cpu", "wall")}
    info = machine()
    print(f"{args.model} in float32, one-shot and blocks of {args.block}, {args.decode_tokens} greedy tokens; medians "
          f"of {args.repeats} interleaved repetitions; transformers {transformers.__version__}, "
          f"torch {torch.__version__}, NumPy {np.__version__} ({info['blas']}), refkv from "
          f"{Path(sys.modules['refkv'].__file__).parent.parent}; {info['cpus']} CPUs "
          f"({info['processor']}), 1-min load average {min(loads):.2f}-{max(loads):.2f} "
          f"(median {statistics.median(loads):.2f}) during the runs")
    print("tokens per CPU second of the process (steady on a busy machine), speed-ups by CPU time and by wall time:")
    print(report(summary["cpu"], wall=summary["wall"]))
    result = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "runs": runs, "summary": summary,
              "load_during": loads, "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
