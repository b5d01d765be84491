"""Comparison: shape -> dtype -> values, tie-aware retention, end-to-end tie propagation."""

import numpy as np
import pytest

from refkv.oracle.arrays import compare_arrays
from refkv.oracle.cases import compare_case
from refkv.oracle.retention import compare_retention
from refkv.oracle.walk import compare_end_to_end

# -- arrays ---------------------------------------------------------------------------------


def test_shape_is_checked_before_dtype_and_dtype_before_values():
    mm = compare_arrays(np.zeros((2, 3), dtype=np.int64), np.ones((3, 2)))
    assert mm.kind == "shape" and "actual (2, 3), desired (3, 2)" in mm.message
    mm = compare_arrays(np.zeros((2, 3), dtype=np.int64), np.ones((2, 3)))
    assert mm.kind == "dtype" and "int64 (integer)" in mm.message
    assert compare_arrays(np.ones(3, dtype=np.float32), np.ones(3)) is None  # same kind
    assert compare_arrays(np.ones(3, dtype=np.float32), np.ones(3), check_dtype=True).kind == "dtype"
    assert compare_arrays(np.zeros(3, dtype=np.int64), np.ones(3), check_dtype=False).kind == "values"


def test_values_report_count_first_and_largest_difference():
    desired = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    actual = desired.copy()
    actual[0, 2] += 0.5
    actual[1, 1] += 2.0
    mm = compare_arrays(actual, desired, rtol=1e-6, describe_index=lambda i: f"head {i[0]}, column {i[1]}")
    assert mm.kind == "values" and (mm.count, mm.total) == (2, 6) and mm.index == (0, 2)
    assert "first at head 0, column 2: actual 3.5, desired 3" in mm.message
    assert "largest |diff| 2 at head 1, column 1" in mm.message


def test_tolerance_boundary_nan_and_infinities():
    # |a - d| <= atol + rtol |d| passes at equality (numpy.testing's convention).
    assert compare_arrays(np.array([1.5]), np.array([1.0]), atol=0.25, rtol=0.25) is None
    assert compare_arrays(np.array([1.5 + 1e-12]), np.array([1.0]), atol=0.25, rtol=0.25) is not None
    assert compare_arrays(np.array([np.nan, np.inf, -np.inf]), np.array([np.nan, np.inf, -np.inf])) is None
    assert compare_arrays(np.array([np.inf]), np.array([-np.inf]), atol=1e300) is not None
    assert compare_arrays(np.array([np.nan]), np.array([0.0]), atol=1.0) is not None
    assert compare_arrays(np.array([1e308]), np.array([np.inf]), atol=1e300) is not None


# -- retention -----------------------------------------------------------------------------
SCORES = np.array([[0.9, 0.5, 0.5 + 1e-12, 0.1, 0.7]])
POSITIONS = np.array([[0, 3, 4, 9, 12]])
REFERENCE = np.array([[0, 2, 4]])  # top 3: 0.9, 0.7 and 0.5+1e-12


def test_equal_sets_pass_without_ties():
    r = compare_retention(REFERENCE, REFERENCE, SCORES, positions=POSITIONS)
    assert r.ok and r.ties == []


def test_a_swap_within_tolerance_is_an_accepted_tie():
    r = compare_retention(np.array([[0, 1, 4]]), REFERENCE, SCORES, positions=POSITIONS, atol=1e-9)
    assert r.ok and len(r.ties) == 1
    t = r.ties[0]
    assert (t.kept_position, t.dropped_position) == (3, 4)
    assert t.gap == pytest.approx(1e-12, abs=1e-15) and t.threshold == pytest.approx(1e-9)
    assert t.describe() == ("head 0: candidate keeps position 3 (reference score 0.5) instead of position 4 "
                            "(reference score 0.500000000001); |difference| 1e-12 <= tolerance 1e-09")


def test_a_swap_beyond_tolerance_fails_naming_both_tokens_and_scores():
    r = compare_retention(np.array([[0, 3, 4]]), REFERENCE, SCORES, positions=POSITIONS, atol=1e-9)
    assert not r.ok and r.head == 0
    assert r.failure == ("head 0: candidate keeps position 9 (reference score 0.1) instead of position 4 "
                         "(reference score 0.5); |difference| 0.4 > tolerance 1e-09")


def test_exact_ties_pass_even_at_zero_tolerance():
    scores = np.array([[1.0, 1.0, 0.0]])
    r = compare_retention(np.array([[0]]), np.array([[1]]), scores)
    assert r.ok and r.ties[0].gap == 0.0


def test_every_pair_of_a_multi_swap_must_be_within_tolerance():
    # Reference keeps {0, 1} (scores 3.0, 2.0); the candidate keeps {2, 3} (1.99, 1.0): the
    # 2.0/1.99 pair is a near tie but 3.0 vs 1.0 is not, and that pair is reported.
    scores = np.array([[3.0, 2.0, 1.99, 1.0]])
    r = compare_retention(np.array([[2, 3]]), np.array([[0, 1]]), scores, atol=0.05)
    assert not r.ok and (r.swap.dropped_position, r.swap.kept_position) == (0, 3)


def test_evicting_a_protected_token_fails_whatever_the_scores():
    scores = np.array([[0.0, 5.0, 5.0]])
    protected = np.array([[True, False, False]])
    r = compare_retention(np.array([[1, 2]]), np.array([[0, 2]]), scores, protected=protected, atol=100.0)
    assert not r.ok and "evicts position 0, which the reference protects" in r.failure


@pytest.mark.parametrize("actual, match", [
    (np.array([[0, 0, 4]]), "keeps position 0 .column 0. twice"),
    (np.array([[0, 2, 7]]), "column 7, outside"),
    (np.array([[0, 2]]), "shape mismatch"),
    (np.array([[0.0, 2.0, 4.0]]), "must be integers"),
])
def test_malformed_candidates_fail_clearly(actual, match):
    r = compare_retention(actual, REFERENCE, SCORES, positions=POSITIONS)
    assert not r.ok
    assert __import__("re").search(match, r.failure)


def test_later_heads_are_reported_only_after_earlier_ones():
    scores = np.array([[1.0, 0.0], [1.0, 0.0]])
    r = compare_retention(np.array([[1], [1]]), np.array([[0], [0]]), scores)
    assert r.head == 0 and r.failure.startswith("head 0:")


# -- end to end ------------------------------------------------------------------------------
def _reference(before=False):
    """3 blocks x 2 layers x 1 head, budget 2, blocks of 1 token; every layer evicts from block 2 on.

    Block 0 holds {0}, block 1 {0, 1}; block 2 evicts one of {0, 1, 2}. Layer 0's scores
    leave a near tie between positions 1 and 2.
    """
    kept = np.full((3, 2, 1, 2), -1)
    kept[0, :, 0, :1] = [0]
    kept[1, :, 0] = [0, 1]
    kept[2, :, 0] = [0, 2]
    counts = np.array([[1, 1], [2, 2], [2, 2]])
    cands = np.full((3, 2, 1, 3), -1)
    cands[2, :, 0] = [0, 1, 2]
    cand_n = np.array([[0, 0], [0, 0], [3, 3]])
    scores = np.full((3, 2, 1, 3), np.nan)
    scores[2, 0, 0] = [5.0, 1.0, 1.0 + 1e-12]
    scores[2, 1, 0] = [5.0, 1.0, 3.0]
    arrays = {"kept": kept, "kept_count": counts, "candidates": cands, "candidate_count": cand_n,
              "scores": scores, "protected": np.zeros((3, 2, 1, 3), dtype=bool), "logits": np.array([0.5, -1.0])}
    # Own-scale tolerances: tol_i = rtol * max(|s_i|, median |s| of the decision) (atol is not used).
    manifest = {"tolerance": {"scores": {"rtol": 1e-9, "atol": 0.0}, "logits": {"rtol": 1e-9, "atol": 0.0}},
                "policy": {"evict_before_attention": before}, "dtype": "float64"}
    return arrays, manifest


def _candidate(arrays, **changes):
    out = {k: arrays[k].copy() for k in ("kept", "kept_count", "logits")}
    out.update(changes)
    return out


def test_end_to_end_identical_candidate_passes():
    ref, man = _reference()
    r = compare_end_to_end(_candidate(ref), ref, man)
    assert r.ok and r.ties == [] and r.decisions == 6 and r.unchecked == 0
    assert r.logits == "max |diff| 0"


def test_end_to_end_tie_in_the_last_block_is_accepted_and_logits_still_compared():
    ref, man = _reference()
    kept = ref["kept"].copy()
    kept[2, 0, 0] = [0, 1]  # layer 0 keeps 1 instead of 2: scores 1.0 vs 1.0 + 1e-12
    r = compare_end_to_end(_candidate(ref, kept=kept), ref, man)
    assert r.ok and len(r.ties) == 1 and r.ties[0].where == "block 2, layer 0, head 0"
    # Eviction after attention in the last block cannot change that block's logits.
    assert r.logits.startswith("max |diff|")


def test_end_to_end_failure_names_block_layer_head_positions_and_scores():
    ref, man = _reference()
    kept = ref["kept"].copy()
    kept[2, 1, 0] = [0, 1]  # layer 1: 1.0 instead of 3.0
    r = compare_end_to_end(_candidate(ref, kept=kept), ref, man)
    assert not r.ok
    # Layer 1's scores are (5, 1, 3), median 3: each tolerance is 1e-9 * max(|s|, 3) = 3e-9.
    assert r.failure == ("block 2, layer 1, head 0: candidate keeps position 1 (reference score 1) instead of "
                         "position 2 (reference score 3); |difference| 2 > tolerance 6e-09 "
                         "[float64 tolerance at the two scores' own scale]")


def test_end_to_end_tie_makes_downstream_decisions_and_logits_unchecked():
    # Four blocks: a tie at (block 2, layer 0) leaves block 3's layers 0 and 1 and the logits
    # unchecked; with eviction before attention, (block 2, layer 1) too.
    ref, man = _reference()
    ref = {k: np.concatenate([v, v[2:3]]) if v.ndim >= 2 else v for k, v in ref.items()}
    kept = ref["kept"].copy()
    kept[2, 0, 0] = [0, 1]
    kept[3, 0, 0] = [0, 1]
    kept[3, 1, 0] = [0, 1]  # would be a failure if it were compared
    cand = _candidate(ref, kept=kept, logits=np.array([9.0, 9.0]))
    r = compare_end_to_end(cand, ref, man)
    assert r.ok and len(r.ties) == 1
    assert (r.decisions, r.unchecked) == (6, 2)
    assert r.logits.startswith("not compared")
    man_before = {**man, "policy": {"evict_before_attention": True}}
    kept[2, 1, 0] = [0, 1]
    r = compare_end_to_end(_candidate(ref, kept=kept, logits=cand["logits"]), ref, man_before)
    assert r.ok and (r.decisions, r.unchecked) == (5, 3)


def test_end_to_end_counts_and_logits_are_checked():
    ref, man = _reference()
    counts = ref["kept_count"].copy()
    counts[1, 1] = 1
    r = compare_end_to_end(_candidate(ref, kept_count=counts), ref, man)
    assert r.failure == "kept_count: block 1, layer 1: candidate holds 1 tokens per head, the reference 2"
    r = compare_end_to_end(_candidate(ref, logits=np.array([0.5, -1.1])), ref, man)
    assert r.failure.startswith("logits: values differ: 1 of 2") and "token id 1" in r.failure
    kept = ref["kept"].copy()
    kept[1, 0, 0] = [0, 5]
    r = compare_end_to_end(_candidate(ref, kept=kept), ref, man)
    assert r.failure.startswith("block 1, layer 0, head 0: kept positions differ but the reference did not evict")


def test_strict_ties_turn_a_tie_into_a_failure():
    ref, man = _reference()
    kept = ref["kept"].copy()
    kept[2, 0, 0] = [0, 1]
    r = compare_end_to_end(_candidate(ref, kept=kept), ref, man, strict_ties=True)
    assert not r.ok and r.failure.startswith("strict ties: block 2, layer 0, head 0")


# -- final-cache form ----------------------------------------------------------------------------
def _final(arrays, kept=None):
    kept = arrays["kept"] if kept is None else kept
    return {"kept": kept[-1].copy(), "kept_count": arrays["kept_count"][-1].copy(), "logits": arrays["logits"]}


def test_final_only_identical_cache_passes_and_says_which_form_ran():
    ref, man = _reference()
    r = compare_end_to_end(_final(ref), ref, man, final_only=True)
    assert r.ok and r.form == "final only" and r.decisions == 2 and r.logits.startswith("max |diff|")
    assert compare_end_to_end(_candidate(ref), ref, man).form == "per block"


def test_final_only_explains_a_difference_by_the_evicting_decision():
    ref, man = _reference()
    kept = ref["kept"].copy()
    kept[2, 0, 0] = [0, 1]  # near tie (1.0 vs 1.0 + 1e-12) at block 2, layer 0
    r = compare_end_to_end(_final(ref, kept), ref, man, final_only=True)
    assert r.ok and len(r.ties) == 1
    assert r.ties[0].where == "final cache, layer 0, head 0 (reference eviction at block 2)"
    kept[2, 1, 0] = [0, 1]  # 1.0 instead of 3.0 at layer 1: a real difference
    r = compare_end_to_end(_final(ref, kept), ref, man, final_only=True)
    assert not r.ok and r.failure.startswith("final cache, layer 1, head 0 (reference eviction at block 2): "
                                             "candidate keeps position 1 (reference score 1) instead of position 2")


def test_final_only_is_weaker_than_the_per_block_check():
    # A candidate that kept another token in block 1 but ends with the reference's cache:
    # the per-block form sees it, the final-only form cannot.
    ref, man = _reference()
    kept = ref["kept"].copy()
    kept[1, 0, 0] = [0, 5]
    assert not compare_end_to_end(_candidate(ref, kept=kept), ref, man).ok
    assert compare_end_to_end(_final(ref, kept), ref, man, final_only=True).ok


# -- declarations -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def snapkv_case():
    from pathlib import Path

    from refkv.testing import load_cases
    return load_cases(Path(__file__).resolve().parents[1] / "golden", policy="snapkv", dtype="float32")[0]


def test_declared_positive_multiple_accepts_a_mean_and_reports_it(snapkv_case):
    out = snapkv_case.outputs
    mean = out["scores"] * np.float32(0.25)  # kvpress: the mean over a window of 4 queries, not their sum
    r = compare_case({"scores": mean, "kept": out["kept"]}, snapkv_case)
    assert not r.ok and r.messages[0].startswith("scores: values differ")
    r = compare_case({"scores": mean, "kept": out["kept"]}, snapkv_case, declare={"scores": "positive_multiple"})
    assert r.ok and r.notes[0] == "declared scores=positive_multiple (argument)"
    spoiled = mean.copy()
    spoiled[0, 0] *= 3
    r = compare_case({"scores": spoiled}, snapkv_case, declare={"scores": "positive_multiple"})
    assert not r.ok and "declared positive_multiple" in r.messages[0]


def test_declared_pinned_columns_are_not_compared_but_kept_sets_are(snapkv_case):
    out = snapkv_case.outputs
    padded = np.where(out["protected"], out["scores"].max() + 1, out["scores"])  # kvpress pins protected tokens
    assert not compare_case({"scores": padded}, snapkv_case).ok
    r = compare_case({"scores": padded, "kept": out["kept"]}, snapkv_case, declare={"pinned": "protected"})
    assert r.ok and "declared pinned=protected (argument)" in r.notes
    positions = snapkv_case.inputs["positions"][out["protected"]]
    r = compare_case({"scores": padded}, snapkv_case, declare={"pinned": sorted(set(positions.tolist()))})
    assert r.ok
    wrong_kept = out["kept"].copy()
    wrong_kept[0, -1] = next(c for c in range(out["scores"].shape[1]) if c not in out["kept"][0])
    wrong_kept.sort(axis=1)
    r = compare_case({"scores": padded, "kept": wrong_kept}, snapkv_case, declare={"pinned": "protected"})
    assert not r.ok and r.messages[0].startswith("kept:")


def test_declared_kept_only_ignores_scores_and_bad_declarations_are_refused(snapkv_case):
    out = snapkv_case.outputs
    r = compare_case({"scores": out["scores"] * 0, "kept": out["kept"]}, snapkv_case, declare={"kept_only": True})
    assert r.ok and r.notes == ["declared kept_only=true (argument)"]
    with pytest.raises(ValueError, match=r"declare has unknown key.*'scale'"):
        compare_case({"kept": out["kept"]}, snapkv_case, declare={"scale": 2})
    with pytest.raises(ValueError, match="declare scores must be one of"):
        compare_case({"kept": out["kept"]}, snapkv_case, declare={"scores": "linear"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        compare_case({"kept": out["kept"]}, snapkv_case, dtype="int8")


# -- folders and the command line ------------------------------------------------------------------------
def _oneshot_folder(folder, policy="tova"):
    from refkv import policies
    from refkv.oracle.encode import encode_case, vectors_document
    from refkv.oracle.io import write_json
    from refkv.oracle.synthetic import random_tokens, replay
    from refkv.oracle.vectors import json_params

    pol = policies.get(policy)
    cases = []
    for i in range(2):
        tokens = random_tokens(np.random.default_rng(i), 4, 2, 8, 20, np.float32)
        view = replay(pol, tokens, block_size=20, budget=8)
        cases.append(encode_case(pol, view, case_id=i + 1, comment="one-shot"))
    write_json(folder / f"{policy}.json", vectors_document(policy, [(json_params(pol.params()), cases)]))


def _run(capsys, *argv):
    from refkv.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_check_accepts_a_folder_of_case_files_without_suite_json(tmp_path, capsys):
    from refkv.oracle.encode import candidate_document
    from refkv.oracle.io import write_json
    from refkv.oracle.vectors import read_vectors

    ref = tmp_path / "ref"
    ref.mkdir()
    _oneshot_folder(ref)
    cases = read_vectors(ref / "tova.json").cases
    cand = tmp_path / "cand"
    doc = candidate_document("tova", {c.id: {"kept": c.outputs["kept"]} for c in cases})
    doc["computed_dtype"] = "bfloat16"
    doc["declare"] = {"scores": "monotone"}
    write_json(cand / "tova.json", doc)
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(ref), "--verbose")
    assert code == 0, out
    assert "the reference has no suite.json" in out and "computed dtype bfloat16 (candidate file)" in out
    assert "declared scores=monotone (candidate file)" in out
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(ref), "--verbose",
                     "--declare", "scores=exact", "--kept-only", "--dtype", "float16")
    assert code == 0
    assert "declared scores=exact (command line)" in out and "overridden: scores=monotone (candidate file)" in out
    assert "declared kept_only=true (command line)" in out
    assert "computed dtype float16 (command line); overrides the candidate file's bfloat16" in out
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(ref), "--declare", "bogus=1")
    assert code == 2 and "--declare must be KEY=VALUE" in out
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(ref), "--dtype", "int8")
    assert code == 2 and "--dtype must be one of 'float64', 'float32', 'bfloat16', 'float16', got 'int8'" in out


def test_check_final_only_from_the_command_line(tmp_path, capsys):
    import shutil
    from pathlib import Path

    from refkv.oracle.io import read_npz, write_npz

    golden = Path(__file__).resolve().parents[1] / "golden"
    rel = "e2e/h2o/N8-B4-float64"
    cand = tmp_path / "cand"
    shutil.copytree(golden / "e2e" / "h2o", cand / "e2e" / "h2o")
    ref = read_npz(golden / f"{rel}.npz")
    write_npz(cand / f"{rel}.npz", {"kept": ref["kept"][-1], "kept_count": ref["kept_count"][-1],
                                    "logits": ref["logits"]})
    argv = ["golden", "check", str(cand), "--against", str(golden), "--policies", "h2o", "--kind", "e2e",
            "--allow-missing", "--verbose"]
    code, out = _run(capsys, *argv, "--final-only")
    assert code == 0, out
    assert "form: final only (weaker: only the final cache is compared)" in out
    code, out = _run(capsys, *argv)
    assert code == 1 and f"FAIL {rel}.json" in out
