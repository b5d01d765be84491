"""The experiment numbers quoted by README.rst, concepts.rst and choosing.rst come from the
published tables through docs/experiment_numbers.py."""

from __future__ import annotations

import csv
import importlib.util
import pathlib

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _module():
    spec = importlib.util.spec_from_file_location("experiment_numbers", DOCS / "experiment_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pages_quote_the_published_tables():
    """Every generated block of the three pages equals what the tables give now."""
    numbers = _module()
    blocks = numbers.render()
    for name, page in numbers.PAGES.items():
        text = page.read_text(encoding="utf-8")
        found = {m["name"]: m["body"] for m in numbers.BLOCK.finditer(text)}
        assert name in found, f"{page.name} has lost its generated block {name!r}"
        assert found[name] == blocks[name], f"{page.name}: {name} is stale; run `python docs/experiment_numbers.py`"


def test_the_budget_advice_is_the_same_number_everywhere():
    """README, concepts and choosing state the quarter-budget bound from one value."""
    numbers = _module()
    bound = numbers.values()["quarter_within"]
    for name in ("readme-which-policy", "concepts-budget", "choosing-budget"):
        assert f"within {bound} of the" in numbers.render()[name]


def _edited(tmp_path, policy, budget, value):
    with open(DOCS / "_static" / "choosing" / "quality_vs_budget.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        if row["panel"] == "delta_ppl" and row["policy"] == policy and row["budget"] == str(budget):
            row["value"] = str(value)
    path = tmp_path / "points.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_a_changed_table_changes_the_pages(tmp_path):
    """TOVA at N = 256 raised to 1.2 (7% of 17.10): the bound becomes 8%, and every page's
    block is reported stale."""
    numbers = _module()
    changed = numbers.values(_edited(tmp_path, "tova", 256, 1.2))
    assert changed["quarter_within"] == "8%" and changed["quarter_range"] == "1.7-7.0%"
    blocks = numbers.render(changed)
    for page in set(numbers.PAGES.values()):
        _, stale = numbers.update(page.read_text(encoding="utf-8"), blocks)
        assert stale, page.name


def test_update_rewrites_only_the_blocks():
    numbers = _module()
    text = "before\n\n.. experiment-numbers: choosing-kernel\n\nold text\n\n.. experiment-numbers: end\n\nafter\n"
    new, changed = numbers.update(text, {"choosing-kernel": "new text\n"})
    assert changed == ["choosing-kernel"]
    assert new == ("before\n\n.. experiment-numbers: choosing-kernel\n\nnew text\n\n"
                   ".. experiment-numbers: end\n\nafter\n")
    with pytest.raises(ValueError, match="not generated here"):
        numbers.update(text.replace("choosing-kernel", "nowhere"), {"choosing-kernel": "x\n"})


def test_phase_two_text_sentence_from_hand_made_verdicts():
    """L1's range and C1's signs flipped to 'lowered by', from verdict rows made by hand; any
    comparison without an estimate gives the not-run sentence."""
    numbers = _module()
    row = {"n": "21", "verdict": "holds", "versus_paper": "smaller than the paper"}
    verdicts = {("L1", "keydiff", b): {**row, "estimate": e, "verdict": "reversed", "low": "0", "high": "0"}
                for b, e in (("snapkv", "11.64"), ("tova", "11.26"), ("h2o", "12.05"))}
    verdicts |= {("C1", f"caote:base={b}", b): {**row, "estimate": "-0.10", "low": "-0.15", "high": "-0.02"}
                 for b in ("h2o", "tova", "snapkv")}
    text = " ".join(numbers._phase2_text(verdicts)["p2_text"].split())
    assert "KeyDiff raised perplexity 11.3-12.1 more than SnapKV, TOVA and H2O (L1 reversed" in text
    assert "CAOTE lowered H2O's by 0.10 [0.02, 0.15] (holds)" in text and text.endswith("smaller than the paper")
    verdicts[("C1", "caote:base=tova", "tova")]["estimate"] = ""
    assert "has not run its perplexity grid" in numbers._phase2_text(verdicts)["p2_text"]


def test_phase_two_token_by_token_sentence_from_hand_made_verdicts():
    """Each of M1, H1 and A1 as ``A - B`` with two significant digits and its verdict; the paper
    label only where the metric matches; a comparison without an estimate says it has not run."""
    numbers = _module()
    blank = {"estimate": "", "low": "", "high": "", "verdict": "not run", "versus_paper": ""}
    verdicts = {("M1", "mat@selected", "sink"): {"estimate": "0.0664899", "low": "-0.017147", "high": "0.150127",
                                                 "verdict": "not resolved", "versus_paper": "smaller than the paper"},
                ("H1", "hashevict", "knorm:recent=10,sink=4"): {
                    "estimate": "-0.51", "low": "-0.9", "high": "-0.12", "verdict": "holds",
                    "versus_paper": "not comparable"},
                ("A1", "hashevict", "knorm:recent=10,sink=4"): blank, ("A1", "h2o", "hashevict"): blank}
    text = " ".join(numbers._phase2_token_by_token(verdicts)["p2_kernel"].split())
    assert "MAT - sink in perplexity +0.066 [-0.017, +0.15] (M1 not resolved, smaller than the paper)" in text
    assert "L2 with HashEvict's protection in perplexity -0.51 [-0.9, -0.12] (H1 holds);" in text
    assert "HashEvict - that L2 has not run (A1); H2O - HashEvict has not run (A1)." in text
