"""Paper form vs authors' form on a real checkpoint: what the authors' code's decisions are worth.

The design is registered in ``docs/forms_registration.json`` before its first record. For
SnapKV (per query head; max pooling), PyramidKV (the floored schedule) and HashEvict (the
prompt stage), each form runs in the authors' regime on the same prompts and texts:

* **SnapKV, PyramidKV** compress the prompt once, one-shot, to ``N`` and never evict
  afterwards. Their authors' forms select per query head, so they run on
  :func:`refkv.model.heads.repeat_kv_heads` of the model (``heads="repeated"``); SnapKV's
  paper form runs on the model itself (``heads="gqa"``, the group mean).
* **HashEvict**: the paper form processes every token one at a time with budget ``N``
  (Algorithm 1 over the prompt); the authors' form processes the prompt uncompressed, then
  one token at a time with budget ``N`` (its first step is the authors' prompt cut).

Tasks: ``passkey`` (phase two's document prompts, :func:`~refkv.experiments.haystack.build_document_prompt`)
and ``perplexity`` (window 0 of each document: a prompt, then a continuation whose
negative log-likelihood is recorded token by token).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..engine import Engine
from ..policies.spec import make_policy, parse_spec
from .design import Experiment
from .documents import document_kind, document_names, document_window
from .haystack import DOCUMENT_SEED, WINDOW_TOKENS, build_document_prompt
from .models import load_model
from .passkey import _needle_retention, answer_key
from .perplexity import token_nll
from .settings import Settings
from .tables import write_csv

__all__ = ["BUDGET", "COMPARISONS", "EXPERIMENT", "VARIANTS", "cells", "run_cell"]

#: Tokens kept per head (registered).
BUDGET = 128
#: Each task's variants: (policy spec, heads) -- ``heads`` is "gqa" (the model) or "repeated".
VARIANTS = {
    "prefill": (("full", "gqa"), ("snapkv", "gqa"), ("snapkv:form=authors", "repeated"),
                ("snapkv:form=authors,pooling=max", "repeated"), ("pyramidkv", "repeated"),
                ("pyramidkv:form=authors", "repeated")),
    "hashevict": (("full", "gqa"), ("hashevict", "gqa"), ("hashevict:form=authors,hash=key", "gqa")),
}
#: The registered comparisons: id -> (A, B) as (spec, heads).
COMPARISONS = {
    "F1": (("snapkv:form=authors", "repeated"), ("snapkv", "gqa")),
    "F2": (("snapkv:form=authors,pooling=max", "repeated"), ("snapkv:form=authors", "repeated")),
    "F3": (("pyramidkv:form=authors", "repeated"), ("pyramidkv", "repeated")),
    "F4": (("hashevict:form=authors,hash=key", "gqa"), ("hashevict", "gqa")),
}
#: Passkey windows and prompt length per regime, and the perplexity texts' split (registered).
PASSKEY = {"prefill": ((4, 5, 6), 1024), "hashevict": ((4, 5), 512)}
#: (text tokens, prompt tokens) of the perplexity texts, per regime.
TEXTS = {"prefill": (1024, 512), "hashevict": (512, 384)}


def cells(settings: Settings) -> list[dict]:
    """Every registered cell: regimes x tasks x units x variants (the same units for every variant)."""
    common = {"model": settings.resolved_model(), "dtype": settings.dtype, "seed": DOCUMENT_SEED,
              "design": "forms", "budget": BUDGET}
    out = []
    for regime, variants in VARIANTS.items():
        windows, length = PASSKEY[regime]
        text, prompt = TEXTS[regime]
        for name in document_names():
            units = [{"task": "passkey", "document": name, "window": w, "length": length, "max_new_tokens": 8}
                     for w in windows]
            units.append({"task": "perplexity", "document": name, "window": 0, "length": text, "prompt": prompt})
            out.extend({**common, **unit, "regime": regime, "policy": spec, "heads": heads}
                       for unit in units for spec, heads in variants)
    return out


def cost(params: dict) -> float:
    """Rough seconds of one core: a token-by-token pass costs ~55 ms a token, a one-shot pass ~3 ms."""
    if params["regime"] == "hashevict" and params["policy"] == "hashevict":
        return 0.055 * params["length"] + 1.0
    if params["regime"] == "hashevict" and params["task"] == "perplexity":
        return 0.055 * (params["length"] - params["prompt"]) + 1.0
    return 0.003 * params["length"] + 1.0


@lru_cache(maxsize=2)
def _model(name: str, dtype: str, heads: str):
    from ..model.heads import repeat_kv_heads

    model, tokenizer = load_model(name, dtype)
    return (repeat_kv_heads(model) if heads == "repeated" else model), tokenizer


def _engine(params: dict, model) -> Engine:
    spec = params["policy"]
    return Engine(model, make_policy(spec), None if spec == "full" else params["budget"])


def _prompt(engine: Engine, params: dict, tokens) -> np.ndarray:
    """The prompt under the cell's regime; the last token's logits."""
    name, kwargs = parse_spec(params["policy"])
    token_by_token = params["regime"] == "hashevict" and name == "hashevict" and kwargs.get("form", "paper") == "paper"
    if token_by_token:  # Algorithm 1 over the prompt: budget N from the first token
        logits = None
        for token in tokens:
            logits = engine.forward([int(token)])
        return logits
    if params["regime"] == "hashevict":  # the authors' form: the prompt uncompressed, budget N afterwards
        saved, engine.budget = engine.budget, None
        logits = engine.forward(tokens)
        engine.budget = saved
        return logits
    logits = engine.forward(tokens)  # SnapKV, PyramidKV: compressed once, one-shot ...
    engine.budget = None  # ... and never again (the codes never evict while decoding)
    return logits


def run_cell(params: dict) -> dict:
    """One variant on one unit: the passkey answer, or the continuation's per-token NLL."""
    model, tokenizer = _model(params["model"], params["dtype"], params["heads"])
    engine = _engine(params, model)
    base = {"kind": document_kind(params["document"])}
    if params["task"] == "passkey":
        tokens, key_at, draw = build_document_prompt(params["model"], params["dtype"], tokenizer,
                                                     params["document"], params["window"], params["length"],
                                                     params["seed"])
        logits = _prompt(engine, params, np.asarray(tokens, dtype=np.int64))
        kept = _needle_retention(engine, key_at, 4)
        answered = answer_key(engine, logits, tokenizer, draw["key"], params["max_new_tokens"])
        return {**base, "key": draw["key"], "depth": draw["depth"], "needle_position": key_at, **answered,
                "needle_retention": kept, "peak_cache_tokens": int(engine.stats.peak_cache_tokens)}
    tokens = document_window(params["model"], params["dtype"], params["document"], WINDOW_TOKENS,
                             params["window"])[:params["length"]]
    prompt = params["prompt"]
    last = _prompt(engine, params, tokens[:prompt])
    # nll[i] is the loss of continuation token i (position prompt + i): the first is predicted
    # by the prompt's last logits, the others by the continuation's own.
    if params["regime"] == "hashevict":
        rows = [last]
        for token in tokens[prompt:-1]:
            rows.append(engine.forward([int(token)], all_logits=True)[0])
        logits = np.stack(rows)  # (continuation, vocab)
    else:  # no eviction after the prompt: one block equals teacher-forced decoding
        logits = np.concatenate([last[None], engine.forward(tokens[prompt:-1], all_logits=True)])
    nll = token_nll(logits, tokens[prompt:])
    return {**base, "tokens": len(nll), "nll": [float(x) for x in nll], "ppl": float(math.exp(nll.mean())),
            "peak_cache_tokens": int(engine.stats.peak_cache_tokens)}


def check_result(params: dict, result: dict) -> None:
    """A record's result is one :func:`run_cell` makes."""
    if params.get("task") == "passkey":
        if not isinstance(result.get("correct"), bool):
            raise ValueError("a forms passkey result must hold 'correct' (bool)")
    elif not (isinstance(result.get("nll"), list) and isinstance(result.get("ppl"), float)):
        raise ValueError("a forms perplexity result must hold 'nll' (list) and 'ppl' (float)")


def label(spec: str, heads: str) -> str:
    """A variant's name in tables: ``snapkv:form=authors@repeated``."""
    return f"{spec}@{heads}"


def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
    """``variants.csv``: each variant's passkey accuracy and mean perplexity, per regime (the verdicts
    are ``docs/forms_verdicts.py``'s, from the records alone)."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        p = r["params"]
        value = float(r["result"]["correct"]) if p["task"] == "passkey" else r["result"]["ppl"]
        groups.setdefault((p["regime"], p["task"], label(p["policy"], p["heads"])), []).append(value)
    rows = [{"regime": k[0], "task": k[1], "variant": k[2], "n": len(v), "mean": float(np.mean(v))}
            for k, v in sorted(groups.items())]
    return [write_csv(folder / "variants.csv", rows)]


EXPERIMENT = Experiment(
    name="forms",
    title="registered: paper form vs authors' form (SnapKV, PyramidKV, HashEvict) on passkey and perplexity",
    cells=cells, run=run_cell, summarise=summarise, cost=cost, table=("variants.csv", ("regime", "task", "variant",
                                                                                      "n", "mean")),
    phase="forms", check_result=check_result)
