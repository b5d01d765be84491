"""Exploratory: how much do two policies agree on what to keep?

Each cell prefills one prose prompt under one policy at budget ``N`` in blocks of ``B``
and records the positions every layer's KV heads hold at the end. The summary compares
every pair of policies that ran on the same prompts:

* per prompt, the **Jaccard overlap** ``|A & B| / |A | B|`` of the two kept sets, for each
  layer and KV head, averaged over layers and heads (:func:`mean_jaccard`): one number
  per prompt, the unit of analysis;
* per pair, budget and block, the mean, standard deviation and count of those numbers
  over the prompts (``overlap.csv``).

A policy compared with itself gives 1; the full cache (no eviction) holds every position,
so its overlap with a policy keeping ``N`` of ``T`` tokens is exactly ``N / T``. Two
policies that score the same signal (H2O and TOVA both read attention, for instance) should
agree more than two that read different ones (key norms, key diversity); how much is what
this measures. It re-tests no paper claim: ``refkv experiment all`` leaves it out.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np

from ..validation import MAX_CONTEXT, check_size, shown
from .design import Experiment, Option
from .grids import grid_axes, policy_cells
from .models import load_model
from .prefill import prefill_or_skip
from .settings import Settings
from .stats import mean_std
from .tables import write_csv
from .text import cell_tokens

__all__ = ["EXPERIMENT", "OVERLAP_PROMPTS", "cells", "check_result", "jaccard", "mean_jaccard", "run_cell", "summarise"]

#: Prose prompts per cell (pydoc segments 0, 1, ...).
OVERLAP_PROMPTS = Option("overlap_prompts", "prompts of the kept-set overlap cells", sizes=(1, 4, 10))
#: Policies of the default grid: two attention readers, two key-geometry readers, the sink.
POLICIES = ("sink", "knorm", "keydiff", "h2o", "tova", "snapkv")


def cells(settings: Settings) -> list[dict]:
    """Prompts x policies x budgets x blocks (the full cache left out: its overlap is ``N / T``)."""
    if settings.registered:
        raise ValueError("overlap is exploratory and has no registered design: run it without --registered")
    model = settings.resolved_model()
    real = model != "tiny"
    if settings.quick:
        length, policies, budgets, blocks = (256 if real else 96), ["sink", "knorm", "keydiff"], [32], [32]
    else:
        length, policies, budgets, blocks = (1024 if real else 512), list(POLICIES), [256 if real else 128], [128]
    policies, budgets, blocks = grid_axes(settings, policies, budgets, blocks)
    base = {"model": model, "dtype": settings.dtype, "seed": settings.seed, "length": length}
    return [cell for segment in range(OVERLAP_PROMPTS.value(settings))
            for cell in policy_cells({**base, "segment": segment}, policies, budgets, blocks)]


def cost(params: dict) -> float:
    """Roughly seconds of one core: one prefill of the prompt."""
    return params["length"] / 256


def run_cell(params: dict) -> dict:
    """The positions each layer's KV heads hold after the prompt: ``kept[layer][head]``
    (a list of positions; a head of an uneven cache lists only its real tokens)."""
    model, _ = load_model(params["model"], params["dtype"])
    tokens = cell_tokens(params)
    engine, _, skipped = prefill_or_skip(params, model, tokens)
    if skipped is not None:
        return {"skipped": skipped}
    kept = [[[int(p) for p in row if p >= 0] for row in cache.positions_or(-1)] for cache in engine.caches]
    return {"tokens": len(tokens), "kept": kept}


#: Most layers and KV heads a kept-set result may list (more than any model refkv reads).
MAX_HEADS = 1 << 12


def check_result(params: dict, result: dict) -> None:
    """A cell's result as :func:`run_cell` makes it, or a one-line ValueError (the record is
    then not counted as finished): ``{"skipped": reason}``, or ``tokens`` (an integer in
    ``[1, MAX_CONTEXT]``) and ``kept[layer][head]``, lists of distinct integer positions in
    ``[0, tokens)``, the same number of heads in every layer."""
    if set(result) == {"skipped"}:
        if not isinstance(result["skipped"], str):
            raise ValueError(f"result.skipped must be a string, got {type(result['skipped']).__name__}")
        return
    if set(result) != {"tokens", "kept"}:
        raise ValueError(f"result must hold 'tokens' and 'kept' (or only 'skipped'), got keys {sorted(result)[:6]}")
    tokens = check_size("result.tokens", result["tokens"], 1, MAX_CONTEXT, why="the hard cap on lengths in tokens")
    kept = result["kept"]
    if not isinstance(kept, list) or not 1 <= len(kept) <= MAX_HEADS:
        raise ValueError(f"result.kept must be a list of 1 to {MAX_HEADS} layers, got {shown(kept)}")
    heads = None
    for layer, rows in enumerate(kept):
        if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_HEADS or (heads is not None and len(rows) != heads):
            raise ValueError(f"result.kept[{layer}] must be a list of KV heads, as many as in layer 0, got "
                             f"{shown(rows)}")
        heads = len(rows)
        for head, row in enumerate(rows):
            if not isinstance(row, list) or len(row) > tokens:
                raise ValueError(f"result.kept[{layer}][{head}] must be a list of at most {tokens} positions, got "
                                 f"{shown(row)}")
            for p in row:
                check_size(f"result.kept[{layer}][{head}] position", p, 0, tokens - 1,
                           why=f"a position of the cell's {tokens} tokens")
            if len(set(row)) != len(row):
                raise ValueError(f"result.kept[{layer}][{head}] lists a position twice")


def jaccard(a, b) -> float:
    """``|A & B| / |A | B|`` of two sets of positions (1 when both are empty)."""
    a, b = set(a), set(b)
    union = len(a | b)
    return 1.0 if union == 0 else len(a & b) / union


def mean_jaccard(kept_a, kept_b) -> float:
    """The Jaccard overlap of two ``kept[layer][head]`` results, averaged over layers and heads."""
    if len(kept_a) != len(kept_b) or any(len(x) != len(y) for x, y in zip(kept_a, kept_b)):
        raise ValueError("kept_a and kept_b must have the same layers and heads")
    return float(np.mean([jaccard(x, y) for la, lb in zip(kept_a, kept_b) for x, y in zip(la, lb)]))


def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
    """``overlap.csv``: per pair of policies, budget and block, the mean Jaccard overlap over
    the prompts both ran on (``prompts``), its standard deviation, minimum and maximum."""
    kept: dict[tuple, dict[str, list]] = {}  # (budget, block, segment) -> policy -> kept[layer][head]
    order: dict[str, None] = {}
    for record in records:
        params, result = record["params"], record["result"]
        if "kept" in result:
            kept.setdefault((params["budget"], params["block"], params["segment"]), {})[params["policy"]] = \
                result["kept"]
            order.setdefault(params["policy"])
    per_pair: dict[tuple, list[float]] = {}
    for (budget, block, segment), by_policy in kept.items():
        for a, b in combinations([p for p in order if p in by_policy], 2):
            try:
                value = mean_jaccard(by_policy[a], by_policy[b])
            except ValueError as err:
                raise ValueError(f"{folder.parent / 'overlap.jsonl'}: the records of {a} and {b} (budget {budget}, "
                                 f"block {block}, prompt {segment}) disagree: {err}; remove them to run them again") \
                    from None
            per_pair.setdefault((a, b, budget, block), []).append(value)
    if not per_pair and records:
        skipped = [(r["params"].get("policy"), r["result"]["skipped"]) for r in records if "skipped" in r["result"]]
        ran = sorted(order)
        why = (f"every cell was skipped ({skipped[0][0]}: {skipped[0][1]})" if len(skipped) == len(records)
               else f"fewer than two policies ran on the same prompts (ran: {', '.join(ran) or 'none'}"
                    + (f"; skipped: {skipped[0][0]}: {skipped[0][1]}" if skipped else "") + ")")
        raise ValueError(f"overlap: no pair of policies to compare: {why}")
    rows = []
    for (a, b, budget, block), values in per_pair.items():
        mean, std, n = mean_std(values)
        rows.append({"policy_a": a, "policy_b": b, "budget": budget, "block": "none" if block is None else block,
                     "jaccard": mean, "jaccard_std": std, "jaccard_min": min(values), "jaccard_max": max(values),
                     "prompts": n})
    columns = ["policy_a", "policy_b", "budget", "block", "jaccard", "jaccard_std", "jaccard_min", "jaccard_max",
               "prompts"]
    return [write_csv(folder / "overlap.csv", rows, columns)]


EXPERIMENT = Experiment(
    name="overlap",
    title="exploratory: Jaccard overlap of the kept sets of two policies, per prompt (layers and heads averaged)",
    cells=cells, run=run_cell, summarise=summarise, cost=cost, options=(OVERLAP_PROMPTS,),
    table=("overlap.csv", ("policy_a", "policy_b", "budget", "block", "jaccard", "jaccard_std", "prompts")),
    exploratory=True, check_result=check_result)
