"""Why does SnapKV miss passkeys it seems to keep? An exploratory look (issue 23 C; not registered).

Two kinds of prompt of 1,024 tokens: the exploratory run's (repeated filler, "pass key"
wording, fixed depths 0.9 and 0.3: where the failures were seen) and the registered
design's (natural-text haystacks, "secret number", the registered test draws 0 and 1 of
seed 0: :func:`refkv.experiments.haystack.draw`). Each is prefilled under SnapKV, SnapKV
without pooling (``kernel=1``, at the smaller budget: does the pooling cause it?), TOVA and
KeyDiff at ``N`` = 256 and 512, in blocks of 128 and one-shot, and the full cache. Per
region, the fraction of (layer, KV head) caches that keep its tokens (``kept_*``, and the
smallest per-layer fraction ``min_layer_*``):

* ``intro``: the instruction before the haystack ("There is an important info hidden ...");
* ``lead``: the needle's "The pass key is " / "The secret number is ";
* ``digit1`` .. ``digit5``: the key's digits, one token each (the run's
  ``needle_retention`` counts only digits 2-5);
* ``tail``: ". Remember it." after the key;
* ``question``: the question and the answer prefix at the end;

and the answer (greedy, 8 tokens, eviction during decoding as in the run). Writes
``docs/_static/experiments/snapkv_passkey.csv`` (rewritten after each prompt)::

    python docs/snapkv_passkey.py [--samples 2] [--length 1024]
    python docs/snapkv_passkey.py --restore      # the causal check below

``--restore`` (``snapkv_passkey_restore.csv``): for the prompts where SnapKV answered wrong
although it kept most of the key, the key's five digit tokens are put back, with their
dense keys and values, into every (layer, KV head) cache that lost one (each replacing the
oldest kept haystack token of that head), and the model answers again; as a control, the
intro is put back instead. If the answer becomes right only with the digits, the failure is
the few heads that lost a digit, not the policy's scores elsewhere.

About 15 prefills of 1,024 tokens per prompt (a few core-minutes on SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from refkv.experiments import haystack
from refkv.experiments.models import load_model
from refkv.experiments.prefill import prefill_or_skip
from refkv.experiments.tables import write_csv
from refkv.experiments.text import prose_tail

OUT = Path(__file__).resolve().parent / "_static" / "experiments" / "snapkv_passkey.csv"
RESTORE_OUT = OUT.with_name("snapkv_passkey_restore.csv")
#: SnapKV, SnapKV without pooling (kernel 1: the causal test of the pooling), TOVA, KeyDiff.
POLICIES = ("snapkv", "snapkv:kernel=1", "tova", "keydiff")
REGIONS = ("intro", "lead", "digit1", "digit2", "digit3", "digit4", "digit5", "tail", "question")
#: Depths of the exploratory run's prompts examined (where SnapKV failed there).
FILLER_DEPTHS = (0.9, 0.3)
COLUMNS = ["protocol", "prompt", "depth", "key", "policy", "budget", "block", "answer", "correct",
           *[f"{prefix}_{name}" for name in REGIONS for prefix in ("kept", "min_layer")]]


def _regions(tokenizer, tokens: list[int], key_at: int, question: str, intro: str) -> dict[str, np.ndarray]:
    """Token positions of each region; ``key_at`` is the key's second digit (digits are
    single tokens in SmolLM2), the needle sentence's lead is the 5 tokens before the key."""
    first = key_at - 1
    out = {"intro": np.arange(len(tokenizer.encode(intro))), "lead": np.arange(first - 5, first),
           "tail": np.arange(first + 5, first + 9),
           "question": np.arange(len(tokens) - len(tokenizer.encode(question)), len(tokens))}
    out.update({f"digit{i + 1}": np.array([first + i]) for i in range(5)})
    return out


def registered_prompt(model_name: str, length: int, sample: int, seed: int = 0):
    """The registered test prompt ``sample`` (natural text, 'secret number'), its key and regions."""
    _, tokenizer = load_model(model_name, "float32")
    d = haystack.draw(seed, length, sample, "test")
    source = prose_tail(model_name, "float32", d["source"], haystack.RESERVED_SEGMENTS * 1024)
    tokens, key_at = haystack.build_text_prompt(tokenizer, source, length, d["depth"], d["key"], d["offset"])
    question = f"{haystack.QUESTION} {haystack.ANSWER_PREFIX}"
    return tokens, d["key"], d["depth"], _regions(tokenizer, tokens, key_at, question, haystack.INTRO)


def filler_prompt(model_name: str, length: int, depth: float, sample: int = 0, seed: int = 0):
    """The published grid's prompt (repeated filler, 'pass key', fixed depth): where the anomaly was seen."""
    from refkv.experiments import passkey

    _, tokenizer = load_model(model_name, "float32")
    key = passkey._key(seed, length, depth, sample)
    tokens, key_at = passkey.build_prompt(tokenizer, length, depth, key, template="raw", filler="repeat",
                                          needle="short", seed=seed)
    question = f"{passkey.QUESTION} {passkey.ANSWER_PREFIX}"
    return tokens, key, depth, _regions(tokenizer, tokens, key_at, question, passkey.INTRO)


def retention(engine, positions: np.ndarray) -> tuple[float, float]:
    """Mean over the region's tokens of the fraction of (layer, KV head) caches keeping each,
    and the smallest per-layer fraction (a layer that lost the region everywhere shows 0)."""
    per_layer = []
    for cache in engine.caches:                                   # cache.positions (Hkv, n)
        kept = np.stack([np.isin(positions, heads) for heads in cache.positions])   # (Hkv, len(positions))
        per_layer.append(kept.mean())
    return float(np.mean(per_layer)), float(np.min(per_layer))


def run(prompts, budgets=(256, 512), model_name: str = "smollm2", out: Path | None = None) -> list[dict]:
    """``prompts``: ``(protocol, tokens, key, depth, regions)``; every policy at each budget in
    blocks of 128 and one-shot (SnapKV without pooling at the smallest budget only), plus the
    full cache. With ``out``, the CSV is rewritten after each prompt."""
    model, tokenizer = load_model(model_name, "float32")
    stop = getattr(tokenizer, "stop_ids", ())
    rows = []
    for number, (protocol, tokens, key, depth, regions) in enumerate(prompts):
        settings = [("full", None, 128)] + [(p, n, b) for n in budgets for p in POLICIES for b in (128, None)
                                            if p != "snapkv:kernel=1" or n == min(budgets)]
        for policy, budget, block in settings:
            engine, logits, skipped = prefill_or_skip({"policy": policy, "budget": budget, "block": block},
                                                      model, tokens)
            if skipped is not None:
                continue
            row = {"protocol": protocol, "prompt": number, "depth": round(depth, 3), "key": key,
                   "policy": policy, "budget": budget, "block": block if block is not None else "one-shot"}
            for name in REGIONS:
                row[f"kept_{name}"], row[f"min_layer_{name}"] = retention(engine, regions[name])
            answer = tokenizer.decode(engine.generate(logits, 8, eos=stop))
            match = re.search(r"\d+", answer)
            row["answer"] = answer.strip()
            row["correct"] = bool(match) and match.group(0) == str(key)
            rows.append(row)
            print(f"{protocol} {number} d={depth:.2f} {policy:16s} N={budget} B={row['block']}: {row['answer']!r:20s} "
                  + " ".join(f"{k}={row['kept_' + k]:.2f}/{row['min_layer_' + k]:.2f}" for k in REGIONS),
                  flush=True)
        if out is not None:
            write_csv(out, rows, COLUMNS)
    return rows


def put_back(engine, dense, positions: np.ndarray, protected: np.ndarray) -> int:
    """Put ``positions`` back into every KV head of ``engine`` that lost any of them, with the
    dense run's keys and values, each replacing the oldest kept token of that head outside
    ``protected``; the head's tokens stay in position order. Returns the slots restored.

    Exploratory surgery on the cache's buffers (the library offers no such operation).
    """
    restored = 0
    for cache, full in zip(engine.caches, dense.caches):
        buffers, n = cache._buffers, len(cache)
        for h in range(cache.positions.shape[0]):
            kept = buffers["positions"][h, :n]
            missing = [int(p) for p in positions if p not in kept]
            order = np.argsort(kept)                     # oldest first; outside ``protected`` first
            victims = ([i for i in order if kept[i] not in protected]
                       + [i for i in order if kept[i] in protected and kept[i] not in positions])[:len(missing)]
            for slot, p in zip(victims, missing):
                at = int(np.flatnonzero(full.positions[h] == p)[0])
                buffers["keys"][h, slot] = full.keys[h, at]
                buffers["values"][h, slot] = full.values[h, at]
                buffers["positions"][h, slot] = p
                restored += 1
            order = np.argsort(buffers["positions"][h, :n], kind="stable")
            for name in ("keys", "values", "positions"):
                buffers[name][h, :n] = buffers[name][h, :n][order]
    return restored


def restore_check(model_name: str = "smollm2", length: int = 1024) -> list[dict]:
    """SnapKV's wrong answers on the exploratory prompts, answered again with the key's digits
    (or, as a control, the intro) put back where they were lost."""
    model, tokenizer = load_model(model_name, "float32")
    stop = getattr(tokenizer, "stop_ids", ())
    rows = []
    for depth in FILLER_DEPTHS:
        tokens, key, _, regions = filler_prompt(model_name, length, depth)
        dense, _, _ = prefill_or_skip({"policy": "full", "budget": None, "block": None}, model, tokens[:-1])
        digits = np.concatenate([regions[f"digit{i}"] for i in range(1, 6)])
        protected = np.concatenate(list(regions.values()))
        for budget in (256, 512):
            for block in (128, None):
                for put in ("nothing", "digits", "intro"):
                    # The prompt but its last token under SnapKV; the repair; then the last token
                    # reads the (repaired) cache and gives the first answer token.
                    params = {"policy": "snapkv", "budget": budget, "block": block}
                    engine, _, _ = prefill_or_skip(params, model, tokens[:-1])
                    restored = 0
                    if put != "nothing":
                        restored = put_back(engine, dense, digits if put == "digits" else regions["intro"], protected)
                    logits = engine.forward(np.asarray(tokens[-1:], dtype=np.int64))
                    answer = tokenizer.decode(engine.generate(logits, 8, eos=stop)).strip()
                    match = re.search(r"\d+", answer)
                    rows.append({"depth": depth, "key": key, "budget": budget,
                                 "block": block if block is not None else "one-shot", "put_back": put,
                                 "slots": restored, "answer": answer,
                                 "correct": bool(match) and match.group(0) == str(key)})
                    print(rows[-1], flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2, help="registered test prompts (samples 0 ..)")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--restore", action="store_true", help="the causal check (snapkv_passkey_restore.csv)")
    args = parser.parse_args(argv)
    if args.restore:
        rows = restore_check(length=args.length)
        out = args.out.with_name(args.out.stem + "_restore.csv") if args.out != OUT else RESTORE_OUT
        write_csv(out, rows, ["depth", "key", "budget", "block", "put_back", "slots", "answer", "correct"])
        print(f"{len(rows)} rows -> {out}")
        return 0
    filler = [("filler", *filler_prompt("smollm2", args.length, depth)) for depth in FILLER_DEPTHS]
    registered = [("registered", *registered_prompt("smollm2", args.length, sample)) for sample in range(args.samples)]
    prompts = [p for pair in zip(filler, registered) for p in pair]          # both protocols early
    rows = run(prompts, out=args.out)
    write_csv(args.out, rows, COLUMNS)
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
