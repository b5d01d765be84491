"""The KV-head-repeated model computes what the grouped-query one does, one KV head per query head."""

from __future__ import annotations

import numpy as np
import pytest

from refkv.engine import Engine
from refkv.model import TINY, Model, random_weights
from refkv.model.heads import repeat_kv_heads
from refkv.policies import get


@pytest.fixture(scope="module")
def tiny():
    return Model(TINY, random_weights(TINY, seed=3, dtype="float64"))


def test_repeated_model_has_one_kv_head_per_query_head(tiny):
    wide = repeat_kv_heads(tiny)
    assert wide.config.n_kv_heads == wide.config.n_heads == tiny.config.n_heads
    g = tiny.config.n_heads // tiny.config.n_kv_heads
    d = tiny.config.d_head
    for narrow, repeated in zip(tiny.weights.layers, wide.weights.layers):
        for h in range(tiny.config.n_heads):  # query head h read KV head h // g; now its own copy h
            own, shared = slice(h * d, (h + 1) * d), slice((h // g) * d, (h // g + 1) * d)
            np.testing.assert_array_equal(repeated.wk[:, own], narrow.wk[:, shared])
            np.testing.assert_array_equal(repeated.wv[:, own], narrow.wv[:, shared])


def test_without_eviction_the_repeated_model_computes_the_same_logits(tiny):
    tokens = np.arange(1, 41) % tiny.config.vocab_size
    narrow = Engine(tiny, get("full"), None).forward(tokens, all_logits=True)
    wide = Engine(repeat_kv_heads(tiny), get("full"), None).forward(tokens, all_logits=True)
    np.testing.assert_allclose(wide, narrow, rtol=1e-12, atol=1e-12)


def test_a_per_kv_head_policy_on_the_repeated_model_decides_per_query_head(tiny):
    """SnapKV's authors' form is refused on GQA; on the repeated model each query head selects its own tokens."""
    tokens = np.arange(1, 41) % tiny.config.vocab_size
    with pytest.raises(ValueError, match="per query head"):
        Engine(tiny, get("snapkv", window=4, kernel=3, form="authors"), 16).forward(tokens)
    engine = Engine(repeat_kv_heads(tiny), get("snapkv", window=4, kernel=3, form="authors"), 16)
    engine.forward(tokens)
    positions = engine.caches[0].positions  # (H, 16): one row per query head
    assert positions.shape == (tiny.config.n_heads, 16)
    g = tiny.config.n_heads // tiny.config.n_kv_heads
    # the query heads of one KV head read the same keys but their own queries: they keep different sets
    assert any(not np.array_equal(np.sort(positions[h]), np.sort(positions[h + 1]))
               for h in range(0, tiny.config.n_heads, g))


def test_a_model_without_groups_comes_back_unchanged():
    from dataclasses import replace

    mha = replace(TINY, n_kv_heads=TINY.n_heads, name="tiny-mha")
    model = Model(mha, random_weights(mha, seed=0, dtype="float64"))
    assert repeat_kv_heads(model) is model
