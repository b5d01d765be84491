"""Every figure of the SnapKV section of docs/guide/experiments.rst, recomputed from the
committed CSVs of docs/snapkv_passkey.py and the registered passkey records (issue 35 D)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from refkv.experiments.stats import rank_auc

STATIC = Path(__file__).resolve().parents[2] / "docs" / "_static" / "experiments"


def _rows(name):
    with open(STATIC / name, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _retention(row):
    return sum(float(row[f"kept_digit{i}"]) for i in range(2, 6)) / 4


def test_snapkv_wrong_answers_as_the_page_describes_them():
    wrong = [r for r in _rows("snapkv_passkey.csv") if r["policy"] == "snapkv" and r["correct"] == "False"]
    assert len(wrong) == 8
    assert sum(r["protocol"] == "filler" for r in wrong) == 7
    kinds = {"truncated": 0, "middle digit dropped": 0, "not a number": 0}
    for r in wrong:
        answer = re.match(r"\s*(\d+)", r["answer"])
        if answer is None:
            kinds["not a number"] += 1
        elif r["key"].startswith(answer.group(1)):
            kinds["truncated"] += 1
        else:
            kinds["middle digit dropped"] += 1
    assert kinds == {"truncated": 5, "middle digit dropped": 1, "not a number": 2}
    retention = sorted(_retention(r) for r in wrong)
    assert sum(x >= 0.9 for x in retention) == 2
    assert retention[0] == pytest.approx(0.30, abs=0.005) and retention[5] == pytest.approx(0.88, abs=0.005)
    # "392" is TOVA's answer
    assert not any(r["answer"].strip().startswith("392") for r in wrong)
    assert any(r["policy"] == "tova" and r["answer"].strip().startswith("392") for r in _rows("snapkv_passkey.csv"))


def test_restore_figures():
    rows = _rows("snapkv_passkey_restore.csv")
    digits = [r for r in rows if r["put_back"] == "digits"]
    base = {(r["depth"], r["budget"], r["block"]): r["correct"] for r in rows if r["put_back"] == "nothing"}
    wrong = [k for k, v in base.items() if v == "False"]
    assert len(wrong) == 7
    assert all(r["correct"] == "True" for r in digits if (r["depth"], r["budget"], r["block"]) in wrong)
    intro = {(r["depth"], r["budget"], r["block"]): r["correct"] for r in rows if r["put_back"] == "intro"}
    assert not any(intro[k] == "True" for k in wrong)
    slots = sorted(int(r["slots"]) for r in digits if r["depth"] == "0.3")
    assert (slots[0], slots[-1]) == (129, 319)
    slots = sorted(int(r["slots"]) for r in digits if r["depth"] == "0.9")
    assert (slots[0], slots[-1]) == (12, 50)


def test_other_counts_of_the_section():
    rows = _rows("snapkv_passkey.csv")

    def right(protocol, policy, budget=None):
        return sum(r["correct"] == "True" for r in rows if r["protocol"] == protocol and r["policy"] == policy
                   and (budget is None or r["budget"] == budget))

    assert right("filler", "snapkv:kernel=1", "256") + right("registered", "snapkv:kernel=1", "256") == 0
    assert right("filler", "snapkv", "256") + right("registered", "snapkv", "256") == 3
    assert 8 - right("registered", "tova") == 5 and 8 - right("registered", "snapkv") == 1
    assert (right("filler", "keydiff"), right("filler", "snapkv"), right("filler", "tova")) == (8, 1, 4)


def test_at_the_registered_budget_retention_does_not_separate():
    records = [json.loads(line) for line in
               (STATIC / "registered" / "records" / "passkey-test.jsonl").read_text().splitlines()]
    evicting = [r for r in records if r["params"]["policy"] != "full"]
    assert not any(not r["result"]["correct"] and r["result"]["needle_retention"] >= 0.9 for r in evicting)
    oneshot = [r for r in evicting if r["params"]["policy"] == "snapkv" and r["params"]["block"] is None]
    auc, p = rank_auc([r["result"]["needle_retention"] for r in oneshot], [r["result"]["correct"] for r in oneshot])
    assert (round(auc, 2), round(p, 2), sum(r["result"]["correct"] for r in oneshot)) == (0.58, 0.34, 19)
