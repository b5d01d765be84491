"""SnapKV: observation-window attention, pooled over the candidates; last w tokens protected."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_views import make_view, random_view, reference_keep
from scipy.ndimage import maximum_filter1d, uniform_filter1d

from refkv.engine import Engine
from refkv.model import TINY
from refkv.policies import get
from refkv.policies.snapkv import SnapKV, pool1d, window_attention

# One KV head, one query head; a block of B = 2 queries (positions 6, 7) over n = 8 keys.
# Weights are multiples of 1/32, so every sum below is exact and ties are exact.
ROW6 = np.array([10, 2, 2, 6, 2, 4, 6, 0]) / 32
ROW7 = np.array([6, 2, 4, 2, 2, 2, 8, 6]) / 32
ATTENTION = np.array([[[ROW6, ROW7]]])
# s = A^T 1 over the window = (16, 4, 6, 8, 4, 6, 14, 6) / 32. With w = 2 the candidates are the
# first 6 columns; average pooling with k = 3 and zero padding, by hand (in 96ths):
#   (0+16+4), (16+4+6), (4+6+8), (6+8+4), (8+4+6), (4+6+0) = 20, 26, 18, 18, 18, 10
# The window's own columns keep their sums 14/32 and 6/32. (Pooling over all columns would
# have given column 5 (4+6+14)/96 = 24/96: the window would leak into its neighbour.)
AVG_SCORES = np.array([20, 26, 18, 18, 18, 10, 42, 18]) / 96
# Max pooling, -inf padding: max(16,4), max(16,4,6), max(4,6,8), max(6,8,4), max(8,4,6), max(4,6) (32nds)
MAX_SCORES = np.array([16, 16, 8, 8, 8, 6, 14, 6]) / 32


def test_window_sum_and_pooling_by_hand():
    view = make_view(ATTENTION)
    np.testing.assert_array_equal(window_attention(view.attention_by_kv_head(), 2)[0] * 32,
                                  [16, 4, 6, 8, 4, 6, 14, 6])
    np.testing.assert_allclose(SnapKV(window=2, kernel=3).score(view)[0], AVG_SCORES, rtol=1e-15, atol=0)
    np.testing.assert_array_equal(SnapKV(window=2, kernel=3, pooling="max").score(view)[0], MAX_SCORES)
    np.testing.assert_array_equal(SnapKV(window=2, kernel=1).score(view)[0] * 32, [16, 4, 6, 8, 4, 6, 14, 6])


@pytest.mark.parametrize(("policy", "budget", "expected"), [
    (SnapKV(window=2, kernel=3), 4, [0, 1, 6, 7]),
    (SnapKV(window=2, kernel=3), 5, [0, 1, 4, 6, 7]),   # 18/96 ties among 2, 3, 4 -> the most recent, 4
    (SnapKV(window=2, kernel=3, pooling="max"), 3, [1, 6, 7]),   # 16/32 ties between 0 and 1 -> 1
    (SnapKV(window=2, kernel=3, pooling="max"), 4, [0, 1, 6, 7]),
])
def test_kept_by_hand(policy, budget, expected):
    view = make_view(ATTENTION, budget=budget)
    np.testing.assert_array_equal(policy.keep_indices(replace(view, keep=budget)), [expected])


def test_window_longer_than_the_block_uses_the_block():
    """w = 4 > B = 2: the two queries there are form the window; the last 4 tokens are protected and
    the candidates are the first 4: pooled (0+16+4), (16+4+6), (4+6+8), (6+8+0) in 96ths."""
    view = make_view(ATTENTION, budget=5)
    policy = SnapKV(window=4, kernel=3)
    np.testing.assert_allclose(policy.score(view)[0], np.array([20, 26, 18, 14, 12, 18, 42, 18]) / 96,
                               rtol=1e-15, atol=0)
    np.testing.assert_array_equal(policy.protected(view)[0], [False] * 4 + [True] * 4)
    np.testing.assert_array_equal(policy.keep_indices(replace(view, keep=5)), [[1, 4, 5, 6, 7]])


def test_pool1d_padding_rule_by_hand():
    x = np.array([3.0, 0.0, 6.0, 0.0, 9.0])
    np.testing.assert_allclose(pool1d(x, 3), [1.0, 3.0, 2.0, 5.0, 3.0], rtol=1e-15)     # zeros padded, /3
    np.testing.assert_array_equal(pool1d(x, 5, "max"), [6.0, 6.0, 9.0, 9.0, 9.0])       # -inf padded
    np.testing.assert_allclose(pool1d(x, 5), [9 / 5, 9 / 5, 18 / 5, 15 / 5, 15 / 5], rtol=1e-15)
    np.testing.assert_array_equal(pool1d(x, 1), x)
    assert pool1d(x.astype(np.float32), 3).dtype == np.float32
    assert pool1d(np.zeros((2, 0)), 3).shape == (2, 0)


@given(x=st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=30),
       kernel=st.sampled_from([1, 3, 5, 7, 9]))
@settings(max_examples=60)
def test_pool1d_matches_scipy_filters(x, kernel):
    x = np.array(x)
    np.testing.assert_allclose(pool1d(x, kernel), uniform_filter1d(x, kernel, mode="constant", cval=0.0),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(pool1d(x, kernel, "max"),
                                  maximum_filter1d(x, kernel, mode="constant", cval=-np.inf))


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(3, 16), b=st.integers(1, 8), window=st.integers(1, 6),
       kernel=st.sampled_from([1, 3, 5, 7]), pooling=st.sampled_from(["avg", "max"]))
@settings(max_examples=60)
def test_scores_against_a_direct_computation(seed, n, b, window, kernel, pooling):
    rng = np.random.default_rng(seed)
    window = min(window, n - 1)
    budget = window + 1
    view = random_view(rng, n=n, b=min(b, n), budget=budget)
    policy = SnapKV(window=window, kernel=kernel, pooling=pooling)
    # Direct route: per column, sum the group-mean weights of the last min(w, B) queries, then
    # pool each candidate with explicit loops.
    mean = view.attention.mean(axis=1)
    q = min(window, view.queries.shape[1])
    s = mean[:, -q:, :].sum(axis=1)
    expected = s.copy()
    cand = n - window
    for h in range(2):
        for j in range(cand):
            nbrs = [s[h, i] if 0 <= i < cand else (0.0 if pooling == "avg" else -np.inf)
                    for i in range(j - kernel // 2, j + kernel // 2 + 1)]
            expected[h, j] = sum(nbrs) / kernel if pooling == "avg" else max(nbrs)
    scores = policy.score(view)
    np.testing.assert_allclose(scores, expected, rtol=1e-12, atol=1e-15)
    protected = policy.protected(view)
    assert protected[:, -window:].all() and not protected[:, :-window].any()
    np.testing.assert_array_equal(policy.keep_indices(replace(view, keep=budget)),
                                  reference_keep(scores, view.positions, budget, protected))


@given(seed=st.integers(0, 2**32 - 1), kernel=st.sampled_from([1, 3, 5]))
@settings(max_examples=30)
def test_average_pooling_commutes_with_the_group_mean(seed, kernel):
    """The docs' claim: for average pooling, averaging the group before or after pooling is the same."""
    rng = np.random.default_rng(seed)
    per_head = rng.random((2, 2, 20))
    np.testing.assert_allclose(pool1d(per_head.mean(axis=1), kernel), pool1d(per_head, kernel).mean(axis=1),
                               rtol=1e-12)


@pytest.mark.parametrize(("params", "match"), [
    ({"window": 0}, "window"), ({"window": 2.0}, "window"), ({"kernel": 0}, "kernel"),
    ({"kernel": 4}, "kernel must be odd"), ({"pooling": "median"}, "pooling"),
])
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        SnapKV(**params)


def test_window_must_leave_room(tiny64):
    with pytest.raises(ValueError, match="window must be < budget=32"):
        SnapKV().check(32, TINY)
    with pytest.raises(ValueError, match="window"):
        Engine(tiny64, "snapkv", budget=16)
    SnapKV().check(33, TINY)
    with pytest.raises(ValueError, match="kernel must be odd"):
        pool1d(np.zeros(3), 2)
    with pytest.raises(ValueError, match="pooling"):
        pool1d(np.zeros(3), 3, "sum")


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize(("budget", "block", "window"), [(8, 1, 4), (8, 2, 4), (8, 6, 4), (12, None, 4),
                                                         (40, 3, 32), (40, None, 32)])
def test_engine_runs_and_keeps_the_window(tiny64, budget, block, window, pooling):
    tokens = np.random.default_rng(5).integers(0, 512, 70)
    engine = Engine(tiny64, get("snapkv", window=window, kernel=3, pooling=pooling), budget)
    engine.prefill(tokens, block)
    for cache in engine.caches:
        assert len(cache) == budget
        np.testing.assert_array_equal(cache.positions[:, -window:],
                                      np.broadcast_to(np.arange(70 - window, 70), (2, window)))


def test_no_eviction_when_budget_covers_prompt(tiny64):
    tokens = np.random.default_rng(8).integers(0, 512, 25)
    engine = Engine(tiny64, SnapKV(window=4), 25)
    logits = engine.prefill(tokens, 6, all_logits=True)
    np.testing.assert_allclose(logits, tiny64.forward_full(tokens), rtol=0, atol=1e-10)
    assert engine.stats.evictions == 0
