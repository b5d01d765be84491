"""TOVA: the block's last query's attention, averaged over the KV group (KeyDiff App. A.1, B.2)."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_views import make_view, random_view, reference_keep

from refkv.engine import Engine
from refkv.policies import get
from refkv.policies.tova import TOVA, last_query_attention

# 2 KV heads x 2 query heads, a block of B = 2 queries (positions 3, 4) over n = 5 keys.
# Only the last query's rows matter; the first query cannot see position 4 (causal zero).
FIRST = [0.25, 0.25, 0.25, 0.25, 0.0]
ATTENTION = np.array([
    [[FIRST, [0.40, 0.10, 0.20, 0.10, 0.20]],    # KV head 0, query head 0
     [FIRST, [0.20, 0.10, 0.40, 0.10, 0.20]]],   # KV head 0, query head 1
    [[FIRST, [0.05, 0.05, 0.10, 0.30, 0.50]],    # KV head 1, query head 2
     [FIRST, [0.15, 0.05, 0.30, 0.10, 0.40]]],   # KV head 1, query head 3
])
# Group means of the last rows, by hand:
#   head 0: (0.40+0.20)/2, (0.10+0.10)/2, (0.20+0.40)/2, ... = 0.30, 0.10, 0.30, 0.10, 0.20
#   head 1: 0.10, 0.05, 0.20, 0.20, 0.45
GROUP_SCORES = np.array([[0.30, 0.10, 0.30, 0.10, 0.20], [0.10, 0.05, 0.20, 0.20, 0.45]])
# Mean over all four heads: 0.80/4, 0.30/4, 1.00/4, 0.60/4, 1.30/4
ALL_SCORES = np.array([0.200, 0.075, 0.250, 0.150, 0.325])


def test_scores_by_hand():
    np.testing.assert_allclose(TOVA().score(make_view(ATTENTION)), GROUP_SCORES, rtol=0, atol=1e-15)
    np.testing.assert_allclose(TOVA(all_heads=True).score(make_view(ATTENTION)), [ALL_SCORES] * 2,
                               rtol=0, atol=1e-15)


@pytest.mark.parametrize(("budget", "expected"), [
    (3, [[0, 2, 4], [2, 3, 4]]),
    (2, [[0, 2], [3, 4]]),     # head 1: 0.20 ties between positions 2 and 3 -> the more recent, 3
    (1, [[2], [4]]),           # head 0: 0.30 ties between positions 0 and 2 -> 2
])
def test_kept_by_hand(budget, expected):
    view = make_view(ATTENTION, budget=budget)
    np.testing.assert_array_equal(TOVA().keep_indices(replace(view, keep=budget)), expected)


def test_all_heads_keeps_the_same_tokens_in_every_head():
    view = make_view(ATTENTION, budget=3)
    np.testing.assert_array_equal(TOVA(all_heads=True).keep_indices(replace(view, keep=3)), [[0, 2, 4], [0, 2, 4]])


def test_last_query_attention_is_the_last_row():
    a = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(last_query_attention(a), a[:, -1, :])


def test_nothing_protected():
    assert not TOVA().protected(make_view(ATTENTION, budget=2)).any()


def test_bad_parameters_and_inputs():
    with pytest.raises(ValueError, match="all_heads"):
        TOVA(all_heads="yes")
    with pytest.raises(ValueError, match="attention"):
        TOVA().score(make_view(n=5))
    with pytest.raises(ValueError, match="attention"):
        TOVA(all_heads=True).score(make_view(n=5))
    positions = np.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 5]])
    with pytest.raises(ValueError, match="same tokens"):
        TOVA(all_heads=True).score(make_view(ATTENTION, positions=positions, query_positions=[3, 5]))


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 16), b=st.integers(1, 6), budget=st.integers(1, 16),
       all_heads=st.booleans())
@settings(max_examples=60)
def test_only_the_last_query_matters_and_selection_matches_a_plain_sort(seed, n, b, budget, all_heads):
    rng = np.random.default_rng(seed)
    b = min(b, n)
    view = random_view(rng, n=n, b=b, budget=budget)
    policy = TOVA(all_heads=all_heads)
    scores = policy.score(view)
    expected_rows = view.attention[:, :, -1, :].mean(axis=(0, 1) if all_heads else 1)
    np.testing.assert_allclose(scores, np.broadcast_to(expected_rows, scores.shape), rtol=1e-12, atol=0)
    # Scrambling every earlier query's weights changes nothing.
    scrambled = view.attention.copy()
    scrambled[:, :, :-1, :] = rng.random(scrambled[:, :, :-1, :].shape)
    again = make_view(scrambled, positions=view.positions, budget=budget)
    np.testing.assert_array_equal(policy.score(again), scores)
    kept = policy.keep_indices(replace(view, keep=budget))
    np.testing.assert_array_equal(kept, reference_keep(scores, view.positions, budget))
    np.testing.assert_array_equal(policy.keep_indices(replace(view, keep=budget)), kept)   # deterministic


@pytest.mark.parametrize("all_heads", [False, True])
@pytest.mark.parametrize(("budget", "block"), [(8, 1), (8, 5), (16, 3), (16, None), (30, 7)])
def test_engine_runs(tiny64, budget, block, all_heads):
    tokens = np.random.default_rng(7).integers(0, 512, 60)
    engine = Engine(tiny64, get("tova", all_heads=all_heads), budget)
    engine.prefill(tokens, block)
    for cache in engine.caches:
        assert len(cache) == budget
        if all_heads:
            np.testing.assert_array_equal(cache.positions[0], cache.positions[1])


def test_group_mode_lets_heads_differ(tiny64):
    tokens = np.random.default_rng(7).integers(0, 512, 60)
    engine = Engine(tiny64, "tova", 16)
    engine.prefill(tokens, 4)
    assert any(not np.array_equal(c.positions[0], c.positions[1]) for c in engine.caches)


def test_no_eviction_when_budget_covers_prompt(tiny64):
    tokens = np.random.default_rng(8).integers(0, 512, 25)
    engine = Engine(tiny64, TOVA(all_heads=True), 25)
    logits = engine.prefill(tokens, 4, all_logits=True)
    np.testing.assert_allclose(logits, tiny64.forward_full(tokens), rtol=0, atol=1e-10)
    assert engine.stats.evictions == 0
