"""H2O: accumulated attention phi = A_prev + A^T 1 (KeyDiff App. A.1) and a recent window r = N // 2."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_views import make_view, random_view, reference_keep

from refkv.engine import Engine
from refkv.model import TINY
from refkv.policies import get
from refkv.policies.h2o import FIELD, H2O, accumulated_attention

# One KV head with two query heads; a block of B = 2 queries (positions 2, 3) over n = 4 keys.
# Tokens 0 and 1 carry accumulators 1.0 and 0.5 from earlier blocks; 2 and 3 are new (0).
ATTENTION = np.array([[
    [[0.50, 0.25, 0.25, 0.00], [0.25, 0.25, 0.25, 0.25]],   # query head 0: rows of positions 2, 3
    [[0.25, 0.25, 0.50, 0.00], [0.50, 0.00, 0.25, 0.25]],   # query head 1
]])
PREVIOUS = np.array([[1.0, 0.5, 0.0, 0.0]])
# Group means: position 2 row (0.375, 0.25, 0.375, 0), position 3 row (0.375, 0.125, 0.25, 0.25);
# column sums A^T 1 = (0.75, 0.375, 0.625, 0.25); plus PREVIOUS:
ACCUMULATED = np.array([[1.75, 0.875, 0.625, 0.25]])


def view_after_observe(budget=None):
    view = make_view(ATTENTION, fields={FIELD: PREVIOUS}, budget=budget)
    new = H2O().observe(view)[FIELD]
    return make_view(ATTENTION, fields={FIELD: new}, budget=budget)


def test_accumulator_by_hand():
    view = make_view(ATTENTION, fields={FIELD: PREVIOUS})
    np.testing.assert_array_equal(accumulated_attention(view.attention_by_kv_head()), [[0.75, 0.375, 0.625, 0.25]])
    np.testing.assert_array_equal(H2O().observe(view)[FIELD], ACCUMULATED)


@pytest.mark.parametrize(("policy", "budget", "expected"), [
    (H2O(), 3, [[0, 1, 3]]),             # r = 3 // 2 = 1 protects position 3; heavy hitters 0 (1.75), 1 (0.875)
    (H2O(), 2, [[0, 3]]),                # r = 1; one heavy hitter
    (H2O(recent=2), 3, [[0, 2, 3]]),     # 2, 3 protected; heavy hitter 0
    (H2O(recent=0), 2, [[0, 1]]),        # pure heavy hitters
])
def test_kept_by_hand(policy, budget, expected):
    view = view_after_observe(budget)
    np.testing.assert_array_equal(policy.keep_indices(replace(view, keep=budget)), expected)


def test_default_window_is_half_the_budget():
    assert [H2O().recent_window(n) for n in (1, 2, 7, 64)] == [0, 1, 3, 32]
    assert H2O(recent=5).recent_window(64) == 5


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_recent(bad):
    with pytest.raises(ValueError, match="recent"):
        H2O(recent=bad)


def test_recent_must_leave_room(tiny64):
    with pytest.raises(ValueError, match="recent must be < budget=8"):
        H2O(recent=8).check(8, TINY)
    with pytest.raises(ValueError, match="recent"):
        Engine(tiny64, H2O(recent=10), budget=8)
    H2O(recent=7).check(8, TINY)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 14), b=st.integers(1, 6), budget=st.integers(1, 14),
       recent=st.one_of(st.none(), st.integers(0, 13)))
@settings(max_examples=60)
def test_selection_is_top_accumulated_plus_recent(seed, n, b, budget, recent):
    if recent is not None and recent >= budget:
        recent = budget - 1
    rng = np.random.default_rng(seed)
    view = random_view(rng, n=n, b=min(b, n), budget=budget, fields={FIELD: rng.random((2, n)) * 3})
    policy = H2O(recent=recent)
    view = make_view(view.attention, positions=view.positions, budget=budget, fields=policy.observe(view))
    r = budget // 2 if recent is None else recent
    protected = np.zeros((2, n), bool)
    protected[:, n - min(r, n):] = True
    kept = policy.keep_indices(replace(view, keep=budget))
    np.testing.assert_array_equal(kept, reference_keep(view.fields[FIELD], view.positions, budget, protected))
    assert np.all(kept[:, kept.shape[1] - min(r, n, budget):] >= n - r)    # the recent window survived


def test_accumulators_sum_to_the_number_of_queries_and_do_not_depend_on_b(tiny64):
    """With no eviction, each head's accumulators add up to T (every query row sums to 1;
    CAOTE Theorem B.1), and processing in blocks of any size gives the same sums."""
    tokens = np.random.default_rng(3).integers(0, 512, 24)
    results = []
    for block in (1, 5, None):
        engine = Engine(tiny64, "h2o", budget=None)
        engine.prefill(tokens, block)
        acc = np.stack([c.fields[FIELD] for c in engine.caches])
        np.testing.assert_allclose(acc.sum(axis=-1), 24.0, rtol=0, atol=1e-12)
        results.append(acc)
    np.testing.assert_allclose(results[0], results[1], rtol=0, atol=1e-13)
    np.testing.assert_allclose(results[0], results[2], rtol=0, atol=1e-13)
    # The first token is seen by every query, the last by one only.
    assert np.all(results[0][..., 0] > results[0][..., -1])


@pytest.mark.parametrize(("budget", "block", "recent"), [(8, 1, None), (8, 3, 2), (16, 5, None), (20, None, 6)])
def test_engine_runs_and_keeps_the_recent_window(tiny64, tiny32, budget, block, recent):
    tokens = np.random.default_rng(4).integers(0, 512, 50)
    for model in (tiny64, tiny32):
        engine = Engine(model, get("h2o", recent=recent), budget)
        engine.prefill(tokens, block)
        r = budget // 2 if recent is None else recent
        for cache in engine.caches:
            assert len(cache) == budget
            assert cache.fields[FIELD].dtype == np.float64
            np.testing.assert_array_equal(cache.positions[:, budget - r:], np.broadcast_to(np.arange(50 - r, 50),
                                                                                         (2, r)))


def test_no_eviction_when_budget_covers_prompt(tiny64):
    tokens = np.random.default_rng(8).integers(0, 512, 25)
    engine = Engine(tiny64, H2O(recent=3), 30)
    logits = engine.prefill(tokens, 3, all_logits=True)
    np.testing.assert_allclose(logits, tiny64.forward_full(tokens), rtol=0, atol=1e-10)
    assert engine.stats.evictions == 0
