"""Draw the quality-against-budget figure from the published experiment tables.

Run after ``refkv experiment ... --publish docs/_static/experiments`` (needs matplotlib)::

    python docs/choosing_figure.py

It reads ``docs/_static/experiments/perplexity/ppl.csv`` and
``docs/_static/experiments/passkey/accuracy.csv`` and writes, under
``docs/_static/choosing/``:

* ``quality_vs_budget.csv`` -- every number the figure plots (one row per point), with its
  95% interval (``low``, ``high``) and sample size ``n`` (tokens for perplexity, prompts for
  passkey);
* ``quality_vs_budget.svg`` and ``.png`` -- left: the perplexity increase over no eviction
  against the budget ``N`` (block ``B = 32``), one line per policy, with the bar of its
  95% paired block-bootstrap interval (dodged sideways); right: passkey accuracy at ``N = 256`` per policy,
  with block processing (``B = 128``) and one-shot (``B = None``), Wilson 95% intervals,
  against the no-eviction ceiling.

The figure heads both the experiments page and the "choosing a policy" page.
``tests/docs/test_docs.py`` recomputes the points from the experiment tables and fails when
the committed CSV disagrees, so the figure cannot silently fall behind the experiments.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import sys
from pathlib import Path

from refkv.experiments.tables import csv_text
from refkv.experiments.tables import write_csv as experiments_csv
from refkv.files import OutputFolder

HERE = Path(__file__).resolve().parent
EXPERIMENTS = HERE / "_static" / "experiments"
OUT = HERE / "_static" / "choosing"
#: The policies drawn (CAOTE variants are on the experiments page; they sit on top of H2O here).
POLICIES = ["h2o", "caote:base=h2o", "snapkv", "tova", "scissorhands", "sink", "mat", "hashevict",
            "keydiff", "knorm"]
LABELS = {"h2o": "H2O", "caote:base=h2o": "H2O+CAOTE", "snapkv": "SnapKV", "tova": "TOVA",
          "scissorhands": "Scissorhands", "sink": "sink", "mat": "MAT", "hashevict": "HashEvict",
          "keydiff": "KeyDiff", "knorm": "L2 norm", "full": "no eviction"}
PPL_BLOCK = "32"
PASSKEY_BUDGET = "256"
#: The left panel's lowest perplexity increase (log axis).
FLOOR = 0.03
#: Sideways shift between two policies' points in the left panel, in budget units.
DODGE = 2.6
#: Least vertical distance between two line labels, in decades of the log axis.
LABEL_GAP = 0.105
COLUMNS = ["panel", "policy", "budget", "block", "value", "low", "high", "n"]


def _read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def points(experiments: Path = EXPERIMENTS) -> list[dict]:
    """The figure's points: perplexity increase per (policy, N) and passkey accuracy per (policy, B),
    each with its 95% interval and sample size.

    Values are rounded to 4 significant digits (what the CSV holds).
    """
    rows = []
    for r in _read(experiments / "perplexity" / "ppl.csv"):
        if r["policy"] in POLICIES and r["block"] == PPL_BLOCK and r["budget"]:
            rows.append({"panel": "delta_ppl", "policy": r["policy"], "budget": r["budget"], "block": r["block"],
                         "value": _g(r["gap"]), "low": _g(r["gap_low"]), "high": _g(r["gap_high"]),
                         "n": r["tokens"]})
    for r in _read(experiments / "passkey" / "accuracy.csv"):
        if not r["accuracy"]:
            continue  # a skipped setting (the policy cannot run it)
        if r["policy"] == "full" or (r["policy"] in POLICIES and r["budget"] == PASSKEY_BUDGET):
            rows.append({"panel": "passkey", "policy": r["policy"], "budget": r["budget"], "block": r["block"],
                         "value": _g(r["accuracy"]), "low": _g(r["acc_low"]), "high": _g(r["acc_high"]),
                         "n": r["n"]})
    rows.sort(key=lambda r: (r["panel"], POLICIES.index(r["policy"]) if r["policy"] in POLICIES else -1,
                             int(r["budget"] or 0), r["block"]))
    return rows


def _g(value: str) -> str:
    """A table's number to 4 significant digits; an empty cell stays empty."""
    return f"{float(value):.4g}" if value not in ("", None) else ""


def write_csv(rows: list[dict], path: Path) -> None:
    experiments_csv(path, rows, COLUMNS)  # atomic, like every table the experiments write


def draw(rows: list[dict], out: Path = OUT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import math

    import matplotlib.pyplot as plt

    colors = dict(zip(POLICIES, plt.get_cmap("tab10").colors))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.8), gridspec_kw={"width_ratios": [1.3, 1]})
    ends, budgets = [], set()
    drawn = [p for p in POLICIES if any(r["panel"] == "delta_ppl" and r["policy"] == p for r in rows)]
    for i, policy in enumerate(drawn):
        pts = sorted((int(r["budget"]), float(r["value"]), float(r["low"] or r["value"]),
                      float(r["high"] or r["value"])) for r in rows
                     if r["panel"] == "delta_ppl" and r["policy"] == policy)
        xs, ys, lows, highs = zip(*pts)
        budgets.update(xs)
        # Each policy's points are shifted sideways by a few budget units (dodged), so that the
        # eleven 95% intervals are separate bars rather than bands drawn on top of each other.
        shift = (i - (len(drawn) - 1) / 2) * DODGE
        dx = [x + shift for x in xs]
        left.plot(dx, ys, "o-", color=colors[policy], label=LABELS[policy], markersize=3.5, lw=1.2)
        # An interval's lower end at or below 0 is drawn at the axis floor (the axis is logarithmic).
        low_ends = [max(lo, FLOOR) for lo in lows]
        left.errorbar(dx, ys, yerr=[[y - lo for y, lo in zip(ys, low_ends)], [hi - y for y, hi in zip(ys, highs)]],
                      fmt="none", ecolor=colors[policy], elinewidth=0.9, alpha=0.55, capsize=0)
        ends.append([math.log10(ys[-1]), dx[-1], ys[-1], policy])
    # Line labels at the right ends, pushed apart (in decades of the log axis) where lines end
    # close together, each joined to its line's end by a thin leader.
    ends.sort()
    for below, above in itertools.pairwise(ends):
        above[0] = max(above[0], below[0] + LABEL_GAP)
    label_x = max(budgets, default=256) + 22
    for label_y, x, y, policy in ends:
        left.annotate(LABELS[policy], (x, y), xytext=(label_x, 10 ** label_y), textcoords="data",
                      va="center", fontsize=8, color=colors[policy],
                      arrowprops={"arrowstyle": "-", "color": colors[policy], "lw": 0.6, "alpha": 0.7})
    left.set_yscale("log")
    left.set_ylim(FLOOR, None)
    left.set_xticks(sorted(budgets))
    left.set_xlim(min(budgets, default=96) - 20, max(budgets, default=256) + 95)
    left.set_xlabel("budget N (tokens per layer and KV head)")
    left.set_ylabel("perplexity increase over no eviction")
    tokens = sorted({int(r["n"]) for r in rows if r["panel"] == "delta_ppl" and r["n"]})
    left.set_title(f"Perplexity, B = {PPL_BLOCK}, {tokens[-1] if tokens else '?'} tokens; bars: 95% CI",
                   fontsize=10)
    left.grid(True, which="major", alpha=0.3)

    full = [r for r in rows if r["panel"] == "passkey" and r["policy"] == "full"]
    names = [p for p in POLICIES if any(r["panel"] == "passkey" and r["policy"] == p for r in rows)]
    for i, policy in enumerate(names):
        for block, marker, shift in (("128", "o", -0.17), ("none", "s", 0.17)):
            hit = [r for r in rows if r["panel"] == "passkey" and r["policy"] == policy and r["block"] == block]
            if hit:
                x, lo, hi = (float(hit[0][k]) for k in ("value", "low", "high"))
                right.errorbar(x, i + shift, xerr=[[x - lo], [hi - x]], fmt=marker, color=colors[policy],
                               markersize=6, capsize=2, lw=1,
                               markerfacecolor=colors[policy] if block == "128" else "white")
    if full:
        ceiling = float(full[0]["value"])
        right.axvline(ceiling, color="0.3", ls="--", lw=1)
        right.text(ceiling, len(names) - 0.9, " no eviction", fontsize=8, color="0.3")
    right.set_yticks(range(len(names)), [LABELS[p] for p in names])
    right.invert_yaxis()
    right.set_xlim(-0.05, 1.05)
    prompts = sorted({int(r["n"]) for r in rows if r["panel"] == "passkey" and r["n"]})
    right.set_xlabel(f"passkey accuracy ({prompts[-1] if prompts else '?'} prompts; bars: Wilson 95% CI)")
    right.set_title(f"Passkey, N = {PASSKEY_BUDGET}: filled B = 128, open one-shot", fontsize=10)
    right.grid(True, axis="x", alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct: lower left and further right are better", fontsize=11)
    fig.tight_layout()
    for ext in ("svg", "png"):
        data = io.BytesIO()
        fig.savefig(data, format=ext, dpi=110, metadata={"Date": None} if ext == "svg" else None)
        OutputFolder(out).write_bytes(f"quality_vs_budget.{ext}", data.getvalue())
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/choosing_figure.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if quality_vs_budget.csv differs from what would be written "
                             "(the figures are not compared: matplotlib's bytes vary by version)")
    args = parser.parse_args(argv)  # unknown arguments: exit 2; --help: exit 0, nothing written
    rows = points()
    if not rows:  # never replace the published figure with an empty one
        parser.error(f"no point could be computed from the experiment tables under {EXPERIMENTS}")
    folder = OutputFolder(OUT, what="output folder")
    stale = folder.publish({"quality_vs_budget.csv": csv_text(rows, COLUMNS)}, check=args.check)
    if args.check:
        print(f"differs: {OUT / 'quality_vs_budget.csv'}" if stale else "quality_vs_budget.csv is up to date")
        return 1 if stale else 0
    draw(rows)
    print(f"wrote {OUT}/quality_vs_budget.csv, .svg, .png ({len(rows)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
