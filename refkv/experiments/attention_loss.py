"""Attention loss of a ranking (HashEvict App. D, Table 3) and attention-output error (CAOTE Fig. 3).

Two kinds of cells share this experiment.

**Attention loss ratio** (``kind="alr"``), on a dense pass over a prose prompt of ``T``
tokens. Per layer ``l`` and KV head ``h``, the attention a key receives is the mean of
its column of the (group-averaged) attention matrix over all ``T`` queries (HashEvict
Eq. 8),

.. math:: \\bar a_p = \\frac1T \\sum_{q} a_{q, p}, \\qquad \\textstyle\\sum_p \\bar a_p = 1 .

A *ranking* is an order in which tokens are dropped. Dropping the first ``m`` costs
:math:`L^m = \\sum_{i \\le m} \\bar a_{\\pi(i)}`; the ideal ranking (ascending
:math:`\\bar a`) costs :math:`L^m_{ref}`. The attention loss ratio is HashEvict Eq. 7,

.. math:: Y_{l,h} = \\sum_{m=1}^{T} \\left(L^m_{l,h} - L^m_{l,h,ref}\\right) \\ \\ge 0 ,

reported divided by ``T`` (the mean gap of the cumulative loss curves, in [0, 1), so
prompts of different lengths compare). The record also keeps HashEvict Table 3's
*attention loss at a 50% budget*: the attention mass :math:`\\sum_p \\bar a_p` of the
tokens a policy evicts when it keeps ``T/2`` (protected tokens included).

Rankings: ``l2`` (drop the largest key norm first: Devoto et al.'s rule, App. D), ``lsh``
(App. D's simulation of HashEvict: each key's SimHash Hamming distance to the queries
of the tokens at or after it, averaged, largest dropped first), and every policy in the
grid, ranked by its own score on a one-shot view of the whole prompt (all ``T``
queries as the block; per-token state from the policy's ``observe``).

**Attention loss per decoding step** (``kind="step_loss"``, HashEvict Table 3's protocol).
The prompt of ``T`` tokens streams through the engine token by token under the policy at
budget ``N``. At each step :math:`t \\ge N` and layer, the loss is the dense attention of
query :math:`t` (averaged over the query heads of each KV head's group) that falls
outside the cache the step attends to,

.. math:: \\ell_{t,l,h} = 1 - \\sum_{j \\in K_{t,l,h}} \bar a^{\\,l,h}_{t,j} ,

with :math:`K_t` the kept set *the step attends to*: :math:`K_{t-1} \\cup \\{t\\}` for a
policy that evicts after attention (token :math:`t` attends to the previous step's cache
plus itself), the cache after eviction :math:`K_t` for one that evicts before it
(HashEvict, MAT). The cell's statistic is the mean over steps, KV heads and layers; the
summary gives its mean over prompts with a 95% t interval, and the paired difference of
every pair of policies over the same prompts (:mod:`refkv.experiments.stats`).

**Why the one-pass statistic is biased.** The ALR cells above rank once over the
dense pass with every query of the prompt, so a token's score includes the attention of
queries that come *after* the point where a streaming policy must decide, and the kept
set is one set for all queries. That favours rankings built on late attention (H2O's
accumulated attention above all) and does not see a policy's own earlier mistakes, which a
streaming cache cannot undo. The per-step cells measure the loss the policy actually
incurs; the one-pass numbers are kept as a fast, policy-free ranking diagnostic
(HashEvict App. D's ALR), not as Table 3.

**Output error** (``kind="output_error"``, CAOTE Fig. 3). The engine prefills ``T``
prompt tokens under the policy (budget ``N``, block ``B``); then the ``M`` tokens that
follow in the text are the queries. Per layer, with the dense run's queries, keys and
values, their attention output over the kept prompt tokens plus the continuation
(:math:`o_e`) is compared with the output over every token (:math:`o_d`):

.. math:: e_l = \\operatorname{mean}_{\\text{heads}, \\text{queries}}
          \\frac{\\lVert o_e - o_d \\rVert^2}{\\lVert o_d \\rVert^2} ,

with the attention mass the continuation's dense queries put on evicted tokens beside it.

Notes
-----
* **Which keys are "kept".** The kept *positions* are the engine's (chosen under
  eviction, from its own, already perturbed hidden states); the vectors compared are
  the dense run's at those positions. This isolates the error of the choice of tokens
  from the error propagated through earlier layers, which is CAOTE's eviction error
  (its Eq. 8 is per layer for given inputs).
* **Ties** in a ranking drop the older token first (the shared tie rule: equal scores
  keep the more recent token).
* **LSH ranking.** App. D averages over "all tokens j > i"; refkv uses ``j >= i`` so the
  last token has a query too. Query heads of a KV head's group are averaged. The text
  of App. E.3 ranks "in ascending order of the average Hamming distance"; dropping the
  *closest* keys first contradicts HashEvict's own rule (Eq. 5 keeps them), so refkv
  drops the farthest first. SimHash signs do not depend on the vectors' norms, so
  App. E's normalisation of keys and queries changes nothing.
* A policy that cannot score a one-shot view (e.g. its budget check fails at ``T/2``)
  gets an ``error`` entry instead of numbers.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ..attention import attend
from ..policies import View
from ..policies.spec import canonical_spec, make_policy
from .captures import cached_capture, layer_attention
from .design import Experiment, Option
from .grids import FAST_CAOTE, configuration, default_policies, format_spec_label, grid_axes, policy_cells
from .models import load_model
from .perplexity import TEXT_LENGTH, registered_texts
from .plots import _none_last
from .prefill import policy_error, prefill_or_skip
from .settings import Settings
from .stats import mean_std, paired_mean_difference
from .tables import write_csv
from .text import cell_tokens, prose_tokens

__all__ = ["EXPERIMENT", "OUTPUT_PROMPTS", "alr", "attention_received", "drop_order", "lsh_mean_distance",
           "one_shot_view", "output_error"]

#: Prompts of the output-error and attention-loss cells (and, given or with the full grid,
#: of geometry's Fig. 2 cosine cells).
OUTPUT_PROMPTS = Option("output_prompts", "prompts of the output-error and attention-loss cells", sizes=(1, 2, 10))

# -- the quantities ------------------------------------------------------------------------
def attention_received(weights: np.ndarray) -> np.ndarray:
    """HashEvict Eq. 8: ``(Hkv, T, n)`` group-averaged weights -> ``(Hkv, n)`` column means."""
    return weights.mean(axis=-2)


def drop_order(scores: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Indices in the order they are dropped: lowest score first, ties older first. (Hkv, n)."""
    return np.stack([np.lexsort((positions[h], scores[h])) for h in range(scores.shape[0])])


def alr(abar: np.ndarray, order: np.ndarray) -> np.ndarray:
    """HashEvict Eq. 7 divided by ``n``: mean gap of the cumulative attention loss, per head."""
    taken = np.take_along_axis(abar, order, axis=1).cumsum(axis=1)
    ideal = np.sort(abar, axis=1).cumsum(axis=1)
    return (taken - ideal).sum(axis=1) / abar.shape[1]


def lsh_mean_distance(q: np.ndarray, k: np.ndarray, n_bits: int, seed: int) -> np.ndarray:
    """Mean SimHash Hamming distance of each key to the queries at or after it (App. D).

    Parameters
    ----------
    q : (H, T, d) queries; k : (Hkv, T, d) keys (both after RoPE)

    Returns
    -------
    (Hkv, T) float64: for key ``i`` of KV head ``h``, the mean over the group's query
    heads and over queries ``j >= i`` of ``d_H(h(q_j), h(k_i))``.
    """
    from ..lsh import gaussian_planes, simhash

    n_kv, t, d = k.shape
    planes = gaussian_planes(n_bits, d, seed, q.dtype)
    # +-1 codes: Hamming distance = (c - s_q . s_k) / 2, one matmul instead of a bit loop.
    sq = simhash(q, planes).astype(np.float64) * 2.0 - 1.0
    sk = simhash(k, planes).astype(np.float64) * 2.0 - 1.0
    sq = sq.reshape(n_kv, -1, t, n_bits)  # (Hkv, g, T, c)
    distance = (n_bits - sq @ sk[:, None].swapaxes(-1, -2)) / 2.0  # (Hkv, g, Tq, Tk)
    visible = np.tril(np.ones((t, t), dtype=bool))  # query j sees key i <= j
    total = np.where(visible, distance, 0.0).sum(axis=(1, 2))
    count = visible.sum(axis=0) * sq.shape[1]
    return total / count


def one_shot_view(policy, layer: int, config, capture, weights, budget: int) -> View:
    """The whole prompt as one block: what ``policy`` would see evicting after a one-shot prefill."""
    k, v, q = capture.k, capture.v, capture.q
    n_kv, t, _ = k.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int64), (n_kv, t)).copy()
    fields = {name: np.full((n_kv, t, *spec.shape), spec.fill, dtype=spec.dtype)
              for name, spec in policy.fields(config).items()}
    view = View(layer=layer, n_layers=config.n_layers, keys=k, values=v, positions=positions, fields=fields,
                queries=q, query_positions=positions[0].copy(), block_keys=k, block_values=v,
                attention=weights if "attention" in policy.needs else None, budget=budget, config=config)
    return replace(view, fields={**fields, **policy.observe(view)})


def output_error(capture, kept_positions: np.ndarray, prompt_length: int) -> tuple[float, float]:
    """CAOTE Fig. 3 for one layer: normalised squared output error and evicted attention mass.

    Parameters
    ----------
    capture : LayerCapture over ``prompt_length + M`` tokens (dense)
    kept_positions : (Hkv, N) prompt positions the evicting engine kept
    prompt_length : int

    Returns
    -------
    (mean ||o_e - o_d||^2 / ||o_d||^2, mean attention mass on evicted prompt tokens),
    both averaged over query heads and the ``M`` continuation queries.
    """
    q, k, v = capture.q, capture.k, capture.v
    n_kv, total, _ = k.shape
    cont = np.arange(prompt_length, total, dtype=np.int64)
    q_cont = q[:, prompt_length:]
    all_pos = np.broadcast_to(np.arange(total, dtype=np.int64), (n_kv, total))
    dense, weights = attend(q_cont, k, v, cont, all_pos, return_weights=True)
    keep = np.concatenate([kept_positions, np.broadcast_to(cont, (n_kv, len(cont)))], axis=1)
    k_e = np.take_along_axis(k, keep[:, :, None], axis=1)
    v_e = np.take_along_axis(v, keep[:, :, None], axis=1)
    evicted, _ = attend(q_cont, k_e, v_e, cont, keep)
    d64, e64 = dense.astype(np.float64), evicted.astype(np.float64)
    error = ((e64 - d64) ** 2).sum(axis=-1) / np.maximum((d64 ** 2).sum(axis=-1), 1e-30)
    kept_mask = np.zeros((n_kv, total), dtype=bool)
    np.put_along_axis(kept_mask, keep, True, axis=1)
    lost = (weights.astype(np.float64) * ~kept_mask[:, None, None, :]).sum(axis=-1)
    return float(error.mean()), float(lost.mean())


# -- cells ---------------------------------------------------------------------------------
#: Policies the default grid measures per decoding step: HashEvict Table 3's three (H2O,
#: HashEvict, L2), each baseline also in its comparable configuration.
STEP_LOSS_POLICIES = ("hashevict", "h2o", "h2o:recent=0", "knorm", "knorm:recent=10,sink=4")


def step_losses(attention: np.ndarray, attended: list[np.ndarray], first_step: int) -> np.ndarray:
    """The attention each step loses: ``1 - sum_{j in attended} attention[h, t, j]``.

    Parameters
    ----------
    attention : (Hkv, T, T) array
        Dense causal attention of every query over every key, averaged over each KV head's
        query group (rows sum to 1).
    attended : list of (Hkv, n_t) int arrays
        Per step ``t = first_step, first_step + 1, ...``, the positions each KV head's
        query ``t`` attends to under eviction.

    Returns
    -------
    (steps, Hkv) float64 array
    """
    out = np.empty((len(attended), attention.shape[0]))
    for i, positions in enumerate(attended):
        t = first_step + i
        row = attention[:, t, :].astype(np.float64)                     # (Hkv, T)
        out[i] = 1.0 - np.take_along_axis(row, positions, axis=1).sum(axis=1)
    return out


def attended_sets(model, spec: str, tokens: np.ndarray, budget: int) -> list[list[np.ndarray]]:
    """Run ``tokens`` token by token under ``spec`` at ``budget``; per layer, per step
    ``t >= budget``, the (Hkv, n) positions step ``t`` attends to (see the module notes)."""
    from ..engine import Engine

    policy = make_policy(spec)
    engine = Engine(model, policy, budget)
    out: list[list[np.ndarray]] = [[] for _ in range(model.config.n_layers)]
    for t in range(len(tokens)):
        before = [c.positions.copy() for c in engine.caches] if t >= budget else None
        engine.forward(tokens[t:t + 1])
        if before is None:
            continue
        for layer, cache in enumerate(engine.caches):
            if policy.evict_before_attention:
                out[layer].append(cache.positions.copy())
            else:
                new = np.full((before[layer].shape[0], 1), t, dtype=np.int64)
                out[layer].append(np.concatenate([before[layer], new], axis=1))
    return out


#: The registered design's per-step attention-loss policies (claim A1: H2O < HashEvict < L2),
#: HashEvict with its 3 registered hash seeds (its per-prompt loss is their mean).
REGISTERED_STEP_POLICIES = ("hashevict:seed=0", "hashevict:seed=1", "hashevict:seed=2", "knorm", "h2o")
#: The registered prompts: the first 512 tokens of each 1,024-token verdict text.
REGISTERED_PROMPT_TOKENS = 512


def registered_prompts(settings: Settings, length: int = REGISTERED_PROMPT_TOKENS) -> list[dict]:
    """The registered prompts' cell fields: the first ``length`` tokens of each of the 16
    perplexity verdict texts (:func:`refkv.experiments.perplexity.registered_texts`)."""
    if settings.policies is not None or settings.budgets is not None or settings.blocks is not None:
        raise ValueError("policies, budgets and blocks are fixed by the registered design: give --registered "
                         "without them")
    text_length = TEXT_LENGTH.given(settings) or 1024
    return [{"model": settings.resolved_model(), "dtype": settings.dtype, "seed": settings.seed,
             "design": "registered", "text": source, "segment": segment, "text_length": text_length,
             "length": min(length, text_length)} for source, segment in registered_texts("verdict")]


def registered_cells(settings: Settings) -> list[dict]:
    """The registered attention-loss grid (claim A1): per prompt of
    :func:`registered_prompts`, :data:`REGISTERED_STEP_POLICIES` token by token (``B = 1``)
    at ``N = T / 2`` (256 of 512, HashEvict Table 3's 50%)."""
    return [{**prompt, "kind": "step_loss", "policy": canonical_spec(policy), "budget": prompt["length"] // 2,
             "block": 1} for prompt in registered_prompts(settings) for policy in REGISTERED_STEP_POLICIES]


def cells(settings: Settings) -> list[dict]:
    """ALR cells (one per prompt), per-step attention-loss cells (prompt x policy, ``N = T/2``,
    ``B = 1``) and output-error cells (prompt x policy x budget x block); ``registered``:
    :func:`registered_cells`."""
    if settings.registered:
        return registered_cells(settings)
    model = settings.resolved_model()
    real = model != "tiny"
    if settings.quick:
        alr_length, segments = 128, (0,)
        err_length, extra = (256 if real else 192), 16
        policies, budgets, blocks = ["sink", "h2o", "caote:base=h2o", "keydiff"], [64], [32]
    else:
        alr_length, segments = 512, (0, 1, 2)
        err_length, extra = 1024, 32
        policies, budgets, blocks = default_policies(FAST_CAOTE), [256], [128]
        if not real:
            err_length, budgets = 512, [128]
    policies, budgets, blocks = grid_axes(settings, policies, budgets, blocks)
    base = {"model": model, "dtype": settings.dtype, "seed": settings.seed}
    prompts = OUTPUT_PROMPTS.value(settings)
    if settings.full or OUTPUT_PROMPTS.given(settings) is not None:
        segments = tuple(range(prompts))
    out = []
    for segment in segments:
        out.append({**base, "kind": "alr", "length": alr_length, "segment": segment, "lsh_bits": 16,
                    "rankings": ["l2", "lsh", *[p for p in policies if p != "full"]]})
    step_policies = [canonical_spec(p) for p in (settings.policies or
                                                    (("hashevict", "h2o") if settings.quick else STEP_LOSS_POLICIES))]
    for segment in segments[:max(prompts, 2) if not settings.quick else 1]:
        out += [{**base, "kind": "step_loss", "length": alr_length, "segment": segment, "policy": policy,
                 "budget": alr_length // 2, "block": 1} for policy in step_policies if policy != "full"]
    for segment in segments[:prompts]:
        out += policy_cells({**base, "kind": "output_error", "length": err_length, "continuation": extra,
                             "segment": segment}, policies, budgets, blocks)
    return out


def cost(params: dict) -> float:
    """Roughly CPU seconds."""
    if params["kind"] == "alr":
        return params["length"] * 0.02 * (1 + len(params["rankings"]) / 8)
    if params["kind"] == "step_loss":  # ~70 ms per token at B = 1 on the real model, plus the dense pass
        return params["length"] * 0.075 + 2.0
    return params["length"] / 250.0 + 2.0


def run_cell(params: dict) -> dict:
    if params["kind"] == "alr":
        return _run_alr(params)
    if params["kind"] == "output_error":
        return _run_output_error(params)
    if params["kind"] == "step_loss":
        return _run_step_loss(params)
    raise ValueError(f"kind must be 'alr', 'step_loss' or 'output_error', got {params['kind']!r}")


def _run_step_loss(params: dict) -> dict:
    model, _ = load_model(params["model"], params["dtype"])
    budget = params["budget"]
    reason = policy_error(params["policy"], budget, 1, model.config)
    if reason is not None:
        return {"skipped": reason}
    tokens = cell_tokens(params)
    attended = attended_sets(model, params["policy"], tokens, budget)
    _, layers = layer_attention(params)
    by_layer = []
    for layer, _cap, weights in layers:  # weights (Hkv, g, T, T)
        by_layer.append(float(step_losses(weights.mean(axis=1), attended[layer], budget).mean()))
    return {"loss_by_layer": by_layer, "mean_loss": float(np.mean(by_layer)), "steps": len(tokens) - budget}


def _run_alr(params: dict) -> dict:
    model, layers = layer_attention(params)
    t = params["length"]
    half = t // 2
    positions = np.broadcast_to(np.arange(t, dtype=np.int64), (model.config.n_kv_heads, t))  # (Hkv, T)
    results: dict[str, dict] = {name: {"alr": [], "loss50": []} for name in params["rankings"]}
    ideal_loss = []
    for layer, cap, weights in layers:  # weights (Hkv, g, T, T)
        abar = attention_received(weights.mean(axis=1)).astype(np.float64)
        ideal_loss.append(np.sort(abar, axis=1)[:, :t - half].sum(axis=1).tolist())
        for name in params["rankings"]:
            entry = results[name]
            if "error" in entry:
                continue
            try:
                scores, kept = _ranking(name, params, model, layer, cap, weights, half)
            except ValueError as err:
                results[name] = {"error": str(err)}
                continue
            entry["alr"].append(alr(abar, drop_order(scores, positions)).tolist())
            lost = abar.sum(axis=1) - np.take_along_axis(abar, kept, axis=1).sum(axis=1)
            entry["loss50"].append(lost.tolist())
    return {"tokens": t, "rankings": results, "ideal_loss50": ideal_loss}


def _ranking(name, params, model, layer, cap, weights, half):
    """Scores (higher = keep) and the kept indices at budget T/2 of one ranking on one layer."""
    positions = np.broadcast_to(np.arange(cap.k.shape[1], dtype=np.int64), cap.k.shape[:2])
    if name == "l2":
        scores = -np.linalg.norm(cap.k.astype(np.float64), axis=-1)
    elif name == "lsh":
        scores = -lsh_mean_distance(cap.q, cap.k, params["lsh_bits"], params["seed"])
    else:
        policy = make_policy(name)
        policy.check(half, model.config)
        view = one_shot_view(policy, layer, model.config, cap, weights, half)
        scores = np.asarray(policy.score(view), dtype=np.float64)
        return scores, policy.keep_indices(view)
    from ..policies import select

    return scores, select(scores, positions, half)


def _run_output_error(params: dict) -> dict:
    model, _ = load_model(params["model"], params["dtype"])
    t, extra = params["length"], params["continuation"]
    tokens = prose_tokens(params["model"], params["dtype"], t + extra, params["segment"])[:t]
    engine, _, skipped = prefill_or_skip(params, model, tokens)
    if skipped is not None:
        return {"skipped": skipped}
    layers, _ = cached_capture(params["model"], params["dtype"], t + extra, params["segment"])
    errors, lost = [], []
    for cap, cache in zip(layers, engine.caches):
        e, m = output_error(cap, cache.positions, t)
        errors.append(e)
        lost.append(m)
    return {"error_by_layer": errors, "lost_attention_by_layer": lost,
            "mean_error": float(np.mean(errors)), "mean_lost_attention": float(np.mean(lost))}


# -- summary -------------------------------------------------------------------------------
def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
    """``alr.csv``, ``alr_by_layer.csv``, ``output_error.csv``, ``output_error_by_layer.csv`` and plots."""
    written = []
    alr_records = [r for r in records if r["params"]["kind"] == "alr"]
    rows, by_layer = [], {}
    names = list(dict.fromkeys(n for r in alr_records for n in r["result"]["rankings"]))
    for name in names:
        values, losses, errors = [], [], []
        for r in alr_records:
            entry = r["result"]["rankings"].get(name, {})
            if "error" in entry:
                errors.append(entry["error"])
                continue
            a = np.asarray(entry["alr"])  # (layers, heads)
            values.append(a)
            losses.append(np.asarray(entry["loss50"]))
        if not values:
            rows.append({"ranking": name, "label": _label(name), "error": errors[0] if errors else ""})
            continue
        a, loss = np.stack(values), np.stack(losses)  # (prompts, layers, heads)
        by_layer[name] = a.mean(axis=(0, 2))
        per_prompt = a.mean(axis=(1, 2))
        rows.append({"ranking": name, "label": _label(name), "alr": float(a.mean()),
                     "alr_prompt_std": mean_std(per_prompt)[1], "loss50": float(loss.mean()),
                     "prompts": len(values)})
    if alr_records:
        ideal = np.mean([np.mean(r["result"]["ideal_loss50"]) for r in alr_records])
        rows.append({"ranking": "ideal", "label": "ideal (ascending attention)", "alr": 0.0,
                     "loss50": float(ideal), "prompts": len(alr_records)})
    rows.sort(key=lambda r: r.get("alr", float("inf")))
    written.append(write_csv(folder / "alr.csv", rows,
                             ["ranking", "label", "alr", "alr_prompt_std", "loss50", "prompts", "error"]))
    if by_layer:
        layer_rows = [{"layer": i, **{n: float(v[i]) for n, v in by_layer.items()}}
                      for i in range(len(next(iter(by_layer.values()))))]
        written.append(write_csv(folder / "alr_by_layer.csv", layer_rows))

    err_records = [r for r in records if r["params"]["kind"] == "output_error" and "skipped" not in r["result"]]
    groups: dict[tuple, list[dict]] = {}
    for r in err_records:
        p = r["params"]
        groups.setdefault((p["policy"], p["budget"], p["block"]), []).append(r)
    rows, curves = [], {}
    for (policy, budget, block), group in groups.items():
        e = np.asarray([r["result"]["error_by_layer"] for r in group])
        m = np.asarray([r["result"]["lost_attention_by_layer"] for r in group])
        curves[(policy, budget, block)] = e.mean(axis=0)
        rows.append({"policy": policy, "label": format_spec_label(policy), "configuration": configuration(policy),
                     "budget": budget, "block": block, "mean_error": float(e.mean()),
                     "error_prompt_std": mean_std(e.mean(axis=1))[1],
                     "mean_lost_attention": float(m.mean()), "prompts": len(group),
                     "wall_time_s": sum(r["wall_time_s"] for r in group)})
    rows.sort(key=lambda r: (_none_last(r["budget"]), _none_last(r["block"]), r["mean_error"]))
    written.append(write_csv(folder / "output_error.csv", rows))
    if curves:
        layer_rows = [{"layer": i, **{f"{format_spec_label(p)} N={n} B={b}": float(c[i])
                                      for (p, n, b), c in curves.items()}}
                      for i in range(len(next(iter(curves.values()))))]
        written.append(write_csv(folder / "output_error_by_layer.csv", layer_rows))
    written.append(write_csv(folder / "output_error_pairs.csv", paired_rows(
        {(r["params"]["policy"], r["params"]["budget"], r["params"]["block"], _prompt(r["params"])):
         r["result"]["mean_error"] for r in err_records})))

    step_records = [r for r in records if r["params"]["kind"] == "step_loss" and "skipped" not in r["result"]]
    per_policy: dict[str, list[float]] = {}
    for r in sorted(step_records, key=lambda r: _prompt(r["params"])):
        per_policy.setdefault(r["params"]["policy"], []).append(r["result"]["mean_loss"])
    rows = []
    for policy, values in per_policy.items():
        row = {"policy": policy, "label": format_spec_label(policy), "configuration": configuration(policy),
               "mean_loss": float(np.mean(values)), "prompts": len(values),
               "budget": step_records[0]["params"]["budget"], "length": step_records[0]["params"]["length"]}
        if len(values) >= 2:  # a t interval over prompts: the paired difference with zero
            interval = paired_mean_difference(values, np.zeros(len(values)))
            row.update(loss_low=interval.low, loss_high=interval.high)
        rows.append(row)
    rows.sort(key=lambda r: r["mean_loss"])
    written.append(write_csv(folder / "step_loss.csv", rows, ["policy", "label", "configuration", "length",
                                                              "budget", "mean_loss", "loss_low", "loss_high",
                                                              "prompts"]))
    written.append(write_csv(folder / "step_loss_pairs.csv", paired_rows(
        {(r["params"]["policy"], r["params"]["budget"], r["params"]["block"], _prompt(r["params"])):
         r["result"]["mean_loss"] for r in step_records})))
    from . import plots

    written += plots.output_error_lines(curves, folder)
    written += plots.alr_lines(by_layer, folder)
    return written


def paired_rows(values: dict[tuple, float]) -> list[dict]:
    """Every pair of policies at the same budget and block over the prompts both ran:
    mean difference A - B with its 95% paired t interval (needs >= 2 shared prompts).

    ``values`` maps ``(policy, budget, block, prompt)`` to one number per prompt."""
    by_cell: dict[tuple, dict] = {}
    for (policy, budget, block, prompt), value in values.items():
        by_cell.setdefault((policy, budget, block), {})[prompt] = value
    keys = sorted(by_cell, key=lambda k: (str(k[1]), str(k[2]), k[0]))
    rows = []
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            prompts = sorted(set(by_cell[a]) & set(by_cell[b]))
            if b[1:] != a[1:] or len(prompts) < 2:
                continue
            interval = paired_mean_difference([by_cell[a][q] for q in prompts], [by_cell[b][q] for q in prompts])
            rows.append({"policy_a": a[0], "policy_b": b[0], "budget": a[1], "block": a[2],
                         "prompts": interval.n, "difference": interval.estimate, "low": interval.low,
                         "high": interval.high})
    return rows


def _prompt(params: dict) -> tuple[str, int]:
    """A cell's prompt: its text (the registered cells name one of two sources) and segment."""
    return params.get("text", ""), params["segment"]


def _label(name: str) -> str:
    fixed = {"l2": "L2 norm (Devoto et al.)", "lsh": "LSH mean Hamming (HashEvict App. D)"}
    return fixed[name] if name in fixed else format_spec_label(name)


EXPERIMENT = Experiment(
    name="attention_loss",
    title="attention loss ratio of rankings (HashEvict App. D) and output error per layer (CAOTE Fig. 3)",
    cells=cells, run=run_cell, summarise=summarise, cost=cost, options=(OUTPUT_PROMPTS, TEXT_LENGTH),
    table=("output_error.csv", ("label", "budget", "block", "mean_error", "mean_lost_attention")))
