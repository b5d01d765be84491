"""Draw the "Which policy, which budget" figure from the published experiment tables.

Run after ``refkv experiment ... --publish docs/_static/experiments`` (needs matplotlib)::

    python docs/choosing_figure.py

It reads ``docs/_static/experiments/perplexity/ppl.csv`` and
``docs/_static/experiments/passkey/accuracy.csv`` and writes, under
``docs/_static/choosing/``:

* ``quality_vs_budget.csv`` -- every number the figure plots (one row per point);
* ``quality_vs_budget.svg`` and ``.png`` -- left: the perplexity increase over no
  eviction against the budget ``N`` (block ``B = 32``), one line per policy; right:
  passkey accuracy at ``N = 256`` per policy, with block processing (``B = 128``) and
  one-shot (``B = None``), against the no-eviction ceiling.

``tests/test_docs.py`` recomputes the points from the experiment tables and fails when
the committed CSV disagrees, so the figure cannot silently fall behind the experiments.
"""

from __future__ import annotations

import csv
import itertools
import os
import sys
import tempfile
from pathlib import Path

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
COLUMNS = ["panel", "policy", "budget", "block", "value"]


def _read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def points(experiments: Path = EXPERIMENTS) -> list[dict]:
    """The figure's points: perplexity increase per (policy, N) and passkey accuracy per (policy, B).

    Values are rounded to 4 significant digits (what the CSV holds).
    """
    rows = []
    for r in _read(experiments / "perplexity" / "ppl.csv"):
        if r["policy"] in POLICIES and r["block"] == PPL_BLOCK and r["budget"]:
            rows.append({"panel": "delta_ppl", "policy": r["policy"], "budget": r["budget"],
                         "block": r["block"], "value": f"{float(r['delta_ppl']):.4g}"})
    for r in _read(experiments / "passkey" / "accuracy.csv"):
        if not r["accuracy"]:
            continue  # a skipped setting (the policy cannot run it)
        if r["policy"] == "full" or (r["policy"] in POLICIES and r["budget"] == PASSKEY_BUDGET):
            rows.append({"panel": "passkey", "policy": r["policy"], "budget": r["budget"],
                         "block": r["block"], "value": f"{float(r['accuracy']):.4g}"})
    rows.sort(key=lambda r: (r["panel"], POLICIES.index(r["policy"]) if r["policy"] in POLICIES else -1,
                             int(r["budget"] or 0), r["block"]))
    return rows


def _write_atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_csv(rows: list[dict], path: Path) -> None:
    def write(tmp):
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)

    _write_atomic(path, write)


def draw(rows: list[dict], out: Path = OUT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import math

    import matplotlib.pyplot as plt

    colors = dict(zip(POLICIES, plt.get_cmap("tab10").colors))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
    ends = []
    for policy in POLICIES:
        pts = sorted((int(r["budget"]), float(r["value"])) for r in rows
                     if r["panel"] == "delta_ppl" and r["policy"] == policy)
        if not pts:
            continue
        xs, ys = zip(*pts)
        left.plot(xs, ys, "o-", color=colors[policy], label=LABELS[policy])
        ends.append([math.log10(ys[-1]), xs[-1], ys[-1], policy])
    # Line labels at the right ends, pushed apart where two lines end close together.
    ends.sort()
    for below, above in itertools.pairwise(ends):
        above[0] = max(above[0], below[0] + 0.07)
    for label_y, x, y, policy in ends:
        left.annotate(LABELS[policy], (x, y), xytext=(x + 8, 10 ** label_y), textcoords="data",
                      va="center", fontsize=8, color=colors[policy])
    left.set_yscale("log")
    left.set_xticks([128, 256])
    left.set_xlim(110, 330)
    left.set_xlabel("budget N (tokens per layer and KV head)")
    left.set_ylabel("perplexity increase over no eviction")
    left.set_title(f"Perplexity, 1,024-token texts, B = {PPL_BLOCK}", fontsize=10)
    left.grid(True, which="both", alpha=0.3)

    full = [float(r["value"]) for r in rows if r["panel"] == "passkey" and r["policy"] == "full"]
    names = [p for p in POLICIES if any(r["panel"] == "passkey" and r["policy"] == p for r in rows)]
    for i, policy in enumerate(names):
        for block, marker, shift in (("128", "o", -0.15), ("none", "s", 0.15)):
            vals = [float(r["value"]) for r in rows if r["panel"] == "passkey" and r["policy"] == policy
                    and r["block"] == block]
            if vals:
                right.plot(vals[0], i + shift, marker, color=colors[policy], markersize=7,
                           markerfacecolor=colors[policy] if block == "128" else "white")
    if full:
        right.axvline(full[0], color="0.3", ls="--", lw=1)
        right.text(full[0], len(names) - 0.4, " no eviction", fontsize=8, color="0.3")
    right.set_yticks(range(len(names)), [LABELS[p] for p in names])
    right.invert_yaxis()
    right.set_xlim(-0.05, 1.05)
    right.set_xlabel("passkey accuracy (10 prompts of 1-2K tokens)")
    right.set_title(f"Passkey, N = {PASSKEY_BUDGET}: filled B = 128, open one-shot", fontsize=10)
    right.grid(True, axis="x", alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct: lower left and further right are better", fontsize=11)
    fig.tight_layout()
    for ext in ("svg", "png"):
        _write_atomic(out / f"quality_vs_budget.{ext}",
                      lambda tmp, ext=ext: fig.savefig(tmp, format=ext, dpi=110, metadata={"Date": None}
                                                       if ext == "svg" else None))
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    rows = points()
    OUT.mkdir(exist_ok=True)
    write_csv(rows, OUT / "quality_vs_budget.csv")
    draw(rows)
    print(f"wrote {OUT}/quality_vs_budget.csv, .svg, .png ({len(rows)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
