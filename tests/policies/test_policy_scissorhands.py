"""Scissorhands: steps with attention >= 1/n over the last m steps; first g and last r protected."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_views import make_view

from refkv.attention import attention_weights
from refkv.engine import Engine
from refkv.model import TINY
from refkv.policies import get
from refkv.policies.scissorhands import FIELD, Scissorhands, importance, record_steps

POLICY = Scissorhands(history=3, sink=1, recent=1)


def observe(history, attention, query_positions):
    """One observe call on a single-head view whose last tokens are the block (new rows False)."""
    attention = np.array(attention)
    n = attention.shape[-1]
    grown = np.concatenate([history, np.zeros((1, n - history.shape[1], 3), bool)], axis=1)
    view = make_view(attention, fields={FIELD: grown}, query_positions=query_positions)
    return POLICY.observe(view)[FIELD]


def test_history_by_hand():
    history = np.zeros((1, 0, 3), bool)
    # Block at positions 2, 3 over tokens 0..3 (m = 3: slots 2 and 0).
    # Position 2 sees 3 keys, threshold 1/3: (0.5, 0.2, 0.3) -> token 0 only.
    # Position 3 sees 4 keys, threshold 1/4: (0.25, 0.1, 0.4, 0.25) -> tokens 0, 2, 3 (0.25 >= 0.25).
    history = observe(history, [[[[0.5, 0.2, 0.3, 0.0], [0.25, 0.1, 0.4, 0.25]]]], [2, 3])
    np.testing.assert_array_equal(history.sum(-1), [[2, 0, 1, 1]])
    # Position 4 (slot 1) over 5 tokens, threshold 0.2: tokens 1 and 4.
    history = observe(history, [[[[0.1, 0.3, 0.1, 0.1, 0.4]]]], [4])
    np.testing.assert_array_equal(history.sum(-1), [[2, 1, 1, 1, 1]])
    # Position 5 (slot 2, overwriting step 2) over 6 tokens, threshold 1/6: tokens 1..5.
    # Token 0 loses step 2, its only important step besides step 3.
    history = observe(history, [[[[0.0, 0.2, 0.2, 0.2, 0.2, 0.2]]]], [5])
    np.testing.assert_array_equal(history.sum(-1), [[1, 2, 2, 2, 2, 1]])
    view = make_view(np.zeros((1, 1, 1, 6)), fields={FIELD: history}, budget=4)
    np.testing.assert_array_equal(POLICY.score(view), [[1, 2, 2, 2, 2, 1]])
    # Budget 4: token 0 (sink) and 5 (recent) protected; tokens 1-4 tie at 2 -> the most recent, 3 and 4.
    np.testing.assert_array_equal(POLICY.keep_indices(replace(view, keep=4)), [[0, 3, 4, 5]])


def test_keys_in_the_future_are_never_important():
    a = np.array([[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]])     # positions 1, 2 over tokens 0..2
    important = importance(a, np.array([[0, 1, 2]]), np.array([0, 1]))
    np.testing.assert_array_equal(important, [[[True, False, False], [True, True, False]]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 3, 7, 10])
def test_uniform_attention_is_important_everywhere(dtype, n):
    """Equal logits give weight 1/n, exactly the threshold, in either dtype."""
    q = np.zeros((1, 1, 4), dtype)
    k = np.zeros((1, n, 4), dtype)
    a = attention_weights(q, k, np.array([n - 1]), np.arange(n)[None])[:, 0]
    assert importance(a, np.arange(n)[None], np.array([n - 1])).all()


@given(data=st.data(), m=st.integers(1, 6), blocks=st.lists(st.integers(1, 7), min_size=1, max_size=6))
@settings(max_examples=60)
def test_ring_buffer_equals_the_last_m_steps(data, m, blocks):
    """record_steps block by block equals a plain list of every step's bits summed over the last m."""
    history = np.zeros((1, 0, m), bool)
    steps = []                       # (step, bits over the tokens existing then)
    n = 0
    for b in blocks:
        n += b
        history = np.concatenate([history, np.zeros((1, b, m), bool)], axis=1)
        bits = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=b,
                                           max_size=b)))
        history = record_steps(history, bits[None], np.arange(n - b, n))
        steps.extend((n - b + i, bits[i]) for i in range(b))
        expected = np.zeros(n, int)
        for step, row in steps:
            if step > n - 1 - m:
                expected[: len(row)] += row
        np.testing.assert_array_equal(history[0].sum(-1), expected)


@pytest.mark.parametrize(("params", "match"), [
    ({"history": 0}, "history"), ({"sink": -1}, "sink"), ({"recent": -1}, "recent"), ({"recent": 1.0}, "recent"),
])
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        Scissorhands(**params)


def test_protected_must_leave_room(tiny64):
    with pytest.raises(ValueError, match="sink \\+ recent must be < budget=14"):
        Scissorhands().check(14, TINY)
    with pytest.raises(ValueError, match="sink"):
        Engine(tiny64, "scissorhands", budget=10)
    Scissorhands().check(15, TINY)


def test_counts_do_not_depend_on_the_block_size(tiny64):
    """Each query is one step, so without eviction blocks of any size record the same history."""
    tokens = np.random.default_rng(6).integers(0, 512, 20)
    counts = []
    for block in (1, 4, None):
        engine = Engine(tiny64, Scissorhands(history=5), budget=None)
        engine.prefill(tokens, block)
        counts.append(np.stack([c.fields[FIELD] for c in engine.caches]))
    np.testing.assert_array_equal(counts[0], counts[1])
    np.testing.assert_array_equal(counts[0], counts[2])
    assert counts[0].sum(-1).max() <= 5


@pytest.mark.parametrize(("budget", "block", "params"), [
    (8, 1, {"history": 4, "sink": 2, "recent": 3}), (8, 3, {"history": 4, "sink": 2, "recent": 3}),
    (16, 5, {}), (24, None, {}), (20, 7, {"history": 2, "sink": 0, "recent": 0}),
])
def test_engine_runs_and_keeps_sinks_and_recent(tiny64, tiny32, budget, block, params):
    tokens = np.random.default_rng(9).integers(0, 512, 50)
    policy = get("scissorhands", **params)
    for model in (tiny64, tiny32):
        engine = Engine(model, policy, budget)
        engine.prefill(tokens, block)
        for cache in engine.caches:
            assert len(cache) == budget
            np.testing.assert_array_equal(cache.positions[:, :policy.sink],
                                          np.broadcast_to(np.arange(policy.sink), (2, policy.sink)))
            np.testing.assert_array_equal(cache.positions[:, budget - policy.recent:],
                                          np.broadcast_to(np.arange(50 - policy.recent, 50), (2, policy.recent)))


def test_no_eviction_when_budget_covers_prompt(tiny64):
    tokens = np.random.default_rng(8).integers(0, 512, 25)
    engine = Engine(tiny64, Scissorhands(history=7), 25)
    logits = engine.prefill(tokens, 2, all_logits=True)
    np.testing.assert_allclose(logits, tiny64.forward_full(tokens), rtol=0, atol=1e-10)
    assert engine.stats.evictions == 0
