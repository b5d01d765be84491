"""Hugging Face checkpoint directories (config.json + safetensors), written here by hand."""

import json
import struct

import numpy as np
import pytest

from refkv.model import ModelConfig, load, load_with_tokenizer, random_weights
from refkv.model.gguf import ModelNotFoundError
from refkv.model.safetensors_dir import CheckpointError, read_safetensors

SMALL = ModelConfig(vocab_size=262, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=96,
                    rope_base=50000.0, norm_eps=1e-5, tie_embeddings=True, max_positions=512, name="small")


def assert_same_weights(a, b, atol=0.0):
    pairs = [(a.embed, b.embed), (a.final_norm, b.final_norm)]
    for la, lb in zip(a.layers, b.layers):
        assert set(la.arrays()) == set(lb.arrays())
        pairs += [(la.arrays()[f], lb.arrays()[f]) for f in la.arrays()]
    for x, y in pairs:
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def write_safetensors(path, tensors: dict, dtype="F32"):
    """The format from its specification: u64 header length, JSON header, raw bytes."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        if dtype == "BF16":  # keep the top 16 bits of each float32 (round toward zero)
            raw = (np.ascontiguousarray(array, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()
        else:
            raw = np.ascontiguousarray(array, dtype={"F32": "<f4", "F16": "<f2"}[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def hf_tensors(weights) -> dict:
    out = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": lw.attn_norm, p + "post_attention_layernorm.weight": lw.mlp_norm,
                    p + "self_attn.q_proj.weight": lw.wq.T, p + "self_attn.k_proj.weight": lw.wk.T,
                    p + "self_attn.v_proj.weight": lw.wv.T, p + "self_attn.o_proj.weight": lw.wo.T,
                    p + "mlp.gate_proj.weight": lw.w_gate.T, p + "mlp.up_proj.weight": lw.w_up.T,
                    p + "mlp.down_proj.weight": lw.w_down.T})
    return out


def write_checkpoint(folder, weights, dtype="F32", **config_changes):
    folder.mkdir(exist_ok=True)
    config = {"model_type": "llama", "vocab_size": SMALL.vocab_size, "hidden_size": SMALL.d_model,
              "intermediate_size": SMALL.d_ff, "num_hidden_layers": SMALL.n_layers,
              "num_attention_heads": SMALL.n_heads, "num_key_value_heads": SMALL.n_kv_heads,
              "rope_theta": SMALL.rope_base, "rms_norm_eps": SMALL.norm_eps, "tie_word_embeddings": True,
              "max_position_embeddings": SMALL.max_positions, "hidden_act": "silu"}
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = hf_tensors(weights)
    names = sorted(tensors)
    half = len(names) // 2  # two shards, as large checkpoints have
    write_safetensors(folder / "model-00001-of-00002.safetensors", {n: tensors[n] for n in names[:half]}, dtype)
    write_safetensors(folder / "model-00002-of-00002.safetensors", {n: tensors[n] for n in names[half:]}, dtype)


@pytest.fixture
def weights():
    return random_weights(SMALL, seed=5, dtype=np.float32)


def test_float32_checkpoint_reads_back_exactly(tmp_path, weights):
    write_checkpoint(tmp_path / "ckpt", weights)
    model = load(tmp_path / "ckpt")
    assert model.config == SMALL.replace(name="ckpt")
    assert_same_weights(model.weights, weights)


def test_bfloat16_is_widened_exactly(tmp_path, weights):
    write_checkpoint(tmp_path / "ckpt", weights, dtype="BF16")
    model = load(tmp_path / "ckpt", dtype=np.float64)
    truncated = weights.layers[0].wq.view(np.uint32) & np.uint32(0xFFFF0000)
    np.testing.assert_array_equal(model.weights.layers[0].wq, truncated.view(np.float32).astype(np.float64))


def test_rope_base_from_transformers_5_config(tmp_path, weights):
    write_checkpoint(tmp_path / "ckpt", weights, rope_theta=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    assert load(tmp_path / "ckpt").config.rope_base == 12345.0


def test_float16(tmp_path, weights):
    write_checkpoint(tmp_path / "ckpt", weights, dtype="F16")
    model = load(tmp_path / "ckpt")
    assert_same_weights(model.weights, weights, atol=2e-3)


def test_the_safetensors_package_reads_what_we_write_and_vice_versa(tmp_path, weights):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {k: np.ascontiguousarray(v) for k, v in hf_tensors(weights).items()}
    st.save_file(tensors, str(tmp_path / "a.safetensors"))
    got = read_safetensors(tmp_path / "a.safetensors")
    assert set(got) == set(tensors) and all(np.array_equal(got[k], tensors[k]) for k in tensors)
    write_safetensors(tmp_path / "b.safetensors", tensors)
    theirs = st.load_file(str(tmp_path / "b.safetensors"))
    assert all(np.array_equal(theirs[k], tensors[k]) for k in tensors)


def test_tokenizer_json_is_read(tmp_path, weights):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from test_gguf import write_gguf

    from refkv.model import Tokenizer

    write_gguf(tmp_path / "small.gguf")
    reference = Tokenizer.from_gguf(tmp_path / "small.gguf")
    write_checkpoint(tmp_path / "ckpt", weights)
    reference.backend.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    _, tok = load_with_tokenizer(tmp_path / "ckpt")
    assert tok.vocab.tokens == reference.vocab.tokens and tok.vocab.pre == "smollm"
    assert tok.eos_id == 2 and tok.special_ids == reference.special_ids
    assert tok.encode("the 42 others") == reference.encode("the 42 others")


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "gpt2", "architectures": []}, "model_type 'gpt2'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"RoPE type 'dynamic' \(rope_scaling.rope_type\)"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, r"RoPE type 'yarn' \(rope_scaling.rope_type\)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, r"rope_parameters\.factor is missing"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "RoPE type 'longrope'"),
    ({"model_type": "qwen2", "use_sliding_window": True}, r"sliding-window attention \(use_sliding_window"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"model_type": "mistral", "sliding_window": 256},
     r"sliding-window attention \(sliding_window = 256 < max_position_embeddings = 512\) is not supported"),
    ({"model_type": "mistral", "sliding_window": "wide"}, "sliding_window must be an integer"),
    ({"model_type": "qwen2_moe"}, "mixture-of-experts.*'model_type'"),
    ({"model_type": "llama", "num_local_experts": 8}, "mixture-of-experts.*'num_local_experts'"),
    ({"mlp_bias": True}, r"MLP biases \(mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "SiLU"),
    ({"intermediate_size": 80}, r"has shape \(96, 64\), config implies \(80, 64\)"),
])
def test_bad_configs(tmp_path, weights, change, message):
    write_checkpoint(tmp_path / "ckpt", weights, **change)
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path / "ckpt")


@pytest.mark.parametrize("window", [None, SMALL.max_positions, 4 * SMALL.max_positions])
def test_mistral_is_llama_when_its_window_covers_the_context(tmp_path, weights, window):
    """A Mistral checkpoint whose sliding window spans the whole context is full attention: the
    Llama model, whatever ``attention_bias`` says (MistralAttention has no biases)."""
    write_checkpoint(tmp_path / "mistral", weights, model_type="mistral", architectures=["MistralForCausalLM"],
                     sliding_window=window, attention_bias=True)
    write_checkpoint(tmp_path / "llama", weights)
    mistral, llama = load(tmp_path / "mistral"), load(tmp_path / "llama")
    assert mistral.config == llama.config.replace(name="mistral")
    assert_same_weights(mistral.weights, llama.weights)


def test_a_config_without_model_type_is_known_by_its_architecture(tmp_path, weights):
    write_checkpoint(tmp_path / "ckpt", weights, model_type=None, architectures=["MistralForCausalLM"],
                     sliding_window=64)
    with pytest.raises(CheckpointError, match="sliding_window = 64 < max_position_embeddings = 512"):
        load(tmp_path / "ckpt")


def test_missing_pieces(tmp_path, weights):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        load(tmp_path / "empty")
    write_checkpoint(tmp_path / "ckpt", weights)
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        load(tmp_path / "ckpt")


def test_truncated_and_corrupt_files(tmp_path, weights):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.ones((4, 4), np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_safetensors(path)
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="too short"):
        read_safetensors(path)
    header = json.dumps({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match="dtype I64"):
        read_safetensors(path)


def test_tokenizer_json_splits_by_its_own_rules(tmp_path, weights):
    """A Llama 3-style pre-tokenizer (numbers in runs of up to 3 digits) is used as the file says."""
    pytest.importorskip("gguf")
    tokenizers = pytest.importorskip("tokenizers")
    from test_gguf import write_gguf

    from refkv.model import Tokenizer

    write_gguf(tmp_path / "small.gguf")
    backend = Tokenizer.from_gguf(tmp_path / "small.gguf").backend
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"\p{N}{1,3}"), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    write_checkpoint(tmp_path / "ckpt", weights)
    backend.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    _, tok = load_with_tokenizer(tmp_path / "ckpt")
    text = "the 12345 others"
    theirs = tokenizers.Tokenizer.from_file(str(tmp_path / "ckpt" / "tokenizer.json")).encode(text).ids
    assert tok.encode(text) == theirs
    assert tok.decode(theirs) == text
    # the splitting rule itself is the file's (GPT-2's would be a ByteLevel with its own regex)
    file_spec = json.loads((tmp_path / "ckpt" / "tokenizer.json").read_text())
    assert json.loads(tok.backend.to_str())["pre_tokenizer"] == file_spec["pre_tokenizer"]
