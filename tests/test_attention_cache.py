"""Attention over cache + block, and the cache's gather/append rules."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import softmax as scipy_softmax

from refkv.attention import attend, attention_weights, softmax
from refkv.cache import FieldSpec, LayerCache


def random_qkv(rng, heads=4, kv=2, b=3, n=9, d=8, scale=1.0):
    q = rng.standard_normal((heads, b, d)) * scale
    k = rng.standard_normal((kv, n, d)) * scale
    v = rng.standard_normal((kv, n, d))
    q_pos = np.arange(n - b, n)
    k_pos = np.broadcast_to(np.arange(n), (kv, n))
    return q, k, v, q_pos, k_pos


def reference_attention(q, k, v, q_pos, k_pos):
    """Loop-by-loop definition (KeyDiff Eq. 2) for one query head at a time."""
    heads, b, d = q.shape
    g = heads // k.shape[0]
    out = np.zeros_like(q)
    for h in range(heads):
        kv = h // g
        for i in range(b):
            visible = k_pos[kv] <= q_pos[i]
            logits = k[kv, visible] @ q[h, i] / np.sqrt(d)
            out[h, i] = scipy_softmax(logits) @ v[kv, visible]
    return out


@given(seed=st.integers(0, 2**16), chunk=st.integers(1, 12), b=st.integers(1, 6), extra=st.integers(0, 6))
def test_both_routes_match_the_definition(seed, chunk, b, extra):
    rng = np.random.default_rng(seed)
    q, k, v, q_pos, k_pos = random_qkv(rng, b=b, n=b + extra)
    expected = reference_attention(q, k, v, q_pos, k_pos)
    out_w, weights = attend(q, k, v, q_pos, k_pos, return_weights=True)
    out_c, none = attend(q, k, v, q_pos, k_pos, key_chunk=chunk)
    assert none is None
    np.testing.assert_allclose(out_w, expected, atol=1e-12)
    np.testing.assert_allclose(out_c, expected, atol=1e-12)
    assert weights.shape == (2, 2, b, b + extra)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-12)
    assert np.all(weights[..., q_pos[:, None] < k_pos[0][None, :]] == 0)  # no weight on the future


def test_single_tile_is_bitwise_the_weights_route(rng):
    q, k, v, q_pos, k_pos = random_qkv(rng, n=20, b=5)
    np.testing.assert_array_equal(attend(q, k, v, q_pos, k_pos, return_weights=True)[0],
                                  attend(q, k, v, q_pos, k_pos, key_chunk=20)[0])


@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), scale=st.sampled_from([1.0, 300.0]),
       future=st.integers(0, 3))
def test_a_single_query_matches_the_definition(seed, n, scale, future):
    # B = 1 (decoding): per-head shuffled positions, keys in the query's future, and logits
    # of ~1e5 (a naive exp overflows) must all give the definition's output.
    rng = np.random.default_rng(seed)
    q, k, v, _, _ = random_qkv(rng, b=1, n=n + future, scale=scale)
    k_pos = np.stack([rng.permutation(n + future) for _ in range(2)])
    q_pos = np.array([n - 1])  # keys at positions n .. n + future - 1 are in its future
    out, none = attend(q, k, v, q_pos, k_pos)
    assert none is None
    np.testing.assert_allclose(out, reference_attention(q, k, v, q_pos, k_pos), atol=1e-9, rtol=1e-12)
    np.testing.assert_allclose(out, attend(q, k, v, q_pos, k_pos, return_weights=True)[0], atol=1e-9, rtol=1e-12)


def test_gqa_group_mapping(rng):
    """Query head h reads KV head h // g: giving KV head 1 zero values zeroes heads 2 and 3 only."""
    q, k, v, q_pos, k_pos = random_qkv(rng)
    v[1] = 0.0
    out, _ = attend(q, k, v, q_pos, k_pos)
    assert np.all(out[2:] == 0) and np.all(np.abs(out[:2]).sum(-1) > 0)


def test_huge_logits_are_stable(rng):
    q, k, v, q_pos, k_pos = random_qkv(rng, scale=300.0)  # logits ~ 1e5: naive exp overflows
    for out in (attend(q, k, v, q_pos, k_pos, return_weights=True)[0], attend(q, k, v, q_pos, k_pos, key_chunk=2)[0]):
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, reference_attention(q, k, v, q_pos, k_pos), atol=1e-9)


def test_per_head_positions_mask_by_position_not_index():
    """After eviction heads hold different positions; the mask follows positions."""
    q = np.ones((2, 1, 2))
    k = np.zeros((2, 2, 2))
    v = np.array([[[1.0, 0], [0, 1.0]], [[1.0, 0], [0, 1.0]]])
    k_pos = np.array([[0, 5], [3, 9]])
    out, _ = attend(q, k, v, np.array([5]), k_pos)
    np.testing.assert_allclose(out[0, 0], [0.5, 0.5])  # both visible, equal logits
    np.testing.assert_allclose(out[1, 0], [1.0, 0.0])  # position 9 is in the future


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_keeps_dtype(rng, dtype):
    q, k, v, q_pos, k_pos = (a.astype(dtype) if a.dtype.kind == "f" else a for a in random_qkv(rng))
    assert attend(q, k, v, q_pos, k_pos)[0].dtype == dtype
    out, w = attend(q, k, v, q_pos, k_pos, return_weights=True)
    assert out.dtype == dtype and w.dtype == dtype
    assert attention_weights(q, k, q_pos, k_pos).dtype == dtype
    assert softmax(np.zeros(3, dtype=dtype)).dtype == dtype


def test_key_chunk_must_be_positive(rng):
    with pytest.raises(ValueError, match="key_chunk"):
        attend(*random_qkv(rng), key_chunk=0)


# -- cache --------------------------------------------------------------------------------------

def make_cache():
    return LayerCache(2, 3, np.float64, {"score": FieldSpec(np.float64, (), 0.5),
                                         "code": FieldSpec(np.uint8, (2,), 7)})


def test_append_assigns_positions_and_fills_fields():
    cache = make_cache()
    k = np.arange(2 * 4 * 3, dtype=float).reshape(2, 4, 3)
    np.testing.assert_array_equal(cache.append(k, -k), [0, 1, 2, 3])
    np.testing.assert_array_equal(cache.append(k[:, :2], -k[:, :2]), [4, 5])
    assert len(cache) == 6 and cache.next_position == 6
    np.testing.assert_array_equal(cache.positions, [[0, 1, 2, 3, 4, 5]] * 2)
    assert np.all(cache.fields["score"] == 0.5) and cache.fields["code"].shape == (2, 6, 2)
    assert np.all(cache.fields["code"] == 7)


def test_keep_gathers_everything_together():
    cache = make_cache()
    k = np.arange(2 * 5 * 3, dtype=float).reshape(2, 5, 3)
    cache.append(k, -k)
    cache.set_field("score", np.arange(10, dtype=float).reshape(2, 5))
    cache.set_field("code", np.arange(20, dtype=np.uint8).reshape(2, 5, 2))
    cache.keep(np.array([[0, 3], [1, 4]]))
    np.testing.assert_array_equal(cache.positions, [[0, 3], [1, 4]])
    np.testing.assert_array_equal(cache.keys[0], k[0, [0, 3]])
    np.testing.assert_array_equal(cache.values[1], -k[1, [1, 4]])
    np.testing.assert_array_equal(cache.fields["score"], [[0, 3], [6, 9]])
    np.testing.assert_array_equal(cache.fields["code"][1], [[12, 13], [18, 19]])
    # positions keep counting from the tokens seen, not from the cache length
    np.testing.assert_array_equal(cache.append(k[:, :1], k[:, :1]), [5])


def test_cache_errors():
    cache = make_cache()
    k = np.zeros((2, 4, 3))
    cache.append(k, k)
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(np.array([[1, 1], [0, 2]]))
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(np.array([[2, 1], [0, 2]]))
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        cache.keep(np.array([[0, 4], [0, 1]]))
    with pytest.raises(ValueError, match="shape"):
        cache.keep(np.array([0, 1]))
    with pytest.raises(ValueError, match="shape"):
        cache.append(np.zeros((3, 1, 3)), np.zeros((3, 1, 3)))
    with pytest.raises(ValueError, match="dtype"):
        cache.append(np.zeros((2, 1, 3), np.float32), np.zeros((2, 1, 3), np.float32))
    with pytest.raises(ValueError, match="unknown cache field"):
        cache.set_field("nope", np.zeros((2, 4)))
    with pytest.raises(ValueError, match="must have shape"):
        cache.set_field("score", np.zeros((2, 3)))


def test_cache_memory_is_bounded_by_budget_plus_block(tiny64):
    """Nothing O(T) is kept: after 400 tokens under N = 32 each layer holds exactly 32 tokens, and
    bytes are those of 32 tokens."""
    from refkv.engine import Engine

    engine = Engine(tiny64, "sink", budget=32)
    engine.prefill(np.arange(400) % 512, 16)
    one_token = 2 * 16 * 8 * 2 + 2 * 8  # keys + values (2 heads x 16 dims x 8 bytes), positions
    for cache in engine.caches:
        assert len(cache) == 32 and cache.nbytes == 32 * one_token
    assert engine.stats.peak_cache_tokens == 32 + 16


# -- the growing buffer: O(1) appends, views that never change under the caller -------------

def _address(array) -> int:
    return array.__array_interface__["data"][0]


def test_views_are_read_only():
    cache = make_cache()
    cache.append(np.ones((2, 3, 3)), np.ones((2, 3, 3)))
    for array in (cache.keys, cache.values, cache.positions, *cache.fields.values()):
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 0
    with pytest.raises(TypeError):  # state is written with set_field, never by assigning an entry
        cache.fields["score"] = np.zeros((2, 3))


def test_append_writes_in_place_and_grows_geometrically():
    """A decoding step does not copy the cache: the buffer moves only when full, and a run of
    single-token appends reallocates O(log T) times, not T times."""
    cache = LayerCache(2, 3, np.float64)
    moves, address = 0, None
    for t in range(1000):
        cache.append(np.full((2, 1, 3), t, dtype=float), np.zeros((2, 1, 3)))
        now = _address(cache.keys)
        moves += address is not None and now != address
        address = now
    assert moves <= 20  # a growth factor of 1.5 needs ~17 moves to reach 1000
    assert len(cache) == 1000 and cache.capacity < 1.5 * 1000 + 2
    np.testing.assert_array_equal(cache.keys[0, :, 0], np.arange(1000))
    np.testing.assert_array_equal(cache.positions, np.broadcast_to(np.arange(1000), (2, 1000)))


@given(blocks=st.lists(st.integers(1, 9), min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_a_held_view_never_changes(blocks, seed):
    """Whatever appends and evictions follow, a view taken earlier keeps the values it showed."""
    rng = np.random.default_rng(seed)
    cache = make_cache()
    held = []  # (view, copy of it when taken)
    for b in blocks:
        k = rng.standard_normal((2, b, 3))
        cache.append(k, -k)
        cache.set_field("score", rng.standard_normal((2, len(cache))))
        for view in (cache.keys, cache.values, cache.positions, cache.fields["score"], cache.fields["code"]):
            held.append((view, view.copy()))
        if len(cache) > 4 and rng.random() < 0.6:  # evict to a random size, different per head
            m = int(rng.integers(1, len(cache)))
            cache.keep(np.sort(np.stack([rng.choice(len(cache), m, replace=False) for _ in range(2)]), axis=1))
        for view, then in held:
            np.testing.assert_array_equal(view, then)


def test_keep_compacts_in_place_when_no_view_is_held():
    cache = make_cache()
    k = np.arange(2 * 6 * 3, dtype=float).reshape(2, 6, 3)
    cache.append(k, -k)
    address = _address(cache.keys)  # an int: no view of the buffer survives this line
    cache.keep(np.array([[1, 4], [0, 5]]))
    assert _address(cache.keys) == address
    np.testing.assert_array_equal(cache.keys, np.stack([k[0, [1, 4]], k[1, [0, 5]]]))


def test_keep_and_set_field_copy_on_write_when_a_view_is_held():
    cache = make_cache()
    k = np.arange(2 * 6 * 3, dtype=float).reshape(2, 6, 3)
    cache.append(k, -k)
    keys, score = cache.keys, cache.fields["score"]
    cache.set_field("score", np.ones((2, 6)))
    cache.keep(np.array([[1, 4], [0, 5]]))
    np.testing.assert_array_equal(keys, k)          # the old view: untouched
    np.testing.assert_array_equal(score, 0.5)       # the fill value it showed
    assert not np.shares_memory(keys, cache.keys)
    np.testing.assert_array_equal(cache.keys, np.stack([k[0, [1, 4]], k[1, [0, 5]]]))
    np.testing.assert_array_equal(cache.fields["score"], 1.0)


def test_set_field_copies_the_callers_array():
    cache = make_cache()
    cache.append(np.zeros((2, 2, 3)), np.zeros((2, 2, 3)))
    mine = np.ones((2, 2))
    cache.set_field("score", mine)
    mine[:] = 9.0  # the caller's array is theirs: changing it later does not reach the cache
    np.testing.assert_array_equal(cache.fields["score"], 1.0)
    cache.set_field("code", np.full((2, 2, 2), 300.0))  # cast to the declared dtype, as before
    assert cache.fields["code"].dtype == np.uint8


@given(blocks=st.lists(st.integers(1, 9), min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_buffer_matches_plain_arrays_when_nothing_is_held(blocks, seed):
    """With no view alive every keep compacts in place; the contents must equal those of plain
    concatenate-and-gather arrays (the cache's definition)."""
    rng = np.random.default_rng(seed)
    cache = make_cache()
    keys, positions, score = np.zeros((2, 0, 3)), np.zeros((2, 0), dtype=np.int64), np.zeros((2, 0))
    for b in blocks:
        k = rng.standard_normal((2, b, 3))
        cache.append(k, -k)
        keys = np.concatenate([keys, k], axis=1)
        seen = cache.next_position
        positions = np.concatenate([positions, np.broadcast_to(np.arange(seen - b, seen), (2, b))], axis=1)
        new_score = rng.standard_normal((2, len(cache)))
        cache.set_field("score", new_score)
        score = new_score.copy()
        if len(cache) > 4:
            m = int(rng.integers(1, len(cache)))
            kept = np.sort(np.stack([rng.choice(len(cache), m, replace=False) for _ in range(2)]), axis=1)
            cache.keep(kept)
            keys = np.take_along_axis(keys, kept[:, :, None], axis=1)
            positions = np.take_along_axis(positions, kept, axis=1)
            score = np.take_along_axis(score, kept, axis=1)
        assert np.array_equal(cache.keys.copy(), keys) and np.array_equal(cache.values.copy(), -keys)
        assert np.array_equal(cache.positions.copy(), positions)
        assert np.array_equal(cache.fields["score"].copy(), score)
