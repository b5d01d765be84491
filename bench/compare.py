"""refkv against PyTorch's transformers on the same model, side by side in one run.

Both run SmolLM2-135M-Instruct in float32 from the same GGUF file: refkv loads it, and a
``transformers.LlamaForCausalLM`` is built from a config matching its metadata and given
refkv's dequantized weights (no download; the construction that
``tests/test_conformance_hf.py`` checks for equal logits). Each implementation

* **prefills** a prompt of real English prose (:func:`refkv.model.english_prose`) in blocks
  of ``--block`` tokens (default 128): refkv's engine with no eviction; transformers with
  a ``DynamicCache`` carried from block to block and ``logits_to_keep=1`` (only the last
  position's logits, as refkv computes);
* **decodes** ``--decode-tokens`` greedy tokens (default 16) one at a time.

transformers runs twice, with ``eager`` and with ``sdpa`` attention. Everything uses the
same BLAS thread count (``--threads``, default 1: ``torch.set_num_threads`` and
threadpoolctl for NumPy). Repetitions are interleaved (refkv, eager, sdpa, then again),
so a burst of load on a shared machine hits all three; the table gives medians of
tokens/s and refkv's speed-up over each (their time / refkv's, paired by repetition).
Times are taken by the process's CPU time, steady on a machine shared with other work
(with one thread it equals the wall time of an idle machine), and the wall-time
speed-ups are printed beside them. The greedy tokens of all three are compared too.

Run ``python bench/compare.py`` (a few minutes on 2 cores; ``--lengths 2048,8192`` for
both lengths, several more). It needs torch and transformers: ``pip install -e
".[interop]"`` from a clone (pins ``torch==2.13.0``; take the CPU build with ``--index-url
https://download.pytorch.org/whl/cpu`` -- a plain ``pip install torch`` pulls a
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
from harness import machine, positive_ints, rst_table, write_json

INSTALL_HINT = ('bench/compare.py needs torch and transformers: pip install -e ".[interop]" from a clone '
                "(torch==2.13.0; for the CPU build add --index-url https://download.pytorch.org/whl/cpu "
                "--extra-index-url https://pypi.org/simple)")
IMPLEMENTATIONS = ("refkv", "transformers eager", "transformers sdpa")


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


def run_refkv(model, prompt, block: int, decode_tokens: int) -> dict:
    from refkv.engine import Engine

    engine = Engine(model)
    start = now()
    logits = engine.prefill(prompt, block)
    middle = now()
    tokens = engine.generate(logits, decode_tokens + 1)  # decode_tokens forward steps after the first
    end = now()
    return {"prefill_seconds": _between(start, middle), "decode_seconds": _between(middle, end), "tokens": tokens}


def run_transformers(hf, prompt, block: int, decode_tokens: int) -> dict:
    torch, transformers = import_torch()
    ids = torch.tensor(np.asarray(prompt, dtype=np.int64)[None, :])
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


def summarise(runs: dict, lengths, decode_tokens: int, clock: str = "cpu") -> dict:
    """Median tokens/s per (implementation, length) and refkv's speed-up over each, timed by ``clock``.

    The speed-up is the median over repetitions of (their seconds / refkv's seconds) in the
    same repetition, so each ratio compares runs made moments apart.
    """
    med = statistics.median
    out = {}
    for length in lengths:
        key = str(length)
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


def report(summary: dict, threads: int, wall: dict | None = None) -> str:
    """The table: rates and speed-ups of ``summary``; with ``wall``, the wall-clock speed-ups beside."""
    rows = []
    for length, s in summary.items():
        for impl, rate in s["rates"].items():
            ratio = s["ratios"].get(impl)
            cells = [length, threads, impl, f"{rate['prefill']:.0f}", f"{rate['decode']:.1f}",
                     "1" if ratio is None else f"{ratio['prefill']:.2f}",
                     "1" if ratio is None else f"{ratio['decode']:.2f}"]
            if wall is not None:
                w = wall[length]["ratios"].get(impl)
                cells.append("1" if w is None else f"{w['prefill']:.2f} / {w['decode']:.2f}")
            cells.append("" if impl == "refkv" else ("yes" if s["same_tokens"][impl] else "no"))
            rows.append(cells)
    headers = ["prompt tokens", "threads", "implementation", "prefill tok/s", "decode tok/s",
               "refkv speed-up, prefill", "refkv speed-up, decode"]
    if wall is not None:
        headers.append("speed-up by wall time (prefill / decode)")
    return rst_table([*headers, "same greedy tokens"], rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or GGUF path (default smollm2)")
    parser.add_argument("--lengths", type=positive_ints, default=[2048], help="prompt lengths, comma-separated "
                        "(default 2048; 2048,8192 for both)")
    parser.add_argument("--block", type=int, default=128, help="prompt block size (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens decoded (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads for all (default 1)")
    parser.add_argument("--out", help="write every run as JSON to this file")
    args = parser.parse_args(argv)
    for name in ("block", "decode_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch, transformers = import_torch()
    from threadpoolctl import threadpool_limits

    from refkv.model import english_prose, load_with_tokenizer

    model, tokenizer = load_with_tokenizer(args.model, dtype=np.float32)
    tokens = tokenizer.encode(english_prose(6 * max(args.lengths)))
    if len(tokens) < max(args.lengths):
        parser.error(f"only {len(tokens)} prose tokens available")
    hf = {"transformers eager": transformers_model(model, "eager"),
          "transformers sdpa": transformers_model(model, "sdpa")}
    torch.set_num_threads(args.threads)
    runs = {impl: {str(n): [] for n in args.lengths} for impl in IMPLEMENTATIONS}
    loads = []
    with threadpool_limits(limits=args.threads, user_api="blas"):
        for rep in range(args.repeats):
            for length in args.lengths:
                prompt = tokens[:length]
                for impl in IMPLEMENTATIONS:  # interleaved: a burst of load hits all three alike
                    loads.append(os.getloadavg()[0])
                    if impl == "refkv":
                        run = run_refkv(model, prompt, args.block, args.decode_tokens)
                    else:
                        run = run_transformers(hf[impl], prompt, args.block, args.decode_tokens)
                    runs[impl][str(length)].append(run)
                    print(f"repetition {rep + 1}/{args.repeats}, {length} tokens, {impl}: prefill "
                          f"{run['prefill_seconds']['cpu']:.2f} CPU s ({run['prefill_seconds']['wall']:.2f} s), "
                          f"decode {run['decode_seconds']['cpu']:.2f} CPU s", file=sys.stderr)
    summary = {clock: summarise(runs, args.lengths, args.decode_tokens, clock) for clock in ("cpu", "wall")}
    info = machine()
    print(f"{args.model} in float32, blocks of {args.block}, {args.decode_tokens} greedy tokens, {args.threads} "
          f"thread(s); medians of {args.repeats} interleaved repetitions; transformers {transformers.__version__}, "
          f"torch {torch.__version__}, NumPy {np.__version__} ({info['blas']}); {info['cpus']} CPUs, "
          f"1-min load average {min(loads):.2f}-{max(loads):.2f} during the runs")
    print("tokens per CPU second of the process (steady on a busy machine), speed-ups by CPU time and by wall time:")
    print(report(summary["cpu"], args.threads, wall=summary["wall"]))
    result = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "runs": runs, "summary": summary,
              "load_during": loads, "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
