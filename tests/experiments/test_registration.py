"""The registered experiment design: the page and the machine-readable file agree, and every
scaled paper effect on the page follows from the paper numbers the file quotes.

The registration (docs/guide/registration.rst, docs/experiment_registration.json) is fixed
before the run; these checks keep the two copies from drifting apart and recompute each
effect from the quoted table values, so a typo in either the arithmetic or the quotation fails.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
REGISTRATION = json.loads((DOCS / "experiment_registration.json").read_text(encoding="utf-8"))
PAGE = (DOCS / "guide" / "registration.rst").read_text(encoding="utf-8")
CLAIMS = {claim["id"]: claim for claim in REGISTRATION["claims"]}


def _page_row(claim_id: str) -> str:
    """The text of the hypotheses table row of ``claim_id`` (up to the next row)."""
    match = re.search(rf"^   \* - {claim_id}\n(.*?)(?=^   \* - |\Z)", PAGE, flags=re.S | re.M)
    assert match, f"claim {claim_id} has no row on the registration page"
    return " ".join(match.group(1).split())


def _effects(claim: dict) -> list[float]:
    """The budget-matched paper effects of ``claim``, recomputed from the quoted numbers."""
    paper, pairs = claim["paper"], claim["comparisons"]
    if "gaps" in paper:                                   # CAOTE: a gap without and with
        return [(paper["gaps"][b][0] - paper["gaps"][b][1]) / paper["gaps"][b][0] for _, b in pairs]
    values = paper["values"]
    if "dense" in paper:                                  # fraction of B's gap to dense removed
        key = {a: a.split("@")[0] for a, _ in pairs}
        return [(values[key[a]] - values[b]) / (paper["dense"] - values[b]) for a, b in pairs]
    if "scale" in paper:                                  # accuracy in percent
        return [(values[a] - values[b]) / paper["scale"] for a, b in pairs]
    if claim["measure"] == "attention loss":              # 1 - ratio of losses
        return [1 - values[a] / values[b] for a, b in pairs]
    return [values[a] - values[b] for a, b in pairs]      # a difference carried over as it is


@pytest.mark.parametrize("claim_id", sorted(c for c in CLAIMS if CLAIMS[c]["paper"]))
def test_each_scaled_paper_effect_on_the_page_follows_from_the_quoted_numbers(claim_id):
    row = _page_row(claim_id)
    for effect in _effects(CLAIMS[claim_id]):
        assert f"{abs(effect):.3f}" in row, (claim_id, effect, row)


def test_the_recomputation_can_fail():
    """A misquoted table value changes a recomputed effect (the check above is not vacuous)."""
    claim = json.loads(json.dumps(CLAIMS["M1"]))
    claim["paper"]["values"]["mat"] = 5.70
    assert f"{_effects(claim)[0]:.3f}" not in _page_row("M1")


def test_every_claim_and_comparison_is_on_the_page():
    for claim_id, claim in CLAIMS.items():
        row = _page_row(claim_id)
        for a, b in claim["comparisons"]:
            for name in (a, b):
                if name and not name.startswith(("bits=", "mat@", "spearman")):
                    assert name.split("@")[0].split(":")[0] in row, (claim_id, name)
    assert len(re.findall(r"^   \* - [A-Z]\d\n", PAGE, flags=re.M)) == len(CLAIMS)


def test_sample_sizes_and_rule_on_the_page_match_the_file():
    samples = REGISTRATION["samples"]
    assert f"**{samples['passkey_prompts']} prompts**" in PAGE
    assert f"**{2 * samples['perplexity_texts_per_source']} texts**" in PAGE
    assert f"**{samples['hashevict_seeds']} hash seeds**" in PAGE
    assert f"{samples['passkey_calibration_prompts']} calibration prompts" in PAGE
    assert f"**alpha = {REGISTRATION['alpha']}**" in PAGE
    assert "Holm" in REGISTRATION["multiplicity"] and "**Holm's correction within each claim**" in PAGE
    ceiling = samples["passkey_ceiling_required"]
    assert f"at least {ceiling:.0%}" in PAGE
    assert f"({round(ceiling * samples['passkey_calibration_prompts'])} of" in PAGE
