"""Tiny random models of the architecture families refkv runs: Llama 2, Llama 3, Qwen2, Qwen3.

Each switches on its family's features at a size that runs in milliseconds, so that tests,
end-to-end goldens and backends can check an architecture without a checkpoint:

========  =======================================================================
family    features (beyond Llama 2's RMSNorm, RoPE, GQA, SwiGLU)
========  =======================================================================
llama     none: the Llama 2 decoder, tied head
llama3    Llama 3.1 RoPE scaling (factor 8, low/high frequency factors 1 and 4) with an
          original context of 32 tokens, so that prompts longer than 32 cross every band;
          RoPE base 500000; GQA group 4; untied LM head
qwen2     q/k/v biases (no output bias); RoPE base 10**6; RMSNorm eps 1e-6
qwen3     per-head RMSNorm of q and k before RoPE; ``d_head`` (32) twice
          ``d_model / n_heads`` (16); RoPE base 10**6; RMSNorm eps 1e-6
========  =======================================================================

``tests/model/test_conformance_families.py`` checks each against transformers' own
implementation of the family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``).
"""

from __future__ import annotations

import numpy as np

from ..validation import check_choice, check_int
from .config import ModelConfig
from .decoder import Model
from .weights import random_weights

__all__ = ["FAMILIES", "family_config", "tiny"]

_BASE = dict(vocab_size=320, n_layers=2, max_positions=256, norm_eps=1e-5, rope_base=10000.0)

#: Family name -> config of its tiny model.
FAMILIES: dict[str, ModelConfig] = {
    "llama": ModelConfig(**_BASE, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                         tie_embeddings=True, name="tiny-llama"),
    "llama3": ModelConfig(**{**_BASE, "rope_base": 500000.0}, d_model=128, n_heads=4, n_kv_heads=1, d_head=32,
                          d_ff=192, tie_embeddings=False, rope_type="llama3", rope_factor=8.0,
                          rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_context=32,
                          name="tiny-llama3"),
    "qwen2": ModelConfig(**{**_BASE, "n_layers": 3, "rope_base": 1e6, "norm_eps": 1e-6}, d_model=96, n_heads=6,
                         n_kv_heads=2, d_head=16, d_ff=160, tie_embeddings=True, attention_bias=True,
                         name="tiny-qwen2"),
    "qwen3": ModelConfig(**{**_BASE, "rope_base": 1e6, "norm_eps": 1e-6}, d_model=64, n_heads=4, n_kv_heads=2,
                         d_head=32, d_ff=128, tie_embeddings=True, qk_norm=True, name="tiny-qwen3"),
}


def family_config(family: str) -> ModelConfig:
    """The config of ``family``'s tiny model (one of :data:`FAMILIES`)."""
    return FAMILIES[check_choice("family", family, tuple(FAMILIES))]


def tiny(family: str, *, seed: int = 0, dtype="float64") -> Model:
    """The tiny model of ``family`` with seeded random weights (:func:`~refkv.model.random_weights`).

    Parameters
    ----------
    family : {"llama", "llama3", "qwen2", "qwen3"}
    seed : int
        Seed of the weights; the same seed gives the same float64 values on every platform.
    dtype : "float64" or "float32"
    """
    cfg = family_config(family)
    seed = check_int("seed", seed, 0)
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = dtype
    check_choice("dtype", name, ("float32", "float64"))
    return Model(cfg, random_weights(cfg, seed=seed, dtype=name))
