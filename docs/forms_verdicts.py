"""Paper form vs authors' form: units and verdicts recomputed from the committed records alone.

Usage (from the repository root)::

    python docs/forms_verdicts.py [RECORDS] [OUT]

``RECORDS`` defaults to ``docs/_static/experiments/forms/records/forms.jsonl.gz`` (gzip JSON
lines as ``refkv experiment forms`` writes them), ``OUT`` to ``docs/_static/experiments/forms``.
It writes, atomically, through refkv's guarded output folder:

* ``units.csv``: one row per comparison, metric and unit (prompt or document) with A's and
  B's value, from which every number below is computed;
* ``verdicts.csv``: per registered comparison (``docs/forms_registration.json``) and metric:
  n, A's and B's mean, the full cache's, the estimate A - B with its 95% interval, the
  two-sided p, the Holm-adjusted p over the 8 tests and the label;
* ``per_kind.csv``: the same estimate per kind of document, and the kind x policy interaction.

A comparison whose records are missing is written as ``not run``, never left out.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import numpy as np

from refkv.experiments.forms import COMPARISONS, label
from refkv.experiments.phase2_analysis import read_gzip_records
from refkv.experiments.stats import (
    holm,
    mcnemar_exact,
    newcombe_paired_difference,
    paired_t_test,
    stratified_binary,
    stratified_mean,
)
from refkv.files import OutputFolder, load_json

ROOT = Path(__file__).resolve().parent
RECORDS = ROOT / "_static" / "experiments" / "forms" / "records" / "forms.jsonl.gz"
OUT = ROOT / "_static" / "experiments" / "forms"
REGISTRATION = ROOT / "forms_registration.json"
METRICS = ("passkey", "perplexity")


def read_records(path: Path) -> list[dict]:
    """The records of ``path`` (gzip JSON lines, read within refkv's caps by
    :func:`refkv.experiments.phase2_analysis.read_gzip_records`); a missing file: none."""
    return read_gzip_records(path) if Path(path).is_file() else []


def _unit(params: dict) -> tuple:
    return (params["document"], params["window"])


def values(records: list[dict]) -> dict[tuple, dict[tuple, tuple[float, str]]]:
    """(metric, variant label) -> {unit: (value, kind)}: passkey correct (0/1), perplexity of the continuation."""
    out: dict[tuple, dict] = {}
    for r in records:
        p, res = r["params"], r["result"]
        value = float(res["correct"]) if p["task"] == "passkey" else float(res["ppl"])
        key = (p["task"], p["regime"], label(p["policy"], p["heads"]))
        out.setdefault(key, {})[_unit(p)] = (value, res["kind"])
    return out


def _regime(spec: str) -> str:
    return "hashevict" if spec.startswith("hashevict") else "prefill"


def unit_rows(records: list[dict]) -> list[dict]:
    """Every comparison's paired units: the rows of ``units.csv``."""
    table = values(records)
    rows = []
    for cid, (a, b) in COMPARISONS.items():
        regime = _regime(a[0])
        for metric in METRICS:
            va, vb = table.get((metric, regime, label(*a)), {}), table.get((metric, regime, label(*b)), {})
            full = table.get((metric, regime, label("full", "gqa")), {})
            for unit in sorted(set(va) & set(vb)):
                rows.append({"comparison": cid, "metric": metric, "document": unit[0], "window": unit[1],
                             "kind": va[unit][1], "a": va[unit][0], "b": vb[unit][0],
                             "full": full[unit][0] if unit in full else ""})
    return rows


def verdict_rows(units: list[dict], alpha: float) -> tuple[list[dict], list[dict]]:
    """``verdicts.csv`` and ``per_kind.csv`` rows from the unit rows, as registered."""
    rows, kinds = [], []
    for cid in COMPARISONS:
        for metric in METRICS:
            mine = [u for u in units if u["comparison"] == cid and u["metric"] == metric]
            row = {"comparison": cid, "metric": metric, "n": len(mine)}
            if len(mine) < 2:
                rows.append({**row, "label": "not run"})
                continue
            a = np.array([u["a"] for u in mine])
            b = np.array([u["b"] for u in mine])
            strata = [u["kind"] for u in mine]
            full = [u["full"] for u in mine if u["full"] != ""]
            if metric == "passkey":
                interval = newcombe_paired_difference(a.astype(bool), b.astype(bool))
                only_a, only_b, p = mcnemar_exact(a.astype(bool), b.astype(bool))
                split = stratified_binary(a.astype(bool), b.astype(bool), strata)
                extra = {"only_a": only_a, "only_b": only_b}
            else:
                interval, p = paired_t_test(a, b)
                split = stratified_mean(a, b, strata)
                extra = {"only_a": "", "only_b": ""}
            rows.append({**row, "mean_a": float(a.mean()), "mean_b": float(b.mean()),
                         "mean_full": float(np.mean(full)) if full else "", "estimate": interval.estimate,
                         "low": interval.low, "high": interval.high, **extra, "p": p,
                         "p_interaction": split["p_interaction"]})
            kinds.extend({"comparison": cid, "metric": metric, "kind": kind, **stats}
                         for kind, stats in split["strata"].items())
    tested = [r for r in rows if "p" in r]
    adjusted = holm([r["p"] for r in tested]) if tested else []
    for r, p_holm in zip(tested, adjusted):
        r["p_holm"] = float(p_holm)
        r["label"] = "differs" if p_holm < alpha else "not resolved"
    return rows, kinds


def _csv(rows: list[dict], columns: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buffer.getvalue()


VERDICT_COLUMNS = ["comparison", "metric", "n", "mean_a", "mean_b", "mean_full", "estimate", "low", "high",
                   "only_a", "only_b", "p", "p_holm", "label", "p_interaction"]


def registered_label(name: str) -> str:
    """A variant as the registration names it: ``spec@heads``, or ``spec`` alone for the model itself."""
    return name if "@" in name else label(name, "gqa")


def main(argv: list[str]) -> int:
    """Write (through the guarded output folder) the three tables; a bad input is one line, exit 2."""
    records_path = Path(argv[0]) if argv else RECORDS
    out = Path(argv[1]) if len(argv) > 1 else OUT
    try:
        folder = OutputFolder(out, what="OUT", inputs=[records_path])
        registration = load_json(REGISTRATION, 1 << 20, what="registration file")
        registered = {c["id"]: (registered_label(c["A"]), registered_label(c["B"]))
                      for c in registration["comparisons"]}
        ours = {cid: (label(*a), label(*b)) for cid, (a, b) in COMPARISONS.items()}
        if registered != ours:  # the grid's comparisons are the registered ones, or nothing is computed
            raise ValueError(f"refkv.experiments.forms.COMPARISONS {ours} differ from the registration's "
                             f"{registered}")
        units = unit_rows(read_records(records_path))
        rows, kinds = verdict_rows(units, float(registration["alpha"]))
    except (ValueError, KeyError, TypeError) as err:
        print(f"forms_verdicts: error: {err}", file=sys.stderr)
        return 2
    folder.publish({
        "units.csv": _csv(units, ["comparison", "metric", "document", "window", "kind", "a", "b", "full"]),
        "verdicts.csv": _csv(rows, VERDICT_COLUMNS),
        "per_kind.csv": _csv(kinds, ["comparison", "metric", "kind", "n", "estimate", "low", "high", "p"]),
    })
    for r in rows:
        print(r["comparison"], r["metric"], r["n"], r.get("label"), f"{r.get('estimate', float('nan')):+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
