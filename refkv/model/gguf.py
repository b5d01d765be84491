"""Read a GGUF file of the llama, qwen2 or qwen3 architecture: config, dequantized weights, tokenizer.

GGUF is llama.cpp's single-file format: a table of typed metadata (``llama.block_count``,
``tokenizer.ggml.tokens``, ...) followed by tensors, each stored as plain floats or in
a block quantization (Q4_1, Q8_0, ...). :func:`read_gguf` reads it with the ``gguf``
package (extra ``models``), dequantizes every tensor with ``gguf.quants.dequantize``
and converts it to refkv's conventions (:mod:`refkv.model.weights`).

Notes
-----
**RoPE pairing, per architecture.** refkv applies RoPE in the Hugging Face "rotate half"
layout: dimension ``i`` of a head rotates with dimension ``i + d/2``
(:func:`refkv.model.layers.apply_rope`). For the ``llama`` architecture llama.cpp
rotates adjacent dimensions ``(2i, 2i + 1)``, so its converter (``convert_hf_to_gguf.py``,
``LlamaModel.modify_tensors``) reorders the rows of ``attn_q`` and ``attn_k`` (and their
biases) within each head: GGUF row ``2i + j`` holds Hugging Face row ``j d/2 + i``
(``j`` in {0, 1}). The loader undoes this with :func:`unpermute_rope_rows` (per query
head for ``attn_q``, per KV head for ``attn_k``), so the loaded weights are exactly the
Hugging Face ones and ``q . k`` is unchanged: both routes rotate the same pairs by the
same angles. For ``qwen2`` and ``qwen3`` llama.cpp uses "NEOX" RoPE, which is rotate
half, and the converter (``Qwen2Model``, ``Qwen3Model(Qwen2Model)``) writes the rows
unchanged: nothing is un-permuted (:attr:`Family.gguf_rope_interleaved
<refkv.model.families.Family.gguf_rope_interleaved>` of the file's family). Tests prove the
llama rule three ways: on a synthetic tensor, by the equality of interleaved RoPE on the
GGUF rows and rotate-half RoPE on the un-permuted rows, and on the real model.

**Layout.** A GGUF tensor of shape ``[ne0, ne1]`` is stored row-major as ``(ne1, ne0)``,
which is PyTorch's ``(out_features, in_features)``; refkv stores ``(in, out)``, so every
projection is transposed after dequantization. The embedding ``token_embd`` is
``(vocab, d_model)`` as stored. A missing ``output.weight`` means tied embeddings.

**Architecture variants.** The file's ``general.architecture`` picks its entry in the
family table (:mod:`refkv.model.families`; Mistral files say ``llama`` and are read as
such, as llama.cpp runs them, without a sliding window). ``blk.N.attn_{q,k,v}.bias``
(qwen2 always; llama optional) switch on ``attention_bias``, ``blk.N.attn_output.bias``
``output_bias``, and
``blk.N.attn_{q,k}_norm.weight`` (qwen3) ``qk_norm``. Llama 3 RoPE scaling arrives as
the ``rope_freqs.weight`` tensor (llama.cpp's converter computes one divisor per
frequency from the Hugging Face ``rope_scaling``), read into
:attr:`~refkv.model.ModelConfig.rope_freq_factors`; ``{arch}.rope.scaling.type`` ``linear``
with its ``rope.scaling.factor`` is read too.

**Precision.** ``gguf.quants.dequantize`` produces float32 (llama.cpp's reference
arithmetic: e.g. Q4_1 computes ``d * q + m`` in float32 from float16 ``d`` and ``m``).
A float64 load widens those float32 values exactly; it does not recompute them.

**Supported tensor types** (:data:`SUPPORTED_TYPES`): F32, F16, BF16, F64, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0 and the K-quants Q2_K to Q6_K. Anything else (IQ*, TQ*, Q8_1, integer
types) is refused with a :class:`GGUFError` naming the tensor and its type, before its
bytes are mapped.

**Float metadata.** GGUF stores ``rope.freq_base`` and the RMSNorm epsilon as float32;
they are read back as the shortest decimal that rounds to the stored value (``1e-05``
rather than ``9.999999747378752e-06``), which is the decimal of the original config.

**Metadata refkv refuses**, naming the key: other architectures; mixture of experts
(``{arch}.expert_count`` > 0, as in Mixtral files of the ``llama`` architecture); RoPE
scaling other than ``none``/``linear`` (``{arch}.rope.scaling.type``); RoPE over part of
the head (``{arch}.rope.dimension_count``); key and value head widths that differ;
counts that are zero, infinite or impossible for the file (``block_count`` larger than
the blocks whose tensors the file holds is refused before anything is allocated).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..validation import check_float
from .config import ModelConfig
from .families import by_gguf_architecture, gguf_architectures
from .weights import FLOAT_DTYPES, LayerWeights, ModelWeights

__all__ = [
    "SUPPORTED_TYPES",
    "GGUFError",
    "GGUFModel",
    "GGUFVocab",
    "ModelNotFoundError",
    "read_gguf",
    "unpermute_rope_rows",
]

#: Names of the GGML tensor types refkv dequantizes (``gguf.GGMLQuantizationType`` names).
SUPPORTED_TYPES = frozenset({"F32", "F16", "BF16", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})

MODELS_EXTRA = "pip install gguf tokenizers  (the 'models' extra: pip install -e '.[models]' in a checkout)"


class GGUFError(ValueError):
    """A GGUF file refkv cannot use: corrupt, truncated, or describing something else."""


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model file (or the package that ships it) is not on this machine.

    Both a :class:`FileNotFoundError` (what it is) and a :class:`ValueError` (so the
    ``refkv`` command reports it as a usage error, like every other bad input).
    """


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer fields of a GGUF file (``tokenizer.ggml.*``).

    Attributes
    ----------
    model : str
        ``tokenizer.ggml.model``; ``"gpt2"`` means byte-level BPE.
    pre : str
        ``tokenizer.ggml.pre``, the pre-tokenizer name (``"smollm"`` for SmolLM2).
    tokens : tuple of str
        Token strings in the byte-level alphabet (``"Ġthe"`` is ``" the"``).
    token_types : (vocab,) int32 array
        llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    merges : tuple of (str, str)
        BPE merges in priority order.
    bos_id, eos_id, unk_id, pad_id : int or None
    add_bos : bool
        Whether a BOS token is prepended to every encoding (False for SmolLM2).
    chat_template : str or None
        The Jinja chat template, kept for reference and tests.
    """

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: np.ndarray
    merges: tuple[tuple[str, str], ...]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str | None


@dataclass(frozen=True)
class GGUFModel:
    """What :func:`read_gguf` returns.

    Attributes
    ----------
    path : Path
    config : ModelConfig
    weights : ModelWeights or None
        ``None`` when read with ``weights=False``.
    vocab : GGUFVocab or None
        ``None`` when the file has no tokenizer fields.
    metadata : dict
        Every scalar and string metadata value (arrays left out), for reports.
    """

    path: Path
    config: ModelConfig
    weights: ModelWeights | None
    vocab: GGUFVocab | None
    metadata: dict


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE reordering of ``attn_q`` / ``attn_k`` rows.

    Parameters
    ----------
    w : (n_heads * d_head, in_features) array
        Rows in GGUF order: within each head, row ``2i + j`` holds Hugging Face row
        ``j d_head/2 + i``.
    n_heads : int
        Heads the rows belong to (query heads for ``attn_q``, KV heads for ``attn_k``).

    Returns
    -------
    (n_heads * d_head, in_features) array in the Hugging Face ("rotate half") order.
    """
    rows, cols = w.shape
    if n_heads < 1 or rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"rows ({rows}) must split into n_heads={n_heads} heads of even width")
    d = rows // n_heads
    # GGUF index within a head is (i, j) -> 2i + j; Hugging Face index is (j, i) -> j d/2 + i.
    return w.reshape(n_heads, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_gguf(path, dtype=np.float32, *, weights: bool = True) -> GGUFModel:
    """Read a GGUF file of the llama, qwen2 or qwen3 architecture.

    Parameters
    ----------
    path : str or PathLike
    dtype : float32 or float64
        dtype of the returned weights.
    weights : bool
        If false, read only the config, vocabulary and metadata (no dequantization).

    Raises
    ------
    ModelNotFoundError
        If ``path`` does not exist.
    GGUFError
        If the file is not GGUF, is truncated or corrupt, is not a llama, qwen2 or qwen3
        model (or uses a variant refkv does not implement), uses a
        tensor type refkv cannot dequantize, or has tensors whose shapes disagree with
        its metadata.
    """
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    path = Path(os.fspath(path))
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    reader = _open(path)
    try:
        metadata = {name: _field_value(field) for name, field in reader.fields.items()
                    if not _is_array(field)}
        tensors = {t.name: t for t in reader.tensors}
        config = _config(reader, tensors, path)
        vocab = _vocab(reader, path) if "tokenizer.ggml.tokens" in reader.fields else None
    except UnicodeDecodeError as err:  # a metadata string (a key's value, a token) of bytes that are not text
        raise GGUFError(f"{path}: a metadata string is not UTF-8 ({err}); the file is corrupt") from None
    _check_tensors(tensors, config, path)
    family = by_gguf_architecture(metadata["general.architecture"])  # known: _config read the file by it
    model_weights = _weights(tensors, config, dtype, family.gguf_rope_interleaved, path) if weights else None
    return GGUFModel(path=path, config=config, weights=model_weights, vocab=vocab, metadata=metadata)


# -- reading -----------------------------------------------------------------------------
def _gguf():
    try:
        import gguf
    except ImportError as err:
        raise ModuleNotFoundError(f"reading GGUF files needs the 'gguf' package: {MODELS_EXTRA}") from err
    return gguf


def _open(path: Path):
    gguf = _gguf()

    class Reader(gguf.GGUFReader):
        """The package's reader, refusing an unsupported tensor type by name before mapping its bytes.

        (Otherwise an IQ2 tensor whose rows are not a multiple of its 256-value block fails
        deep in the reader with a row-size message that does not say what is wrong.)
        """

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                raw = int(field.parts[4][0])
                try:
                    kind = gguf.GGMLQuantizationType(raw).name
                except ValueError:
                    kind = f"unknown type id {raw}"
                if kind not in SUPPORTED_TYPES:
                    name = bytes(field.parts[1]).decode("utf-8", "replace")
                    raise GGUFError(f"{path}: tensor {name!r} has type {kind}, which refkv cannot dequantize; "
                                    f"supported: {', '.join(sorted(SUPPORTED_TYPES))}")
            return super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except GGUFError:
        raise
    except Exception as err:  # the reader raises ValueError, IndexError, struct/memmap errors...
        raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                        f"{type(err).__name__}: {err}") from err


def _is_array(field) -> bool:
    return bool(field.types) and field.types[0].name == "ARRAY"


def _field_value(field):
    """A scalar or string metadata value (the parts/data layout of ``ReaderField``).

    FLOAT32 values come back as the shortest decimal that rounds to the stored float32
    (``1e-05``, not ``9.999999747378752e-06``): converters write the Hugging Face
    config's decimal rounded to float32, and this recovers that decimal exactly.
    """
    kind = field.types[0].name
    if kind == "STRING":
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    if kind == "FLOAT32":
        return float(str(np.float32(value)))
    return value.item()


def _array_strings(field) -> list[str]:
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _array_numbers(field) -> np.ndarray:
    return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.zeros(0)


def _config(reader, tensors: dict, path: Path) -> ModelConfig:
    fields = reader.fields

    def get(key, required=True):
        if key not in fields:
            if required:
                raise GGUFError(f"{path}: metadata key {key!r} is missing")
            return None
        return _field_value(fields[key])

    arch = get("general.architecture")
    family = by_gguf_architecture(arch)
    if family is None:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; refkv reads "
                        f"{', '.join(repr(a) for a in gguf_architectures())} GGUF files")

    def count(key, default=None, low=1):
        """An integer field, checked before anything is sized by it."""
        value = get(f"{arch}.{key}", required=default is None)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise GGUFError(f"{path}: metadata {arch}.{key} must be an integer >= {low}, got {value!r}")
        return value

    def number(key, default, low, high=None):
        value = get(f"{arch}.{key}", required=default is None)
        value = default if value is None else value
        try:
            return check_float(f"{arch}.{key}", value, low, high, low_open=True, high_open=high is not None)
        except ValueError as err:
            raise GGUFError(f"{path}: metadata {err}") from None

    experts = count("expert_count", 0, low=0)
    if experts:
        raise GGUFError(f"{path}: mixture-of-experts models are not supported ({arch}.expert_count = {experts})")
    n_layers = count("block_count")
    blocks = {int(name.split(".")[1]) for name in tensors
              if name.startswith("blk.") and name.split(".")[1].isdigit()}
    # Compared by size first (4e9 layers must not build a 4e9-entry set); more blocks than
    # the count would otherwise run silently as a shallower model.
    if n_layers != len(blocks) or blocks != set(range(n_layers)):
        # before anything is sized by it: 4e9 layers would otherwise mean a 4e9-entry table
        raise GGUFError(f"{path}: metadata {arch}.block_count = {n_layers}, but the file holds tensors for "
                        f"{len(blocks)} blocks")
    d_model, d_ff = count("embedding_length"), count("feed_forward_length")
    n_heads = count("attention.head_count")
    n_kv_heads = count("attention.head_count_kv", n_heads)
    d_head = count("attention.key_length", 0)
    if not d_head:
        if d_model % n_heads:
            raise GGUFError(f"{path}: metadata {arch}.attention.head_count = {n_heads} does not divide "
                            f"{arch}.embedding_length = {d_model}, and {arch}.attention.key_length is not given")
        d_head = d_model // n_heads
    for name, heads in (("blk.0.attn_q.weight", n_heads), ("blk.0.attn_k.weight", n_kv_heads)):
        rows = _rows(tensors.get(name))  # before RoPE is judged: a wrong head count is not "partial RoPE"
        if rows is not None and rows != heads * d_head:
            raise GGUFError(f"{path}: metadata {arch}.attention.head_count = {n_heads}, head_count_kv = "
                            f"{n_kv_heads} and head width {d_head} imply {heads * d_head} rows of {name}; "
                            f"the file has {rows}")
    d_value = count("attention.value_length", d_head)
    if d_value != d_head:
        raise GGUFError(f"{path}: key width {d_head} != value width {d_value}; refkv needs them equal")
    rope_dims = count("rope.dimension_count", d_head)
    if rope_dims != d_head:
        raise GGUFError(f"{path}: partial RoPE ({arch}.rope.dimension_count = {rope_dims} of {d_head} dims "
                        f"per head) is not supported")
    rope = {}
    scaling = get(f"{arch}.rope.scaling.type", required=False)
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_factor": number("rope.scaling.factor", None, 0.0)}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported; refkv "
                        f"implements none, linear, and Llama 3 scaling (rope_freqs.weight)")
    if "rope_freqs.weight" in tensors:
        rope["rope_freq_factors"] = _rope_freq_factors(tensors["rope_freqs.weight"], d_head, path)
    vocab = get(f"{arch}.vocab_size", required=False)
    if vocab is None:
        if "tokenizer.ggml.tokens" in fields:
            vocab = len(fields["tokenizer.ggml.tokens"].data)
        elif "token_embd.weight" in tensors:
            vocab = int(tensors["token_embd.weight"].shape[1])
        else:
            raise GGUFError(f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size, tokens or embedding)")
    bias = "blk.0.attn_q.bias" in tensors
    try:
        return ModelConfig(
            vocab_size=int(vocab), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_kv_heads, d_head=d_head, d_ff=d_ff,
            rope_base=number("rope.freq_base", 10000.0, 1.0),
            norm_eps=number("attention.layer_norm_rms_epsilon", None, 0.0, 1.0),
            tie_embeddings="output.weight" not in tensors, max_positions=count("context_length"),
            name=path.name.removesuffix(".gguf"),
            # the family's rules (Qwen2: biases always; Qwen3: q/k norms), but the output bias as the file has it
            **{**family.attention_flags(bias), "output_bias": "blk.0.attn_output.bias" in tensors}, **rope)
    except ValueError as err:
        raise GGUFError(f"{path}: metadata describes an invalid model: {err}") from err


def _rows(tensor) -> int | None:
    """Rows (``ne1``) of a 2-D GGUF tensor, or None."""
    return None if tensor is None or len(tensor.shape) < 2 else int(tensor.shape[1])


def _rope_freq_factors(tensor, d_head: int, path: Path) -> tuple[float, ...]:
    gguf = _gguf()
    if tensor.tensor_type.name != "F32" or tensor.n_elements != d_head // 2:
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' must be F32 with d_head / 2 = {d_head // 2} values, "
                        f"got {tensor.tensor_type.name} with {tensor.n_elements}")
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(-1)
    return tuple(float(v) for v in values)


def _vocab(reader, path: Path | str = "GGUF file") -> GGUFVocab:
    fields = reader.fields

    def get(key, default=None):
        return _field_value(fields[key]) if key in fields else default

    tokens = tuple(_array_strings(fields["tokenizer.ggml.tokens"]))

    def get_id(key):
        value = get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise GGUFError(f"{path}: metadata {key} = {value!r} is not a token id in [0, {len(tokens) - 1}] "
                            f"(tokenizer.ggml.tokens has {len(tokens)})")
        return value

    if "tokenizer.ggml.token_type" in fields:
        token_types = _array_numbers(fields["tokenizer.ggml.token_type"]).astype(np.int32)
    else:
        token_types = np.ones(len(tokens), dtype=np.int32)
    merges = []
    for line in _array_strings(fields["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in fields else ():
        left, sep, right = line.partition(" ")
        if not sep or not left or not right or " " in right:
            raise GGUFError(f"malformed BPE merge {line!r}: expected two tokens separated by one space")
        merges.append((left, right))
    if len(token_types) != len(tokens):
        raise GGUFError(f"tokenizer.ggml.token_type has {len(token_types)} entries, tokens has {len(tokens)}")
    return GGUFVocab(
        model=get("tokenizer.ggml.model", "gpt2"), pre=get("tokenizer.ggml.pre", "default"), tokens=tokens,
        token_types=token_types, merges=tuple(merges), bos_id=get_id("tokenizer.ggml.bos_token_id"),
        eos_id=get_id("tokenizer.ggml.eos_token_id"), unk_id=get_id("tokenizer.ggml.unknown_token_id"),
        pad_id=get_id("tokenizer.ggml.padding_token_id"), add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        chat_template=_template(get("tokenizer.chat_template"), path))


def _template(value, path) -> str | None:
    if value is not None and not isinstance(value, str):
        raise GGUFError(f"{path}: metadata tokenizer.chat_template must be a string, got {type(value).__name__}")
    return value


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> stored numpy shape ``(ne1, ne0)`` (PyTorch's (out, in))."""
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    shapes = {"token_embd.weight": (cfg.vocab_size, cfg.d_model), "output_norm.weight": (cfg.d_model,)}
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.d_model)
    for i in range(cfg.n_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (cfg.d_model,), f"blk.{i}.attn_q.weight": (q, cfg.d_model),
            f"blk.{i}.attn_k.weight": (kv, cfg.d_model), f"blk.{i}.attn_v.weight": (kv, cfg.d_model),
            f"blk.{i}.attn_output.weight": (cfg.d_model, q), f"blk.{i}.ffn_norm.weight": (cfg.d_model,),
            f"blk.{i}.ffn_gate.weight": (cfg.d_ff, cfg.d_model), f"blk.{i}.ffn_up.weight": (cfg.d_ff, cfg.d_model),
            f"blk.{i}.ffn_down.weight": (cfg.d_model, cfg.d_ff)})
        if cfg.attention_bias:
            shapes.update({f"blk.{i}.attn_q.bias": (q,), f"blk.{i}.attn_k.bias": (kv,),
                           f"blk.{i}.attn_v.bias": (kv,)})
        if cfg.output_bias:
            shapes[f"blk.{i}.attn_output.bias"] = (cfg.d_model,)
        if cfg.qk_norm:
            shapes.update({f"blk.{i}.attn_q_norm.weight": (cfg.d_head,),
                           f"blk.{i}.attn_k_norm.weight": (cfg.d_head,)})
    return shapes


def _check_tensors(tensors: dict, cfg: ModelConfig, path: Path) -> None:
    """Every tensor present, of a supported type, of the metadata's shape, and complete."""
    gguf = _gguf()
    for name, shape in _expected_shapes(cfg).items():
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing")
        t = tensors[name]
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {name!r} has type {kind}, which refkv cannot dequantize; "
                            f"supported: {', '.join(sorted(SUPPORTED_TYPES))}")
        stored = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        while len(stored) > len(shape) and stored[0] == 1:
            stored = stored[1:]
        if stored != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {stored}, but the metadata implies {shape}")
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        expected_bytes = int(np.prod(shape)) // block * block_bytes
        if int(np.prod(shape)) % block or t.data.nbytes != expected_bytes:
            raise GGUFError(f"{path}: tensor {name!r} holds {t.data.nbytes} bytes, expected {expected_bytes} "
                            f"for {kind} {shape} (truncated or corrupt file?)")


def _weights(tensors: dict, cfg: ModelConfig, dtype: np.dtype, permuted: bool, path: Path) -> ModelWeights:
    gguf = _gguf()
    shapes = _expected_shapes(cfg)

    def array(name: str) -> np.ndarray:
        t = tensors[name]
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # float32 (float64 for F64)
        return values.reshape(shapes[name])

    def rows(name: str, rope_heads: int | None) -> np.ndarray:
        w = array(name)  # (out, in) or (out,)
        if rope_heads is not None and permuted:  # llama: undo the converter's interleaving
            w = unpermute_rope_rows(w.reshape(w.shape[0], -1), rope_heads).reshape(w.shape)
        return w

    def dense(name: str, rope_heads: int | None = None) -> np.ndarray:
        return np.ascontiguousarray(rows(name, rope_heads).T, dtype=dtype)  # refkv stores (in, out)

    def vector(name: str, rope_heads: int | None = None) -> np.ndarray:
        return np.ascontiguousarray(rows(name, rope_heads), dtype=dtype)

    layers = []
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        extra = {}
        if cfg.attention_bias:
            extra.update(bq=vector(b + "attn_q.bias", cfg.n_heads), bk=vector(b + "attn_k.bias", cfg.n_kv_heads),
                         bv=vector(b + "attn_v.bias"))
        if cfg.output_bias:
            extra["bo"] = vector(b + "attn_output.bias")
        if cfg.qk_norm:
            extra.update(q_norm=vector(b + "attn_q_norm.weight"), k_norm=vector(b + "attn_k_norm.weight"))
        layers.append(LayerWeights(
            attn_norm=vector(b + "attn_norm.weight"), wq=dense(b + "attn_q.weight", cfg.n_heads),
            wk=dense(b + "attn_k.weight", cfg.n_kv_heads), wv=dense(b + "attn_v.weight"),
            wo=dense(b + "attn_output.weight"), mlp_norm=vector(b + "ffn_norm.weight"),
            w_gate=dense(b + "ffn_gate.weight"), w_up=dense(b + "ffn_up.weight"),
            w_down=dense(b + "ffn_down.weight"), **extra))
    lm_head = None if cfg.tie_embeddings else dense("output.weight")
    weights = ModelWeights(embed=vector("token_embd.weight"), layers=tuple(layers),
                           final_norm=vector("output_norm.weight"), lm_head=lm_head)
    try:
        weights.validate(cfg)
    except ValueError as err:  # e.g. NaN in a corrupt file
        raise GGUFError(f"{path}: GGUF weights are unusable: {err}") from err
    return weights


# -- the model's depth from the header alone ----------------------------------------------------
#: GGUF metadata value types: struct format of the scalar ones (8 = string, 9 = array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}


def read_block_count(path) -> int | None:
    """The number of layers ``{architecture}.block_count`` from a GGUF file's header, or None.

    Reads the metadata key/value section only, stopping at that key (the tensors and the
    tokenizer's arrays are skipped unread), so the CLI can check depth-dependent policy
    parameters (knorm's ``skip_layers``, MAT's ``shallow_layers``) in milliseconds, before
    the seconds :func:`read_gguf` takes. None when the header does not give it (the full
    reader then reports what is wrong).
    """
    import struct

    def unpack(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def length(f, unit: int = 1) -> int:
        """A length or count read from the file, checked against the bytes left before use."""
        n = unpack(f, "<Q")
        if n * unit > size - f.tell():  # a string of 2**62 bytes cannot be in this file
            raise ValueError(f"length {n} beyond the end of the file")
        return n

    def skip_value(f, kind, depth=0):
        if kind in _SCALAR_FORMATS:
            f.seek(struct.calcsize(_SCALAR_FORMATS[kind]), os.SEEK_CUR)
        elif kind == 8:
            f.seek(length(f), os.SEEK_CUR)
        elif kind == 9 and depth < 4:
            inner = unpack(f, "<I")
            if inner in _SCALAR_FORMATS:
                f.seek(length(f, struct.calcsize(_SCALAR_FORMATS[inner])), os.SEEK_CUR)
            else:
                for _ in range(length(f, 8)):  # every element takes at least 8 bytes
                    skip_value(f, inner, depth + 1)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if f.read(4) != b"GGUF" or unpack(f, "<I") < 2:
                return None
            unpack(f, "<Q")  # tensor count
            n_kv = unpack(f, "<Q")
            architecture = None
            for _ in range(min(n_kv, 1 << 16)):
                key = f.read(length(f)).decode("utf-8", "replace")
                kind = unpack(f, "<I")
                if key == "general.architecture" and kind == 8:
                    architecture = f.read(length(f)).decode("utf-8", "replace")
                elif architecture is not None and key == f"{architecture}.block_count" and kind in _SCALAR_FORMATS:
                    count = unpack(f, _SCALAR_FORMATS[kind])
                    return int(count) if 1 <= count <= 1 << 16 else None
                else:
                    skip_value(f, kind)
    except (OSError, EOFError, ValueError, OverflowError, struct.error):
        return None
    return None
