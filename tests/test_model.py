"""The decoder's pieces, checked against hand computation and their defining properties."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv.model import TINY, Model, ModelConfig, load, random_weights
from refkv.model.layers import apply_rope, rms_norm, rope_angles, swiglu

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False)


def test_rms_norm_by_hand():
    x = np.array([[3.0, 4.0]])  # mean square 12.5
    out = rms_norm(x, np.array([1.0, 2.0]), eps=1e-12)
    np.testing.assert_allclose(out, [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-12)


def test_swiglu_by_hand():
    x = np.array([[1.0, -1.0]])
    w_gate = np.array([[2.0], [0.0]])  # gate = 2
    w_up = np.array([[0.0], [-3.0]])   # up = 3
    w_down = np.array([[0.5, 1.0]])
    silu2 = 2.0 / (1.0 + np.exp(-2.0))
    np.testing.assert_allclose(swiglu(x, w_gate, w_up, w_down), [[1.5 * silu2, 3.0 * silu2]], rtol=1e-12)


def test_rope_rotates_the_halves_by_hand():
    """d = 4: pairs (0, 2) and (1, 3) rotate by p and p / base**0.5."""
    cos, sin = rope_angles(np.array([1]), 4, 100.0, np.float64)
    x = np.array([[[1.0, 0.0, 0.0, 1.0]]])
    a, b = 1.0, 1.0 / 10.0
    expected = [np.cos(a), -np.sin(b), np.sin(a), np.cos(b)]
    np.testing.assert_allclose(apply_rope(x, cos, sin)[0, 0], expected, rtol=1e-12)


@given(st.lists(finite, min_size=8, max_size=8), st.lists(finite, min_size=8, max_size=8),
       st.integers(0, 5000), st.integers(0, 5000), st.integers(-50, 50))
def test_rope_is_a_rotation_and_relative(q, k, m, n, shift):
    """RoPE preserves norms, and q_m . k_n depends only on m - n."""
    q, k = np.array(q)[None, None], np.array(k)[None, None]

    def at(x, p):
        cos, sin = rope_angles(np.array([p]), 8, 10000.0, np.float64)
        return apply_rope(x, cos, sin)

    np.testing.assert_allclose(np.linalg.norm(at(q, m)), np.linalg.norm(q), rtol=1e-9, atol=1e-9)
    if m + shift >= 0 and n + shift >= 0:
        lhs = float((at(q, m) * at(k, n)).sum())
        rhs = float((at(q, m + shift) * at(k, n + shift)).sum())
        assert abs(lhs - rhs) <= 1e-8 * (1 + np.linalg.norm(q) * np.linalg.norm(k))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_is_preserved_everywhere(dtype):
    model = load("tiny", dtype=dtype)
    tokens = np.arange(7)
    rope = model.rope(np.arange(7))
    assert rope[0].dtype == dtype
    x = model.embed(tokens)
    q, k, v = model.qkv(0, x, rope)
    assert (q.dtype, k.dtype, v.dtype) == (dtype,) * 3
    assert q.shape == (TINY.n_heads, 7, TINY.d_head) and k.shape == (TINY.n_kv_heads, 7, TINY.d_head)
    assert model.attn_out(0, q).dtype == dtype and model.attn_out(0, q).shape == (7, TINY.d_model)
    assert model.mlp(0, x).dtype == dtype
    assert model.forward_full(tokens).dtype == dtype


def test_float32_weights_are_rounded_float64_weights():
    w64 = random_weights(TINY, seed=3, dtype=np.float64)
    w32 = random_weights(TINY, seed=3, dtype=np.float32)
    np.testing.assert_array_equal(w64.layers[1].wq.astype(np.float32), w32.layers[1].wq)


def test_forward_full_is_causal(tiny64):
    """Changing a later token never changes an earlier position's logits."""
    tokens = np.arange(10)
    changed = tokens.copy()
    changed[6] = 99
    a, b = tiny64.forward_full(tokens), tiny64.forward_full(changed)
    np.testing.assert_array_equal(a[:6], b[:6])
    assert not np.allclose(a[6:], b[6:])


def test_untied_head():
    cfg = TINY.replace(tie_embeddings=False, n_layers=1, name="untied")
    model = Model(cfg, random_weights(cfg, seed=0))
    assert model.weights.lm_head.shape == (cfg.d_model, cfg.vocab_size)
    assert model.forward_full([1, 2, 3]).shape == (3, cfg.vocab_size)


def test_config_errors_name_the_parameter():
    with pytest.raises(ValueError, match="n_heads must be a multiple of n_kv_heads"):
        TINY.replace(n_heads=3)
    with pytest.raises(ValueError, match="d_head must be even"):
        TINY.replace(d_head=15)
    with pytest.raises(ValueError, match="n_layers must be an integer >= 1"):
        TINY.replace(n_layers=0)
    with pytest.raises(ValueError, match="rope_base"):
        TINY.replace(rope_base=1.0)
    with pytest.raises(ValueError, match="norm_eps"):
        TINY.replace(norm_eps=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(vocab_size=True, d_model=4, n_layers=1, n_heads=1, n_kv_heads=1, d_head=2, d_ff=4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused(bad):
    w = random_weights(TINY, seed=0)
    w.layers[2].wv[0, 0] = bad
    with pytest.raises(ValueError, match=r"layers\[2\]\.wv contains NaN or inf"):
        Model(TINY, w)


def test_weight_shape_and_dtype_errors():
    w = random_weights(TINY, seed=0)
    cfg = TINY.replace(d_ff=64)
    with pytest.raises(ValueError, match=r"w_gate has shape \(64, 128\), expected \(64, 64\)"):
        Model(cfg, w)
    with pytest.raises(ValueError, match="layers"):
        Model(TINY.replace(n_layers=3), w)
    mixed = type(w)(w.embed, w.layers, w.final_norm.astype(np.float32), None)
    with pytest.raises(ValueError, match="dtype"):
        Model(TINY, mixed)
    with pytest.raises(ValueError, match="float32 or float64"):
        random_weights(TINY, dtype=np.float16)


def test_load_unknown_model():
    with pytest.raises(ValueError, match=r"no-such-model.*not found"):
        load("no-such-model")
