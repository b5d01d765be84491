"""The experiments' quantities, each checked against a hand computation or an independent route."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import log_softmax
from scipy.special import softmax as sp_softmax

from refkv.experiments import attention_loss, geometry, passkey, perplexity
from refkv.experiments.captures import LayerCapture, dense_capture
from refkv.experiments.grids import format_spec_label
from refkv.experiments.prefill import policy_error
from refkv.experiments.registry import check_options
from refkv.experiments.text import prose_tokens
from refkv.lsh import gaussian_planes, hamming_unpacked, simhash
from refkv.model.tokenizer import ByteTokenizer
from refkv.policies.spec import canonical_spec, parse_spec

# -- policy specs --------------------------------------------------------------------------


def test_policy_specs_parse_and_canonicalise():
    assert parse_spec("sink") == ("sink", {})
    assert parse_spec("caote:base=h2o,fast=True") == ("caote", {"base": "h2o", "fast": True})
    assert canonical_spec("caote: fast=True , base=h2o") == "caote:base=h2o,fast=True"
    nested = "caote:base=snapkv,base_params={'window': 8, 'kernel': 3}"
    assert parse_spec(nested)[1]["base_params"] == {"window": 8, "kernel": 3}
    assert canonical_spec(canonical_spec(nested)) == canonical_spec(nested)
    assert format_spec_label("caote:base=tova,fast=True") == "TOVA+FastCAOTE"
    assert format_spec_label("keydiff") == "KeyDiff"
    assert format_spec_label("keydiff:metric=dot") == "keydiff:metric=dot"
    with pytest.raises(ValueError, match="unknown policy"):
        parse_spec("nope")
    with pytest.raises(ValueError, match="name=value"):
        parse_spec("sink:4")


def test_policy_error_explains_what_cannot_run(tiny64):
    assert policy_error("sink", 64, 16, tiny64.config) is None
    assert "budget" in policy_error("sink", 4, 16, tiny64.config)
    assert "evicts before attention" in policy_error("hashevict", 64, None, tiny64.config)
    assert "evicts before attention" in policy_error("hashevict", 64, 128, tiny64.config)


# -- dense capture and perplexity ----------------------------------------------------------


def test_dense_capture_matches_the_full_forward_oracle(tiny64, rng):
    tokens = rng.integers(0, tiny64.config.vocab_size, 40)
    layers, logits = dense_capture(tiny64, tokens)
    np.testing.assert_allclose(logits, tiny64.forward_full(tokens)[-1], rtol=1e-10, atol=1e-10)
    assert len(layers) == tiny64.config.n_layers
    cfg = tiny64.config
    assert layers[0].q.shape == (cfg.n_heads, 40, cfg.d_head)
    assert layers[0].k.shape == layers[0].v.shape == (cfg.n_kv_heads, 40, cfg.d_head)


@given(st.integers(1, 6), st.integers(2, 9), st.integers(0, 2**31 - 1))
def test_token_nll_is_minus_log_softmax(n, vocab, seed):
    r = np.random.default_rng(seed)
    logits = r.normal(0.0, 5.0, (n, vocab)).astype(np.float32)
    targets = r.integers(0, vocab, n)
    expected = -log_softmax(logits.astype(np.float64), axis=-1)[np.arange(n), targets]
    np.testing.assert_allclose(perplexity.token_nll(logits, targets), expected, rtol=1e-12, atol=1e-12)


def test_perplexity_cell_without_eviction_is_the_oracle_perplexity(tiny64, monkeypatch):
    from refkv.experiments import models

    tokens = np.arange(5, 70) % tiny64.config.vocab_size
    monkeypatch.setattr(models, "_MODELS", {("tiny", "float64"): (tiny64, ByteTokenizer(512))})
    monkeypatch.setattr(perplexity, "prose_tokens", lambda *args: tokens)
    params = {"model": "tiny", "dtype": "float64", "seed": 0, "text": "pydoc_prose", "length": len(tokens),
              "segment": 0, "block": 16}
    dense = perplexity.run_cell({**params, "policy": "full", "budget": None})
    logits = tiny64.forward_full(tokens)
    nll = -log_softmax(logits[:-1], axis=-1)[np.arange(len(tokens) - 1), tokens[1:]]
    assert dense["ppl"] == pytest.approx(float(np.exp(nll.mean())), rel=1e-10)
    np.testing.assert_allclose(dense["nll"], nll, rtol=1e-9)
    # A budget larger than the text never evicts: the same likelihood under any policy.
    big = perplexity.run_cell({**params, "policy": "keydiff", "budget": 100})
    assert big["ppl"] == pytest.approx(dense["ppl"], rel=1e-12) and big["evicted_tokens"] == 0
    # With eviction only tokens at positions >= N can change.
    small = perplexity.run_cell({**params, "policy": "sink", "budget": 24})
    assert small["evicted_tokens"] == len(tokens) - 1 - 24
    assert small["nll_sum"] - small["nll_evicted_sum"] == pytest.approx(float(nll[:24].sum()), rel=1e-9)


# -- attention loss ratio (HashEvict Eq. 7) -------------------------------------------------


def test_alr_by_hand():
    abar = np.array([[0.1, 0.4, 0.2, 0.3]])
    order = np.array([[1, 0, 2, 3]])  # drops 0.4 first: cumulative 0.4, 0.5, 0.7, 1.0
    # ideal: 0.1, 0.3, 0.6, 1.0 -> gaps 0.3, 0.2, 0.1, 0 -> Y = 0.6, Y / n = 0.15
    np.testing.assert_allclose(attention_loss.alr(abar, order), [0.15])
    np.testing.assert_allclose(attention_loss.alr(abar, np.array([[0, 2, 3, 1]])), [0.0], atol=1e-15)


def test_drop_order_lowest_score_first_ties_older_first():
    scores = np.array([[2.0, 1.0, 1.0, 3.0, 1.0]])
    positions = np.array([[0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(attention_loss.drop_order(scores, positions), [[1, 2, 4, 0, 3]])


def test_attention_received_is_the_column_mean_and_sums_to_one():
    w = sp_softmax(np.where(np.tril(np.ones((5, 5))) > 0, np.arange(25.0).reshape(5, 5) / 7, -np.inf), axis=-1)
    abar = attention_loss.attention_received(w[None])
    np.testing.assert_allclose(abar[0], w.sum(axis=0) / 5)
    assert abar.sum() == pytest.approx(1.0)


def _capture(tiny64, n=48, seed=0):
    tokens = np.random.default_rng(seed).integers(0, tiny64.config.vocab_size, n)
    return dense_capture(tiny64, tokens)[0]


def test_h2o_ranks_exactly_like_the_ideal_ranking(tiny64):
    """H2O's one-shot score is T times the mean attention received (Eq. 8): its ALR is 0."""
    params = {"lsh_bits": 16, "seed": 0}
    t = 48
    positions = np.broadcast_to(np.arange(t), (tiny64.config.n_kv_heads, t))
    for layer, cap in enumerate(_capture(tiny64, t)):
        from refkv.attention import attention_weights

        weights = attention_weights(cap.q, cap.k, positions[0], positions)
        abar = attention_loss.attention_received(weights.mean(axis=1))
        scores, _kept = attention_loss._ranking("h2o", params, tiny64, layer, cap, weights, t // 2)
        np.testing.assert_allclose(attention_loss.alr(abar, attention_loss.drop_order(scores, positions)), 0.0,
                                   atol=1e-12)


def test_lsh_mean_distance_matches_a_loop_over_codes(rng):
    h, hkv, t, d, bits = 4, 2, 7, 8, 16
    q = rng.normal(size=(h, t, d))
    k = rng.normal(size=(hkv, t, d))
    planes = gaussian_planes(bits, d, 5)
    cq, ck = simhash(q, planes), simhash(k, planes)
    expected = np.zeros((hkv, t))
    for kv in range(hkv):
        for i in range(t):
            dist = [hamming_unpacked(cq[qh, j], ck[kv, i]) for qh in range(kv * 2, kv * 2 + 2) for j in range(i, t)]
            expected[kv, i] = np.mean(dist)
    np.testing.assert_allclose(attention_loss.lsh_mean_distance(q, k, bits, 5), expected)


def test_output_error_zero_when_nothing_is_evicted_and_by_hand_otherwise(rng):
    h, hkv, t, m, d = 2, 1, 6, 2, 4
    cap = LayerCapture(rng.normal(size=(h, t + m, d)), rng.normal(size=(hkv, t + m, d)),
                       rng.normal(size=(hkv, t + m, d)))
    err, lost = attention_loss.output_error(cap, np.arange(t)[None], t)
    assert err == pytest.approx(0.0, abs=1e-24) and lost == pytest.approx(0.0, abs=1e-15)
    kept = np.array([[0, 3, 5]])
    err, lost = attention_loss.output_error(cap, kept, t)
    errors, losses = [], []
    for head in range(h):
        for j in range(m):
            pos = t + j
            logits = cap.q[head, pos] @ cap.k[0, :pos + 1].T / 2.0
            a = sp_softmax(logits)
            dense = a @ cap.v[0, :pos + 1]
            keep = [0, 3, 5, *range(t, pos + 1)]
            evicted = sp_softmax(logits[keep]) @ cap.v[0, keep]
            errors.append(np.sum((evicted - dense) ** 2) / np.sum(dense ** 2))
            losses.append(a[[1, 2, 4]].sum())
    assert err == pytest.approx(np.mean(errors), rel=1e-10)
    assert lost == pytest.approx(np.mean(losses), rel=1e-10)


def test_alr_cell_on_tiny(tiny64, monkeypatch):
    from refkv.experiments import models

    monkeypatch.setattr(models, "_MODELS", {("tiny", "float64"): (tiny64, ByteTokenizer(512))})
    params = {"model": "tiny", "dtype": "float64", "seed": 0, "kind": "alr", "length": 64, "segment": 0,
              "lsh_bits": 16, "rankings": ["l2", "lsh", "h2o", "sink", "hashevict"]}
    result = attention_loss.run_cell(params)
    rankings = result["rankings"]
    assert np.allclose(rankings["h2o"]["alr"], 0.0, atol=1e-12)
    ideal = np.asarray(result["ideal_loss50"])
    for name in ("l2", "lsh", "sink", "hashevict"):
        alr = np.asarray(rankings[name]["alr"])
        loss = np.asarray(rankings[name]["loss50"])
        assert alr.shape == loss.shape == (4, 2)
        assert np.all(alr >= -1e-12) and np.all(alr < 1)
        assert np.all(loss >= ideal - 1e-12)  # no choice of T/2 tokens loses less than the ideal


def test_step_losses_by_hand():
    # One KV head, T = 3: rows are query t's attention over keys 0..2.
    attention = np.array([[[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.5, 0.2, 0.3]]])
    got = attention_loss.step_losses(attention, [np.array([[1]]), np.array([[0, 2]])], first_step=1)
    np.testing.assert_allclose(got, [[0.25], [0.2]], rtol=0, atol=1e-15)


def test_attended_sets_follow_the_engine_mode(tiny64):
    tokens = np.arange(20) % 512
    budget = 8
    # Sink evicts after attention: step t attends to kept[t-1] (first 4 + last 4 of 0..t-1) plus t.
    sink = attention_loss.attended_sets(tiny64, "sink", tokens, budget)
    assert len(sink[2]) == 20 - budget
    for t, positions in enumerate(sink[2], start=budget):
        expected = sorted({0, 1, 2, 3} | set(range(max(4, t - 4), t)) | {t})
        np.testing.assert_array_equal(positions, [expected] * 2)
    # HashEvict evicts before attention: N keys, the current token among them, nothing from the future.
    hashed = attention_loss.attended_sets(tiny64, "hashevict", np.arange(28) % 512, 16)
    assert len(hashed[1]) == 28 - 16
    for t, positions in enumerate(hashed[1], start=16):
        assert positions.shape == (2, 16) and np.all(positions[:, -1] == t) and positions.max() == t


def test_step_loss_cell_on_tiny(tiny64, monkeypatch):
    from refkv.attention import attention_weights
    from refkv.experiments import models

    monkeypatch.setattr(models, "_MODELS", {("tiny", "float64"): (tiny64, ByteTokenizer(512))})
    params = {"model": "tiny", "dtype": "float64", "seed": 0, "kind": "step_loss", "length": 48, "segment": 0,
              "policy": "sink", "budget": 24, "block": 1}
    result = attention_loss.run_cell(params)
    assert result["steps"] == 24 and len(result["loss_by_layer"]) == 4
    assert all(0 < x < 1 for x in result["loss_by_layer"])
    # Independently: sink's kept set is known in closed form; the loss from the dense capture.
    tokens = prose_tokens("tiny", "float64", 48, 0)
    captures, _ = dense_capture(tiny64, tokens)
    pos = np.arange(48)
    cap = captures[0]
    a = attention_weights(cap.q, cap.k, pos, np.broadcast_to(pos, (2, 48))).mean(axis=1)  # (Hkv, T, T)
    losses = [1 - a[:, t, sorted({0, 1, 2, 3} | set(range(max(4, t - 20), t + 1)))].sum(axis=1)
              for t in range(24, 48)]
    assert result["loss_by_layer"][0] == pytest.approx(float(np.mean(losses)), abs=1e-12)
    skipped = attention_loss.run_cell({**params, "policy": "mat", "budget": 2})
    assert "skipped" in skipped


def test_paired_rows_by_hand():
    values = {("a", 8, 1, 0): 0.5, ("a", 8, 1, 1): 0.7, ("b", 8, 1, 0): 0.25, ("b", 8, 1, 1): 0.25,
              ("c", 16, 1, 0): 0.0, ("c", 16, 1, 1): 0.1}
    rows = attention_loss.paired_rows(values)
    assert [(r["policy_a"], r["policy_b"]) for r in rows] == [("a", "b")]   # c is at another budget
    # d = (0.25, 0.45): mean 0.35, sd 0.1 * sqrt(2), t_{0.975, 1} = 12.706.
    assert rows[0]["difference"] == pytest.approx(0.35)
    assert rows[0]["high"] - 0.35 == pytest.approx(12.7062047 * 0.1 * np.sqrt(2) / np.sqrt(2), rel=1e-6)


# -- key geometry --------------------------------------------------------------------------


def test_common_query_statistics_by_hand(rng):
    import itertools

    from scipy.stats import spearmanr

    t = 8                                    # keys 0..5, queries 6, 7; one key picked of 1..5
    keys = rng.normal(size=(1, t, 3))
    logits = rng.normal(size=(t, t))
    logits[np.triu_indices(t, 1)] = -np.inf
    attention = sp_softmax(logits, axis=-1)[None]      # (1, T, T) causal, rows sum to 1
    got = geometry.common_query_statistics(keys, attention)
    k, a = keys[0, :6], attention[0, 6:, :6]
    distinct = -np.array([np.mean([k[i] @ k[j] / np.linalg.norm(k[i]) / np.linalg.norm(k[j])
                                   for j in range(6) if j != i]) for i in range(6)])
    received = a.mean(axis=0)
    assert got["spearman"][0] == pytest.approx(spearmanr(distinct, received)[0])
    assert got["spearman_per_query"][0] == pytest.approx(np.mean([spearmanr(distinct, row)[0] for row in a]))
    best = 1 + int(np.argmax(distinct[1:]))
    assert got["share_distinctive"][0] == pytest.approx(received[best])
    assert got["share_recent"][0] == pytest.approx(received[5])
    assert got["share_low_norm"][0] == pytest.approx(received[1 + int(np.argmin(np.linalg.norm(k[1:], axis=1)))])
    # "Random" is the exact mean over every choice of one key of 1..5.
    assert got["share_random"][0] == pytest.approx(np.mean([received[list(c)].sum()
                                                            for c in itertools.combinations(range(1, 6), 1)]))
    with pytest.raises(ValueError, match="too short"):
        geometry.common_query_statistics(keys[:, :3], attention[:, :3, :3])


def test_common_query_spearman_ignores_position_when_attention_follows_distinctiveness(rng):
    # Attention that depends on distinctiveness alone: +1 on the common query set, whatever the
    # positions; the "visible queries" mean is pulled by position instead.
    t = 64
    keys = rng.normal(size=(1, t, 4))
    distinct = -geometry.mean_pairwise_cosine(keys[:, :48])[0]
    logits = np.full((t, t), -np.inf)
    for q in range(t):
        logits[q, :q + 1] = 0.0
        logits[q, :min(q + 1, 48)] = 5 * distinct[:min(q + 1, 48)]
    attention = sp_softmax(logits, axis=-1)[None]
    got = geometry.common_query_statistics(keys, attention)
    assert got["spearman"][0] == pytest.approx(1.0) and got["spearman_per_query"][0] == pytest.approx(1.0)
    assert got["share_distinctive"][0] > got["share_random"][0]


def test_mean_pairwise_cosine_matches_a_double_loop(rng):
    k = rng.normal(size=(2, 6, 3))
    got = geometry.mean_pairwise_cosine(k)
    for h in range(2):
        for i in range(6):
            cos = [k[h, i] @ k[h, j] / np.linalg.norm(k[h, i]) / np.linalg.norm(k[h, j]) for j in range(6) if j != i]
            assert got[h, i] == pytest.approx(np.mean(cos))


def test_log_volume_by_hand():
    keys = np.array([[2.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    assert geometry.log_volume(keys) == pytest.approx(np.log(4.0) + np.log(9.0))
    assert geometry.log_volume(np.array([[1.0, 1.0], [2.0, 2.0]])) == float("-inf")  # spans one dimension


def test_pca_2d_matches_the_covariance_eigenvectors(rng):
    x = rng.normal(size=(50, 4)) * np.array([5.0, 2.0, 0.5, 0.1])
    got = geometry.pca_2d(x)
    centred = x - x.mean(axis=0)
    _values, vectors = np.linalg.eigh(centred.T @ centred)
    top = vectors[:, ::-1][:, :2]
    for c in range(2):  # equal up to the sign of each component
        a, b = got[:, c], centred @ top[:, c]
        assert min(np.abs(a - b).max(), np.abs(a + b).max()) < 1e-9
    assert np.var(got[:, 0]) >= np.var(got[:, 1])


def test_hamming_correlation_matches_a_direct_computation(rng):
    from scipy.stats import pearsonr

    q = rng.normal(size=(2, 5, 6))
    k = rng.normal(size=(1, 5, 6))
    w = sp_softmax(np.where(np.tril(np.ones((5, 5))) > 0, rng.normal(size=(1, 2, 5, 5)), -np.inf), axis=-1)
    got = geometry.hamming_correlation(q, k, w, 8, [0, 1])
    for head in range(2):
        a, s = [], []
        for i in range(5):
            for j in range(i + 1):
                dist = np.mean([hamming_unpacked(simhash(q[head, i], gaussian_planes(8, 6, seed)),
                                                 simhash(k[0, j], gaussian_planes(8, 6, seed))) for seed in (0, 1)])
                a.append(w[0, head, i, j])
                s.append(-dist)
        assert got[head] == pytest.approx(pearsonr(a, s)[0])


def test_geometry_cells_on_tiny(tiny64, monkeypatch):
    from refkv.experiments import models

    monkeypatch.setattr(models, "_MODELS", {("tiny", "float64"): (tiny64, ByteTokenizer(512))})
    base = {"model": "tiny", "dtype": "float64", "seed": 0, "segment": 0}
    cos = geometry.run_cell({**base, "kind": "cosine", "length": 80})
    assert np.asarray(cos["spearman_pairwise"]).shape == (4, 2)
    assert len(cos["picture"]["received"]) == 64
    common = cos["common_queries"]
    assert all(np.asarray(v).shape == (4, 2) for v in common.values())
    shares = np.asarray([common[k] for k in ("share_distinctive", "share_random", "share_recent", "share_low_norm")])
    assert np.all((shares >= 0) & (shares <= 1 + 1e-12))
    rows = geometry.common_query_rows([{"result": cos}, {"result": cos}])
    by_name = {r["statistic"]: r for r in rows}
    assert by_name["spearman"]["mean"] == pytest.approx(np.nanmean(common["spearman"]))
    assert by_name["share_distinctive - share_random"]["prompts"] == 2
    ret = geometry.run_cell({**base, "kind": "retention", "length": 120, "policy": "keydiff", "budget": 40,
                             "block": 16})
    assert np.asarray(ret["log_volume"]).shape == (4, 2)
    assert sum(ret["pca"]["kept"]) == 40 and len(ret["pca"]["xy"]) == 120
    ham = geometry.run_cell({**base, "kind": "hamming", "length": 40, "bits": [8, 32], "projections": 2})
    assert np.asarray(ham["pearson"]["32"]).shape == (4, 4)


# -- passkey -------------------------------------------------------------------------------


def test_passkey_prompt_places_the_needle_and_hits_the_length():
    tok = ByteTokenizer(512)
    for depth in (0.0, 0.5, 1.0):
        tokens, at = passkey.build_prompt(tok, 2000, depth, 48151, template="raw")
        text = bytes(tokens).decode()
        assert "The pass key is 48151. Remember it." in text
        assert text.endswith("What is the pass key? The pass key is")
        assert 2000 - 200 < len(tokens) <= 2000 + 10
        assert text[at:at + 4] == "8151"
        fraction = text.index("48151") / len(text)
        assert abs(fraction - depth) < 0.12
    with pytest.raises(ValueError, match="depth"):
        passkey.build_prompt(tok, 2000, 1.5, 48151)
    with pytest.raises(ValueError, match="five digits"):
        passkey.build_prompt(tok, 2000, 0.5, 123)


def test_passkey_key_depends_on_the_prompt_not_the_policy():
    cells = passkey.cells(passkey.Settings(quick=True, model="tiny"))
    assert {c["policy"] for c in cells} == {"full", "sink", "keydiff"}
    keys = {passkey._key(c["seed"], c["length"], c["depth"], c["sample"]) for c in cells}
    assert len(keys) == 1
    assert passkey._key(0, 1024, 0.5, 0) != passkey._key(0, 1024, 0.5, 1)


def test_passkey_cell_reports_retention_and_skips_what_cannot_run(tiny64, monkeypatch):
    from refkv.experiments import models

    monkeypatch.setattr(models, "_MODELS", {("tiny", "float64"): (tiny64, ByteTokenizer(512))})
    params = {"model": "tiny", "dtype": "float64", "seed": 0, "template": "raw", "filler": "repeat", "needle": "short",
              "max_new_tokens": 4, "length": 400, "depth": 0.5, "sample": 0}
    full = passkey.run_cell({**params, "policy": "full", "budget": None, "block": 64})
    assert full["needle_retention"] == 1.0 and isinstance(full["correct"], bool)
    sink = passkey.run_cell({**params, "policy": "sink", "budget": 32, "block": 16})
    assert sink["needle_retention"] == 0.0  # the middle of the prompt is outside sink + window
    skipped = passkey.run_cell({**params, "policy": "hashevict", "budget": 64, "block": None})
    assert "evicts before attention" in skipped["skipped"]


@pytest.mark.slow
def test_smollm2_retrieves_the_key_without_eviction(smollm2, smollm2_tokenizer, monkeypatch):
    """The ceiling is not zero: with no eviction the 135M model reads the key back (quick grid's prompt)."""
    from refkv.experiments import models

    monkeypatch.setattr(models, "_MODELS", {("smollm2", "float32"): (smollm2, smollm2_tokenizer)})
    ceiling = passkey.cells(passkey.Settings(quick=True, model="smollm2"))[0]
    assert ceiling["policy"] == "full" and ceiling["budget"] is None
    result = passkey.run_cell(ceiling)
    assert result["correct"], result["answer"]
    tokens, at = passkey.build_prompt(smollm2_tokenizer, ceiling["length"], ceiling["depth"], result["key"],
                                      template=ceiling["template"], needle=ceiling["needle"])
    assert len(tokens) == result["prompt_tokens"]
    assert smollm2_tokenizer.decode(tokens[at:at + 4]) == str(result["key"])[1:]


def test_perplexity_grid_adds_token_by_token_cells_only_to_the_default_grid():
    from refkv.experiments.settings import Settings

    default = perplexity.cells(Settings(model="tiny"))
    by_token = [c for c in default if c["block"] == 1]
    names = {policy_name(c["policy"]) for c in by_token}
    assert names == set(perplexity.TOKEN_BY_TOKEN)
    assert {c["budget"] for c in by_token} == {128}
    assert {(c["text"], c["segment"]) for c in by_token} == {("pydoc_prose", 0), ("kjv_narrative", 0)}
    custom = perplexity.cells(Settings(model="tiny", policies=("mat",), budgets=(64,)))
    assert {c["block"] for c in custom} == {32}
    assert {c["policy"] for c in custom} == {"full", "mat"}


def policy_name(spec):
    return spec.partition(":")[0]


def test_default_perplexity_grid_holds_the_comparable_baselines():
    from refkv.experiments.grids import COMPARABLE_BASELINES
    from refkv.experiments.settings import Settings

    default = perplexity.cells(Settings(model="tiny"))
    at = {(c["policy"], c["budget"], c["block"]) for c in default}
    for spec in COMPARABLE_BASELINES:             # beside each default, at both budgets
        assert (canonical_spec(spec), 128, 32) in at and (canonical_spec(spec), 256, 32) in at
    for spec in ("knorm", "h2o", "keydiff", "caote:base=h2o"):
        assert (spec, 128, 32) in at
    # HashEvict's protection for L2 also token by token, where the two are compared.
    assert ("knorm:recent=10,sink=4", 128, 1) in at and ("knorm", 128, 1) in at
    # MAT's grid: beta x L_s, L_s = 10 dropped on the 4-layer tiny model.
    mats = {p for p, n, b in at if policy_name(p) == "mat" and n == 128 and b == 32}
    assert {"mat:beta=16,shallow_layers=0", "mat:beta=64,shallow_layers=2"} <= mats
    assert not any("shallow_layers=10" in p for p in mats) and len(mats) == 1 + 5 * 2
    # Equal peak memory: evict-after policies also at N - B, evict-before ones not.
    assert ("keydiff", 96, 32) in at and ("h2o:recent=0", 224, 32) in at
    assert ("hashevict", 96, 32) not in at and ("mat", 96, 32) not in at
    # Both texts get every cell: one from each prose source.
    assert {(c["text"], c["segment"]) for c in default} == {("pydoc_prose", 0), ("kjv_narrative", 0)}


def test_full_grid_sample_sizes():
    from refkv.experiments.settings import Settings

    full = Settings(model="smollm2", full=True)
    ppl = perplexity.cells(full)
    texts = {(c["text"], c["segment"]) for c in ppl}
    assert texts == {(source, s) for source in ("pydoc_prose", "kjv_narrative") for s in range(4)}
    assert {c["length"] for c in ppl} == {1024}
    keys = passkey.cells(full)
    assert {c["length"] for c in keys} == {1024, 2048, 4096}
    per_cell = [c for c in keys if c["policy"] == "keydiff" and c["budget"] == 256 and c["block"] == 128]
    assert len(per_cell) == 3 * 50                # 50 prompts per length: 10 per needle depth
    errors = [c for c in attention_loss.cells(full) if c["kind"] == "output_error" and c["policy"] == "sink"]
    assert {c["segment"] for c in errors} == set(range(10))
    assert len([c for c in attention_loss.cells(full) if c["kind"] == "alr"]) == 10
    assert {c["segment"] for c in geometry.cells(full) if c["kind"] == "cosine"} == set(range(10))
    # Settings override a grid's sample size; quick and full exclude each other.
    three = {(c["text"], c["segment"]) for c in perplexity.cells(Settings(model="tiny", options={"texts": 3}))}
    assert three == {("pydoc_prose", 0), ("kjv_narrative", 0), ("pydoc_prose", 1)}
    with pytest.raises(ValueError, match="exclusive"):
        Settings(quick=True, full=True)
    # An experiment's own settings are checked by the option that declares them, before any grid is listed.
    with pytest.raises(ValueError, match=r"texts must be an integer in \[1, 10000\]"):
        check_options(Settings(options={"texts": 0}))
    with pytest.raises(ValueError, match=r"passkey_lengths must be an integer in \[64, "):
        passkey.cells(Settings(model="tiny", options={"passkey_lengths": (8,)}))
    with pytest.raises(ValueError, match="no experiment has the option 'textz'"):
        check_options(Settings(options={"textz": 3}))




# -- comparable baselines and interval summaries (issue 16) -------------------------------
def test_equal_memory_budget_matches_the_evict_before_peak(tiny64):
    from refkv.engine import Engine
    from refkv.experiments.grids import equal_memory_budget
    from refkv.policies import get

    assert equal_memory_budget("keydiff", 128, 32) == 96
    assert equal_memory_budget("hashevict", 128, 32) is None       # evicts before attention already
    assert equal_memory_budget("caote:base=h2o", 128, 1) is None   # B = 1: the modes match
    assert equal_memory_budget("sink", None, 32) is None and equal_memory_budget("sink", 16, 16) is None
    # The engine's own peak: an evict-after policy at N - B holds what an evict-before one holds at N.
    tokens = np.arange(80) % tiny64.config.vocab_size
    peaks = {}
    for spec, budget in (("hashevict", 32), ("sink", equal_memory_budget("sink", 32, 8)), ("sink", 32)):
        engine = Engine(tiny64, get(spec), budget)
        for start in range(0, 80, 8):
            engine.forward(tokens[start:start + 8])
        peaks[(spec, budget)] = engine.stats.peak_cache_tokens
    assert peaks[("hashevict", 32)] == peaks[("sink", 24)] == 32 and peaks[("sink", 32)] == 40


def test_configuration_spells_out_defaults():
    from refkv.experiments.grids import configuration

    assert configuration("h2o") == "form='paper', recent=None"
    assert configuration("h2o:recent=0") == "form='paper', recent=0"
    assert configuration("knorm:sink=4,recent=10") == "recent=10, sink=4, skip_layers=(), skip_sink=4"
    assert "base_params={'recent': 0}" in configuration("caote:base=h2o,base_params={'recent': 0}")


def test_mat_grid_and_best_of_grid():
    from refkv.experiments.grids import best_of_grid, mat_grid

    assert mat_grid(32, 30) == [f"mat:beta={b},shallow_layers={s}" for b in (8, 16) for s in (0, 2, 10)]
    assert mat_grid(128, 4) == [f"mat:beta={b},shallow_layers={s}" for b in (8, 16, 32, 48, 64) for s in (0, 2)]
    rows = [{"policy": "mat", "budget": 8, "block": 1, "gap": 3.0},
            {"policy": "mat:beta=2,shallow_layers=0", "budget": 8, "block": 1, "gap": 1.0},
            {"policy": "mat:beta=4,shallow_layers=0", "budget": 8, "block": 1, "gap": float("nan")},
            {"policy": "mat", "budget": 16, "block": 1, "gap": 5.0},
            {"policy": "sink", "budget": 8, "block": 1, "gap": 0.0}]
    best_of_grid(rows, "mat", by="gap")
    assert [r.get("best_of_grid") for r in rows] == [False, True, False, True, None]


def test_supported_digits():
    assert perplexity.supported_digits(2.3) == 1
    assert perplexity.supported_digits(0.04) == 3
    assert perplexity.supported_digits(25.0) == 0
    assert perplexity.supported_digits(0.0) == 4


def test_passkey_pairs_by_hand():
    def rec(policy, sample, correct):
        return {"params": {"policy": policy, "budget": None if policy == "full" else 8, "block": 4,
                           "length": 100, "depth": 0.5, "sample": sample}, "result": {"correct": correct}}

    # Five prompts: the ceiling gets all, A gets 0-3, B gets 0 only.
    records = [rec("full", i, True) for i in range(5)]
    records += [rec("a", i, i < 4) for i in range(5)] + [rec("b", i, i == 0) for i in range(5)]
    pairs = {(r["policy_a"], r["policy_b"]): r for r in passkey.paired_comparisons(records)}
    assert set(pairs) == {("a", "full"), ("a", "b"), ("b", "full")}
    ab = pairs[("a", "b")]
    assert (ab["prompts"], ab["only_a"], ab["only_b"]) == (5, 3, 0)
    assert ab["difference"] == pytest.approx(0.6) and ab["mcnemar_p"] == pytest.approx(0.25)  # 2 * 0.5 ** 3
    assert ab["diff_low"] <= 0.6 <= ab["diff_high"]
    assert pairs[("b", "full")]["difference"] == pytest.approx(-0.8)


def test_perplexity_pairs_same_budget_and_equal_memory(rng):
    def rec(policy, budget, segment, nll):
        return {"params": {"policy": policy, "budget": budget, "block": 4, "segment": segment},
                "result": {"nll": list(nll)}}

    nll = {key: rng.uniform(0.5, 3.0, size=(2, 128)) for key in ("hashevict", "sink16", "sink12", "keydiff")}
    records = [rec("hashevict", 16, s, nll["hashevict"][s]) for s in range(2)]
    records += [rec("sink", 16, s, nll["sink16"][s]) for s in range(2)]
    records += [rec("sink", 12, s, nll["sink12"][s]) for s in range(2)]
    records += [rec("keydiff", 16, 0, nll["keydiff"][0])]                        # one text only
    records += [{"params": {"policy": "full", "budget": None, "block": 4, "segment": 0}, "result": {"nll": [1.0]}}]
    rows = {(r["policy_a"], r["budget_a"], r["policy_b"], r["budget_b"]): r for r in perplexity.paired_gaps(records)}
    assert set(rows) == {("hashevict", 16, "keydiff", 16), ("hashevict", 16, "sink", 16),
                         ("keydiff", 16, "sink", 16), ("hashevict", 16, "sink", 12)}
    memory = rows[("hashevict", 16, "sink", 12)]
    assert memory["comparison"] == "equal peak memory" and memory["texts"] == 2 and memory["tokens"] == 256
    expected = np.exp(nll["hashevict"].mean()) - np.exp(nll["sink12"].mean())
    assert memory["difference"] == pytest.approx(expected) and memory["low"] <= expected <= memory["high"]
    assert rows[("hashevict", 16, "keydiff", 16)]["texts"] == 1                 # only the shared text
    assert rows[("hashevict", 16, "sink", 16)]["comparison"] == "same budget"


def test_perplexity_pairs_keep_the_two_sources_apart(rng):
    # Segment 0 of each source is a different text: pairing by segment alone would let one
    # overwrite the other and halve the sample.
    def rec(policy, text, nll):
        return {"params": {"policy": policy, "budget": 16, "block": 4, "segment": 0, "text": text},
                "result": {"nll": list(nll)}}

    nll = rng.uniform(0.5, 3.0, size=(2, 2, 64))
    records = [rec(policy, text, nll[i, j]) for i, policy in enumerate(("sink", "keydiff"))
               for j, text in enumerate(("pydoc_prose", "kjv_narrative"))]
    (row,) = perplexity.paired_gaps(records)
    assert row["texts"] == 2 and row["tokens"] == 128
    assert row["difference"] == pytest.approx(np.exp(nll[1].mean()) - np.exp(nll[0].mean()))


def test_prose_sources_are_distinct_offline_and_long_enough(smollm2_tokenizer):
    from refkv.experiments.text import text_source
    from refkv.model.sample_text import PROSE_SOURCES, narrative_prose, prose

    assert [text_source(i) for i in range(4)] == [("pydoc_prose", 0), ("kjv_narrative", 0),
                                                  ("pydoc_prose", 1), ("kjv_narrative", 1)]
    kjv = narrative_prose()
    assert "Joseph" in kjv and "Nineveh" in kjv and not any(ch.isdigit() for ch in kjv)  # verse numbers gone
    assert len(kjv.split("\n\n")) == 14 + 4 + 10 + 4                                   # one paragraph a chapter
    # The powered grid's 8 texts of 1,024 tokens (4 a source) fit with room to spare.
    for source in PROSE_SOURCES:
        assert len(smollm2_tokenizer.encode(prose(source, 8 * 4 * 1024))) >= 4 * 1024 + 1
    assert prose("pydoc_prose", 1000)[:200] != kjv[:200]
    with pytest.raises(ValueError, match="source must be one of"):
        prose("gutenberg", 10)


def test_default_passkey_grid_runs_one_shot_only_for_the_one_shot_claim():
    from refkv.experiments.settings import Settings

    default = passkey.cells(Settings(model="smollm2"))
    one_shot = {c["policy"] for c in default if c["block"] is None and c["policy"] != "full"}
    assert one_shot == set(passkey.ONE_SHOT_POLICIES)
    assert {"knorm", "mat", "hashevict", "keydiff:reserve=0.25"} <= {c["policy"] for c in default if c["block"] == 128}
    full = passkey.cells(Settings(model="smollm2", full=True))
    assert {"knorm", "scissorhands"} <= {c["policy"] for c in full if c["block"] is None}
    chosen = passkey.cells(Settings(model="smollm2", policies=("knorm",), blocks=(None,)))
    assert {c["block"] for c in chosen if c["policy"] == "knorm"} == {None}  # asked for: always run


def test_a_spec_with_parameters_in_parentheses_is_the_same_spec():
    from refkv.policies.spec import canonical_spec, parse_spec, parse_spec_list
    assert parse_spec("adakv(base=keydiff,form=kvpress)") == ("adakv", {"base": "keydiff", "form": "kvpress"})
    assert canonical_spec("snapkv(window=8,kernel=3)") == canonical_spec("snapkv:kernel=3,window=8")
    assert parse_spec_list("h2o,adakv(base=keydiff,form=kvpress),keydiff:reserve=0.25") == [
        "h2o", "adakv(base=keydiff,form=kvpress)", "keydiff:reserve=0.25"]
    with pytest.raises(ValueError, match="close with"):
        parse_spec("keydiff(reserve=0.25")
    with pytest.raises(ValueError, match="follows no"):
        parse_spec_list("adakv(base=keydiff),form=kvpress")
