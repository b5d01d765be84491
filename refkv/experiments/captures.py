"""Dense captures: every layer's queries, keys and values of a prompt run without eviction.

:func:`dense_capture` runs the model with no cache limit and keeps every layer's RoPE'd
queries, keys and values. It is the same computation as
:meth:`refkv.model.Model.forward_full` (a test checks the logits agree); the attention
route is :func:`refkv.attention.attend` without weights, so nothing of size ``T x T`` is
kept. Experiments form attention weights per layer when they need them
(:func:`layer_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..attention import attend, attention_weights
from .models import load_model
from .text import cell_tokens

__all__ = ["LayerCapture", "cached_capture", "dense_capture", "layer_attention"]


@dataclass(frozen=True)
class LayerCapture:
    """One layer's RoPE'd queries ``q`` (H, T, d), keys ``k`` and values ``v`` (Hkv, T, d)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


def dense_capture(model, tokens) -> tuple[list[LayerCapture], np.ndarray]:
    """Run ``tokens`` with no eviction; every layer's q, k, v and the last logits."""
    tokens = model.check_tokens(tokens)
    positions = np.arange(len(tokens), dtype=np.int64)
    rope = model.rope(positions)
    key_positions = np.broadcast_to(positions, (model.config.n_kv_heads, len(tokens)))
    x = model.embed(tokens)
    layers = []
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, x, rope)
        out, _ = attend(q, k, v, positions, key_positions)
        layers.append(LayerCapture(q, k, v))
        x = x + model.attn_out(layer, out)
        x = x + model.mlp(layer, x)
    return layers, model.head(x[-1:])[0]


_CAPTURES: dict[tuple, tuple] = {}


def cached_capture(model_name: str, dtype: str, length: int, segment: int, source: str = "pydoc_prose",
                   text_length: int | None = None):
    """:func:`dense_capture` of a cell's prompt (:func:`cell_tokens`: the first ``length``
    tokens of segment ``segment`` of ``source`` counted in texts of ``text_length``, default
    ``length``), kept per process.

    One capture is kept at a time (the real model's is ~100 MB for 1K tokens); cells of
    the same prompt that run one after the other in a process share it.
    """
    key = (model_name, dtype, length, segment, source, text_length)
    if key not in _CAPTURES:
        model, _ = load_model(model_name, dtype)
        _CAPTURES.clear()
        tokens = cell_tokens({"model": model_name, "dtype": dtype, "length": length, "segment": segment,
                              "text": source, "text_length": text_length})
        _CAPTURES[key] = dense_capture(model, tokens)
    return _CAPTURES[key]


def layer_attention(params: dict):
    """A cell's model and, layer by layer, its dense capture and causal attention weights.

    Reads ``params["model"]``, ``"dtype"``, ``"length"`` (``T``), ``"segment"`` and, where
    given, ``"text"`` and ``"text_length"`` (:func:`cell_tokens`). Returns
    ``(model, layers)`` where ``layers`` yields ``(layer, capture, weights)`` with ``weights``
    the (Hkv, g, T, T) attention of every query over the prompt, formed one layer at a time.
    """
    model, _ = load_model(params["model"], params["dtype"])
    captures, _ = cached_capture(params["model"], params["dtype"], params["length"], params["segment"],
                                 params.get("text", "pydoc_prose"), params.get("text_length"))
    positions = np.arange(params["length"], dtype=np.int64)  # (T,)
    kv_positions = np.broadcast_to(positions, (model.config.n_kv_heads, len(positions)))  # (Hkv, T)

    def each():
        for layer, cap in enumerate(captures):
            yield layer, cap, attention_weights(cap.q, cap.k, positions, kv_positions)  # (Hkv, g, T, T)

    return model, each()
