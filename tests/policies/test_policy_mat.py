"""MAT (Managing Anchor Tokens), Algorithm 1, Eqs. 3-5: the closed form equals the streaming argmax eviction."""

import doctest
import math
import pathlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv.engine import Engine
from refkv.model.config import TINY
from refkv.policies import View, get
from refkv.policies.mat import LOGIT_FIELD, MAT, anchor_logits, closed_form_keep, default_beta, streaming_keep


def view(pi, *, b, keep, layer=1, d=2, keys=None, queries=None):
    """A pre-attention View over a cache with logits ``pi`` (Hkv, n) keeping ``keep = N - b``; the block
    of ``b`` is not in it."""
    pi = np.asarray(pi, dtype=np.float64)
    n_kv, n = pi.shape
    keys = np.zeros((n_kv, n, d)) if keys is None else keys
    queries = np.zeros((n_kv, b, d)) if queries is None else queries
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (n_kv, n)).copy()
    return View(layer=layer, n_layers=4, keys=keys, values=np.zeros_like(keys), positions=positions,
                fields={LOGIT_FIELD: pi}, queries=queries, query_positions=np.arange(n, n + b, dtype=np.int64),
                block_keys=np.zeros((n_kv, b, d)), block_values=np.zeros((n_kv, b, d)), budget=keep + b,
                keep=keep)


# -- Eq. 3 ------------------------------------------------------------------------------------

def test_anchor_logits_by_hand():
    q = np.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(anchor_logits(q, np.array([1.0, 1.0])), [3 / math.sqrt(2), 7 / math.sqrt(2)],
                               rtol=0, atol=1e-15)
    # Batched: (Hkv=2, n=1, d=2) against one first key per head.
    got = anchor_logits(np.array([[[1.0, 0.0]], [[0.0, 2.0]]]), np.array([[4.0, 9.0], [4.0, 9.0]]))
    np.testing.assert_allclose(got, [[4 / math.sqrt(2)], [18 / math.sqrt(2)]], rtol=0, atol=1e-15)
    assert anchor_logits(q.astype(np.float32), np.ones(2, np.float32)).dtype == np.float32
    with pytest.raises(ValueError, match="share d"):
        anchor_logits(q, np.ones(3))


# -- closed form and streaming, by hand --------------------------------------------------------

# N = 5, beta = 2: the first token, a window of N - beta = 3, beta - 1 = 1 other anchor.
PI = [0.0, 5.0, 1.0, 4.0, 2.0, 9.0, 9.0, 9.0]


def test_closed_form_by_hand():
    # Window = columns 5, 6, 7; the rest 1..4 have pi 5, 1, 4, 2 -> the lowest is column 2.
    np.testing.assert_array_equal(closed_form_keep(PI, np.arange(8), 5, 2), [0, 2, 5, 6, 7])
    # N = 6, beta = 3: window 5..7 again, two anchors: the two lowest of 5, 1, 4, 2 -> columns 2 and 4.
    np.testing.assert_array_equal(closed_form_keep(PI, np.arange(8), 6, 3), [0, 2, 4, 5, 6, 7])
    # beta = 1: the anchor cache is the first token alone, i.e. StreamingLLM with one sink.
    np.testing.assert_array_equal(closed_form_keep(PI, np.arange(8), 4, 1), [0, 5, 6, 7])
    # n <= N: nothing to evict.
    np.testing.assert_array_equal(closed_form_keep(PI[:4], np.arange(4), 5, 2), [0, 1, 2, 3])


def test_streaming_by_hand():
    """Eq. 4 step by step (N = 5, beta = 2, candidates = cache indices 1..beta):

    tokens 0-4 fill the cache [0, 1, 2, 3, 4];
    token 5: candidates (1, 2) with pi (5, 1) -> evict 1 -> [0, 2, 3, 4, 5];
    token 6: candidates (2, 3) with pi (1, 4) -> evict 3 -> [0, 2, 4, 5, 6];
    token 7: candidates (2, 4) with pi (1, 2) -> evict 4 -> [0, 2, 5, 6, 7].
    """
    np.testing.assert_array_equal(streaming_keep(PI, np.arange(8), 5, 2), [0, 2, 5, 6, 7])
    np.testing.assert_array_equal(streaming_keep(PI[:6], np.arange(6), 5, 2), [0, 2, 3, 4, 5])


def test_ties_evict_the_oldest_candidate():
    # All pi equal: argmax takes the first candidate (the oldest), so the anchors are the
    # tokens most recently pushed out of the window; the closed form's tie rule agrees.
    # N = 5, beta = 3: tokens 5..9 each evict the oldest of cache[1:4]: 1, 2, 3, 4, 5.
    pi = np.zeros(10)
    np.testing.assert_array_equal(streaming_keep(pi, np.arange(10), 5, 3), [0, 6, 7, 8, 9])
    np.testing.assert_array_equal(closed_form_keep(pi, np.arange(10), 5, 3), [0, 6, 7, 8, 9])


def test_first_token_is_kept_whatever_its_logit():
    pi = [100.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    np.testing.assert_array_equal(closed_form_keep(pi, np.arange(6), 3, 2), [0, 4, 5])
    np.testing.assert_array_equal(streaming_keep(pi, np.arange(6), 3, 2), [0, 4, 5])


def test_bad_sizes():
    for budget, beta, name in [(5, 5, "beta"), (5, 0, "beta"), (5, 7, "beta"), (1, 1, "budget"), (5, 2.0, "beta")]:
        for fn in (closed_form_keep, streaming_keep):
            with pytest.raises(ValueError, match=name):
                fn(np.zeros(8), np.arange(8), budget, beta)
    with pytest.raises(ValueError, match="same shape"):
        closed_form_keep(np.zeros(8), np.arange(7), 5, 2)
    with pytest.raises(ValueError, match="NaN"):
        streaming_keep(np.full(8, np.nan), np.arange(8), 5, 2)
    with pytest.raises(ValueError, match="column 0"):
        streaming_keep(np.zeros(8), np.arange(1, 9), 5, 2)


# -- the equivalence (cited by the theory docs) ------------------------------------------------

def logits(n, discrete):
    values = st.integers(-3, 3).map(float) if discrete else st.floats(-50, 50, allow_nan=False, width=64)
    return st.lists(values, min_size=n, max_size=n)


@st.composite
def streams(draw, max_n=40):
    budget = draw(st.integers(2, 16))
    beta = draw(st.integers(1, budget - 1))
    n = draw(st.integers(0, max_n))
    rows = draw(st.integers(1, 3))
    discrete = draw(st.booleans())                  # small integers: many ties
    pi = np.array([draw(logits(n, discrete)) for _ in range(rows)]).reshape(rows, n)
    return pi, budget, beta


@given(stream=streams())
def test_streaming_argmax_equals_closed_form(stream):
    """Eq. 4 repeated token by token keeps exactly: first token + last N - beta + the beta - 1
    lowest pi among the rest (ties: the more recent)."""
    pi, budget, beta = stream
    positions = np.broadcast_to(np.arange(pi.shape[1]), pi.shape)
    np.testing.assert_array_equal(streaming_keep(pi, positions, budget, beta),
                                  closed_form_keep(pi, positions, budget, beta))


@given(stream=streams(max_n=50), data=st.data())
def test_policy_in_blocks_equals_streaming(stream, data):
    """The MAT policy, evicting to N - B before each block of B <= N - beta (as the engine
    does), ends with the same cache as the token-by-token Eq. 4, after every block."""
    pi, budget, beta = stream
    pi = pi[:1]
    policy = MAT(shallow_layers=0, beta=beta)
    total = pi.shape[1]
    kept_pos = np.zeros((1, 0), dtype=np.int64)
    start = 0
    while start < total:
        b = data.draw(st.integers(1, budget - beta), label="B")
        stop = min(start + b, total)
        b = stop - start
        if kept_pos.shape[1] + b > budget:
            v = view(pi[:, kept_pos[0]], b=b, keep=budget - b, layer=0)
            v = View(**{**v.__dict__, "positions": kept_pos, "query_positions": np.arange(start, stop)})
            kept_pos = kept_pos[:, policy.keep_indices(v)[0]]
        kept_pos = np.concatenate([kept_pos, np.arange(start, stop)[None]], axis=1)
        start = stop
        expected = streaming_keep(pi[0, :stop], np.arange(stop), budget, beta)
        np.testing.assert_array_equal(kept_pos[0], expected)


# -- the policy on hand-made views ------------------------------------------------------------

def test_deep_layer_view_by_hand():
    # Cache of 8 before a block of B = 2 with N = 8: evict to 6. beta = 3 -> window of N - beta = 5
    # after the block, i.e. the last 3 cached; 2 places left for the first token + 1 anchor.
    pi = [[0.0, 5.0, 1.0, 4.0, 2.0, 9.0, 9.0, 9.0]]
    v = view(pi, b=2, keep=6)
    policy = MAT(beta=3, shallow_layers=1)
    np.testing.assert_array_equal(policy.protected(v), [[1, 0, 0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(policy.score(v), -np.asarray(pi))
    np.testing.assert_array_equal(policy.keep_indices(v), [[0, 2, 4, 5, 6, 7]])


def test_shallow_layer_is_sink_and_window():
    v = view(np.zeros((2, 10)), b=1, keep=7, layer=0)
    np.testing.assert_array_equal(MAT(sink=2).keep_indices(v), [[0, 1, 5, 6, 7, 8, 9]] * 2)


def test_large_block_shrinks_the_anchor_cache():
    # N = 8, beta = 2, B = 7 > N - beta: the block alone fills the window; 1 place = first token.
    v = view(np.arange(8.0)[None], b=7, keep=1)
    np.testing.assert_array_equal(MAT(beta=2, shallow_layers=0).keep_indices(v), [[0]])
    # N = 8, beta = 4, B = 5: 3 places, first token + 2 anchors (lowest pi 1, 2), no cached window.
    v = view([[0.0, 7.0, 1.0, 6.0, 2.0, 5.0, 4.0, 3.0]], b=5, keep=3)
    np.testing.assert_array_equal(MAT(beta=4, shallow_layers=0).keep_indices(v), [[0, 2, 4]])


def test_block_leaving_no_place_raises():
    v = view(np.zeros((1, 8)), b=8, keep=0)
    with pytest.raises(ValueError, match="B <= N - 1"):
        MAT(beta=2, shallow_layers=0).keep_indices(v)
    v = view(np.zeros((1, 8)), b=6, keep=2, layer=0)
    with pytest.raises(ValueError, match="sink"):
        MAT(sink=4).keep_indices(v)


def test_observe_stores_group_mean_logit():
    """GQA: pi is the mean over the KV head's query heads of q . k0 / sqrt(d)."""
    d = 2
    keys = np.zeros((1, 3, d))
    keys[0, 0] = [1.0, 2.0]                         # k0
    queries = np.array([[[1.0, 0.0], [0.0, 1.0]],   # query head 0, block of 2: q.k0 = 1, 2
                        [[3.0, 0.0], [2.0, 2.0]]])  # query head 1: q.k0 = 3, 6
    table = np.full((1, 3), np.nan)
    table[0, 0] = -7.0
    v = View(layer=2, n_layers=4, keys=keys, values=np.zeros_like(keys), positions=np.array([[0, 5, 6]]),
             fields={LOGIT_FIELD: table}, queries=queries, query_positions=np.array([5, 6]),
             block_keys=keys[:, 1:], block_values=keys[:, 1:], budget=None)
    new = MAT().observe(v)[LOGIT_FIELD]
    np.testing.assert_allclose(new, [[-7.0, 2 / math.sqrt(2), 4 / math.sqrt(2)]], rtol=0, atol=1e-15)
    assert np.isnan(table[0, 1])                    # observe returns a new array
    assert MAT().observe(View(**{**v.__dict__, "layer": 1})) == {}   # shallow layers keep no logits


def test_parameters():
    assert default_beta(256) == 64 and default_beta(3) == 1
    assert MAT().anchor_size(40) == 10 and MAT(beta=7).anchor_size(40) == 7
    for params, name in [({"beta": 0}, "beta"), ({"beta": 2.5}, "beta"), ({"shallow_layers": -1}, "shallow_layers"),
                         ({"sink": -1}, "sink")]:
        with pytest.raises(ValueError, match=name):
            MAT(**params)
    with pytest.raises(ValueError, match=r"shallow_layers must be an integer in \[0, 4\]"):
        MAT(shallow_layers=5).check(16, TINY)
    with pytest.raises(ValueError, match="beta must be < budget"):
        MAT(beta=16).check(16, TINY)
    with pytest.raises(ValueError, match="budget must be >= 2"):
        MAT().check(1, TINY)
    with pytest.raises(ValueError, match="sink"):
        MAT(sink=4).check(4, TINY)
    MAT(shallow_layers=0, sink=4).check(4, TINY)     # no shallow layer: the sink does not matter
    MAT(shallow_layers=4).check(16, TINY)


# -- through the engine -----------------------------------------------------------------------

@dataclass(frozen=True)
class RecordingMAT(MAT):
    """MAT that also keeps every token's pi as it is written (the cache loses the evicted ones)."""

    log: dict = field(default_factory=dict, compare=False, repr=False)

    def observe(self, view):
        out = super().observe(view)
        if out:
            b = len(view.query_positions)
            self.log.setdefault(view.layer, []).append(out[LOGIT_FIELD][:, -b:].copy())
        return out


@pytest.mark.parametrize(("block", "budget", "beta"), [(1, 12, None), (1, 16, 6), (3, 12, 4), (8, 12, None),
                                                      (5, 20, 15)])
def test_engine_deep_layers_equal_streaming_eviction(tiny64, block, budget, beta):
    """With B <= N - beta the engine's cache equals Eq. 4 applied token by token to the same
    logits, after every block; shallow layers hold the first s and the last N - s tokens."""
    tokens = np.random.default_rng(block).integers(0, tiny64.config.vocab_size, 45)
    policy = RecordingMAT(beta=beta)
    engine = Engine(tiny64, policy, budget, record=True)
    engine.prefill(tokens, block)
    b = policy.anchor_size(budget)
    assert engine.stats.attention_materialised == 0
    assert engine.stats.peak_cache_tokens == budget          # before attention: never N + B
    for layer in (2, 3):
        pi = np.concatenate(policy.log[layer], axis=1)       # (Hkv, T): every token's logit
        assert pi.shape == (2, 45) and np.isfinite(pi).all()
        for step, kept in enumerate(engine.trace.kept):
            stop = min((step + 1) * block, 45)
            expected = streaming_keep(pi[:, :stop], np.broadcast_to(np.arange(stop), (2, stop)), budget, b)
            np.testing.assert_array_equal(kept[layer], expected)
    for layer in (0, 1):
        np.testing.assert_array_equal(engine.caches[layer].positions, [[0, 1, 2, 3, *range(45 - budget + 4, 45)]] * 2)


def test_engine_logits_are_the_attention_logits(tiny64):
    """pi_i is token i's attention logit to token 0, averaged over the group's query heads."""
    tokens = np.random.default_rng(9).integers(0, tiny64.config.vocab_size, 10)
    policy = RecordingMAT(shallow_layers=0)
    Engine(tiny64, policy, budget=None).prefill(tokens, None)
    q, k, _ = tiny64.qkv(0, tiny64.embed(tokens), tiny64.rope(np.arange(10)))
    g = tiny64.config.group_size
    for h in range(2):
        expected = np.mean([q[h * g + j] @ k[h, 0] for j in range(g)], axis=0) / math.sqrt(tiny64.config.d_head)
        np.testing.assert_allclose(policy.log[0][0][h], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize(("block", "budget"), [(1, 8), (4, 8), (6, 8), (10, 24), (10, 12)])
def test_engine_runs_any_block(tiny64, tiny32, dtype_name, block, budget):
    model = tiny64 if dtype_name == "float64" else tiny32
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, 40)
    """Any B <= N - sink (the shallow layers' sinks must fit), including B > N - beta (10, 12)."""
    engine = Engine(model, get("mat", sink=2), budget)
    logits = engine.prefill(tokens, block)
    assert logits.dtype == model.dtype and np.isfinite(logits).all()
    assert engine.stats.attention_materialised == 0
    for cache in engine.caches:
        assert cache.positions.shape == (2, budget)
        assert (cache.positions[:, 0] == 0).all()
        assert (cache.positions[:, -1] == 39).all()


def test_engine_rejects_a_block_of_n(tiny64):
    tokens = np.arange(24)
    with pytest.raises(ValueError, match="block size must be <= 7 for mat"):  # B <= N - 1: the first token stays
        Engine(tiny64, MAT(shallow_layers=0), 8).prefill(tokens, 8)
    with pytest.raises(ValueError, match=r"block size must be <= .* with budget="):
        Engine(tiny64, "mat", 8).prefill(tokens, 9)


def test_docs_page_examples_run():
    """The worked example of docs/policies/mat.rst runs as printed."""
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies" / "mat.rst"
    assert doctest.testfile(str(page), module_relative=False).failed == 0
