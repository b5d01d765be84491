"""Passkey retrieval (needle in a haystack) under eviction: KeyDiff Fig. 6 at small scale.

A five-digit pass key is hidden at a controlled depth of a synthetic haystack; the model
reads the prompt with block prompt processing (block size ``B``, budget ``N``, the
policy evicting as it goes, KeyDiff Eq. 6), then answers greedily. A cell is correct when
the first number in the answer equals the key (exact match).

Prompt (Mohtashami & Jaggi's passkey task, as used by KeyDiff's and CAOTE's
needle tests)::

    There is an important info hidden inside a lot of irrelevant text. Find it and
    memorize it. I will quiz you about the important information there.

    <filler> ... The pass key is 48151. Remember it. ... <filler>

    What is the pass key? The pass key is

Notes
-----
* **Filler.** ``filler="repeat"`` (default) repeats the classic five filler sentences
  ("The grass is green. The sky is blue. ..."); ``filler="varied"`` draws seeded
  sentences from a small grammar. SmolLM2-135M finds the key in the repeated filler
  at 1-2K tokens but hardly ever in varied filler beyond ~700 tokens even with no
  eviction, so only the repeated filler measures eviction at all at this scale.
* **Template and needle (grid default: raw text, short needle).** ``template="chat"``
  wraps the prompt in the model's ChatML template (one user message, then the assistant
  turn starting with "The pass key is"); ``"raw"`` is plain text (models without a chat
  template, like ``tiny``, always get raw text). ``needle="short"`` is "The pass key is
  K. Remember it."; ``"classic"`` adds "K is the pass key." With no eviction, SmolLM2
  found the key at 2,048 tokens in 3 of 5 depths with raw text (either needle) but in
  0-1 of 5 with the chat template, and raw + short found it in 5 of 5 at 1,024 and 4,096
  tokens: the grid uses raw text and the short needle.
* **Depth** ``d`` in [0, 1] puts the needle after ``round(d * n)`` of the ``n`` filler
  units; the record keeps the needle's actual token position.
* **Pairing.** The key and the haystack depend only on (seed, length, depth, sample),
  never on the policy, budget or block size: every policy answers the same prompts.
* **Needle retention.** Each record also keeps the fraction of the key's digit tokens
  still in the cache after the prompt, averaged over layers and KV heads: whether the
  policy kept the needle, separately from whether the model then read it.
* **Ceiling.** Policy ``full`` (no eviction) is run on every prompt: the accuracy the
  135M model reaches without eviction, which bounds every policy's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..engine import Engine
from ..policies.keydiff import anchor_scores
from ..policies.spec import canonical_spec
from ..validation import check_float, check_int
from . import haystack
from .design import Experiment, Option
from .grids import COMPARABLE_BASELINES, configuration, default_policies
from .models import load_model
from .prefill import prefill_or_skip
from .settings import MAX_TOKENS, Settings
from .stats import mcnemar_exact, mean_std, paired_proportion_difference, wilson_interval
from .tables import write_csv
from .text import prose_tail

__all__ = ["EXPERIMENT", "PASSKEY_LENGTHS", "PASSKEY_PROMPTS", "answer_key", "build_prompt", "cells", "run_cell",
           "summarise"]

#: Prompts per cell, spread evenly over the needle depths (rounded up to a multiple of their number).
PASSKEY_PROMPTS = Option("passkey_prompts", "passkey prompts per cell (spread over the needle depths)",
                         sizes=(1, 5, 50))
#: Prompt lengths in tokens (the tiny model's default grid halves them: its context is 2,048).
PASSKEY_LENGTHS = Option("passkey_lengths", "passkey prompt lengths in tokens",
                         sizes=((512,), (1024, 2048), (1024, 2048, 4096)), low=64, high=MAX_TOKENS, metavar="T",
                         many=True)

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLES = {"short": "The pass key is {key}. Remember it.",
           "classic": "The pass key is {key}. Remember it. {key} is the pass key."}
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"

_SUBJECTS = ("The river", "A small boat", "The old house", "The wind", "A tall tree", "The market", "The road",
             "A quiet village", "The clock", "The garden")
_PREDICATES = ("runs past the hill", "stays warm in winter", "moves slowly", "looks bright at noon",
               "waits by the gate", "turns to the east", "opens early", "rests in the shade", "sounds far away",
               "grows every year")

#: Depths at which the default grid puts the needle (fractions of the haystack).
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _filler_units(kind: str, count: int, rng: np.random.Generator) -> list[str]:
    if kind == "repeat":
        return [FILLER] * count
    if kind == "varied":
        units = []
        for _ in range(count):
            sentences = [f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_PREDICATES[rng.integers(len(_PREDICATES))]}."
                         for _ in range(5)]
            units.append(" ".join(sentences))
        return units
    raise ValueError(f"filler must be 'repeat' or 'varied', got {kind!r}")


def _render(tokenizer, units: list[str], template: str) -> list[int]:
    haystack = " ".join(units)
    if template == "chat" and getattr(tokenizer, "has_chat_template", False):
        message = f"{INTRO}\n\n{haystack}\n\n{QUESTION}"
        return list(tokenizer.encode_chat([{"role": "user", "content": message}])) + \
            list(tokenizer.encode(ANSWER_PREFIX))
    if template not in ("chat", "raw"):
        raise ValueError(f"template must be 'chat' or 'raw', got {template!r}")
    return list(tokenizer.encode(f"{INTRO}\n\n{haystack}\n\n{QUESTION} {ANSWER_PREFIX}"))


def build_prompt(tokenizer, length: int, depth: float, key: int, *, template: str = "raw",
                 filler: str = "repeat", needle: str = "short", seed: int = 0) -> tuple[list[int], int]:
    """The prompt tokens (about ``length`` of them) and the token index of the key's last digits.

    Parameters
    ----------
    tokenizer : refkv.model.tokenizer.Tokenizer or ByteTokenizer
    length : int
        Target prompt length in tokens (``>= 64``); the prompt holds as many filler
        units as fit.
    depth : float in [0, 1]
        Where the needle goes: after ``round(depth * n)`` of the ``n`` filler units.
    key : int
        The pass key (five digits).
    template : "chat" or "raw"
    filler : "repeat" or "varied"
    needle : "classic" or "short"
        ``"classic"`` states the key twice ("The pass key is K. Remember it. K is the pass
        key.", Mohtashami & Jaggi); ``"short"`` once ("The pass key is K. Remember it.").
    seed : int
        Seed of the varied filler.
    """
    check_int("length", length, 64)
    check_float("depth", depth, 0.0, 1.0)
    if not 10000 <= key <= 99999:
        raise ValueError(f"key must have five digits, got {key!r}")
    if needle not in NEEDLES:
        raise ValueError(f"needle must be one of {sorted(NEEDLES)}, got {needle!r}")
    needle = NEEDLES[needle].format(key=key)
    rng = np.random.default_rng(seed)
    overhead = len(_render(tokenizer, [needle], template))
    per_unit = max(1, len(tokenizer.encode(" " + FILLER)))
    count = max(1, (length - overhead) // per_unit)
    units = _filler_units(filler, count, rng)
    at = round(depth * count)
    tokens = _render(tokenizer, [*units[:at], needle, *units[at:]], template)
    marker = list(tokenizer.encode(str(key)[1:]))  # the last four digits: one run of tokens in context
    return tokens, _find(tokens, marker)


def _find(tokens: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    for i in range(len(tokens) - n + 1):
        if tokens[i:i + n] == pattern:
            return i
    return -1


def _key(seed: int, length: int, depth: float, sample: int) -> int:
    rng = np.random.default_rng([seed, length, round(depth * 1000), sample])
    return int(rng.integers(10000, 100000))


#: The comparable baselines the passkey grid adds (the CAOTE ones stay in the perplexity grid,
#: where CAOTE's claims are): KeyDiff's reserve, L2 protected as HashEvict, H2O without window.
PASSKEY_BASELINES = tuple(spec for spec in COMPARABLE_BASELINES if not spec.startswith("caote"))


#: The policies the default grid also runs with one-shot prefill (``B = None``): those of
#: KeyDiff's claim that the gap to attention-based policies closes without blocks (Sec. 4.2),
#: and sink as the reference. One-shot cells at 2K tokens are the grid's most expensive
#: (the full T x T attention), so the other policies run one-shot only in ``--full``.
ONE_SHOT_POLICIES = ("keydiff", "snapkv", "tova", "h2o", "h2o:recent=0", "caote:base=h2o", "sink")


#: The registered design's passkey policies (claims P1 and P2): each runs in blocks and one-shot.
REGISTERED_POLICIES = ("keydiff", "snapkv", "tova", "h2o")


# -- the grid ------------------------------------------------------------------------------
def registered_cells(settings: Settings) -> list[dict]:
    """The registered passkey grid (``docs/guide/registration.rst``).

    Without ``passkey_lengths``: the calibration, the full cache on 60 calibration prompts
    at each of :data:`refkv.experiments.haystack.CALIBRATION_LENGTHS`. With one length ``L``
    (the calibrated one): 60 test prompts, the full cache and each of
    :data:`REGISTERED_POLICIES` at ``N = L / 8`` in blocks of ``min(128, N)`` and one-shot.
    """
    model = settings.resolved_model()
    prompts = PASSKEY_PROMPTS.given(settings) or 60
    lengths = PASSKEY_LENGTHS.given(settings)
    common = {"model": model, "dtype": settings.dtype, "seed": settings.seed, "design": "registered",
              "max_new_tokens": 8}
    if lengths is None:
        return [{**common, "purpose": "calibration", "length": length, "sample": sample, "policy": "full",
                 "budget": None, "block": 128}
                for length in haystack.CALIBRATION_LENGTHS for sample in range(prompts)]
    if len(lengths) != 1:
        raise ValueError(f"passkey_lengths must hold the one calibrated length for the registered test grid, "
                         f"got {list(lengths)}")
    length = lengths[0]
    budget = length // 8
    block = min(128, budget)
    out = []
    for sample in range(prompts):
        prompt = {**common, "purpose": "test", "length": length, "sample": sample}
        out.append({**prompt, "policy": "full", "budget": None, "block": block})
        for policy in REGISTERED_POLICIES:
            out.extend({**prompt, "policy": policy, "budget": budget, "block": b} for b in (block, None))
    return out


def cells(settings: Settings) -> list[dict]:
    """The grid: prompts x (ceiling + policies x budgets x block sizes); the default grid runs
    one-shot prefill for :data:`ONE_SHOT_POLICIES` only; ``registered``: :func:`registered_cells`."""
    if settings.registered:
        return registered_cells(settings)
    model = settings.resolved_model()
    real = model != "tiny"
    if settings.quick:
        lengths, depths, samples = ([512] if real else [200]), (0.5,), 1
        policies = ["sink", "keydiff"]
        budgets, blocks = ([128] if real else [64]), ([128] if real else [32])
    else:
        # Prompts per cell spread over the needle depths: 5 -> one per depth, 50 -> ten.
        lengths, depths = (PASSKEY_LENGTHS.value(settings) if real else (512, 1024)), DEPTHS
        samples = -(-PASSKEY_PROMPTS.value(settings) // len(DEPTHS))
        policies = default_policies(("caote:base=h2o", *PASSKEY_BASELINES), caote=False)
        budgets, blocks = [256], [128, None]
    given_lengths, given_prompts = PASSKEY_LENGTHS.given(settings), PASSKEY_PROMPTS.given(settings)
    if given_lengths is not None:
        lengths = given_lengths
    if settings.quick and given_prompts is not None:
        depths, samples = DEPTHS, -(-given_prompts // len(DEPTHS))
    trimmed = not (settings.quick or settings.full or settings.policies or settings.blocks)
    one_shot = {canonical_spec(p) for p in ONE_SHOT_POLICIES}
    policies = [canonical_spec(p) for p in (settings.policies or policies)]
    budgets = list(settings.budgets or budgets)
    blocks = list(settings.blocks or blocks)
    common = {"model": model, "dtype": settings.dtype, "seed": settings.seed, "template": "raw",
              "filler": "repeat", "needle": "short", "max_new_tokens": 8}
    out = []
    for length in lengths:
        for depth in depths:
            for sample in range(samples):
                prompt = {**common, "length": length, "depth": depth, "sample": sample}
                out.append({**prompt, "policy": "full", "budget": None, "block": blocks[0]})
                for policy in policies:
                    if policy == "full":
                        continue
                    for budget in budgets:
                        for block in blocks:
                            if block is None and trimmed and policy not in one_shot:
                                continue
                            out.append({**prompt, "policy": policy, "budget": budget, "block": block})
    return out


def cost(params: dict) -> float:
    """Roughly seconds of one core: the prompt's tokens, more without blocks or budget."""
    tokens = params["length"] / 250.0
    if params["block"] is None or params["budget"] is None:
        tokens *= 1.0 + params["length"] / 2048.0  # attention over the whole prompt
    return tokens + 1.0


def run_cell(params: dict) -> dict:
    """Build the prompt, prefill it under the policy, answer greedily, check the number."""
    if params.get("design") == "registered":
        return _run_registered(params)
    model, tokenizer = load_model(params["model"], params["dtype"])
    key = _key(params["seed"], params["length"], params["depth"], params["sample"])
    tokens, needle_at = build_prompt(tokenizer, params["length"], params["depth"], key,
                                     template=params["template"], filler=params["filler"],
                                     needle=params["needle"], seed=params["seed"])
    base = {"key": key, "prompt_tokens": len(tokens), "needle_position": needle_at}
    engine, logits, skipped = prefill_or_skip(params, model, tokens)
    if skipped is not None:
        return {**base, "skipped": skipped}
    kept = _needle_retention(engine, needle_at, 4)
    return {**base, **answer_key(engine, logits, tokenizer, key, params["max_new_tokens"]), "needle_retention": kept}


def _run_registered(params: dict) -> dict:
    """A registered prompt (natural text, random depth): answer, retention, and how distinctive the needle was."""
    model, tokenizer = load_model(params["model"], params["dtype"])
    d = haystack.draw(params["seed"], params["length"], params["sample"], params["purpose"])
    source = prose_tail(params["model"], params["dtype"], d["source"], haystack.RESERVED_SEGMENTS * 1024)
    tokens, needle_at = haystack.build_text_prompt(tokenizer, source, params["length"], d["depth"], d["key"],
                                                   d["offset"])
    base = {"key": d["key"], "source": d["source"], "depth": d["depth"], "prompt_tokens": len(tokens),
            "needle_position": needle_at}
    engine, logits, skipped = prefill_or_skip(params, model, tokens)
    if skipped is not None:
        return {**base, "skipped": skipped}
    if params["policy"] == "full":
        base["needle_distinctiveness"] = _needle_distinctiveness(engine, needle_at, 4)
    kept = _needle_retention(engine, needle_at, 4)
    return {**base, **answer_key(engine, logits, tokenizer, d["key"], params["max_new_tokens"]),
            "needle_retention": kept}


def answer_key(engine: Engine, logits: np.ndarray, tokenizer, key: int, max_new_tokens: int) -> dict:
    """Answer greedily from the prompt's last ``logits``; correct when the first number in the
    answer is ``key`` (exact match). Returns ``answer`` (the text), ``predicted`` and ``correct``."""
    text = tokenizer.decode(engine.generate(logits, max_new_tokens, eos=getattr(tokenizer, "stop_ids", ())))
    match = re.search(r"\d+", text)
    predicted = match.group(0) if match else ""
    return {"answer": text, "predicted": predicted, "correct": predicted == str(key)}


def _needle_distinctiveness(engine: Engine, start: int, width: int) -> float | None:
    """How distinctive the needle's keys are by KeyDiff's score (its anchor distance): the
    fraction of the prompt's tokens scoring below the needle tokens' mean, averaged over
    layers and KV heads (1.0: the most distinctive of all; about 0.5: typical)."""
    if start < 0:
        return None
    fractions = []
    for cache in engine.caches:
        scores = anchor_scores(cache.keys)                         # (Hkv, n)
        inside = (cache.positions >= start) & (cache.positions < start + width)
        for head in range(scores.shape[0]):
            needle = scores[head][inside[head]].mean()
            fractions.append(float(np.mean(scores[head] < needle)))
    return float(np.mean(fractions))


def _needle_retention(engine: Engine, start: int, width: int) -> float | None:
    """Fraction of the needle's tokens ``[start, start + width)`` in the caches (mean over layers, heads)."""
    if start < 0:
        return None
    fractions = []
    for cache in engine.caches:
        inside = (cache.positions >= start) & (cache.positions < start + width)
        fractions.append(inside.sum(axis=1) / width)
    return float(np.mean(fractions))


# -- summary -------------------------------------------------------------------------------
def _label(params: dict) -> str:
    return "full" if params["policy"] == "full" else params["policy"]


def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
    """``accuracy.csv`` (one row per policy, budget, block), ``cells.csv`` and heatmaps."""
    done = [r for r in records if "skipped" not in r["result"]]
    groups: dict[tuple, list[dict]] = {}
    for r in done:
        p = r["params"]
        groups.setdefault((p["policy"], p["budget"], p["block"]), []).append(r)
    lengths = sorted({r["params"]["length"] for r in done})
    rows = []
    for (policy, budget, block), group in groups.items():
        acc, _, n = mean_std(float(r["result"]["correct"]) for r in group)
        keep, _, _ = mean_std(r["result"]["needle_retention"] for r in group)
        wilson = wilson_interval(sum(bool(r["result"]["correct"]) for r in group), len(group))
        row = {"policy": policy, "configuration": configuration(policy), "budget": budget,
               "block": "none" if block is None else block, "accuracy": acc, "acc_low": wilson.low,
               "acc_high": wilson.high, "n": n, "needle_retention": keep,
               "wall_time_s": sum(r["wall_time_s"] for r in group)}
        for length in lengths:
            sub = [float(r["result"]["correct"]) for r in group if r["params"]["length"] == length]
            row[f"acc_{length}"] = mean_std(sub)[0]
        rows.append(row)
    skipped = {(r["params"]["policy"], r["params"]["budget"], r["params"]["block"]): r["result"]["skipped"]
               for r in records if "skipped" in r["result"]}
    for (policy, budget, block), reason in skipped.items():
        rows.append({"policy": policy, "budget": budget, "block": "none" if block is None else block,
                     "n": 0, "skipped": reason})
    columns = ["policy", "configuration", "budget", "block", "accuracy", "acc_low", "acc_high", "n",
               "needle_retention",
               *[f"acc_{length}" for length in lengths], "wall_time_s", "skipped"]
    written = [write_csv(folder / "accuracy.csv", rows, columns)]
    written.append(write_csv(folder / "pairs.csv", paired_comparisons(done)))
    cell_rows = []
    for r in done:
        p, res = r["params"], r["result"]
        cell_rows.append({"policy": p["policy"], "budget": p["budget"],
                          "block": "none" if p["block"] is None else p["block"], "length": p["length"],
                          "depth": p["depth"], "sample": p["sample"], "prompt_tokens": res["prompt_tokens"],
                          "key": res["key"], "predicted": res["predicted"], "correct": int(res["correct"]),
                          "needle_retention": res["needle_retention"], "wall_time_s": r["wall_time_s"]})
    written.append(write_csv(folder / "cells.csv", cell_rows))
    from . import plots

    written += plots.passkey_heatmaps(done, folder)
    return written


def paired_comparisons(records: list[dict]) -> list[dict]:
    """Every pair of policies at the same budget and block, on the prompts both answered.

    Per pair: the accuracy difference A - B with its 95% paired bootstrap interval over
    prompts (:func:`~refkv.experiments.stats.paired_proportion_difference`) and McNemar's
    exact test (:func:`~refkv.experiments.stats.mcnemar_exact`); the no-eviction ceiling
    (``full``, one per prompt) is paired with every policy.
    """
    answers: dict[tuple, dict[tuple, bool]] = {}   # (policy, budget, block) -> {prompt: correct}
    ceiling: dict[tuple, bool] = {}
    for r in records:
        p = r["params"]
        prompt = (p["length"], p["depth"], p["sample"])
        if p["policy"] == "full":
            ceiling[prompt] = bool(r["result"]["correct"])
        else:
            answers.setdefault((p["policy"], p["budget"], p["block"]), {})[prompt] = bool(r["result"]["correct"])
    rows = []
    keys = sorted(answers, key=lambda k: (str(k[1]), str(k[2]), k[0]))
    for i, a in enumerate(keys):
        others = [("full", a[1], a[2])] + [b for b in keys[i + 1:] if b[1:] == a[1:]]
        for b in others:
            b_answers = ceiling if b[0] == "full" else answers[b]
            prompts = sorted(set(answers[a]) & set(b_answers))
            if not prompts:
                continue
            x = [answers[a][q] for q in prompts]
            y = [b_answers[q] for q in prompts]
            only_a, only_b, p_value = mcnemar_exact(x, y)
            diff = paired_proportion_difference(x, y, n_boot=2000)
            rows.append({"policy_a": a[0], "policy_b": b[0], "budget": a[1],
                         "block": "none" if a[2] is None else a[2], "prompts": len(prompts),
                         "acc_a": float(np.mean(x)), "acc_b": float(np.mean(y)), "difference": diff.estimate,
                         "diff_low": diff.low, "diff_high": diff.high, "only_a": only_a, "only_b": only_b,
                         "mcnemar_p": p_value})
    return rows


EXPERIMENT = Experiment(
    name="passkey",
    title="needle in a haystack: exact-match accuracy by length x depth (KeyDiff Fig. 6)",
    cells=cells, run=run_cell, summarise=summarise, cost=cost, options=(PASSKEY_PROMPTS, PASSKEY_LENGTHS),
    table=("accuracy.csv", ("policy", "budget", "block", "accuracy", "needle_retention", "n")))
