"""Read a Hugging Face checkpoint directory: ``config.json`` + ``*.safetensors``.

For users who have an unquantized checkpoint (e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``,
``meta-llama/Llama-3.2-1B``, ``Qwen/Qwen2.5-0.5B``, ``Qwen/Qwen3-0.6B``,
``mistralai/Mistral-7B-Instruct-v0.3`` downloaded by other means); refkv never downloads anything.

Notes
-----
**Format.** A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, byte offsets) and raw little-endian tensor bytes. refkv parses
it directly (no pickle, no ``safetensors`` package needed), which also lets it read
BF16, the dtype most checkpoints use and NumPy lacks: a bfloat16 is the top half of
a float32, so ``uint16 << 16`` viewed as float32 is exact. F16 and BF16 are upcast
exactly to the requested float32/float64. A tensor stored in two shards is an error.

**Layout.** Hugging Face stores ``nn.Linear`` weights as (out, in) with q/k rows
already in the "rotate half" RoPE order refkv uses, so projections are only
transposed (no un-permutation, unlike GGUF).

**Accepted configs**: the families of :data:`refkv.model.families.FAMILIES`, found by
``model_type`` (or, without one, by ``architectures``): ``LlamaForCausalLM`` (``"llama"``),
``Qwen2ForCausalLM`` (``"qwen2"``), ``Qwen3ForCausalLM`` (``"qwen3"``) and
``MistralForCausalLM`` (``"mistral"``), ``hidden_act`` ``"silu"``. RoPE comes from
``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (version 4):
``rope_type`` ``"default"``, ``"linear"`` or ``"llama3"``. Attention biases, q/k norms and
the default ``head_dim`` are the family entry's (:meth:`~refkv.model.families.Family.attention_flags`):
Qwen2 always has q/k/v biases and no output bias; Llama and Qwen3 have q/k/v and output
biases when ``attention_bias`` is true; Mistral never has any. Refused, each by name with
its config key: sliding-window attention (``use_sliding_window`` and ``layer_types`` of
Qwen, a Mistral ``sliding_window`` narrower than ``max_position_embeddings``), mixture of
experts (``num_experts``, ``num_local_experts``, the ``*_moe`` model types), MLP biases
(``mlp_bias``), partial rotary embeddings (``partial_rotary_factor``) and every other
RoPE type (``dynamic``: its frequencies depend on the length seen so far; ``yarn``,
``longrope``, ...).

**Tokenizer.** If ``tokenizer.json`` is present and describes a byte-level BPE, it is
turned into the same :class:`~refkv.model.tokenizer.Tokenizer` the GGUF path builds
(special tokens from ``added_tokens``; the ``smollm`` pre-tokenizer when the
pre-tokenizer splits digits; EOS and chat template from ``tokenizer_config.json``).
Loading with a tokenizer (``refkv generate``, experiments) requires it.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np

from ..files import load_json, parse_json
from ..validation import check_float, check_int, shown
from .config import ModelConfig
from .families import Family, by_model_type, hf_architectures
from .gguf import GGUFVocab, ModelNotFoundError
from .weights import LayerWeights, ModelWeights

__all__ = ["CheckpointError", "read_checkpoint", "read_safetensors", "tokenizer_of",
           "vocab_from_tokenizer_json"]

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint directory refkv cannot use."""


#: Largest ``config.json`` / ``tokenizer_config.json`` read (real ones are a few kB).
MAX_CONFIG_BYTES = 16 * 2**20
#: Largest ``tokenizer.json`` read (a 150k-token vocabulary with its merges is about 10 MB).
MAX_TOKENIZER_BYTES = 128 * 2**20
#: Token ids may exceed the number of tokens a ``tokenizer.json`` lists by at most this
#: many (reserved ranges); a larger id would size the token table from a typo or a lie.
MAX_TOKEN_ID_GAP = 2**16


def read_json(file: Path, max_bytes: int = MAX_CONFIG_BYTES):
    """The parsed JSON of ``file`` (:func:`refkv.files.load_json`: a regular file of at most
    ``max_bytes``, standard JSON, bounded depth, no repeated key); a :class:`CheckpointError`
    naming the file otherwise."""
    try:
        return load_json(file, max_bytes, what=file.name, allow_constants=True)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _header_entry(path: Path, name, info, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one header entry: (dtype name, shape, start, stop) or a CheckpointError naming it."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry must be a JSON object, got {type(info).__name__}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: header entry has no {key!r}")
    kind, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(kind, str) or kind not in _DTYPES:
        raise CheckpointError(f"{where} has dtype {kind}; supported: {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(type(n) is int and 0 <= n <= max(data_size, 1) for n in shape):
        raise CheckpointError(f"{where}: 'shape' must be a list of integers in [0, {max(data_size, 1)}] (the "
                              f"file's data bytes), got {shown(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise CheckpointError(f"{where}: 'data_offsets' must be two integers [start, stop], got {offsets!r}")
    start, stop = offsets
    if not 0 <= start <= stop <= data_size or stop - start != math.prod(shape) * _DTYPES[kind].itemsize:
        raise CheckpointError(f"{where} bytes [{start}, {stop}) do not fit its shape {tuple(shape)} or the "
                              f"file (truncated?)")
    return kind, tuple(shape), start, stop


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as float arrays (BF16 widened to float32).

    Raises
    ------
    CheckpointError
        A malformed header (naming the entry and field), an unsupported dtype or a file
        shorter than its header says.
    """
    path = Path(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    if raw.size < 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file")
    n = int(raw[:8].view("<u8")[0])
    if n > _MAX_HEADER or 8 + n > raw.size:
        raise CheckpointError(f"{path}: header length {n} is impossible for a {raw.size}-byte file")
    try:  # depth-capped, and a tensor name given twice is refused (the last would silently win)
        header = parse_json(bytes(raw[8:8 + n]), f"{path}: the header")
    except ValueError as err:
        raise CheckpointError(str(err).replace("the header: not valid JSON", "the header is not JSON")) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header must be a JSON object, got {type(header).__name__}")
    data = raw[8 + n:]
    entries = {name: _header_entry(path, name, info, data.size) for name, info in header.items()
               if name != "__metadata__"}
    spans = sorted((start, stop, name) for name, (_, _, start, stop) in entries.items() if stop > start)
    for (_, stop, first), (start, _, second) in itertools.pairwise(spans):
        if start < stop:  # as the safetensors library: every tensor has bytes of its own
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} share bytes (their data_offsets "
                                  f"overlap); the header is inconsistent")
    tensors = {}
    for name, (kind, shape, start, stop) in entries.items():
        array = data[start:stop].view(_DTYPES[kind]).reshape(shape)
        if kind == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = np.asarray(array)
    return tensors


class _Fields:
    """Typed reads of ``config.json`` fields, each error naming the file and the key."""

    def __init__(self, file: Path, cfg: dict):
        self.file, self.cfg = file, cfg

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: {message}")

    def _check(self, check, key, value, *args, **kwargs):
        try:
            return check(key, value, *args, **kwargs)
        except ValueError as err:
            raise self.error(str(err)) from None

    def integer(self, key: str, default=None, low: int = 1) -> int:
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise self.error(f"{key!r} is missing")
            return default
        return self._check(check_int, key, value, low)

    def number(self, key: str, value, low=None, high=None, **kwargs) -> float:
        return self._check(check_float, key, value, low, high, **kwargs)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.cfg.get(key, default)
        value = default if value is None else value
        if not isinstance(value, bool):
            raise self.error(f"{key} must be true or false, got {value!r}")
        return value


def _family(f: _Fields) -> Family:
    """The config's entry in the family table (:mod:`refkv.model.families`), or a CheckpointError."""
    cfg = f.cfg
    arch, archs = cfg.get("model_type"), cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise f.error(f"architectures must be a list of names, got {archs!r}")
    moe = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)]
    if moe or (isinstance(arch, str) and "moe" in arch.lower()):
        key = moe[0] if moe else "model_type"
        raise f.error(f"mixture-of-experts models are not supported (config key {key!r} = {cfg.get(key)!r}); "
                      f"refkv reads dense {', '.join(hf_architectures())} checkpoints")
    family = by_model_type(arch, archs)
    if family is None:
        raise f.error(f"model_type {arch!r} (architectures {archs}) is not supported; refkv reads "
                      f"{', '.join(hf_architectures())} checkpoints")
    return family


def _check_full_attention(f: _Fields, family: Family) -> None:
    """Refuse sliding-window attention, asked for the way ``family``'s config asks for it."""
    cfg = f.cfg
    if family.sliding_window == "use_sliding_window":  # Qwen2/3: a flag, or per-layer types
        if f.flag("use_sliding_window"):
            raise f.error("sliding-window attention (use_sliding_window = true) is not supported")
        types = cfg.get("layer_types") or []
        if not isinstance(types, list) or any(t != "full_attention" for t in types):
            raise f.error(f"layer_types {types!r}: only 'full_attention' layers are supported "
                          f"(sliding-window attention is not)")
    elif family.sliding_window == "sliding_window" and cfg.get("sliding_window") is not None:
        # Mistral: a window as wide as the context is full attention, so only a narrower one is refused
        window, max_positions = f.integer("sliding_window"), f.integer("max_position_embeddings", 2048)
        if window < max_positions:
            raise f.error(f"sliding-window attention (sliding_window = {window} < max_position_embeddings = "
                          f"{max_positions}) is not supported: refkv attends to every cached token; a "
                          f"sliding_window of null or >= max_position_embeddings is full attention")


def _rope(f: _Fields) -> dict:
    """ModelConfig fields of the RoPE settings (transformers 5 ``rope_parameters`` or v4 keys)."""
    cfg = f.cfg
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    rope = cfg.get(key) or {}
    if not isinstance(rope, dict):
        raise f.error(f"{key} must be a JSON object or null, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "dynamic":
        raise f.error(f"RoPE type 'dynamic' ({key}.rope_type) is not supported: its frequencies depend on the "
                      f"length seen so far, so cached keys and new keys would be rotated differently")
    if kind not in ("default", "linear", "llama3"):
        raise f.error(f"RoPE type {kind!r} ({key}.rope_type) is not supported; refkv implements "
                      f"'default', 'linear' and 'llama3'")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise f.error(f"partial rotary embeddings (partial_rotary_factor = {partial!r}) are not supported")
    fields = {"rope_base": f.number("rope_theta", rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
                                    1.0, low_open=True), "rope_type": kind}

    def need(name):
        if rope.get(name) is None:
            raise f.error(f"{key}.{name} is missing (needed by rope_type {kind!r})")
        return rope[name]

    if kind in ("linear", "llama3"):
        fields["rope_factor"] = f.number(f"{key}.factor", need("factor"), 0.0, low_open=True)
    if kind == "llama3":
        fields["rope_low_freq_factor"] = f.number(f"{key}.low_freq_factor", need("low_freq_factor"), 0.0,
                                                  low_open=True)
        fields["rope_high_freq_factor"] = f.number(f"{key}.high_freq_factor", need("high_freq_factor"),
                                                   fields["rope_low_freq_factor"], low_open=True)
        fields["rope_original_context"] = f._check(check_int, f"{key}.original_max_position_embeddings",
                                                   need("original_max_position_embeddings"), 1)
    return fields


def _config(path: Path) -> ModelConfig:
    file = path / "config.json"
    if not file.exists():  # a FIFO or device there is refused by read_json, naming what it is
        raise ModelNotFoundError(f"{path} has no config.json; not a Hugging Face checkpoint directory")
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: must hold a JSON object (the model config), got {type(cfg).__name__}")
    f = _Fields(file, cfg)
    family = _family(f)
    if cfg.get("hidden_act", "silu") != "silu":
        raise f.error(f"hidden_act {cfg.get('hidden_act')!r} is not supported; only SiLU (SwiGLU) MLPs")
    if f.flag("mlp_bias"):
        raise f.error("MLP biases (mlp_bias = true) are not supported")
    _check_full_attention(f, family)
    d_model, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is None and family.default_head_dim is not None:
        head_dim = family.default_head_dim
    elif head_dim is None:
        if d_model % heads:
            raise f.error(f"hidden_size {d_model} is not a multiple of num_attention_heads {heads} and "
                          f"head_dim is not given")
        head_dim = d_model // heads
    # attention_bias is read only where it counts: Qwen2 has biases and Mistral none whatever it says
    flags = family.attention_flags(family.qkv_bias == "config" and f.flag("attention_bias"))
    try:
        return ModelConfig(
            vocab_size=f.integer("vocab_size"), d_model=d_model, n_layers=f.integer("num_hidden_layers"),
            n_heads=heads, n_kv_heads=f.integer("num_key_value_heads", heads),
            d_head=f._check(check_int, "head_dim", head_dim, 1), d_ff=f.integer("intermediate_size"),
            norm_eps=f.number("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), 0.0, 1.0, low_open=True,
                              high_open=True),
            tie_embeddings=f.flag("tie_word_embeddings"),
            max_positions=f.integer("max_position_embeddings", 2048), name=path.name, **flags, **_rope(f))
    except CheckpointError:
        raise
    except ValueError as err:
        raise f.error(f"not a usable {family.model_type} config: {err}") from err


def read_checkpoint(path, dtype=np.float32, *, tokenizer: bool = True):
    """Config, weights and (optionally) tokenizer of a checkpoint directory.

    Returns
    -------
    config : ModelConfig
    weights : ModelWeights
    tokenizer : Tokenizer or None
        ``None`` if not asked for.

    Raises
    ------
    ModelNotFoundError
        No ``config.json``, no ``*.safetensors``, or (``tokenizer=True``) no ``tokenizer.json``.
    CheckpointError
        Anything else refkv cannot use, naming the file and the key or tensor.
    """
    path = Path(path)
    config = _config(path)
    if tokenizer and not (path / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"{path / 'tokenizer.json'} not found: generating text and running experiments "
                                 f"need the checkpoint's tokenizer (copy tokenizer.json from the same checkpoint)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files")
    tensors, origin = {}, {}
    for file in files:
        for name, array in read_safetensors(file).items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} is in two shards, {origin[name].name} and "
                                      f"{file.name}; which one is meant is unknown")
            tensors[name], origin[name] = array, file
    weights = _weights(path, config, tensors, dtype)
    tok = None
    if tokenizer:
        tok = tokenizer_of(path, config.vocab_size)
    return config, weights, tok


def _weights(path: Path, c: ModelConfig, tensors: dict, dtype) -> ModelWeights:
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

    q, kv = c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    layers = []
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        extra = {}
        if c.attention_bias:
            extra.update(bq=vector(a + "q_proj.bias", q), bk=vector(a + "k_proj.bias", kv),
                         bv=vector(a + "v_proj.bias", kv))
        if c.output_bias:
            extra["bo"] = vector(a + "o_proj.bias", c.d_model)
        if c.qk_norm:
            extra.update(q_norm=vector(a + "q_norm.weight", c.d_head), k_norm=vector(a + "k_norm.weight", c.d_head))
        layers.append(LayerWeights(
            attn_norm=vector(p + "input_layernorm.weight", c.d_model),
            wq=dense(a + "q_proj.weight", q, c.d_model),
            wk=dense(a + "k_proj.weight", kv, c.d_model),
            wv=dense(a + "v_proj.weight", kv, c.d_model),
            wo=dense(a + "o_proj.weight", c.d_model, q),
            mlp_norm=vector(p + "post_attention_layernorm.weight", c.d_model),
            w_gate=dense(p + "mlp.gate_proj.weight", c.d_ff, c.d_model),
            w_up=dense(p + "mlp.up_proj.weight", c.d_ff, c.d_model),
            w_down=dense(p + "mlp.down_proj.weight", c.d_model, c.d_ff), **extra))
    embed = np.ascontiguousarray(get("model.embed_tokens.weight", (c.vocab_size, c.d_model)), dtype=dtype)
    lm_head = None if c.tie_embeddings else dense("lm_head.weight", c.vocab_size, c.d_model)
    weights = ModelWeights(embed, tuple(layers), vector("model.norm.weight", c.d_model), lm_head)
    try:
        weights.validate(c)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    return weights


def tokenizer_of(path, vocab_size: int | None = None):
    """The :class:`~refkv.model.tokenizer.Tokenizer` of a directory's ``tokenizer.json``, used as it is.

    The ``tokenizers`` object read from the file does the encoding (its own normalizer and
    pre-tokenizer: Llama 3 and Qwen2 do not split like GPT-2); refkv's table of token bytes
    does the decoding, as for GGUF files.
    """
    from .tokenizer import Tokenizer

    vocab = vocab_from_tokenizer_json(path, None if vocab_size is None else vocab_size - 1)
    try:
        from tokenizers import Tokenizer as Backend
    except ImportError as err:
        raise ModuleNotFoundError("the tokenizer needs the 'tokenizers' package: pip install tokenizers  "
                                  "(the 'models' extra: pip install -e '.[models]' in a checkout)") from err
    file = Path(path) / "tokenizer.json"
    try:
        backend = Backend.from_file(str(file))
    except Exception as err:  # the library raises its own exception type for a file it cannot use
        raise CheckpointError(f"{file}: the tokenizers library cannot read it: {err}") from err
    return Tokenizer(vocab, backend=backend)


def vocab_from_tokenizer_json(path, max_id: int | None = None) -> GGUFVocab:
    """A :class:`~refkv.model.gguf.GGUFVocab` from a directory's ``tokenizer.json``.

    Every token id is checked before the token table is sized by it: an integer in
    ``[0, max_id]`` (default: the number of tokens listed plus :data:`MAX_TOKEN_ID_GAP`;
    :func:`read_checkpoint` passes the model's ``vocab_size - 1``).

    Raises
    ------
    CheckpointError
        If the tokenizer is not a byte-level BPE.
    """
    path = Path(path)
    file = path / "tokenizer.json"
    spec = read_json(file, MAX_TOKENIZER_BYTES)
    if not isinstance(spec, dict):
        raise CheckpointError(f"{file}: must hold a JSON object, got {type(spec).__name__}")
    try:
        return _vocab(path, spec, max_id)
    except (KeyError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(f"{file}: malformed tokenizer ({type(err).__name__}: {err})") from err


def _vocab(path: Path, spec, max_id: int | None = None) -> GGUFVocab:
    file = path / "tokenizer.json"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise CheckpointError(f"{file}: only byte-level BPE tokenizers are supported")
    vocab = dict(model["vocab"])
    added_tokens = spec.get("added_tokens", [])
    if not isinstance(added_tokens, list) or not all(isinstance(a, dict) for a in added_tokens):
        raise CheckpointError(f"{file}: added_tokens must be a list of objects")
    for added in added_tokens:
        vocab[added["content"]] = added["id"]
    if max_id is None:
        max_id = len(vocab) - 1 + MAX_TOKEN_ID_GAP
    for token, i in vocab.items():  # before the table is sized by the largest id
        if not isinstance(token, str) or isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= max_id:
            raise CheckpointError(f"{file}: token {shown(token, 40)} has id {shown(i)}; ids must be integers in "
                                  f"[0, {max_id}] (the model's vocabulary)")
    size = max(vocab.values()) + 1
    tokens = [""] * size
    for token, i in vocab.items():
        tokens[i] = token
    types = np.ones(size, dtype=np.int32)
    for added in added_tokens:
        types[added["id"]] = 3 if added.get("special") else 4
    merges = tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", []))
    settings = {}
    if (path / "tokenizer_config.json").is_file():
        settings = read_json(path / "tokenizer_config.json")
        if not isinstance(settings, dict):
            raise CheckpointError(f"{path / 'tokenizer_config.json'}: must hold a JSON object")
        template = settings.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{path / 'tokenizer_config.json'}: chat_template must be a string (a Jinja "
                                  f"template) or absent, got {type(template).__name__}")

    def token_id(key):
        value = settings.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return vocab.get(value) if isinstance(value, str) else None

    pre = "smollm" if '"Digits"' in json.dumps(spec.get("pre_tokenizer")) else "gpt2"
    return GGUFVocab(model="gpt2", pre=pre, tokens=tuple(tokens), token_types=types, merges=merges,
                     bos_id=token_id("bos_token"), eos_id=token_id("eos_token"), unk_id=token_id("unk_token"),
                     pad_id=token_id("pad_token"), add_bos=bool(settings.get("add_bos_token", False)),
                     chat_template=settings.get("chat_template"))
