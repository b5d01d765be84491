"""Block prompt processing (KeyDiff Eq. 6) against the no-cache oracle, and eviction invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refkv.engine import Engine, blocks, generate, prefill
from refkv.policies import Policy, View, select
from refkv.policies.sink import Sink


def random_prompt(model, length, seed):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, length)


def assert_logits_match(actual, expected, dtype):
    """float64 to 1e-10; float32 to 1e-5 relative to the logit scale.

    The float32 bound is relative because the logits of the built-in model are O(10):
    an absolute 1e-5 would ask for better than float32's 6e-8 relative precision after a
    few layers of accumulation.
    """
    scale = max(1.0, float(np.abs(expected).max()))
    atol = 1e-10 if dtype == np.float64 else 1e-5 * scale
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


# -- exactness without eviction -------------------------------------------------------------

@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_every_block_size_matches_forward_full(dtype_name, tiny64, tiny32):
    model = tiny64 if dtype_name == "float64" else tiny32
    tokens = random_prompt(model, 23, seed=1)
    expected = model.forward_full(tokens)
    assert expected.dtype == model.dtype
    for block_size in [*range(1, len(tokens) + 1), None]:
        logits = Engine(model).prefill(tokens, block_size, all_logits=True)
        assert logits.dtype == model.dtype
        assert logits.shape == (len(tokens), model.config.vocab_size)
        assert_logits_match(logits, expected, model.dtype)


@given(length=st.integers(1, 40), block=st.one_of(st.none(), st.integers(1, 45)),
       seed=st.integers(0, 2**16), budget_slack=st.integers(0, 5))
@settings(max_examples=40)
def test_no_eviction_when_budget_covers_prompt(tiny64, length, block, seed, budget_slack):
    """N >= T: any policy with any B reproduces forward_full exactly."""
    tokens = random_prompt(tiny64, length, seed)
    engine = Engine(tiny64, Sink(sink=0), budget=length + budget_slack)
    logits = engine.prefill(tokens, block, all_logits=True)
    assert_logits_match(logits, tiny64.forward_full(tokens), np.float64)
    assert engine.stats.evictions == 0
    for cache in engine.caches:
        np.testing.assert_array_equal(cache.positions, np.broadcast_to(np.arange(length), cache.positions.shape))


def test_b1_is_step_by_step_generation(tiny64):
    """B = 1 prefill is the same computation as feeding tokens one at a time."""
    tokens = random_prompt(tiny64, 30, seed=2)
    a = Engine(tiny64, "sink", budget=12)
    logits_a = a.prefill(tokens, 1, all_logits=True)
    b = Engine(tiny64, "sink", budget=12)
    logits_b = np.stack([b.forward([t]) for t in tokens])
    np.testing.assert_array_equal(logits_a, logits_b)
    for ca, cb in zip(a.caches, b.caches):
        np.testing.assert_array_equal(ca.positions, cb.positions)


def test_one_shot_prefill_logits_are_unaffected_by_eviction(tiny64):
    """B = None: the block attends before anything is evicted, so its logits equal the full pass,
    and the cache afterwards is the policy's choice over the whole prompt."""
    tokens = random_prompt(tiny64, 40, seed=3)
    engine = Engine(tiny64, Sink(sink=4), budget=10)
    logits = engine.prefill(tokens, None, all_logits=True)
    assert_logits_match(logits, tiny64.forward_full(tokens), np.float64)
    expected = np.r_[0:4, 34:40]
    for cache in engine.caches:
        np.testing.assert_array_equal(cache.positions, np.broadcast_to(expected, (2, 10)))


def test_sink_window_by_hand(tiny64):
    """T = 20, N = 8, s = 2, B = 5: after each block every layer keeps 0, 1 and the last 6."""
    engine = Engine(tiny64, Sink(sink=2), budget=8, record=True)
    engine.prefill(random_prompt(tiny64, 20, seed=4), 5)
    expected_after_block = [np.r_[0:5], np.r_[0:2, 4:10], np.r_[0:2, 9:15], np.r_[0:2, 14:20]]
    assert len(engine.trace.kept) == 4
    for kept_layers, expected in zip(engine.trace.kept, expected_after_block):
        for kept in kept_layers:
            np.testing.assert_array_equal(kept, np.broadcast_to(expected, kept.shape))
    assert engine.stats.peak_cache_tokens == 8 + 5


# -- eviction invariants --------------------------------------------------------------------

class _RandomScores(Policy):
    """Test-only policy (not registered: the engine takes policy objects): pseudo-random scores from
    the key values, first token and last 2 protected, so different heads keep different tokens."""

    name = "_test_random"
    needs = frozenset({"keys"})

    def score(self, view: View) -> np.ndarray:
        return np.sin(1e3 * view.keys.sum(axis=-1))

    def protected(self, view: View) -> np.ndarray:
        mask = view.positions == 0
        mask[:, -2:] = True
        return mask


@given(length=st.integers(1, 60), block=st.one_of(st.none(), st.integers(1, 20)),
       budget=st.integers(3, 20), seed=st.integers(0, 2**16))
@settings(max_examples=40)
def test_eviction_invariants(tiny64, length, block, budget, seed):
    tokens = random_prompt(tiny64, length, seed)
    engine = Engine(tiny64, _RandomScores(), budget=budget, record=True)
    logits = engine.prefill(tokens, block)
    seen = 0
    for kept_layers, chunk in zip(engine.trace.kept, blocks(tokens, block)):
        seen += len(chunk)
        for kept in kept_layers:
            assert kept.shape[1] == min(budget, seen)                 # budget respected
            assert np.all(np.diff(kept, axis=1) > 0)                   # unique and sorted
            assert np.all(kept < seen)
            assert np.all(kept[:, -2:] == np.arange(seen - 2, seen)[-kept.shape[1]:][-2:])  # recent kept
            assert np.all(kept[:, 0] == 0)                              # protected first token kept
    for cache in engine.caches:
        assert len(cache) == min(budget, length)
        assert cache.keys.shape == (2, len(cache), 16) and cache.values.shape == cache.keys.shape
    # bit-identical on a rerun
    again = Engine(tiny64, _RandomScores(), budget=budget)
    np.testing.assert_array_equal(again.prefill(tokens, block), logits)
    for c1, c2 in zip(engine.caches, again.caches):
        np.testing.assert_array_equal(c1.positions, c2.positions)
        np.testing.assert_array_equal(c1.keys, c2.keys)


def test_heads_may_keep_different_tokens(tiny64):
    engine = Engine(tiny64, _RandomScores(), budget=6)
    engine.prefill(random_prompt(tiny64, 40, seed=5), 4)
    assert any(not np.array_equal(c.positions[0], c.positions[1]) for c in engine.caches)


def test_evicted_cache_matches_manual_recomputation(tiny64):
    """Eviction gathers keys and values with their positions: layer 0's k and v depend only on the
    token and its position, so they must equal the full pass's entries at the kept positions."""
    tokens = random_prompt(tiny64, 25, seed=6)
    engine = Engine(tiny64, _RandomScores(), budget=7)
    engine.prefill(tokens, 5)
    full = Engine(tiny64)
    full.prefill(tokens, None)
    cache, reference = engine.caches[0], full.caches[0]
    assert not np.array_equal(cache.positions[0], cache.positions[1])  # heads differ: a real gather test
    for h in range(cache.n_kv_heads):
        np.testing.assert_array_equal(cache.keys[h], reference.keys[h, cache.positions[h]])
        np.testing.assert_array_equal(cache.values[h], reference.values[h, cache.positions[h]])


# -- the tie rule -----------------------------------------------------------------------------

def test_tie_rule_keeps_more_recent_token():
    scores = np.array([[1.0, 2.0, 2.0, 0.5, 2.0]])
    positions = np.array([[3, 7, 9, 12, 15]])
    # three tokens tie at 2.0; budget 2 keeps the two most recent of them (positions 9 and 15)
    np.testing.assert_array_equal(select(scores, positions, 2), [[2, 4]])
    np.testing.assert_array_equal(select(scores, positions, 3), [[1, 2, 4]])
    # signed zeros tie too
    np.testing.assert_array_equal(select(np.array([[0.0, -0.0]]), np.array([[0, 1]]), 1), [[1]])


def test_select_protected_first_and_errors():
    scores = np.array([[5.0, 4.0, 3.0, 2.0]])
    positions = np.arange(4)[None]
    protected = np.array([[False, False, False, True]])
    np.testing.assert_array_equal(select(scores, positions, 2, protected), [[0, 3]])
    assert select(scores, positions, 0).shape == (1, 0)      # a block of B = N evicted before attention
    with pytest.raises(ValueError, match="budget"):
        select(scores, positions, -1)
    with pytest.raises(ValueError, match="protected"):
        select(scores, positions, 0, protected)
    with pytest.raises(ValueError, match="protected"):
        select(scores, positions, 1, np.array([[True, True, False, False]]))
    with pytest.raises(ValueError, match="NaN"):
        select(np.array([[np.nan, 1.0, 2.0, 3.0]]), positions, 2)
    with pytest.raises(ValueError, match="shape"):
        select(scores[:, :3], positions, 2)


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=12), st.integers(1, 12))
def test_select_is_topk_with_recency_ties(values, budget):
    """Against a brute-force reference: sort by (score, position) descending."""
    scores = np.array([values], dtype=float)
    positions = np.arange(len(values))[None] * 2 + 1
    ranked = sorted(range(len(values)), key=lambda i: (values[i], i), reverse=True)
    expected = sorted(ranked[:budget])
    np.testing.assert_array_equal(select(scores, positions, budget)[0], expected)


# -- generation -------------------------------------------------------------------------------

def test_generate_is_greedy_and_stops_at_eos(tiny64):
    tokens = random_prompt(tiny64, 10, seed=7)
    new, engine = generate(tiny64, tokens, max_new_tokens=6)
    # reference: recompute everything for each step and take the argmax
    seq = list(tokens)
    for token in new:
        assert token == int(np.argmax(tiny64.forward_full(seq)[-1]))
        seq.append(token)
    assert len(new) == 6 and engine.position == 10 + 5
    stopped, _ = generate(tiny64, tokens, max_new_tokens=6, eos=[new[2]])
    assert stopped == new[:new.index(new[2]) + 1]  # stops at the first occurrence, eos included
    streamed = []
    logits, engine = prefill(tiny64, tokens)
    engine.generate(logits, 4, on_token=streamed.append)
    assert streamed == new[:4]
    assert generate(tiny64, tokens, max_new_tokens=0)[0] == []


def test_generation_under_eviction_keeps_budget(tiny64):
    new, engine = generate(tiny64, random_prompt(tiny64, 50, seed=8), "sink", budget=16, block_size=8,
                           max_new_tokens=10)
    assert len(new) == 10
    assert all(len(c) == 16 for c in engine.caches)
    assert engine.stats.peak_cache_tokens == 16 + 8


# -- bad input --------------------------------------------------------------------------------

def test_bad_input_is_a_clear_value_error(tiny64):
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        Engine(tiny64, "sink", budget=0)
    with pytest.raises(ValueError, match="budget must be > sink=4"):
        Engine(tiny64, "sink", budget=4)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        Engine(tiny64).prefill([1, 2, 3], 0)
    with pytest.raises(ValueError, match="tokens must not be empty"):
        Engine(tiny64).prefill([], 4)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 511\]"):
        Engine(tiny64).prefill([1, 512], 4)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 511\]"):
        Engine(tiny64).prefill([-1], 4)
    with pytest.raises(ValueError, match="tokens must be integers"):
        Engine(tiny64).prefill([1.5], 4)
    with pytest.raises(ValueError, match="unknown policy"):
        Engine(tiny64, "no-such-policy")
    with pytest.raises(ValueError, match="max_new_tokens"):
        Engine(tiny64).generate(np.zeros(512), -1)


def test_full_policy_refuses_a_budget_it_cannot_keep(tiny64):
    engine = Engine(tiny64, "full", budget=5)
    with pytest.raises(ValueError, match="protected tokens do not fit"):
        engine.prefill(random_prompt(tiny64, 10, seed=9), 2)


def test_a_block_too_large_is_refused_before_any_state_changes(tiny64):
    """Policies that evict before attention state their largest block (``max_block``); the engine
    refuses a larger one up front, so the caches are untouched and the engine stays usable."""
    from refkv.policies import get

    mat = get("mat")  # shallow layers keep sink=4 tokens: B <= N - 4
    assert mat.max_block(10, tiny64.config) == 6
    assert get("hashevict").max_block(20, tiny64.config) == 16
    assert get("sink").max_block(10, tiny64.config) is None
    engine = Engine(tiny64, mat, budget=10)
    engine.prefill(random_prompt(tiny64, 12, seed=10), 6)
    before = [c.positions.copy() for c in engine.caches]
    with pytest.raises(ValueError, match="block size must be <= 6 for mat with budget=10"):
        engine.forward(random_prompt(tiny64, 7, seed=11))
    assert engine.position == 12
    for cache, positions in zip(engine.caches, before):
        np.testing.assert_array_equal(cache.positions, positions)
    engine.forward(random_prompt(tiny64, 6, seed=12))  # still usable
    assert engine.position == 18
