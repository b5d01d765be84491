"""Fuzzing every reader of outside input (issue 26): it loads, or it refuses cleanly.

Each fuzzer feeds hypothesis-made inputs to one reader — GGUF header, safetensors header,
``config.json``, ``tokenizer.json``, candidate files, suite manifests, results JSONL — and
holds it to one of two outcomes: it loads, or it raises a ``ValueError`` (the CLI's exit 2)
whose message names the file. Any other exception (``TypeError``, ``KeyError``,
``OverflowError``, ``MemoryError``, ``RecursionError``...) fails the test, and so does an
example slower than its stated deadline. Inputs are valid files with one part replaced by
an arbitrary JSON value or arbitrary bytes (lengths, counts, types, nesting), so the
reader is driven past its first check. The example counts keep all fuzzers together at
about a minute (``MAX_EXAMPLES``).
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"

#: Examples per fuzzer, and the deadline of one example (ms): together about a minute. The
#: binary headers are cheap per example and get more.
MAX_EXAMPLES = 100
BINARY_EXAMPLES = 200
DEADLINE_MS = 5000

_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=DEADLINE_MS, derandomize=True, database=None,
                suppress_health_check=_HEALTH)
FUZZ_BINARY = settings(FUZZ, max_examples=BINARY_EXAMPLES)

# Arbitrary JSON values: the strange ones readers meet (huge and negative numbers, deep
# nesting, lists where objects belong).
_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([10**400, -1, 0, 2**63, 2**64 - 1])
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _paths(obj, prefix=()):
    """Every (nested) location of a JSON document, as key/index tuples."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from _paths(v, (*prefix, i))


def _replace(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return obj


@st.composite
def mutated(draw, doc, paths=None):
    """``doc`` with one location (drawn from ``paths``, or all) replaced by an arbitrary JSON value."""
    paths = paths if paths is not None else list(_paths(doc))
    return _replace(doc, draw(st.sampled_from(paths)), draw(JSON))


def _refusal(err: BaseException, *names: str) -> None:
    """A clean refusal: a ValueError, one line, naming the file."""
    assert isinstance(err, ValueError), f"{type(err).__name__}: {err}"
    message = str(err)
    assert any(name in message for name in names), message
    assert "\n" not in message.strip() or message.count("\n") < 30, message


def _outcome(read, *names):
    try:
        return read()
    except ValueError as err:
        _refusal(err, *names)
        return None


# -- GGUF header -------------------------------------------------------------------------------------
gguf = pytest.importorskip("gguf")


_SMALL_GGUF: list[bytes] = []


@pytest.fixture(scope="module", autouse=True)
def _small_gguf_made(tmp_path_factory):
    """A small valid GGUF file's bytes, made once before the fuzzers (kept out of the
    hypothesis arguments, so a failure report does not print a megabyte)."""
    from test_gguf import write_gguf

    path = tmp_path_factory.mktemp("fuzz") / "small.gguf"
    write_gguf(path)
    _SMALL_GGUF[:] = [path.read_bytes()]


def _header_end(data: bytes) -> int:
    """Bytes of the key/value section (the tokenizer arrays included), where the fuzzing acts."""
    return min(len(data), data.index(b"tokenizer.ggml.tokens") + 64)


@FUZZ_BINARY
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["u64", "u32", "byte"]),
                                st.sampled_from([0, 1, 7, 255, 2**31, 2**32 - 1, 2**62, 2**64 - 1])),
                      min_size=1, max_size=3))
def test_fuzz_gguf_header(tmp_path_factory, edits):
    from refkv.model.gguf import read_block_count, read_gguf

    small_gguf = _SMALL_GGUF[0]
    data = bytearray(small_gguf)
    end = _header_end(small_gguf)
    for at, kind, value in edits:
        at %= end
        if kind == "u64":
            data[at:at + 8] = struct.pack("<Q", value)
        elif kind == "u32":
            data[at:at + 4] = struct.pack("<I", value % 2**32)
        else:
            data[at] = value % 256
    path = tmp_path_factory.mktemp("g") / "fuzzed.gguf"
    path.write_bytes(bytes(data))
    depth = read_block_count(path)  # never raises: an int or None
    assert depth is None or isinstance(depth, int)
    _outcome(lambda: read_gguf(path, weights=False), "fuzzed.gguf")


# -- safetensors header ----------------------------------------------------------------------------
_ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@FUZZ_BINARY
@given(header=mutated({"a": _ENTRY, "b": {**_ENTRY, "data_offsets": [16, 32]}, "__metadata__": {"format": "pt"}}),
       declared=st.sampled_from([None, 0, 7, 2**63, 2**64 - 1]), data=st.binary(max_size=40))
def test_fuzz_safetensors_header(tmp_path_factory, header, declared, data):
    from refkv.model.safetensors_dir import read_safetensors

    text = json.dumps(header).encode()
    size = len(text) if declared is None else declared
    path = tmp_path_factory.mktemp("s") / "fuzzed.safetensors"
    path.write_bytes(struct.pack("<Q", size) + text + data)
    tensors = _outcome(lambda: read_safetensors(path), "fuzzed.safetensors")
    if tensors is not None:
        assert all(isinstance(a, np.ndarray) for a in tensors.values())


# -- config.json -------------------------------------------------------------------------------------
CONFIG = {"model_type": "llama", "vocab_size": 262, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 50000.0,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 512, "hidden_act": "silu",
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}


@FUZZ
@given(config=mutated(CONFIG), extra=st.dictionaries(st.sampled_from(["head_dim", "attention_bias", "mlp_bias",
                                                                       "rope_parameters", "architectures",
                                                                       "text_config", "layer_types"]), JSON,
                                                      max_size=2))
def test_fuzz_config_json(tmp_path_factory, config, extra):
    from refkv.model.safetensors_dir import _config

    folder = tmp_path_factory.mktemp("c") / "ckpt"
    folder.mkdir()
    if isinstance(config, dict):
        config = {**config, **extra}
    (folder / "config.json").write_text(json.dumps(config))
    _outcome(lambda: _config(folder), "config.json")


# -- tokenizer.json ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_spec(tmp_path_factory) -> dict:
    pytest.importorskip("tokenizers")
    from test_gguf import write_gguf

    from refkv.model import Tokenizer

    folder = tmp_path_factory.mktemp("t")
    write_gguf(folder / "small.gguf")
    Tokenizer.from_gguf(folder / "small.gguf").backend.save(str(folder / "tokenizer.json"))
    return json.loads((folder / "tokenizer.json").read_text())


@FUZZ
@given(data=st.data())
def test_fuzz_tokenizer_json(tmp_path_factory, tokenizer_spec, data):
    from refkv.model.safetensors_dir import vocab_from_tokenizer_json

    paths = [p for p in _paths(tokenizer_spec) if not (len(p) >= 3 and p[:2] == ("model", "vocab"))]
    paths += [("model", "vocab", "Ġthe"), ("added_tokens", 0, "id"), ("added_tokens", 0)]
    spec = data.draw(mutated(tokenizer_spec, paths))
    settings_doc = data.draw(st.none() | st.dictionaries(st.sampled_from(["chat_template", "eos_token",
                                                                          "bos_token", "add_bos_token"]), JSON))
    folder = tmp_path_factory.mktemp("tk")
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    if settings_doc is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(settings_doc))
    vocab = _outcome(lambda: vocab_from_tokenizer_json(folder, 261), "tokenizer.json", "tokenizer_config.json")
    if vocab is not None:
        assert len(vocab.tokens) <= 262


# -- candidate files ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vectors_doc() -> dict:
    doc = json.loads((GOLDEN / "vectors" / "sink.json").read_text())
    doc["groups"] = doc["groups"][:1]
    doc["groups"][0]["cases"] = doc["groups"][0]["cases"][:2]
    return doc


@FUZZ
@given(data=st.data())
def test_fuzz_candidate_files(tmp_path_factory, vectors_doc, data):
    from refkv.oracle.vectorcheck import check_vector_file

    candidate = data.draw(mutated(vectors_doc, [p for p in _paths(vectors_doc) if "inputs" not in p]))
    folder = tmp_path_factory.mktemp("v")
    path = folder / "sink.json"
    path.write_text(json.dumps(candidate))
    report = _outcome(lambda: check_vector_file(path, GOLDEN / "vectors" / "sink.json"), "sink.json")
    if report is not None:
        assert report.status.name in ("PASS", "FAIL", "MISSING", "SKIPPED", "NOTE") or report.status


@FUZZ
@given(data=st.data())
def test_fuzz_end_to_end_manifests(tmp_path_factory, data):
    import shutil

    from refkv.oracle.e2echeck import check_end_to_end_file

    stem = "e2e/sink/N8-B4-float32"
    manifest = json.loads((GOLDEN / f"{stem}.json").read_text())
    candidate = data.draw(mutated(manifest, [p for p in _paths(manifest) if p[:1] in (("arrays",), ("budget",),
                                                                                       ("mode",), ("dtype",))]))
    folder = tmp_path_factory.mktemp("e")
    shutil.copy(GOLDEN / f"{stem}.npz", folder / "N8-B4-float32.npz")
    path = folder / "N8-B4-float32.json"
    path.write_text(json.dumps(candidate))
    _outcome(lambda: check_end_to_end_file(path, GOLDEN / f"{stem}.json"), "N8-B4-float32")


# -- suite manifests ---------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_fuzz_suite_manifest(tmp_path_factory, data):
    from refkv.oracle.suiteindex import existing_index, read_suite

    index = json.loads((GOLDEN / "suite.json").read_text())
    index["files"] = index["files"][:3]
    paths = [p for p in _paths(index) if p[:1] in (("policies",), ("files",), ("skipped",), ("schema_version",))
             or p == ()]
    tampered = data.draw(mutated(index, paths))
    folder = tmp_path_factory.mktemp("suite")
    (folder / "suite.json").write_text(json.dumps(tampered))
    _outcome(lambda: read_suite(folder, verify=False), "suite.json")
    _outcome(lambda: existing_index(folder, {"sink"}), "suite.json", str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["suite.json"]  # a reader writes nothing


# -- results JSONL ---------------------------------------------------------------------------------------
RECORD = {"experiment": "perplexity", "key": '{"i":0}', "params": {"i": 0}, "result": {"loss": [1.0, 2.0]},
          "wall_time_s": 1.0}


@FUZZ
@given(lines=st.lists(mutated(RECORD).map(lambda r: json.dumps(r).encode())
                      | st.binary(max_size=40) | st.sampled_from([b"[" * 5000, b'{"key": "k", "result": NaN}']),
                      max_size=5), newline=st.booleans())
def test_fuzz_results_jsonl(tmp_path_factory, lines, newline):
    from refkv.experiments.records import cut_partial_tail, read_records

    path = tmp_path_factory.mktemp("r") / "fuzzed.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"\n" if newline else b""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = read_records(path)  # never raises: unreadable lines are skipped with a warning
    assert all(isinstance(r, dict) and isinstance(r["key"], str) for r in records)
    cut_partial_tail(path)
    assert path.read_bytes() == b"" or path.read_bytes().endswith(b"\n")


# -- issue 36: schedule goldens, overlap resume records, the registration file -----------------------------
#: Fewer examples each: three more fuzzers within the file's minute.
FUZZ_36 = settings(FUZZ, max_examples=60)
FUZZ_36_SCHEDULE = settings(FUZZ, max_examples=40)  # a golden read per example: the slowest
SCHEDULE_STEM = "e2e/keydiff/sched-oneshot-K4-N16-float64"
#: Values a forged size takes: huge, negative, zero, fractional, a string of digits.
SIZES = st.sampled_from([10**9, 2**31, 2**63, 10**400, -1, 0, 1.5, "16", None]) | st.integers(-5, 10**12)


@FUZZ_36_SCHEDULE
@given(data=st.data())
def test_fuzz_schedule_manifests(tmp_path_factory, data):
    """A schedule golden's manifest (no suite.json, so no checksum) with one field replaced: it
    reads as the manifest it was, or is refused naming the file -- never a traceback, never an
    allocation sized by a forged number (``d_head`` of 10**9 took 7.45 GiB)."""
    import shutil

    from refkv.oracle.endtoend import read_end_to_end

    manifest = json.loads((GOLDEN / f"{SCHEDULE_STEM}.json").read_text())
    # Where sizes and lengths live (what the check sizes arrays by), replaced by a size-like
    # value half of the time (huge, negative, fractional, a string) and any JSON value otherwise.
    paths = [p for p in _paths(manifest) if p[:2] in (("model", "config"), ("prompt", "length"),
                                                       ("decode", "length"), ("schedule",), ("tolerance",))
             or p in (("dtype",), ("policy",), ("rounds",))]
    path_to = data.draw(st.sampled_from(paths))
    value = data.draw(SIZES | JSON)
    tampered = _replace(manifest, path_to, value)
    folder = tmp_path_factory.mktemp("s")
    name = Path(SCHEDULE_STEM).name
    shutil.copy(GOLDEN / f"{SCHEDULE_STEM}.npz", folder / f"{name}.npz")
    path = folder / f"{name}.json"
    path.write_text(json.dumps(tampered))
    golden = _outcome(lambda: read_end_to_end(path), name)
    if golden is not None:  # accepted: every size the check uses is the arrays' own
        cfg = golden.manifest["model"]["config"]
        kept = golden.arrays["kept"]
        assert (kept.shape[1], kept.shape[2]) == (cfg["n_layers"], cfg["n_kv_heads"])
        assert 1 <= cfg["d_head"] <= 1 << 18
        assert golden.arrays["prompt"].shape == (golden.manifest["prompt"]["length"],)
        assert golden.arrays["decode"].shape == (golden.manifest["decode"]["length"],)


_KEPT_RESULT = {"tokens": 6, "kept": [[[0, 1, 5], [0, 2, 5]], [[1, 3, 5], [0, 4, 5]]]}


@FUZZ_36
@given(result=mutated(_KEPT_RESULT) | st.sampled_from([{}, {"kept": "x"}, {"tokens": 6, "kept": [[[10**9]]]}]))
def test_fuzz_overlap_records(tmp_path_factory, result):
    """An overlap record whose result is replaced: it counts as finished only if it is a result
    :func:`~refkv.experiments.overlap.run_cell` could make; otherwise it is skipped with a warning
    naming the file and line (its cell runs again)."""
    from refkv.experiments.overlap import EXPERIMENT
    from refkv.experiments.records import read_records

    path = tmp_path_factory.mktemp("o") / "overlap.jsonl"
    record = {"key": "k", "params": {"policy": "sink"}, "result": result}
    path.write_text(json.dumps(record) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_records(path, EXPERIMENT.check_result)
    if records:
        kept, tokens = records[0]["result"].get("kept"), records[0]["result"].get("tokens")
        if kept is not None:  # a finished cell: positions inside its prompt, as many heads per layer
            assert all(isinstance(p, int) and 0 <= p < tokens for layer in kept for row in layer for p in row)
            assert len({len(layer) for layer in kept}) == 1
        else:
            assert isinstance(records[0]["result"]["skipped"], str)
    else:
        assert any(f"{path}:1" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def registration_doc():
    return json.loads((ROOT / "docs" / "experiment_registration.json").read_text())


@FUZZ_36
@given(data=st.data())
def test_fuzz_registration(tmp_path_factory, registration_doc, data):
    """The registration file with one field replaced: read as valid (alpha in (0, 1), claims with
    distinct string ids, known directions) or refused naming the file -- never a traceback."""
    from refkv.experiments.registered import DIRECTIONS, read_registration

    # A group first (alpha, the ceiling, the claims list, one claim field), then a place in it:
    # each field the verdicts read is hit as often as any other.
    groups = [[("alpha",)], [("samples", "passkey_ceiling_required")], [("claims",)]]
    for field in ("id", "direction", "comparisons", "paper", "measure"):
        groups.append([p for p in _paths(registration_doc) if len(p) >= 3 and p[0] == "claims" and p[2] == field])
    place = data.draw(st.sampled_from(data.draw(st.sampled_from(groups))))
    doc = _replace(registration_doc, place, data.draw(SIZES | JSON | st.just(float("nan"))))
    path = tmp_path_factory.mktemp("g") / "registration.json"
    path.write_text(json.dumps(doc))
    reg = _outcome(lambda: read_registration(path), "registration.json")
    if reg is not None:
        assert 0 < reg["alpha"] < 1 and not isinstance(reg["alpha"], bool)
        assert 0 < reg["samples"]["passkey_ceiling_required"] <= 1
        ids = [c["id"] for c in reg["claims"]]
        assert ids and all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)
        assert all(c["direction"] in DIRECTIONS for c in reg["claims"])
