"""Plots of the experiments (matplotlib, the ``plot`` extra), written as PNG and SVG.

Every function takes finished records (or arrays) and a folder, and returns the paths it
wrote; without matplotlib they write nothing and return ``[]`` (the CSV tables are the
results; the plots are views of them). Files are reproducible: SVGs carry no date and a
fixed hash salt, PNGs no timestamp. Each file is rendered in memory and written
atomically (temporary file + ``os.replace``).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ..files import OutputFolder
from ..policies.spec import parse_spec
from .grids import format_spec_label

__all__ = ["alr_lines", "available", "cosine_picture", "log_volume_boxes", "output_error_lines", "passkey_heatmaps",
           "pca_scatter", "perplexity_bars"]


def available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "refkv"
    plt.rcParams["font.size"] = 8
    return plt


def _save(fig, folder: Path, stem: str) -> list[Path]:
    """Write ``fig`` as ``stem.png`` and ``stem.svg`` in ``folder``, each atomically.

    ``folder`` is the summary's :class:`refkv.files.OutputFolder` (or a plain path, then
    guarded as the root).
    """
    plt = _pyplot()
    if not isinstance(folder, OutputFolder):  # a plain path: the folder named is the guarded root
        folder = OutputFolder(folder)
    paths = []
    try:
        for ext, options in (("png", {"dpi": 90, "metadata": {"Software": None}}),
                             ("svg", {"metadata": {"Date": None, "Creator": None}})):
            # Render in memory, then publish: a run killed while matplotlib writes leaves
            # the previous file (or none), never half a figure.
            buffer = io.BytesIO()
            fig.savefig(buffer, format=ext, bbox_inches="tight", **options)
            paths.append(folder.write_bytes(f"{stem}.{ext}", buffer.getvalue()))
    finally:
        plt.close(fig)
    return paths


def _none_last(value) -> float:
    """Sort key for budgets and block sizes: ``None`` (no limit) after every number."""
    return float("inf") if value is None else float(value)


def _block(block) -> str:
    return "none" if block is None else str(block)


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 4)
    return (n + cols - 1) // cols, cols


def passkey_heatmaps(records: list[dict], folder: Path) -> list[Path]:
    """One figure per (budget, block): a length x depth accuracy heatmap per policy (KeyDiff Fig. 6).

    The no-eviction ceiling (policy ``full``) is the first panel of every figure.
    """
    if not available() or not records:
        return []
    plt = _pyplot()
    ceiling = [r for r in records if r["params"]["policy"] == "full"]
    evicting = [r for r in records if r["params"]["policy"] != "full"]
    settings = sorted({(r["params"]["budget"], r["params"]["block"]) for r in evicting},
                      key=lambda s: (_none_last(s[0]), _none_last(s[1])))
    if not settings:
        settings = [(None, None)]
    written = []
    for budget, block in settings:
        panels = [("no eviction (ceiling)", ceiling)]
        chosen = [r for r in evicting if r["params"]["budget"] == budget and r["params"]["block"] == block]
        for policy in dict.fromkeys(r["params"]["policy"] for r in chosen):
            panels.append((format_spec_label(policy), [r for r in chosen if r["params"]["policy"] == policy]))
        lengths = sorted({r["params"]["length"] for r in records})
        depths = sorted({r["params"]["depth"] for r in records})
        rows, cols = _grid(len(panels))
        fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols + 1.0, 2.1 * rows + 0.6), squeeze=False,
                                 sharex=True, sharey=True, constrained_layout=True)
        image = None
        for index, (ax, (title, group)) in enumerate(zip(axes.flat, panels)):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for i, depth in enumerate(depths):
                for j, length in enumerate(lengths):
                    hits = [float(r["result"]["correct"]) for r in group
                            if r["params"]["depth"] == depth and r["params"]["length"] == length]
                    if hits:
                        grid[i, j] = float(np.mean(hits))
            image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="upper")
            mean = np.nanmean(grid) if np.isfinite(grid).any() else float("nan")
            ax.set_title(f"{title}\nacc {mean:.2f}", fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(v) for v in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            ax.tick_params(labelbottom=True)
            if index % cols == 0:
                ax.set_ylabel("needle depth")
            if index >= len(panels) - cols:
                ax.set_xlabel("prompt length (tokens)")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="exact-match accuracy")
        fig.suptitle(f"passkey retrieval, budget N={budget}, block B={_block(block)}", fontsize=9)
        written += _save(fig, folder, f"heatmap_N{budget}_B{_block(block)}")
    return written


def _gap(row: dict) -> float:
    return row["gap"] if row.get("gap") is not None else row["delta_ppl"]


def perplexity_bars(rows: list[dict], folder: Path) -> list[Path]:
    """Perplexity gap to no eviction per policy, one colour per (budget, block) (CAOTE Table 4),
    with the 95% interval of each gap."""
    rows = [r for r in rows if r.get("policy") != "full" and r.get("delta_ppl") is not None]
    if not available() or not rows:
        return []
    plt = _pyplot()
    groups = sorted({(r["budget"], r["block"]) for r in rows}, key=lambda g: (_none_last(g[0]), _none_last(g[1])))
    # Policies in the order of the group that has the most of them (ties: the first group).
    main = max(groups, key=lambda g: sum(1 for r in rows if (r["budget"], r["block"]) == g))
    order = {r["label"]: r["delta_ppl"] for r in rows if (r["budget"], r["block"]) == main}
    labels = sorted(dict.fromkeys(r["label"] for r in rows), key=lambda lab: order.get(lab, np.inf))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(labels) * len(groups)), 3.0))
    lowest = 0.0
    width = 0.8 / len(groups)
    x = np.arange(len(labels))
    for i, (budget, block) in enumerate(groups):
        chosen = {r["label"]: r for r in rows if r["budget"] == budget and r["block"] == block}
        # The pooled gap with its 95% bootstrap interval (the mean gap over texts, no bar, for
        # records kept before intervals were).
        values = [_gap(chosen[lab]) if lab in chosen else np.nan for lab in labels]
        ends = [(chosen[lab].get("gap_low", v), chosen[lab].get("gap_high", v)) if lab in chosen else (v, v)
                for lab, v in zip(labels, values)]
        below = [max(0.0, v - lo) if np.isfinite(v) else 0.0 for v, (lo, _) in zip(values, ends)]
        above = [max(0.0, hi - v) if np.isfinite(v) else 0.0 for v, (_, hi) in zip(values, ends)]
        ax.bar(x + (i - (len(groups) - 1) / 2) * width, values, width, yerr=[below, above], capsize=2,
               label=f"N={budget}, B={_block(block)}")
        lowest = min([lowest, *[v - e for v, e in zip(values, below) if np.isfinite(v)]])
    ax.set_xticks(x, labels, rotation=60, ha="right")
    ax.set_ylabel("perplexity - dense perplexity")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(bottom=lowest * 1.2)
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.legend(fontsize=7)
    ax.set_title("perplexity gap under eviction, 95% intervals (lower is better)")
    return _save(fig, folder, "ppl_gap")


def output_error_lines(curves: dict, folder: Path) -> list[Path]:
    """Normalised attention-output error per layer (CAOTE Fig. 3).

    Two figures: ``output_error_caote`` (each base policy solid, +CAOTE dashed,
    +FastCAOTE dotted, one colour per base) and ``output_error_by_layer`` (every policy).
    """
    if not available() or not curves:
        return []
    plt = _pyplot()
    settings = {(n, b) for (_, n, b) in curves}
    suffix = "" if len(settings) > 1 else " (N={}, B={})".format(*next(iter(settings)))

    def label(policy, budget, block):
        extra = f" (N={budget}, B={_block(block)})" if len(settings) > 1 else ""
        return format_spec_label(policy) + extra

    written = []
    families = {}
    for key in curves:
        name, params = parse_spec(key[0])
        base = str(params.get("base", "h2o")) if name == "caote" else name
        families.setdefault(base, []).append((key, name, params))
    caote_bases = {base for base, members in families.items() if any(name == "caote" for _, name, _ in members)}
    if caote_bases:
        fig, ax = plt.subplots(figsize=(6.0, 3.2))
        for colour, base in enumerate(sorted(caote_bases)):
            for key, name, params in families[base]:
                style = "-" if name != "caote" else (":" if params.get("fast") else "--")
                ax.plot(np.arange(len(curves[key])), curves[key], style, color=f"C{colour}", linewidth=1.0,
                        label=label(*key))
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel(r"$\|o_e - o_d\|^2 / \|o_d\|^2$")
        ax.set_title("output error with and without CAOTE" + suffix, fontsize=8)
        ax.legend(fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        written += _save(fig, folder, "output_error_caote")
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    for i, key in enumerate(k for k in curves if parse_spec(k[0])[0] != "caote"):
        ax.plot(np.arange(len(curves[key])), curves[key], "-" if i < 10 else "--", linewidth=1.0,
                label=label(*key))
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(r"$\|o_e - o_d\|^2 / \|o_d\|^2$")
    ax.set_title("attention-output error of the kept cache" + suffix, fontsize=8)
    ax.legend(fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return written + _save(fig, folder, "output_error_by_layer")


def alr_lines(by_layer: dict, folder: Path) -> list[Path]:
    """Attention loss ratio (HashEvict Eq. 7 / T) per layer for each ranking."""
    if not available() or not by_layer:
        return []
    plt = _pyplot()
    # HashEvict's comparison (L2, its App. D ranking, the policy) and a few others; the CSV has all.
    shown = [n for n in ("l2", "lsh", "hashevict", "keydiff", "tova", "snapkv", "scissorhands") if n in by_layer]
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    for name in shown or list(by_layer):
        curve = by_layer[name]
        label = {"l2": "L2 norm", "lsh": "LSH (App. D)"}.get(name) or format_spec_label(name)
        style = "-" if name in ("l2", "lsh", "hashevict") else "--"
        ax.plot(np.arange(len(curve)), curve, style, linewidth=1.0, label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention loss ratio / T")
    ax.set_title("cumulative attention-loss gap to the ideal ranking (lower is better)")
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, folder, "alr_by_layer")


def cosine_picture(picture: dict | None, folder: Path) -> list[Path]:
    """KeyDiff Fig. 2: key cosine similarity of the first 64 tokens beside the attention they receive."""
    if not available() or not picture:
        return []
    plt = _pyplot()
    cos = np.asarray(picture["cosine"])
    received = np.asarray(picture["received"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(4.0, 5.0), height_ratios=(3, 1), sharex=True)
    image = top.imshow(-cos, cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=top, label="negative cosine similarity")
    top.set_title(f"keys of layer {picture['layer']}, KV head {picture['head']} (first {len(received)} tokens)")
    top.set_ylabel("key")
    bottom.bar(np.arange(len(received)), received)
    bottom.set_xlabel("key")
    bottom.set_ylabel("mean attention\nreceived")
    return _save(fig, folder, "cosine_vs_attention")


def log_volume_boxes(distributions: dict, folder: Path) -> list[Path]:
    """KeyDiff Fig. 5: distribution over layers, heads and prompts of log det of the kept keys' Gram matrix."""
    distributions = {k: v for k, v in distributions.items() if len(v)}
    if not available() or not distributions:
        return []
    plt = _pyplot()
    order = sorted(distributions, key=lambda k: float(np.median(distributions[k])))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(order)), 3.0))
    ax.boxplot([distributions[k] for k in order], showfliers=False)
    ax.set_xticks(np.arange(1, len(order) + 1), order, rotation=60, ha="right")
    ax.set_ylabel(r"$\log\det(K^\top K)$ of kept keys")
    ax.set_title("volume spanned by the kept keys (higher = more diverse)")
    return _save(fig, folder, "log_volume")


def pca_scatter(pictures: dict, folder: Path) -> list[Path]:
    """KeyDiff Fig. 4: PCA of one head's keys, retained (blue) vs evicted (orange), per policy."""
    if not available() or not pictures:
        return []
    plt = _pyplot()
    names = list(pictures)
    fig, axes = plt.subplots(1, len(names), figsize=(2.6 * len(names), 2.9), squeeze=False, constrained_layout=True)
    for ax, name in zip(axes[0], names):
        xy = np.asarray(pictures[name]["xy"])
        kept = np.asarray(pictures[name]["kept"], dtype=bool)
        # Rasterised points keep the SVG small (thousands of markers otherwise).
        ax.scatter(xy[~kept, 0], xy[~kept, 1], s=3, color="tab:orange", label="evicted", rasterized=True)
        ax.scatter(xy[kept, 0], xy[kept, 1], s=3, color="tab:blue", label="retained", rasterized=True)
        ax.set_title(name)
        ax.set_xticks([])
        ax.set_yticks([])
    first = pictures[names[0]]
    axes[0][0].legend(fontsize=6, loc="best")
    fig.suptitle(f"PCA of the keys of layer {first['layer']}, KV head {first['head']}", fontsize=9)
    return _save(fig, folder, "pca_retained")
