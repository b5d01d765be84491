"""The GGUF loader on small synthetic files written with ``gguf.GGUFWriter``.

The files are written here the way llama.cpp's converter writes them: projections as
(out, in), and the rows of attn_q / attn_k reordered for interleaved RoPE by
:func:`llama_cpp_permute`, an index-by-index transcription of the converter's rule
(independent of the loader's reshape-based :func:`unpermute_rope_rows`).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv.model import Model, ModelConfig, random_weights
from refkv.model.gguf import SUPPORTED_TYPES, GGUFError, ModelNotFoundError, read_gguf, unpermute_rope_rows
from refkv.model.layers import apply_rope, rope_angles

gguf = pytest.importorskip("gguf")

SMALL = ModelConfig(vocab_size=262, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=96,
                    rope_base=50000.0, norm_eps=1e-5, tie_embeddings=True, max_positions=512, name="small")


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face rows -> GGUF rows: GGUF row ``h d + 2 i + j`` is HF row ``h d + j d/2 + i``."""
    d = w.shape[0] // n_heads
    order = [h * d + j * (d // 2) + i for h in range(n_heads) for i in range(d // 2) for j in range(2)]
    return w[order]


def rope_interleaved(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's RoPE on (T, heads, d): rotate pairs ``(x[2i], x[2i+1])`` by ``p * base**(-2i/d)``."""
    d = x.shape[-1]
    theta = positions[:, None, None] * base ** (-np.arange(0, d, 2) / d)  # (T, 1, d/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(theta) - odd * np.sin(theta)
    out[..., 1::2] = even * np.sin(theta) + odd * np.cos(theta)
    return out


def small_vocab():
    """256 byte tokens, three control tokens and three merges ("Ġt", "he", "Ġthe")."""
    from refkv.model.tokenizer import byte_alphabet

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [byte_alphabet()[b] for b in range(256)] + ["Ġt", "he", "Ġthe"]
    types = [3] * 3 + [1] * 259
    return tokens, types, ["Ġ t", "h e", "Ġt he"]


def write_gguf(path, cfg=SMALL, weights=None, *, qtype="F32", arch="llama", skip=(), shapes=None,
               extra=None, vocab=True, raw_types=None, rope_freqs=None, pre="smollm"):
    """Write ``weights`` (refkv layout) as a llama.cpp-style GGUF file and return the weights.

    As llama.cpp's converter does: q/k rows (and q/k biases) permuted for interleaved RoPE
    for ``arch="llama"`` only (its ``LlamaModel``; ``Qwen2Model`` and ``Qwen3Model`` write
    them unchanged); biases as ``attn_{q,k,v,output}.bias``, Qwen3's norms as
    ``attn_{q,k}_norm.weight``; ``rope_freqs`` (Llama 3 scaling) as ``rope_freqs.weight``.
    ``skip`` leaves tensors out, ``shapes`` replaces a tensor by zeros of another
    (out, in) shape, ``raw_types`` stores a tensor as zero bytes of another GGML type,
    ``extra`` adds or overrides metadata (key -> (kind, value)).
    """
    weights = random_weights(cfg, seed=7, dtype=np.float32) if weights is None else weights
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {
        f"{arch}.block_count": ("uint32", cfg.n_layers), f"{arch}.context_length": ("uint32", cfg.max_positions),
        f"{arch}.embedding_length": ("uint32", cfg.d_model), f"{arch}.feed_forward_length": ("uint32", cfg.d_ff),
        f"{arch}.attention.head_count": ("uint32", cfg.n_heads),
        f"{arch}.attention.head_count_kv": ("uint32", cfg.n_kv_heads),
        f"{arch}.rope.freq_base": ("float32", cfg.rope_base),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", cfg.norm_eps),
        f"{arch}.vocab_size": ("uint32", cfg.vocab_size), f"{arch}.rope.dimension_count": ("uint32", cfg.d_head),
    }
    if cfg.n_heads * cfg.d_head != cfg.d_model:  # as the converter writes Hugging Face's head_dim
        meta.update({f"{arch}.attention.key_length": ("uint32", cfg.d_head),
                     f"{arch}.attention.value_length": ("uint32", cfg.d_head)})
    meta.update(extra or {})
    for key, (kind, value) in meta.items():
        getattr(writer, f"add_{kind}")(key, value)
    if vocab:
        tokens, types, merges = small_vocab()
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_string("tokenizer.ggml.pre", pre)
        writer.add_array("tokenizer.ggml.tokens", tokens)
        writer.add_array("tokenizer.ggml.token_type", types)
        writer.add_array("tokenizer.ggml.merges", merges)
        writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
        writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
        writer.add_bool("tokenizer.ggml.add_bos_token", False)

    def rope_rows(w, heads):  # (out, ...) rows in llama.cpp's order for its architecture
        return llama_cpp_permute(w, heads) if arch == "llama" else w

    tensors = {"token_embd.weight": weights.embed, "output_norm.weight": weights.final_norm}
    for i, lw in enumerate(weights.layers):
        b = f"blk.{i}."
        tensors.update({
            b + "attn_norm.weight": lw.attn_norm, b + "ffn_norm.weight": lw.mlp_norm,
            b + "attn_q.weight": rope_rows(lw.wq.T, cfg.n_heads),
            b + "attn_k.weight": rope_rows(lw.wk.T, cfg.n_kv_heads),
            b + "attn_v.weight": lw.wv.T, b + "attn_output.weight": lw.wo.T,
            b + "ffn_gate.weight": lw.w_gate.T, b + "ffn_up.weight": lw.w_up.T, b + "ffn_down.weight": lw.w_down.T})
        if lw.bq is not None:
            tensors.update({b + "attn_q.bias": rope_rows(lw.bq, cfg.n_heads),
                            b + "attn_k.bias": rope_rows(lw.bk, cfg.n_kv_heads), b + "attn_v.bias": lw.bv})
        if lw.bo is not None:
            tensors[b + "attn_output.bias"] = lw.bo
        if lw.q_norm is not None:
            tensors.update({b + "attn_q_norm.weight": lw.q_norm, b + "attn_k_norm.weight": lw.k_norm})
    if weights.lm_head is not None:
        tensors["output.weight"] = weights.lm_head.T
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = np.asarray(rope_freqs, dtype=np.float32)
    for name, array in tensors.items():
        if name in skip:
            continue
        array = np.ascontiguousarray(array, dtype=np.float32)
        if shapes and name in shapes:
            array = np.zeros(shapes[name], dtype=np.float32)
        if raw_types and name in raw_types:
            kind = gguf.GGMLQuantizationType[raw_types[name]]
            block, nbytes = gguf.GGML_QUANT_SIZES[kind]
            raw = np.zeros((*array.shape[:-1], array.shape[-1] // block * nbytes), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=kind)
        elif qtype == "F32" or array.ndim == 1:  # llama.cpp keeps norm gains in F32
            writer.add_tensor(name, array)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def assert_same_weights(a, b, atol=0.0):
    np.testing.assert_allclose(a.embed, b.embed, rtol=0, atol=atol)
    np.testing.assert_allclose(a.final_norm, b.final_norm, rtol=0, atol=atol)
    for la, lb in zip(a.layers, b.layers):
        for name in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"):
            np.testing.assert_allclose(getattr(la, name), getattr(lb, name), rtol=0, atol=atol, err_msg=name)


# -- the RoPE row order ---------------------------------------------------------------------
def test_unpermute_on_a_hand_made_tensor():
    # One head of width 4: HF rows (a0, a1 | b0, b1) pair a_i with b_i; GGUF interleaves
    # them as (a0, b0, a1, b1). Un-permuting must give back (a0, a1, b0, b1).
    hf = np.array([[10.0], [11.0], [20.0], [21.0]])
    gguf_rows = np.array([[10.0], [20.0], [11.0], [21.0]])
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows, 1), hf)
    np.testing.assert_array_equal(llama_cpp_permute(hf, 1), gguf_rows)


@given(heads=st.integers(1, 4), half=st.integers(1, 8), cols=st.integers(1, 5))
def test_unpermute_inverts_the_converter_permutation(heads, half, cols):
    w = np.arange(heads * 2 * half * cols, dtype=np.float64).reshape(heads * 2 * half, cols)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)


@given(heads=st.integers(1, 3), half=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_interleaved_rope_on_gguf_rows_equals_rotate_half_on_unpermuted_rows(heads, half, seed):
    """The reason for the un-permutation: both layouts rotate the same pairs by the same angles."""
    rng = np.random.default_rng(seed)
    d, d_in, t = 2 * half, 5, 6
    w_gguf = rng.standard_normal((heads * d, d_in))
    x = rng.standard_normal((t, d_in))
    positions = rng.integers(0, 5000, t)
    by_llama = rope_interleaved((x @ w_gguf.T).reshape(t, heads, d), positions, 10000.0)
    w_hf = unpermute_rope_rows(w_gguf, heads)
    cos, sin = rope_angles(positions, d, 10000.0, np.float64)
    by_refkv = apply_rope((x @ w_hf.T).reshape(t, heads, d).transpose(1, 0, 2), cos, sin).transpose(1, 0, 2)
    order = llama_cpp_permute(np.arange(d)[:, None], 1)[:, 0]  # refkv dim of each GGUF dim
    np.testing.assert_allclose(by_llama, by_refkv[..., order], rtol=1e-12, atol=1e-12)


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError, match="n_heads=3"):
        unpermute_rope_rows(np.zeros((8, 2)), 3)
    with pytest.raises(ValueError, match="even width"):
        unpermute_rope_rows(np.zeros((6, 2)), 2)


# -- reading ------------------------------------------------------------------------------
def test_float32_file_reads_back_exactly_with_its_config(tmp_path):
    path = tmp_path / "small.gguf"
    written = write_gguf(path)
    got = read_gguf(path)
    assert got.config == SMALL.replace(name="small")
    assert got.config.norm_eps == 1e-5  # stored as float32, read back as the decimal
    assert got.weights.dtype == np.float32
    assert_same_weights(got.weights, written)
    assert got.metadata["general.architecture"] == "llama"


def test_float64_load_widens_the_float32_values(tmp_path):
    path = tmp_path / "small.gguf"
    written = write_gguf(path)
    got = read_gguf(path, np.float64)
    assert got.weights.dtype == np.float64
    assert_same_weights(got.weights, written.astype(np.float64))


def test_untied_head_is_read_and_transposed(tmp_path):
    cfg = SMALL.replace(tie_embeddings=False)
    path = tmp_path / "untied.gguf"
    written = write_gguf(path, cfg, random_weights(cfg, seed=3, dtype=np.float32))
    got = read_gguf(path)
    assert not got.config.tie_embeddings
    np.testing.assert_array_equal(got.weights.lm_head, written.lm_head)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_quantized_files_read_back_within_quantization_error(tmp_path, qtype):
    path = tmp_path / f"{qtype}.gguf"
    written = write_gguf(path, qtype=qtype)
    got = read_gguf(path).weights
    # Per 32-value block the error is at most one quantization step, max|w| / (levels - 1);
    # with 4 bits that is 1/15 of the tensor's largest |w|. A wrong row order or a missing
    # transpose would give errors of the size of the weights themselves.
    levels = {"Q8_0": 255, "Q4_0": 15, "Q4_1": 15, "Q5_0": 31, "Q5_1": 31, "F16": 2**11, "BF16": 2**8}[qtype]
    for a, b in zip(got.layers, written.layers):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            ref = getattr(b, name)
            err = np.abs(getattr(a, name) - ref).max()
            assert err <= 2 * np.abs(ref).max() / levels, (name, err)


def test_loaded_gguf_model_gives_the_same_logits_as_the_written_weights(tmp_path):
    path = tmp_path / "small.gguf"
    written = write_gguf(path)
    from refkv.model import load

    model = load(path)
    tokens = np.arange(0, 200, 7)
    np.testing.assert_array_equal(model.forward_full(tokens), Model(SMALL, written).forward_full(tokens))


def test_weights_false_skips_dequantization(tmp_path):
    path = tmp_path / "small.gguf"
    write_gguf(path)
    got = read_gguf(path, weights=False)
    assert got.weights is None and got.config.n_layers == 2 and len(got.vocab.tokens) == 262


def test_vocab_fields(tmp_path):
    path = tmp_path / "small.gguf"
    write_gguf(path)
    vocab = read_gguf(path, weights=False).vocab
    tokens, types, _ = small_vocab()
    assert vocab.tokens == tuple(tokens) and vocab.token_types.tolist() == types
    assert vocab.merges == (("Ġ", "t"), ("h", "e"), ("Ġt", "he"))
    assert (vocab.model, vocab.pre, vocab.eos_id, vocab.bos_id, vocab.add_bos) == ("gpt2", "smollm", 2, 1, False)


# -- errors --------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found") as info:
        read_gguf(tmp_path / "absent.gguf")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)


def test_other_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, arch="gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        read_gguf(path)


@pytest.mark.parametrize("kind", ["Q8_1", "I32"])
def test_unsupported_tensor_type(tmp_path, kind):
    assert kind not in SUPPORTED_TYPES
    path = tmp_path / "odd.gguf"
    write_gguf(path, raw_types={"blk.1.ffn_up.weight": kind})
    with pytest.raises(GGUFError, match=f"'blk.1.ffn_up.weight' has type {kind}"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [0.999, 0.9, 0.5, 0.01])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "cut.gguf"
    write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        read_gguf(path)


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    path = tmp_path / "bad_shape.gguf"
    write_gguf(path, shapes={"blk.0.ffn_gate.weight": (80, 64)})
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_gate.weight' has shape \(80, 64\), but the metadata implies "
                                        r"\(96, 64\)"):
        read_gguf(path)


def test_metadata_disagrees_with_tensors(tmp_path):
    path = tmp_path / "bad_meta.gguf"
    write_gguf(path, extra={"llama.attention.head_count_kv": ("uint32", 4)})
    with pytest.raises(GGUFError, match=r"head_count_kv = 4 and head width 16 imply 64 rows of blk\.0\.attn_k\.weight; "
                                        r"the file has 32"):
        read_gguf(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "missing.gguf"
    write_gguf(path, skip=("blk.1.attn_v.weight",))
    with pytest.raises(GGUFError, match=r"'blk\.1\.attn_v\.weight' is missing"):
        read_gguf(path)


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "no_ff.gguf"
    write_gguf(path, extra={"llama.feed_forward_length": ("string", "x")})
    with pytest.raises(GGUFError):
        read_gguf(path)


def test_rope_scaling_other_than_linear_is_refused_by_key(tmp_path):
    path = tmp_path / "scaled.gguf"
    write_gguf(path, extra={"llama.rope.scaling.type": ("string", "yarn")})
    with pytest.raises(GGUFError, match=r"RoPE scaling 'yarn' \(llama\.rope\.scaling\.type\)"):
        read_gguf(path)


def test_linear_rope_scaling_is_read(tmp_path):
    path = tmp_path / "linear.gguf"
    write_gguf(path, extra={"llama.rope.scaling.type": ("string", "linear"),
                            "llama.rope.scaling.factor": ("float32", 4.0)})
    cfg = read_gguf(path, weights=False).config
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 4.0)


def test_mixture_of_experts_is_refused_by_key(tmp_path):
    path = tmp_path / "moe.gguf"
    write_gguf(path, extra={"llama.expert_count": ("uint32", 8)})
    with pytest.raises(GGUFError, match=r"mixture-of-experts.*llama\.expert_count = 8"):
        read_gguf(path)


def test_partial_rope_is_refused(tmp_path):
    path = tmp_path / "partial.gguf"
    write_gguf(path, extra={"llama.rope.dimension_count": ("uint32", 8)})
    with pytest.raises(GGUFError, match="partial RoPE"):
        read_gguf(path)


def test_invalid_config_in_metadata(tmp_path):
    path = tmp_path / "heads.gguf"
    write_gguf(path, extra={"llama.rope.freq_base": ("float32", 1.0)})
    with pytest.raises(GGUFError, match=r"llama\.rope\.freq_base must be a finite number in \(1, inf\), got 1\.0"):
        read_gguf(path)


def test_non_finite_weights_are_refused(tmp_path):
    weights = random_weights(SMALL, seed=7, dtype=np.float32)
    weights.layers[0].wv[3, 5] = np.nan
    path = tmp_path / "nan.gguf"
    write_gguf(path, weights=weights)
    with pytest.raises(GGUFError, match="NaN or inf"):
        read_gguf(path)


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="float32 or float64"):
        read_gguf(tmp_path / "x.gguf", np.int32)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizers_refkv_does_not_rebuild_are_refused(tmp_path, pre):
    """Llama 3 and Qwen2 split text by their own regexes: no silent GPT-2 splitting in their place."""
    pytest.importorskip("tokenizers")
    from refkv.model import Tokenizer, load_with_tokenizer

    path = tmp_path / "other.gguf"
    write_gguf(path, pre=pre)
    with pytest.raises(ValueError, match=f"tokenizer.ggml.pre '{pre}' is not implemented.*checkpoint directory"):
        Tokenizer.from_gguf(path)
    with pytest.raises(ValueError, match=f"'{pre}'"):
        load_with_tokenizer(path)
    assert read_gguf(path, weights=False).vocab.pre == pre  # the model itself still loads


def test_block_count_from_the_header_alone(tmp_path):
    """read_block_count finds the depth without reading tensors; anything else gives None."""
    from refkv.model.gguf import read_block_count

    path = tmp_path / "m.gguf"
    write_gguf(path)
    assert read_block_count(path) == SMALL.n_layers == read_gguf(path, weights=False).config.n_layers
    (tmp_path / "not.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 9)  # truncated header
    (tmp_path / "text.gguf").write_text("hello")
    assert read_block_count(tmp_path / "not.gguf") is None
    assert read_block_count(tmp_path / "text.gguf") is None
    assert read_block_count(tmp_path / "missing.gguf") is None


def test_cli_checks_layer_indices_against_the_header_before_loading(tmp_path, capsys, monkeypatch):
    import refkv.model.loading as loading
    from refkv.cli import main

    path = tmp_path / "m.gguf"
    write_gguf(path)
    monkeypatch.setattr(loading, "load_with_tokenizer", lambda *a, **k: pytest.fail("model loaded"))
    code = main(["generate", "hello", "--model", str(path), "--policy", "knorm", "--param",
                 f"skip_layers=[{SMALL.n_layers}]", "--budget", "8"])
    err = capsys.readouterr().err
    assert code == 2 and f"for a model of {SMALL.n_layers} layers" in err and "loading" not in err
