"""Perplexity of real English prose under eviction: CAOTE Table 4 and MAT Table 3 at small scale.

Each text (1,024-token segments taken in turn from two offline sources, CPython's
``pydoc_data.topics`` prose and the shipped King James narrative chapters, see
:func:`refkv.experiments.text.text_source`) streams through the engine in blocks of
``B`` tokens under budget ``N``; each block's logits are read *before* the block's own
eviction, so every token is predicted from the cache that eviction left it (plus the
earlier tokens of its own block). Perplexity is ``exp`` of the mean negative
log-likelihood of tokens ``1 .. T-1``; tables report the difference to the no-eviction
perplexity of the same text (CAOTE Table 4's "perplexity difference with dense").

Notes
-----
* **Blocks, not single tokens.** MAT evaluates token by token (``B = 1``) and CAOTE
  prefills in blocks of 128. On this CPU a 30-layer forward costs ~60-90 ms per token at
  ``B = 1`` against ~6 ms per token at ``B = 32``, so the default is ``B = 32``:
  within a block, token ``t`` attends to the evicted cache plus the ``t`` earlier
  tokens of its block (at most ``N + B - 1`` keys, KeyDiff Eq. 6), and eviction happens
  after every block. ``--blocks 1`` gives the literal token-by-token measurement.
* **Equal budgets across the two engine modes.** A policy that evicts *after* attention
  (sink, TOVA, H2O, KeyDiff, ...) lets a block attend to up to ``N + B`` keys; one that
  evicts *before* it (HashEvict, MAT: their papers' per-token algorithms) to ``N``. At
  ``B = 32`` this favours the former by up to ``B`` keys, so the default grid shows both
  fair comparisons: every evict-after policy also at budget ``N - B`` (equal peak memory,
  ``peak_cache_tokens`` in the table, the pairs in ``ppl_pairs.csv``), and sink, MAT,
  HashEvict and L2 (plain and with HashEvict's protection) token by token (``B = 1``,
  every text, smallest budget), where the two modes differ by one key; their gaps are
  paired with the dense run of the same text (at ``B = 32``: without a budget the block
  size changes only rounding).
* **Comparable baselines.** Beside each policy's default the grid runs
  :data:`~refkv.experiments.grids.COMPARABLE_BASELINES` and MAT's beta x L_s grid; the
  ``configuration`` column spells out every parameter and ``best_of_grid`` marks MAT's
  best cell per budget and block (MAT Sec. 5.1 reports its best beta).
* **Intervals.** ``gap``: the pooled gap (the perplexity of all texts' tokens together
  minus the dense one; ``delta_ppl`` is the mean of the per-text gaps); ``gap_low`` /
  ``gap_high``: its 95% paired block bootstrap (blocks of 64 tokens resampled within each
  text), ``tokens`` its sample size; ``gap_interval`` is rounded to the digits the
  interval supports.
* **Positions.** Keys keep their original RoPE positions (the seed papers' setting);
  MAT's StreamingLLM-style position rolling is not used. All prompts are inside
  SmolLM2's 8K training window, where rolling is not needed.
* **Where eviction bites.** Tokens at positions ``< N`` are predicted before any
  eviction and have exactly the dense likelihood; the record also keeps the
  perplexity over positions ``>= N`` alone (``ppl_evicted``), the part a policy can change.
* The log-softmax is computed in float64 whatever the model dtype.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..model.config import TINY
from ..policies.spec import canonical_spec, make_policy, parse_spec
from .design import Experiment, Option
from .grids import (
    COMPARABLE_BASELINES,
    FAST_CAOTE,
    best_of_grid,
    configuration,
    default_policies,
    equal_memory_budget,
    format_spec_label,
    grid_axes,
    mat_grid,
)
from .models import load_model
from .plots import _none_last
from .prefill import prefill_or_skip
from .settings import MAX_TOKENS, Settings
from .stats import mean_std, perplexity_gap
from .tables import write_csv
from .text import prose_tokens, text_source

__all__ = ["EXPERIMENT", "TEXTS", "TEXT_LENGTH", "cells", "paired_gaps", "run_cell", "summarise", "supported_digits",
           "token_nll"]

#: Perplexity texts (non-overlapping prose segments) per cell.
TEXTS = Option("texts", "perplexity texts per cell", sizes=(1, 2, 8))
#: Tokens per perplexity text (the tiny model's default grid uses 512, its quick grid 192);
#: the registered design's attention-loss and geometry prompts are the starts of such texts.
TEXT_LENGTH = Option("text_length", "tokens per perplexity text", sizes=(256, 1024, 1024), low=2, high=MAX_TOKENS,
                     metavar="T")

#: Policies the default grid also runs token by token (B = 1): MAT vs sink, HashEvict vs L2.
TOKEN_BY_TOKEN = ("sink", "mat", "hashevict", "knorm")


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of ``targets`` (n,) under ``logits`` (n, vocab), in float64."""
    z = np.asarray(logits, dtype=np.float64)
    top = z.max(axis=-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(z - top).sum(axis=-1))
    return log_norm - z[np.arange(len(targets)), targets]


#: The registered design's perplexity grid (``docs/guide/registration.rst``): texts per source
#: for verdicts and for choosing MAT's configuration, the policies in blocks (claims L1, C1)
#: and token by token (M1, H1), and HashEvict's seeds.
REGISTERED_TEXTS_PER_SOURCE = 8
REGISTERED_SELECTION_TEXTS_PER_SOURCE = 2
REGISTERED_BLOCKED = ("keydiff", "snapkv", "tova", "h2o", "caote:base=h2o", "caote:base=tova", "caote:base=snapkv")
REGISTERED_TOKEN_BY_TOKEN = ("sink", "knorm:recent=10,sink=4", "hashevict:seed=0", "hashevict:seed=1",
                             "hashevict:seed=2")
REGISTERED_BUDGET = 128
REGISTERED_BLOCK = 32


def registered_texts(purpose: str) -> list[tuple[str, int]]:
    """The registered ``(source, segment)`` texts: ``"verdict"`` (segments 0-7 of each source)
    or ``"selection"`` (segments 8-9, MAT's configuration only); never both."""
    from ..model.sample_text import PROSE_SOURCES

    first, count = ((0, REGISTERED_TEXTS_PER_SOURCE) if purpose == "verdict" else
                    (REGISTERED_TEXTS_PER_SOURCE, REGISTERED_SELECTION_TEXTS_PER_SOURCE))
    return [(source, segment) for segment in range(first, first + count) for source in PROSE_SOURCES]


def registered_cells(settings: Settings) -> list[dict]:
    """The registered perplexity grid.

    Without ``policies``: the full cache and :data:`REGISTERED_BLOCKED` at ``N = 128``,
    ``B = 32`` on the 16 verdict texts, :data:`REGISTERED_TOKEN_BY_TOKEN` at ``B = 1`` on
    them, and MAT's grid (:func:`~refkv.experiments.grids.mat_grid`) at ``N = 128``,
    ``B = 32`` on the 4 selection texts with their full-cache references. With
    ``policies`` = the one MAT spec chosen on the selection texts: that spec at ``B = 1``
    on the verdict texts (claim M1).
    """
    model = settings.resolved_model()
    length = TEXT_LENGTH.given(settings) or 1024
    n_layers = TINY.n_layers if model == "tiny" else None

    def cell(text, policy, budget, block):
        return {"model": model, "dtype": settings.dtype, "seed": settings.seed, "design": "registered",
                "text": text[0], "segment": text[1], "length": length, "policy": policy, "budget": budget,
                "block": block}

    verdict, selection = registered_texts("verdict"), registered_texts("selection")
    if settings.policies is not None:
        chosen = [canonical_spec(p) for p in settings.policies]
        if len(chosen) != 1 or parse_spec(chosen[0])[0] != "mat":
            raise ValueError(f"policies must be the one MAT spec chosen on the selection texts for the registered "
                             f"grid, got {list(settings.policies)}")
        return [cell(text, chosen[0], REGISTERED_BUDGET, 1) for text in verdict]
    out = []
    for text in verdict:
        out.append(cell(text, "full", None, REGISTERED_BLOCK))
        out.extend(cell(text, p, REGISTERED_BUDGET, REGISTERED_BLOCK) for p in REGISTERED_BLOCKED)
        out.extend(cell(text, canonical_spec(p), REGISTERED_BUDGET, 1) for p in REGISTERED_TOKEN_BY_TOKEN)
    for text in selection:
        out.append(cell(text, "full", None, REGISTERED_BLOCK))
        out.extend(cell(text, spec, REGISTERED_BUDGET, REGISTERED_BLOCK)
                   for spec in mat_grid(REGISTERED_BUDGET, n_layers))
    return out


def cells(settings: Settings) -> list[dict]:
    """The grid: text segments x (dense + policies x budgets x block sizes).

    The default (and ``full``) grid adds, beside each policy's default configuration, the
    comparable baselines of :data:`~refkv.experiments.grids.COMPARABLE_BASELINES`, MAT's
    grid over beta x L_s (:func:`~refkv.experiments.grids.mat_grid`), every policy that
    evicts after attention also at budget ``N - B`` (equal peak memory with the evict-before
    policies at ``N``, :func:`~refkv.experiments.grids.equal_memory_budget`), and the
    token-by-token (``B = 1``) cells of :data:`TOKEN_BY_TOKEN` on every text.
    ``registered``: :func:`registered_cells`.
    """
    if settings.registered:
        return registered_cells(settings)
    model = settings.resolved_model()
    real = model != "tiny"
    texts = TEXTS.value(settings)
    length = TEXT_LENGTH.given(settings) or (TEXT_LENGTH.value(settings) if real or settings.quick else 512)
    if settings.quick:
        length = TEXT_LENGTH.given(settings) or (256 if real else 192)
        policies, budgets, blocks_ = ["sink", "keydiff"], ([64] if real else [48]), [16]
    else:
        policies, budgets, blocks_ = default_policies((*FAST_CAOTE, *COMPARABLE_BASELINES)), [128, 256], [32]
    default_grid = not (settings.quick or settings.policies or settings.budgets or settings.blocks)
    policies, budgets, blocks_ = grid_axes(settings, policies, budgets, blocks_)
    out = []
    for number in range(texts):
        source, segment = text_source(number)  # the two prose sources in turn
        base = {"model": model, "dtype": settings.dtype, "seed": settings.seed, "text": source,
                "length": length, "segment": segment}
        for block in blocks_:
            out.append({**base, "policy": "full", "budget": None, "block": block})
            for policy in policies:
                if policy != "full":
                    out.extend({**base, "policy": policy, "budget": budget, "block": block} for budget in budgets)
        if not default_grid:
            continue
        n_layers = TINY.n_layers if model == "tiny" else None
        for block in blocks_:
            for budget in budgets:
                # MAT Sec. 5.1's search (its default beta = N // 4, L_s = 2 is in the list already).
                out.extend({**base, "policy": spec, "budget": budget, "block": block}
                           for spec in mat_grid(budget, n_layers) if spec not in policies)
                # Equal peak memory: the evict-after policies at N - B.
                for policy in policies:
                    matched = equal_memory_budget(policy, budget, block)
                    if matched is not None and matched not in budgets:
                        out.append({**base, "policy": policy, "budget": matched, "block": block})
        # Token by token (B = 1, MAT's and HashEvict's own setting) for the pairs whose claims
        # compare a policy that evicts before attention with one that evicts after it.
        for policy in policies:
            if parse_spec(policy)[0] in TOKEN_BY_TOKEN:
                out.append({**base, "policy": policy, "budget": min(budgets), "block": 1})
    return out


def cost(params: dict) -> float:
    """Roughly CPU seconds: ~6.5 ms per token at B = 32, more for small blocks."""
    block = params["block"] or params["length"]
    return params["length"] * (0.0045 + 0.06 / block) + 1.0


def run_cell(params: dict) -> dict:
    """Stream the text through the engine; the NLL of every token under eviction."""
    model, _ = load_model(params["model"], params["dtype"])
    tokens = prose_tokens(params["model"], params["dtype"], params["length"], params["segment"],
                          params.get("text", "pydoc_prose"))
    nll = np.empty(len(tokens) - 1)

    def score_block(start: int, logits: np.ndarray) -> None:
        # logits[i] predicts token start + i + 1; the last token predicts nothing.
        targets = tokens[start + 1:start + len(logits) + 1]
        nll[start:start + len(targets)] = token_nll(logits[:len(targets)], targets)

    engine, _, skipped = prefill_or_skip(params, model, tokens, on_block=score_block)
    if skipped is not None:
        return {"skipped": skipped}
    budget = params["budget"]
    first_evicted = budget if budget is not None else len(tokens)
    # nll[i] is the loss of token i + 1, predicted at position i.
    evicted = nll[first_evicted:] if first_evicted < len(nll) else np.empty(0)
    result = {"tokens": len(nll), "nll_sum": float(nll.sum()), "ppl": float(math.exp(nll.mean())),
              "evicted_tokens": len(evicted), "nll_evicted_sum": float(evicted.sum()),
              "ppl_evicted": float(math.exp(evicted.mean())) if len(evicted) else None,
              "peak_cache_tokens": int(engine.stats.peak_cache_tokens)}
    # Every token's loss: the dense reference's for any budget's suffix, a policy's for the
    # paired block bootstrap of its gap (refkv.experiments.stats.perplexity_gap).
    result["nll"] = [float(x) for x in nll]
    return result


def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
    """``ppl.csv``: per policy, budget and block, the perplexity gap to dense with its 95%
    interval (paired block bootstrap over tokens, blocks of 64 resampled within each text:
    :func:`refkv.experiments.stats.perplexity_gap`), the configuration every parameter
    spells out, the peak cache size, and MAT's best cell of its grid."""
    dense = {(_text(r["params"]), r["params"]["block"]): r["result"] for r in records
             if r["params"]["policy"] == "full"}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        p = r["params"]
        if p["policy"] == "full" or "skipped" in r["result"]:
            continue
        groups.setdefault((p["policy"], p["budget"], p["block"]), []).append(r)
    rows = []
    for block in sorted({k[1] for k in dense}, key=lambda b: -1 if b is None else b):
        sub = [v for (s, b), v in dense.items() if b == block]
        rows.append({"policy": "full", "label": "no eviction", "configuration": "", "budget": None, "block": block,
                     "ppl": mean_std(v["ppl"] for v in sub)[0], "delta_ppl": 0.0, "delta_ppl_std": 0.0,
                     "ppl_evicted": None, "delta_ppl_evicted": None, "segments": len(sub)})
    for (policy, budget, block), group in groups.items():
        deltas, deltas_ev, ppls, ppls_ev, pairs = [], [], [], [], []
        for r in sorted(group, key=lambda r: _text(r["params"])):
            ref = dense.get((_text(r["params"]), block)) or _any_block(dense, _text(r["params"]))
            res = r["result"]
            ppls.append(res["ppl"])
            if ref is None:
                continue
            deltas.append(res["ppl"] - ref["ppl"])
            if "nll" in res and "nll" in ref and len(res["nll"]) == len(ref["nll"]):
                pairs.append((res["nll"], ref["nll"]))
            if res["evicted_tokens"]:
                ref_ev = math.exp(float(np.mean(ref["nll"][r["params"]["budget"]:])))
                ppls_ev.append(res["ppl_evicted"])
                deltas_ev.append(res["ppl_evicted"] - ref_ev)
        d_mean, d_std, n = mean_std(deltas)
        row = {"policy": policy, "label": format_spec_label(policy), "configuration": configuration(policy),
               "budget": budget, "block": block, "peak_cache_tokens": max(r["result"]["peak_cache_tokens"]
                                                                        for r in group),
               "ppl": mean_std(ppls)[0], "delta_ppl": d_mean, "delta_ppl_std": d_std,
               "ppl_evicted": mean_std(ppls_ev)[0], "delta_ppl_evicted": mean_std(deltas_ev)[0],
               "segments": n, "wall_time_s": sum(r["wall_time_s"] for r in group)}
        row.update(_gap_interval(pairs))
        rows.append(row)
    best_of_grid(rows, "mat", by="delta_ppl")
    rows.sort(key=lambda r: (_none_last(r["budget"]), _none_last(r["block"]), r["policy"] != "full",
                             r["delta_ppl"] if r["delta_ppl"] is not None else 0.0))
    columns = ["policy", "label", "configuration", "budget", "block", "peak_cache_tokens", "ppl", "delta_ppl",
               "gap", "gap_low", "gap_high", "gap_interval", "tokens", "delta_ppl_std", "ppl_evicted",
               "delta_ppl_evicted", "segments", "best_of_grid", "wall_time_s"]
    written = [write_csv(folder / "ppl.csv", rows, columns)]
    written.append(write_csv(folder / "ppl_pairs.csv", paired_gaps(records)))
    from . import plots

    written += plots.perplexity_bars(rows, folder)
    return written


def paired_gaps(records: list[dict]) -> list[dict]:
    """``ppl(A) - ppl(B)`` with its 95% paired block-bootstrap interval, for every pair of
    policies at the same budget and block on the texts both ran (``comparison`` = "same
    budget"), and for every evict-before policy at ``N`` against every evict-after policy at
    ``N - B`` (``"equal peak memory"``, see :func:`~refkv.experiments.grids.equal_memory_budget`)."""
    nll: dict[tuple, dict[int, list]] = {}
    for r in records:
        p, res = r["params"], r["result"]
        if p["policy"] != "full" and "nll" in res:
            nll.setdefault((p["policy"], p["budget"], p["block"]), {})[_text(p)] = res["nll"]
    keys = sorted(nll, key=lambda k: (_none_last(k[1]), _none_last(k[2]), k[0]))
    candidates = [(a, b, "same budget") for i, a in enumerate(keys) for b in keys[i + 1:] if a[1:] == b[1:]]
    for a in keys:
        if make_policy(a[0]).evict_before_attention and a[1] is not None and a[2] is not None:
            candidates += [(a, b, "equal peak memory") for b in keys
                           if b[2] == a[2] and b[1] == a[1] - a[2] and not make_policy(b[0]).evict_before_attention]
    rows = []
    for a, b, comparison in candidates:
        texts = sorted(set(nll[a]) & set(nll[b]))
        if not texts or any(len(nll[a][s]) != len(nll[b][s]) for s in texts):
            continue
        interval = perplexity_gap([nll[a][s] for s in texts], [nll[b][s] for s in texts], block=64)
        rows.append({"policy_a": a[0], "budget_a": a[1], "policy_b": b[0], "budget_b": b[1], "block": a[2],
                     "comparison": comparison, "texts": len(texts), "tokens": interval.n,
                     "difference": interval.estimate, "low": interval.low, "high": interval.high,
                     "interval": interval.format(supported_digits(interval.high - interval.low))})
    return rows


def _gap_interval(pairs: list[tuple[list, list]]) -> dict:
    """The pooled gap ``ppl(policy) - ppl(dense)`` over the paired texts with its 95% paired block
    bootstrap interval, rounded to what the interval supports; empty without per-token losses
    (records written before they were kept)."""
    if not pairs:
        return {}
    interval = perplexity_gap([a for a, _ in pairs], [b for _, b in pairs], block=64)
    digits = supported_digits(interval.high - interval.low)
    return {"gap": interval.estimate, "gap_low": interval.low, "gap_high": interval.high, "tokens": interval.n,
            "gap_interval": interval.format(digits)}


def supported_digits(width: float) -> int:
    """Decimals an estimate with an interval of ``width`` supports: the interval's first
    significant digit, plus one (0 to 4 decimals). A width of 2.3 gives 1 (``+5.2``), 0.04
    gives 3 (``+0.213``)."""
    if not math.isfinite(width) or width <= 0:
        return 4
    return max(0, min(4, 1 - math.floor(math.log10(width))))


EXPERIMENT = Experiment(
    name="perplexity",
    title="perplexity of English prose under eviction, gap to no eviction (CAOTE Table 4, MAT Table 3)",
    cells=cells, run=run_cell, summarise=summarise, cost=cost, options=(TEXTS, TEXT_LENGTH),
    table=("ppl.csv", ("label", "budget", "block", "ppl", "delta_ppl")))


def _text(params: dict) -> tuple[str, int]:
    """A cell's text: ``(source, segment)`` (records before the second source are pydoc's)."""
    return params.get("text", "pydoc_prose"), params["segment"]


def _any_block(dense: dict, text: tuple[str, int]) -> dict | None:
    """A dense record of ``text`` at any block size (without a budget, B changes only rounding)."""
    for (key, _), result in sorted(dense.items(), key=lambda item: _none_last(item[0][1])):
        if key == text:
            return result
    return None
