"""Phase two's text grids: perplexity, attention loss and geometry over the 21 shipped documents.

The design is registered in ``docs/experiment_registration_phase2.json``; this module builds
its grids with phase one's code (the same metric functions, fed the documents' windows
instead of the two prose sources). Three experiments, each run only by name (``phase=2``):

``perplexity2`` (claims L1, C1, M1, H1)
    Windows 0 and 1 (1,024 tokens each) of every document
    (:func:`refkv.experiments.documents.document_window`) stream through the engine exactly as
    phase one's perplexity cells do (each block's logits read before the block's eviction,
    :func:`refkv.experiments.perplexity.token_nll`): the full cache and the blocked policies
    of L1 and C1 at ``N = 128``, ``B = 32``; sink, MAT (phase one's choice,
    :data:`MAT_SPEC`), L2 with HashEvict's protection and HashEvict with each of its 3 hash
    seeds token by token (``B = 1``) at ``N = 128``. Every token's loss is kept (the
    two-stage bootstrap), and each seed is its own cell (the per-seed display).
``attention_loss2`` (A1, A1-unmatched)
    The first 512 tokens of each perplexity window, token by token at ``N = 256``: the
    attention each step loses (:func:`refkv.experiments.attention_loss.attended_sets` and
    :func:`~refkv.experiments.attention_loss.step_losses`, phase one's code) for HashEvict
    (3 seeds), L2 with HashEvict's protection (primary), plain L2 (secondary) and H2O.
``geometry2`` (G1, G1-all, G2, S1)
    On the 512-token prompts: one dense ``cosine`` cell (KeyDiff Fig. 2, common query set
    and all queries, :func:`refkv.experiments.geometry.common_query_statistics`) and one
    ``hamming`` cell at 8 and 32 bits (4 projections, as phase one); on the 1,024-token
    windows, ``retention`` cells (the kept keys' ``log det(K^T K)``) of KeyDiff, SnapKV, TOVA,
    H2O and sink at ``N = 256``, ``B = 128``.

``--policies`` runs a subset of a grid's policies (the full cache and the dense cells always
run, as every comparison needs them), so the claims can run in priority order; ``hashevict``
alone names its 3 seeded cells. The estimated cost on SmolLM2 (one core; ``--dry-run`` prints
it per cell, :func:`cost_table` per part):

========================================  ======  ============
part (``--policies``)                     cells   core-minutes
========================================  ======  ============
perplexity2: L1, C1 (blocks of 32)        336     ~42
geometry2 (G1, G1-all, S1, G2)            294     ~47
perplexity2: M1 (``sink`` and MAT)        84      ~94
perplexity2: H1 (``hashevict``, L2 4+10)  168     ~188
attention_loss2: A1 (all six)             252     ~170
========================================  ======  ============
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..attention import attention_weights
from ..policies.spec import canonical_spec
from .attention_loss import attended_sets, step_losses
from .attention_loss import cost as _attention_cost
from .captures import dense_capture
from .design import Experiment
from .documents import document_kind, document_names, document_window
from .geometry import (
    _received_visible,
    _spearman,
    _unit,
    common_query_statistics,
    hamming_correlation,
    log_volume,
    mean_pairwise_cosine,
)
from .geometry import cost as _geometry_cost
from .haystack import DOCUMENT_WINDOWS, WINDOW_TOKENS
from .models import load_model
from .perplexity import cost as _perplexity_cost
from .perplexity import token_nll
from .prefill import policy_error, prefill_or_skip
from .settings import Settings
from .tables import write_csv

__all__ = ["ATTENTION_LOSS", "ATTENTION_POLICIES", "BLOCKED", "GEOMETRY", "HASHEVICT_SEEDS", "MAT_SPEC",
           "PERPLEXITY", "RETENTION_POLICIES", "TOKEN_BY_TOKEN", "cost_table", "window_tokens"]

#: Perplexity claims' budget and block (L1, C1) and the token-by-token block (M1, H1).
BUDGET, BLOCK = 128, 32
#: HashEvict's registered hash seeds (its per-unit value is their mean; each seed is published).
HASHEVICT_SEEDS = tuple(f"hashevict:seed={s}" for s in range(3))
#: MAT's configuration: phase one's choice on its selection texts (registered, not re-chosen).
MAT_SPEC = "mat:beta=8,shallow_layers=10"
#: Policies in blocks of 32 (L1: KeyDiff against SnapKV, TOVA, H2O; C1: CAOTE on each of them).
BLOCKED = ("keydiff", "snapkv", "tova", "h2o", "caote:base=h2o", "caote:base=tova", "caote:base=snapkv")
#: Policies token by token (M1: MAT against sink; H1: HashEvict against L2 with its protection).
TOKEN_BY_TOKEN = ("sink", MAT_SPEC, "knorm:recent=10,sink=4", *HASHEVICT_SEEDS)
#: A1: the per-step attention loss of these, token by token at N = T/2 (matched L2 primary, plain L2 secondary).
ATTENTION_POLICIES = (*HASHEVICT_SEEDS, "knorm:recent=10,sink=4", "knorm", "h2o")
#: Prompts of the per-prompt claims: the first 512 tokens of each perplexity window.
PROMPT_TOKENS = 512
#: G2's policies, budget and block (on the 1,024-token windows).
RETENTION_POLICIES = ("keydiff", "snapkv", "tova", "h2o", "sink")
RETENTION_BUDGET, RETENTION_BLOCK = 256, 128
#: S1's code lengths and projections per Hamming distance (phase one's).
BITS, PROJECTIONS = (8, 32), 4


# -- the windows and their dense captures ---------------------------------------------------------
def window_tokens(params: dict) -> np.ndarray:
    """A cell's tokens: the first ``params["length"]`` tokens of window ``params["window"]``
    (1,024 tokens) of ``params["document"]``."""
    tokens = document_window(params["model"], params["dtype"], params["document"], WINDOW_TOKENS,
                             params["window"])
    if not 2 <= params["length"] <= WINDOW_TOKENS:
        raise ValueError(f"length must be in [2, {WINDOW_TOKENS}], got {params['length']}")
    return tokens[:params["length"]]


_CAPTURE: dict[tuple, list] = {}


def _dense_layers(params: dict):
    """The cell's model and, per layer, ``(layer, capture, weights)`` with the (Hkv, g, T, T)
    causal attention of the dense pass (:func:`refkv.experiments.captures.dense_capture`);
    one prompt's capture is kept per process, so a prompt's cells that follow each other share it."""
    model, _ = load_model(params["model"], params["dtype"])
    key = (params["model"], params["dtype"], params["document"], params["window"], params["length"])
    if key not in _CAPTURE:
        _CAPTURE.clear()
        _CAPTURE[key] = dense_capture(model, window_tokens(params))[0]
    captures = _CAPTURE[key]
    positions = np.arange(params["length"], dtype=np.int64)                          # (T,)
    kv_positions = np.broadcast_to(positions, (model.config.n_kv_heads, len(positions)))  # (Hkv, T)

    def each():
        for layer, cap in enumerate(captures):
            yield layer, cap, attention_weights(cap.q, cap.k, positions, kv_positions)

    return model, each()


# -- cells ------------------------------------------------------------------------------------
def _windows(settings: Settings, length: int) -> list[dict]:
    common = {"model": settings.resolved_model(), "dtype": settings.dtype, "design": "phase2", "length": length}
    return [{**common, "document": name, "window": window} for name in document_names()
            for window in DOCUMENT_WINDOWS["perplexity"]]


def _chosen(settings: Settings, grid: tuple[str, ...]) -> set[str]:
    """The grid's policies ``--policies`` names (all without it); ``hashevict`` names its seeds.

    Raises
    ------
    ValueError
        Naming a spec the grid does not hold, and the ones it does.
    """
    if settings.policies is None:
        return set(grid)
    chosen = set()
    for spec in settings.policies:
        spec = canonical_spec(spec)
        if spec == "hashevict" and any(p in grid for p in HASHEVICT_SEEDS):
            chosen.update(p for p in HASHEVICT_SEEDS if p in grid)
        elif spec in grid:
            chosen.add(spec)
        elif spec != "full":
            raise ValueError(f"policies must name policies of this registered grid ({', '.join(grid)}, or "
                             f"hashevict for its seeds), got {spec!r}")
    return chosen


def _no_axes(settings: Settings) -> None:
    if settings.budgets is not None or settings.blocks is not None:
        raise ValueError("budgets and blocks are fixed by phase two's registration: give neither")


def perplexity_cells(settings: Settings) -> list[dict]:
    """The full cache and :data:`BLOCKED` at ``N = 128, B = 32``, :data:`TOKEN_BY_TOKEN` at ``B = 1``,
    on the 42 perplexity windows (``--policies``: a subset)."""
    _no_axes(settings)
    chosen = _chosen(settings, (*BLOCKED, *TOKEN_BY_TOKEN))
    out = []
    for window in _windows(settings, WINDOW_TOKENS):
        out.append({**window, "policy": "full", "budget": None, "block": BLOCK})
        out += [{**window, "policy": p, "budget": BUDGET, "block": BLOCK} for p in BLOCKED if p in chosen]
        out += [{**window, "policy": p, "budget": BUDGET, "block": 1} for p in TOKEN_BY_TOKEN if p in chosen]
    return out


def attention_cells(settings: Settings) -> list[dict]:
    """:data:`ATTENTION_POLICIES` token by token at ``N = 256`` on the 42 prompts of 512 tokens."""
    _no_axes(settings)
    chosen = _chosen(settings, ATTENTION_POLICIES)
    return [{**prompt, "kind": "step_loss", "policy": p, "budget": PROMPT_TOKENS // 2, "block": 1}
            for prompt in _windows(settings, PROMPT_TOKENS) for p in ATTENTION_POLICIES if p in chosen]


def geometry_cells(settings: Settings) -> list[dict]:
    """Per window: a ``cosine`` and a ``hamming`` cell on its first 512 tokens, and ``retention``
    cells of :data:`RETENTION_POLICIES` (``--policies``: a subset) on all 1,024 at ``N = 256, B = 128``."""
    _no_axes(settings)
    chosen = _chosen(settings, RETENTION_POLICIES)
    out = []
    for prompt in _windows(settings, PROMPT_TOKENS):
        out.append({**prompt, "kind": "cosine"})
        out.append({**prompt, "kind": "hamming", "bits": list(BITS), "projections": PROJECTIONS,
                    "seed": settings.seed})
    for window in _windows(settings, WINDOW_TOKENS):
        out += [{**window, "kind": "retention", "policy": p, "budget": RETENTION_BUDGET, "block": RETENTION_BLOCK}
                for p in RETENTION_POLICIES if p in chosen]
    return out


def cost_table(settings: Settings | None = None) -> list[dict]:
    """Cells and estimated core-minutes of each part of the three grids (the module's table)."""
    settings = settings or Settings(model="smollm2")
    parts = {"perplexity2: L1, C1": [c for c in perplexity_cells(settings) if c["block"] == BLOCK],
             "geometry2": geometry_cells(settings),
             "perplexity2: M1": [c for c in perplexity_cells(settings) if c["policy"] in ("sink", MAT_SPEC)],
             "perplexity2: H1": [c for c in perplexity_cells(settings)
                                 if c["block"] == 1 and c["policy"] not in ("sink", MAT_SPEC)],
             "attention_loss2: A1": attention_cells(settings)}
    costs = {"perplexity2": _perplexity_cost, "geometry2": _geometry_cost, "attention_loss2": _attention_cost}
    return [{"part": name, "cells": len(cells_),
             "core_minutes": round(sum(costs[name.split(":")[0]](c) for c in cells_) / 60)}
            for name, cells_ in parts.items()]


# -- running a cell ---------------------------------------------------------------------------
def run_perplexity(params: dict) -> dict:
    """Stream the window through the engine; every token's loss under eviction (phase one's
    :func:`refkv.experiments.perplexity.run_cell`, on a document's window)."""
    model, _ = load_model(params["model"], params["dtype"])
    tokens = window_tokens(params)
    nll = np.empty(len(tokens) - 1)

    def score_block(start: int, logits: np.ndarray) -> None:
        # logits[i] predicts token start + i + 1; the window's last token predicts nothing.
        targets = tokens[start + 1:start + len(logits) + 1]
        nll[start:start + len(targets)] = token_nll(logits[:len(targets)], targets)

    engine, _, skipped = prefill_or_skip(params, model, tokens, on_block=score_block)
    if skipped is not None:
        return {"skipped": skipped}
    return {"document_kind": document_kind(params["document"]), "tokens": len(nll), "ppl": float(math.exp(nll.mean())),
            "peak_cache_tokens": int(engine.stats.peak_cache_tokens), "nll": [float(x) for x in nll]}


def run_step_loss(params: dict) -> dict:
    """Phase one's per-step attention loss (:mod:`refkv.experiments.attention_loss`) on a window's prompt."""
    model, _ = load_model(params["model"], params["dtype"])
    budget = params["budget"]
    reason = policy_error(params["policy"], budget, 1, model.config)
    if reason is not None:
        return {"skipped": reason}
    attended = attended_sets(model, params["policy"], window_tokens(params), budget)
    _, layers = _dense_layers(params)
    by_layer = [float(step_losses(weights.mean(axis=1), attended[layer], budget).mean())
                for layer, _cap, weights in layers]  # weights (Hkv, g, T, T)
    return {"document_kind": document_kind(params["document"]), "loss_by_layer": by_layer,
            "mean_loss": float(np.mean(by_layer)), "steps": params["length"] - budget}


def run_geometry(params: dict) -> dict:
    """A ``cosine``, ``hamming`` or ``retention`` cell, computed as phase one's
    (:mod:`refkv.experiments.geometry`) on a window of a document."""
    kind = params["kind"]
    base = {"document_kind": document_kind(params["document"])}
    if kind == "retention":
        model, _ = load_model(params["model"], params["dtype"])
        engine, _, skipped = prefill_or_skip(params, model, window_tokens(params))
        if skipped is not None:
            return {"skipped": skipped}
        return {**base, "log_volume": [[log_volume(c.keys[h]) for h in range(c.n_kv_heads)] for c in engine.caches]}
    _, layers = _dense_layers(params)
    if kind == "hamming":
        seeds = range(params["seed"], params["seed"] + params["projections"])
        out = {str(bits): [] for bits in params["bits"]}
        for _, cap, weights in layers:
            for bits in params["bits"]:
                out[str(bits)].append(hamming_correlation(cap.q, cap.k, weights, bits, seeds).tolist())
        return {**base, "pearson": out}
    if kind != "cosine":
        raise ValueError(f"kind must be 'cosine', 'retention' or 'hamming', got {kind!r}")
    anchor, pairwise, common = [], [], {}
    for _, cap, weights in layers:
        group = weights.mean(axis=1)                                   # (Hkv, T, T)
        received = _received_visible(group)                            # (Hkv, T)
        for name, values in common_query_statistics(cap.k, group).items():
            common.setdefault(name, []).append(values)                 # per layer, per KV head
        unit = _unit(cap.k)
        anchor_score = -(unit @ _unit(unit.mean(axis=1))[:, :, None])[..., 0]   # KeyDiff Eq. 8
        neg_cos = -mean_pairwise_cosine(cap.k)
        anchor.append([_spearman(anchor_score[h], received[h]) for h in range(len(received))])
        pairwise.append([_spearman(neg_cos[h], received[h]) for h in range(len(received))])
    return {**base, "spearman_anchor": anchor, "spearman_pairwise": pairwise, "common_queries": common}


# -- checks and summaries -----------------------------------------------------------------------
def _check(required: dict):
    def check(params: dict, result: dict) -> None:
        if "skipped" in result:
            return
        for name, kind in required.items():
            if not isinstance(result.get(name), kind):
                raise ValueError(f"a phase-two result must hold {name!r} ({kind.__name__})")
    return check


def _check_geometry(params: dict, result: dict) -> None:
    need = {"cosine": "common_queries", "hamming": "pearson", "retention": "log_volume"}.get(params.get("kind"))
    if "skipped" not in result and (need is None or need not in result):
        raise ValueError(f"a phase-two geometry result must hold {need!r}")


def _summary(name: str, value):
    """A console table: per setting, the mean of ``value(result)`` over the windows that ran."""
    def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
        groups: dict[tuple, list[float]] = {}
        for r in records:
            p = r["params"]
            if "skipped" not in r["result"]:
                key = (p.get("kind", ""), p.get("policy", "dense"), p.get("budget"), p.get("block"))
                groups.setdefault(key, []).append(value(r["result"]))
        rows = [{"kind": k[0], "policy": k[1], "budget": k[2], "block": k[3], "mean": float(np.nanmean(v)),
                 "windows": len(v)} for k, v in sorted(groups.items(), key=lambda item: str(item[0]))]
        return [write_csv(folder / name, rows, ["kind", "policy", "budget", "block", "mean", "windows"])]
    return summarise


def _geometry_value(result: dict) -> float:
    if "log_volume" in result:
        return float(np.mean(result["log_volume"]))
    if "pearson" in result:
        return float(np.nanmean(result["pearson"][str(BITS[-1])]))
    return float(-np.nanmean(result["common_queries"]["spearman"]))


PERPLEXITY = Experiment(
    name="perplexity2",
    title="phase two (registered): perplexity over 2 windows of the 21 shipped documents (claims L1, C1, M1, H1)",
    cells=perplexity_cells, run=run_perplexity, summarise=_summary("ppl.csv", lambda r: r["ppl"]),
    cost=_perplexity_cost, table=("ppl.csv", ("policy", "budget", "block", "mean", "windows")), phase=2,
    check_result=_check({"ppl": float, "nll": list}))
ATTENTION_LOSS = Experiment(
    name="attention_loss2",
    title="phase two (registered): per-step attention loss on the 42 prompts of 512 tokens (claims A1, A1-unmatched)",
    cells=attention_cells, run=run_step_loss, summarise=_summary("step_loss.csv", lambda r: r["mean_loss"]),
    cost=_attention_cost, table=("step_loss.csv", ("policy", "budget", "mean", "windows")), phase=2,
    check_result=_check({"mean_loss": float, "loss_by_layer": list}))
GEOMETRY = Experiment(
    name="geometry2",
    title="phase two (registered): key geometry on the documents' windows (claims G1, G1-all, G2, S1)",
    cells=geometry_cells, run=run_geometry, summarise=_summary("geometry.csv", _geometry_value),
    cost=_geometry_cost, table=("geometry.csv", ("kind", "policy", "mean", "windows")), phase=2,
    check_result=_check_geometry)
#: The three experiments, in the order the registry lists them.
EXPERIMENTS = (PERPLEXITY, ATTENTION_LOSS, GEOMETRY)
