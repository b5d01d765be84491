"""Phase two's verdicts, recomputed from its committed records alone.

Reads every ``*.jsonl.gz`` under ``_static/experiments/phase2/records/`` (gzip JSON lines, one
record per cell as ``refkv experiment`` writes it; each record names its experiment:
``passkey2``, ``perplexity2``, ``attention_loss2``, ``geometry2``), the registration
(``experiment_registration_phase2.json``) and the power analysis
(``_static/experiments/phase2/power.csv``, from ``docs/phase2_power.py``), and writes into
``_static/experiments/phase2/``, each file atomically:

* ``verdicts.csv``: one row per registered comparison, claims in registered order: n,
  estimate, 95% interval, p, Holm-adjusted p, verdict, the registered power beside "not
  resolved", the paper effect and label, the kind x policy and document x policy interaction
  p; a claim without records is "not run", comparison by comparison;
* ``units.csv``: one row per unit (document, or passkey prompt ``document/window``) and
  comparison, with its kind, at full precision;
* ``strata.csv``: per kind (and, for passkey, per document) every comparison's estimate;
* ``calibration.csv``: the passkey floor and ceiling check, the chosen budget and the power
  recomputed from the calibration's discordance;
* ``bootstrap.csv``: the perplexity claims' two-stage bootstrap beside the t interval, with
  its spread over 20 seeds;
* ``seeds.csv``: HashEvict's per-seed values per document; ``distinctiveness.csv``: the
  needle's distinctiveness per test prompt against each policy's answer;
* ``cost.csv``: what each part of each grid cost, from the records' own cell times;
* ``verdicts.svg``: each comparison with records, its estimate and 95% interval, and beside it
  its estimate within each kind of text (the kind x policy interaction made visible); drawn
  from ``verdicts.csv`` and ``strata.csv`` alone (needs matplotlib: the ``plot`` extra);
* ``verdicts.inc``: the verdicts in words for the results page, written from ``verdicts.csv``'s
  own text (so the page says what the table says).

Every rule lives in :mod:`refkv.experiments.phase2_analysis`; this script reads and writes::

    python docs/phase2_verdicts.py            # rewrite the CSVs
    python docs/phase2_verdicts.py --check    # write nothing; exit 1 naming each CSV that differs
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from pathlib import Path

from refkv.experiments.phase2_analysis import (
    BOOTSTRAP_COLUMNS,
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEEDS,
    COST_COLUMNS,
    STRATA_COLUMNS,
    UNIT_COLUMNS,
    VERDICT_COLUMNS,
    analyse,
    cost_rows,
    read_gzip_records,
    verdict_words,
)
from refkv.experiments.registered import read_registration
from refkv.experiments.tables import csv_text
from refkv.files import OutputFolder, read_regular

HERE = Path(__file__).resolve().parent
REGISTRATION = HERE / "experiment_registration_phase2.json"
OUT = HERE / "_static" / "experiments" / "phase2"
RECORDS = OUT / "records"
POWER = OUT / "power.csv"
#: Most records files read, and the largest power table.
MAX_FILES = 64
MAX_POWER_BYTES = 1 << 20


def read_records_folder(folder: Path) -> dict[str, list[dict]]:
    """``{experiment: records}`` from the ``*.jsonl.gz`` files of ``folder`` (none: ``{}``). A record
    is filed under its ``experiment`` field; a record of one key in two files: the later file wins."""
    if not folder.is_dir():
        return {}
    paths = sorted(folder.glob("*.jsonl.gz"))
    if len(paths) > MAX_FILES:
        raise ValueError(f"{folder}: {len(paths)} records files, more than the {MAX_FILES} allowed")
    by_key: dict[tuple, dict] = {}
    for path in paths:
        for record in read_gzip_records(path):
            experiment = record.get("experiment")
            if not isinstance(experiment, str):
                raise ValueError(f"{path}: a record without its experiment's name (key {record['key'][:60]})")
            by_key[(experiment, record["key"])] = record
    out: dict[str, list[dict]] = {}
    for (experiment, _), record in by_key.items():
        out.setdefault(experiment, []).append(record)
    return out


def read_power(path: Path) -> dict[tuple, dict]:
    """``power.csv``'s rows by (claim, a, b)."""
    text = read_regular(path, MAX_POWER_BYTES, what="power table").decode("utf-8")
    return {(r["claim"], r["a"], r["b"]): r for r in csv.DictReader(io.StringIO(text))}


def table_files(records: Path, power: Path, *, resamples: int = BOOTSTRAP_RESAMPLES,
                seeds: int = BOOTSTRAP_SEEDS, bootstrap: bool = True, figure: bool = True) -> dict[str, str | bytes]:
    """Every file this script writes (name -> text), computed before any is written (``bootstrap``
    False: the bootstrap display is left as "not run", for a quick check of the other tables; ``figure``
    False: no ``verdicts.svg``, whose bytes depend on the matplotlib version)."""
    by_experiment = read_records_folder(records)
    out = analyse(read_registration(REGISTRATION), by_experiment, read_power(power),
                  n_boot=resamples, seeds=seeds, bootstrap=bootstrap)
    seed_columns = ["claim", "document", "kind", "hashevict:seed=0", "hashevict:seed=1", "hashevict:seed=2", "mean"]
    calibration_columns = ["budget", "claim", "a", "b", "mean_accuracy", "verdict", "discordance", "power_at_n"]
    distinct_columns = ["document", "window", "kind", "distinctiveness", "full",
                        *sorted({k for r in out["distinctiveness"] for k in r if "@" in k})]
    verdicts = csv_text(out["verdicts"], VERDICT_COLUMNS)
    strata = csv_text(out["strata"], STRATA_COLUMNS)
    verdict_rows = list(csv.DictReader(io.StringIO(verdicts)))
    words = verdict_words(read_registration(REGISTRATION), verdict_rows)
    files = {"verdicts.csv": verdicts, "verdicts.inc": words,
            "units.csv": csv_text(out["units"], UNIT_COLUMNS),
            "strata.csv": strata,
            "calibration.csv": csv_text(out["calibration"], calibration_columns),
            "bootstrap.csv": csv_text(out["bootstrap"], BOOTSTRAP_COLUMNS),
            "seeds.csv": csv_text(out["seeds"], seed_columns),
            "distinctiveness.csv": csv_text(out["distinctiveness"], distinct_columns),
            "cost.csv": csv_text(cost_rows(by_experiment), COST_COLUMNS)}
    svg = verdicts_svg(verdict_rows, list(csv.DictReader(io.StringIO(strata)))) if figure else None
    if svg is not None:
        files["verdicts.svg"] = svg
    return files


VERDICT_COLORS = {"holds": "tab:green", "reversed": "tab:red", "not resolved": "0.4",
                  "secondary (no verdict)": "tab:blue"}
KIND_MARKERS = "s^vD<>ph"


def _short(setting: str, limit: int = 95) -> str:
    """A claim's setting short enough for a panel title: its parenthetical remarks dropped when
    it is longer than ``limit`` characters, then cut with an ellipsis if still too long (the
    full setting is in ``verdicts.csv`` and the words above the figure)."""
    while len(setting) > limit and re.search(r" \([^()]*\)", setting):   # innermost first
        setting = re.sub(r" \([^()]*\)", "", setting)
    return setting if len(setting) <= limit else setting[:limit - 1].rstrip() + "\u2026"


def verdicts_svg(verdicts: list[dict], strata: list[dict]) -> bytes | None:
    """The figure of the results page: one panel per claim with records, each comparison's
    estimate and 95% interval coloured by its verdict, and its estimate within each kind of
    text as small open markers on the same row. Rows are CSV rows (strings). None when no
    comparison has an estimate yet."""
    rows = [r for r in verdicts if r.get("estimate") not in (None, "")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "refkv"   # reproducible element ids
    plt.rcParams["svg.fonttype"] = "none"    # text stays text (searchable, and testable)
    claims = list(dict.fromkeys(r["claim"] for r in rows))
    kinds = sorted({s["stratum"] for s in strata if s["stratum_type"] == "kind"})
    marker = {k: KIND_MARKERS[i % len(KIND_MARKERS)] for i, k in enumerate(kinds)}
    heights = [len([r for r in rows if r["claim"] == c]) + 1.2 for c in claims]
    fig, axes = plt.subplots(len(claims), 1, figsize=(9, 0.45 * sum(heights) + 1.2),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, claim in zip(axes[:, 0], claims):
        these = [r for r in rows if r["claim"] == claim]
        for i, r in enumerate(these):
            x, lo, hi = float(r["estimate"]), float(r["low"]), float(r["high"])
            ax.errorbar(x, i, xerr=[[x - lo], [hi - x]], fmt="o", capsize=3, markersize=6,
                        color=VERDICT_COLORS.get(r["verdict"], "black"), zorder=3)
            for s in strata:
                if (s["claim"], s["a"], s["b"], s["stratum_type"]) == (claim, r["a"], r["b"], "kind"):
                    ax.plot(float(s["estimate"]), i + 0.25, marker[s["stratum"]], markersize=4,
                            markerfacecolor="none", color="0.35", label=s["stratum"])
        ax.axvline(0.0, color="0.3", lw=0.8)
        ax.set_yticks(range(len(these)), [r["a"] if not r["b"] else f"{r['a']} - {r['b']}" for r in these],
                      fontsize=8)
        ax.set_ylim(len(these) - 0.4, -0.6)
        ax.set_title(f"{claim} ({these[0]['n']} {these[0]['unit']}; {_short(these[0]['setting'])})",
                     fontsize=8.5, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        fig.legend(unique.values(), list(unique), loc="lower center", ncol=min(len(unique), 6), fontsize=7.5,
                   frameon=False, title="open markers: the estimate within each kind of text", title_fontsize=7.5)
    fig.suptitle("Phase two: estimate and 95% interval per comparison\n(green holds, red reversed, grey not "
                 "resolved, blue secondary)", fontsize=8.5)
    fig.tight_layout(rect=(0, 0.08 if unique else 0, 1, 1))
    data = io.BytesIO()
    fig.savefig(data, format="svg", metadata={"Date": None})
    plt.close(fig)
    return data.getvalue()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python docs/phase2_verdicts.py", description=__doc__.splitlines()[0])
    parser.add_argument("--records", default=str(RECORDS), metavar="DIR",
                        help=f"the folder of the *.jsonl.gz records (default {RECORDS})")
    parser.add_argument("--out", default=str(OUT), metavar="DIR", help=f"where the CSVs go (default {OUT})")
    parser.add_argument("--power", default=str(POWER), metavar="CSV", help=f"the power table (default {POWER})")
    parser.add_argument("--resamples", type=int, default=BOOTSTRAP_RESAMPLES,
                        help=f"bootstrap resamples (registered: {BOOTSTRAP_RESAMPLES})")
    parser.add_argument("--seeds", type=int, default=BOOTSTRAP_SEEDS,
                        help=f"bootstrap seeds whose spread is shown (registered: {BOOTSTRAP_SEEDS})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each CSV that differs from what would be written")
    args = parser.parse_args(argv)  # unknown arguments: exit 2
    try:
        folder = OutputFolder(args.out, what="--out", inputs=[args.records, args.power])
        if args.resamples < 100 or args.seeds < 1:
            raise ValueError(f"--resamples must be >= 100 and --seeds >= 1, got {args.resamples} and {args.seeds}")
        files = table_files(Path(args.records), Path(args.power), resamples=args.resamples, seeds=args.seeds)
    except ValueError as err:
        parser.error(str(err))
    stale = folder.publish(files, check=args.check)
    if args.check:
        for name in stale:
            print(f"differs: {folder.path(name)}")
        print(f"{len(stale)} of {len(files)} files differ")
        return 1 if stale else 0
    verdicts = list(csv.DictReader(io.StringIO(files["verdicts.csv"])))
    ran = sum(not r["verdict"].startswith("not run") for r in verdicts)
    print(f"{ran} of {len(verdicts)} comparisons have records -> {args.out} ({len(stale)} files changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
