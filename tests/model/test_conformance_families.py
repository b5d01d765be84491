"""Each architecture family against transformers' own implementation, through a saved checkpoint.

Per family (:data:`refkv.model.families.FAMILIES`, plus Llama with ``attention_bias`` for
the output bias and Llama with ``linear`` RoPE scaling) a transformers model of the family's
own class (its entry's ``hf_architecture``) is built from a config with the family's
features switched on, every parameter is set to seeded random
values (biases and norm gains included: transformers initialises biases to 0 and gains to 1,
which would hide a bug that ignores them), saved with ``save_pretrained`` in float64 and
read back by refkv's loader. Nothing in transformers is patched.

What transformers' float64 path keeps: its weights and matrix products are float64, but
three steps run in float32 whatever the model dtype: the RoPE tables
(``LlamaRotaryEmbedding.forward`` forms ``inv_freq`` and the angles in float32 and takes
their cos/sin there), RMSNorm (``LlamaRMSNorm``/``Qwen3RMSNorm`` cast the hidden states to
float32 before the mean square and the scaling) and the eager attention softmax
(``softmax(..., dtype=torch.float32)``). So the two agree to float32 precision, not float64:
the measured largest difference at any position is at most 2.8e-7 of that position's largest
|logit| (printed with ``-s``); the bound checked is the issue's 1e-5, per position.

The tests show the features matter: the same weights with the family's feature switched
off (plain RoPE, biases dropped, q/k norms dropped) miss transformers' logits by far more
than the bound.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="conformance with transformers needs torch (pip install torch)")
transformers = pytest.importorskip("transformers",
                                   reason="conformance with transformers needs it (pip install transformers)")

from refkv.engine import Engine  # noqa: E402
from refkv.model import Model, load  # noqa: E402
from refkv.model.families import FAMILIES, tiny  # noqa: E402
from refkv.model.layers import rope_frequencies  # noqa: E402

torch.set_num_threads(1)

#: The families' tiny models, Llama with attention_bias (q/k/v and output biases, as
#: LlamaAttention has them) and Llama with linear RoPE scaling. A case's family is the name
#: before its first "-"; its seed is its place here, and families added later come last, so
#: the earlier cases keep their weights (and the numbers docs/guide/real-model.rst shows).
LLAMA = FAMILIES["llama"].tiny
FIRST = ("llama", "llama3", "qwen2", "qwen3")
CASES = {**{name: FAMILIES[name].tiny for name in FIRST},
         "llama-bias": LLAMA.replace(attention_bias=True, output_bias=True, name="tiny-llama-bias"),
         "llama-linear": LLAMA.replace(rope_type="linear", rope_factor=4.0, name="tiny-llama-linear"),
         **{name: family.tiny for name, family in FAMILIES.items() if name not in FIRST}}
PROMPT = 48  # longer than llama3's original context (32): every RoPE band is crossed
TOLERANCE = 1e-5


#: What each ``model_type``'s transformers config needs beyond the common fields: every
#: sliding window off, the bias switch where the family reads one.
HF_EXTRA = {"llama": lambda cfg: dict(attention_bias=cfg.attention_bias, mlp_bias=False),
            "qwen2": lambda cfg: dict(use_sliding_window=False),
            "qwen3": lambda cfg: dict(attention_bias=cfg.attention_bias, use_sliding_window=False),
            "mistral": lambda cfg: dict(sliding_window=None)}


def hf_config(cfg, family="llama"):
    """A transformers config (and model class) of ``family`` (a name in FAMILIES) with refkv config ``cfg``."""
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_base}
    if cfg.rope_type == "linear":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_context)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                  num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head, hidden_act="silu",
                  max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.norm_eps,
                  tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope)
    entry = FAMILIES[family]
    config = transformers.AutoConfig.for_model(entry.model_type, **common, **HF_EXTRA[entry.model_type](cfg))
    return config, getattr(transformers, entry.hf_architecture)


def family_of(case: str) -> str:
    return case.split("-")[0]


def randomise(hf, seed: int) -> None:
    """Every parameter seeded random: projections 1/sqrt(fan_in), gains 1 + 0.1 N, biases 0.5 N."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                values = 0.5 * rng.standard_normal(p.shape)
            elif p.ndim == 1:
                values = 1.0 + 0.1 * rng.standard_normal(p.shape)
            elif "embed_tokens" in name:
                values = rng.standard_normal(p.shape)
            else:
                values = rng.standard_normal(p.shape) / math.sqrt(p.shape[1])
            p.copy_(torch.from_numpy(values))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(case name, transformers model in float64, refkv model read from its saved checkpoint, config.json)."""
    name = request.param
    config, cls = hf_config(CASES[name], family_of(name))
    config._attn_implementation = "eager"
    hf = cls(config).to(torch.float64).eval()
    randomise(hf, seed=list(CASES).index(name))  # one seed per case
    folder = tmp_path_factory.mktemp(name) / "checkpoint"
    hf.save_pretrained(folder)
    return name, hf, load(folder, dtype=np.float64), json.loads((folder / "config.json").read_text())


def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(tokens)[None, :]), use_cache=False).logits[0].numpy()


def prompt(cfg) -> np.ndarray:
    return np.random.default_rng(99).integers(0, cfg.vocab_size, PROMPT)


def relative_error(ours, theirs) -> np.ndarray:
    """Per position: the largest |difference| over the vocabulary / the largest |logit| there."""
    return np.abs(ours - theirs).max(-1) / np.abs(theirs).max(-1)


def test_the_checkpoint_is_read_as_the_family_config(pair):
    name, _, model, saved = pair
    assert model.config == CASES[name].replace(name="checkpoint")
    assert saved["architectures"][0] == FAMILIES[family_of(name)].hf_architecture


def test_logits_at_every_position_match_transformers(pair):
    name, hf, model, _ = pair
    tokens = prompt(model.config)
    theirs = hf_logits(hf, tokens)
    error = relative_error(model.forward_full(tokens), theirs)
    print(f"\n{name} vs transformers {transformers.__version__} (float64): max relative difference "
          f"{error.max():.2e} over {len(tokens)} positions")
    assert error.max() < TOLERANCE, (name, error.max(), int(error.argmax()))


def without_features(model: Model) -> Model:
    """The same weights with the family's variants switched off (plain RoPE, no biases, no q/k norm)."""
    cfg = model.config.replace(rope_type="default", rope_factor=1.0, rope_low_freq_factor=None,
                               rope_high_freq_factor=None, rope_original_context=None, attention_bias=False,
                               output_bias=False, qk_norm=False)
    plain = {"bq": None, "bk": None, "bv": None, "bo": None, "q_norm": None, "k_norm": None}
    layers = tuple(dataclasses.replace(lw, **plain) for lw in model.weights.layers)
    return Model(cfg, dataclasses.replace(model.weights, layers=layers))


def test_each_feature_matters(pair):
    name, hf, model, _ = pair
    if not model.config.features:
        pytest.skip("the Llama 2 family has no variant to switch off")
    tokens = prompt(model.config)
    error = relative_error(without_features(model).forward_full(tokens), hf_logits(hf, tokens))
    assert error.max() > 100 * TOLERANCE, (name, model.config.features, error.max())


def test_mistral_window_as_wide_as_the_context_is_read_and_a_narrower_one_refused(tmp_path):
    """transformers' Mistral with ``sliding_window`` = the context (its sliding-window mask hides
    nothing) matches refkv; with a window narrower than the prompt its logits differ from full
    attention, which is why refkv refuses such a checkpoint, naming the parameter."""
    from refkv.model.safetensors_dir import CheckpointError

    cfg = FAMILIES["mistral"].tiny
    models = {}
    for window in (cfg.max_positions, 16):
        config, cls = hf_config(cfg, "mistral")
        config.sliding_window = window
        config._attn_implementation = "eager"
        models[window] = cls(config).to(torch.float64).eval()
        randomise(models[window], seed=11)
        models[window].save_pretrained(tmp_path / str(window))
    model = load(tmp_path / str(cfg.max_positions), dtype=np.float64)
    tokens = prompt(cfg)
    assert relative_error(model.forward_full(tokens), hf_logits(models[cfg.max_positions], tokens)).max() < TOLERANCE
    assert relative_error(model.forward_full(tokens), hf_logits(models[16], tokens)).max() > 100 * TOLERANCE
    with pytest.raises(CheckpointError, match=r"sliding-window attention \(sliding_window = 16 < "
                                              r"max_position_embeddings = 256\) is not supported"):
        load(tmp_path / "16")


def test_llama3_scaling_crosses_every_band():
    """The llama3 case is a real test of the scaling: kept, interpolated and divided frequencies all occur."""
    cfg = FAMILIES["llama3"].tiny
    wavelength = 2 * np.pi / rope_frequencies(cfg.d_head, cfg.rope_base)
    low_edge = cfg.rope_original_context / cfg.rope_low_freq_factor
    high_edge = cfg.rope_original_context / cfg.rope_high_freq_factor
    assert (wavelength < high_edge).any() and (wavelength > low_edge).any()
    assert ((wavelength >= high_edge) & (wavelength <= low_edge)).any()
    assert PROMPT > cfg.rope_original_context


def test_greedy_tokens_match_transformers_generate(pair):
    name, hf, model, _ = pair
    tokens = prompt(model.config)[:20]
    engine = Engine(model)
    ours = engine.generate(engine.prefill(tokens), 12)
    with torch.no_grad():
        out = hf.generate(torch.tensor(tokens[None, :]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(tokens):].tolist()
    assert ours == theirs, name


@pytest.mark.parametrize("block", [1, 7, None])
def test_block_prompt_processing_without_eviction_is_the_full_forward(pair, block):
    _, _, model, _ = pair
    tokens = prompt(model.config)
    full = model.forward_full(tokens)
    blocked = Engine(model).prefill(tokens, block, all_logits=True)
    assert blocked.shape == full.shape
    np.testing.assert_allclose(blocked, full, rtol=0, atol=1e-10 * np.abs(full).max())


# -- the tiny family models through refkv's own readers --------------------------------------
def llama_cpp_rope_freqs(cfg) -> list[float]:
    """llama.cpp's converter rule for ``rope_freqs.weight``, transcribed one frequency at a time."""
    base, dim = cfg.rope_base, cfg.d_head
    factor, low, high, old = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                              cfg.rope_original_context)
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_family_round_trips_through_gguf(tmp_path, family):
    pytest.importorskip("gguf")
    from test_gguf import write_gguf

    original = tiny(family, seed=3, dtype="float32")  # F32 in the file holds these values exactly
    cfg = original.config
    arch = FAMILIES[family].gguf_architecture
    freqs = llama_cpp_rope_freqs(cfg) if cfg.rope_type == "llama3" else None
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, cfg, original.weights, arch=arch, rope_freqs=freqs)
    loaded = load(path, dtype=np.float64)
    if freqs is None:
        assert loaded.config == cfg.replace(name=family)
    else:  # GGUF carries Llama 3 scaling as the per-frequency divisors, not the four parameters
        assert loaded.config.rope_type == "default" and loaded.config.rope_freq_factors is not None
    reference = Model(cfg, original.weights.astype(np.float64))
    for a, b in zip(loaded.weights.layers, reference.weights.layers):
        assert a.arrays().keys() == b.arrays().keys()
        for key in a.arrays():
            np.testing.assert_array_equal(a.arrays()[key], b.arrays()[key], err_msg=key)
    tokens = prompt(cfg)
    ours, theirs = loaded.forward_full(tokens), reference.forward_full(tokens)
    # float64 on both sides; only the float32 rope_freqs of llama3 round the angles
    bound = 1e-6 if freqs is not None else 1e-12
    assert relative_error(ours, theirs).max() < bound


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_tiny_family_round_trips_through_safetensors(tmp_path, family, dtype):
    from test_checkpoint_dir import write_safetensors

    original = tiny(family, seed=4, dtype="float32")
    cfg = original.config
    hf, _ = hf_config(cfg, family)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(hf.to_json_string())
    w = original.weights
    tensors = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if w.lm_head is not None:
        tensors["lm_head.weight"] = w.lm_head.T
    hf_names = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
                "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
                "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
                "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
                "bv": "self_attn.v_proj.bias", "bo": "self_attn.o_proj.bias", "q_norm": "self_attn.q_norm.weight",
                "k_norm": "self_attn.k_norm.weight"}
    for i, lw in enumerate(w.layers):
        for key, array in lw.arrays().items():
            tensors[f"model.layers.{i}.{hf_names[key]}"] = array.T  # (in, out) -> (out, in); 1-D unchanged
    names = sorted(tensors)
    for k, part in enumerate((names[::2], names[1::2])):  # two shards
        write_safetensors(folder / f"model-0000{k + 1}-of-00002.safetensors", {n: tensors[n] for n in part}, dtype)
    loaded = load(folder, dtype=np.float64)
    assert loaded.config == cfg.replace(name="ckpt")
    for a, b in zip(loaded.weights.layers, w.layers):
        assert a.arrays().keys() == b.arrays().keys()
        for key in a.arrays():
            expected = b.arrays()[key].astype(np.float64)
            if dtype == "BF16":  # the writer keeps the top 16 bits: within one bfloat16 step
                np.testing.assert_allclose(a.arrays()[key], expected, rtol=2 ** -7, atol=0, err_msg=key)
            else:
                np.testing.assert_array_equal(a.arrays()[key], expected, err_msg=key)


@pytest.mark.parametrize("torch_dtype", ["bfloat16", "float16"])
def test_half_precision_sharded_checkpoint_is_upcast_exactly(tmp_path, torch_dtype):
    """transformers' own bf16/fp16 writer, split into shards with an index: every value upcast exactly."""
    config, cls = hf_config(CASES["qwen2"], "qwen2")
    config._attn_implementation = "eager"
    hf = cls(config).to(torch.float64).eval()
    randomise(hf, seed=7)
    hf = hf.to(getattr(torch, torch_dtype))
    hf.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    model = load(tmp_path / "ckpt", dtype=np.float64)
    attn = hf.model.layers[1].self_attn
    np.testing.assert_array_equal(model.weights.layers[1].wk, attn.k_proj.weight.detach().double().numpy().T)
    np.testing.assert_array_equal(model.weights.layers[1].bk, attn.k_proj.bias.detach().double().numpy())
    # A fresh float64 model holding the half-precision values: casting `hf` itself back would
    # keep its RoPE frequency buffer rounded to half precision by .to(), a transformers artefact.
    wide = cls(config).to(torch.float64).eval()
    wide.load_state_dict({k: v.double() for k, v in hf.state_dict().items()})
    tokens = prompt(model.config)
    error = relative_error(model.forward_full(tokens), hf_logits(wide, tokens))
    assert error.max() < TOLERANCE
