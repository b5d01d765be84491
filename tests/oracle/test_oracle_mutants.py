"""The checker, pinned (issue 22 I): each test here fails on one plausible single-line regression.

Mutation testing of the oracle left these mutants alive (or caught only by the example page's
printed-output snapshot). Each test is semantic -- an adversarial candidate, or a value
computed by hand from the documented rule -- never a snapshot of what the code prints. The
mutant each test kills is named in its docstring.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from refkv import policies
from refkv.oracle.cases import compare_case
from refkv.oracle.checker import check_suite
from refkv.oracle.declare import Declarations, parse_cli_declaration
from refkv.oracle.encode import candidate_document, encode_case
from refkv.oracle.io import write_json
from refkv.oracle.retention import Swap, compare_kept, compare_ranking, compare_retention
from refkv.oracle.synthetic import Tokens, random_tokens, replay
from refkv.oracle.tolerance import (
    DTYPES,
    SMALLEST_SUBNORMAL,
    UNIT_ROUNDOFF,
    backward_error,
    reductions,
    score_tolerance,
    tie_rule_meaningless,
)
from refkv.oracle.vectors import as_vector_case
from refkv.oracle.walk import compare_end_to_end
from refkv.testing import load_cases

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(scope="module")
def snapkv_cases():
    return load_cases(GOLDEN, policy="snapkv", dtype="float32")


# -- cases.py: declared positive_multiple ------------------------------------------------------------
def test_a_negated_candidate_is_not_a_positive_multiple(snapkv_cases):
    """Kills: the ``c > 0`` check dropped (``-2 s`` rescaled by its median ratio -2 is ``s``)."""
    for case in snapkv_cases:
        out = case.outputs
        r = compare_case({"scores": -2.0 * out["scores"], "kept": out["kept"]}, case,
                         declare={"scores": "positive_multiple"})
        assert not r.ok, case.label
        assert r.messages[0].startswith("scores (declared positive_multiple): head 0: the ratio to the reference "
                                        "is -2, not > 0"), r.messages[0]


def _rescaled_and_noisy(case, dtype, c=0.25):
    """``c (s_i + tol_i sign(s_i))`` on the 60% of each head's scores with the largest relative
    tolerance, ``c s_i`` on the rest: every score within its own tolerance of ``c s``, and a
    median ratio pushed up by a typical relative tolerance, so the scores with a small one land
    about that far from ``s`` after rescaling -- beyond their own ``tol_i``."""
    s = case.outputs["scores"].astype(np.float64)
    tol = score_tolerance(case, dtype)
    rel = np.divide(tol, np.abs(s), out=np.full(s.shape, np.inf), where=np.abs(s) > 0)
    a = s.copy()
    for h in range(s.shape[0]):
        up = rel[h] >= np.quantile(rel[h], 0.4)
        a[h] = np.where(up, s[h] + np.sign(s[h]) * tol[h], s[h])
    return c * a, s, tol


@pytest.mark.parametrize("policy", ["snapkv", "keydiff"])
def test_a_rescaled_and_noisy_candidate_within_tolerance_passes(policy):
    """Kills: the positive_multiple slack reduced to ``tol`` (the estimated ratio's own error
    is not allowed for, and this correct-up-to-rounding candidate fails)."""
    needed_slack = 0
    for case in load_cases(GOLDEN, policy=policy, dtype="float32"):
        a, s, tol = _rescaled_and_noisy(case, "bfloat16")
        r = compare_case({"scores": a.astype(np.float32)}, case, dtype="bfloat16",
                         declare={"scores": "positive_multiple"})
        assert r.ok, r.format()
        # Adversarial indeed: rescaled by its median ratio, some score is beyond its own tol.
        use = np.abs(s) > tol
        ratio = np.array([[np.median(a[h, use[h]] / s[h, use[h]])] for h in range(s.shape[0])])
        needed_slack += bool((np.abs(a / ratio - s) > tol).any())
    assert needed_slack >= 3


# -- retention.py -------------------------------------------------------------------------------------
def test_a_swap_to_a_higher_scored_token_is_not_a_tie():
    """Kills: ``abs(gap)`` -> ``gap`` (keeping a token scored 3 in place of one scored 1 gives a
    negative gap, which would pass any threshold)."""
    scores = np.array([[5.0, 1.0, 3.0]])
    r = compare_retention(np.array([[0, 2]]), np.array([[0, 1]]), scores, atol=0.5)
    assert not r.ok and r.swap.gap == -2.0
    assert r.failure.startswith("head 0: candidate keeps position 2 (reference score 3) instead of position 1 "
                                "(reference score 1); |difference| 2 > tolerance 0.5")
    status, _, _ = compare_kept(np.array([0, 2]), np.array([0, 1]), scores[0], np.arange(3),
                                np.zeros(3, dtype=bool), atol=0.5, where="head 0")
    assert status.value == "fail"
    swap = Swap("head 0", kept_position=2, kept_score=3.0, dropped_position=1, dropped_score=1.0, gap=-2.0,
                threshold=0.5)
    assert not swap.accepted and "|difference| 2 > tolerance 0.5" in swap.describe()
    # The same gap the other way round is a failure too, and within the threshold a tie.
    assert not compare_retention(np.array([[0, 1]]), np.array([[0, 2]]), scores, atol=0.5).ok
    assert compare_retention(np.array([[0, 2]]), np.array([[0, 1]]), scores, atol=2.0).ties


def test_a_ranking_reversed_only_in_the_last_head_fails_the_monotone_check():
    """Kills: the monotone check skipping the last head."""
    desired = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    actual = desired.copy()
    actual[2] = [3.0, 2.0, 1.0]
    tol = np.full(desired.shape, 0.1)
    compared = np.ones(desired.shape, dtype=bool)
    positions = np.tile(np.arange(3), (3, 1))
    message = compare_ranking(actual, desired, tol, positions, compared)
    assert message is not None and message.startswith("head 2: the reference ranks position 2 (score 3) above "
                                                      "position 0 (score 1)")
    assert compare_ranking(desired, desired, tol, positions, compared) is None


def test_monotone_candidate_reversed_in_the_last_head_fails_compare_case(snapkv_cases):
    """Kills: the monotone check skipping the last head, through the case comparison."""
    case = next(c for c in snapkv_cases if c.sizes["n_kv_heads"] > 1)
    out = case.outputs
    scores = np.exp(out["scores"].astype(np.float64))  # increasing: a declared monotone transform
    assert compare_case({"scores": scores}, case, declare={"scores": "monotone"}).ok
    scores[-1] = -scores[-1]
    r = compare_case({"scores": scores}, case, declare={"scores": "monotone"})
    last = case.sizes["n_kv_heads"] - 1
    assert not r.ok and r.messages[0].startswith(f"scores (declared monotone): head {last}:"), r.messages


@pytest.mark.parametrize("dropped_col", [0, 1])
def test_per_token_thresholds_add_the_two_tokens_own_tolerances(dropped_col):
    """Kills: ``tol[d] + tol[e]`` replaced by twice one of them (or their maximum). With
    tolerances 0.1 and 0.25 the threshold is 0.35 whichever token is dropped: a gap of 0.3 is
    a tie (2 x 0.1 would reject it), a gap of 0.4 is not (2 x 0.25 would accept it)."""
    extra_col = 1 - dropped_col
    tolerance = np.array([[0.1, 0.25, 0.0]])
    positions = np.array([[0, 1, 2]])
    for gap, accepted in ((0.3, True), (0.4, False)):
        scores = np.array([[10.0, 10.0, 50.0]])
        scores[0, extra_col] -= gap
        r = compare_retention(np.array([[extra_col, 2]]), np.array([[dropped_col, 2]]), scores,
                              positions=positions, tolerance=tolerance)
        swap = r.ties[0] if accepted else r.swap
        assert r.ok is accepted and swap.threshold == pytest.approx(0.35, abs=1e-15)
        assert swap.gap == pytest.approx(gap, abs=1e-12)


def test_monotone_pairs_use_the_two_scores_own_tolerances():
    """Per-token thresholds in the ranking check too: reference 1 and 1.3 with tolerances 0.1
    and 0.25 are not ordered beyond tolerance (0.3 <= 0.35): a flip is allowed; with 1.4 it is not."""
    tol = np.array([[0.1, 0.25]])
    compared = np.ones((1, 2), dtype=bool)
    flipped = np.array([[2.0, 1.0]])
    assert compare_ranking(flipped, np.array([[1.0, 1.3]]), tol, np.array([[0, 1]]), compared) is None
    assert compare_ranking(flipped, np.array([[1.0, 1.4]]), tol, np.array([[0, 1]]), compared) is not None


# -- tolerance.py ---------------------------------------------------------------------------------------
def _finfo(name):
    """(eps, smallest normal) of a dtype, from torch.finfo / np.finfo (never from refkv)."""
    if name == "bfloat16":
        try:
            import torch
        except ImportError:  # bfloat16 is float32's top 16 bits: 7 of float32's 23 fraction bits stay
            f32 = np.finfo(np.float32)
            return 2.0 ** -(f32.nmant - 16), float(f32.smallest_normal)
        info = torch.finfo(torch.bfloat16)
        return float(info.eps), float(info.smallest_normal)
    info = np.finfo(np.dtype(name))
    return float(info.eps), float(info.smallest_normal)


@pytest.mark.parametrize("name", DTYPES)
def test_unit_roundoff_is_half_the_machine_epsilon(name):
    """Kills: bfloat16's unit roundoff 2**-8 -> 2**-7 (or any dtype's constant off by a bit)."""
    eps, _ = _finfo(name)
    assert UNIT_ROUNDOFF[name] == eps / 2


@pytest.mark.parametrize("name", DTYPES)
def test_smallest_subnormal_is_one_spacing_below_the_smallest_normal(name):
    eps, smallest_normal = _finfo(name)
    assert SMALLEST_SUBNORMAL[name] == smallest_normal * eps
    if name != "bfloat16":
        assert SMALLEST_SUBNORMAL[name] == float(np.finfo(np.dtype(name)).smallest_subnormal)


def test_backward_error_by_hand():
    """eta = u (2 + sum of ceil(log2 m)): lengths 16, 24, 48 give ceil(log2) 4, 5, 6."""
    assert backward_error("float32", (16, 24, 48)) == 2.0 ** -24 * (2 + 4 + 5 + 6)
    assert backward_error("bfloat16", ()) == 2.0 ** -8 * 2
    assert backward_error("float16", (1, 2, 3)) == 2.0 ** -11 * (2 + 0 + 1 + 2)


def _knorm_case():
    """A one-shot Knorm case whose keys each have one non-zero coordinate, exact in bfloat16 and
    float16: every perturbation of the derivation moves score ``-|x_i|`` by a known amount."""
    x = np.array([1.0, 1.5, 2.0, 3.0, 0.75, 5.0, 6.0, 0.5])  # exact in every dtype
    keys = np.zeros((1, 8, 4))
    keys[0, np.arange(8), np.arange(8) % 4] = x
    rng = np.random.default_rng(0)
    tokens = Tokens(rng.standard_normal((1, 8, 4)), keys, rng.standard_normal((1, 8, 4)))
    policy = policies.get("knorm")
    return as_vector_case(encode_case(policy, replay(policy, tokens, budget=5), case_id=3, comment="")), x


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_score_tolerance_by_hand(name):
    """Kills: the factor 2 on the random-sign deviation, and the eta |s_i| output term.

    Knorm scores ``-||k_i||``; with ``k_i = x_i e_j`` and ``x_i`` exact in the dtype, rounding
    moves nothing, the all-positive perturbation moves each score by ``eta |x_i|`` and every
    random-sign one by exactly ``eta |x_i|`` too. So ``tol_i = max(0, eta |x_i|, 2 eta |x_i|)
    + eta |s_i| + (eta / u) tiny / 2 = 3 eta |x_i| + (eta / u) tiny / 2``, with ``eta = u (2 +
    ceil(log2 d) + ceil(log2 n)) = 7 u`` (keys stored: d = 4, n = 8) and the float64 case's own
    rounding 0."""
    case, x = _knorm_case()
    assert reductions(case) == (4, 8)
    u = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[name]
    tiny = {"float32": 2.0 ** -149, "bfloat16": 2.0 ** -133, "float16": 2.0 ** -24}[name]
    eta = 7 * u
    expected = 3 * eta * x + 0.5 * 7 * tiny
    np.testing.assert_allclose(score_tolerance(case, name)[0], expected, rtol=1e-9)


def test_reductions_of_an_attention_case_by_hand():
    """TOVA stores the attention only: the candidate sums g B = 2 x 24 = 48 weights per KV head."""
    tova = policies.get("tova")
    tokens = random_tokens(np.random.default_rng(0), 4, 2, 8, 24, np.float32)
    case = as_vector_case(encode_case(tova, replay(tova, tokens, budget=10), case_id=1, comment=""))
    assert set(case.inputs) == {"positions", "query_positions", "attention"}
    assert reductions(case) == (48,)
    assert backward_error("bfloat16", reductions(case)) == 2.0 ** -8 * (2 + 6)


def test_tie_rule_meaningless_at_its_boundary():
    """Kills: ``<=`` -> ``<``: scores 0 and 1 with tolerances 0.5 each are exactly within
    tolerance (1 <= 0.5 + 0.5): any swap is a tie."""
    assert tie_rule_meaningless(np.array([0.0, 1.0]), np.array([0.5, 0.5]))
    assert not tie_rule_meaningless(np.array([0.0, 1.0]), np.array([0.5, 0.25]))
    assert not tie_rule_meaningless(np.array([0.0, 1.0, 2.0]), np.array([0.5, 0.5, 0.5]))  # 0 vs 2 is not
    assert not tie_rule_meaningless(np.array([1.0, 1.0]), np.array([9.0, 9.0]))  # nothing to tell apart
    assert not tie_rule_meaningless(np.array([1.0]), np.array([9.0]))
    # Only the candidates count (a protected outlier does not make the rule meaningful).
    assert tie_rule_meaningless(np.array([0.0, 1.0, 99.0]), np.array([0.5, 0.5, 0.0]),
                                np.array([True, True, False]))


# -- declare.py ---------------------------------------------------------------------------------------
def test_position_0_can_be_declared_pinned(snapkv_cases):
    """Kills: ``p >= 0`` -> ``p > 0`` (position 0, a sink, is the token most often padded)."""
    assert Declarations.parse({"pinned": [0, 3]}).pinned == (0, 3)
    assert Declarations.parse({"pinned": [0]}).pinned_mask(np.array([[0, 1], [0, 2]]), None).tolist() == [
        [True, False], [True, False]]
    key, value = parse_cli_declaration("pinned=0,1")
    assert Declarations.parse({key: value}).pinned == (0, 1)
    with pytest.raises(ValueError, match="declare pinned positions must be integers >= 0"):
        Declarations.parse({"pinned": [-1]})
    case = next(c for c in snapkv_cases if 0 in c.inputs["positions"][0])
    out = case.outputs
    padded = np.where(case.inputs["positions"] == 0, out["scores"].max() + 1, out["scores"])
    assert not compare_case({"scores": padded}, case).ok
    assert compare_case({"scores": padded, "kept": out["kept"]}, case, declare={"pinned": [0]}).ok


# -- walk.py ----------------------------------------------------------------------------------------
def _reference(before: bool):
    """3 blocks x 2 layers x 1 head, budget 2, blocks of 1 token; both layers evict at block 2
    (the last) among positions 0, 1, 2. Layer 0: 1.0 vs 1.0 + 1e-12 (a tie); layer 1: 1 vs 3."""
    kept = np.full((3, 2, 1, 2), -1)
    kept[0, :, 0, :1] = 0
    kept[1, :, 0] = [0, 1]
    kept[2, :, 0] = [0, 2]
    cands = np.full((3, 2, 1, 3), -1)
    cands[2, :, 0] = [0, 1, 2]
    scores = np.full((3, 2, 1, 3), np.nan)
    scores[2, 0, 0] = [5.0, 1.0, 1.0 + 1e-12]
    scores[2, 1, 0] = [5.0, 1.0, 3.0]
    arrays = {"kept": kept, "kept_count": np.array([[1, 1], [2, 2], [2, 2]]), "candidates": cands,
              "candidate_count": np.array([[0, 0], [0, 0], [3, 3]]), "scores": scores,
              "protected": np.zeros((3, 2, 1, 3), dtype=bool), "logits": np.array([0.5, -1.0])}
    manifest = {"tolerance": {"scores": {"rtol": 1e-9, "atol": 0.0}, "logits": {"rtol": 1e-9, "atol": 0.0}},
                "policy": {"evict_before_attention": before}, "dtype": "float64"}
    return arrays, manifest


def test_final_only_tie_in_the_last_block_before_attention_leaves_deeper_layers_and_logits_unchecked():
    """Kills: in the final-only walk, a last-block tie of a policy that evicts *before*
    attention not tainting the deeper layers (``tb < last or before`` -> ``tb < last``), or not
    the logits. Before attention, layer 0's choice at the last block changes what layer 1 of
    that block attends to, so layer 1's kept set and the logits cannot be judged."""
    ref, manifest = _reference(before=True)
    final = {"kept": np.array([[[0, 1]], [[0, 1]]]),    # layer 0: the tie; layer 1: 1 for 3 (beyond)
             "kept_count": np.array([2, 2]), "logits": np.array([9.0, 9.0])}
    r = compare_end_to_end(final, ref, manifest, final_only=True)
    assert r.ok, r.failure
    assert (r.decisions, r.unchecked, len(r.ties)) == (1, 1, 1)
    assert r.logits == "not compared (downstream of an accepted tie)"
    # After attention the same tie changes nothing downstream in its block: layer 1 is judged.
    ref, manifest = _reference(before=False)
    r = compare_end_to_end(final, ref, manifest, final_only=True)
    assert not r.ok and r.failure.startswith("final cache, layer 1, head 0 (reference eviction at block 2): "
                                             "candidate keeps position 1")
    # ... and with layer 1 right, the logits are compared (and here wrong).
    final["kept"][1, 0] = [0, 2]
    r = compare_end_to_end(final, ref, manifest, final_only=True)
    assert not r.ok and r.failure.startswith("logits:")


# -- checker.py ------------------------------------------------------------------------------------
def test_a_full_candidate_file_passes_at_bfloat16_on_the_float32_cases(tmp_path):
    """Kills: the candidate's ids checked against the *filtered* reference (a bfloat16 check
    compares the float32 cases only; the candidate's float64 cases are the reference's too,
    not unknown ids)."""
    reference = load_cases(GOLDEN, policy="keydiff")
    assert {c.dtype for c in reference} == {"float32", "float64"}
    outputs = {c.id: {k: c.outputs[k] for k in ("scores", "protected", "kept")} for c in reference}
    write_json(tmp_path / "vectors" / "keydiff.json", candidate_document("keydiff", outputs))
    report = check_suite(tmp_path, GOLDEN, policies=["keydiff"], kinds=("vectors",), dtype="bfloat16")
    assert report.ok, report.format()
    n32 = sum(c.dtype == "float32" for c in reference)
    assert report.files[0].summary == f"{n32} cases: {n32} passed"
    # An id the reference does not have at all is still refused.
    outputs[10_000] = outputs[reference[0].id]
    write_json(tmp_path / "vectors" / "keydiff.json", candidate_document("keydiff", outputs))
    report = check_suite(tmp_path, GOLDEN, policies=["keydiff"], kinds=("vectors",), dtype="bfloat16")
    assert not report.ok and "candidate has case ids the reference does not: [10000]" in report.format()

