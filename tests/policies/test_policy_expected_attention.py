"""ExpectedAttention (kvpress): its equations against independent recomputations, and kvpress itself.

The reference here is built another way than the policy: the queries before RoPE come
from the model with RoPE switched off (not by rotating back), each RoPE matrix is built
from its 2 x 2 rotation blocks and the average formed by a loop, and the expected logits,
the softmax and the value norms are sums written out per head and per key.
"""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refkv.engine import Engine
from refkv.model import TINY
from refkv.model.layers import apply_rope, rope_angles
from refkv.policies import get
from refkv.policies.expected_attention import (
    ExpectedAttention,
    averaged_rotation,
    expected_logits,
    unrotated_queries,
)

T = 40


class _Catch:
    """Stands in for the engine's policy and keeps every eviction view."""

    def __init__(self, policy):
        self.policy, self.views = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def keep_indices(self, view):
        self.views.append(view)
        return self.policy.keep_indices(view)


def one_shot_views(model, policy, tokens, budget):
    """The engine's eviction view of every layer in one-shot mode (the whole prompt, one block)."""
    catcher = _Catch(policy)
    engine = Engine(model, policy, budget)
    engine.policy = catcher
    engine.prefill(tokens, None)
    return catcher.views, engine


def rope_matrix(p: int, d: int, base: float) -> np.ndarray:
    """R_p built from its 2 x 2 blocks: dimension i pairs with i + d/2, angle p * base^(-2i/d)."""
    r = np.zeros((d, d))
    half = d // 2
    for i in range(half):
        a = p * base ** (-2 * i / d)
        c, s = math.cos(a), math.sin(a)
        r[i, i], r[i, i + half] = c, -s
        r[i + half, i], r[i + half, i + half] = s, c
    return r


def reference_scores(model, tokens, layer_input, view, policy) -> np.ndarray:
    """(Hkv, n) ExpectedAttention scores, computed the slow way from the layer's input."""
    cfg = model.config
    d, hkv, g = cfg.d_head, cfg.n_kv_heads, cfg.group_size
    t = len(tokens)
    no_rope = (np.ones((t, d)), np.zeros((t, d)))
    q_raw, _, _ = model.qkv(view.layer, layer_input, no_rope)  # (H, T, d) before RoPE
    s = policy.n_sink
    r_bar = sum(rope_matrix(p, d, cfg.rope_base) for p in range(t, t + policy.n_future_positions))
    r_bar = r_bar / policy.n_future_positions
    keys, values = view.keys.astype(np.float64), view.values.astype(np.float64)
    n = keys.shape[1]
    out = np.zeros((hkv, n))
    for kv in range(hkv):
        averaged = np.zeros(n - s)
        for member in range(g):
            qs = q_raw[kv * g + member, s:]  # (m, d)
            mu = qs.mean(axis=0)
            cov = np.cov(qs, rowvar=False, bias=True)
            mu, cov = r_bar @ mu, r_bar @ cov @ r_bar.T
            z = []
            for j in range(s, n):
                k = keys[kv, j]
                term = sum(mu[i] * k[i] for i in range(d)) / math.sqrt(d)
                if policy.use_covariance:
                    term += sum(k[i] * cov[i, jj] * k[jj] for i in range(d) for jj in range(d)) / (2 * d)
                z.append(term)
            top = max(z)
            weights = [math.exp(x - top) for x in z]
            total = sum(weights)
            averaged += np.array([w / total for w in weights]) / g
        if policy.use_vnorm:
            norms = np.array([math.sqrt(sum(x * x for x in values[kv, j])) for j in range(s, n)])
            averaged = (averaged + policy.epsilon) * norms
        out[kv, s:] = averaged
    return out


@pytest.mark.parametrize("params", [{}, {"n_future_positions": 16, "epsilon": 0.01},
                                    {"use_covariance": False, "n_sink": 2}, {"use_vnorm": False}])
def test_scores_equal_the_slow_recomputation(tiny64, params):
    policy = ExpectedAttention(**params)
    tokens = np.random.default_rng(5).integers(0, TINY.vocab_size, T)
    views, _ = one_shot_views(tiny64, policy, tokens, 16)
    assert [v.layer for v in views] == list(range(TINY.n_layers))
    view = views[0]
    expected = reference_scores(tiny64, tokens, tiny64.embed(tokens), view, policy)
    got = policy.score(view)
    s = policy.n_sink
    np.testing.assert_allclose(got[:, s:], expected[:, s:], rtol=1e-9, atol=1e-14)
    # The sinks: kvpress's padding, max + 1, and protected.
    np.testing.assert_array_equal(got[:, :s], np.full((TINY.n_kv_heads, s), expected[:, s:].max() + 1.0))
    assert policy.protected(view)[:, :s].all() and not policy.protected(view)[:, s:].any()
    kept = policy.keep_indices(view)
    assert kept.shape == (TINY.n_kv_heads, 16) and (kept[:, :s] == np.arange(s)).all()


def test_the_expected_weight_is_the_gaussian_mean():
    """Eq. behind z: E[exp(q.k / sqrt d)] = exp(mu.k / sqrt d + k^T Sigma k / 2d) for q ~ N(mu, Sigma)."""
    rng = np.random.default_rng(11)
    d, draws = 4, 400_000
    a = rng.standard_normal((d, d)) * 0.4
    cov = a @ a.T
    mu = rng.standard_normal(d)
    keys = rng.standard_normal((1, 3, d))
    z = expected_logits(keys, mu[None], cov[None])[0, 0]  # (3,)
    samples = rng.multivariate_normal(mu, cov, size=draws)  # (draws, d)
    weights = np.exp(samples @ keys[0].T / math.sqrt(d))  # (draws, 3)
    mean, stderr = weights.mean(axis=0), weights.std(axis=0) / math.sqrt(draws)
    assert np.all(np.abs(mean - np.exp(z)) < 6 * stderr), (mean, np.exp(z), stderr)
    # Without the covariance term the same sample mean is clearly larger than exp(z): the term matters.
    z_mean_only = expected_logits(keys, mu[None], None)[0, 0]
    assert np.all(mean - np.exp(z_mean_only) > 6 * stderr)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 6), st.integers(0, 2 ** 31 - 1))
def test_unrotating_inverts_rope(start, length, seed):
    q = np.random.default_rng(seed).standard_normal((2, length, TINY.d_head))
    positions = np.arange(start, start + length)
    rotated = apply_rope(q, *rope_angles(positions, TINY.d_head, TINY.rope_base, np.float64))
    np.testing.assert_allclose(unrotated_queries(rotated, positions, TINY), q, rtol=0, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 3000), st.integers(1, 40))
def test_averaged_rotation_is_the_mean_of_the_block_matrices(start, count):
    d = TINY.d_head
    expected = sum(rope_matrix(p, d, TINY.rope_base) for p in range(start, start + count)) / count
    np.testing.assert_allclose(averaged_rotation(start, count, TINY), expected, rtol=0, atol=1e-12)


def test_gqa_scores_are_the_group_mean_of_per_head_softmaxes(tiny64):
    policy = ExpectedAttention(n_future_positions=8)
    tokens = np.random.default_rng(2).integers(0, TINY.vocab_size, 24)
    view = one_shot_views(tiny64, policy, tokens, 12)[0][1]
    mu, cov = policy.statistics(view)
    s = policy.n_sink
    z = expected_logits(view.keys[:, s:], mu, cov)  # (Hkv, g, n - s)
    per_head = np.exp(z - z.max(-1, keepdims=True))
    per_head /= per_head.sum(-1, keepdims=True)
    norms = np.linalg.norm(view.values[:, s:], axis=-1)
    np.testing.assert_allclose(policy.score(view)[:, s:], per_head.mean(axis=1) * norms, rtol=1e-12)
    # Averaging the logits instead (another plausible order) gives other scores: the order is tested.
    pooled = np.exp(z.mean(axis=1) - z.mean(axis=1).max(-1, keepdims=True))
    pooled /= pooled.sum(-1, keepdims=True)
    assert not np.allclose(pooled * norms, policy.score(view)[:, s:], rtol=1e-6)


def test_runs_in_blocks_and_token_by_token(tiny64):
    tokens = np.random.default_rng(4).integers(0, TINY.vocab_size, 48)
    for block in (1, 8, None):
        engine = Engine(tiny64, "expected_attention", 20)
        engine.prefill(tokens, block)
        for cache in engine.caches:
            assert cache.positions.shape == (TINY.n_kv_heads, 20)
            assert (cache.positions[:, :4] == np.arange(4)).all()


@pytest.mark.parametrize(("params", "match"), [
    ({"n_future_positions": 0}, "n_future_positions"),
    ({"n_sink": -1}, "n_sink"),
    ({"use_covariance": "yes"}, "use_covariance"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"),
])
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        get("expected_attention", **params)


def test_refusals(tiny64):
    with pytest.raises(ValueError, match="budget must be > n_sink"):
        Engine(tiny64, ExpectedAttention(n_sink=4), 4)
    view = one_shot_views(tiny64, ExpectedAttention(), np.arange(20), 8)[0][0]
    with pytest.raises(ValueError, match=r"view\.config"):
        ExpectedAttention().score(replace(view, config=None))
    with pytest.raises(ValueError, match="a token after them"):
        ExpectedAttention(n_sink=30).score(view)
    early = replace(view, queries=view.queries[:, :2], query_positions=view.query_positions[:2])
    with pytest.raises(ValueError, match="after the first n_sink"):
        ExpectedAttention().score(early)


# -- against kvpress's press itself (the interop extra) -----------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("params", [{}, {"use_covariance": False, "n_sink": 2, "n_future_positions": 64}])
def test_scores_and_kept_sets_equal_kvpress(tiny64, params):
    """One-shot on the tiny model: kvpress's ExpectedAttentionPress scores layer 0 from the layer's
    normalised input (its own pre-RoPE queries, its own RoPE module) like refkv does from the view."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("kvpress")
    import types

    from kvpress import ExpectedAttentionPress
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from refkv.model.layers import rms_norm

    cfg = tiny64.config
    policy = ExpectedAttention(**params)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, T)
    view = one_shot_views(tiny64, policy, tokens, 16)[0][0]
    llama = LlamaConfig(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                        head_dim=cfg.d_head, rope_theta=cfg.rope_base, max_position_embeddings=cfg.max_positions,
                        intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers, vocab_size=cfg.vocab_size)
    weights = tiny64.weights.layers[0]
    q_proj = torch.nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=False).double()
    with torch.no_grad():
        q_proj.weight.copy_(torch.from_numpy(weights.wq.T.copy()))
    module = types.SimpleNamespace(q_proj=q_proj, head_dim=cfg.d_head, config=llama,
                                   rotary_emb=LlamaRotaryEmbedding(llama).double())
    hidden = rms_norm(tiny64.embed(tokens), weights.attn_norm, cfg.norm_eps)  # the attention layer's input
    press = ExpectedAttentionPress(compression_ratio=0.6, **params)
    with torch.no_grad():
        # The cache hands out read-only views; torch wants writable arrays, so give it copies.
        theirs = press.score(module, torch.from_numpy(hidden)[None], torch.from_numpy(view.keys.copy())[None],
                             torch.from_numpy(view.values.copy())[None], None, {})[0].numpy()
    ours = policy.score(view)
    # HF forms the RoPE frequencies in float32, so the scores agree to ~1e-8, not to the last bit.
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-9)
    n_kept = max(1, int(T * (1 - press.compression_ratio)))  # kvpress's compute_n_kept
    kept = ExpectedAttention(**params).keep_indices(replace(view, keep=n_kept))
    theirs_kept = np.sort(np.argsort(-theirs, axis=-1, kind="stable")[:, :n_kept], axis=-1)
    np.testing.assert_array_equal(kept, theirs_kept)


def test_unrotating_uses_the_models_rope_scaling():
    """Llama 3.1's RoPE scaling changes the frequencies: the rotation undone must be the model's."""
    from refkv.model.layers import rope_frequencies_of

    scaled = TINY.replace(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                          rope_original_context=64)
    assert not np.allclose(rope_frequencies_of(scaled), rope_frequencies_of(TINY))
    q = np.random.default_rng(8).standard_normal((2, 5, TINY.d_head))
    positions = np.arange(300, 305)
    cos, sin = rope_angles(positions, TINY.d_head, TINY.rope_base, np.float64, inv_freq=rope_frequencies_of(scaled))
    rotated = apply_rope(q, cos, sin)
    np.testing.assert_allclose(unrotated_queries(rotated, positions, scaled), q, rtol=0, atol=1e-12)
    assert not np.allclose(unrotated_queries(rotated, positions, TINY), q, atol=1e-3)
