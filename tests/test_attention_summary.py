"""The query-tiled routes (issue 27): attend over query tiles, and attend_summary's rows and
column sums of the weights, against the definition; policies fed a summary decide as when
fed the whole matrix; one-shot memory does not hold the T x T square."""

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import softmax as scipy_softmax

from refkv.attention import AttentionNeed, attend, attend_summary, attention_weights
from refkv.engine import Engine
from refkv.policies import get

ATTENTION_POLICIES = ("tova", "snapkv", "h2o", "scissorhands", "caote")


def reference_weights(q, k, q_pos, k_pos):
    """Loop-by-loop definition of ``A`` (KeyDiff Eq. 2): (Hkv, g, B, n), zero on the future."""
    heads, b, d = q.shape
    n_kv, n, _ = k.shape
    g = heads // n_kv
    a = np.zeros((n_kv, g, b, n))
    for h in range(heads):
        for i in range(b):
            visible = k_pos[h // g] <= q_pos[i]
            if visible.any():
                a[h // g, h % g, i, visible] = scipy_softmax(k[h // g, visible] @ q[h, i] / np.sqrt(d))
    return a


def qkv_per_head(rng, heads, kv, b, extra, d=8, scale=1.0):
    """Random q, k, v whose KV heads hold different positions (as after eviction, sorted)
    and whose queries are the last B positions of the first head's range."""
    n = b + extra
    span = n + 5
    k_pos = np.stack([np.sort(rng.choice(span, size=n, replace=False)) for _ in range(kv)])
    q_pos = np.arange(span - b, span)
    q = rng.standard_normal((heads, b, d)) * scale
    k = rng.standard_normal((kv, n, d)) * scale
    v = rng.standard_normal((kv, n, d))
    return q, k, v, q_pos, k_pos


@given(seed=st.integers(0, 2**16), b=st.integers(1, 12), extra=st.integers(0, 8), query_chunk=st.integers(1, 7),
       key_chunk=st.integers(1, 9), rows=st.one_of(st.none(), st.integers(0, 14)), sums=st.booleans(),
       scale=st.sampled_from([1.0, 300.0]), groups=st.sampled_from([(4, 2), (3, 1), (2, 2)]))
def test_summary_matches_the_definition(seed, b, extra, query_chunk, key_chunk, rows, sums, scale, groups):
    # GQA groups, per-head positions, logits of ~1e5 (scale 300: a naive exp overflows) and
    # tiles that cut the block anywhere: output, rows and column sums are the definition's.
    rng = np.random.default_rng(seed)
    heads, kv = groups
    q, k, v, q_pos, k_pos = qkv_per_head(rng, heads, kv, b, extra, scale=scale)
    a = reference_weights(q, k, q_pos, k_pos)
    seen = a.sum(-1) > 0  # (Hkv, g, B): a query that sees no key has no output
    if not seen.all():
        return
    expected = np.einsum("kgbn,knd->kgbd", a, v).reshape(heads, b, -1)
    out, summary = attend_summary(q, k, v, q_pos, k_pos, AttentionNeed(rows=rows, column_sums=sums),
                                  key_chunk=key_chunk, query_chunk=query_chunk)
    np.testing.assert_allclose(out, expected, atol=1e-9, rtol=1e-9)
    r = b if rows is None else min(rows, b)
    if r:
        assert summary.rows.shape == (kv, heads // kv, r, k.shape[1])
        np.testing.assert_allclose(summary.rows, a[:, :, b - r:], atol=1e-12, rtol=1e-9)
        assert np.all(summary.rows[a[:, :, b - r:] == 0] == 0)  # exactly zero on the future
    else:
        assert summary.rows is None
    if sums:
        np.testing.assert_allclose(summary.column_sums, a.sum(axis=2), atol=1e-9, rtol=1e-9)
    else:
        assert summary.column_sums is None
    tiled, none = attend(q, k, v, q_pos, k_pos, key_chunk=key_chunk, query_chunk=query_chunk)
    assert none is None
    np.testing.assert_allclose(tiled, expected, atol=1e-9, rtol=1e-9)


def test_query_tiles_skip_only_keys_nobody_sees():
    # A key in the future of a whole tile is skipped; a NaN value there must not leak in,
    # while one that a query of the tile sees makes the output non-finite (and raises).
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((1, 6, 4)), rng.standard_normal((1, 6, 4))
    pos = np.arange(6)
    v[0, 5] = np.nan  # seen by the last query only
    out, _ = attend(q[:, :3], k, v, pos[:3], pos[None], query_chunk=2)
    assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="input v"):
        attend(q, k, v, pos, pos[None], query_chunk=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_summary_keeps_dtype(rng, dtype):
    q, k, v, q_pos, k_pos = (a.astype(dtype) if a.dtype.kind == "f" else a
                             for a in qkv_per_head(rng, 4, 2, 5, 3))
    out, s = attend_summary(q, k, v, q_pos, k_pos, AttentionNeed(rows=2, column_sums=True))
    assert out.dtype == s.rows.dtype == s.column_sums.dtype == dtype


@pytest.mark.parametrize("bad, match", [({"rows": -1}, "rows"), ({"rows": 1.5}, "rows"),
                                        ({"column_sums": "yes"}, "column_sums")])
def test_attention_need_refuses_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        AttentionNeed(**bad)


def test_summary_refuses_bad_arguments(rng):
    args = qkv_per_head(rng, 2, 1, 3, 2)
    with pytest.raises(ValueError, match="need must be an AttentionNeed"):
        attend_summary(*args, {"rows": 1})
    with pytest.raises(ValueError, match="query_chunk"):
        attend_summary(*args, AttentionNeed(rows=1), query_chunk=0)
    with pytest.raises(ValueError, match="query_chunk"):
        attend(*args, query_chunk=0)


def test_one_shot_summary_does_not_hold_the_square():
    # T = 768 queries over 768 keys: A is 2 x 768 x 768 float64 = 9 MiB. The summary of
    # H2O (column sums) or SnapKV (32 rows) with tiles of 64 holds a (2, 64, 768) tile and
    # the result: well under a quarter of it. A T x T intermediate would fail this.
    rng = np.random.default_rng(0)
    t, d = 768, 16
    q, k, v = rng.standard_normal((2, t, d)), rng.standard_normal((1, t, d)), rng.standard_normal((1, t, d))
    pos = np.arange(t)
    square = 2 * t * t * 8
    for need in (AttentionNeed(rows=0, column_sums=True), AttentionNeed(rows=32), AttentionNeed(rows=0)):
        tracemalloc.start()
        attend_summary(q, k, v, pos, pos[None], need, query_chunk=64, key_chunk=256)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < square / 4, (need, peak, square)


# -- policies: a summary gives the same numbers as the whole matrix ----------------------------------

def _views(rng, b=6, n=10):
    """The same view twice: with the whole matrix, and with only a summary of it."""
    from policy_views import random_view

    view = random_view(rng, n_kv=2, g=2, n=n, b=b)
    _, summary = attend_summary(view.queries, view.keys, view.values, view.query_positions, view.positions,
                                AttentionNeed(rows=None, column_sums=True), query_chunk=4)
    return view, replace(view, attention=None, attention_summary=summary)


def test_view_serves_rows_and_sums_from_either(rng):
    whole, summarised = _views(rng)
    for count in (0, 1, 3, 6, 50):
        np.testing.assert_allclose(summarised.attention_last_rows(count), whole.attention_last_rows(count),
                                   atol=1e-12)
        assert whole.attention_last_rows(count).shape[2] == min(count, 6)
    np.testing.assert_allclose(summarised.attention_column_sums(), whole.attention_by_kv_head().sum(axis=-2),
                               atol=1e-12)


def test_view_without_the_needed_part_says_so(rng):
    whole, _ = _views(rng)
    _, summary = attend_summary(whole.queries, whole.keys, whole.values, whole.query_positions, whole.positions,
                                AttentionNeed(rows=2))
    partial = replace(whole, attention=None, attention_summary=summary)
    assert partial.attention_last_rows(2).shape[2] == 2
    with pytest.raises(ValueError, match=r"last 2 rows.*not 3.*attention_need"):
        partial.attention_last_rows(3)
    with pytest.raises(ValueError, match="no column sums"):
        partial.attention_column_sums()


@pytest.mark.parametrize("spec", [("tova", {}), ("tova", {"all_heads": True}), ("snapkv", {"window": 4, "kernel": 3}),
                                  ("h2o", {}), ("scissorhands", {"history": 3, "sink": 1, "recent": 1}),
                                  ("caote", {"base": "snapkv", "base_params": {"window": 2, "kernel": 3}})])
def test_policies_decide_alike_from_a_summary(rng, spec):
    name, params = spec
    policy = get(name, **params)
    whole, _ = _views(rng)
    _, summary = attend_summary(whole.queries, whole.keys, whole.values, whole.query_positions, whole.positions,
                                policy.attention_need(), query_chunk=4)
    summarised = replace(whole, attention=None, attention_summary=summary, budget=5, keep=5)
    whole = replace(whole, budget=5, keep=5)
    for field_name, spec_ in policy.fields(None).items():
        fill = np.full(whole.positions.shape + spec_.shape, spec_.fill, dtype=spec_.dtype)
        whole = replace(whole, fields={**whole.fields, field_name: fill})
        summarised = replace(summarised, fields={**summarised.fields, field_name: fill})
    observed_w, observed_s = policy.observe(whole), policy.observe(summarised)
    assert observed_w.keys() == observed_s.keys()
    for key in observed_w:
        np.testing.assert_allclose(observed_s[key], observed_w[key], atol=1e-12)
        whole = replace(whole, fields={**whole.fields, key: observed_w[key]})
        summarised = replace(summarised, fields={**summarised.fields, key: observed_s[key]})
    np.testing.assert_allclose(policy.score(summarised), policy.score(whole), atol=1e-12)
    np.testing.assert_array_equal(policy.keep_indices(summarised), policy.keep_indices(whole))


@pytest.mark.parametrize("name", ATTENTION_POLICIES)
@pytest.mark.parametrize("block", [None, 32])
def test_engine_needed_route_equals_the_matrix_route(tiny64, name, block):
    # The engine forms only what the policy needs; a trace with views forms the matrix (as
    # the oracle does). Same kept tokens in every layer, logits equal to float64 rounding.
    tokens = np.random.default_rng(7).integers(0, tiny64.config.vocab_size, 200)
    lean = Engine(tiny64, name, budget=48, record=True)
    matrix = Engine(tiny64, name, budget=48, record="views")
    lean_logits, matrix_logits = lean.prefill(tokens, block), matrix.prefill(tokens, block)
    np.testing.assert_allclose(lean_logits, matrix_logits, atol=1e-10, rtol=1e-10)
    for a, b in zip(lean.caches, matrix.caches):
        np.testing.assert_array_equal(a.positions, b.positions)
    assert lean.stats.attention_matrices == 0 and lean.stats.attention_materialised == lean.stats.attention_calls
    assert matrix.stats.attention_matrices == matrix.stats.attention_calls
    assert all(e.view.attention is not None for e in matrix.trace.evictions)


def test_one_shot_matches_blocks_for_full(tiny32):
    # One-shot (the whole prompt in query tiles) and blocks of 16 are the same arithmetic.
    tokens = np.random.default_rng(3).integers(0, tiny32.config.vocab_size, 300)
    one = Engine(tiny32, "full").prefill(tokens, None, all_logits=True)
    blocks = Engine(tiny32, "full").prefill(tokens, 16, all_logits=True)
    np.testing.assert_allclose(one, blocks, atol=2e-4, rtol=2e-4)


def test_attention_weights_rows_are_the_summary_rows(rng):
    # The rows the summary returns are attention_weights' rows (the oracle's definition).
    q, k, v, q_pos, k_pos = qkv_per_head(rng, 4, 2, 9, 4)
    _, summary = attend_summary(q, k, v, q_pos, k_pos, AttentionNeed(rows=5), query_chunk=3)
    np.testing.assert_allclose(summary.rows, attention_weights(q, k, q_pos, k_pos)[:, :, -5:], atol=1e-14)
