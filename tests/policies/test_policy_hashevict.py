"""HashEvict (Algorithm 1, Eqs. 2-6): SimHash Hamming scores, eviction before attention."""

import doctest
import pathlib
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv.engine import Engine
from refkv.lsh import gaussian_planes, hamming_unpacked, pack_codes, simhash
from refkv.model.config import TINY
from refkv.policies import View, get
from refkv.policies.hashevict import CODE_FIELD, HashEvict, hamming_scores


@dataclass(frozen=True)
class IdentityPlanes(HashEvict):
    """HashEvict with R = I (d = n_bits = 2): each bit is the sign of one coordinate, so codes
    can be read off the vectors by hand."""

    def planes(self, d, dtype=np.float64):
        return np.eye(self.n_bits, d, dtype=dtype)


def view(keys, queries, *, keep, block_keys=None, layer=0, codes=None, policy=None):
    """A pre-attention View keeping ``keep = N - B``: the cache holds ``keys`` (Hkv, n, d) at positions 0..n-1 and the
    block of B = queries.shape[1] comes next. Codes default to the policy's hashes of the keys."""
    keys = np.asarray(keys, dtype=np.float64)
    queries = np.asarray(queries, dtype=np.float64)
    n_kv, n, d = keys.shape
    b = queries.shape[1]
    if block_keys is None:
        block_keys = np.zeros((n_kv, b, d))
    if codes is None:
        codes = (policy or HashEvict()).codes(keys)
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (n_kv, n)).copy()
    return View(layer=layer, n_layers=4, keys=keys, values=np.zeros_like(keys), positions=positions,
                fields={CODE_FIELD: codes}, queries=queries, query_positions=np.arange(n, n + b, dtype=np.int64),
                block_keys=np.asarray(block_keys, dtype=np.float64), block_values=np.zeros((n_kv, b, d)),
                budget=None if keep is None else keep + b, keep=keep)


# -- by hand ----------------------------------------------------------------------------------

def test_hamming_scores_by_hand():
    q = pack_codes(np.array([[[True, False, True]]]))               # (Hkv=1, m=1, bytes)
    k = pack_codes(np.array([[[True, False, True], [False, True, False], [True, True, True]]]))
    np.testing.assert_array_equal(hamming_scores(q, k), [[0.0, -3.0, -1.0]])
    two = pack_codes(np.array([[[True, False, True], [False, False, False]]]))  # m = 2: distances add:
    np.testing.assert_array_equal(hamming_scores(two, k), [[-2.0, -4.0, -4.0]])  # 1+3, 3+1


def test_scores_and_eviction_by_hand():
    """R = I: h(q) = signs of q. q = (1, -1) -> code 10.
    keys (1, 1) -> 11, (-1, -1) -> 00, (2, -3) -> 10, (-1, 1) -> 01: distances 1, 1, 0, 2."""
    policy = IdentityPlanes(n_bits=2, sink=0, recent=0)
    keys = [[[1.0, 1.0], [-1.0, -1.0], [2.0, -3.0], [-1.0, 1.0]]]
    v = view(keys, [[[1.0, -1.0]]], keep=3, policy=policy)
    np.testing.assert_array_equal(policy.score(v), [[-1.0, -1.0, 0.0, -2.0]])
    np.testing.assert_array_equal(policy.keep_indices(v), [[0, 1, 2]])       # evict (-1, 1)
    # Budget 2: the tie at -1 between columns 0 and 1 keeps the more recent, column 1.
    np.testing.assert_array_equal(policy.keep_indices(replace(v, keep=2)), [[1, 2]])
    # Key hashing (authors' code): the block's key (-1, -1) -> 00; distances 2, 0, 1, 1.
    key_policy = IdentityPlanes(n_bits=2, sink=0, recent=0, hash="key")
    v = view(keys, [[[1.0, -1.0]]], keep=3, block_keys=[[[-1.0, -1.0]]], policy=key_policy)
    np.testing.assert_array_equal(key_policy.score(v), [[-2.0, 0.0, -1.0, -1.0]])


def test_gqa_sums_the_group_and_blocks_combine_queries():
    """Two query heads share the KV head; a block of B = 2 queries.
    Head 0: q = (1, 1) -> 11, (1, -1) -> 10; head 1: q = (-1, 1) -> 01, (-1, -1) -> 00.
    Keys (1, 1) -> 11 and (-1, -1) -> 00."""
    policy = IdentityPlanes(n_bits=2, sink=0, recent=0)
    keys = [[[1.0, 1.0], [-1.0, -1.0]]]
    queries = [[[1.0, 1.0], [1.0, -1.0]], [[-1.0, 1.0], [-1.0, -1.0]]]
    v = view(keys, queries, keep=1, policy=policy)
    # sum: key 11 -> 0 + 1 + 1 + 2 = 4; key 00 -> 2 + 1 + 1 + 0 = 4.
    np.testing.assert_array_equal(policy.score(v), [[-4.0, -4.0]])
    # last query of each head only: (1, -1) and (-1, -1): key 11 -> 1 + 2; key 00 -> 1 + 0.
    last = IdentityPlanes(n_bits=2, sink=0, recent=0, block_query="last")
    np.testing.assert_array_equal(last.score(v), [[-3.0, -1.0]])


def test_scores_match_unpacked_reference():
    """Seeded planes, GQA g = 2, B = 3: scores = -sum over heads and queries of the plain bit count."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 9, 8))
    queries = rng.standard_normal((4, 3, 8))
    block_keys = rng.standard_normal((2, 3, 8))
    planes = gaussian_planes(20, 8, seed=5)
    kc = simhash(keys, planes)
    for hash_input in ("query", "key"):
        for combine in ("sum", "last"):
            policy = HashEvict(n_bits=20, seed=5, hash=hash_input, block_query=combine)
            v = view(keys, queries, keep=5, block_keys=block_keys, policy=policy)
            expected = np.zeros((2, 9))
            for h in range(2):
                probes = queries[2 * h:2 * h + 2] if hash_input == "query" else block_keys[h:h + 1]
                if combine == "last":
                    probes = probes[:, -1:]
                for p in probes.reshape(-1, 8):
                    expected[h] -= hamming_unpacked(simhash(p, planes)[None], kc[h])
            np.testing.assert_array_equal(policy.score(v), expected)


def test_protected_sink_and_recent_after_the_block():
    v = view(np.zeros((1, 20, 2)), np.zeros((1, 3, 2)), keep=17)
    mask = HashEvict(sink=4, recent=10).protected(v)
    # recent 10 after appending the block of 3 = the block + the last 7 cached.
    np.testing.assert_array_equal(np.flatnonzero(mask[0]), [0, 1, 2, 3, *range(13, 20)])
    v = view(np.zeros((1, 20, 2)), np.zeros((1, 12, 2)), keep=8)
    np.testing.assert_array_equal(np.flatnonzero(HashEvict(sink=4, recent=10).protected(v)[0]), [0, 1, 2, 3])


def test_block_too_large_for_the_protected_tokens():
    v = view(np.zeros((1, 20, 2)), np.zeros((1, 17, 2)), keep=3)
    with pytest.raises(ValueError, match="B <= N - sink"):
        HashEvict(sink=4, recent=10).keep_indices(v)
    # Nothing protected: a block of B = N empties the cache.
    v = view(np.zeros((1, 5, 2)), np.zeros((1, 8, 2)), keep=0)
    assert HashEvict(sink=0, recent=0).keep_indices(v).shape == (1, 0)


def test_observe_hashes_the_block_keys_into_the_table():
    policy = HashEvict(n_bits=12)
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2, 6, 4))
    table = np.full((2, 6, 2), 7, dtype=np.uint8)
    v = View(layer=0, n_layers=4, keys=keys, values=keys, positions=np.broadcast_to(np.arange(10, 16), (2, 6)),
             fields={CODE_FIELD: table}, queries=rng.standard_normal((4, 2, 4)), query_positions=np.array([14, 15]),
             block_keys=keys[:, -2:], block_values=keys[:, -2:])
    new = policy.observe(v)[CODE_FIELD]
    assert new.dtype == np.uint8 and new.shape == (2, 6, 2)
    np.testing.assert_array_equal(new[:, :4], 7)                               # older codes untouched
    np.testing.assert_array_equal(new[:, 4:], pack_codes(simhash(keys[:, 4:], gaussian_planes(12, 4, seed=0))))
    np.testing.assert_array_equal(table, 7)                                    # a new array is returned


@given(seed=st.integers(0, 2**16), factor=st.sampled_from([0.25, 0.5, 2.0, 8.0]))
def test_scores_invariant_to_positive_scaling(seed, factor):
    """SimHash sees directions only: scaling queries and keys by powers of two changes nothing."""
    rng = np.random.default_rng(seed)
    keys, queries = rng.standard_normal((2, 7, 6)), rng.standard_normal((4, 2, 6))
    policy = HashEvict()
    a = policy.score(view(keys, queries, keep=4))
    b = policy.score(view(keys * factor, queries * factor, keep=4))
    np.testing.assert_array_equal(a, b)


def test_parameters():
    for params, name in [({"n_bits": 0}, "n_bits"), ({"n_bits": 2.0}, "n_bits"), ({"sink": -1}, "sink"),
                         ({"recent": -2}, "recent"), ({"hash": "value"}, "hash"), ({"block_query": "mean"},
                                                                                   "block_query"),
                         ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=name):
            HashEvict(**params)
    with pytest.raises(ValueError, match="sink \\+ recent"):
        HashEvict().check(13, TINY)
    HashEvict().check(14, TINY)
    assert HashEvict(n_bits=16).n_bytes == 2 and HashEvict(n_bits=17).n_bytes == 3
    assert HashEvict().fields(TINY)[CODE_FIELD].shape == (2,)


# -- Algorithm 1, literally, against the engine ------------------------------------------------

@dataclass(frozen=True)
class RecordingHashEvict(HashEvict):
    """HashEvict that records each layer's block queries and keys as it observes them."""

    log: dict = field(default_factory=dict, compare=False, repr=False)

    def observe(self, view):
        self.log.setdefault(view.layer, []).append((view.queries.copy(), view.block_keys.copy()))
        return super().observe(view)


def algorithm1(queries, keys, budget, policy, planes):
    """HashEvict's Algorithm 1 for one KV head, token by token, with plain Python lists.

    queries: (T, g, d) of the head's query group; keys: (T, d). Before token t arrives at a
    full cache, e_t = argmin of -Hamming over the unprotected entries (first index among
    ties, i.e. the oldest), then k_t is appended. Returns the kept positions after each token.
    """
    key_codes = [simhash(k, planes) for k in keys]
    cache, history = [], []
    for t in range(len(keys)):
        if len(cache) == budget:
            probes = [simhash(q, planes) for q in queries[t]] if policy.hash == "query" else [key_codes[t]]
            recent = cache[len(cache) - (policy.recent - 1):] if policy.recent > 1 else []
            candidates = [p for p in cache if p >= policy.sink and p not in recent]
            scores = [-sum(int(hamming_unpacked(c, key_codes[p])) for c in probes) for p in candidates]
            cache.remove(candidates[scores.index(min(scores))])
        cache.append(t)
        history.append(list(cache))
    return history


@pytest.mark.parametrize(("params", "budget"), [({}, 20), ({"n_bits": 6, "sink": 2, "recent": 3}, 9),
                                                ({"hash": "key", "n_bits": 8}, 16)])
def test_engine_b1_is_algorithm_1(tiny64, params, budget):
    tokens = np.random.default_rng(2).integers(0, tiny64.config.vocab_size, 40)
    policy = RecordingHashEvict(**params)
    engine = Engine(tiny64, policy, budget, record=True)
    engine.prefill(tokens, 1)
    cfg = tiny64.config
    planes = gaussian_planes(policy.n_bits, cfg.d_head, policy.seed)
    for layer in range(cfg.n_layers):
        q = np.concatenate([entry[0] for entry in policy.log[layer]], axis=1)   # (H, T, d)
        k = np.concatenate([entry[1] for entry in policy.log[layer]], axis=1)   # (Hkv, T, d)
        for h in range(cfg.n_kv_heads):
            group = q[h * cfg.group_size:(h + 1) * cfg.group_size].transpose(1, 0, 2)
            history = algorithm1(group, k[h], budget, policy, planes)
            for t, kept in enumerate(engine.trace.kept):
                np.testing.assert_array_equal(kept[layer][h], history[t])
    assert engine.stats.attention_materialised == 0
    assert engine.stats.peak_cache_tokens == budget          # the token attends to at most N


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize(("block", "budget", "params"), [
    (1, 16, {}), (4, 16, {}), (12, 16, {}), (7, 24, {"block_query": "last"}), (5, 20, {"hash": "key"}),
    (16, 16, {"sink": 0, "recent": 0}),
])
def test_engine_runs_attention_free(tiny64, tiny32, dtype_name, block, budget, params):
    model = tiny64 if dtype_name == "float64" else tiny32
    tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, 50)
    engine = Engine(model, get("hashevict", **params), budget)
    logits = engine.prefill(tokens, block)
    assert logits.dtype == model.dtype and np.isfinite(logits).all()
    assert engine.stats.attention_materialised == 0
    assert engine.stats.peak_cache_tokens <= budget
    sink, recent = params.get("sink", 4), params.get("recent", 10)
    for cache in engine.caches:
        assert len(cache) <= budget
        assert set(range(sink)) <= set(cache.positions[0])
        assert set(range(50 - recent, 50)) <= set(cache.positions[1])
        assert cache.fields[CODE_FIELD].dtype == np.uint8
        # The stored codes are the hashes of the stored keys.
        expected = HashEvict(**params).codes(cache.keys)
        np.testing.assert_array_equal(cache.fields[CODE_FIELD], expected)
    new = engine.generate(logits, 3)
    assert len(new) == 3


def test_engine_rejects_blocks_too_large(tiny64):
    with pytest.raises(ValueError, match=r"block size must be <= .* with budget="):
        Engine(tiny64, "hashevict", 16).prefill(np.arange(40), 17)
    with pytest.raises(ValueError, match="block size must be <= 12 for hashevict"):  # B <= N - sink
        Engine(tiny64, "hashevict", 16).prefill(np.arange(40), 13)
    with pytest.raises(ValueError, match="sink \\+ recent"):
        Engine(tiny64, "hashevict", 10)


def test_docs_page_examples_run():
    """The worked example of docs/policies/hashevict.rst runs as printed."""
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies" / "hashevict.rst"
    assert doctest.testfile(str(page), module_relative=False).failed == 0
