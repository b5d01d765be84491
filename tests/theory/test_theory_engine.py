"""Engine-level statements: block prompt processing without eviction is exact, and MAT's
streaming Eq. 4 equals its closed form. See docs/theory/engine.rst."""

from functools import cache

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from refkv.engine import Engine
from refkv.policies import available, get, policy_class
from refkv.policies.mat import closed_form_keep, streaming_keep


def library_policies():
    """Registered policies defined by refkv itself (other test modules may register their own)."""
    return [name for name in available() if policy_class(name).__module__.startswith("refkv.")]


def constructible(name, model, budget):
    """The policy with default parameters, or None if it cannot run with this budget
    (e.g. ``full`` takes no budget, ``sink`` needs N > s)."""
    try:
        policy = get(name)
        Engine(model, policy, budget)
    except ValueError:
        return None
    return policy


@cache
def smallest_budget(name):
    """The smallest N the policy accepts with default parameters on the tiny model (its
    protected set must fit: e.g. 14 for HashEvict's 4 sinks + 10 recent, 33 for SnapKV's w = 32)."""
    from refkv.model import builtin_model

    model = builtin_model()
    for budget in range(1, 257):
        if constructible(name, model, budget) is not None:
            return budget
    raise AssertionError(f"{name} accepts no budget up to 256")


def logit_tolerance(expected, dtype):
    """float64: 1e-10 absolute. float32: 1e-5 of the logit scale (the tiny model's logits are O(10))."""
    if dtype == np.float64:
        return 1e-10
    return 1e-5 * max(1.0, float(np.abs(expected).max()))


# -- N >= T: block processing is exact for every B ------------------------------------------------

@pytest.mark.parametrize("name", library_policies())
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_every_policy_every_block_size_is_exact_without_eviction(name, dtype_name, tiny64, tiny32):
    """With N >= T nothing is evicted, so every B in 1..T (and B = None) must give the logits
    of forward_full at every position, for every registered policy: a policy may read, score
    and keep state, but it must not change the computation."""
    model = tiny64 if dtype_name == "float64" else tiny32
    tokens = np.random.default_rng(11).integers(0, model.config.vocab_size, 13)
    expected = model.forward_full(tokens)
    budget = None if name == "full" else max(len(tokens), smallest_budget(name))
    policy = constructible(name, model, budget)
    assert policy is not None
    for block in [*range(1, len(tokens) + 1), None]:
        engine = Engine(model, policy, budget)
        logits = engine.prefill(tokens, block, all_logits=True)
        assert logits.dtype == model.dtype
        assert engine.stats.evictions == 0
        np.testing.assert_allclose(logits, expected, rtol=0, atol=logit_tolerance(expected, model.dtype))


@given(name=st.sampled_from([p for p in library_policies() if p != "full"]), length=st.integers(1, 24),
       block=st.one_of(st.none(), st.integers(1, 24)), slack=st.integers(0, 8), seed=st.integers(0, 2**16))
@settings(max_examples=40)
def test_exactness_for_random_lengths_blocks_and_budgets(tiny64, name, length, block, slack, seed):
    """Any T, any B, any N >= T: the cached block path reproduces forward_full."""
    tokens = np.random.default_rng(seed).integers(0, tiny64.config.vocab_size, length)
    budget = max(length + slack, smallest_budget(name))  # N >= T, and the protected set fits
    policy = constructible(name, tiny64, budget)
    assert policy is not None
    engine = Engine(tiny64, policy, budget)
    logits = engine.prefill(tokens, block, all_logits=True)
    assert engine.stats.evictions == 0
    expected = tiny64.forward_full(tokens)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-10)


def test_exactness_is_not_vacuous(tiny64):
    """The comparison can fail: with N < T the same prompt gives different logits."""
    tokens = np.random.default_rng(11).integers(0, tiny64.config.vocab_size, 13)
    logits = Engine(tiny64, "keydiff", 6).prefill(tokens, 2, all_logits=True)
    assert np.abs(logits[-1] - tiny64.forward_full(tokens)[-1]).max() > 1e-3


# -- MAT: streaming Eq. 4 = bottom-beta closed form --------------------------------------------------

def bottom_beta_by_hand(pi, budget, beta):
    """The closed form written out: the first token, the last N - beta tokens, and the beta - 1
    others of lowest pi (equal pi: the more recent one stays)."""
    n = len(pi)
    if n <= budget:
        return list(range(n))
    window = list(range(n - (budget - beta), n)) if budget > beta else []
    middle = [i for i in range(1, n) if i not in window]
    anchors = sorted(middle, key=lambda i: (pi[i], -i))[:beta - 1]
    return sorted({0, *anchors, *window})


@st.composite
def mat_cases(draw):
    budget = draw(st.integers(2, 12))
    beta = draw(st.integers(1, budget - 1))
    n = draw(st.integers(1, 40))
    # Small integer logits half the time, so ties (the tie rule) are exercised.
    elements = st.one_of(st.integers(-3, 3).map(float), st.floats(-50, 50, allow_nan=False, allow_infinity=False))
    pi = draw(arrays(np.float64, n, elements=elements))
    return pi, budget, beta


@given(case=mat_cases())
@example(case=(np.array([0.0, 5.0, 1.0, 5.0, 2.0, 0.5, 3.0]), 4, 2))
@settings(max_examples=150)
def test_mat_streaming_argmax_equals_closed_form(case):
    """Eq. 4 applied token by token (evict argmax pi among the beta anchor candidates) keeps
    exactly: the first token, the last N - beta, and the beta - 1 lowest-pi others."""
    pi, budget, beta = case
    positions = np.arange(len(pi))
    streamed = streaming_keep(pi, positions, budget, beta)
    closed = closed_form_keep(pi, positions, budget, beta)
    np.testing.assert_array_equal(streamed, closed)
    np.testing.assert_array_equal(closed, bottom_beta_by_hand(pi, budget, beta))


@given(case=mat_cases(), rows=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_mat_forms_agree_per_row(case, rows, seed):
    """Per KV head (rows): each row is evicted independently."""
    pi, budget, beta = case
    rng = np.random.default_rng(seed)
    stacked = np.stack([pi] + [rng.permutation(pi) for _ in range(rows - 1)])
    positions = np.broadcast_to(np.arange(len(pi)), stacked.shape)
    np.testing.assert_array_equal(streaming_keep(stacked, positions, budget, beta),
                                  closed_form_keep(stacked, positions, budget, beta))


def test_mat_worked_example():
    """N = 4, beta = 2: one anchor place besides the first token, a window of 2.
    pi = (0, 5, 1, 5, 2, 0.5, 3): the anchor is the lowest pi among tokens 1..4 that left the
    window, token 2 (pi = 1); the window is tokens 5 and 6."""
    pi = np.array([0.0, 5.0, 1.0, 5.0, 2.0, 0.5, 3.0])
    np.testing.assert_array_equal(streaming_keep(pi, np.arange(7), 4, 2), [0, 2, 5, 6])
    np.testing.assert_array_equal(closed_form_keep(pi, np.arange(7), 4, 2), [0, 2, 5, 6])
