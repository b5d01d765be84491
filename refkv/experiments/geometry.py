"""Key geometry: KeyDiff Figs. 2, 4, 5 and HashEvict Table 11 on a real model.

Three kinds of cells:

* ``kind="cosine"`` (KeyDiff Fig. 2): on a dense pass over a prose prompt, per layer and
  KV head, each key's mean cosine similarity to the other keys against the attention
  it receives. The statistic is Spearman's rank correlation between
  :math:`-\\frac{1}{T-1}\\sum_{j \\ne i} \\cos(k_i, k_j)` and the mean attention the key
  receives from the queries that can see it (group-averaged weights,
  :math:`\\frac{1}{T-i}\\sum_{q \\ge i} a_{q,i}`); KeyDiff's claim is that it is positive.
  The same correlation is kept for KeyDiff's anchor score (Eq. 8, minus the cosine to
  the mean unit key; it ranks keys exactly as the pairwise sum, Eq. 7 = Eq. 8, so the two
  columns agree, a check) and for the L2 rule's score (minus the key norm, HashEvict
  App. C / Devoto et al.). The first 64 keys of one head are kept for the Fig. 2 picture.
  **That statistic is confounded by position**: the mean over "the queries that see the
  key" averages an early key over many late queries and a late key over a few recent
  ones, so it tracks position, whatever the key's direction. The same cell therefore
  also measures Fig. 2 *on a common query set* (:func:`common_query_statistics`): the
  last 25% of queries against the first 75% of keys, where every query sees every key;
  there, Spearman between distinctiveness (minus the mean cosine to the other keys of
  that set) and the mean attention received, the same per query (Spearman over keys for
  each query, averaged), the L2 rule's Spearman, and the attention share the 25% most
  distinctive keys capture (token 0, the attention sink, excluded from every selection)
  against 25% chosen at random (the exact expectation), the 25% most recent, and the 25%
  of lowest key norm. The old column stays for comparison with the earlier page.
* ``kind="retention"`` (Figs. 4, 5): the engine prefills the prompt under a policy
  (budget ``N``, block ``B``); per layer and KV head, the log-volume of the kept keys,
  :math:`\\log\\det(K^\\top K)` (see Notes), and their mean pairwise cosine. For one
  (layer, head) the 2-D PCA of the dense run's keys of every prompt token is stored
  with the kept mask (the Fig. 4 scatter).
* ``kind="hamming"`` (HashEvict Table 11): per layer and query head, the Pearson
  correlation between the attention weights :math:`a_{q,k}` (every causal pair
  ``k <= q``) and the inverted SimHash Hamming distance of ``q`` and ``k``, averaged over
  several random projections, for codes of 8, 16, 24 and 32 bits.

Notes
-----
* **log det of the Gram matrix.** KeyDiff Fig. 5 plots :math:`\\log\\det(K K^\\top)` of
  the ``N`` kept keys. With ``N`` larger than the head width ``d``, :math:`K K^\\top`
  (``N x N``) has rank at most ``d`` and its determinant is 0. refkv reports
  :math:`\\log\\det(K^\\top K) = \\sum_i \\log \\sigma_i^2`, the log of the product of the
  nonzero eigenvalues of :math:`K K^\\top` (its pseudo-determinant): the squared
  ``d``-dimensional volume the kept keys span. Computed in float64 with
  :func:`numpy.linalg.slogdet`.
* **PCA** is fitted to all ``T`` dense keys of the chosen head (centred, float64 SVD);
  the sign of each component is fixed so its largest-magnitude loading is positive.
* **"Inverted" Hamming distance** is its negation (Pearson's correlation is unchanged by
  the affine map to ``c - d_H``). Hamming distances are averaged over
  ``projections`` independent planes (seeds ``seed .. seed + projections - 1``) before
  the correlation, as App. E does "to mitigate the randomness that LSH introduces".
  HashEvict normalises keys and queries first; SimHash signs do not depend on norms.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..policies.spec import canonical_spec
from .attention_loss import OUTPUT_PROMPTS, registered_prompts
from .captures import cached_capture, layer_attention
from .design import Experiment
from .grids import configuration, default_policies, format_spec_label, grid_axes, policy_cells
from .models import load_model
from .perplexity import TEXT_LENGTH
from .prefill import prefill_or_skip
from .settings import Settings
from .stats import mean_std, paired_mean_difference, scipy_stats
from .tables import write_csv
from .text import cell_tokens

__all__ = ["EXPERIMENT", "common_query_statistics", "hamming_correlation", "log_volume", "mean_pairwise_cosine",
           "pca_2d", "top_share"]

#: Code lengths of HashEvict Table 11.
BITS = (8, 16, 24, 32)
#: Policies of KeyDiff Figs. 4 and 5.
FIGURE_POLICIES = ("sink", "tova", "keydiff")


# -- the quantities ------------------------------------------------------------------------
def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-8)


def mean_pairwise_cosine(keys: np.ndarray) -> np.ndarray:
    """Each key's mean cosine similarity to the *other* keys: (..., n, d) -> (..., n)."""
    u = _unit(keys)
    n = u.shape[-2]
    total = u @ u.sum(axis=-2)[..., :, None]  # sum_j cos(k_i, k_j), self included
    return (total[..., 0] - (u * u).sum(axis=-1)) / max(n - 1, 1)


def log_volume(keys: np.ndarray) -> float:
    """``log det(K^T K)`` of (n, d) keys in float64 (``-inf`` if they span fewer than d dims)."""
    k = np.asarray(keys, dtype=np.float64)
    sign, logdet = np.linalg.slogdet(k.T @ k)
    return float(logdet) if sign > 0 else float("-inf")


def pca_2d(x: np.ndarray) -> np.ndarray:
    """Projections (n, 2) of rows on their first two principal components (signs fixed)."""
    x = np.asarray(x, dtype=np.float64)
    centred = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    components = vt[:2]
    flip = np.sign(components[np.arange(len(components)), np.abs(components).argmax(axis=1)])
    return centred @ (components * flip[:, None]).T


def hamming_correlation(q: np.ndarray, k: np.ndarray, weights: np.ndarray, n_bits: int, seeds) -> np.ndarray:
    """Pearson r of attention and minus mean Hamming distance, per query head.

    Parameters
    ----------
    q : (H, T, d); k : (Hkv, T, d); weights : (Hkv, g, T, T) attention
    n_bits : int; seeds : iterable of int (one projection each)

    Returns
    -------
    (H,) float64 correlations over the causal pairs ``k <= q``.
    """
    from ..lsh import gaussian_planes, simhash

    n_kv, t, d = k.shape
    g = q.shape[0] // n_kv
    distance = np.zeros((n_kv, g, t, t))
    seeds = list(seeds)
    for seed in seeds:
        planes = gaussian_planes(n_bits, d, seed, q.dtype)
        sq = (simhash(q, planes).astype(np.float64) * 2.0 - 1.0).reshape(n_kv, g, t, n_bits)
        sk = simhash(k, planes).astype(np.float64) * 2.0 - 1.0
        distance += (n_bits - sq @ sk[:, None].swapaxes(-1, -2)) / 2.0
    distance /= len(seeds)
    rows, cols = np.tril_indices(t)
    out = []
    for h in range(n_kv):
        for j in range(g):
            a = weights[h, j][rows, cols].astype(np.float64)
            s = -distance[h, j][rows, cols]
            out.append(float(scipy_stats().pearsonr(a, s)[0]) if np.ptp(s) > 0 and np.ptp(a) > 0 else float("nan"))
    return np.asarray(out)


def _received_visible(weights_kv: np.ndarray) -> np.ndarray:
    """Mean attention each key receives from the queries that see it: (Hkv, T, T) -> (Hkv, T)."""
    t = weights_kv.shape[-1]
    return weights_kv.sum(axis=-2) / (t - np.arange(t))


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(scipy_stats().spearmanr(x, y)[0])


def top_share(score: np.ndarray, received: np.ndarray, count: int) -> float:
    """Attention ``received`` on the ``count`` keys of highest ``score``, token 0 left out
    (ties: the earlier key first, a stable sort)."""
    top = 1 + np.argsort(-score[1:], kind="stable")[:count]
    return float(received[top].sum())


def common_query_statistics(keys: np.ndarray, attention: np.ndarray, fraction: float = 0.25) -> dict:
    """KeyDiff Fig. 2 on a common query set, for one layer.

    Parameters
    ----------
    keys : (Hkv, T, d) array
    attention : (Hkv, T, T) array
        Group-averaged causal attention (rows sum to 1).
    fraction : float
        Queries are the last ``fraction`` of positions, keys the first ``1 - fraction``; the
        selections take ``fraction`` of the keys (token 0 excluded).

    Returns
    -------
    dict of per-head lists: ``spearman`` (distinctiveness vs mean attention received),
    ``spearman_per_query`` (mean over queries of the per-query Spearman over keys),
    ``spearman_low_norm`` (minus key norm vs mean attention received), and the attention
    shares ``share_distinctive``, ``share_random`` (expected), ``share_recent``,
    ``share_low_norm`` (mean over queries of the attention on the selected keys).
    """
    n_kv, t, _ = keys.shape
    n_keys = int(t * (1 - fraction))                    # keys [0, n_keys)
    first_query = t - int(t * fraction)                 # queries [first_query, T); all see every key
    if n_keys < 3 or first_query < n_keys or first_query >= t:
        raise ValueError(f"T={t} is too short for a common query set with fraction={fraction}")
    picked = max(1, round(fraction * (n_keys - 1)))   # keys 1 .. n_keys - 1 are candidates
    out: dict[str, list[float]] = {name: [] for name in (
        "spearman", "spearman_per_query", "spearman_low_norm", "share_distinctive", "share_random",
        "share_recent", "share_low_norm")}
    for h in range(n_kv):
        k = keys[h, :n_keys]                                          # (K, d)
        a = attention[h, first_query:, :n_keys].astype(np.float64)   # (Q, K)
        distinct = -mean_pairwise_cosine(k)                           # (K,) higher = more distinctive
        low_norm = -np.linalg.norm(k.astype(np.float64), axis=-1)    # (K,) higher = lower norm
        received = a.mean(axis=0)                                     # (K,)
        out["spearman"].append(_spearman(distinct, received))
        out["spearman_per_query"].append(float(np.nanmean([_spearman(distinct, row) for row in a])))
        out["spearman_low_norm"].append(_spearman(low_norm, received))
        out["share_distinctive"].append(top_share(distinct, received, picked))
        out["share_low_norm"].append(top_share(low_norm, received, picked))
        out["share_recent"].append(top_share(np.arange(n_keys, dtype=np.float64), received, picked))
        out["share_random"].append(float(received[1:].sum() * picked / (n_keys - 1)))
    return out


# -- cells ---------------------------------------------------------------------------------
#: The registered design's code lengths (claim S1: 32 bits against 8).
REGISTERED_BITS = (8, 32)
#: The registered design's retention policies (claim G2: KeyDiff against each of the others).
REGISTERED_RETENTION_POLICIES = ("keydiff", "snapkv", "tova", "h2o", "sink")


def registered_cells(settings: Settings) -> list[dict]:
    """The registered geometry grid (claims G1, S1, G2).

    On the first 512 tokens of each of the 16 perplexity verdict texts
    (:func:`refkv.experiments.attention_loss.registered_prompts`): one dense ``cosine`` cell
    (G1) and one ``hamming`` cell at 8 and 32 bits (S1, 4 projections as in the default
    grid). On the whole 1,024-token texts: ``retention`` cells of
    :data:`REGISTERED_RETENTION_POLICIES` at ``N = 256``, ``B = 128`` (G2).
    """
    out = []
    for prompt in registered_prompts(settings):
        out.append({**prompt, "kind": "cosine"})
        out.append({**prompt, "kind": "hamming", "bits": list(REGISTERED_BITS), "projections": 4})
    for prompt in registered_prompts(settings, TEXT_LENGTH.given(settings) or 1024):
        out += [{**prompt, "kind": "retention", "policy": canonical_spec(policy), "budget": 256, "block": 128}
                for policy in REGISTERED_RETENTION_POLICIES]
    return out


def cells(settings: Settings) -> list[dict]:
    """Cosine and Hamming cells per prompt, retention cells per prompt, policy, budget and
    block; ``registered``: :func:`registered_cells`."""
    if settings.registered:
        return registered_cells(settings)
    model = settings.resolved_model()
    real = model != "tiny"
    base = {"model": model, "dtype": settings.dtype, "seed": settings.seed}
    if settings.quick:
        dense_length, segments, ret_length = 128, (0,), (256 if real else 192)
        policies, budgets, blocks, projections = list(FIGURE_POLICIES), [64], [32], 2
    else:
        dense_length, segments, ret_length = 512, (0, 1, 2), 1024
        policies, budgets, blocks, projections = default_policies(), [256], [128], 4
        if not real:
            ret_length, budgets = 512, [128]
    policies, budgets, blocks = grid_axes(settings, policies, budgets, blocks)
    if settings.full or OUTPUT_PROMPTS.given(settings) is not None:  # the powered grid: Fig. 2 on 10 prompts
        segments = tuple(range(OUTPUT_PROMPTS.value(settings)))
    out = []
    for segment in segments:
        out.append({**base, "kind": "cosine", "length": dense_length, "segment": segment})
        out.append({**base, "kind": "hamming", "length": dense_length, "segment": segment, "bits": list(BITS),
                    "projections": projections})
    for segment in segments[:2]:
        out += policy_cells({**base, "kind": "retention", "length": ret_length, "segment": segment},
                            policies, budgets, blocks)
    return out


def cost(params: dict) -> float:
    if params["kind"] == "retention":
        return params["length"] / 250.0 + 1.0
    if params["kind"] == "hamming":  # the default grid's four code lengths cost 0.03 s a token each
        return params["length"] * 0.03 * params["projections"] * len(params["bits"]) / len(BITS)
    return params["length"] * 0.02


def _plot_head(config) -> tuple[int, int]:
    """The (layer, KV head) pictured: KeyDiff Fig. 4 shows layer 5 of 28; here layer L // 6, head 0."""
    return config.n_layers // 6, 0


def run_cell(params: dict) -> dict:
    kind = params["kind"]
    if kind == "cosine":
        return _run_cosine(params)
    if kind == "retention":
        return _run_retention(params)
    if kind == "hamming":
        return _run_hamming(params)
    raise ValueError(f"kind must be 'cosine', 'retention' or 'hamming', got {kind!r}")


def _run_cosine(params: dict) -> dict:
    model, layers = layer_attention(params)
    pairwise, anchor, low_norm = [], [], []
    common: dict[str, list] = {}
    plot_layer, plot_head = _plot_head(model.config)
    picture = None
    for layer, cap, weights in layers:
        received = _received_visible(weights.mean(axis=1))  # (Hkv, T, T) -> (Hkv, T)
        for name, values in common_query_statistics(cap.k, weights.mean(axis=1)).items():
            common.setdefault(name, []).append(values)      # per layer, per KV head
        neg_cos = -mean_pairwise_cosine(cap.k)
        unit = _unit(cap.k)
        anchor_score = -(unit @ _unit(unit.mean(axis=1))[:, :, None])[..., 0]
        norms = np.linalg.norm(cap.k.astype(np.float64), axis=-1)
        pairwise.append([_spearman(neg_cos[h], received[h]) for h in range(len(received))])
        anchor.append([_spearman(anchor_score[h], received[h]) for h in range(len(received))])
        low_norm.append([_spearman(-norms[h], received[h]) for h in range(len(received))])
        if layer == plot_layer:
            u = unit[plot_head, :64]
            picture = {"layer": layer, "head": plot_head, "cosine": np.round(u @ u.T, 4).tolist(),
                       "received": [float(x) for x in received[plot_head, :64]]}
    return {"spearman_pairwise": pairwise, "spearman_anchor": anchor, "spearman_low_norm": low_norm,
            "picture": picture, "common_queries": common}


def _run_retention(params: dict) -> dict:
    model, _ = load_model(params["model"], params["dtype"])
    tokens = cell_tokens(params)
    engine, _, skipped = prefill_or_skip(params, model, tokens)
    if skipped is not None:
        return {"skipped": skipped}
    volume, spread = [], []
    for cache in engine.caches:
        volume.append([log_volume(cache.keys[h]) for h in range(cache.n_kv_heads)])
        spread.append([float(mean_pairwise_cosine(cache.keys[h]).mean()) for h in range(cache.n_kv_heads)])
    result = {"log_volume": volume, "kept_mean_cosine": spread}
    if params["policy"] in FIGURE_POLICIES and params.get("design") != "registered":  # the Fig. 4 picture
        layer, head = _plot_head(model.config)
        layers, _ = cached_capture(params["model"], params["dtype"], params["length"], params["segment"])
        kept = np.zeros(params["length"], dtype=bool)
        kept[engine.caches[layer].positions[head]] = True
        result["pca"] = {"layer": layer, "head": head,
                         "xy": np.round(pca_2d(layers[layer].k[head]), 4).tolist(),
                         "kept": kept.astype(int).tolist()}
    return result


def _run_hamming(params: dict) -> dict:
    _, layers = layer_attention(params)
    seeds = range(params["seed"], params["seed"] + params["projections"])
    out = {str(bits): [] for bits in params["bits"]}
    for _, cap, weights in layers:
        for bits in params["bits"]:
            out[str(bits)].append(hamming_correlation(cap.q, cap.k, weights, bits, seeds).tolist())
    return {"pearson": out}


# -- summary -------------------------------------------------------------------------------
def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
    """``cosine.csv``, ``log_volume.csv``, ``hamming.csv`` and the Fig. 2 / 4 / 5 pictures."""
    from . import plots

    written = []
    cos = [r for r in records if r["params"]["kind"] == "cosine"]
    if cos:
        pair = np.asarray([r["result"]["spearman_pairwise"] for r in cos], dtype=np.float64)
        anch = np.asarray([r["result"]["spearman_anchor"] for r in cos], dtype=np.float64)
        norm = np.asarray([r["result"]["spearman_low_norm"] for r in cos], dtype=np.float64)
        rows = [{"layer": layer, "spearman_pairwise": float(np.nanmean(pair[:, layer])),
                 "spearman_anchor": float(np.nanmean(anch[:, layer])),
                 "heads_positive_pairwise": float(np.mean(pair[:, layer] > 0)),
                 "spearman_low_norm": float(np.nanmean(norm[:, layer]))}
                for layer in range(pair.shape[1])]
        rows.append({"layer": "all", "spearman_pairwise": float(np.nanmean(pair)),
                     "spearman_anchor": float(np.nanmean(anch)),
                     "heads_positive_pairwise": float(np.mean(pair > 0)),
                     "spearman_low_norm": float(np.nanmean(norm))})
        written.append(write_csv(folder / "cosine.csv", rows))
        written += plots.cosine_picture(cos[0]["result"]["picture"], folder)
        controlled = [r for r in cos if "common_queries" in r["result"]]
        if controlled:
            written.append(write_csv(folder / "cosine_common_queries.csv", common_query_rows(controlled)))

    ret = [r for r in records if r["params"]["kind"] == "retention" and "skipped" not in r["result"]]
    groups: dict[tuple, list[dict]] = {}
    for r in ret:
        p = r["params"]
        groups.setdefault((p["policy"], p["budget"], p["block"]), []).append(r)
    rows, distributions = [], {}
    for (policy, budget, block), group in groups.items():
        vol = np.asarray([r["result"]["log_volume"] for r in group], dtype=np.float64)
        spread = np.asarray([r["result"]["kept_mean_cosine"] for r in group], dtype=np.float64)
        finite = vol[np.isfinite(vol)]
        distributions[format_spec_label(policy)] = finite
        rows.append({"policy": policy, "label": format_spec_label(policy), "configuration": configuration(policy),
                     "budget": budget, "block": block,
                     "log_volume_mean": float(finite.mean()) if finite.size else float("nan"),
                     "log_volume_median": float(np.median(finite)) if finite.size else float("nan"),
                     "kept_mean_cosine": float(spread.mean()), "prompts": len(group)})
    rows.sort(key=lambda r: -r["log_volume_mean"])
    written.append(write_csv(folder / "log_volume.csv", rows))
    written += plots.log_volume_boxes(distributions, folder)
    pictures = {format_spec_label(r["params"]["policy"]): r["result"]["pca"] for r in ret
                if "pca" in r["result"] and r["params"]["segment"] == 0}
    written += plots.pca_scatter(pictures, folder)

    ham = [r for r in records if r["params"]["kind"] == "hamming"]
    if ham:
        rows = []
        for bits in ham[0]["params"]["bits"]:
            values = np.concatenate([np.ravel(r["result"]["pearson"][str(bits)]) for r in ham])
            mean, std, n = mean_std(values)
            rows.append({"bits": bits, "pearson_mean": mean, "pearson_std": std, "heads_x_layers_x_prompts": n})
        written.append(write_csv(folder / "hamming.csv", rows))
    return written


def common_query_rows(records: list[dict]) -> list[dict]:
    """One row per statistic of :func:`common_query_statistics`: its mean over prompts, layers
    and heads, the fraction of (layer, head) cells above zero, and a 95% t interval over
    prompts (each prompt's mean) when there are >= 2; the shares also as differences
    distinctive - other, paired over prompts."""
    per_prompt = {name: [float(np.nanmean(r["result"]["common_queries"][name])) for r in records]
                  for name in records[0]["result"]["common_queries"]}
    rows = []
    for name, values in per_prompt.items():
        cells_ = np.concatenate([np.ravel(r["result"]["common_queries"][name]) for r in records])
        row = {"statistic": name, "mean": float(np.mean(values)), "prompts": len(values),
               "positive_fraction": float(np.mean(cells_[~np.isnan(cells_)] > 0))}
        if len(values) >= 2:
            interval = paired_mean_difference(values, np.zeros(len(values)))
            row.update(low=interval.low, high=interval.high)
        rows.append(row)
    for other in ("share_random", "share_recent", "share_low_norm"):
        a, b = per_prompt["share_distinctive"], per_prompt[other]
        row = {"statistic": f"share_distinctive - {other}", "mean": float(np.mean(a) - np.mean(b)),
               "prompts": len(a)}
        if len(a) >= 2:
            interval = paired_mean_difference(a, b)
            row.update(low=interval.low, high=interval.high)
        rows.append(row)
    return rows


EXPERIMENT = Experiment(
    name="geometry",
    title="key geometry: cosine vs attention, PCA and log-volume of kept keys, LSH vs attention correlation",
    cells=cells, run=run_cell, summarise=summarise, cost=cost, options=(OUTPUT_PROMPTS, TEXT_LENGTH),
    table=("log_volume.csv", ("label", "budget", "block", "log_volume_mean", "kept_mean_cosine")))
