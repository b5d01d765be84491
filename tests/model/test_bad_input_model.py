"""Issue 13's attacks on the model loaders (items 4, 8, 10, 14, 15 and the ``load`` part of 17).

Each test is named ``test_attack_13_<item>_<slug>`` and failed before the fix: the input
was accepted silently, gave a traceback of the wrong type, named neither the file nor the
field, or (item 4) grew the loader's memory with an edited count. Every refusal here is a
one-line ``ValueError`` (the CLI prints ``error: ...`` and exits 2) naming the file and the
metadata key, config field or tensor at fault.
"""

import json
import struct
import time

import numpy as np
import pytest

from refkv.model import ModelNotFoundError, load, load_with_tokenizer, random_weights
from refkv.model.gguf import GGUFError, read_gguf
from refkv.model.safetensors_dir import CheckpointError, read_safetensors

gguf = pytest.importorskip("gguf")

from test_checkpoint_dir import SMALL, write_checkpoint, write_safetensors  # noqa: E402
from test_gguf import write_gguf  # noqa: E402


def one_line(err: BaseException) -> str:
    message = str(err)
    assert "\n" not in message, message
    return message


@pytest.fixture
def weights():
    return random_weights(SMALL, seed=5, dtype=np.float32)


# -- 4: counts checked against the file before anything is sized by them ---------------------
@pytest.mark.parametrize("blocks", [3, 200_000, 4_000_000_000])
def test_attack_13_04_gguf_block_count(tmp_path, blocks):
    path = tmp_path / "blocks.gguf"
    write_gguf(path, extra={"llama.block_count": ("uint32", blocks)})
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=f"llama.block_count = {blocks}, but the file holds tensors for 2 blocks"):
        read_gguf(path)
    assert time.perf_counter() - start < 5.0  # refused from the tensor list, nothing sized by the count


# -- 8: absurd or infinite config values and overflowing weights are refused at load ----------
@pytest.mark.parametrize(("key", "kind", "value"), [
    ("llama.rope.freq_base", "float32", np.inf),
    ("llama.rope.freq_base", "float32", np.nan),
    ("llama.attention.layer_norm_rms_epsilon", "float32", np.inf),
    ("llama.context_length", "uint32", 0),
])
def test_attack_13_08_gguf_absurd_config_values(tmp_path, key, kind, value):
    path = tmp_path / "absurd.gguf"
    write_gguf(path, extra={key: (kind, value)})
    with pytest.raises(GGUFError, match=key.replace(".", r"\.")) as info:
        read_gguf(path, weights=False)
    one_line(info.value)


@pytest.mark.parametrize(("change", "field"), [
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
])
def test_attack_13_08_checkpoint_absurd_config_values(tmp_path, weights, change, field):
    write_checkpoint(tmp_path / "ckpt", weights, **change)  # json writes Infinity / NaN, as the attack did
    with pytest.raises(CheckpointError, match=field) as info:
        load(tmp_path / "ckpt")
    one_line(info.value)


def test_attack_13_08_overflowing_norm_weight(tmp_path, weights):
    """3e38 is a finite float32, but its square is not: the forward pass would print garbage."""
    weights.layers[1].attn_norm[3] = 3e38
    path = tmp_path / "huge.gguf"
    write_gguf(path, weights=weights)
    with pytest.raises(GGUFError, match=r"layers\[1\]\.attn_norm has a value of magnitude 3e\+38") as info:
        load(path)
    one_line(info.value)
    write_checkpoint(tmp_path / "ckpt", weights)
    with pytest.raises(CheckpointError, match=r"layers\[1\]\.attn_norm has a value of magnitude 3e\+38"):
        load(tmp_path / "ckpt")
    # float64 has room for it: the same weights load in float64 (its square is finite there)
    assert load(tmp_path / "ckpt", dtype=np.float64).weights.layers[1].attn_norm[3] == np.float32(3e38)


def test_attack_13_08_non_finite_after_dequantisation_names_the_tensor(tmp_path, weights):
    """A Q8_0 block scale edited to float16 inf: the dequantised tensor is named with its file."""
    path = tmp_path / "q8.gguf"
    write_gguf(path, weights=weights, qtype="Q8_0")
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    data[tensor.data_offset:tensor.data_offset + 2] = np.float16(np.inf).tobytes()  # first block's scale d
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"q8\.gguf: .*layers\[1\]\.w_down contains NaN or inf"):
        load(path)


# -- 10: one tensor in two shards ---------------------------------------------------------------
def test_attack_13_10_tensor_in_two_shards(tmp_path, weights):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights)
    bogus = {"model.norm.weight": np.full(SMALL.d_model, 7.0, np.float32)}
    write_safetensors(folder / "model-extra.safetensors", bogus)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is in two shards, model-0000\d-of-00002"
                                              r"\.safetensors and model-extra\.safetensors"):
        load(folder)


# -- 14: checkpoint folders: missing tokenizer, invalid JSON, malformed fields and headers -------
def test_attack_13_14_checkpoint_without_tokenizer(tmp_path, weights, capsys):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights)
    load(folder)  # the model alone needs no tokenizer
    with pytest.raises(ModelNotFoundError, match=r"ckpt/tokenizer\.json not found"):
        load_with_tokenizer(folder)
    from refkv.cli import main

    assert main(["generate", "hello", "--model", str(folder), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "tokenizer.json" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_attack_13_14_invalid_json_names_the_file(tmp_path, weights, name):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights)
    (folder / name).write_text('{"vocab_size": 262,')
    with pytest.raises(CheckpointError, match=rf"ckpt/{name}: not valid JSON") as info:
        load_with_tokenizer(folder)
    one_line(info.value)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_attention_heads": "four"}, r"num_attention_heads must be an integer >= 1, got 'four'"),
    ({"rope_scaling": "linear"}, r"rope_scaling must be a JSON object or null, got 'linear'"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be true or false, got 'yes'"),
    ({"num_hidden_layers": 2.5}, r"num_hidden_layers must be an integer >= 1, got 2\.5"),
])
def test_attack_13_14_malformed_config_fields(tmp_path, weights, change, message):
    write_checkpoint(tmp_path / "ckpt", weights, **change)
    with pytest.raises(CheckpointError, match=r"ckpt/config\.json: " + message) as info:
        load(tmp_path / "ckpt")
    one_line(info.value)


def test_attack_13_14_config_that_is_a_json_list(tmp_path, weights):
    write_checkpoint(tmp_path / "ckpt", weights)
    (tmp_path / "ckpt" / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config\.json: must hold a JSON object .*got list"):
        load(tmp_path / "ckpt")


@pytest.mark.parametrize(("header", "message"), [
    ({"a": {"shape": [2], "data_offsets": [0, 8]}}, r"tensor 'a': header entry has no 'dtype'"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}},
     r"tensor 'a': 'data_offsets' must be two integers \[start, stop\], got \['0', '8'\]"),
    ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, r"tensor 'a': 'shape' must be a list"),
    ({"a": [1, 2]}, r"tensor 'a': header entry must be a JSON object"),
    ([1, 2], r"the header must be a JSON object, got list"),
])
def test_attack_13_14_malformed_safetensors_headers(tmp_path, header, message):
    path = tmp_path / "bad.safetensors"
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(8))
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: " + message) as info:
        read_safetensors(path)
    one_line(info.value)


# -- 15: misleading GGUF messages ------------------------------------------------------------------
@pytest.mark.parametrize(("heads", "message"), [
    (0, r"llama\.attention\.head_count must be an integer >= 1, got 0"),
    (7, r"llama\.attention\.head_count = 7 does not divide llama\.embedding_length = 64"),
    (8, r"llama\.attention\.head_count = 8, head_count_kv = 2 and head width 8 imply 16 rows of "
        r"blk\.0\.attn_k\.weight; the file has 32"),
])
def test_attack_13_15_gguf_head_count(tmp_path, heads, message):
    path = tmp_path / "heads.gguf"
    write_gguf(path, extra={"llama.attention.head_count": ("uint32", heads)})
    with pytest.raises(GGUFError, match=message) as info:
        read_gguf(path)
    assert "partial RoPE" not in str(info.value)


def test_attack_13_15_gguf_iq2_tensor_is_an_unsupported_type(tmp_path):
    """The attack edited a tensor's type id to IQ2_XXS: its 64-value rows are not a multiple of 256."""
    path = tmp_path / "iq2.gguf"
    write_gguf(path)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)  # tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == gguf.GGMLQuantizationType.F32
    struct.pack_into("<I", data, type_at, gguf.GGMLQuantizationType.IQ2_XXS)
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_up\.weight' has type IQ2_XXS, which refkv cannot "
                                        r"dequantize") as info:
        read_gguf(path)
    assert "row size" not in str(info.value)


# -- 17: load's own parameters ----------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": None}, r"name must be a model name \('tiny', 'smollm2'\) or a path"),
    ({"name": 3}, r"name must be a model name"),
    ({"seed": 1.5}, r"seed must be an integer >= 0, got 1\.5"),
    ({"seed": -1}, r"seed must be an integer >= 0, got -1"),
])
def test_attack_13_17_load_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load(**kwargs)
