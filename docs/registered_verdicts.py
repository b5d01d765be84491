"""The registered verdict table, computed from the run's records by the registered rule.

Run after the registered design has run (``docs/guide/registration.rst``)::

    refkv experiment passkey --registered --jobs 2              # the calibration
    refkv experiment passkey --registered --passkey-lengths L   # L: printed by this script
    refkv experiment perplexity --registered --jobs 2
    refkv experiment perplexity --registered --policies SPEC    # SPEC: MAT's chosen spec, printed here
    refkv experiment attention_loss --registered --jobs 2      # claim A1
    refkv experiment geometry --registered --jobs 2            # claims G1, G2, S1
    python docs/registered_verdicts.py results

It reads ``RESULTS/passkey.jsonl``, ``perplexity.jsonl``, ``attention_loss.jsonl`` and
``geometry.jsonl`` (a missing file leaves its claims out of the table) and the registration
(``docs/experiment_registration.json``), and writes into
``docs/_static/experiments/registered/``: ``verdicts.csv`` (one row per registered
comparison: n in prompts or texts, estimate, 95% interval, p, Holm-adjusted p, verdict,
scaled paper effect and where the interval lies against it), ``calibration.csv``, and
``units.csv`` (one row per prompt or text and comparison, so anyone can recompute). Every
rule lives in :mod:`refkv.experiments.registered`; this script only reads and writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from refkv.experiments.common import write_csv
from refkv.experiments.registered import (
    UNIT_COLUMNS,
    attention_loss_comparisons,
    calibrated_length,
    chosen_mat,
    geometry_comparisons,
    passkey_comparisons,
    perplexity_comparisons,
    unit_rows,
    verdict_rows,
)
from refkv.experiments.runner import read_records

HERE = Path(__file__).resolve().parent
REGISTRATION = HERE / "experiment_registration.json"
OUT = HERE / "_static" / "experiments" / "registered"
COLUMNS = ["claim", "a", "b", "n", "unit", "estimate", "low", "high", "p", "p_holm", "verdict", "paper_effect",
           "versus_paper"]


def registration() -> dict:
    """The registered design as committed."""
    return json.loads(REGISTRATION.read_text(encoding="utf-8"))


def tables(results: Path) -> dict[str, list[dict]]:
    """Every table this script writes, from the records under ``results``."""
    design = registration()
    passkey = read_records(results / "passkey.jsonl")
    perplexity = read_records(results / "perplexity.jsonl")
    length, tally = calibrated_length(passkey, design)
    comparisons = (passkey_comparisons(passkey) + perplexity_comparisons(perplexity)
                   + attention_loss_comparisons(read_records(results / "attention_loss.jsonl"))
                   + geometry_comparisons(read_records(results / "geometry.jsonl")))
    return {
        "verdicts": verdict_rows(design, comparisons),
        "calibration": [{"length": k, "correct": right, "prompts": n, "chosen": k == length}
                        for k, (right, n) in tally.items()],
        "units": unit_rows(comparisons),
        "mat": [{"chosen_mat": chosen_mat(perplexity)}],
    }


def main(argv: list[str]) -> int:
    results = Path(argv[0] if argv else "results")
    out = tables(results)
    OUT.mkdir(parents=True, exist_ok=True)
    write_csv(OUT / "verdicts.csv", out["verdicts"], COLUMNS)
    write_csv(OUT / "calibration.csv", out["calibration"], ["length", "correct", "prompts", "chosen"])
    write_csv(OUT / "units.csv", out["units"], UNIT_COLUMNS)
    chosen = [row["length"] for row in out["calibration"] if row["chosen"]]
    print(f"calibrated passkey length: {chosen[0] if chosen else 'none reached the ceiling'}; "
          f"MAT's chosen spec: {out['mat'][0]['chosen_mat']}; {len(out['verdicts'])} verdicts -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
