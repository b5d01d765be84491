"""End-to-end goldens: what they record is what the engine did, decided by the recorded scores."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from refkv import Engine, policies
from refkv.model import builtin_model
from refkv.oracle import read_end_to_end, run_end_to_end
from refkv.oracle.endtoend import policy_from_manifest
from refkv.oracle.models import export_weights, prompt_tokens
from refkv.policies.adakv import safeguard

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
#: Block and one-shot goldens (schedule goldens, indexed by round, are tests/oracle/test_oracle_schedule.py's).
E2E_FILES = sorted(p for p in (GOLDEN / "e2e").glob("*/*.json") if not p.name.startswith("sched-"))


def _independent_keep(positions, scores, protected, budget):
    """Protected first, then higher score, then more recent: Python's sorted, not refkv's select."""
    order = sorted(range(len(positions)), key=lambda i: (not protected[i], -scores[i], -positions[i]))
    return sorted(int(positions[i]) for i in order[:budget])


def _independent_layer_keep(cands, scores, protected, budget, floor):
    """AdaKV's joint choice over a layer's heads (Python's sorted): per head, its protected tokens and
    its first ``floor`` in its own order are forced; then the layer's ``budget * Hkv`` best by
    (forced, score, position, lower head)."""
    forced = set()
    for h, cand in enumerate(cands):
        own = sorted(range(len(cand)), key=lambda i: (not protected[h][i], -scores[h][i], -cand[i]))
        forced |= {(h, i) for i in own[:max(floor, int(np.sum(protected[h])))]}
    pairs = sorted(((h, i) for h, cand in enumerate(cands) for i in range(len(cand))),
                   key=lambda hi: ((hi not in forced), -scores[hi[0]][hi[1]], -cands[hi[0]][hi[1]], hi[0]))
    chosen = pairs[:budget * len(cands)]
    return [sorted(int(cands[h][i]) for h2, i in chosen if h2 == h) for h in range(len(cands))]


@pytest.mark.parametrize("path", E2E_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_recorded_decision_follows_from_its_recorded_scores(path):
    g = read_end_to_end(path)
    a, m = g.arrays, g.manifest
    n_blocks, n_layers, hkv, _ = a["kept"].shape
    before = m["policy"]["evict_before_attention"]
    t, bs = len(a["prompt"]), m["block_size"] or len(a["prompt"])
    sizes = [min(bs, t - s) for s in range(0, t, bs)]
    assert m["n_blocks"] == n_blocks == len(sizes) and m["evictions"] == int((a["candidate_count"] > 0).sum())
    policy = policy_from_manifest(m)
    even = not policy.shares_layer_budget  # AdaKV shares a layer's total unevenly
    for b in range(n_blocks):
        for l in range(n_layers):
            k = a["kept_count"][b, l]
            # a head keeping fewer tokens than the widest ends its row in -1 (uneven budgets)
            kept = [row[row >= 0] for row in a["kept"][b, l, :, :k]]
            assert (a["kept"][b, l, :, k:] == -1).all()
            assert all((np.diff(row) > 0).all() and (a["kept"][b, l, h, len(row):k] == -1).all()
                       for h, row in enumerate(kept))
            c = a["candidate_count"][b, l]
            if c == 0:
                continue
            # Evicting after attention keeps N_l of the candidates (N but for PyramidKV's layers);
            # before attention, N - B (the block arrives afterwards and is kept by everyone).
            budget = policy.layer_budget(m["budget"], l, n_layers)
            n_keep = budget - sizes[b] if before else budget
            cands = [a["candidates"][b, l, h, :c] for h in range(hkv)]
            owned = [kept[h][np.isin(kept[h], cands[h])] for h in range(hkv)]
            if not even:
                real = [cand >= 0 for cand in cands]  # -1: an empty slot among the candidates
                expected = _independent_layer_keep(
                    [cand[r] for cand, r in zip(cands, real)], [a["scores"][b, l, h, :c][real[h]] for h in range(hkv)],
                    [a["protected"][b, l, h, :c][real[h]] for h in range(hkv)], n_keep,
                    safeguard(n_keep, policy.alpha, policy.form))
                assert [own.tolist() for own in owned] == expected, (b, l)
                continue
            for h in range(hkv):
                assert len(owned[h]) == n_keep
                expected = _independent_keep(cands[h], a["scores"][b, l, h, :c], a["protected"][b, l, h, :c], n_keep)
                assert owned[h].tolist() == expected, (b, l, h)


def test_run_end_to_end_records_the_engine_trace_and_logits():
    policy = policies.get("keydiff")
    manifest, arrays = run_end_to_end(policy, budget=8, block_size=4, dtype="float64", prompt_length=20)
    model = builtin_model(seed=0, dtype=np.float64)
    prompt = prompt_tokens(1, 20, model.config.vocab_size)
    engine = Engine(model, policy, 8, record=True)
    logits = engine.prefill(prompt, 4)
    assert np.array_equal(arrays["prompt"], prompt) and np.array_equal(arrays["logits"], logits)
    for b, per_block in enumerate(engine.trace.kept):
        for l, positions in enumerate(per_block):
            k = arrays["kept_count"][b, l]
            assert np.array_equal(arrays["kept"][b, l, :, :k], positions)
    assert manifest["budget"] == 8 and manifest["block_size"] == 4 and manifest["dtype"] == "float64"
    assert manifest["policy"]["params"]["anchor"] == "unit_mean"
    assert policy_from_manifest(manifest) == policy


def test_the_unbounded_golden_matches_a_full_forward_pass():
    # An independent route: no cache, no blocks, scipy softmax (Model.forward_full).
    g = read_end_to_end(GOLDEN / "e2e" / "full" / "Nnone-B8-float64.json")
    model = builtin_model(seed=g.manifest["model"]["seed"], dtype=np.float64)
    expected = model.forward_full(g.arrays["prompt"])[-1]
    np.testing.assert_allclose(g.arrays["logits"], expected, rtol=1e-10, atol=1e-10)
    assert g.arrays["kept_count"][-1].tolist() == [len(g.arrays["prompt"])] * model.config.n_layers


def test_prompt_rule_is_the_documented_one():
    g = read_end_to_end(E2E_FILES[0])
    p = g.manifest["prompt"]
    vocab = g.manifest["model"]["config"]["vocab_size"]
    assert p["rule"] == "numpy.random.default_rng(seed).integers(0, vocab_size, length)"
    assert np.array_equal(g.arrays["prompt"], np.random.default_rng(p["seed"]).integers(0, vocab, p["length"]))


@pytest.fixture
def golden_copy(tmp_path):
    src = GOLDEN / "e2e" / "sink"
    for f in src.glob("N8-B4-float64.*"):
        shutil.copy(f, tmp_path / f.name)
    return tmp_path / "N8-B4-float64.json"


def test_reader_rejects_unknown_version_missing_array_and_bad_shapes(golden_copy):
    from refkv.oracle.io import read_npz, write_npz

    m = json.loads(golden_copy.read_text())
    golden_copy.write_text(json.dumps({**m, "schema_version": 7}))
    with pytest.raises(ValueError, match="unknown schema version 7 of refkv-e2e"):
        read_end_to_end(golden_copy)
    golden_copy.write_text(json.dumps({k: v for k, v in m.items() if k != "budget"}))
    with pytest.raises(ValueError, match="missing field 'budget'"):
        read_end_to_end(golden_copy)
    golden_copy.write_text(json.dumps(m))
    npz = golden_copy.with_suffix(".npz")
    arrays = read_npz(npz)
    write_npz(npz, {k: v for k, v in arrays.items() if k != "scores"})
    with pytest.raises(ValueError, match="checksum mismatch"):
        read_end_to_end(golden_copy)
    m2 = {**m, "arrays": {k: v for k, v in m["arrays"].items() if k != "sha256"}}
    golden_copy.write_text(json.dumps(m2))
    with pytest.raises(ValueError, match="missing array 'scores'"):
        read_end_to_end(golden_copy)
    write_npz(npz, {**arrays, "logits": arrays["logits"][:-1]})
    with pytest.raises(ValueError, match="shape mismatch: array 'logits' has shape"):
        read_end_to_end(golden_copy)


def test_candidate_goldens_need_only_kept_counts_and_logits(golden_copy):
    from refkv.oracle.endtoend import write_end_to_end
    from refkv.oracle.io import read_npz

    ref = read_end_to_end(golden_copy)
    arrays = read_npz(golden_copy.with_suffix(".npz"))
    mine = golden_copy.parent / "mine.json"
    write_end_to_end(mine, {k: v for k, v in ref.manifest.items() if k != "arrays"},
                     {k: arrays[k] for k in ("kept", "kept_count", "logits")})
    assert set(read_end_to_end(mine, candidate=True).arrays) == {"kept", "kept_count", "logits"}
    with pytest.raises(ValueError, match="missing array 'prompt'"):
        read_end_to_end(mine)  # as a reference it lacks arrays


def test_exported_weights_are_the_builtin_model(tmp_path):
    m = export_weights(tmp_path / "w.npz", seed=0, dtype="float32")
    model = builtin_model(seed=0, dtype=np.float32)
    with np.load(tmp_path / "w.npz", allow_pickle=False) as z:
        assert np.array_equal(z["embed"], model.weights.embed) and z["embed"].dtype == np.float32
        assert np.array_equal(z["layers.3.w_down"], model.weights.layers[3].w_down)
        assert len(z.files) == 2 + 9 * model.config.n_layers  # tied head: no lm_head
    assert json.loads((tmp_path / "w.json").read_text())["model"]["config"] == model.config.to_dict()
    assert m["arrays"]["contents"]["layers.0.wq"]["shape"] == [64, 64]
    with pytest.raises(ValueError, match=r"must end in .npz"):
        export_weights(tmp_path / "w.bin")


@pytest.mark.slow
def test_a_model_is_added_to_the_suite_with_one_entry(monkeypatch, tmp_path):
    # The end-to-end model list is data: name -> builder. A second model (here the tiny one
    # with other weights, standing in for a tiny model of another architecture) adds its own
    # goldens, named after it, that check against themselves.
    from refkv.oracle import check_suite, generate, generate_suite, models

    monkeypatch.setitem(models.MODELS, "other", lambda seed, dtype: builtin_model(seed=seed + 7, dtype=dtype))
    monkeypatch.setattr(generate, "E2E_MODELS", ("tiny", "other"))
    index = generate_suite(tmp_path, ["sink"])
    other = [e["path"] for e in index["files"] if "/other-" in e["path"]]
    # Another model gets the first block and the first one-shot setting, in float32.
    assert sorted(other) == ["e2e/sink/other-N16-Ball-float32.json", "e2e/sink/other-N8-B4-float32.json"]
    tiny = read_end_to_end(tmp_path / "e2e/sink/N8-B4-float32.json")
    g = read_end_to_end(tmp_path / "e2e/sink/other-N8-B4-float32.json")
    assert g.manifest["model"]["builder"] == "other" and tiny.manifest["model"]["builder"] == "tiny"
    assert not np.array_equal(g.arrays["logits"], tiny.arrays["logits"])  # other weights ran
    assert index["models"] == ["tiny", "other"] and check_suite(tmp_path, tmp_path).ok
    with pytest.raises(ValueError, match="model must be one of"):
        run_end_to_end(policies.get("sink"), budget=8, block_size=4, model="nosuch")


def test_one_shot_goldens_attend_over_the_whole_prompt_then_evict_once_per_layer():
    oneshot = [p for p in E2E_FILES if json.loads(p.read_text())["mode"] == "oneshot"]
    assert len(oneshot) >= 18  # float64 and float32 for every policy that runs one-shot
    for path in oneshot:
        g = read_end_to_end(path)
        m, a = g.manifest, g.arrays
        t = m["prompt"]["length"]
        assert m["block_size"] is None and m["n_blocks"] == 1, path
        if m["budget"] is None:
            continue
        assert m["budget"] < t and m["evictions"] == m["model"]["config"]["n_layers"], path
        policy, n_layers = policy_from_manifest(m), m["model"]["config"]["n_layers"]
        budgets = [policy.layer_budget(m["budget"], l, n_layers) for l in range(n_layers)]  # N but for PyramidKV
        hkv = a["kept"].shape[2]
        assert (a["candidate_count"] == t).all(), path
        assert [int((a["kept"][0, l] >= 0).sum()) for l in range(n_layers)] == [n * hkv for n in budgets], path
        assert (a["candidates"][0, :, :, :t] == np.arange(t)).all(), path


@pytest.mark.parametrize("path", [GOLDEN / "e2e" / "keydiff" / "N8-B4-float64.json",
                                  GOLDEN / "e2e" / "h2o" / "N16-B1-float64.json"], ids=lambda p: p.parent.name)
def test_a_permuted_cache_passes_at_every_block_evicting_or_not(path):
    """Issue 22 B: kept positions are a set; rows in another order (kvpress's topk order) hold the same tokens."""
    from refkv.oracle.walk import compare_end_to_end

    g = read_end_to_end(path)
    kept = g.arrays["kept"].copy()
    rng = np.random.default_rng(0)
    for idx in np.ndindex(*kept.shape[:3]):
        k = g.arrays["kept_count"][idx[:2]]
        kept[idx][:k] = rng.permutation(kept[idx][:k])
    assert (g.arrays["candidate_count"] == 0).any()  # non-evicting blocks are among them
    cand = {"kept": kept, "kept_count": g.arrays["kept_count"], "logits": g.arrays["logits"]}
    res = compare_end_to_end(cand, g.arrays, g.manifest)
    assert res.ok, res.failure
    kept[-1, 0, 0, 0] = kept[-1, 0, 0, 1]  # a position claimed twice is no permutation
    assert not compare_end_to_end(cand, g.arrays, g.manifest).ok
