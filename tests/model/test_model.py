"""The decoder's pieces, checked against hand computation and their defining properties."""

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import expit

from refkv.model import TINY, Model, ModelConfig, load, random_weights
from refkv.model.layers import apply_rope, rms_norm, rope_angles, silu, swiglu

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


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_silu_is_z_times_sigmoid_with_its_limits_and_no_warning(dtype):
    # z / (1 + exp(-z)) must equal z * expit(z) within a few ulps, keep the dtype, give -0
    # (not NaN) where exp(-z) overflows, and keep that overflow quiet. Where it overflows
    # the true value, |z| e^z, is below 100 times the smallest normal number: the atol.
    finfo = np.finfo(dtype)
    z = np.concatenate([np.linspace(-30, 30, 601), [-1e4, -200.0, -90.0, 0.0, 90.0, 1e4]]).astype(dtype)
    z = z[np.isfinite(z)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = silu(z)
    assert out.dtype == dtype
    want = z.astype(np.float64) * expit(z.astype(np.float64))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=4 * finfo.eps, atol=100 * float(finfo.tiny))
    assert np.all(out[z < -60] <= 0) and np.all(np.isfinite(out))


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


# -- architecture variants (Llama 3, Qwen2, Qwen3) -------------------------------------------
def test_llama3_frequencies_by_hand():
    """Original context 32, low 1, high 4, factor 8: band edges at wavelengths 8 and 32."""
    from refkv.model.layers import llama3_frequencies

    wavelengths = np.array([6.0, 16.0, 40.0])
    theta = 2 * np.pi / wavelengths
    got = llama3_frequencies(theta, 8.0, 1.0, 4.0, 32)
    # 6 < 8: kept; 40 > 32: divided by 8; 16: s = (32/16 - 1) / 3 = 1/3, (2/3)/8 + 1/3 = 10/24
    np.testing.assert_allclose(got, theta * [1.0, 10 / 24, 1 / 8], rtol=1e-15)


@given(st.floats(1.0, 64.0), st.floats(0.5, 2.0), st.floats(2.5, 8.0), st.integers(2, 10_000))
def test_llama3_scaling_is_monotone_between_one_and_one_over_factor(factor, low, high, context):
    """The scale theta'/theta falls from 1 (short wavelengths) to 1/factor (long ones), continuously."""
    from refkv.model.layers import llama3_frequencies, rope_frequencies

    theta = rope_frequencies(128, 500000.0)  # wavelengths 6.3 .. 3e6, sorted increasing
    scale = llama3_frequencies(theta, factor, low, high, context) / theta
    assert np.all(scale <= 1 + 1e-12) and np.all(scale >= 1 / factor - 1e-12)
    assert np.all(np.diff(scale) <= 1e-12)  # never rises as the wavelength grows
    # continuity at the band edges: the blend equals the neighbouring rule there
    edges = np.array([context / high, context / low])
    at_edges = llama3_frequencies(2 * np.pi / edges, factor, low, high, context) / (2 * np.pi / edges)
    np.testing.assert_allclose(at_edges, [1.0, 1 / factor], rtol=1e-9)


def test_linear_scaling_is_position_interpolation():
    """rope_type linear with factor f: position p is rotated as plain RoPE rotates p / f."""
    cfg = TINY.replace(n_layers=1, rope_type="linear", rope_factor=4.0)
    scaled = Model(cfg, random_weights(cfg, seed=1))
    plain = Model(cfg.replace(rope_type="default", rope_factor=1.0), random_weights(cfg, seed=1))
    cos, sin = scaled.rope(np.array([0, 4, 40, 400]))
    cos_ref, sin_ref = rope_angles(np.array([0, 1, 10, 100]), cfg.d_head, cfg.rope_base, np.float64)
    np.testing.assert_allclose(cos, cos_ref, atol=1e-12)
    np.testing.assert_allclose(sin, sin_ref, atol=1e-12)
    assert not np.allclose(plain.rope(np.array([40]))[1], sin[2])


def test_rope_freq_factors_divide_the_frequencies():
    factors = tuple(float(f) for f in np.linspace(1.0, 8.0, TINY.d_head // 2))
    cfg = TINY.replace(n_layers=1, rope_freq_factors=factors)
    model = Model(cfg, random_weights(cfg, seed=0))
    _, sin = model.rope(np.array([7]))
    theta = TINY.rope_base ** (-np.arange(0, TINY.d_head, 2) / TINY.d_head)
    np.testing.assert_allclose(sin[0, :TINY.d_head // 2], np.sin(7 * theta / np.array(factors)), rtol=1e-12)


def test_biases_are_added_right_after_the_projections():
    """With every projection zero, q, k and v are the biases (q, k then rotated by RoPE)."""
    cfg = TINY.replace(n_layers=1, attention_bias=True, output_bias=True)
    w = random_weights(cfg, seed=2)
    lw = w.layers[0]
    for name in ("wq", "wk", "wv"):
        getattr(lw, name)[:] = 0.0
    model = Model(cfg, w)
    rope = model.rope(np.arange(3))
    q, _, v = model.qkv(0, model.embed(np.array([1, 2, 3])), rope)
    heads = lw.bq.reshape(cfg.n_heads, 1, cfg.d_head).repeat(3, axis=1)
    np.testing.assert_allclose(q, apply_rope(heads, *rope), rtol=1e-12)
    np.testing.assert_allclose(v, lw.bv.reshape(cfg.n_kv_heads, 1, cfg.d_head).repeat(3, axis=1), rtol=0)
    np.testing.assert_allclose(model.attn_out(0, np.zeros_like(q)), np.tile(lw.bo, (3, 1)), rtol=0)


@given(st.integers(0, 2**16))
def test_qk_norm_gives_each_head_the_rms_of_its_gain(seed):
    """Qwen3's q/k norm: with unit gains each head of q and k has RMS 1 before RoPE, so norm sqrt(d) after."""
    cfg = TINY.replace(n_layers=1, qk_norm=True, d_head=32)
    w = random_weights(cfg, seed=seed % 7)
    w.layers[0].q_norm[:] = 1.0
    w.layers[0].k_norm[:] = 1.0
    model = Model(cfg, w)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, 5)
    q, k, _ = model.qkv(0, model.embed(tokens), model.rope(np.arange(5)))
    for x in (q, k):  # eps = 1e-5 against a mean square of order 1: within 1e-4
        np.testing.assert_allclose(np.linalg.norm(x, axis=-1), np.sqrt(cfg.d_head), rtol=1e-4)


def test_variant_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"rope_type must be one of 'default', 'linear', 'llama3', got 'dynamic'"):
        TINY.replace(rope_type="dynamic")
    with pytest.raises(ValueError, match="rope_low_freq_factor"):
        TINY.replace(rope_type="llama3", rope_factor=8.0)
    with pytest.raises(ValueError, match="rope_high_freq_factor"):
        TINY.replace(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=4.0, rope_high_freq_factor=1.0,
                     rope_original_context=8192)
    with pytest.raises(ValueError, match="apply to rope_type 'llama3' only"):
        TINY.replace(rope_original_context=8192)
    with pytest.raises(ValueError, match="rope_factor must be 1 with rope_type 'default'"):
        TINY.replace(rope_factor=2.0)
    with pytest.raises(ValueError, match="rope_freq_factors must be a tuple of d_head / 2 = 8"):
        TINY.replace(rope_freq_factors=(1.0, 2.0))
    with pytest.raises(ValueError, match="qk_norm must be True or False"):
        TINY.replace(qk_norm=1)
    with pytest.raises(ValueError, match="rope_base must be a finite number"):
        TINY.replace(rope_base=float("inf"))


def test_to_dict_leaves_out_unused_variants_and_round_trips():
    from refkv.model.families import FAMILIES

    assert set(TINY.to_dict()) == {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff",
                                   "rope_base", "norm_eps", "tie_embeddings", "max_positions", "name"}
    with_factors = TINY.replace(rope_freq_factors=(1.0,) * 8)
    for cfg in [TINY, with_factors, *(family.tiny for family in FAMILIES.values())]:
        assert ModelConfig(**cfg.to_dict()) == cfg
    assert FAMILIES["qwen3"].tiny.features == ("qk_norm",)


def test_family_table_lookups():
    """A reader takes the first entry with a file's name: Llama 3 checkpoints and Mistral GGUF
    files are Llama files; each family's tiny model switches on what its entry reads."""
    from refkv.model.families import FAMILIES, by_gguf_architecture, by_model_type, hf_architectures

    assert by_model_type("llama") is FAMILIES["llama"] and by_model_type("mistral") is FAMILIES["mistral"]
    assert by_model_type(None, ["Foo", "Qwen3ForCausalLM"]) is FAMILIES["qwen3"]
    assert by_model_type("gpt2", ["LlamaForCausalLM"]) is None  # a model_type given is what counts
    assert by_model_type(["llama"]) is None and by_gguf_architecture(None) is None
    assert by_gguf_architecture("llama") is FAMILIES["llama"] and by_gguf_architecture("mistral") is None
    assert hf_architectures() == ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
    for family in FAMILIES.values():
        flags = family.attention_flags(family.tiny.attention_bias)
        assert all(getattr(family.tiny, key) == value for key, value in flags.items()), family.name


def test_optional_weights_must_match_the_config():
    cfg = TINY.replace(n_layers=1, attention_bias=True)
    w = random_weights(cfg, seed=0)
    with pytest.raises(ValueError, match=r"weight layers\[0\]\.b[qkv] is given but the config does not use it"):
        Model(cfg.replace(attention_bias=False), w)
    plain = random_weights(cfg.replace(attention_bias=False), seed=0)
    with pytest.raises(ValueError, match=r"weight layers\[0\]\.bq must be a numpy array, got NoneType"):
        Model(cfg, plain)


def test_variants_leave_llama_weights_unchanged():
    """Random weights of a Llama 2-style config do not depend on the variant arrays' existence."""
    base = random_weights(TINY, seed=4)
    qwen = random_weights(TINY.replace(attention_bias=True, qk_norm=True), seed=4)
    assert np.array_equal(base.embed, qwen.embed) and np.array_equal(base.final_norm, qwen.final_norm)
    for a, b in zip(base.layers, qwen.layers):
        assert all(np.array_equal(a.arrays()[k], b.arrays()[k]) for k in a.arrays())


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_tiny_family_models(family):
    from refkv.model.families import tiny

    model = tiny(family, seed=1)
    assert model.dtype == np.float64 and model.config.name == f"tiny-{family}"
    assert model.forward_full(np.arange(40)).shape == (40, model.config.vocab_size)
    assert tiny(family, seed=1, dtype="float32").dtype == np.float32
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        tiny(family, seed=-1)
    with pytest.raises(ValueError, match="family must be one of"):
        tiny("gpt2")
