"""Issue 26, readers and parameters: silent, hanging and unclear inputs (``test_attack_26_<NN>_*``).

Each test failed on the code issue 26 was filed against. :func:`test_reliability_26_table`
keeps the issue-26 table of ``docs/guide/reliability.rst`` and the tests named
``test_attack_26_<NN>_*`` in ``tests/test_reliability_*.py`` in step.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from refkv.cli import main
from refkv.experiments import runner
from refkv.experiments.records import append_record, cell_key, read_records
from refkv.experiments.settings import Settings
from refkv.files import load_json, parse_json, read_regular
from refkv.model import load, random_weights
from refkv.model.safetensors_dir import CheckpointError, read_safetensors

ROOT = Path(__file__).resolve().parents[1]
gguf = pytest.importorskip("gguf")

from test_checkpoint_dir import SMALL, write_checkpoint  # noqa: E402
from test_gguf import write_gguf  # noqa: E402

from refkv.model.gguf import GGUFError, read_block_count, read_gguf  # noqa: E402

BIG = 10**400  # a 401-digit integer: float() of it raises OverflowError


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def _clear(code: int, text: str, *needles: str) -> None:
    """Exit 2 with one ``error:`` line holding every needle, no traceback."""
    assert code == 2 and "Traceback" not in text, text
    lines = [line for line in text.splitlines() if "error:" in line]
    assert len(lines) == 1, text
    for needle in needles:
        assert needle in lines[0], (needle, text)


@pytest.fixture
def weights():
    return random_weights(SMALL, seed=5, dtype=np.float32)


def _header_file(path: Path, header_text: bytes, data: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + data)
    return path


def _patched_gguf(tmp_path: Path, name: str, patch) -> Path:
    base = tmp_path / "base.gguf"
    if not base.exists():
        write_gguf(base)
    data = bytearray(base.read_bytes())
    patch(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def _set_u64_after(data: bytearray, key: bytes, value: int, skip: int = 4) -> None:
    """Overwrite the 8 bytes after ``key`` and its ``skip``-byte type tag (a string's length)."""
    at = data.index(key) + len(key) + skip
    data[at:at + 8] = struct.pack("<Q", value)


# -- 4: safetensors headers that lie -----------------------------------------------------------------
def test_attack_26_04_safetensors_duplicate_name_and_shared_bytes_are_refused(tmp_path):
    entry = '{"dtype": "F32", "shape": [2], "data_offsets": [%d, %d]}'
    twice = ('{"a": ' + entry % (0, 8) + ', "a": ' + entry % (8, 16) + "}").encode()
    with pytest.raises(CheckpointError, match="key 'a' twice"):
        read_safetensors(_header_file(tmp_path / "dup.safetensors", twice, bytes(16)))
    shared = ('{"a": ' + entry % (0, 8) + ', "b": ' + entry % (0, 8) + "}").encode()
    with pytest.raises(CheckpointError, match="'a' and 'b' share bytes"):
        read_safetensors(_header_file(tmp_path / "shared.safetensors", shared, bytes(8)))
    overlap = ('{"a": ' + entry % (0, 8) + ', "b": ' + entry % (4, 12) + "}").encode()
    with pytest.raises(CheckpointError, match="share bytes"):
        read_safetensors(_header_file(tmp_path / "overlap.safetensors", overlap, bytes(12)))
    ok = ('{"a": ' + entry % (0, 8) + ', "b": ' + entry % (8, 16) + "}").encode()
    assert set(read_safetensors(_header_file(tmp_path / "ok.safetensors", ok, bytes(16)))) == {"a", "b"}


# -- 5: a GGUF holding more blocks than its block_count ----------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attack_26_05_gguf_with_more_blocks_than_block_count_is_refused(tmp_path, arch):
    path = tmp_path / "more.gguf"
    cfg = SMALL.replace(qk_norm=True) if arch == "qwen3" else SMALL
    write_gguf(path, cfg, arch=arch, extra={f"{arch}.block_count": ("uint32", 1)})
    with pytest.raises(GGUFError, match=f"{arch}.block_count = 1, but the file holds tensors for 2 blocks"):
        read_gguf(path, weights=False)


# -- 6, 7, 19: candidate files -------------------------------------------------------------------------
GOLDEN = ROOT / "tests" / "golden"


def _candidate(tmp_path: Path, change, kind: str = "vectors") -> Path:
    """A candidate folder: the sink golden (vectors, or one end-to-end manifest and its arrays), changed."""
    import shutil

    folder = tmp_path / "cand"
    if kind == "vectors":
        doc = json.loads((GOLDEN / "vectors" / "sink.json").read_text())
        text = change(doc)
        (folder / "vectors").mkdir(parents=True)
        (folder / "vectors" / "sink.json").write_text(text if isinstance(text, str) else json.dumps(doc))
    else:
        stem = "e2e/sink/N8-B4-float32"
        doc = json.loads((GOLDEN / f"{stem}.json").read_text())
        change(doc)
        (folder / "e2e" / "sink").mkdir(parents=True)
        (folder / f"{stem}.json").write_text(json.dumps(doc))
        shutil.copy(GOLDEN / f"{stem}.npz", folder / f"{stem}.npz")
    return folder


def _check(capsys, folder: Path, kind: str = "vectors", *extra) -> tuple[int, str]:
    return _cli(capsys, "golden", "check", folder, "--against", GOLDEN, "--policies", "sink", "--kind", kind,
                *extra)


def _all_scores(value):
    def change(doc):
        for group in doc["groups"]:
            for case in group["cases"]:
                scores = case["outputs"].get("scores")
                if scores is not None and isinstance(scores["data"], list):
                    scores["data"] = [value] * len(scores["data"])
    return change


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_attack_26_06_monotone_scores_that_are_not_finite_fail(capsys, tmp_path, value):
    code, text = _check(capsys, _candidate(tmp_path, _all_scores(value)), "vectors", "--declare",
                        "scores=monotone")
    # refused by the candidate gate (refkv.oracle.candidates) before the monotone comparison
    assert code == 1 and "FAIL" in text and "a candidate's floats must be finite" in text, text
    assert "Traceback" not in text
    honest = _candidate(tmp_path / "honest", lambda doc: None)
    code, text = _check(capsys, honest, "vectors", "--declare", "scores=monotone")
    assert code == 0, text


def test_attack_26_07_a_key_given_twice_is_refused(capsys, tmp_path):
    def twice(doc):
        case = doc["groups"][0]["cases"][0]
        right = json.dumps(case["outputs"]["kept"])
        wrong = json.dumps({**case["outputs"]["kept"], "data": [9] * len(case["outputs"]["kept"]["data"])})
        text = json.dumps(doc)
        return text.replace('"kept": ' + right, '"kept": ' + wrong + ', "kept": ' + right, 1)

    code, text = _check(capsys, _candidate(tmp_path, twice))
    assert code == 1 and "FAIL" in text and "the key 'kept' twice" in text, text
    with pytest.raises(ValueError, match=r"x\.json: JSON object has the key 'a' twice"):
        parse_json(b'{"a": 1, "a": 2}', "x.json")


MALFORMED = {
    "outputs-string": ("vectors", lambda d: d["groups"][0]["cases"][0].__setitem__("outputs", "kept")),
    "outputs-number": ("vectors", lambda d: d["groups"][0]["cases"][0].__setitem__("outputs", 5)),
    "group-list": ("vectors", lambda d: d["groups"].__setitem__(0, [1, 2])),
    "cases-number": ("vectors", lambda d: d["groups"][0].__setitem__("cases", 5)),
    "flags-number": ("vectors", lambda d: d["groups"][0]["cases"][0].__setitem__("flags", 5)),
    "kept-column-1e6": ("vectors", lambda d: d["groups"][0]["cases"][0]["outputs"]["kept"]["data"]
                        .__setitem__(0, 10**6)),
    "arrays-file-number": ("e2e", lambda m: m["arrays"].__setitem__("file", 5)),
    "contents-list": ("e2e", lambda m: m["arrays"].__setitem__("contents", [1])),
    "shape-number": ("e2e", lambda m: next(iter(m["arrays"]["contents"].values())).__setitem__("shape", 5)),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_attack_26_19_malformed_candidate_files_fail_cleanly(capsys, tmp_path, name):
    kind, change = MALFORMED[name]

    def apply(doc):
        change(doc)

    code, text = _check(capsys, _candidate(tmp_path, apply, kind), kind)
    assert code == 1 and "FAIL" in text and "Traceback" not in text, text
    assert "sink" in text


# -- 9, 16: prompts longer than the model's context ---------------------------------------------------
def test_attack_26_09_prompt_longer_than_the_context_is_refused(capsys, tmp_path, weights):
    from refkv.generation import generate_text
    from refkv.model import load_with_tokenizer

    model, tokenizer = load_with_tokenizer("tiny")
    context = model.config.max_positions
    with pytest.raises(ValueError, match=f"prompt has {context + 1} tokens, more than the model's context of "
                                         f"{context}"):
        generate_text(model, tokenizer, "x" * (context + 1), max_new_tokens=1, chat=False)
    path = tmp_path / "short.gguf"
    write_gguf(path)  # SMALL: a context of 512
    code, text = _cli(capsys, "generate", "z" * 693, "--model", path, "--raw", "--max-new-tokens", "1")
    _clear(code, text, "693 tokens", "context of 512")
    folder = _tokenizer_checkpoint(tmp_path, weights, max_position_embeddings=1)
    code, text = _cli(capsys, "generate", "the 42 others", "--model", folder, "--raw", "--max-new-tokens", "1")
    _clear(code, text, "more than the model's context of 1")


def test_attack_26_16_huge_prompts_are_refused_before_any_work(capsys, tmp_path):
    start = time.perf_counter()
    code, text = _cli(capsys, "generate", "x" * 100_000, "--model", "tiny", "--raw", "--max-new-tokens", "1")
    _clear(code, text, "100000 tokens", "context of")
    assert time.perf_counter() - start < 20
    from refkv.experiments.prefill import prefill_or_skip

    model = load("tiny", dtype="float32")
    too_long = model.config.max_positions + 1
    with pytest.raises(ValueError, match=f"has {too_long} tokens, more than the model's context"):
        prefill_or_skip({"policy": "sink", "budget": 16, "block": None, "length": too_long}, model,
                        np.zeros(too_long, dtype=np.int64))  # an experiment cell's prompt, before the engine
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (4 * 2**20 + 1))
    code, text = _cli(capsys, "generate", "--prompt-file", big, "--model", "tiny")
    _clear(code, text, "--prompt-file", "more than the")


# -- 10, 23: --threads -----------------------------------------------------------------------------------
def test_attack_26_10_threads_beyond_what_blas_runs_are_refused(capsys):
    from refkv.threads import MAX_THREADS, _blas_max_threads, choose_threads

    most = _blas_max_threads(MAX_THREADS)
    if most is None:
        pytest.skip("no BLAS thread pool to ask")
    code, text = _cli(capsys, "run", "--threads", 10_000, "--prompt-len", 8)
    _clear(code, text, "--threads must be an integer in [1, ", "got 10000")
    assert choose_threads(None, requested=min(most, 2)).n == min(most, 2)
    if most < MAX_THREADS:
        with pytest.raises(ValueError, match=rf"in \[1, {most}\] \(the most threads"):
            choose_threads(None, requested=most + 1)


def test_attack_26_23_absurd_threads_and_proc_stat(capsys, monkeypatch):
    from refkv import threads

    code, text = _cli(capsys, "run", "--threads", "99999999999999999999", "--prompt-len", 8)
    _clear(code, text, "--threads must be an integer")
    for line in ("cpu nan 0 0 0 0 0 0 0 0 0\n", "cpu inf 1 1 1 1 1 1 1\n", "cpu -5 1 1 1 1 1 1 1\n"):
        monkeypatch.setattr(threads, "_read_proc_stat", lambda line=line: line)
        assert threads._cpu_times() is None
        assert threads.idle_cores(0.0) is None


# -- 11, 12: FIFOs and devices are never read ---------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_attack_26_11_fifos_are_refused_without_blocking(capsys, tmp_path, weights):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    start = time.perf_counter()
    code, text = _cli(capsys, "generate", "hi", "--model", folder, "--max-new-tokens", "1")
    _clear(code, text, "config.json", "must be a regular file, but it is a FIFO")
    with pytest.raises(ValueError, match="must be a regular file, but it is a FIFO"):
        load_json(folder / "config.json", 1000)
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "perplexity.jsonl")
    for extra in ((), ("--dry-run",)):
        code, text = _cli(capsys, "experiment", "perplexity", "--quick", "--model", "tiny", "--out", out, *extra)
        _clear(code, text, "perplexity.jsonl", "FIFO")
    (out / "perplexity.jsonl").unlink()
    os.mkfifo(out / ".perplexity.jsonl.lock")
    code, text = _cli(capsys, "experiment", "perplexity", "--quick", "--model", "tiny", "--out", out)
    _clear(code, text, ".perplexity.jsonl.lock", "FIFO")
    assert time.perf_counter() - start < 30


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_attack_26_12_devices_are_refused(capsys, tmp_path, weights, monkeypatch):
    import io

    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    code, text = _cli(capsys, "generate", "hi", "--model", folder, "--max-new-tokens", "1")
    _clear(code, text, "config.json", "must be a regular file, but it is a device")
    code, text = _cli(capsys, "generate", "--prompt-file", "/dev/zero", "--model", "tiny")
    _clear(code, text, "/dev/zero", "a device")

    class Endless(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, buffer):
            buffer[:] = b"x" * len(buffer)
            return len(buffer)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Endless())))
    code, text = _cli(capsys, "generate", "-", "--model", "tiny")
    _clear(code, text, "stdin", "longer than")


# -- 13, 22: sizes, lengths and ids read from files ---------------------------------------------------------
@pytest.mark.parametrize("where", ["key", "architecture"])
@pytest.mark.parametrize("length", [2**62, 2**64 - 1])
def test_attack_26_13_gguf_string_lengths_beyond_the_file(tmp_path, where, length):
    def patch(data):
        if where == "key":
            data[24:32] = struct.pack("<Q", length)  # the first key's length
        else:
            _set_u64_after(data, b"general.architecture", length)

    path = _patched_gguf(tmp_path, "long.gguf", patch)
    assert read_block_count(path) is None  # the header probe gives up; nothing allocated
    with pytest.raises(GGUFError, match=r"long\.gguf"):
        read_gguf(path, weights=False)


def _tokenizer_checkpoint(tmp_path, weights, **config) -> Path:
    pytest.importorskip("tokenizers")
    from refkv.model import Tokenizer

    write_gguf(tmp_path / "small.gguf")
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights, **config)
    Tokenizer.from_gguf(tmp_path / "small.gguf").backend.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("token_id", [10**9, 10**8, SMALL.vocab_size, -1])
def test_attack_26_13_tokenizer_ids_beyond_the_vocabulary(tmp_path, weights, token_id):
    from refkv.model import load_with_tokenizer

    folder = _tokenizer_checkpoint(tmp_path, weights)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": token_id, "content": "<|bogus|>", "special": True, "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False})
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"tokenizer\.json: token '<\|bogus\|>' has id {token_id}; ids must "
                                              rf"be integers in \[0, {SMALL.vocab_size - 1}\]"):
        load_with_tokenizer(folder)
    assert time.perf_counter() - start < 10


def test_attack_26_13_candidates_with_too_many_values_are_refused_before_parsing(tmp_path):
    from refkv.files import MAX_JSON_ITEMS
    from refkv.oracle.io import read_json

    path = tmp_path / "many.json"
    path.write_bytes(b'{"a": [' + b"{}," * MAX_JSON_ITEMS + b"{}]}")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"many.json: JSON with about .* values, more than the {MAX_JSON_ITEMS}"):
        read_json(path)
    assert time.perf_counter() - start < 5


def test_attack_26_22_bad_model_metadata_names_the_file(tmp_path, weights, capsys):
    from refkv.model import load_with_tokenizer

    folder = _tokenizer_checkpoint(tmp_path, weights)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat_template must be a string"):
        load_with_tokenizer(folder)
    code, text = _cli(capsys, "generate", "hi", "--model", folder, "--raw", "--max-new-tokens", "1")
    _clear(code, text, "chat_template")

    path = _patched_gguf(tmp_path, "k64.gguf", lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 2**64 - 1)))
    code, text = _cli(capsys, "generate", "hi", "--model", path, "--max-new-tokens", "1")
    _clear(code, text, "k64.gguf")

    shape = b'{"a": {"dtype": "F32", "shape": [1099511627776, 1099511627776, 0], "data_offsets": [0, 0]}}'
    with pytest.raises(CheckpointError, match=r"x\.safetensors: tensor 'a': 'shape' must be a list of integers"):
        read_safetensors(_header_file(tmp_path / "x.safetensors", shape, b""))

    def bos(data):
        key = b"tokenizer.ggml.bos_token_id"
        at = data.index(key) + len(key) + 4
        data[at:at + 4] = struct.pack("<I", 4_000_000_000)

    path = _patched_gguf(tmp_path, "bos.gguf", bos)
    with pytest.raises(GGUFError, match=r"bos\.gguf: metadata tokenizer\.ggml\.bos_token_id = 4000000000 is not "
                                        r"a token id in \[0, 261\]"):
        read_gguf(path, weights=False)


# -- 14, 24: --scheduler --------------------------------------------------------------------------------------
def test_attack_26_14_a_server_that_never_answers_times_out(monkeypatch):
    pytest.importorskip("distributed")
    import http.server
    import threading

    from refkv.experiments import cluster

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.timeout = 30
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT", 1.0)
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=r"no Dask scheduler answered within 1\.0 s"):
            with cluster.dask_executor(f"tcp://127.0.0.1:{server.server_port}"):
                pass
    finally:
        server.shutdown()
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("address, message", [
    ("tcp://localhost:99999", "invalid port '99999'"),
    ("tcp://localhost:0", "invalid port '0'"),
    ("tcp://localhost:http", "invalid port 'http'"),
    ("tcp://:8786", "has no valid host"),
])
def test_attack_26_24_scheduler_address_is_checked_before_connecting(capsys, tmp_path, address, message):
    start = time.perf_counter()
    code, text = _cli(capsys, "experiment", "perplexity", "--quick", "--model", "tiny", "--scheduler", address,
                      "--out", tmp_path / "o")
    _clear(code, text, message)
    assert time.perf_counter() - start < 5
    from refkv.experiments.cluster import check_scheduler

    assert check_scheduler("tcp://127.0.0.1:8786") == "tcp://127.0.0.1:8786"


# -- 15: parameters with no upper bound -------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["run", "--policy", "hashevict", "--param", "n_bits=1000000000"], "n_bits must be an integer in [1, 1024]"),
    (["run", "--policy", "hashevict", "--param", "n_bits=2000000"], "n_bits must be an integer in [1, 1024]"),
    (["run", "--policy", "expected_attention", "--param", "n_future_positions=10000000000"],
     "n_future_positions must be an integer in [1, 131072]"),
    (["run", "--policy", "snapkv", "--param", "kernel=1000000001"], "kernel must be an integer in [1, 131073]"),
    (["run", "--prompt-len", "1000000000"], "--prompt-len must be an integer in [1, 131072], got 1000000000"),
    (["experiment", "passkey", "--passkey-lengths", "1000000000", "--model", "tiny", "--dry-run"],
     "passkey_lengths must be an integer in [64, 131072]"),
    (["experiment", "perplexity", "--texts", "1000000000", "--dry-run", "--model", "tiny"],
     "texts must be an integer in [1, 10000]"),
])
def test_attack_26_15_parameters_have_upper_bounds(capsys, tmp_path, argv, message):
    start = time.perf_counter()
    if argv[0] == "experiment":
        argv = [*argv, "--out", str(tmp_path / "o")]
    code, text = _cli(capsys, *argv)
    _clear(code, text, message)
    assert time.perf_counter() - start < 10


# -- 17: 400-digit integers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["rope_theta", "rms_norm_eps"])
def test_attack_26_17_huge_integers_in_config_json(tmp_path, weights, key):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights)
    text = (folder / "config.json").read_text()
    config = json.loads(text)
    (folder / "config.json").write_text(text.replace(json.dumps(config[key]), str(BIG), 1))
    with pytest.raises(CheckpointError, match=rf"config\.json: {key} must be a finite number") as info:
        load(folder)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("argv", [["run", "--policy", "keydiff", "--budget", "16", "--param", f"eps={BIG}"],
                                  ["experiment", "perplexity", "--quick", "--model", "tiny", "--dry-run",
                                   "--policies", f"keydiff:eps={BIG}"]])
def test_attack_26_17_huge_integers_on_the_command_line(capsys, tmp_path, argv):
    if argv[0] == "experiment":
        argv = [*argv, "--out", str(tmp_path / "o")]
    code, text = _cli(capsys, *argv)
    _clear(code, text, "eps must be a finite number", "got an integer of about 1329 bits")
    assert "OverflowError" not in text


# -- 18: deeply nested JSON ----------------------------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000


def test_attack_26_18_deeply_nested_json_is_refused(tmp_path, weights):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights)
    (folder / "config.json").write_bytes(b'{"a": ' + DEEP + b"}")
    with pytest.raises(CheckpointError, match=r"config\.json: JSON nested deeper than the 64 levels"):
        load(folder)
    with pytest.raises(CheckpointError, match="the header: JSON nested deeper"):
        read_safetensors(_header_file(tmp_path / "deep.safetensors", b'{"a": ' + DEEP + b"}", b""))
    path = tmp_path / "r.jsonl"
    append_record(path, {"key": "a", "params": {}, "result": {"v": 1}})
    with open(path, "ab") as f:
        f.write(b'{"key": "b", "result": ' + DEEP + b"}\n")
    with pytest.warns(UserWarning, match=r"r\.jsonl:2: skipping an unreadable record .*nested deeper"):
        records = read_records(path)
    assert [r["key"] for r in records] == ["a"]
    with pytest.raises(ValueError, match="nested deeper than the 3 levels"):
        parse_json(b"[[[[1]]]]", "x", max_depth=3)
    assert parse_json(b"[[[1]]]", "x", max_depth=3) == [[[1]]]


# -- 21: resume on bad records ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, reason", [
    (b'{"key": [1, 2]}', "a string key"),
    (b'{"key": "x", "params": {}, "result": "garbage"}', "result must be an object"),
    (b'{"key": "x", "params": {}, "result": {"losses": [NaN]}}', "non-standard JSON constant NaN"),
])
def test_attack_26_21_bad_records_are_skipped_naming_file_and_line(tmp_path, line, reason):
    path = tmp_path / "r.jsonl"
    append_record(path, {"key": "a", "params": {}, "result": {"v": 1}})
    with open(path, "ab") as f:
        f.write(line + b"\n")
    with pytest.warns(UserWarning, match=rf"r\.jsonl:2: skipping an unreadable record .*{re.escape(reason)}.*runs "
                                         rf"again"):
        records = read_records(path)
    assert [r["key"] for r in records] == ["a"]


def test_attack_26_21_resume_reruns_the_bad_cell(tmp_path):
    from test_reliability_writes import _toy

    out = tmp_path / "out"
    out.mkdir()
    good = cell_key({"i": 0})
    (out / "toy26.jsonl").write_text(
        json.dumps({"key": good, "params": {"i": 0}, "result": {"value": 0}}) + "\n"
        + json.dumps({"key": cell_key({"i": 1}), "params": {"i": 1}, "result": "garbage"}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = runner.run(_toy(), Settings(quick=True), out=out, stream=open(os.devnull, "w"))
    assert [r["result"] for r in records["toy26"]] == [{"value": 0}, {"value": 1}]


# -- the shared readers --------------------------------------------------------------------------------------------
def test_read_regular_states_its_caps(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_regular(path, 10) == b"x" * 10
    with pytest.raises(ValueError, match="has 10 bytes, more than the 9 allowed"):
        read_regular(path, 9)
    outside = tmp_path / "outside"
    outside.write_text("{}")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="symlink leading out of"):
        read_regular(tmp_path / "in" / "link", 10, root=tmp_path / "in")
    assert read_regular(tmp_path / "in" / "link", 10) == b"{}"


# -- the table of docs/guide/reliability.rst -------------------------------------------------------------------------
ATTACK_TEST = re.compile(r"^def (test_attack_26_(\d\d)_\w+)\(", re.MULTILINE)


def test_reliability_26_table():
    """Every row of the issue-26 table has a test ``test_attack_26_<NN>_*`` and every such test a
    row; every row was tried and came out clear."""
    text = (ROOT / "docs" / "guide" / "reliability.rst").read_text()
    table = text[text.index(".. table:: Issue 26"):]
    table = table[:table.index("inputs tried")]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"^\s*(\d+)\s{2,}(.+?)\s{2,}(\w[\w ]*?)\s{2,}"
                         r"(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", line)
        if match:
            item = int(match.group(1))
            assert item not in rows, f"item {item} appears twice"
            rows[item] = [match.group(2), match.group(3), *map(int, match.groups()[3:])]
    assert sorted(rows) == list(range(1, len(rows) + 1)) and len(rows) >= 20, sorted(rows)
    for item, (attack, was, tried, clear, unclear, silent, lost, hang) in rows.items():
        assert was in ("data loss", "silent", "hang", "unclear"), (item, was)
        assert tried >= 1 and clear == tried, (item, attack)
        assert (unclear, silent, lost, hang) == (0, 0, 0, 0), (item, attack)
    tested: dict[int, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_reliability_*.py")):
        for name, number in ATTACK_TEST.findall(path.read_text()):
            tested.setdefault(int(number), []).append(name)
    assert sorted(set(rows) - set(tested)) == [], "rows without a test_attack_26_NN_* test"
    assert sorted(set(tested) - set(rows)) == [], "tests for items not in the table"
