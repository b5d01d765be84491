"""Compression schedules (issue 22 A, B): the driver, the schedule goldens, and the round checker."""

import json
import pathlib

import numpy as np
import pytest

from refkv import Engine, policies
from refkv.cli import main
from refkv.model import builtin_model
from refkv.oracle.endtoend import fingerprints, is_schedule, read_end_to_end, write_end_to_end
from refkv.oracle.io import read_json
from refkv.oracle.models import decode_tokens, prompt_tokens
from refkv.oracle.recorder import run_schedule_golden
from refkv.oracle.rounds import compare_schedule
from refkv.policies.keydiff import KeyDiff
from refkv.schedule import Schedule, run_schedule

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
SCHEDULE_FILES = sorted(p for p in (GOLDEN / "e2e").glob("*/sched-*.json"))
#: Policies whose heads (AdaKV) or layers (PyramidKV) keep uneven counts: a round keeps the
#: layer's total, not N in every head, so the per-head rule below does not apply to them.
UNEVEN = {"adakv", "pyramidkv"}
EVEN_FILES = [p for p in SCHEDULE_FILES if p.parent.name not in UNEVEN]
UNEVEN_FILES = [p for p in SCHEDULE_FILES if p.parent.name in UNEVEN]


# -- the driver ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"interval": 0, "budget": 4}, "interval must be"),
    ({"budget": None}, "budget must be an integer >= 1 for rule='interval'"),
    ({"rule": "ratio", "ratio": 1.0}, r"ratio must be a number in \[0, 1\)"),
    ({"rule": "ratio", "ratio": 0.5, "budget": 4}, "budget must be None for rule='ratio'"),
    ({"rule": "every", "budget": 4}, "rule must be one of interval, ratio"),
    ({"block_size": 0, "budget": 4}, "block_size must be"),
])
def test_bad_schedules_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        Schedule(**kwargs)
    assert "\n" not in str(err.value)


def _sizes(schedule, prompt_length=20, policy="keydiff"):
    """Cache length after every forward call, and the rounds."""
    model = builtin_model(seed=0, dtype=np.float64)
    engine = Engine(model, policy)
    sizes = []
    prompt = prompt_tokens(1, prompt_length, model.config.vocab_size)
    new = decode_tokens(2, schedule.new_tokens, model.config.vocab_size)
    _, rounds = run_schedule(engine, prompt, new, schedule, on_step=lambda s, r: sizes.append(len(engine.caches[0])))
    return sizes, rounds, engine


def test_decoding_press_semantics_every_k_steps_down_to_n():
    """kvpress DecodingPress: nothing at prefill; the K-th decoding step compresses to N, the count restarts."""
    sizes, rounds, engine = _sizes(Schedule(None, None, 4, 16, new_tokens=13))
    # one-shot prefill of 20 is left as is; +1 per token; at tokens 4, 8, 12 down to 16
    assert sizes == [20, 21, 22, 23, 16, 17, 18, 19, 16, 17, 18, 19, 16, 17]
    assert [(r.step, r.phase, r.budget, r.position) for r in rounds] == [
        (4, "decode", 16, 24), (8, "decode", 16, 28), (12, "decode", 16, 32)]
    assert engine.budget is None  # the driver restores it


def test_a_round_with_a_cache_within_n_evicts_nothing_and_restarts_the_count():
    sizes, rounds, _ = _sizes(Schedule(None, None, 3, 40, new_tokens=12))
    assert sizes == [20 + i for i in range(13)]
    assert len(rounds) == 4  # rounds at steps 3, 6, 9, 12: scheduled, nothing to evict
    sizes, _, _ = _sizes(Schedule(None, None, 3, 22, new_tokens=6))
    assert sizes == [20, 21, 22, 22, 23, 24, 22]  # step 3 (23 tokens) evicts to 22; step 6 too


def test_ratio_rule_keeps_a_fraction_of_the_tokens_seen():
    """CompressionRatioDecodingPress: max(1, int(seen * (1 - ratio))), seen counting the current token."""
    sizes, rounds, _ = _sizes(Schedule(None, None, 4, None, "ratio", 0.5, 12))
    assert [r.budget for r in rounds] == [12, 14, 16]
    assert sizes[4] == 12 and sizes[8] == 14 and sizes[12] == 16
    assert Schedule(rule="ratio", ratio=0.99).target(10) == 1


def test_k1_is_the_engines_own_rule():
    """Compressing every token down to N is what the engine does at a budget: same caches, same logits."""
    model = builtin_model(seed=0, dtype=np.float64)
    prompt = prompt_tokens(1, 24, model.config.vocab_size)
    new = decode_tokens(2, 5, model.config.vocab_size)
    plain = Engine(model, "h2o", 12)
    plain.prefill(prompt, 8)
    for t in new:
        logits = plain.forward([int(t)])
    driven = Engine(model, "h2o")
    driven_logits, _ = run_schedule(driven, prompt, new, Schedule(8, 12, 1, 12, new_tokens=5))
    assert np.array_equal(logits, driven_logits)
    for a, b in zip(plain.caches, driven.caches):
        assert np.array_equal(a.positions, b.positions)


def test_new_tokens_must_match_the_schedule():
    engine = Engine(builtin_model(seed=0), "keydiff")
    with pytest.raises(ValueError, match=r"new_tokens must hold schedule\.new_tokens = 3"):
        run_schedule(engine, [1, 2, 3], [4, 5], Schedule(budget=2, new_tokens=3))


# -- the goldens --------------------------------------------------------------------------------------------
def test_the_suite_has_schedule_goldens_for_every_policy_that_can_run_so():
    index = read_json(GOLDEN / "suite.json")
    scheduled = {e["policy"] for e in index["files"] if e.get("mode") == "schedule"}
    assert set(index["policies"]) - scheduled == {"full"}  # full never evicts
    intervals, prefills = set(), set()
    for path in SCHEDULE_FILES:
        m = read_end_to_end(path).manifest
        decode_rounds = [r for r in m["rounds"] if r["phase"] == "decode"]
        assert len(decode_rounds) >= 3, path
        intervals.add(m["schedule"]["interval"])
        prefills.add(m["schedule"]["block_size"] is None)
    assert {1, 4, 16} <= intervals and prefills == {True, False}


@pytest.mark.parametrize("path", UNEVEN_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_an_uneven_round_keeps_its_layers_total(path):
    """AdaKV and PyramidKV: after a round that evicted, the layer's heads hold together the
    layer's budget times Hkv real tokens (-1 pads the shorter heads), no head holds a
    position twice, and every kept position was offered or held before."""
    g = read_end_to_end(path)
    a, m = g.arrays, g.manifest
    policy = policies.get(m["policy"]["name"], **m["policy"]["params"])
    n_layers, hkv = a["kept"].shape[1], a["kept"].shape[2]
    assert m["policy"]["evict_before_attention"] is False
    uneven_seen = False
    for r, info in enumerate(m["rounds"]):
        for l in range(n_layers):
            if a["candidate_count"][r, l] == 0:
                continue
            rows = a["kept"][r, l, :, :a["kept_count"][r, l]]
            real = [row[row >= 0] for row in rows]
            assert all(len(np.unique(x)) == len(x) for x in real)
            assert sum(len(x) for x in real) == policy.layer_budget(info["budget"], l, n_layers) * hkv, (r, l)
            uneven_seen |= len({len(x) for x in real}) > 1 or policy.layer_budget(info["budget"], l, n_layers) != \
                info["budget"]
    assert uneven_seen, "the golden never exercises an uneven budget"


@pytest.mark.parametrize("path", EVEN_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_round_follows_from_its_recorded_scores(path):
    """Each round keeps its budget's best candidates by the recorded scores (Python's sorted, not refkv's)."""
    g = read_end_to_end(path)
    a, m = g.arrays, g.manifest
    assert is_schedule(m) and m["schema_version"] == 2
    before = m["policy"]["evict_before_attention"]
    for r, info in enumerate(m["rounds"]):
        for l in range(a["kept"].shape[1]):
            c = a["candidate_count"][r, l]
            k = a["kept_count"][r, l]
            if c == 0:
                assert k <= info["budget"]
                continue
            # before attention a step's tokens arrive after the eviction: N minus the step's size
            size = 1 if info["phase"] == "decode" else info["position"] - (m["rounds"][r - 1]["position"] if r else 0)
            n_keep = info["budget"] - size if before else info["budget"]
            for h in range(a["kept"].shape[2]):
                cand, s, p = a["candidates"][r, l, h, :c], a["scores"][r, l, h, :c], a["protected"][r, l, h, :c]
                order = sorted(range(c), key=lambda i: (not p[i], -s[i], -cand[i]))
                expected = sorted(int(cand[i]) for i in order[:n_keep])
                kept = a["kept"][r, l, h, :k]
                assert kept[np.isin(kept, cand)].tolist() == expected, (r, l, h)


def test_schedule_golden_replays_exactly():
    path = GOLDEN / "e2e" / "keydiff" / "sched-oneshot-K4-N16-float64.json"
    g = read_end_to_end(path)
    sched = Schedule.from_dict(g.manifest["schedule"])
    _, arrays = run_schedule_golden(policies.get("keydiff"), sched, prompt_length=g.manifest["prompt"]["length"])
    for name, a in g.arrays.items():
        np.testing.assert_array_equal(arrays[name], a, err_msg=name)


# -- the checker -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keydiff_golden():
    sched = Schedule(None, None, 4, 16, new_tokens=12)
    m, a = run_schedule_golden(policies.get("keydiff"), sched)
    return m, a, sched


def _candidate_rows(policy, sched, dtype="float64", permute=False):
    """A candidate's arrays from refkv itself: rows (optionally permuted), their keys and values."""
    model = builtin_model(seed=0, dtype=np.dtype(dtype))
    engine = Engine(model, policy)
    prompt = prompt_tokens(1, 24, model.config.vocab_size)
    new = decode_tokens(2, sched.new_tokens, model.config.vocab_size)
    rows, keys, values, counts = [], [], [], []
    rng = np.random.default_rng(5)

    def on_step(step, rnd):
        if rnd is None:
            return
        per = []
        for c in engine.caches:
            order = rng.permutation(c.positions.shape[1]) if permute else np.arange(c.positions.shape[1])
            per.append((c.positions[:, order], c.keys[:, order], c.values[:, order]))
        rows.append([p for p, _, _ in per])
        keys.append([k for _, k, _ in per])
        values.append([v for _, _, v in per])
        counts.append([p.shape[1] for p, _, _ in per])

    logits, _ = run_schedule(engine, prompt, new, sched, on_step=on_step)
    return {"kept": np.array(rows), "kept_count": np.array(counts), "row_keys": np.array(keys),
            "row_values": np.array(values), "logits": logits}


def test_refkv_itself_passes_and_a_permuted_cache_passes_everywhere(keydiff_golden):
    m, a, sched = keydiff_golden
    for permute in (False, True):
        cand = _candidate_rows(policies.get("keydiff"), sched, permute=permute)
        res = compare_schedule(cand, a, m)
        assert res.ok, res.failure
        assert res.decisions == 3 * 4 and res.rows_checked == 3 * 4 * 2 * 16
        assert res.logits.startswith("max |diff|")


def test_a_float32_candidate_passes_the_float64_golden(keydiff_golden):
    m, a, sched = keydiff_golden
    cand = _candidate_rows(policies.get("keydiff"), sched, dtype="float32", permute=True)
    res = compare_schedule(cand, a, m, dtype="float32")
    assert res.ok, res.failure


def test_a_row_holding_another_positions_key_is_reported_as_such(keydiff_golden):
    m, a, sched = keydiff_golden
    cand = _candidate_rows(policies.get("keydiff"), sched)
    cand["row_keys"][1, 2, 1, [3, 7]] = cand["row_keys"][1, 2, 1, [7, 3]]  # rows 3 and 7 hold each other's key
    res = compare_schedule(cand, a, m)
    assert not res.ok and res.first_round == 1
    assert "row holds the wrong key" in res.failure
    assert "round 1, layer 2, head 1: row 3 claims position" in res.failure
    assert "1 more such rows in this head" in res.failure
    first = cand["kept"][1, 2, 1, 7]
    assert f"it matches the reference's key of position {first}" in res.failure
    cand = _candidate_rows(policies.get("keydiff"), sched)
    cand["row_values"][0, 0, 0, 0] = cand["row_values"][0, 0, 0, 1]
    res = compare_schedule(cand, a, m)
    assert "row holds the wrong value" in res.failure


class LateKeyDiff(KeyDiff):
    """A press with a defect from the second compression on: it then keeps the oldest tokens."""

    calls: dict

    def score(self, view):
        self.calls = getattr(self, "calls", {})
        self.calls[view.layer] = self.calls.get(view.layer, 0) + 1
        s = super().score(view)
        return s if self.calls[view.layer] == 1 else -view.positions.astype(np.float64)


def test_a_defect_from_the_second_round_on_is_located_at_that_round(keydiff_golden):
    m, a, sched = keydiff_golden
    cand = _candidate_rows(LateKeyDiff(), sched)
    res = compare_schedule(cand, a, m)
    assert not res.ok and res.first_round == 1
    assert res.failure.startswith("first diverged at round 1 (decode step 8, 32 tokens seen, budget 16): "
                                  "kept-set difference beyond ties")
    assert "more divergence(s):" in res.failure and "round 1: " in res.failure
    # every layer of round 1 diverged; round 2 is downstream of them
    assert {d.layer for d in res.divergences} == {0, 1, 2, 3} and res.unchecked == 4


def test_protected_positions_evicted_are_named():
    sched = Schedule(None, None, 4, 16, new_tokens=12)
    m, a = run_schedule_golden(policies.get("sink"), sched)
    cand = {"kept": a["kept"].copy(), "kept_count": a["kept_count"], "logits": a["logits"]}
    c = a["candidate_count"][0, 0]
    dropped = np.setdiff1d(a["candidates"][0, 0, 0, :c], a["kept"][0, 0, 0])
    cand["kept"][0, 0, 0, 0] = dropped[0]  # sink position 0 replaced by an evicted middle token
    res = compare_schedule(cand, a, m)
    assert res.first_round == 0 and "protected position evicted" in res.failure
    assert "candidate evicts position 0, which the reference protects" in res.failure


def test_candidate_scores_are_compared_where_given(keydiff_golden):
    m, a, _ = keydiff_golden
    cand = {"kept": a["kept"], "kept_count": a["kept_count"], "logits": a["logits"],
            "scores": a["scores"].copy(), "score_positions": a["candidates"]}
    res = compare_schedule(cand, a, m)
    assert res.ok and res.scores_checked == int((a["candidates"] >= 0).sum())
    cand["scores"][2, 3, 0, 5] *= 1 + 1e-5
    res = compare_schedule(cand, a, m)
    assert res.first_round == 2 and "score beyond tolerance" in res.failure
    assert "round 2, layer 3, head 0: position" in res.failure
    res = compare_schedule(cand, a, m, declare={"kept_only": True})
    assert res.ok and any("not compared (declared kept_only)" in n for n in res.notes)


def test_golden_check_cli_reads_schedule_goldens(tmp_path, capsys, keydiff_golden):
    m, a, sched = keydiff_golden
    ref = tmp_path / "ref" / "e2e" / "keydiff"
    ref.mkdir(parents=True)
    write_end_to_end(ref / "sched.json", m, a)
    good = tmp_path / "good" / "e2e" / "keydiff"
    good.mkdir(parents=True)
    write_end_to_end(good / "sched.json", {"schema": m["schema"], "schema_version": 2, "refkv_version": "x",
                                           "numpy_version": "y"},
                     _candidate_rows(policies.get("keydiff"), sched, permute=True))
    assert main(["golden", "check", str(tmp_path / "good"), "--against", str(tmp_path / "ref")]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out
    bad = tmp_path / "bad" / "e2e" / "keydiff"
    bad.mkdir(parents=True)
    write_end_to_end(bad / "sched.json", {"schema": m["schema"], "schema_version": 2, "refkv_version": "x",
                                          "numpy_version": "y"}, _candidate_rows(LateKeyDiff(), sched))
    assert main(["golden", "check", str(tmp_path / "bad"), "--against", str(tmp_path / "ref")]) == 1
    out = capsys.readouterr().out
    assert "first diverged at round 1" in out
    assert main(["golden", "check", str(tmp_path / "good"), "--against", str(tmp_path / "ref"), "--final-only"]) == 1
    out = capsys.readouterr().out
    assert "no final-only form" in out and "FAIL (nothing was compared" in out


def test_a_reader_without_schedules_would_refuse_them():
    """Schedule goldens are schema version 2: arrays indexed by round must not be read as blocks."""
    doc = json.loads(SCHEDULE_FILES[0].read_text())
    assert doc["schema_version"] == 2 and "schedule" in doc and "n_blocks" not in doc


def test_fingerprint_separates_keys():
    keys = np.random.default_rng(0).standard_normal((40, 16))
    prints = fingerprints(keys, 16)
    gaps = np.abs(prints[:, None] - prints[None, :])[~np.eye(40, dtype=bool)]
    assert gaps.min() > 1e-4  # far above every tolerance


def _move_between_heads(a, r=0, l=0):
    """The reference's own arrays with one token moved across heads at (round r, layer l): the
    head keeping the layer's lowest-scored kept token (not protected) evicts it, another head keeps its
    highest-scored evicted candidate instead (the layer's total unchanged)."""
    kept, counts = a["kept"].copy(), a["kept_count"].copy()
    c = int(a["candidate_count"][r, l])
    hkv = kept.shape[2]
    held = [(float(a["scores"][r, l, h, j]), h, int(p)) for h in range(hkv)
            for j, p in enumerate(a["candidates"][r, l, h, :c])
            if p >= 0 and p in kept[r, l, h] and not a["protected"][r, l, h, j]]
    out = [(float(a["scores"][r, l, h, j]), h, int(p)) for h in range(hkv)
           for j, p in enumerate(a["candidates"][r, l, h, :c]) if p >= 0 and p not in kept[r, l, h]]
    _, h_out, p_out = min(held)
    _, h_in, p_in = max(x for x in out if x[1] != h_out)
    kept = np.concatenate([kept, np.full((*kept.shape[:3], 1), -1, dtype=kept.dtype)], axis=3)
    row = kept[r, l, h_out]
    row[:] = np.concatenate([row[row != p_out], [-1]])
    row = kept[r, l, h_in]
    n_in = int((row >= 0).sum())
    row[n_in] = p_in
    counts[r, l] = max(counts[r, l], n_in + 1)
    return {"kept": kept, "kept_count": counts, "logits": a["logits"]}, (h_out, p_out), (h_in, p_in)


def test_a_token_moving_between_heads_is_compared_with_the_heads_pooled():
    """AdaKV allocates a layer's budget across its heads: a token moving from one head to another
    is a tie when the two reference scores are within tolerance, and named as such; beyond it,
    a kept-set difference naming both heads (not a per-head count difference)."""
    adakv = policies.get("adakv", base="snapkv", base_params={"window": 4})
    m, a = run_schedule_golden(adakv, Schedule(None, 12, 1, 12, new_tokens=0))
    cand, (h_out, p_out), (h_in, p_in) = _move_between_heads(a)
    assert h_out != h_in
    tie = compare_schedule(cand, a, m, tolerance_factor=1e8)
    assert tie.ok, tie.failure
    moved = f"heads pooled, kept in head {h_in}, evicted from head {h_out}"
    assert [s.where.split(" (")[0] for s in tie.ties] == [moved]
    assert (tie.ties[0].kept_position, tie.ties[0].dropped_position) == (p_in, p_out)
    fail = compare_schedule(cand, a, m, tolerance_factor=1e-9)
    assert not fail.ok
    assert [d.kind for d in fail.divergences] == ["kept-set difference beyond ties"]
    assert f"kept in head {h_in}, evicted from head {h_out}" in fail.failure
    strict = compare_schedule(cand, a, m, tolerance_factor=1e8, strict_ties=True)
    assert not strict.ok and "strict ties" in strict.failure
    # the same move in a policy whose heads keep their own budgets is a count difference per head
    m_even, a_even = run_schedule_golden(policies.get("keydiff"), Schedule(None, 12, 1, 12, new_tokens=0))
    moved, _, _ = _move_between_heads(a_even)
    even = compare_schedule(moved, a_even, m_even, tolerance_factor=1e8)
    assert not even.ok and even.divergences[0].kind == "kept count differs"
