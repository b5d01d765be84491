"""KeyDiff (Park et al. 2025): Eqs. 7-8, the anchor and metric variants, the reserve, the engine."""

import doctest
import math
import pathlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refkv.engine import Engine
from refkv.policies import View, get
from refkv.policies.keydiff import EPS, KeyDiff, anchor, anchor_scores, cosine, pairwise_scores, unit_keys

R5 = math.sqrt(5.0)


def view(keys, *, budget=None, b=1, layer=0):
    """A View over (Hkv, n, d) keys at positions 0..n-1, the last ``b`` being the block."""
    keys = np.asarray(keys, dtype=np.float64)
    n_kv, n, d = keys.shape
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (n_kv, n)).copy()
    return View(layer=layer, n_layers=4, keys=keys, values=np.zeros_like(keys), positions=positions, fields={},
                queries=np.zeros((n_kv, b, d)), query_positions=np.arange(n - b, n, dtype=np.int64),
                block_keys=keys[:, -b:], block_values=np.zeros_like(keys[:, -b:]), budget=budget)


def key_arrays(min_n=2):
    """(n, d) keys, 2 <= d <= 6, min_n <= n <= 12, with norms > 0.1: away from the eps floor."""
    n, d = st.integers(min_n, 12), st.integers(2, 6)
    elements = st.floats(-4, 4, allow_nan=False, width=64)
    return st.tuples(n, d).flatmap(lambda s: hnp.arrays(np.float64, s, elements=elements)).filter(
        lambda k: np.linalg.norm(k, axis=-1).min() > 0.1)


# -- the functions, by hand -------------------------------------------------------------------

def test_cosine_by_hand():
    assert cosine(np.array([1.0, 0.0]), np.array([1.0, 1.0])) == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    assert cosine(np.array([1.0, 0.0]), np.array([-3.0, 0.0])) == -1.0
    assert cosine(np.array([0.0, 0.0]), np.array([1.0, 2.0])) == 0.0       # 0 / max(0, eps)
    # Tiny vectors: ||a|| ||b|| = 1e-10 < eps = 1e-8, so the result is 1e-10 / 1e-8 = 0.01.
    assert cosine(np.array([1e-5, 0.0]), np.array([1e-5, 0.0])) == pytest.approx(0.01, rel=1e-12)
    assert cosine(np.array([1e-5, 0.0]), np.array([1e-5, 0.0]), eps=1e-12) == pytest.approx(1.0, rel=1e-12)


def test_anchors_by_hand():
    keys = np.array([[3.0, 4.0], [0.0, 2.0]])
    np.testing.assert_allclose(unit_keys(keys), [[0.6, 0.8], [0.0, 1.0]], rtol=0, atol=1e-15)
    np.testing.assert_allclose(anchor(keys), [0.3, 0.9], rtol=0, atol=1e-15)            # Eq. 8
    np.testing.assert_allclose(anchor(keys, "mean"), [1.5, 3.0], rtol=0, atol=0)
    np.testing.assert_array_equal(anchor(np.array([[1.0, 5.0], [2.0, 0.0], [9.0, 1.0]]), "median"), [2.0, 1.0])
    with pytest.raises(ValueError, match="anchor kind"):
        anchor(keys, "mode")
    with pytest.raises(ValueError, match="at least one"):
        anchor(np.zeros((0, 2)))


def test_anchor_cosine_scores_by_hand():
    # Unit keys (1,0), (0,1), (1,0): anchor (2/3, 1/3), |anchor| = sqrt(5)/3.
    # cos = (2/3)/(sqrt(5)/3) = 2/sqrt(5) for (1,0) and 1/sqrt(5) for (0,1): the odd key out scores highest.
    keys = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    np.testing.assert_allclose(anchor_scores(keys), [-2 / R5, -1 / R5, -2 / R5], rtol=0, atol=1e-15)
    # Scaling a key does not move its unit vector: same scores.
    np.testing.assert_allclose(anchor_scores(keys * [[5.0], [0.5], [2.0]]), [-2 / R5, -1 / R5, -2 / R5],
                               rtol=0, atol=1e-15)


def test_dot_and_euclidean_by_hand():
    keys = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # Mean anchor (1, 2/3).
    np.testing.assert_allclose(anchor_scores(keys, "mean", "dot"), [-2.0, -2 / 3, -5 / 3], rtol=0, atol=1e-15)
    np.testing.assert_allclose(anchor_scores(keys, "mean", "euclidean"),
                               [math.sqrt(13) / 3, math.sqrt(10) / 3, 1 / 3], rtol=0, atol=1e-15)
    # Unit keys (1, 0), (0, 1), (1, 1)/sqrt 2: unit-mean anchor (1 + 1/sqrt 2)/3 (1, 1), with the raw keys.
    a = np.full(2, (1 + 1 / math.sqrt(2)) / 3)
    np.testing.assert_allclose(anchor_scores(keys, "unit_mean", "dot"), -(keys @ a), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="metric"):
        anchor_scores(keys, metric="manhattan")


def test_pairwise_by_hand():
    # Cosine matrix rows: (1, 0, 1), (0, 1, 0), (1, 0, 1); self-similarity included.
    keys = np.array([[1.0, 0.0], [0.0, 3.0], [2.0, 0.0]])
    np.testing.assert_allclose(pairwise_scores(keys), [-2.0, -1.0, -2.0], rtol=0, atol=1e-15)


def test_zero_norm_keys():
    """A zero key has cosine 0 with everything (0 / eps), adds the zero vector to the anchor
    but counts in n: here anchor = ((1,0) + 0) / 2 = (0.5, 0)."""
    keys = np.array([[1.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(anchor(keys), [0.5, 0.0], rtol=0, atol=0)
    np.testing.assert_array_equal(anchor_scores(keys), [-1.0, 0.0])   # so the zero key is kept first
    np.testing.assert_array_equal(pairwise_scores(keys), [-1.0, 0.0])  # its self-similarity is 0 too
    assert np.isfinite(anchor_scores(np.zeros((3, 4)))).all()


def test_zero_anchor_ties_keep_recent():
    """Keys that cancel give a zero anchor: every cosine is 0 and the tie rule keeps the latest."""
    keys = np.array([[[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]]])
    v = view(keys, budget=2)
    np.testing.assert_array_equal(KeyDiff().score(v), [[0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(KeyDiff().keep_indices(replace(v, keep=2)), [[2, 3]])


# -- invariants -------------------------------------------------------------------------------

@given(keys=key_arrays())
def test_eq7_and_eq8_rank_identically(keys):
    """sum_j cos(k_i, k_j) = n |mu| cos(mu, k_i): pairwise = n |mu| * anchor scores."""
    mu = unit_keys(keys).mean(axis=0)
    assume(np.linalg.norm(mu) > 1e-3)
    np.testing.assert_allclose(pairwise_scores(keys), len(keys) * np.linalg.norm(mu) * anchor_scores(keys),
                               rtol=1e-9, atol=1e-9)


@given(keys=key_arrays(), index=st.integers(0, 11), factor=st.floats(1e-3, 1e3))
def test_cosine_scores_unchanged_by_positive_scaling(keys, index, factor):
    index %= len(keys)
    scaled = keys.copy()
    scaled[index] *= factor
    for scores in (anchor_scores, pairwise_scores):
        np.testing.assert_allclose(scores(scaled), scores(keys), rtol=1e-9, atol=1e-12)


@given(keys=key_arrays(), seed=st.integers(0, 2**16))
def test_scores_permute_with_the_tokens(keys, seed):
    perm = np.random.default_rng(seed).permutation(len(keys))
    # A permutation changes the order of the anchor's sum, so the anchor moves by up to
    # |da| <= n u max||k|| (u = 2^-53), and a cosine a.k / max(||a|| ||k||, eps) by up to
    # |da| ||k|| / max(||a|| ||k||, eps). Negligible for a real anchor; when the keys cancel,
    # rounding noise *is* the anchor and is divided by eps = 1e-8: allow exactly that much.
    kmax = np.linalg.norm(keys, axis=-1).max()
    for kind in ("unit_mean", "mean", "median"):
        a = np.linalg.norm(anchor(keys, kind))
        noise = 2 * len(keys) * 2.0**-53 * kmax * max(kmax, 1.0) / max(a * 0.1, EPS)
        for metric in ("cosine", "dot", "euclidean"):
            np.testing.assert_allclose(anchor_scores(keys[perm], kind, metric), anchor_scores(keys, kind, metric)[perm],
                                       rtol=1e-9, atol=1e-12 + noise)
    np.testing.assert_allclose(pairwise_scores(keys[perm]), pairwise_scores(keys)[perm], rtol=1e-9, atol=1e-12)


@given(keys=key_arrays(min_n=3), budget=st.integers(1, 12), reserve=st.floats(0, 0.99))
def test_policy_keeps_top_scores_and_reserve(keys, budget, reserve):
    """Budget respected, the floor(reserve * N) latest kept, the rest the best scores."""
    n = len(keys)
    v = view(keys[None], budget=budget)
    policy = KeyDiff(reserve=reserve)
    kept = policy.keep_indices(replace(v, keep=budget))
    m = min(budget, n)
    assert kept.shape == (1, m)
    reserved = math.floor(reserve * budget)
    assert set(range(n - min(reserved, n), n)) <= set(kept[0])
    # Among the rest, nothing evicted scores above anything kept (ties may go either way only by position).
    scores = anchor_scores(keys)
    free_kept = [j for j in kept[0] if j < n - reserved]
    evicted = sorted(set(range(n)) - set(kept[0]))
    if free_kept and evicted:
        assert min(scores[free_kept]) >= max(scores[evicted])
    np.testing.assert_array_equal(policy.keep_indices(replace(v, keep=budget)), kept)  # deterministic


def test_reserve_protects_recent_tokens_by_hand():
    # Scores: the three copies of (1, 0) are worst, (0, 1) best; N = 4, reserve 0.5 -> last 2 kept.
    keys = np.array([[[0.0, 1.0], [1.0, 1.0], [1.0, 0.1], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])
    v = view(keys, budget=4)
    assert KeyDiff(reserve=0.5).reserved(4) == 2
    assert KeyDiff(reserve=0.74).reserved(4) == 2      # floor(2.96)
    np.testing.assert_array_equal(KeyDiff(reserve=0.5).protected(v), [[0, 0, 0, 0, 1, 1]])
    kept = KeyDiff(reserve=0.5).keep_indices(replace(v, keep=4))
    scores = anchor_scores(keys[0])
    # The two free places go to the best two of columns 0..3.
    best_two = sorted(np.argsort(-scores[:4])[:2])
    np.testing.assert_array_equal(kept, [[*best_two, 4, 5]])
    np.testing.assert_array_equal(KeyDiff().keep_indices(replace(v, keep=4))[0][:2], [0, 1])


def test_anchor_uses_cache_and_block():
    """Block mode: the anchor is formed from every candidate (cache + block, Eq. 6's C_i)."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 9, 4))
    v = view(keys, budget=5, b=4)
    np.testing.assert_allclose(KeyDiff().score(v), anchor_scores(keys), rtol=0, atol=0)
    cache_only = anchor_scores(keys[:, :5])
    assert not np.allclose(KeyDiff().score(v)[:, :5], cache_only)


def test_variants_are_dispatched():
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2, 7, 3))
    v = view(keys, budget=3)
    np.testing.assert_allclose(KeyDiff(anchor="pairwise").score(v), pairwise_scores(keys), rtol=0, atol=0)
    for kind in ("mean", "median"):
        for metric in ("cosine", "dot", "euclidean"):
            np.testing.assert_allclose(KeyDiff(anchor=kind, metric=metric).score(v),
                                       anchor_scores(keys, kind, metric), rtol=0, atol=0)


def test_float32_scores_stay_float32():
    keys = np.random.default_rng(2).standard_normal((2, 6, 4)).astype(np.float32)
    for kind in ("unit_mean", "mean", "median"):
        for metric in ("cosine", "dot", "euclidean"):
            assert anchor_scores(keys, kind, metric).dtype == np.float32
    assert pairwise_scores(keys).dtype == np.float32


@pytest.mark.parametrize(("params", "name"), [
    ({"anchor": "mode"}, "anchor"), ({"metric": "l1"}, "metric"), ({"reserve": 1.0}, "reserve"),
    ({"reserve": -0.1}, "reserve"), ({"reserve": True}, "reserve"), ({"reserve": "0.5"}, "reserve"),
    ({"anchor": "pairwise", "metric": "dot"}, "metric"), ({"eps": 0.0}, "eps"), ({"eps": float("nan")}, "eps"),
])
def test_bad_parameters(params, name):
    with pytest.raises(ValueError, match=name):
        KeyDiff(**params)


# -- through the engine -----------------------------------------------------------------------

def simulate_layer0(model, tokens, budget, block, score):
    """Block prompt processing (Eq. 6) of layer 0 by hand: layer 0's keys depend only on the
    tokens, so they can be computed once, and each step keeps the top N of cache + block."""
    _, k, _ = model.qkv(0, model.embed(tokens), model.rope(np.arange(len(tokens))))
    kept = [np.zeros(0, dtype=np.int64) for _ in range(k.shape[0])]
    for start in range(0, len(tokens), block or len(tokens)):
        stop = min(start + (block or len(tokens)), len(tokens))
        for h in range(k.shape[0]):
            candidates = np.r_[kept[h], start:stop]
            if len(candidates) > budget:
                s = score(k[h, candidates])
                order = sorted(range(len(candidates)), key=lambda j: (s[j], candidates[j]), reverse=True)
                candidates = np.sort(candidates[order[:budget]])
            kept[h] = candidates
    return np.array(kept)


@pytest.mark.parametrize("params", [{}, {"anchor": "pairwise"}, {"anchor": "median", "metric": "dot"}])
@pytest.mark.parametrize(("block", "budget"), [(1, 12), (5, 12), (16, 20), (None, 12), (3, 40)])
def test_engine_layer0_matches_hand_simulation(tiny64, params, block, budget):
    tokens = np.random.default_rng(block or 0).integers(0, tiny64.config.vocab_size, 48)
    engine = Engine(tiny64, KeyDiff(**params), budget)
    engine.prefill(tokens, block)
    policy = KeyDiff(**params)

    def score(keys):
        return policy.score(view(keys[None]))[0]

    np.testing.assert_array_equal(engine.caches[0].positions, simulate_layer0(tiny64, tokens, budget, block, score))
    assert engine.stats.attention_materialised == 0 and engine.stats.attention_calls > 0
    assert all(len(c) == min(budget, 48) for c in engine.caches)


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("block", [1, 4, 13, None])
def test_engine_runs_attention_free(tiny64, tiny32, dtype_name, block):
    model = tiny64 if dtype_name == "float64" else tiny32
    tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, 40)
    engine = Engine(model, get("keydiff", reserve=0.25), budget=16)
    logits = engine.prefill(tokens, block)
    assert logits.dtype == model.dtype and np.isfinite(logits).all()
    assert engine.stats.attention_materialised == 0
    for cache in engine.caches:
        assert cache.positions.shape == (2, 16)
        assert set(range(36, 40)) <= set(cache.positions[0])   # floor(0.25 * 16) = 4 latest
    new = engine.generate(logits, 5)
    assert len(new) == 5 and engine.stats.attention_materialised == 0


def test_docs_page_examples_run():
    """The worked example of docs/policies/keydiff.rst runs as printed."""
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies" / "keydiff.rst"
    assert doctest.testfile(str(page), module_relative=False).failed == 0
