"""L2 / Knorm (Devoto et al. 2024): keep the keys of lowest L2 norm; skipped layers fall back to sink + window."""

import doctest
import pathlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refkv.engine import Engine
from refkv.model.config import TINY
from refkv.policies import View, get
from refkv.policies.knorm import Knorm, key_norm_scores


def view(keys, *, budget=None, layer=0):
    keys = np.asarray(keys, dtype=np.float64)
    n_kv, n, d = keys.shape
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (n_kv, n)).copy()
    return View(layer=layer, n_layers=4, keys=keys, values=np.zeros_like(keys), positions=positions, fields={},
                queries=np.zeros((n_kv, 1, d)), query_positions=np.array([n - 1]), block_keys=keys[:, -1:],
                block_values=np.zeros_like(keys[:, -1:]), budget=budget)


def test_scores_by_hand():
    np.testing.assert_array_equal(key_norm_scores(np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])), [-5.0, -1.0, 0.0])
    assert key_norm_scores(np.ones((2, 3, 4), dtype=np.float32)).dtype == np.float32
    with pytest.raises(ValueError, match="shape"):
        key_norm_scores(np.ones(3))


def test_keeps_low_norms_by_hand():
    # Norms 5, 1, 2, 1 (a tie between columns 1 and 3), 10.
    keys = np.array([[[3.0, 4.0], [0.0, 1.0], [2.0, 0.0], [1.0, 0.0], [6.0, 8.0]]])
    v = view(keys, budget=2)
    np.testing.assert_array_equal(Knorm().keep_indices(replace(v, keep=2)), [[1, 3]])
    np.testing.assert_array_equal(Knorm().keep_indices(replace(v, keep=1)), [[3]])  # the tie keeps the more recent
    np.testing.assert_array_equal(Knorm().keep_indices(replace(v, keep=3)), [[1, 2, 3]])
    assert not Knorm().protected(v).any()


@given(norms=hnp.arrays(np.float64, st.integers(1, 20), elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5, 7.0])),
       budget=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_keeps_the_lowest_norms(norms, budget, seed):
    """Kept = the N smallest norms, ties to the larger position, whatever the key directions.

    Keys are signed multiples of basis vectors, so their norms are exact and ties are real.
    """
    rng = np.random.default_rng(seed)
    keys = np.zeros((len(norms), 5))
    keys[np.arange(len(norms)), rng.integers(0, 5, len(norms))] = norms * rng.choice([-1.0, 1.0], len(norms))
    kept = Knorm().keep_indices(replace(view(keys[None], budget=budget), keep=budget))[0]
    order = sorted(range(len(norms)), key=lambda j: (norms[j], -j))
    np.testing.assert_array_equal(kept, sorted(order[:budget]))


@given(keys=hnp.arrays(np.float64, (8, 3), elements=st.floats(-5, 5, allow_nan=False, width=64)))
def test_score_is_monotone_in_the_norm(keys):
    scores = key_norm_scores(keys)
    norms = np.sqrt((keys**2).sum(axis=1))
    for i in range(8):
        for j in range(8):
            if norms[i] < norms[j] * (1 - 1e-12):
                assert scores[i] > scores[j]


def test_skipped_layers_fall_back_to_sink_and_window():
    keys = np.random.default_rng(0).standard_normal((2, 12, 4))
    policy = Knorm(skip_layers=(1,), skip_sink=2)
    skipped = view(keys, budget=6, layer=1)
    np.testing.assert_array_equal(policy.keep_indices(replace(skipped, keep=6)), [[0, 1, 8, 9, 10, 11]] * 2)
    normal = view(keys, budget=6, layer=0)
    np.testing.assert_array_equal(policy.score(normal), key_norm_scores(keys))


def test_sink_and_recent_protection_keep_hashevicts_tokens_then_lowest_norms():
    # Norms by hand: token i has norm 12 - i (older = larger), except token 5, the smallest.
    norms = np.array([12.0 - i for i in range(12)])
    norms[5] = 0.5
    keys = np.zeros((1, 12, 2))
    keys[0, :, 0] = norms
    v = view(keys, budget=6)
    # No protection: the 6 lowest norms are tokens 5 and 7..11.
    np.testing.assert_array_equal(Knorm().keep_indices(replace(v, keep=6)), [[5, 7, 8, 9, 10, 11]])
    # sink=2, recent=2: tokens 0, 1 (largest norms) and 10, 11 forced in; then 5 and 9 by norm.
    np.testing.assert_array_equal(Knorm(sink=2, recent=2).keep_indices(replace(v, keep=6)), [[0, 1, 5, 9, 10, 11]])


def test_protection_defaults_and_bounds():
    assert (Knorm().sink, Knorm().recent) == (0, 0)      # the authors' rule: nothing protected
    # ... with the parameters it had before the option (golden files compare these dicts).
    assert Knorm().params() == {"skip_layers": (), "skip_sink": 4}
    assert Knorm(recent=10).params() == {"skip_layers": (), "skip_sink": 4, "sink": 0, "recent": 10}
    assert get("knorm", **Knorm(sink=4, recent=10).params()) == Knorm(sink=4, recent=10)
    for name in ("sink", "recent"):
        with pytest.raises(ValueError, match=name):
            Knorm(**{name: -1})
    with pytest.raises(ValueError, match=r"sink \+ recent = 14"):
        Knorm(sink=4, recent=10).check(14, TINY)
    Knorm(sink=4, recent=10).check(15, TINY)
    Knorm().check(1, TINY)


def test_parameters():
    assert Knorm(skip_layers=[1, 0]).skip_layers == (0, 1)       # lists (CLI) are accepted and sorted
    for bad, name in [((0, 0), "repeat"), ((-1,), "skip_layers"), (("a",), "skip_layers"), ("01", "skip_layers"),
                      (3, "skip_layers")]:
        with pytest.raises(ValueError, match=name):
            Knorm(skip_layers=bad)
    with pytest.raises(ValueError, match="skip_sink"):
        Knorm(skip_sink=-1)
    with pytest.raises(ValueError, match=r"skip_layers must be in \[0, 3\]"):
        Knorm(skip_layers=(4,)).check(8, TINY)
    with pytest.raises(ValueError, match="skip_sink"):
        Knorm(skip_layers=(0,), skip_sink=4).check(4, TINY)
    Knorm(skip_sink=4).check(2, TINY)          # no skipped layer: any budget
    Knorm(skip_layers=(3,)).check(5, TINY)


@pytest.mark.parametrize(("block", "budget"), [(1, 8), (4, 8), (7, 20), (None, 8), (16, 16)])
def test_engine_layer0_keeps_globally_lowest_norms(tiny64, block, budget):
    """A token's key norm never changes, so repeated top-N keeps the N lowest norms of all
    tokens; layer 0's keys depend only on the tokens, so they can be computed directly."""
    tokens = np.random.default_rng(5).integers(0, tiny64.config.vocab_size, 40)
    engine = Engine(tiny64, "knorm", budget)
    engine.prefill(tokens, block)
    _, k, _ = tiny64.qkv(0, tiny64.embed(tokens), tiny64.rope(np.arange(40)))
    norms = np.sqrt((k**2).sum(axis=-1))
    for h in range(k.shape[0]):
        expected = np.sort(np.argsort(norms[h], kind="stable")[:budget])
        np.testing.assert_array_equal(engine.caches[0].positions[h], expected)
    assert engine.stats.attention_materialised == 0 and engine.stats.attention_calls > 0


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("block", [1, 6, None])
def test_engine_with_skipped_layers(tiny64, tiny32, dtype_name, block):
    model = tiny64 if dtype_name == "float64" else tiny32
    tokens = np.random.default_rng(6).integers(0, model.config.vocab_size, 36)
    engine = Engine(model, get("knorm", skip_layers=(0, 1)), budget=10)
    logits = engine.prefill(tokens, block)
    assert logits.dtype == model.dtype and np.isfinite(logits).all()
    assert engine.stats.attention_materialised == 0
    for layer in (0, 1):
        np.testing.assert_array_equal(engine.caches[layer].positions, [[0, 1, 2, 3, *range(30, 36)]] * 2)
    for layer in (2, 3):
        assert engine.caches[layer].positions.shape == (2, 10)


def test_docs_page_examples_run():
    """The worked example of docs/policies/knorm.rst runs as printed."""
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies" / "knorm.rst"
    assert doctest.testfile(str(page), module_relative=False).failed == 0
