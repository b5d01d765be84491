"""Packed projections (issue 17): one GEMM for q/k/v and one for gate/up, the same results."""

import numpy as np
import pytest

from refkv.model import Model, random_weights
from refkv.model.layers import apply_rope, rms_norm, swiglu
from refkv.model.weights import pack_projections


def test_packed_matrices_hold_the_weights_once(tiny64):
    for lw, packed in zip(tiny64.weights.layers, tiny64.packed):
        for name in ("wq", "wk", "wv"):
            assert np.shares_memory(getattr(lw, name), packed.qkv)
        for name in ("w_gate", "w_up"):
            assert np.shares_memory(getattr(lw, name), packed.gate_up)
        q, kv = lw.wq.shape[1], lw.wk.shape[1]
        np.testing.assert_array_equal(packed.qkv, np.concatenate([lw.wq, lw.wk, lw.wv], axis=1))
        assert packed.qkv_splits == (q, q + kv)


def test_packing_keeps_every_value_and_the_callers_weights(tiny64):
    weights = random_weights(tiny64.config, seed=3)
    before = {name: getattr(weights.layers[1], name).copy() for name in ("wq", "wk", "wv", "w_gate", "w_up")}
    packed_weights, _ = pack_projections(weights)
    for name, value in before.items():
        np.testing.assert_array_equal(getattr(packed_weights.layers[1], name), value)
        np.testing.assert_array_equal(getattr(weights.layers[1], name), value)  # the input is not changed
    packed_weights.validate(tiny64.config)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_packed_layer_equals_the_three_products(tiny64, dtype):
    """qkv and mlp against the unpacked definitions: h W_q, h W_k, h W_v and layers.swiglu."""
    cfg = tiny64.config
    model = Model(cfg, random_weights(cfg, seed=5, dtype=dtype))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, cfg.d_model)).astype(dtype)
    rope = model.rope(np.arange(7))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for layer in range(cfg.n_layers):
        lw = model.weights.layers[layer]
        h = rms_norm(x, lw.attn_norm, cfg.norm_eps)
        heads = lambda a, n: a.reshape(7, n, -1).transpose(1, 0, 2)  # noqa: E731
        expected = (apply_rope(heads(h @ lw.wq, cfg.n_heads), *rope),
                    apply_rope(heads(h @ lw.wk, cfg.n_kv_heads), *rope), heads(h @ lw.wv, cfg.n_kv_heads))
        for got, want in zip(model.qkv(layer, x, rope), expected):
            assert got.dtype == dtype
            np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
        want = swiglu(rms_norm(x, lw.mlp_norm, cfg.norm_eps), lw.w_gate, lw.w_up, lw.w_down)
        got = model.mlp(layer, x)
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
