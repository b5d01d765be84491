"""The registered paper-vs-authors grid (refkv experiment forms) and its verdict script."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from refkv.experiments import forms
from refkv.experiments.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("forms_verdicts", ROOT / "docs" / "forms_verdicts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_grid_pairs_every_variant_on_the_same_units():
    cells = forms.cells(Settings(model="tiny"))
    by_variant: dict[tuple, set] = {}
    for c in cells:
        variant = (c["regime"], c["task"], c["policy"], c["heads"])
        by_variant.setdefault(variant, set()).add((c["document"], c["window"]))
    for (regime, task, _, _), units in by_variant.items():
        assert units == by_variant[(regime, task, "full", "gqa")]
    # 21 documents: SnapKV/PyramidKV 3 passkey windows, HashEvict 2, one text each
    assert len(by_variant[("prefill", "passkey", "snapkv", "gqa")]) == 63
    assert len(by_variant[("hashevict", "passkey", "hashevict", "gqa")]) == 42
    assert len(by_variant[("hashevict", "perplexity", "hashevict", "gqa")]) == 21


def test_the_grid_compares_what_the_registration_registered():
    registration = json.loads((ROOT / "docs" / "forms_registration.json").read_text())
    script = _script()
    registered = {c["id"]: (script.registered_label(c["A"]), script.registered_label(c["B"]))
                  for c in registration["comparisons"]}
    assert registered == {cid: (forms.label(*a), forms.label(*b)) for cid, (a, b) in forms.COMPARISONS.items()}


@pytest.mark.parametrize("regime,task,policy,heads", [
    ("prefill", "perplexity", "snapkv:form=authors", "repeated"),
    ("hashevict", "perplexity", "hashevict", "gqa"),
    ("hashevict", "passkey", "hashevict:form=authors,hash=key", "gqa"),
])
def test_a_cell_runs_in_its_regime_on_the_tiny_model(regime, task, policy, heads):
    cell = next(c for c in forms.cells(Settings(model="tiny")) if c["regime"] == regime and c["task"] == task
                and c["policy"] == policy and c["heads"] == heads)
    result = forms.run_cell(cell)
    forms.check_result(cell, result)
    if task == "perplexity":
        assert result["tokens"] == cell["length"] - cell["prompt"] == len(result["nll"])
        assert math.isclose(result["ppl"], math.exp(np.mean(result["nll"])))
    if regime == "prefill":  # compressed once to N per query head, then only the continuation is added
        assert result["peak_cache_tokens"] <= cell["length"]
    if regime == "hashevict":  # evicts before attention: at most N + 1 once decoding, or the prompt and one token
        assert result["peak_cache_tokens"] <= max(cell["budget"] + 1, cell.get("prompt", cell["length"]) + 1)


def _record(params: dict, result: dict) -> str:
    """A record as the runner writes it: its key, parameters and result."""
    return json.dumps({"key": json.dumps(params, sort_keys=True), "params": params, "result": result})


def test_the_script_recomputes_hand_computed_verdicts(tmp_path):
    """F1 passkey on 10 prompts (4 only A, 1 only B) and F4 perplexity on 5 documents, by hand."""
    script = _script()
    a_spec, b_spec = forms.COMPARISONS["F1"]
    lines = []
    a_right = [1, 1, 1, 1, 0, 1, 0, 0, 0, 0]
    b_right = [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    for i, (x, y) in enumerate(zip(a_right, b_right)):
        unit = {"task": "passkey", "regime": "prefill", "document": f"d{i}", "window": 4}
        kind = "drama" if i < 5 else "technical"
        lines.append(_record({**unit, "policy": a_spec[0], "heads": a_spec[1]}, {"correct": bool(x), "kind": kind}))
        lines.append(_record({**unit, "policy": b_spec[0], "heads": b_spec[1]}, {"correct": bool(y), "kind": kind}))
    a_spec, b_spec = forms.COMPARISONS["F4"]
    ppl_a, ppl_b = [20.0, 31.0, 25.5, 40.0, 18.0], [19.0, 30.0, 26.0, 35.0, 18.5]
    for i, (x, y) in enumerate(zip(ppl_a, ppl_b)):
        unit = {"task": "perplexity", "regime": "hashevict", "document": f"d{i}", "window": 0}
        lines.append(_record({**unit, "policy": a_spec[0], "heads": a_spec[1]}, {"ppl": x, "kind": "essay"}))
        lines.append(_record({**unit, "policy": b_spec[0], "heads": b_spec[1]}, {"ppl": y, "kind": "essay"}))
    records = tmp_path / "forms.jsonl.gz"
    records.write_bytes(gzip.compress("\n".join(lines).encode()))
    assert script.main([str(records), str(tmp_path / "out")]) == 0
    rows = {(r["comparison"], r["metric"]): r for r in csv.DictReader(open(tmp_path / "out" / "verdicts.csv"))}
    passkey = rows[("F1", "passkey")]
    assert int(passkey["n"]) == 10 and int(passkey["only_a"]) == 4 and int(passkey["only_b"]) == 1
    assert float(passkey["estimate"]) == pytest.approx((4 - 1) / 10)
    # exact McNemar: two-sided binomial on 5 discordant pairs, 1 of them B's
    assert float(passkey["p"]) == pytest.approx(2 * sps.binom.cdf(1, 5, 0.5), rel=1e-5)
    ppl = rows[("F4", "perplexity")]
    d = np.subtract(ppl_a, ppl_b)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(5))
    assert float(ppl["estimate"]) == pytest.approx(d.mean(), rel=1e-5)
    assert float(ppl["p"]) == pytest.approx(2 * sps.t.sf(abs(t), 4), rel=1e-4)
    # Holm over the two tests run: the smaller p doubled, the larger kept (if not below it)
    ps = sorted([float(passkey["p"]), float(ppl["p"])])
    assert min(float(passkey["p_holm"]), float(ppl["p_holm"])) == pytest.approx(min(1, 2 * ps[0]), rel=1e-4)
    # every registered comparison and metric is on the table: the others as "not run"
    assert len(rows) == 8
    assert rows[("F2", "passkey")]["label"] == rows[("F3", "perplexity")]["label"] == "not run"


COMMITTED = ROOT / "docs" / "_static" / "experiments" / "forms"


def test_the_committed_tables_are_what_the_committed_records_give(tmp_path):
    """Every registered record is committed (693 cells) and the published tables follow from them alone."""
    script = _script()
    records = script.read_records(COMMITTED / "records" / "forms.jsonl.gz")
    assert len(records) == len(forms.cells(Settings(model="smollm2"))) == 693
    assert script.main([str(COMMITTED / "records" / "forms.jsonl.gz"), str(tmp_path)]) == 0
    for name in ("units.csv", "verdicts.csv", "per_kind.csv"):
        assert (tmp_path / name).read_text() == (COMMITTED / name).read_text(), name
