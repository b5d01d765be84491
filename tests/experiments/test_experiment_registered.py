"""The registered rule's statistics and verdicts, against published values and hand-made data."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from refkv.experiments.registered import Comparison, paper_effect, verdict_rows, versus_paper
from refkv.experiments.stats import Interval, holm, newcombe_paired_difference, paired_t_test, text_perplexities

REGISTRATION = json.loads((pathlib.Path(__file__).resolve().parents[2] / "docs"
                           / "experiment_registration.json").read_text(encoding="utf-8"))
CLAIMS = {claim["id"]: claim for claim in REGISTRATION["claims"]}


def _paired(both: int, only_a: int, only_b: int, neither: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([1] * both + [1] * only_a + [0] * only_b + [0] * neither, dtype=bool)
    b = np.array([1] * both + [0] * only_a + [1] * only_b + [0] * neither, dtype=bool)
    return a, b


def test_newcombe_matches_the_published_example():
    """Fagerland, Lydersen & Laake (2017), ch. 8, Cavo et al. (2012): -0.0621 (-0.1186 to -0.0046)."""
    interval = newcombe_paired_difference(*_paired(59, 6, 16, 80))
    assert (round(interval.estimate, 4), round(interval.low, 4), round(interval.high, 4)) == (-0.0621, -0.1186, -0.0046)


def test_newcombe_keeps_its_coverage_on_sixty_prompts():
    """Simulated paired outcomes at the registered n = 60: the 95% interval covers the true
    difference at least 93% of the time (method 10 is near nominal; a wrong correlation sign
    or swapped limits drops it well below)."""
    rng = np.random.default_rng(7)
    for cells in ([0.55, 0.25, 0.05, 0.15], [0.80, 0.10, 0.05, 0.05], [0.30, 0.10, 0.10, 0.50]):
        p = np.array(cells)
        truth = (p[0] + p[1]) - (p[0] + p[2])
        hits = 0
        reps = 800
        for _ in range(reps):
            counts = rng.multinomial(60, p)
            interval = newcombe_paired_difference(*_paired(*counts))
            hits += interval.low <= truth <= interval.high
        assert hits / reps >= 0.93, (cells, hits / reps)


def test_holm_by_hand():
    assert holm([0.01, 0.04, 0.03]).tolist() == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]).tolist() == [0.5]
    assert holm([0.2, 0.9]).tolist() == pytest.approx([0.4, 0.9])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=8))
def test_holm_properties(p):
    adjusted = holm(p)
    p = np.asarray(p)
    assert np.all(adjusted >= p - 1e-15) and np.all(adjusted <= 1)
    assert adjusted[np.argmin(p)] == pytest.approx(min(1.0, len(p) * p.min()))
    order = np.argsort(p, kind="stable")
    assert np.all(np.diff(adjusted[order]) >= -1e-15)  # monotone in the raw p-values


def test_paired_t_test_matches_scipy():
    rng = np.random.default_rng(3)
    a, b = rng.normal(1.0, 1.0, 16), rng.normal(0.6, 1.0, 16)
    interval, p = paired_t_test(a, b)
    assert p == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-12)
    assert interval.estimate == pytest.approx(np.mean(a - b)) and interval.n == 16


def test_text_perplexities_are_per_text():
    assert text_perplexities([[0.0, 0.0], [np.log(2.0)] * 3]).tolist() == pytest.approx([1.0, 2.0])
    with pytest.raises(ValueError, match="text 1"):
        text_perplexities([[0.1], [np.nan]])


def test_scaled_paper_effects():
    # L1: KeyDiff removes (38.14 - 35.46) / (45.87 - 35.46) of SnapKV's gap: with SnapKV's gap 2.0
    assert paper_effect(CLAIMS["L1"], "keydiff", "snapkv", 2.0) == pytest.approx(-2.0 * 2.68 / 10.41)
    # C1: CAOTE removes (0.555 - 0.451) / 0.555 of SnapKV's gap
    assert paper_effect(CLAIMS["C1"], "caote:base=snapkv", "snapkv", 1.0) == pytest.approx(-0.104 / 0.555)
    # P1: accuracy points / 100
    assert paper_effect(CLAIMS["P1"], "keydiff", "tova", None) == pytest.approx(0.49)
    # M1: perplexity (lower is better) (5.74 - 5.89) / (5.05 - 5.89) of sink's gap
    assert paper_effect(CLAIMS["M1"], "mat@selected", "sink", 3.0) == pytest.approx(-3.0 * 0.15 / 0.84)
    # A1: ratio of losses H2O / HashEvict, scaled by HashEvict's loss
    assert paper_effect(CLAIMS["A1"], "h2o", "hashevict", 0.1) == pytest.approx(-(1 - 0.0139 / 0.0336) * 0.1)
    assert paper_effect(CLAIMS["S1"], "bits=32", "bits=8", None) == pytest.approx(0.18)
    assert paper_effect(CLAIMS["P2"], "snapkv@oneshot", "snapkv@blocks", None) is None
    with pytest.raises(ValueError, match="reference"):
        paper_effect(CLAIMS["L1"], "keydiff", "snapkv", None)


def test_versus_paper_reads_on_the_claimed_side():
    def interval(low, high):
        return Interval((low + high) / 2, low, high, 0.95, 16, "texts", "t")
    # claim: A - B < 0, paper effect -1.0
    assert versus_paper(interval(-3.0, -1.5), -1.0, -1) == "larger than the paper"
    assert versus_paper(interval(-0.8, 0.2), -1.0, -1) == "smaller than the paper"
    assert versus_paper(interval(-1.2, -0.5), -1.0, -1) == "consistent with the paper"
    # claim: A - B > 0, paper effect +0.28
    assert versus_paper(interval(0.3, 0.6), 0.28, 1) == "larger than the paper"
    assert versus_paper(interval(-0.1, 0.2), 0.28, 1) == "smaller than the paper"
    assert versus_paper(interval(0.1, 0.2), None, 1) == ""


def test_verdicts_by_the_registered_rule():
    """Hand-made records: Holm turns a raw p below 0.05 into 'not resolved', and every row's
    verdict follows from its numbers."""
    n = 60
    kd = np.ones(n, bool)
    # keydiff vs snapkv: 14 discordant all for KeyDiff -> exact p = 2 * 0.5**14, holds after Holm.
    snap = kd.copy()
    snap[:14] = False
    # keydiff vs tova: 6 vs 0 discordant -> p = 0.03125 raw, x2 or x3 under Holm -> not resolved.
    tova = kd.copy()
    tova[:6] = False
    # keydiff vs h2o: 3 prompts only KeyDiff, 5 only H2O -> p = 0.727, the largest.
    kd_h = np.zeros(n, bool)
    kd_h[:3] = True
    h2o = np.zeros(n, bool)
    h2o[3:8] = True
    comparisons = [Comparison("P1", "keydiff", "snapkv", kd, snap, "prompts"),
                   Comparison("P1", "keydiff", "tova", kd, tova, "prompts"),
                   Comparison("P1", "keydiff", "h2o", kd_h, h2o, "prompts")]
    rows = {row["b"]: row for row in verdict_rows(REGISTRATION, comparisons)}
    assert rows["snapkv"]["verdict"] == "holds" and rows["snapkv"]["p"] == pytest.approx(2 * 0.5 ** 14)
    assert rows["tova"]["p"] == pytest.approx(0.03125) and rows["tova"]["p_holm"] == pytest.approx(0.0625)
    assert rows["tova"]["verdict"] == "not resolved"
    assert rows["h2o"]["verdict"] == "not resolved" and rows["h2o"]["p_holm"] == pytest.approx(0.7265625)
    assert rows["snapkv"]["paper_effect"] == pytest.approx(0.28)
    assert rows["snapkv"]["versus_paper"] == "consistent with the paper"  # [~+0.13, ~+0.34]
    for row in rows.values():
        assert row["low"] <= row["estimate"] <= row["high"] and row["n"] == n


def test_perplexity_verdicts_are_per_text():
    rng = np.random.default_rng(11)
    b = rng.normal(20.0, 2.0, 16)
    a = b - 1.0 + rng.normal(0, 0.2, 16)           # clearly lower perplexity: holds
    row, = verdict_rows(REGISTRATION, [Comparison("M1", "mat@selected", "sink", a, b, "texts", reference=2.5)])
    assert row["verdict"] == "holds" and row["unit"] == "texts" and row["n"] == 16
    assert row["paper_effect"] == pytest.approx(-2.5 * 0.15 / 0.84)


def test_a_significant_difference_against_the_claim_is_reversed():
    rng = np.random.default_rng(5)
    b = rng.normal(20.0, 2.0, 16)
    a = b + 1.0 + rng.normal(0, 0.2, 16)           # KeyDiff clearly worse (higher perplexity)
    rows = verdict_rows(REGISTRATION, [Comparison("L1", "keydiff", "snapkv", a, b, "texts", reference=1.0)])
    assert rows[0]["verdict"] == "reversed" and rows[0]["versus_paper"] == "smaller than the paper"


def test_unregistered_comparisons_are_refused():
    x = np.ones(4, bool)
    with pytest.raises(ValueError, match="not one of its registered"):
        verdict_rows(REGISTRATION, [Comparison("P1", "keydiff", "sink", x, x, "prompts")])
    with pytest.raises(ValueError, match="not registered"):
        verdict_rows(REGISTRATION, [Comparison("Z9", "keydiff", "sink", x, x, "prompts")])


def _record(params: dict, result: dict) -> dict:
    return {"params": {"design": "registered", **params}, "result": result}


def test_calibration_picks_the_largest_length_at_the_ceiling():
    from refkv.experiments.registered import calibrated_length

    records = []
    for length, right in ((512, 60), (768, 57), (1024, 56)):
        records += [_record({"purpose": "calibration", "length": length, "sample": s, "policy": "full"},
                            {"correct": s < right}) for s in range(60)]
    length, tally = calibrated_length(records, REGISTRATION)
    assert length == 768 and tally[1024] == (56, 60)          # 56/60 = 0.933 < 0.95
    records = [r for r in records if r["params"]["length"] == 1024]
    assert calibrated_length(records, REGISTRATION)[0] is None


def test_records_become_the_registered_comparisons():
    from refkv.experiments.perplexity import registered_texts
    from refkv.experiments.registered import chosen_mat, passkey_comparisons, perplexity_comparisons

    rng = np.random.default_rng(0)
    records = []
    for s in range(60):
        base = {"purpose": "test", "length": 1024, "sample": s}
        for policy in ("keydiff", "snapkv", "tova", "h2o"):
            for block in (128, None):
                correct = {"correct": bool(rng.random() < 0.5)}
                records.append(_record({**base, "policy": policy, "block": block}, correct))
    comparisons = passkey_comparisons(records)
    assert [(c.claim, c.a, c.b) for c in comparisons] == [
        ("P1", "keydiff", "snapkv"), ("P1", "keydiff", "tova"), ("P1", "keydiff", "h2o"),
        ("P2", "snapkv@oneshot", "snapkv@blocks"), ("P2", "tova@oneshot", "tova@blocks"),
        ("P2", "h2o@oneshot", "h2o@blocks")]
    assert all(len(c.a_values) == 60 for c in comparisons)
    assert len(verdict_rows(REGISTRATION, comparisons)) == 6

    texts = registered_texts("verdict")
    ppl = []
    for i, (text, segment) in enumerate(texts):
        cell = {"text": text, "segment": segment}
        ppl.append(_record({**cell, "policy": "full", "block": 32}, {"ppl": 10.0 + i}))
        for policy, extra in (("keydiff", 3.0), ("snapkv", 2.0), ("tova", 2.5), ("h2o", 4.0),
                              ("caote:base=h2o", 3.5), ("caote:base=tova", 2.4), ("caote:base=snapkv", 1.9)):
            ppl.append(_record({**cell, "policy": policy, "block": 32}, {"ppl": 10.0 + i + extra + 0.01 * (i % 3)}))
        for seed, extra in enumerate((1.0, 1.2, 1.4)):
            ppl.append(_record({**cell, "policy": f"hashevict:seed={seed}", "block": 1}, {"ppl": 10.0 + i + extra}))
        ppl.append(_record({**cell, "policy": "knorm:recent=10,sink=4", "block": 1}, {"ppl": 10.0 + i + 2.0}))
        ppl.append(_record({**cell, "policy": "sink", "block": 1}, {"ppl": 10.0 + i + 1.5}))
        ppl.append(_record({**cell, "policy": "mat:beta=16,shallow_layers=2", "block": 1}, {"ppl": 10.0 + i + 1.1}))
    for text, segment in registered_texts("selection"):
        for spec, value in (("mat:beta=16,shallow_layers=2", 12.0), ("mat:beta=32,shallow_layers=0", 12.5)):
            ppl.append(_record({"text": text, "segment": segment, "policy": spec, "block": 32}, {"ppl": value}))
    assert chosen_mat(ppl) == "mat:beta=16,shallow_layers=2"
    by_pair = {(c.claim, c.a, c.b): c for c in perplexity_comparisons(ppl)}
    h1 = by_pair[("H1", "hashevict", "knorm:recent=10,sink=4")]
    assert h1.a_values[0] == pytest.approx(11.2) and h1.reference == pytest.approx(2.0)   # the seeds' mean
    l1 = by_pair[("L1", "keydiff", "snapkv")]
    assert len(l1.a_values) == 16 and l1.unit == "texts"
    rows = {(r["claim"], r["b"]): r for r in verdict_rows(REGISTRATION, list(by_pair.values()))}
    assert rows[("L1", "snapkv")]["verdict"] == "reversed"        # KeyDiff 1.0 worse on every text
    assert rows[("M1", "sink")]["verdict"] == "holds"             # MAT 0.4 better on every text
    assert rows[("M1", "sink")]["paper_effect"] == pytest.approx(-1.5 * 0.15 / 0.84)


def test_the_docs_script_writes_the_registered_tables(tmp_path, monkeypatch):
    """docs/registered_verdicts.py reads the results folder's records and writes the three
    tables; a calibration record set with one passing length is named as chosen."""
    import importlib.util

    from refkv.files import atomic_write

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    spec = importlib.util.spec_from_file_location("registered_verdicts", docs / "registered_verdicts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path / "out")
    lines = [json.dumps({"key": f"c{s}", "params": {"design": "registered", "purpose": "calibration",
                                                     "length": 512, "sample": s, "policy": "full"},
                         "result": {"correct": True}}) for s in range(60)]
    (tmp_path / "results").mkdir()
    atomic_write(tmp_path / "results" / "passkey.jsonl", "\n".join(lines) + "\n")
    assert module.main([str(tmp_path / "results")]) == 0
    calibration = (tmp_path / "out" / "calibration.csv").read_text().splitlines()
    assert calibration == ["length,correct,prompts,chosen", "512,60,60,True"]
    assert (tmp_path / "out" / "verdicts.csv").read_text().startswith("claim,a,b,n,unit,estimate")
