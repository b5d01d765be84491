"""Score-function test vectors: refkv agrees with its committed vectors; encoding, flags, reader errors."""

import json
import pathlib
from dataclasses import dataclass

import numpy as np
import pytest

from refkv import policies
from refkv.oracle import read_vectors
from refkv.oracle.encode import boundary_gap, encode_case, kept_rows, vectors_document
from refkv.oracle.io import dumps
from refkv.oracle.recipes import library_policies
from refkv.oracle.synthetic import Tokens, random_tokens, replay
from refkv.policies import Policy, View
from refkv.testing import assert_case

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
VECTOR_FILES = sorted((GOLDEN / "vectors").glob("*.json"))


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_refkv_reproduces_every_committed_vector_from_the_file_alone(path):
    # The format's promise: rebuild the View from the stored inputs, run the policy, get
    # the stored outputs (checked with the public kit and each case's own tolerance).
    vf = read_vectors(path)
    assert vf.cases, f"{path.name} holds no cases"
    for case in vf.cases:
        policy = case.policy()
        view = case.view()
        assert_case(case, scores=policy.score(view), protected=policy.protected(view),
                    kept=policy.keep_indices(view), strict_ties=True, check_dtype=True)


def test_every_file_declares_its_flags_and_versions():
    import refkv

    for path in VECTOR_FILES:
        vf = read_vectors(path)
        used = {f for c in vf.cases for f in c.flags}
        assert used == set(vf.meta["notes"]), path.name
        assert vf.meta["refkv_version"] == refkv.__version__
        assert {"schema", "schema_version", "numpy_version", "float_format"} <= set(vf.meta)
        assert all(c.dtype in ("float32", "float64") for c in vf.cases)


def test_the_suite_covers_the_adversarial_flags():
    flags = {f for path in VECTOR_FILES for c in read_vectors(path).cases for f in c.flags}
    assert {"gqa", "mha", "single-token", "near-tie", "exact-tie", "zero-norm-key", "duplicate-keys",
            "huge-logits", "no-eviction", "stateful", "before-attention", "engine", "float32"} <= flags


# -- the one-layer replay is the engine's layer ------------------------------------------------
def _layer0_tokens(model, prompt, block):
    """Layer 0's q, k, v of every prompt token, computed block by block as the engine does."""
    qs, ks, vs = [], [], []
    for start in range(0, len(prompt), block):
        pos = np.arange(start, min(start + block, len(prompt)))
        q, k, v = model.qkv(0, model.embed(prompt[pos]), model.rope(pos))
        qs.append(q), ks.append(k), vs.append(v)
    return Tokens(np.concatenate(qs, axis=1), np.concatenate(ks, axis=1), np.concatenate(vs, axis=1))


@pytest.mark.parametrize("block", [4, None], ids=["B4", "oneshot"])
@pytest.mark.parametrize("name", library_policies())
def test_replay_gives_the_engines_eviction_view(name, block, tiny64):
    # Layer 0's inputs do not depend on eviction, so replaying them through one layer must
    # reproduce the engine's own layer-0 decisions exactly, state and all (read from the
    # engine's Trace), in block mode and one-shot.
    from refkv import Engine

    policy = policies.get(name)
    prompt = np.random.default_rng(3).integers(0, tiny64.config.vocab_size, 48)
    for budget in (8, 16, 40):
        try:
            engine = Engine(tiny64, policy, budget, record="views")
            engine.prefill(prompt, block)
        except ValueError:
            continue
        break
    else:
        pytest.skip(f"{name} runs with none of the budgets tried")
    events = [e for e in engine.trace.evictions if e.layer == 0]
    if not events:
        pytest.skip(f"{name} never evicted from layer 0")
    seen = events[-1].view
    end = int(seen.query_positions[-1]) + 1  # the prompt up to the block of the last eviction
    tokens = _layer0_tokens(tiny64, prompt[:end], block or end)
    view = replay(policy, tokens, block_size=block, budget=budget, layer=0, n_layers=tiny64.config.n_layers)
    assert np.array_equal(view.positions, seen.positions)
    assert (view.budget, view.keep) == (seen.budget, seen.keep)
    assert np.array_equal(policy.score(view), policy.score(seen), equal_nan=True)
    kept, _ = kept_rows(policy.keep_indices(view))  # (Hkv, m), -1 after a shorter head's tokens (AdaKV)
    assert np.array_equal(kept, kept_rows(policy.keep_indices(seen))[0])
    assert np.array_equal(kept, events[-1].kept)  # the event records the decision itself
    for field, array in seen.fields.items():
        assert np.array_equal(view.fields[field], array, equal_nan=True), field
    if block is None:
        assert encode_case(policy, view, case_id=1, comment="")["mode"] == "oneshot"


def test_the_trace_records_every_eviction_with_its_kept_positions(tiny64):
    from refkv import Engine

    engine = Engine(tiny64, "tova", 8, record=True)
    engine.prefill(np.arange(20) % tiny64.config.vocab_size, 4)
    n_layers = tiny64.config.n_layers
    # 20 tokens in blocks of 4 under N = 8: blocks 2, 3 and 4 evict, in every layer.
    assert [(e.block, e.layer) for e in engine.trace.evictions] == [(b, lyr) for b in (2, 3, 4)
                                                                     for lyr in range(n_layers)]
    for e in engine.trace.evictions:
        assert e.view is None and e.stage == "after-attention" and e.positions.shape[1] == 12
        assert np.array_equal(e.kept_positions, engine.trace.kept[e.block][e.layer])
    with pytest.raises(ValueError, match="record must be False, True or 'views'"):
        Engine(tiny64, "tova", 8, record="all")


@pytest.mark.parametrize("name", [n for n in library_policies() if policies.policy_class(n).evict_before_attention])
def test_policies_that_evict_before_attention_have_no_one_shot_form(name):
    tokens = random_tokens(np.random.default_rng(0), 4, 2, 4, 48)
    with pytest.raises(ValueError, match=f"block size must be <= .* for {name}"):
        replay(policies.get(name), tokens, budget=40, layer=3, n_layers=4)


def test_a_one_shot_mode_the_view_contradicts_is_refused():
    tokens = random_tokens(np.random.default_rng(0), 4, 2, 4, 12)
    policy = policies.get("tova")
    view = replay(policy, tokens, block_size=3, budget=6)
    assert encode_case(policy, view, case_id=1, comment="")["mode"] == "block"
    with pytest.raises(ValueError, match="mode='oneshot' needs a view whose block is the whole prompt"):
        encode_case(policy, view, case_id=1, comment="", mode="oneshot")
    with pytest.raises(ValueError, match="mode must be one of"):
        encode_case(policy, view, case_id=1, comment="", mode="prefill")


# -- hand-built cases ---------------------------------------------------------------------------
def _view(keys, budget, *, queries=None, block=1):
    keys = np.asarray(keys, dtype=np.float64)
    hkv, n, d = keys.shape
    q = np.ones((hkv, block, d)) if queries is None else np.asarray(queries, dtype=np.float64)
    positions = np.broadcast_to(np.arange(n), (hkv, n)).copy()
    return View(layer=0, n_layers=1, keys=keys, values=keys.copy(), positions=positions, fields={}, queries=q,
                query_positions=np.arange(n - block, n), block_keys=keys[:, n - block:],
                block_values=keys[:, n - block:].copy(), attention=None, budget=budget)


def test_exact_tie_and_duplicate_keys_are_detected():
    # knorm keeps low-norm keys. Norms 1, 2, 2, 3 with budget 2: keep position 0, then the
    # tie between positions 1 and 2 goes to the more recent one (the shared tie rule).
    keys = [[[1.0, 0.0], [0.0, 2.0], [0.0, 2.0], [3.0, 0.0]]]
    case = encode_case(policies.get("knorm"), _view(keys, 2), case_id=1, comment="hand-made")
    assert case["outputs"]["kept"]["data"] == [0, 2]
    assert case["outputs"]["scores"]["data"] == [-1.0, -2.0, -2.0, -3.0]
    assert {"exact-tie", "duplicate-keys", "mha", "single-token"} <= set(case["flags"])
    assert "near-tie" not in case["flags"] and "no-eviction" not in case["flags"]


def test_zero_key_no_eviction_and_near_tie_are_detected():
    keys = [[[0.0, 0.0], [1.0, 0.0], [1.0 + 1e-13, 0.0]]]
    near = encode_case(policies.get("knorm"), _view(keys, 2), case_id=1, comment="")
    assert {"zero-norm-key", "near-tie"} <= set(near["flags"])
    assert "exact-tie" not in near["flags"]
    everything = encode_case(policies.get("knorm"), _view(keys, 3), case_id=2, comment="")
    assert "no-eviction" in everything["flags"]
    assert everything["outputs"]["kept"]["data"] == [0, 1, 2]


def test_boundary_gap_by_hand():
    scores = np.array([[5.0, 1.0, 3.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    protected = np.array([[False, True, False, False], [False] * 4])
    kept = np.array([[0, 1, 2], [1, 2, 3]])
    # head 0: unprotected kept {5, 3}, evicted {2} -> 3 - 2; head 1: all equal -> exact tie.
    assert boundary_gap(scores, kept, protected) == [1.0, 0.0]
    assert boundary_gap(scores, np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), protected) == [None, None]


def test_only_what_the_policy_reads_is_stored():
    rng = np.random.default_rng(0)
    tokens = random_tokens(rng, 4, 2, 4, 12)
    stored = {}
    for name in ("sink", "keydiff", "h2o", "hashevict"):
        p = policies.get(name)
        view = replay(p, tokens, block_size=2, budget=16 if name == "hashevict" else 6)
        stored[name] = set(encode_case(p, view, case_id=1, comment="")["inputs"])
    base = {"positions", "query_positions", "fields"}
    assert stored["sink"] == base
    assert stored["keydiff"] == base | {"keys"}  # block keys are keys[:, -B:] after attention
    assert stored["h2o"] == base | {"attention"}
    assert stored["hashevict"] == base | {"keys", "block_keys", "queries"}  # evicts before attention


@dataclass(frozen=True)
class _Undeclared(Policy):
    """Reads the queries without saying so in ``needs``."""

    name = "undeclared"
    needs = frozenset({"keys"})

    def score(self, view):
        return view.keys.sum(axis=-1) + float(view.queries.sum())


def test_a_policy_reading_undeclared_inputs_gets_every_input_stored():
    tokens = random_tokens(np.random.default_rng(1), 2, 2, 4, 9)
    view = replay(_Undeclared(), tokens, block_size=3, budget=4)
    case = encode_case(_Undeclared(), view, case_id=1, comment="")
    assert {"keys", "values", "queries"} <= set(case["inputs"])


def test_encode_read_round_trip_rebuilds_the_view(tmp_path):
    p = policies.get("tova")
    tokens = random_tokens(np.random.default_rng(2), 4, 2, 4, 10, dtype=np.float32)
    view = replay(p, tokens, block_size=3, budget=5, layer=1, n_layers=2)
    doc = vectors_document("tova", [({"all_heads": False}, [encode_case(p, view, case_id=7, comment="c")])])
    (tmp_path / "tova.json").write_text(dumps(doc))
    case = read_vectors(tmp_path / "tova.json").case(7)
    back = case.view()
    assert case.dtype == "float32" and case.layer == 1 and case.n_layers == 2 and case.budget == 5
    assert np.array_equal(back.attention, view.attention) and back.attention.dtype == np.float32
    assert np.array_equal(back.positions, view.positions)
    assert np.isnan(back.keys).all()  # TOVA never reads keys, so they are not in the file
    assert back.keep == view.keep == 5
    assert np.array_equal(kept_rows(p.keep_indices(back))[0], kept_rows(p.keep_indices(view))[0])
    assert str(case) == "tova-7" and "tova case 7" in case.label


# -- reader errors -------------------------------------------------------------------------------------
@pytest.fixture
def sink_doc():
    return json.loads((GOLDEN / "vectors" / "sink.json").read_text())


def _write(tmp_path, doc):
    path = tmp_path / "v.json"
    path.write_text(json.dumps(doc))
    return path


def test_reader_rejects_an_unknown_schema_version(tmp_path, sink_doc):
    sink_doc["schema_version"] = 2
    with pytest.raises(ValueError, match=r"unknown schema version 2 of refkv-vectors; this refkv reads versions \[1\]"):
        read_vectors(_write(tmp_path, sink_doc))


def test_reader_names_a_missing_field(tmp_path, sink_doc):
    del sink_doc["groups"][0]["cases"][2]["budget"]
    with pytest.raises(ValueError, match=r"groups\[0\]\.cases\[2\] \(id 3\): missing field 'budget'"):
        read_vectors(_write(tmp_path, sink_doc))


def test_reader_names_a_shape_mismatch(tmp_path, sink_doc):
    case = sink_doc["groups"][0]["cases"][0]
    case["inputs"]["positions"]["shape"] = [2, case["sizes"]["n"] + 1]
    with pytest.raises(ValueError, match=r"inputs.positions: shape mismatch"):
        read_vectors(_write(tmp_path, sink_doc))
    case["inputs"]["positions"]["shape"] = [case["sizes"]["n"], 2]
    with pytest.raises(ValueError, match=r"inputs.positions: shape mismatch: expected \(2, "):
        read_vectors(_write(tmp_path, sink_doc))


def test_reader_checks_counts_ids_and_kept_range(tmp_path, sink_doc):
    good = json.dumps(sink_doc)
    sink_doc["number_of_cases"] += 1
    with pytest.raises(ValueError, match="number_of_cases"):
        read_vectors(_write(tmp_path, sink_doc))
    sink_doc = json.loads(good)
    sink_doc["groups"][0]["cases"][1]["id"] = sink_doc["groups"][0]["cases"][0]["id"]
    with pytest.raises(ValueError, match="duplicate case id"):
        read_vectors(_write(tmp_path, sink_doc))
    sink_doc = json.loads(good)
    kept = sink_doc["groups"][0]["cases"][0]["outputs"]["kept"]
    kept["data"][0] = 999
    with pytest.raises(ValueError, match=r"outputs.kept must be integer column indices"):
        read_vectors(_write(tmp_path, sink_doc))


def test_candidate_files_need_only_ids_and_kept(tmp_path):
    doc = {"schema": "refkv-vectors", "schema_version": 1, "refkv_version": "x", "numpy_version": "y",
           "policy": "sink", "groups": [{"cases": [{"id": 1, "outputs": {"kept": {"dtype": "int32", "shape": [1, 1],
                                                                                     "data": [0]}}}]}]}
    vf = read_vectors(_write(tmp_path, doc), candidate=True)
    assert vf.cases[0].outputs["kept"].dtype == np.int32
    del doc["groups"][0]["cases"][0]["outputs"]["kept"]
    with pytest.raises(ValueError, match=r"missing field 'outputs.kept'"):
        read_vectors(_write(tmp_path, doc), candidate=True)


def test_tokens_validate_their_shapes():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        Tokens(np.zeros((3, 2, 4)), np.zeros((2, 2, 4)), np.zeros((2, 2, 4)))
    with pytest.raises(ValueError, match="keys and values must have shape"):
        Tokens(np.zeros((2, 2, 4)), np.zeros((2, 3, 4)), np.zeros((2, 2, 4)))
