"""Read a Hugging Face Llama checkpoint directory: ``config.json`` + ``*.safetensors``.

For users who have an unquantized checkpoint (e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``
downloaded by other means); refkv never downloads anything.

Notes
-----
**Format.** A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, byte offsets) and raw little-endian tensor bytes. refkv parses
it directly (no pickle, no ``safetensors`` package needed), which also lets it read
BF16, the dtype most checkpoints use and NumPy lacks: a bfloat16 is the top half of
a float32, so ``uint16 << 16`` viewed as float32 is exact.

**Layout.** Hugging Face stores ``nn.Linear`` weights as (out, in) with q/k rows
already in the "rotate half" RoPE order refkv uses, so projections are only
transposed (no un-permutation, unlike GGUF).

**Accepted configs.** ``model_type`` ``"llama"`` (or a ``LlamaForCausalLM``
architecture), ``hidden_act`` ``"silu"``, no attention/MLP biases, plain RoPE: the base
comes from ``rope_parameters.rope_theta`` (transformers 5) or ``rope_theta`` (version
4, default 10000); any ``rope_type`` other than ``"default"`` is refused.

**Tokenizer.** If ``tokenizer.json`` is present and describes a byte-level BPE, it is
turned into the same :class:`~refkv.model.tokenizer.Tokenizer` the GGUF path builds
(special tokens from ``added_tokens``; the ``smollm`` pre-tokenizer when the
pre-tokenizer splits digits; EOS and chat template from ``tokenizer_config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .gguf import GGUFVocab, ModelNotFoundError
from .weights import LayerWeights, ModelWeights

__all__ = ["read_checkpoint", "read_safetensors", "vocab_from_tokenizer_json"]

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint directory refkv cannot use."""


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as float arrays (BF16 widened to float32).

    Raises
    ------
    CheckpointError
        A malformed header, an unsupported dtype or a file shorter than its header says.
    """
    path = Path(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    if raw.size < 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file")
    n = int(raw[:8].view("<u8")[0])
    if n > _MAX_HEADER or 8 + n > raw.size:
        raise CheckpointError(f"{path}: header length {n} is impossible for a {raw.size}-byte file")
    try:
        header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: the header is not JSON: {err}") from err
    data = raw[8 + n:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind, shape, (start, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if kind not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {kind}; supported: {', '.join(_DTYPES)}")
        dtype = _DTYPES[kind]
        if not 0 <= start <= stop <= data.size or stop - start != int(np.prod(shape)) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} bytes [{start}, {stop}) do not fit its shape "
                                  f"{shape} or the file (truncated?)")
        array = data[start:stop].view(dtype).reshape(shape)
        if kind == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = np.asarray(array)
    return tensors


def _config(path: Path) -> ModelConfig:
    file = path / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json; not a Hugging Face checkpoint directory")
    cfg = json.loads(file.read_text(encoding="utf-8"))
    arch = cfg.get("model_type")
    if arch != "llama" and "LlamaForCausalLM" not in cfg.get("architectures", []):
        raise CheckpointError(f"{file}: model_type {arch!r} is not supported; refkv reads Llama checkpoints")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise CheckpointError(f"{file}: only SiLU MLPs without biases are supported")
    # transformers 5 writes "rope_parameters" {"rope_type", "rope_theta"}; version 4 wrote
    # "rope_theta" and an optional "rope_scaling" {"type" or "rope_type", ...}.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{file}: RoPE scaling {rope!r} is not supported (plain RoPE only)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = int(cfg["num_attention_heads"])
    try:
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]), d_model=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            d_head=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            d_ff=int(cfg["intermediate_size"]), rope_base=float(theta),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(cfg.get("max_position_embeddings", 2048)), name=path.name)
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"{file}: not a usable Llama config: {err!r}") from err


def read_checkpoint(path, dtype=np.float32, *, tokenizer: bool = True):
    """Config, weights and (optionally) tokenizer of a checkpoint directory.

    Returns
    -------
    config : ModelConfig
    weights : ModelWeights
    tokenizer : Tokenizer or None
        ``None`` if not asked for or the directory has no ``tokenizer.json``.
    """
    path = Path(path)
    config = _config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files")
    tensors = {}
    for file in files:
        tensors.update(read_safetensors(file))

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        if tensors[name].shape != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tensors[name].shape}, config implies {shape}")
        return tensors[name]

    def dense(name: str, out: int, n_in: int) -> np.ndarray:
        return np.ascontiguousarray(get(name, (out, n_in)).T, dtype=dtype)  # (out, in) -> refkv's (in, out)

    def vector(name: str, n: int) -> np.ndarray:
        return np.ascontiguousarray(get(name, (n,)), dtype=dtype)

    c = config
    q, kv = c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    layers = []
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            attn_norm=vector(p + "input_layernorm.weight", c.d_model),
            wq=dense(p + "self_attn.q_proj.weight", q, c.d_model),
            wk=dense(p + "self_attn.k_proj.weight", kv, c.d_model),
            wv=dense(p + "self_attn.v_proj.weight", kv, c.d_model),
            wo=dense(p + "self_attn.o_proj.weight", c.d_model, q),
            mlp_norm=vector(p + "post_attention_layernorm.weight", c.d_model),
            w_gate=dense(p + "mlp.gate_proj.weight", c.d_ff, c.d_model),
            w_up=dense(p + "mlp.up_proj.weight", c.d_ff, c.d_model),
            w_down=dense(p + "mlp.down_proj.weight", c.d_model, c.d_ff)))
    embed = np.ascontiguousarray(get("model.embed_tokens.weight", (c.vocab_size, c.d_model)), dtype=dtype)
    lm_head = None if c.tie_embeddings else dense("lm_head.weight", c.vocab_size, c.d_model)
    weights = ModelWeights(embed, tuple(layers), vector("model.norm.weight", c.d_model), lm_head)
    weights.validate(config)
    tok = None
    if tokenizer and (path / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer

        tok = Tokenizer(vocab_from_tokenizer_json(path))
    return config, weights, tok


def vocab_from_tokenizer_json(path) -> GGUFVocab:
    """A :class:`~refkv.model.gguf.GGUFVocab` from a directory's ``tokenizer.json``.

    Raises
    ------
    CheckpointError
        If the tokenizer is not a byte-level BPE.
    """
    path = Path(path)
    spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise CheckpointError(f"{path / 'tokenizer.json'}: only byte-level BPE tokenizers are supported")
    vocab = dict(model["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    size = max(vocab.values()) + 1
    tokens = [""] * size
    for token, i in vocab.items():
        tokens[i] = token
    types = np.ones(size, dtype=np.int32)
    for added in spec.get("added_tokens", []):
        types[added["id"]] = 3 if added.get("special") else 4
    merges = tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", []))
    settings = {}
    if (path / "tokenizer_config.json").is_file():
        settings = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))

    def token_id(key):
        value = settings.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return vocab.get(value) if isinstance(value, str) else None

    pre = "smollm" if '"Digits"' in json.dumps(spec.get("pre_tokenizer")) else "gpt2"
    return GGUFVocab(model="gpt2", pre=pre, tokens=tuple(tokens), token_types=types, merges=merges,
                     bos_id=token_id("bos_token"), eos_id=token_id("eos_token"), unk_id=token_id("unk_token"),
                     pad_id=token_id("pad_token"), add_bos=bool(settings.get("add_bos_token", False)),
                     chat_template=settings.get("chat_template"))
