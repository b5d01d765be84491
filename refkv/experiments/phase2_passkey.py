"""Phase two's passkey grid: the calibration (ceiling and floor) and the test, over the shipped documents.

The design is registered in ``docs/experiment_registration_phase2.json`` (claims P1 and P2):

* **Prompts.** Each prompt is one window of 1,024 tokens of one of the 21 shipped documents
  (:mod:`refkv.experiments.documents`), the needle at the sentence end nearest a random depth
  (:func:`refkv.experiments.haystack.build_document_prompt`). Windows 2 and 3 of every
  document are the 42 calibration prompts, windows 4 to 10 the 147 test prompts: no two
  prompts share text.
* **Calibration** (``--passkey-budget`` not given): the full cache on the 42 prompts (the
  ceiling: at least 40 of 42 must be right), and for each candidate budget
  ``N`` in (256, 512), blocks of ``B = N / 16`` (the paper's ``B / N``), KeyDiff, SnapKV, TOVA
  and H2O in blocks and SnapKV, TOVA and H2O one-shot (the floor check).
  :func:`chosen_budget` applies the registered rule to those records.
* **Test** (``--passkey-budget N``, the calibrated ``N``): the same settings at ``N`` on the 147
  test prompts.

Each record keeps the answer, whether it is the key, the needle's retention, and, for the
full cache, the needle's distinctiveness by KeyDiff's score (the registered display).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .design import Experiment, Option
from .documents import document_kind, document_names
from .haystack import DOCUMENT_SEED, DOCUMENT_WINDOWS, build_document_prompt
from .models import load_model
from .passkey import _needle_distinctiveness, _needle_retention, answer_key
from .prefill import prefill_or_skip
from .settings import Settings
from .tables import write_csv

__all__ = ["BLOCK_POLICIES", "CANDIDATE_BUDGETS", "COMPARISONS", "EXPERIMENT", "ONE_SHOT_POLICIES", "cells",
           "chosen_budget", "run_cell", "testable"]

#: The prompts' length in tokens (registered).
LENGTH = 1024
#: The budgets the floor check considers (L/4, L/2), and the block's share of the budget (the paper's 128/2048).
CANDIDATE_BUDGETS = (256, 512)
BLOCK_RATIO = 16
#: The policies of P1 (in blocks) and of P2 (one-shot against blocks).
BLOCK_POLICIES = ("keydiff", "snapkv", "tova", "h2o")
ONE_SHOT_POLICIES = ("snapkv", "tova", "h2o")
#: Every P1 and P2 comparison, as ((policy, one_shot), (policy, one_shot)).
COMPARISONS = {
    "P1": [(("keydiff", False), (b, False)) for b in ("snapkv", "tova", "h2o")],
    "P2": [((p, True), (p, False)) for p in ONE_SHOT_POLICIES],
}
#: The band a comparison's mean calibration accuracy must lie in to be testable (registered).
FLOOR_BAND = (0.1, 0.9)
#: The ceiling the full cache must reach on the calibration prompts (registered: 40 of 42).
CEILING = 0.95

PASSKEY_BUDGET = Option("passkey_budget", "phase two: the calibrated budget N (the test grid); without it, the "
                        "calibration", sizes=(None, None, None), low=16, high=LENGTH)


def _prompt_cells(common: dict, purpose: str) -> list[dict]:
    return [{**common, "purpose": purpose, "document": name, "window": window}
            for name in document_names() for window in DOCUMENT_WINDOWS[purpose]]


def _settings_at(budget: int) -> list[dict]:
    block = budget // BLOCK_RATIO
    return ([{"policy": p, "budget": budget, "block": block} for p in BLOCK_POLICIES]
            + [{"policy": p, "budget": budget, "block": None} for p in ONE_SHOT_POLICIES])


def cells(settings: Settings) -> list[dict]:
    """The calibration (no ``passkey_budget``) or the test grid at the calibrated budget."""
    budget = PASSKEY_BUDGET.given(settings)
    common = {"model": settings.resolved_model(), "dtype": settings.dtype, "seed": DOCUMENT_SEED,
              "design": "phase2", "length": LENGTH, "max_new_tokens": 8}
    if budget is not None and budget not in CANDIDATE_BUDGETS:
        raise ValueError(f"passkey_budget must be one of the registered budgets {CANDIDATE_BUDGETS}, got {budget}")
    purpose = "calibration" if budget is None else "test"
    budgets = CANDIDATE_BUDGETS if budget is None else (budget,)
    out = []
    for prompt in _prompt_cells(common, purpose):
        out.append({**prompt, "policy": "full", "budget": None, "block": None})
        out.extend({**prompt, **s} for b in budgets for s in _settings_at(b))
    return out


def cost(params: dict) -> float:
    """Roughly seconds of one core: blocks of 16 cost about 8 s at 1,024 tokens, one-shot 3 s."""
    if params["block"] is None:
        return 3.0
    return 2.0 + 96.0 / params["block"]


def run_cell(params: dict) -> dict:
    """Build the document's prompt, prefill it under the policy, answer greedily, check the number."""
    model, tokenizer = load_model(params["model"], params["dtype"])
    tokens, key_at, draw = build_document_prompt(params["model"], params["dtype"], tokenizer, params["document"],
                                                 params["window"], params["length"], params["seed"])
    base = {"key": draw["key"], "depth": draw["depth"], "kind": document_kind(params["document"]),
            "prompt_tokens": len(tokens), "needle_position": key_at}
    engine, logits, skipped = prefill_or_skip(params, model, tokens)
    if skipped is not None:
        return {**base, "skipped": skipped}
    if params["policy"] == "full":
        base["needle_distinctiveness"] = _needle_distinctiveness(engine, key_at, 4)
    kept = _needle_retention(engine, key_at, 4)
    return {**base, **answer_key(engine, logits, tokenizer, draw["key"], params["max_new_tokens"]),
            "needle_retention": kept}


def check_result(params: dict, result: dict) -> None:
    """A record's result is one :func:`run_cell` makes (a skipped cell, or an answer with its check)."""
    if "skipped" in result:
        return
    if not isinstance(result.get("correct"), bool) or not isinstance(result.get("answer"), str):
        raise ValueError("a phase-two passkey result must hold 'correct' (bool) and 'answer' (str)")


# -- the registered rules ------------------------------------------------------------------
def _accuracy(records: list[dict]) -> dict[tuple, float]:
    """(policy, budget, one_shot) -> fraction correct, over the records given."""
    answers: dict[tuple, list[bool]] = {}
    for r in records:
        p = r["params"]
        if "skipped" in r["result"]:
            continue
        answers.setdefault((p["policy"], p["budget"], p["block"] is None), []).append(r["result"]["correct"])
    return {key: float(np.mean(values)) for key, values in answers.items()}


def testable(records: list[dict], budget: int) -> dict[str, str]:
    """Each P1/P2 comparison's calibration verdict at ``budget``: "testable", "not testable (floor)" or "(ceiling)".

    A comparison is testable when the mean of its two sides' calibration accuracies lies in
    :data:`FLOOR_BAND` (registered).
    """
    acc = _accuracy(records)
    out = {}
    for claim, pairs in COMPARISONS.items():
        for (a, a_one), (b, b_one) in pairs:
            mean = (acc[(a, budget, a_one)] + acc[(b, budget, b_one)]) / 2
            name = f"{claim} {a}{'@oneshot' if a_one else ''} vs {b}{'@oneshot' if b_one else ''}"
            out[name] = ("not testable (floor)" if mean < FLOOR_BAND[0] else
                         "not testable (ceiling)" if mean > FLOOR_BAND[1] else "testable")
    return out


def chosen_budget(records: list[dict]) -> int:
    """The registered budget: the smaller one at which every P1 and P2 comparison is testable, else the
    one that makes more testable (ties: the smaller)."""
    counts = {b: sum(v == "testable" for v in testable(records, b).values()) for b in CANDIDATE_BUDGETS}
    total = sum(len(pairs) for pairs in COMPARISONS.values())
    for budget in CANDIDATE_BUDGETS:
        if counts[budget] == total:
            return budget
    return max(CANDIDATE_BUDGETS, key=lambda b: (counts[b], -b))


def summarise(records: list[dict], folder: Path, settings: Settings) -> list[Path]:
    """``accuracy.csv`` (per setting, with the ceiling) and, for the calibration, ``calibration.csv``."""
    acc = _accuracy(records)
    n = {}
    for r in records:
        p = r["params"]
        n[(p["policy"], p["budget"], p["block"] is None)] = n.get((p["policy"], p["budget"], p["block"] is None), 0) + 1
    rows = [{"policy": k[0], "budget": "none" if k[1] is None else k[1], "prefill": "one-shot" if k[2] else "blocks",
             "accuracy": acc[k], "n": n[k]} for k in sorted(acc, key=lambda k: (str(k[1]), k[0], k[2]))]
    paths = [write_csv(folder / "accuracy.csv", rows)]
    purposes = {r["params"]["purpose"] for r in records}
    if purposes == {"calibration"}:
        ceiling = acc.get(("full", None, True))
        table = [{"budget": b, "comparison": name, "verdict": verdict}
                 for b in CANDIDATE_BUDGETS for name, verdict in testable(records, b).items()]
        table.append({"budget": "chosen", "comparison": f"ceiling {ceiling:.3f} (required {CEILING})",
                      "verdict": chosen_budget(records)})
        paths.append(write_csv(folder / "calibration.csv", table))
    return paths


EXPERIMENT = Experiment(
    name="passkey2",
    title="phase two (registered): passkey calibration and test over the 21 shipped documents (claims P1, P2)",
    cells=cells, run=run_cell, summarise=summarise, cost=cost, options=(PASSKEY_BUDGET,),
    table=("accuracy.csv", ("policy", "budget", "prefill", "accuracy", "n")), phase=2,
    check_result=check_result)
