"""refkv.testing.strategies: the drawn caches and views have the properties they promise."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refkv import policies
from refkv.cache import EMPTY
from refkv.oracle.recipes import library_policies
from refkv.testing import strategies as kvst


@given(kvst.layouts(max_kv_heads=4, max_group=3, head_dims=(2, 8)))
def test_layouts_are_gqa_layouts(layout):
    h, hkv, d = layout
    assert 1 <= hkv <= 4 and h % hkv == 0 and 1 <= h // hkv <= 3 and d in (2, 8)


@settings(max_examples=30)
@given(kvst.kv_caches(bound=2.0))
def test_caches_have_consistent_shapes_dtype_and_bounded_finite_values(cache):
    h, hkv, d = cache.layout
    t = cache.queries.shape[1]
    assert cache.queries.shape == (h, t, d) and cache.keys.shape == cache.values.shape == (hkv, t, d)
    assert cache.queries.dtype == cache.keys.dtype == cache.values.dtype
    assert cache.queries.dtype in (np.float32, np.float64)
    assert 1 <= cache.block_size <= min(8, t) and 1 <= cache.budget <= t + 2
    bounded = [cache.values] if "huge-logits" in cache.adversarial else [cache.values, cache.keys, cache.queries]
    for a in bounded:  # a near tie may add 2**-12 to a key
        assert np.isfinite(a).all() and np.abs(a).max(initial=0) <= 2.0 + 2.0 ** -10
    assert set(cache.adversarial) == set(cache.planted) and len(cache.adversarial) <= 2


@settings(max_examples=30)
@given(kvst.kv_caches(adversarial=["zero-norm-key"]))
def test_zero_norm_key_is_planted(cache):
    head, index = cache.planted["zero-norm-key"]
    assert not cache.keys[head, index].any()


@settings(max_examples=30)
@given(kvst.kv_caches(adversarial=["duplicate-keys"]))
def test_duplicate_keys_are_planted_with_their_values(cache):
    head, a, b = cache.planted["duplicate-keys"]
    assert a < b
    assert np.array_equal(cache.keys[head, a], cache.keys[head, b])
    assert np.array_equal(cache.values[head, a], cache.values[head, b])


@settings(max_examples=30)
@given(kvst.kv_caches(adversarial=["near-tie"]))
def test_near_ties_differ_by_a_tiny_nonzero_offset(cache):
    head, a, b, delta = cache.planted["near-tie"]
    diff = cache.keys[head, b].astype(np.float64) - cache.keys[head, a].astype(np.float64)
    assert diff[0] != 0 and abs(diff[0]) <= 2 * delta and not diff[1:].any()
    assert delta == kvst.NEAR_TIE_DELTA[cache.keys.dtype.name]


@settings(max_examples=30)
@given(kvst.kv_caches(adversarial=["huge-logits"], layout=kvst.layouts(head_dims=(2, 16, 64))))
def test_huge_logits_exceed_thirty(cache):
    qh, qi, ki = cache.planted["huge-logits"]
    h, hkv, d = cache.layout
    q = cache.queries[qh, qi].astype(np.float64)
    k = cache.keys[qh // (h // hkv), ki].astype(np.float64)
    assert abs(q @ k) / np.sqrt(d) > 30.0
    assert qi == cache.queries.shape[1] - 1  # the last query: every key is in its past


@settings(max_examples=30)
@given(kvst.kv_caches(adversarial=list(kvst.ADVERSARIAL)))
def test_all_features_together_do_not_overwrite_each_other(cache):
    head, index = cache.planted["zero-norm-key"]
    assert not cache.keys[head, index].any()
    head, a, b = cache.planted["duplicate-keys"]
    assert np.array_equal(cache.keys[head, a], cache.keys[head, b])
    assert cache.queries.shape[1] >= 6


def test_unknown_features_and_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="adversarial features must be among"):
        kvst.kv_caches(adversarial=["nan-keys"]).example()
    with pytest.raises(ValueError, match="n_kv_heads dividing n_heads"):
        kvst.kv_caches(layout=(3, 2, 4)).example()


def _never_evicts(policy):
    """Whether the policy protects every token (``full``), found by trying it, not by name.

    One token more than the budget, in blocks of one: no earlier eviction, and the last
    one must drop a token unless everything is protected.
    """
    from refkv.oracle.synthetic import random_tokens, replay

    budget = kvst._smallest_budget(policy, (2, 1, 4), 4)
    tokens = random_tokens(np.random.default_rng(0), 2, 1, 4, budget + 1)
    view = replay(policy, tokens, block_size=1, budget=budget, layer=3, n_layers=4)
    return bool(policy.protected(view).all())


@pytest.mark.parametrize("name", library_policies())
def test_views_are_decidable_and_consistent(name):
    policy = policies.get(name)
    if _never_evicts(policy):
        pytest.skip(f"{name} protects every token: it never evicts")

    @settings(max_examples=12, deadline=None)
    @given(kvst.views(policy, layout=kvst.layouts(max_kv_heads=2, max_group=2, head_dims=(4,))))
    def check(view):
        hkv, n, d = view.keys.shape
        b = len(view.query_positions)
        assert view.values.shape == (hkv, n, d) and view.positions.shape == (hkv, n)
        # An uneven cache (AdaKV, PyramidKV's AdaKV form) pads a head's row with empty slots
        # after its real tokens; the real positions increase strictly.
        real = view.positions != EMPTY
        assert (np.diff(real.astype(int), axis=1) <= 0).all()
        assert all((np.diff(view.positions[h, real[h]]) > 0).all() for h in range(hkv))
        assert view.queries.shape[1:] == (b, d) and view.block_keys.shape == (hkv, b, d)
        rows = [np.asarray(row) for row in policy.keep_indices(view)]
        assert all(len(np.unique(row)) == len(row) and real[h, row].all() for h, row in enumerate(rows))
        if real.all() and len({len(row) for row in rows}) == 1:
            assert np.shape(rows) == (hkv, min(view.keep, n))
        else:  # uneven: the layer keeps its total over the heads
            assert sum(len(row) for row in rows) == min(view.keep * hkv, int(real.sum()))
        if policy.evict_before_attention:
            assert view.attention is None and view.positions[real].max(initial=-1) < view.query_positions[0]
        else:
            last = [view.positions[h, real[h]][-b:] for h in range(hkv)]
            assert np.array_equal(last, np.broadcast_to(view.query_positions, (hkv, b)))
        if "attention" in policy.needs and not policy.evict_before_attention:
            visible = view.positions[:, None, None, :] <= view.query_positions[None, None, :, None]
            assert np.allclose(view.attention.sum(axis=-1), 1.0, atol=1e-5)
            assert not view.attention[~np.broadcast_to(visible, view.attention.shape)].any()
        for array in view.fields.values():
            assert array.shape[:2] == (hkv, n)

    check()


@settings(max_examples=40)
@given(kvst.selections())
def test_selections_fit_and_agree_with_an_independent_top_k(problem):
    scores, positions, protected, budget = problem
    assert (np.diff(positions, axis=1) > 0).all() and (protected.sum(axis=1) <= budget).all()
    kept = policies.select(scores, positions, budget, protected)
    for h in range(scores.shape[0]):
        order = sorted(range(scores.shape[1]), key=lambda i: (not protected[h, i], -scores[h, i], -positions[h, i]))
        assert kept[h].tolist() == sorted(order[:budget])


@settings(max_examples=30)
@given(st.data())
def test_views_accept_fixed_settings(data):
    policy = policies.get("keydiff")
    view = data.draw(kvst.views(policy, layout=(4, 2, 8), dtype=np.float32, layer=2))
    assert view.keys.dtype == np.float32 and view.layer == 2 and view.keys.shape[0] == 2
