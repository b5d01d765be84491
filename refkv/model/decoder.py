"""A Llama-family decoder in NumPy, split into the pieces the cached engine reuses.

The same code runs every family of :mod:`refkv.model.families` (Llama 2, Llama 3 with RoPE
scaling, Qwen2/2.5 with q/k/v biases, Qwen3 with per-head q/k RMSNorm, Mistral): it reads
only config flags, which each family's table entry sets, never a family's name. Each
variant is one flag and a few lines in :meth:`Model.qkv`, :meth:`Model.attn_out` or
:mod:`refkv.model.layers`.

:meth:`Model.forward_full` runs the whole sequence with plain causal attention and no
cache. It is deliberately written independently of :mod:`refkv.attention` and
:mod:`refkv.engine` (its own mask, ``scipy.special.softmax``, ``np.repeat`` for GQA),
so that it is an oracle the cached block path must match, not a copy of it.
"""

from __future__ import annotations

import numpy as np
from scipy.special import softmax

from .config import ModelConfig
from .layers import apply_rope, gated_silu, rms_norm, rope_angles, rope_frequencies_of
from .weights import ModelWeights, pack_projections

__all__ = ["Model"]


class Model:
    """A decoder: a config, its weights, and the forward pieces.

    Parameters
    ----------
    config : ModelConfig
    weights : ModelWeights
        Validated against ``config`` (shapes, one float dtype, all finite).

    Notes
    -----
    Shapes use ``T`` for tokens in the call, ``H`` query heads, ``Hkv`` KV heads and
    ``d`` the head width. Heads come first in attention tensors: ``(H, T, d)``.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights):
        weights.validate(config)
        self.config = config
        # One matrix for q/k/v and one for gate/up per layer (fewer, larger GEMMs); the
        # weights' own wq, ..., w_up become views of them, so nothing is held twice.
        self.weights, self.packed = pack_projections(weights)
        self._inv_freq = rope_frequencies_of(config)  # (d_head / 2,) float64, any RoPE scaling applied

    @property
    def dtype(self) -> np.dtype:
        return self.weights.dtype

    def __repr__(self) -> str:
        return f"Model({self.config.name!r}, layers={self.config.n_layers}, dtype={self.dtype})"

    # -- input -----------------------------------------------------------------------
    def check_tokens(self, tokens) -> np.ndarray:
        """Validate token ids and return them as a 1-D int64 array."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be a 1-D sequence of ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError("tokens must not be empty (need at least 1 token)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"tokens must be in [0, {self.config.vocab_size - 1}] (vocab_size="
                             f"{self.config.vocab_size}), got {int(arr[bad][0])}")
        return arr.astype(np.int64)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Token embeddings, (T, d_model)."""
        return self.weights.embed[tokens]

    # -- attention pieces ---------------------------------------------------------------
    def rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """RoPE cos/sin tables for ``positions`` (computed once per block, shared by layers)."""
        cfg = self.config
        return rope_angles(positions, cfg.d_head, cfg.rope_base, self.dtype, inv_freq=self._inv_freq)

    def qkv(self, layer: int, x: np.ndarray, rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Normalise the residual ``x`` (T, d_model) and project to RoPE'd q, k and v.

        In order: RMSNorm, the three projections, their biases (``config.attention_bias``),
        the split into heads, the per-head q/k RMSNorm (``config.qk_norm``), RoPE on q and k.

        Returns
        -------
        q : (H, T, d)
        k : (Hkv, T, d)
            After RoPE at the tokens' own positions.
        v : (Hkv, T, d)
        """
        cfg, lw = self.config, self.weights.layers[layer]
        h = rms_norm(x, lw.attn_norm, cfg.norm_eps)
        cos, sin = rope
        packed = self.packed[layer]
        q, k, v = np.split(h @ packed.qkv, packed.qkv_splits, axis=1)  # one GEMM: h @ [wq | wk | wv]
        if cfg.attention_bias:  # e.g. Qwen2/2.5 (families.Family.qkv_bias): right after the projections
            q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
        q, k, v = _split_heads(q, cfg.n_heads), _split_heads(k, cfg.n_kv_heads), _split_heads(v, cfg.n_kv_heads)
        if cfg.qk_norm:  # e.g. Qwen3: RMSNorm over each head's d values of q and k, right before RoPE
            q, k = rms_norm(q, lw.q_norm, cfg.norm_eps), rms_norm(k, lw.k_norm, cfg.norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v  # (H, T, d), (Hkv, T, d), (Hkv, T, d)

    def attn_out(self, layer: int, o: np.ndarray) -> np.ndarray:
        """Output projection of per-head attention outputs ``o`` (H, T, d) -> (T, d_model)."""
        heads, t, d = o.shape
        lw = self.weights.layers[layer]
        out = o.transpose(1, 0, 2).reshape(t, heads * d) @ lw.wo
        if self.config.output_bias:  # e.g. Llama / Qwen3 with attention_bias (families.Family.output_bias)
            out = out + lw.bo
        return out

    def mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The MLP branch (RMSNorm then SwiGLU) of the residual ``x`` (T, d_model).

        SwiGLU ``(silu(h W_gate) * (h W_up)) W_down`` as :func:`refkv.model.layers.swiglu`,
        with ``h W_gate`` and ``h W_up`` from one GEMM on ``[W_gate | W_up]`` and the
        activation in row blocks (:func:`refkv.model.layers.gated_silu`).
        """
        lw = self.weights.layers[layer]
        h = rms_norm(x, lw.mlp_norm, self.config.norm_eps)
        hidden = gated_silu(h @ self.packed[layer].gate_up)  # (T, 2 d_ff) -> (T, d_ff)
        return hidden @ lw.w_down

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm and LM head: residual (T, d_model) -> logits (T, vocab)."""
        w = self.weights
        h = rms_norm(x, w.final_norm, self.config.norm_eps)
        return h @ (w.embed.T if w.lm_head is None else w.lm_head)

    # -- the oracle -------------------------------------------------------------------
    def forward_full(self, tokens) -> np.ndarray:
        """Logits (T, vocab) of every position, recomputed from scratch with no cache."""
        tokens = self.check_tokens(tokens)
        cfg = self.config
        t = len(tokens)
        rope = self.rope(np.arange(t))
        future = np.triu(np.ones((t, t), dtype=bool), k=1)
        scale = 1.0 / float(np.sqrt(cfg.d_head))
        x = self.embed(tokens)
        for layer in range(cfg.n_layers):
            q, k, v = self.qkv(layer, x, rope)
            k = np.repeat(k, cfg.group_size, axis=0)  # (H, T, d): each KV head serves its group
            v = np.repeat(v, cfg.group_size, axis=0)
            logits = (q @ k.transpose(0, 2, 1)) * scale
            logits[:, future] = -np.inf
            x = x + self.attn_out(layer, softmax(logits, axis=-1) @ v)
            x = x + self.mlp(layer, x)
        return self.head(x)


def _split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(T, heads * d) -> (heads, T, d)."""
    t = x.shape[0]
    return x.reshape(t, heads, -1).transpose(1, 0, 2)
