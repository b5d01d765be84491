"""The verdict table of the experiments page, computed from the published experiment tables.

Run after ``refkv experiment all --publish docs/_static/experiments``::

    python docs/experiment_verdicts.py

It reads the paired comparisons the experiments wrote (``passkey/pairs.csv``,
``perplexity/ppl_pairs.csv``, ``attention_loss/step_loss_pairs.csv`` and
``output_error_pairs.csv``) and the per-policy
tables, and writes ``docs/_static/experiments/verdicts.csv``: one row per tested claim
with the measured paired difference, its 95% interval and sample size, the effect the
paper reports *scaled to this model*, and which of the two (paper effect, no effect) the
interval excludes.

Rules, fixed here so that no verdict is chosen after seeing the numbers:

* **Direction.** Every claim says A is better than B. For passkey accuracy better is
  higher (``A - B > 0``); for perplexity and attention loss better is lower (``A - B < 0``).
* **Verdict.** ``holds`` when the 95% interval excludes 0 on the claimed side;
  ``reversed`` when it excludes 0 on the other side; ``not resolved`` when it contains 0
  (the data cannot tell the two apart at this sample size). For passkey, where a cell has
  a handful of prompts, McNemar's exact test decides whether 0 is excluded (``p < 0.05``,
  column ``p``): the paired bootstrap interval of a difference of a few binary outcomes is
  too narrow (5 prompts only A answered and none only B answered give a bootstrap
  interval of [+0.2, +0.8] out of 10, but an exact p of 0.0625).
* **Paper effect, scaled.** The papers measure other models, tasks and metrics, so an
  effect is carried over as a *fraction of a gap*, which does not depend on the scale of
  the metric: e.g. CAOTE Table 4 removes a median 0.12 of H2O's perplexity gap to dense,
  so the scaled effect here is ``-0.12 x`` H2O's own perplexity gap at the same budget and
  block. Passkey effects are differences of accuracy, which need no scaling. The basis of
  each (paper, table, setting, arithmetic) is in the ``paper_basis`` column; the numbers
  were read from the papers' text, see ``docs/guide/experiments.rst``.

``tests/docs/test_docs.py`` recomputes the table from the published CSVs and fails when the
committed file disagrees, so the page cannot fall behind the experiments.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

from refkv.experiments.tables import csv_text
from refkv.experiments.tables import write_csv as experiments_csv
from refkv.files import OutputFolder

HERE = Path(__file__).resolve().parent
EXPERIMENTS = HERE / "_static" / "experiments"
OUT = EXPERIMENTS / "verdicts.csv"
COLUMNS = ["claim", "a", "b", "setting", "measure", "n", "difference", "low", "high", "p", "paper_effect",
           "paper_basis", "excludes", "verdict"]

ATTENTION_BASED = ("snapkv", "tova", "h2o", "h2o:recent=0")
L2 = ("knorm", "knorm:recent=10,sink=4")


@dataclass(frozen=True)
class Claim:
    """One tested claim: A better than B on ``measure`` in the setting ``where``."""

    claim: str
    measure: str  # "passkey", "perplexity", "step_loss" or "output_error"
    a: str
    b: str
    where: dict  # budget / block (and budget_b for the equal-memory pairs)
    fraction: float | None = None  # the paper's effect as a fraction of B's gap (or a plain difference)
    plain: float | None = None  # the paper's effect as an absolute difference (passkey)
    basis: str = ""


KEYDIFF_PR = ("KeyDiff Table 1, PR-en (passage retrieval), Llama-3.2-3B, 2K budget, B = 128: KeyDiff 60.50 "
              "vs SnapKV 32.50 = +0.28 accuracy")
KEYDIFF_AVG = ("KeyDiff Table 1, LongBench average, Llama-3.2-3B, 2K, B = 128: KeyDiff closes 0.26 of "
               "SnapKV's gap to dense ((38.14 - 35.46) / (45.87 - 35.46)); scaled: -0.26 x B's perplexity gap")
CAOTE = {"h2o": (0.12, "0.12 (median over 2k-8k; 0.07 at 2k)"), "tova": (0.13, "0.13 (0.10 at 2k)"),
         "snapkv": (0.29, "0.29 (0.19 at 2k)")}
MAT = ("MAT Table 3, LLaMA-2-7B, WikiText-2, 4,096 tokens, c = 256: MAT removes 0.23 of StreamingLLM's "
       "perplexity gap ((6.60 - 6.25) / (6.60 - 5.05)); scaled: -0.23 x sink's gap")
HASHEVICT_QUALITY = ("HashEvict Table 5, GSM8K Rouge-L, Llama3-8B, 50% budget: HashEvict closes 0.79 of "
                     "L2's gap to full ((0.393 - 0.355) / (0.403 - 0.355)); scaled: -0.79 x L2's perplexity gap")
HASHEVICT_LOSS = ("HashEvict Table 3, Llama3-8B, GSM8K, 50% budget: HashEvict / L2 attention loss = "
                  "0.0336 / 0.0340 = 0.988; scaled: -0.012 x L2's loss")
H2O_LOSS = ("HashEvict Table 3: H2O / HashEvict attention loss = 0.0139 / 0.0336 = 0.41; scaled: "
            "-0.59 x HashEvict's loss")


def claims() -> list[Claim]:
    """Every claim the page tests, in the order the page discusses them."""
    out = []
    block = {"budget": "256", "block": "128"}
    one_shot = {"budget": "256", "block": "none"}
    for b in ATTENTION_BASED:
        out.append(Claim("KeyDiff beats attention-based policies under block prefill (KeyDiff Sec. 4)",
                         "passkey", "keydiff", b, block, plain=0.28, basis=KEYDIFF_PR))
    for b in ("snapkv", "tova"):
        out.append(Claim("... and the gap closes with one-shot prefill (KeyDiff Sec. 4.2; no number given)",
                         "passkey", "keydiff", b, one_shot, basis="KeyDiff Table 7's body is not in the paper "
                         "text: no effect size to compare"))
    for a in ("keydiff", "keydiff:reserve=0.25", "keydiff:reserve=0.5"):
        for b in ATTENTION_BASED:
            out.append(Claim("KeyDiff beats attention-based policies (LongBench; here perplexity)", "perplexity",
                             a, b, {"budget": "128", "block": "32"}, fraction=0.26, basis=KEYDIFF_AVG))
    for base, spec in (("h2o", "caote:base=h2o"), ("h2o", "caote:base=h2o,fast=True"),
                       ("h2o:recent=0", "caote:base=h2o,base_params={'recent': 0}"),
                       ("h2o:recent=0", "caote:base=h2o,base_params={'recent': 0},fast=True"),
                       ("tova", "caote:base=tova"), ("tova", "caote:base=tova,fast=True"),
                       ("snapkv", "caote:base=snapkv"), ("snapkv", "caote:base=snapkv,fast=True")):
        f, text = CAOTE[base.split(":")[0]]
        for budget in ("128", "256"):
            out.append(Claim("CAOTE lifts H2O strongly, TOVA and SnapKV slightly (CAOTE Table 4)", "perplexity",
                             spec, base, {"budget": budget, "block": "32"}, fraction=f,
                             basis=f"CAOTE Table 4, Llama-3.2-3B, B = 128: CAOTE removes {text} of "
                                   f"{base.split(':')[0]}'s perplexity gap to dense; scaled: -{f} x its gap"))
    for base in ("h2o", "tova", "snapkv"):
        out.append(Claim("CAOTE lowers the attention output error (CAOTE Fig. 3)", "output_error",
                         f"caote:base={base}", base, {"budget": "256", "block": "128"},
                         basis="CAOTE Fig. 3 (App. C.4): 'always produces a smaller gap'; no number given"))
    out.append(Claim("MAT beats StreamingLLM at equal budget (MAT Table 3)", "perplexity", "mat", "sink",
                     {"budget": "128", "block": "1"}, fraction=0.23, basis=MAT))
    for budget in ("128", "256"):
        out.append(Claim("MAT beats StreamingLLM at equal budget (MAT Table 3)", "perplexity", "MAT best", "sink",
                         {"budget": budget, "block": "32"}, fraction=0.23, basis=MAT))
    for b in L2:
        out.append(Claim("HashEvict beats L2 eviction (HashEvict Sec. 4)", "perplexity", "hashevict", b,
                         {"budget": "128", "block": "1"}, fraction=0.79, basis=HASHEVICT_QUALITY))
        out.append(Claim("HashEvict beats L2 eviction (HashEvict Sec. 4)", "perplexity", "hashevict", b,
                         {"budget": "128", "budget_b": "96", "block": "32"}, fraction=0.79, basis=HASHEVICT_QUALITY))
        out.append(Claim("HashEvict loses less attention than L2 (HashEvict Table 3)", "step_loss", "hashevict", b,
                         {"budget": "256", "block": "1"}, fraction=0.012, basis=HASHEVICT_LOSS))
    for a in ("h2o", "h2o:recent=0"):  # H2O as its paper defines it (with a recent window), and without
        out.append(Claim("H2O loses less attention than HashEvict (HashEvict Table 3)", "step_loss", a,
                         "hashevict", {"budget": "256", "block": "1"}, fraction=0.59, basis=H2O_LOSS))
    return out


def _read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _norm(value: str) -> str:
    """Budgets and blocks as the tables spell them: '' (None) becomes 'none'."""
    return "none" if value in ("", "None", None) else value


class Tables:
    """The published tables a verdict reads, indexed by (policy, budget, block)."""

    def __init__(self, experiments: Path):
        self.passkey_pairs = _read(experiments / "passkey" / "pairs.csv")
        self.ppl_pairs = _read(experiments / "perplexity" / "ppl_pairs.csv")
        self.step_pairs = _read(experiments / "attention_loss" / "step_loss_pairs.csv")
        self.error_pairs = _read(experiments / "attention_loss" / "output_error_pairs.csv")
        self.ppl = {(r["policy"], _norm(r["budget"]), _norm(r["block"])): r
                    for r in _read(experiments / "perplexity" / "ppl.csv")}
        self.step = {(r["policy"], _norm(r["budget"])): r
                     for r in _read(experiments / "attention_loss" / "step_loss.csv")}

    def mat_best(self, budget: str, block: str) -> str | None:
        """MAT's best configuration of its beta x L_s grid at (budget, block) (``best_of_grid``)."""
        for (policy, b, k), row in self.ppl.items():
            if policy.startswith("mat") and b == budget and k == block and row.get("best_of_grid") in ("True", "1"):
                return policy
        return None

    def pair(self, claim: Claim, a: str) -> tuple[dict, float] | None:
        """The published paired row of ``a`` vs ``claim.b`` and the sign that turns it into A - B.

        A pair table lists each pair once, in either order; perplexity pairs carry a budget
        per side (equal-memory pairs differ), the others one budget for both.
        """
        w = claim.where
        rows = {"passkey": self.passkey_pairs, "perplexity": self.ppl_pairs, "step_loss": self.step_pairs,
                "output_error": self.error_pairs}[claim.measure]
        budgets = {a: w["budget"], claim.b: w.get("budget_b", w["budget"])}
        for sign, (x, y) in ((1.0, (a, claim.b)), (-1.0, (claim.b, a))):
            for r in rows:
                if (r["policy_a"], r["policy_b"]) != (x, y) or _norm(r["block"]) != w["block"]:
                    continue
                if claim.measure == "perplexity":
                    same = (_norm(r["budget_a"]), _norm(r["budget_b"])) == (budgets[x], budgets[y])
                else:
                    same = _norm(r["budget"]) == w["budget"]
                if same:
                    return r, sign
        return None

    def scale(self, claim: Claim) -> float | None:
        """B's gap (perplexity) or loss (attention loss) at the claim's setting, which the
        paper's fraction multiplies."""
        w = claim.where
        if claim.measure == "perplexity":
            row = self.ppl.get((claim.b, w.get("budget_b", w["budget"]), w["block"]))
            return float(row["gap"]) if row else None  # the pooled gap, whose interval the pairs share
        if claim.measure == "step_loss":
            row = self.step.get((claim.b, w["budget"]))
            return float(row["mean_loss"]) if row else None
        return None


def verdict_row(claim: Claim, tables: Tables) -> dict | None:
    """The verdict of one claim, or None when its cells were not run."""
    a = claim.a
    if a == "MAT best":
        a = tables.mat_best(claim.where["budget"], claim.where["block"])
        if a is None:
            return None
    found = tables.pair(claim, a)
    if found is None:
        return None
    row, sign = found
    keys = ("difference", "diff_low", "diff_high") if claim.measure == "passkey" else ("difference", "low", "high")
    d, lo, hi = (sign * float(row[k]) for k in keys)
    lo, hi = min(lo, hi), max(lo, hi)
    n = row.get("prompts") if claim.measure != "perplexity" else row["tokens"]
    unit = "tokens" if claim.measure == "perplexity" else "prompts"
    better_is_higher = claim.measure == "passkey"
    if claim.plain is not None:
        effect = claim.plain
    elif claim.fraction is not None and tables.scale(claim) is not None:
        effect = -claim.fraction * tables.scale(claim)
    else:
        effect = None
    p = float(row["mcnemar_p"]) if claim.measure == "passkey" else None
    zero_excluded = p < 0.05 if p is not None else not lo <= 0.0 <= hi
    if zero_excluded and (d > 0) == better_is_higher:
        verdict = "holds"
    elif zero_excluded:
        verdict = "reversed"
    else:
        verdict = "not resolved"
    excluded = ["paper"] if effect is not None and not lo <= effect <= hi else []
    excluded += ["zero"] if zero_excluded else []
    w = claim.where
    budget = w["budget"] if "budget_b" not in w else f"{w['budget']} vs {w['budget_b']} (equal peak memory)"
    return {"claim": claim.claim, "a": a, "b": claim.b, "setting": f"N = {budget}, B = {w['block']}",
            "measure": {"passkey": "accuracy A - B", "perplexity": "perplexity A - B",
                        "step_loss": "attention loss A - B", "output_error": "output error A - B"}[claim.measure],
            "n": f"{n} {unit}", "difference": f"{d:+.4g}", "low": f"{lo:+.4g}", "high": f"{hi:+.4g}",
            "p": "" if p is None else f"{p:.3g}",
            "paper_effect": "" if effect is None else f"{effect:+.4g}", "paper_basis": claim.basis,
            "excludes": " and ".join(excluded) if excluded else "neither", "verdict": verdict}


def rows(experiments: Path = EXPERIMENTS) -> list[dict]:
    """Every claim's verdict row, in the page's order; claims whose cells were not run are left out."""
    tables = Tables(experiments)
    return [r for r in (verdict_row(c, tables) for c in claims()) if r is not None]


def write_csv(table: list[dict], path: Path = OUT) -> None:
    experiments_csv(path, table, COLUMNS)  # atomic, like every table the experiments write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/experiment_verdicts.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help=f"write nothing; exit 1 if {OUT.name} differs from what would be written")
    args = parser.parse_args(argv)  # unknown arguments: exit 2; --help: exit 0, nothing written
    table = rows()
    if not table:  # never replace the published verdicts with an empty table
        parser.error(f"no verdict could be computed from the tables under {EXPERIMENTS} (run `refkv experiment all "
                     f"--publish {EXPERIMENTS}` first)")
    folder = OutputFolder(OUT.parent, what="output folder")
    stale = folder.publish({OUT.name: csv_text(table, COLUMNS)}, check=args.check)
    if args.check:
        print(f"differs: {OUT} (run `python docs/experiment_verdicts.py`)" if stale else f"{OUT} is up to date")
        return 1 if stale else 0
    print(f"wrote {OUT} ({len(table)} verdicts)" if stale else f"{OUT} unchanged ({len(table)} verdicts)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
