"""Ada-KV (Feng et al. 2024, Algorithm 1 with the safeguard): head-adaptive budgets over a base score."""

import doctest
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refkv.attention import attend
from refkv.cache import EMPTY, LayerCache
from refkv.engine import Engine
from refkv.model import TINY
from refkv.oracle.synthetic import random_tokens, replay
from refkv.policies import get
from refkv.policies.adakv import AdaKV, allocate, head_view, safeguard

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies" / "adakv.rst"


# -- an independent recomputation: Python sorts over (head, column) pairs --------------------------
def expected_kept(scores, positions, protected, keep, alpha, form="paper"):
    """Per head, the set of kept columns: forced tokens, then the joint top of the layer."""
    hkv, n = scores.shape
    if form == "paper":
        sums = scores.sum(axis=1, keepdims=True)
        scores = np.where(sums > 0, scores / np.where(sums > 0, sums, 1), 1.0 / n)
    floor = int(alpha * keep + 1e-12)
    if form == "kvpress" and alpha > 0 and keep > 0:
        floor = max(floor, 1)
    forced = set()
    for h in range(hkv):
        own = sorted(range(n), key=lambda c: (bool(protected[h, c]), scores[h, c], positions[h, c]), reverse=True)
        count = max(floor, int(protected[h].sum()))
        forced |= {(h, c) for c in own[:count]}
    pairs = sorted(((h, c) for h in range(hkv) for c in range(n)),
                   key=lambda hc: ((hc in forced), scores[hc], positions[hc], -hc[0]), reverse=True)
    chosen = pairs[:keep * hkv]
    return [sorted(c for h2, c in chosen if h2 == h) for h in range(hkv)]


def as_sets(kept):
    return [sorted(np.asarray(row).tolist()) for row in kept]


def one_shot_view(policy, seed, t=20, budget=6, h=4, hkv=2, d=8, layer=0, n_layers=1):
    tokens = random_tokens(np.random.default_rng(seed), h, hkv, d, t)
    return replay(policy, tokens, budget=budget, layer=layer, n_layers=n_layers)


@pytest.mark.parametrize("spec", [dict(base="tova"), dict(base="h2o", alpha=0.5),
                                  dict(base="snapkv", base_params={"window": 2, "kernel": 3}),
                                  dict(base="keydiff", form="kvpress"), dict(base="tova", form="kvpress", alpha=0.0)])
@pytest.mark.parametrize("seed", range(4))
def test_kept_set_is_the_joint_top_with_the_floor(spec, seed):
    policy = get("adakv", **spec)
    view = one_shot_view(policy, seed)
    base = policy.base_policy
    want = expected_kept(np.asarray(base.score(view), dtype=np.float64), view.positions, base.protected(view),
                         view.keep, policy.alpha, policy.form)
    got = as_sets(policy.keep_indices(view))
    assert got == want
    assert sum(len(row) for row in got) == view.keep * view.n_kv_heads


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_allocate_properties(data):
    hkv = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 9))
    lengths = np.array(data.draw(st.lists(st.integers(0, n), min_size=hkv, max_size=hkv)))
    lengths[0] = n  # the widest head has no empty slot
    scores = np.array(data.draw(st.lists(st.integers(0, 5), min_size=hkv * n, max_size=hkv * n)),
                      dtype=float).reshape(hkv, n)  # small integers: many ties
    positions = np.tile(np.arange(n), (hkv, 1))
    keep = data.draw(st.integers(0, n))
    floor = data.draw(st.integers(0, keep))
    protected = np.zeros((hkv, n), dtype=bool)
    counts = allocate(scores, positions, protected, lengths, keep * hkv, floor)
    assert counts.sum() == min(keep * hkv, lengths.sum())
    assert np.all(counts <= lengths)
    assert np.all(counts >= np.minimum(floor, lengths))
    # every kept (non-forced) token scores at least as high as every evicted one of another head
    kept_min = [scores[h, :lengths[h]][np.argsort(-scores[h, :lengths[h]], kind="stable")][:c] for h, c in
                enumerate(counts)]
    for h in range(hkv):
        evicted = np.sort(scores[h, :lengths[h]])[::-1][counts[h]:]
        for g in range(hkv):
            extra = kept_min[g][min(floor, counts[g]):]
            if evicted.size and extra.size:
                assert extra.min() >= evicted.max()


@given(st.integers(1, 4), st.integers(2, 10), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_identical_heads_reduce_to_uniform(hkv, n, seed):
    rng = np.random.default_rng(seed)
    row = rng.integers(0, 4, n).astype(float)
    scores = np.tile(row, (hkv, 1))
    keep = int(rng.integers(1, n + 1))
    counts = allocate(scores, np.tile(np.arange(n), (hkv, 1)), np.zeros((hkv, n), bool), np.full(hkv, n),
                      keep * hkv, 0)
    np.testing.assert_array_equal(counts, np.full(hkv, keep))


@pytest.mark.parametrize("seed", range(3))
def test_identical_heads_keep_what_the_base_keeps(seed):
    tokens = random_tokens(np.random.default_rng(seed), 4, 2, 8, 16)
    same = type(tokens)(queries=np.concatenate([tokens.queries[:2]] * 2), keys=np.stack([tokens.keys[0]] * 2),
                        values=np.stack([tokens.values[0]] * 2))
    policy = get("adakv", base="tova")
    view = replay(policy, same, budget=5)
    np.testing.assert_array_equal(policy.keep_indices(view), policy.base_policy.keep_indices(view))


def test_alpha_one_is_uniform():
    policy = get("adakv", base="tova", alpha=1.0)
    view = one_shot_view(policy, 7)
    np.testing.assert_array_equal(policy.keep_indices(view), policy.base_policy.keep_indices(view))


def test_safeguard():
    assert safeguard(10, 0.2) == 2 and safeguard(4, 0.2) == 0 and safeguard(4, 0.2, "kvpress") == 1
    assert safeguard(0, 0.2, "kvpress") == 0 and safeguard(4, 0.0, "kvpress") == 0 and safeguard(7, 1.0) == 7


def test_kvpress_form_matches_adakvpress():
    """kvpress's AdaKVPress, given the same scores, masks exactly the tokens refkv evicts."""
    torch = pytest.importorskip("torch")
    from kvpress.presses.adakv_press import AdaKVPress
    from kvpress.presses.scorer_press import ScorerPress

    for seed in range(5):
        policy = get("adakv", base="tova", form="kvpress")
        view = one_shot_view(policy, seed, t=32, budget=8)  # a ratio exact in binary
        scores = np.asarray(policy.base_policy.score(view), dtype=np.float64)

        class Given(ScorerPress):
            given = torch.tensor(scores)[None]

            def score(self, module, hidden_states, keys, values, attentions, kwargs):
                return self.given.clone()

        press = AdaKVPress(Given(compression_ratio=1 - view.keep / view.n))
        module = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
        press.compress(module, None, torch.zeros(1, 2, view.n, 8), torch.zeros(1, 2, view.n, 8), None, {})
        _, heads, columns = module.masked_key_indices
        masked = [sorted(columns[heads == h].tolist()) for h in range(2)]
        kept = as_sets(policy.keep_indices(view))
        assert [sorted(set(range(view.n)) - set(k)) for k in kept] == masked


# -- the engine with uneven heads ---------------------------------------------------------------
def test_engine_keeps_the_layer_total_and_empty_slots_change_nothing(tiny64):
    policy = get("adakv", base="h2o", base_params={"recent": 2})  # stateful, with room to move
    engine = Engine(tiny64, policy, 12, record=True)
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, 60)
    engine.prefill(prompt, 5)
    assert any(cache.uneven for cache in engine.caches), "expected some layer to allocate unevenly"
    for cache in engine.caches:
        assert cache.total == 12 * cache.n_kv_heads
        for row, length in zip(cache.positions, cache.head_lengths):
            assert np.all(row[length:] == EMPTY) and np.all(np.diff(row[:length]) > 0)
    # attention over a cache with empty slots == each head over its real tokens alone
    cache = next(c for c in engine.caches if c.uneven)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((TINY.n_heads, 3, TINY.d_head))
    qpos = np.arange(cache.next_position, cache.next_position + 3)
    out, _ = attend(q, cache.keys, cache.values, qpos, cache.positions)
    g = TINY.n_heads // TINY.n_kv_heads
    for h, length in enumerate(cache.head_lengths):
        alone, _ = attend(q[h * g:(h + 1) * g], cache.keys[h:h + 1, :length], cache.values[h:h + 1, :length], qpos,
                          cache.positions[h:h + 1, :length])
        np.testing.assert_allclose(out[h * g:(h + 1) * g], alone, rtol=1e-12, atol=1e-14)
    # the trace marks empty slots with -1, and its kept sets are the caches'
    last = engine.trace.kept[-1]
    for cache, recorded in zip(engine.caches, last):
        np.testing.assert_array_equal(recorded, cache.positions_or(-1))
    event = engine.trace.evictions[-1]
    counts = (event.kept >= 0).sum(axis=1)
    np.testing.assert_array_equal(counts, engine.caches[event.layer].head_lengths)
    assert np.all(event.kept_positions[event.kept < 0] == -1)


def test_uneven_view_scores_each_head_alone(tiny64):
    """With empty slots the base sees each head's real tokens only (head_view)."""
    policy = get("adakv", base="keydiff", form="kvpress")
    engine = Engine(tiny64, policy, 10, record="views")
    engine.prefill(np.random.default_rng(3).integers(0, TINY.vocab_size, 40), 4)
    views = [e.view for e in engine.trace.evictions if (e.view.positions == EMPTY).any()]
    assert views, "expected an eviction over uneven heads"
    view = views[-1]
    scores = policy.score(view)
    for h in range(view.n_kv_heads):
        alone = head_view(view, h)
        n_h = alone.n
        np.testing.assert_array_equal(scores[h, :n_h], policy.base_policy.score(alone)[0])
        assert np.all(scores[h, n_h:] == -np.inf)


def test_cache_uneven_keep_and_append_copy_on_write():
    cache = LayerCache(2, 1, np.float64, {})
    cache.append(np.arange(10.0).reshape(2, 5, 1), np.arange(10.0).reshape(2, 5, 1))
    before = cache.keys
    cache.keep([np.array([0, 2, 4]), np.array([1])])
    np.testing.assert_array_equal(before[:, :, 0], [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])  # untouched
    np.testing.assert_array_equal(cache.head_lengths, [3, 1])
    np.testing.assert_array_equal(cache.positions, [[0, 2, 4], [1, EMPTY, EMPTY]])
    np.testing.assert_array_equal(cache.keys[1, 1:], 0)
    kept = cache.positions
    cache.append(np.full((2, 2, 1), 7.0), np.full((2, 2, 1), 7.0))
    np.testing.assert_array_equal(kept, [[0, 2, 4], [1, EMPTY, EMPTY]])
    np.testing.assert_array_equal(cache.positions, [[0, 2, 4, 5, 6], [1, 5, 6, EMPTY, EMPTY]])
    np.testing.assert_array_equal(cache.keys[:, :, 0], [[0, 2, 4, 7, 7], [6, 7, 7, 0, 0]])
    with pytest.raises(ValueError, match="head 1: indices must name real tokens"):
        cache.keep([np.array([0]), np.array([3])])
    cache.keep([np.array([3, 4]), np.array([1, 2])])  # even again
    assert not cache.uneven and len(cache) == 2
    np.testing.assert_array_equal(cache.positions, [[5, 6], [5, 6]])


@pytest.mark.parametrize("params, match", [
    (dict(alpha=1.5), "alpha"), (dict(form="torch"), "form"), (dict(base="keydiff"), "signed scores"),
    (dict(base="hashevict"), "evicts before attention"), (dict(base="full"), "never evicts"),
    (dict(base="adakv"), "not allowed"), (dict(base=3), "base must be"),
])
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        get("adakv", **params)


def test_params_rebuild():
    policy = AdaKV(base=get("snapkv", window=4, kernel=3), alpha=0.3)
    again = get("adakv", **policy.params())
    assert again.params() == policy.params() and again.base_policy == policy.base_policy


def test_page_worked_example():
    result = doctest.testfile(str(PAGE), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE,
                              raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


# -- the golden format and the checker with uneven heads ------------------------------------------
def uneven_case(seed=0, **spec):
    """An encoded block-mode AdaKV case whose heads keep different counts (empty slots among the candidates)."""
    from refkv.oracle.encode import encode_case

    policy = get("adakv", **(spec or {"base": "snapkv", "base_params": {"window": 2, "kernel": 3}}))
    for s in range(seed, seed + 50):
        tokens = random_tokens(np.random.default_rng(s), 4, 2, 4, 20)
        view = replay(policy, tokens, block_size=3, budget=6, layer=1, n_layers=4)
        case = encode_case(policy, view, case_id=1, comment="uneven")
        if "head_budgets" in case and (view.positions == EMPTY).any():
            return policy, view, case
    raise AssertionError("no uneven case found")


def test_uneven_case_round_trip_through_a_file(tmp_path):
    from refkv.oracle.encode import vectors_document
    from refkv.oracle.io import write_json
    from refkv.oracle.vectors import read_vectors

    policy, view, case = uneven_case()
    assert case["layer_total"] == sum(case["head_budgets"]) == view.keep * view.n_kv_heads
    assert -1 in case["inputs"]["positions"]["data"]  # empty slots are -1 in a file
    path = tmp_path / "adakv.json"
    write_json(path, vectors_document("adakv", [(case.params, [case])]))
    back = read_vectors(path).cases[0]
    assert back.head_budgets == tuple(case["head_budgets"])
    rebuilt = back.view()
    np.testing.assert_array_equal(rebuilt.positions, view.positions)  # EMPTY again in memory
    kept = policy.keep_indices(rebuilt)
    assert [len(r) for r in kept] == list(back.head_budgets)
    from refkv.oracle.cases import compare_case

    assert compare_case({"kept": kept, "scores": policy.score(rebuilt)}, back).ok
    padded = back.outputs["kept"]  # the -1 padded array is accepted too
    assert compare_case({"kept": padded}, back).ok
    positions = [view.positions[h][np.asarray(r)] for h, r in enumerate(kept)]
    assert compare_case({"kept": positions}, back, kept_as="positions").ok


def test_uneven_case_rebuilds_each_heads_block():
    """After attention the block is each head's last B real tokens, not the last B columns."""
    from refkv.oracle.vectors import as_vector_case

    policy, view, case = uneven_case(base="keydiff", form="kvpress")  # reads keys: they are stored
    rebuilt = as_vector_case(case).view()
    np.testing.assert_array_equal(rebuilt.block_keys, view.block_keys)
    np.testing.assert_array_equal(policy.score(rebuilt), policy.score(view))


def test_uneven_case_file_is_validated(tmp_path):
    import copy

    from refkv.oracle.encode import vectors_document
    from refkv.oracle.io import write_json
    from refkv.oracle.vectors import read_vectors

    _, _, case = uneven_case()
    bad_total = copy.deepcopy(dict(case))
    bad_total["layer_total"] += 1
    write_json(tmp_path / "a.json", vectors_document("adakv", [(case.params, [bad_total])]))
    with pytest.raises(ValueError, match=r"layer_total is .* but head_budgets sum to"):
        read_vectors(tmp_path / "a.json")
    bad_row = copy.deepcopy(dict(case))
    short = int(np.argmin(case["head_budgets"]))
    width = max(case["head_budgets"])
    bad_row["outputs"]["kept"]["data"][short * width + width - 1] = 0  # a pad that is not -1
    write_json(tmp_path / "b.json", vectors_document("adakv", [(case.params, [bad_row])]))
    with pytest.raises(ValueError, match=rf"outputs.kept row {short} must hold head_budgets"):
        read_vectors(tmp_path / "b.json")


def test_checker_reports_uneven_failures():
    from refkv.oracle.cases import compare_case
    from refkv.oracle.vectors import as_vector_case

    policy, view, case = uneven_case()
    ref = as_vector_case(case)
    kept = [np.asarray(r) for r in policy.keep_indices(view)]
    long, short = int(np.argmax(ref.head_budgets)), int(np.argmin(ref.head_budgets))
    # one token fewer in a head: the layer's total differs
    fewer = [r if h != long else r[:-1] for h, r in enumerate(kept)]
    result = compare_case({"kept": fewer}, ref)
    assert not result.ok and "the layer's total differs" in result.format()
    # an empty slot kept
    n_short = int(np.count_nonzero(view.positions[short] != EMPTY))
    slot = [r if h != short else np.append(r, n_short) for h, r in enumerate(fewer)]
    result = compare_case({"kept": slot}, ref)
    assert not result.ok and "past them are empty slots" in result.format()
    # a token moved from one head to the other: pooled over the layer, and not a tie here
    lowest = min((float(ref.outputs["scores"][long][c]), c) for c in kept[long]
                 if not ref.outputs["protected"][long][c])[1]
    moved = list(kept)
    moved[long] = kept[long][kept[long] != lowest]
    free = [c for c in range(n_short) if c not in set(kept[short].tolist())]
    worst = min(free, key=lambda c: float(ref.outputs["scores"][short][c]))
    moved[short] = np.sort(np.append(kept[short], worst))
    result = compare_case({"kept": moved}, ref)
    text = result.format()
    assert not result.ok and "heads pooled" in text and "per head" in text


def test_compare_uneven_accepts_a_move_between_heads_only_within_tolerance():
    from refkv.oracle.retention import compare_uneven

    scores = np.array([[0.5, 0.3, 0.2], [0.6, 0.29, 0.11]])
    positions = np.tile(np.arange(3), (2, 1))
    protected = np.zeros((2, 3), dtype=bool)
    lengths = np.array([3, 3])
    desired = [np.array([0, 1]), np.array([0])]             # keeps 0.5, 0.3 | 0.6
    actual = [np.array([0]), np.array([0, 1])]              # keeps 0.5 | 0.6, 0.29: 0.29 for 0.3
    tight = np.full((2, 3), 0.004)                          # 0.008 < 0.01: fails
    loose = np.full((2, 3), 0.006)                          # 0.012 >= 0.01: a tie
    fail = compare_uneven(actual, desired, scores, positions=positions, protected=protected, lengths=lengths,
                          tolerance=tight)
    assert not fail.ok and "heads pooled" in fail.failure and "[1, 2]" in fail.failure
    tie = compare_uneven(actual, desired, scores, positions=positions, protected=protected, lengths=lengths,
                         tolerance=loose)
    assert tie.ok and len(tie.ties) == 1 and tie.ties[0].dropped_score == 0.3
    # a higher-scored token given up for a lower one is never a tie, whatever the sign
    wrong = [np.array([0, 1]), np.array([1])]               # 0.29 kept for 0.6
    res = compare_uneven(wrong, desired, scores, positions=positions, protected=protected, lengths=lengths,
                         tolerance=loose)
    assert not res.ok
    protected[0, 1] = True                                  # the moved-out token was protected
    res = compare_uneven(actual, desired, scores, positions=positions, protected=protected, lengths=lengths,
                         tolerance=loose)
    assert not res.ok and "protects" in res.failure
    same = compare_uneven(desired, desired, scores, positions=positions, protected=protected, lengths=lengths)
    assert same.ok and not same.ties


def test_an_even_reference_refuses_an_uneven_candidate():
    from refkv.oracle.cases import compare_case
    from refkv.oracle.encode import encode_case

    policy = get("tova")
    view = replay(policy, random_tokens(np.random.default_rng(0), 4, 2, 4, 12), budget=5)
    case = encode_case(policy, view, case_id=1, comment="even")
    kept = policy.keep_indices(view)
    outside = next(c for c in range(12) if c not in kept[1])
    result = compare_case({"kept": [kept[0][:-1], np.sort(np.append(kept[1], outside))]}, case)
    assert not result.ok and "the reference [5, 5]" in result.format()


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_cache_with_uneven_heads_matches_a_list_per_head(data):
    """Any sequence of appends and (even or uneven) keeps: each head holds exactly what a plain
    Python list of (position, key, value, field) would, then empty slots."""
    from refkv.cache import FieldSpec

    hkv = data.draw(st.integers(1, 3), label="hkv")
    cache = LayerCache(hkv, 2, np.float64, {"f": FieldSpec(np.int64, (), -7)})
    model = [[] for _ in range(hkv)]  # per head: (position, key0, field)
    held = []  # views handed out, with a copy of what they showed
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        b = data.draw(st.integers(1, 3), label="block")
        start = cache.next_position
        keys = np.arange(start, start + b, dtype=np.float64)[None, :, None] * np.ones((hkv, 1, 2))
        keys[:, :, 1] = np.arange(hkv)[:, None]
        cache.append(keys, keys.copy())
        for h in range(hkv):
            model[h] += [(p, float(p), -7) for p in range(start, start + b)]
        if data.draw(st.booleans(), label="set field"):
            values = (cache.positions * 10) % 13
            cache.set_field("f", values)
            for h in range(hkv):
                model[h] = [(p, k, int((p * 10) % 13)) for p, k, _ in model[h]]
        held.append((cache.positions, cache.positions.copy()))
        rows = []
        for h in range(hkv):
            n_h = len(model[h])
            rows.append(np.array(sorted(data.draw(st.sets(st.integers(0, n_h - 1), max_size=n_h), label="keep")),
                                 dtype=np.int64))
        cache.keep(rows)
        for h in range(hkv):
            model[h] = [model[h][c] for c in rows[h]]
        for h in range(hkv):
            n_h = len(model[h])
            assert cache.head_lengths[h] == n_h
            np.testing.assert_array_equal(cache.positions[h, :n_h], [p for p, _, _ in model[h]])
            np.testing.assert_array_equal(cache.keys[h, :n_h, 0], [k for _, k, _ in model[h]])
            np.testing.assert_array_equal(cache.keys[h, :n_h, 1], h)
            np.testing.assert_array_equal(cache.fields["f"][h, :n_h], [f for _, _, f in model[h]])
            assert np.all(cache.positions[h, n_h:] == EMPTY) and np.all(cache.keys[h, n_h:] == 0)
            assert np.all(cache.fields["f"][h, n_h:] == -7)
        assert len(cache) == max(len(m) for m in model) and cache.total == sum(len(m) for m in model)
    for view, copy in held:  # copy on write: nothing handed out ever changed
        np.testing.assert_array_equal(view, copy)


def test_ada_pyramid_keeps_each_layers_total(tiny64):
    policy = get("adakv", base="pyramidkv", base_params={"base_params": {"window": 2, "kernel": 3}, "beta": 4})
    budgets = policy.base_policy.layer_budgets(12, TINY.n_layers)
    engine = Engine(tiny64, policy, 12)
    engine.prefill(np.random.default_rng(5).integers(0, TINY.vocab_size, 70), 6)
    for cache, budget in zip(engine.caches, budgets):
        assert cache.total == budget * cache.n_kv_heads
    assert len(set(budgets)) > 1


@given(seed=st.integers(0, 2**16), t=st.integers(2, 24), keep=st.integers(1, 12),
       alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]), form=st.sampled_from(["paper", "kvpress"]),
       block=st.sampled_from([None, 1, 3]))
@settings(max_examples=40, deadline=None)
def test_any_decision_is_the_joint_top_with_the_floor(seed, t, keep, alpha, form, block):
    """Block mode too: the candidates then hold empty slots, which are never kept."""
    policy = get("adakv", base="tova", alpha=alpha, form=form)
    tokens = random_tokens(np.random.default_rng(seed), 4, 2, 4, t)
    view = replay(policy, tokens, block_size=block, budget=keep)
    lengths = view.head_lengths
    base = np.full(view.positions.shape, -np.inf)
    for h in range(2):
        alone = head_view(view, h)
        base[h, :lengths[h]] = policy.base_policy.score(alone)[0]
    got = as_sets(policy.keep_indices(view))
    hkv = 2
    # the joint top over real tokens only, by the independent recomputation on each head's real columns
    real_scores = [base[h, :lengths[h]] for h in range(hkv)]
    if form == "paper":
        real_scores = [s / s.sum() if s.sum() > 0 else np.full(len(s), 1 / len(s)) for s in real_scores]
    floor = int(np.floor(alpha * keep)) if form == "paper" else (max(1, int(keep * alpha)) if alpha > 0 else 0)
    forced = {(h, c) for h in range(hkv) for c in sorted(range(lengths[h]), key=lambda c: (
        real_scores[h][c], view.positions[h, c]), reverse=True)[:floor]}
    pairs = sorted(((h, c) for h in range(hkv) for c in range(lengths[h])),
                   key=lambda hc: ((hc in forced), real_scores[hc[0]][hc[1]], view.positions[hc], -hc[0]),
                   reverse=True)[:keep * hkv]
    assert got == [sorted(c for h2, c in pairs if h2 == h) for h in range(hkv)]
    assert sum(map(len, got)) == min(keep * hkv, int(lengths.sum()))
