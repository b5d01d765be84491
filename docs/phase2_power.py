"""The power analysis of the second registered phase, from the committed phase-one numbers.

Reads phase one's passkey test records (``_static/experiments/registered/records/
passkey-test.jsonl``) for its discordance rates and its per-unit table (``units.csv``) for
the spread of each per-text or per-prompt difference, and writes
``_static/experiments/phase2/power.csv``: per registered comparison of phase two, the
effect it is sized for and where that effect comes from, the spread or discordance rate
assumed, the level (alpha over the claim's comparisons: Holm's first step, so the
conservative one), the smallest n with power >= 0.8, and the power at the n phase two
registers (``docs/experiment_registration_phase2.json``, whose numbers a test checks
against this script).

The tests and their power:

* passkey (paired binary): the exact McNemar test; its power is summed exactly over the
  binomial laws of the discordant count and of its split
  (:func:`refkv.experiments.stats.mcnemar_power`); Connor's normal approximation is given
  beside it (:func:`~refkv.experiments.stats.mcnemar_power_normal`);
* per-document and per-prompt means (paired t): the noncentral t
  (:func:`~refkv.experiments.stats.paired_t_power`).

    python docs/phase2_power.py          # rewrites power.csv and prints it
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

from refkv.experiments.records import read_records
from refkv.experiments.stats import (
    mcnemar_power,
    mcnemar_power_normal,
    paired_t_power,
    sample_size,
)
from refkv.experiments.tables import write_csv

HERE = Path(__file__).resolve().parent
PHASE_ONE = HERE / "_static" / "experiments" / "registered"
OUT = HERE / "_static" / "experiments" / "phase2" / "power.csv"
TARGET = 0.8
ALPHA = 0.05
#: Documents of the phase-two population (refkv.experiments.documents): the unit of every
#: perplexity and per-prompt claim.
DOCUMENTS = 21
#: Passkey test prompts registered for phase two (windows of the 21 documents, 7 each).
PASSKEY_PROMPTS = 147
COLUMNS = ["claim", "a", "b", "test", "effect", "effect_basis", "spread", "spread_basis", "alpha",
           "n_needed", "n_needed_normal", "n_registered", "power_registered"]


def discordance() -> dict[tuple, float]:
    """Phase one's discordance rate of every pair of passkey settings: the share of the 60
    prompts that exactly one of the two answered."""
    answers: dict[tuple, dict[int, bool]] = {}
    for r in read_records(PHASE_ONE / "records" / "passkey-test.jsonl"):
        p = r["params"]
        answers.setdefault((p["policy"], p["block"]), {})[p["sample"]] = bool(r["result"]["correct"])
    out = {}
    for a in answers:
        for b in answers:
            prompts = sorted(set(answers[a]) & set(answers[b]))
            out[(a, b)] = float(np.mean([answers[a][q] != answers[b][q] for q in prompts]))
    return out


def units() -> dict[tuple, dict]:
    """Per phase-one comparison: the sample SD of its per-unit differences, B's mean and B's
    mean gap to the full cache, and its scaled paper effect (from verdicts.csv)."""
    rows: dict[tuple, list[dict]] = {}
    with open(PHASE_ONE / "units.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            rows.setdefault((row["claim"], row["a"], row["b"]), []).append(row)
    with open(PHASE_ONE / "verdicts.csv", newline="", encoding="utf-8") as f:
        effects = {(r["claim"], r["a"], r["b"]): r["paper_effect"] for r in csv.DictReader(f)}
    out = {}
    for key, group in rows.items():
        if key[0] in ("P1", "P2"):
            continue
        a = np.array([float(r["value_a"]) for r in group])
        b = np.array([float(r["value_b"]) if r["value_b"] else 0.0 for r in group])
        out[key] = {"sd": float(np.std(a - b, ddof=1)), "b_mean": float(b.mean()),
                    "effect": float(effects[key]) if effects.get(key) else None}
    return out


def _independent(p_a: float, p_b: float) -> float:
    """Discordance rate of two policies whose answers are independent, with accuracies p_a, p_b."""
    return p_a * (1 - p_b) + p_b * (1 - p_a)


def rows() -> list[dict]:
    """One row per registered phase-two comparison (see the module docstring)."""
    rate = discordance()
    spread = units()
    away = rate[(("keydiff", None), ("snapkv", None))]     # the largest away-from-floor rate of phase one
    out = []

    def binary(claim, a, b, effect, basis, accuracies, m):
        p_d = max(away, _independent(*accuracies), abs(effect) + 0.01)
        alpha = ALPHA / m
        n = sample_size(lambda k: mcnemar_power(k, p_d, effect, alpha), TARGET, 2, 2000)
        n_normal = sample_size(lambda k: mcnemar_power_normal(k, p_d, effect, alpha), TARGET, 2, 2000)
        out.append({"claim": claim, "a": a, "b": b, "test": "exact McNemar", "effect": effect,
                    "effect_basis": basis, "spread": round(p_d, 4),
                    "spread_basis": f"discordance rate: the larger of phase one's away-from-floor rate {away:.3f} "
                                    f"(KeyDiff vs SnapKV one-shot) and independent answers at accuracies "
                                    f"{accuracies[0]:.3f}, {accuracies[1]:.3f}",
                    "alpha": alpha, "n_needed": n, "n_needed_normal": n_normal, "n_registered": PASSKEY_PROMPTS,
                    "power_registered": mcnemar_power(PASSKEY_PROMPTS, p_d, effect, alpha)})

    def mean(claim, a, b, effect, basis, sd, sd_basis, m):
        alpha = ALPHA / m
        n = sample_size(lambda k: paired_t_power(k, effect, sd, alpha), TARGET, 2, 5000)
        out.append({"claim": claim, "a": a, "b": b, "test": "paired t", "effect": effect, "effect_basis": basis,
                    "spread": sd, "spread_basis": sd_basis, "alpha": alpha, "n_needed": n, "n_needed_normal": "",
                    "n_registered": DOCUMENTS, "power_registered": paired_t_power(DOCUMENTS, effect, sd, alpha)})

    paper = {"keydiff": 0.605, "snapkv": 0.325, "tova": 0.115, "h2o": 0.005}
    for other in ("snapkv", "tova", "h2o"):
        binary("P1", "keydiff", other, round(paper["keydiff"] - paper[other], 3),
               "KeyDiff Table 1 PR-en (another task: sizing only, the label is 'not comparable')",
               (paper["keydiff"], paper[other]), 3)
    for policy in ("snapkv", "tova", "h2o"):
        binary("P2", f"{policy}@oneshot", f"{policy}@blocks", 0.2,
               "smallest effect of interest, chosen here (no paper number)", (0.6, 0.4), 3)
    sd_note = "phase one: SD of the per-text differences over its 16 texts (2 sources)"
    for claim, pairs, basis in (
            ("L1", [("keydiff", o) for o in ("snapkv", "tova", "h2o")],
             "phase one's LongBench fraction-of-gap heuristic (another metric: sizing only, 'not comparable')"),
            ("C1", [(f"caote:base={o}", o) for o in ("h2o", "tova", "snapkv")],
             "CAOTE Table 4 perplexity, fraction of the gap, times phase one's gap (same metric)"),
            ("M1", [("mat@selected", "sink")], "MAT Table 3 perplexity, fraction of sink's gap (same metric)"),
            ("H1", [("hashevict", "knorm:recent=10,sink=4")],
             "phase one's Rouge-L fraction-of-gap heuristic (another metric: sizing only, 'not comparable')")):
        for a, b in pairs:
            u = spread[(claim, a, b)]
            mean(claim, a, b, u["effect"], basis, u["sd"], sd_note, len(pairs))
    loss = spread[("A1", "hashevict", "knorm")]
    effect = -(1 - 0.0336 / 0.0340) * loss["b_mean"]
    mean("A1", "hashevict", "knorm:recent=10,sink=4", effect,
         "HashEvict Table 3 ratio 0.988 times phase one's L2 loss (same metric)", loss["sd"],
         "phase one's unmatched comparison (no matched record exists): SD over 16 prompts", 2)
    u = spread[("A1", "h2o", "hashevict")]
    mean("A1", "h2o", "hashevict", u["effect"], "HashEvict Table 3 ratio 0.414 times phase one's loss (same metric)",
         u["sd"], "phase one: SD over 16 prompts", 2)
    mean("A1 (secondary)", "hashevict", "knorm", effect, "as the primary", loss["sd"],
         "phase one: SD over 16 prompts", 2)
    u = spread[("G1", "spearman", "")]
    mean("G1", "spearman", "", -0.03, "smallest effect of interest, chosen here (the figure gives the sign only)",
         u["sd"], "phase one: SD over 16 prompts", 1)
    for other in ("snapkv", "tova", "h2o", "sink"):
        u = spread[("G2", "keydiff", other)]
        mean("G2", "keydiff", other, 1.0, "smallest effect of interest, chosen here (ordering only)", u["sd"],
             "phase one: SD over 16 prompts", 4)
    u = spread[("S1", "bits=32", "bits=8")]
    mean("S1", "bits=32", "bits=8", 0.18, "HashEvict Table 11 (same metric)", u["sd"],
         "phase one: SD over 16 prompts", 1)
    return out


def main() -> int:
    table = rows()
    write_csv(OUT, table, COLUMNS)
    for r in table:
        print(f"{r['claim']:15s} {r['a']:>22s} - {r['b']:<24s} effect {float(r['effect']):+.4g} "
              f"n needed {r['n_needed']} (registered {r['n_registered']}, power {float(r['power_registered']):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
