"""The architecture families refkv runs, in one table: Llama 2, Llama 3, Qwen2, Qwen3, Mistral.

Every family is the Llama 2 decoder (RMSNorm, RoPE, GQA, SwiGLU) with a few switches. One
:class:`Family` entry per family holds all that differs: the names its files carry
(Hugging Face ``model_type`` and architecture, GGUF ``general.architecture``), which
attention variants it switches on and from where, how its config asks for sliding-window
attention (refused), and a tiny random model. Both loaders
(:mod:`refkv.model.gguf`, :mod:`refkv.model.safetensors_dir`) look a file's family up
here and read it by these fields; neither branches on a family's name. The decoder
(:class:`refkv.model.Model`) sees only the :class:`~refkv.model.ModelConfig` flags the
entry sets (``attention_bias``, ``output_bias``, ``qk_norm``, the RoPE fields).

========  =======================================================================
family    features (beyond Llama 2's RMSNorm, RoPE, GQA, SwiGLU), as its tiny model has them
========  =======================================================================
llama     none: the Llama 2 decoder, tied head; q/k/v and output biases when
          ``config.json`` has ``attention_bias: true``
llama3    Llama 3.1 RoPE scaling (factor 8, low/high frequency factors 1 and 4) with an
          original context of 32 tokens, so that prompts longer than 32 cross every band;
          RoPE base 500000; GQA group 4; untied LM head. Its files are Llama files (the
          scaling is in each file's RoPE parameters), so they are read by the llama entry
qwen2     q/k/v biases, always (no output bias); RoPE base 10**6; RMSNorm eps 1e-6
qwen3     per-head RMSNorm of q and k before RoPE; ``d_head`` (32) twice
          ``d_model / n_heads`` (16); RoPE base 10**6; RMSNorm eps 1e-6
mistral   none: Llama maths (no biases ever), untied head, GQA group 4, RoPE base 10**6.
          Its sliding window is refused unless it covers the whole context (``null`` or
          ``>= max_position_embeddings``); llama.cpp writes its GGUF files as ``llama``
========  =======================================================================

Several entries may share a file name (Llama 3 and Mistral GGUF files both say ``llama``;
Llama 3 checkpoints say ``model_type`` ``llama``): a reader takes the first entry in
:data:`FAMILIES` with the name, so the entry that owns a name comes first.

``tests/model/test_conformance_families.py`` checks each against transformers' own
implementation of the family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MistralForCausalLM``), through a saved checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..validation import check_choice, check_int
from .config import ModelConfig
from .decoder import Model
from .weights import random_weights

__all__ = ["FAMILIES", "Family", "by_gguf_architecture", "by_model_type", "family_config", "gguf_architectures",
           "hf_architectures", "tiny"]

#: How a family's q/k/v projections get biases: always (Qwen2), when the file says so
#: (``config.json`` ``attention_bias``; in GGUF, ``blk.N.attn_q.bias`` present), or never.
QKV_BIAS = ("always", "config", "never")
#: How a family's ``config.json`` asks for sliding-window attention, which refkv refuses:
#: ``"use_sliding_window"`` (Qwen: that flag, or a ``layer_types`` entry other than
#: ``full_attention``) or ``"sliding_window"`` (Mistral: a window narrower than
#: ``max_position_embeddings``). None: the family has none.
SLIDING_WINDOW = (None, "use_sliding_window", "sliding_window")


@dataclass(frozen=True)
class Family:
    """What one architecture family changes in the Llama 2 decoder, and where its files say it.

    Attributes
    ----------
    name : str
        The family's name in refkv (:func:`tiny`, the golden files).
    model_type : str
        ``model_type`` in its checkpoints' ``config.json``.
    hf_architecture : str
        ``architectures[0]`` in its ``config.json``: the transformers class that runs it
        (read when ``model_type`` is absent).
    gguf_architecture : str
        ``general.architecture`` of its GGUF files (llama.cpp's converter's choice).
    gguf_rope_interleaved : bool
        llama.cpp's converter reorders this architecture's q/k rows for interleaved RoPE,
        so the GGUF reader un-permutes them (:func:`refkv.model.gguf.unpermute_rope_rows`).
    qkv_bias : {"always", "config", "never"}
        Biases on the q, k and v projections (:data:`QKV_BIAS`).
    output_bias : bool
        The output projection has a bias whenever q/k/v have one (Llama, Qwen3: transformers'
        ``attention_bias`` covers ``o_proj`` too); false for Qwen2, whose ``o_proj`` never has one.
    qk_norm : bool
        Per-head RMSNorm of q and k before RoPE (Qwen3's ``q_norm``, ``k_norm``).
    default_head_dim : int or None
        ``head_dim`` when ``config.json`` leaves it out (Qwen3Config's 128); None:
        ``hidden_size / num_attention_heads``.
    sliding_window : {None, "use_sliding_window", "sliding_window"}
        How its ``config.json`` asks for sliding-window attention (:data:`SLIDING_WINDOW`).
    tiny : ModelConfig
        The family's tiny model (:func:`tiny`): its features at a size that runs in milliseconds.
    """

    name: str
    model_type: str
    hf_architecture: str
    gguf_architecture: str
    tiny: ModelConfig
    gguf_rope_interleaved: bool = False
    qkv_bias: str = "config"
    output_bias: bool = True
    qk_norm: bool = False
    default_head_dim: int | None = None
    sliding_window: str | None = None

    def __post_init__(self) -> None:
        check_choice("qkv_bias", self.qkv_bias, QKV_BIAS)
        check_choice("sliding_window", self.sliding_window, SLIDING_WINDOW)

    def attention_flags(self, bias: bool) -> dict[str, bool]:
        """The :class:`~refkv.model.ModelConfig` attention fields of a file of this family.

        ``bias``: whether the file asks for q/k/v biases (``config.json`` ``attention_bias``,
        or a GGUF file holding ``blk.0.attn_q.bias``); it counts for ``qkv_bias="config"`` only.
        """
        qkv = self.qkv_bias == "always" or (self.qkv_bias == "config" and bias)
        return {"attention_bias": qkv, "output_bias": qkv and self.output_bias, "qk_norm": self.qk_norm}


_BASE = dict(vocab_size=320, n_layers=2, max_positions=256, norm_eps=1e-5, rope_base=10000.0)

#: Family name -> its entry; a reader takes the first entry with a file's name (see the module notes).
FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("llama", "llama", "LlamaForCausalLM", "llama", gguf_rope_interleaved=True,
           tiny=ModelConfig(**_BASE, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                            tie_embeddings=True, name="tiny-llama")),
    Family("llama3", "llama", "LlamaForCausalLM", "llama", gguf_rope_interleaved=True,
           tiny=ModelConfig(**{**_BASE, "rope_base": 500000.0}, d_model=128, n_heads=4, n_kv_heads=1, d_head=32,
                            d_ff=192, tie_embeddings=False, rope_type="llama3", rope_factor=8.0,
                            rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_context=32,
                            name="tiny-llama3")),
    Family("qwen2", "qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias="always", output_bias=False,
           sliding_window="use_sliding_window",
           tiny=ModelConfig(**{**_BASE, "n_layers": 3, "rope_base": 1e6, "norm_eps": 1e-6}, d_model=96, n_heads=6,
                            n_kv_heads=2, d_head=16, d_ff=160, tie_embeddings=True, attention_bias=True,
                            name="tiny-qwen2")),
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True, default_head_dim=128,
           sliding_window="use_sliding_window",
           tiny=ModelConfig(**{**_BASE, "rope_base": 1e6, "norm_eps": 1e-6}, d_model=64, n_heads=4, n_kv_heads=2,
                            d_head=32, d_ff=128, tie_embeddings=True, qk_norm=True, name="tiny-qwen3")),
    Family("mistral", "mistral", "MistralForCausalLM", "llama", gguf_rope_interleaved=True, qkv_bias="never",
           sliding_window="sliding_window",
           tiny=ModelConfig(**{**_BASE, "rope_base": 1e6}, d_model=64, n_heads=4, n_kv_heads=1, d_head=16,
                            d_ff=160, tie_embeddings=False, name="tiny-mistral")),
)}


def _first(key: str) -> dict[str, Family]:
    """Value of ``key`` -> the first family that has it (the entry that owns the name)."""
    table = {}
    for family in FAMILIES.values():
        table.setdefault(getattr(family, key), family)
    return table


_BY_MODEL_TYPE = _first("model_type")
_BY_HF_ARCHITECTURE = _first("hf_architecture")
_BY_GGUF = _first("gguf_architecture")


def hf_architectures() -> tuple[str, ...]:
    """The ``config.json`` architecture names refkv reads (``LlamaForCausalLM``, ...), in table order."""
    return tuple(_BY_HF_ARCHITECTURE)


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF ``general.architecture`` values refkv reads (``llama``, ``qwen2``, ``qwen3``)."""
    return tuple(_BY_GGUF)


def by_model_type(model_type, architectures=()) -> Family | None:
    """The family of a ``config.json``: by ``model_type``, else (``model_type`` absent) by the
    first known name in ``architectures``; None when neither is known."""
    if isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    known = [_BY_HF_ARCHITECTURE[a] for a in architectures if isinstance(a, str) and a in _BY_HF_ARCHITECTURE]
    return known[0] if model_type is None and known else None


def by_gguf_architecture(architecture) -> Family | None:
    """The family whose GGUF files carry ``general.architecture`` ``architecture``, or None."""
    return _BY_GGUF.get(architecture) if isinstance(architecture, str) else None


def family_config(family: str) -> ModelConfig:
    """The config of ``family``'s tiny model (a name in :data:`FAMILIES`)."""
    return FAMILIES[check_choice("family", family, tuple(FAMILIES))].tiny


def tiny(family: str, *, seed: int = 0, dtype="float64") -> Model:
    """The tiny model of ``family`` with seeded random weights (:func:`~refkv.model.random_weights`).

    Parameters
    ----------
    family : {"llama", "llama3", "qwen2", "qwen3", "mistral"}
    seed : int
        Seed of the weights; the same seed gives the same float64 values on every platform.
    dtype : "float32" or "float64"
    """
    cfg = family_config(family)
    seed = check_int("seed", seed, 0)
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = dtype
    check_choice("dtype", name, ("float32", "float64"))
    return Model(cfg, random_weights(cfg, seed=seed, dtype=name))
