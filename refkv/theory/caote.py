"""CAOTE (Goel et al., "CAOTE: KV Caching through Attention Output-Based Token Eviction").

:func:`attention_output` (Eqs. 10-11), :func:`attention_after_eviction` (Thm 3.1: softmax
recomputed without token ``j``), :func:`eviction_errors` (Eq. 9: ``||X_attn - X'_attn,j||`` by
recomputing attention), :func:`attention_only_logits` (App. B.2 case 1: a one-layer decoder
without norms). Tests: ``tests/theory/test_theory_caote.py``; page: ``docs/theory/caote.rst``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._checks import _matrix, _norm, _softmax, _subset, _vector, check_int

__all__ = [
    "AttentionOnlyOutput",
    "attention_after_eviction",
    "attention_only_logits",
    "attention_output",
    "eviction_errors",
]


def attention_output(logits, values, keep=None) -> np.ndarray:
    """Attention output of one query: ``softmax(logits[keep]) @ values[keep]``.

    Parameters
    ----------
    logits : (n,) array
        The query's attention logits over the ``n`` cached tokens.
    values : (n, d) array
    keep : sequence of int, optional
        Tokens that remain; default all. The softmax is recomputed over them alone, which
        is what a cache without the other tokens would do.

    Returns
    -------
    (d,) array: CAOTE Eq. 10 (``keep`` = all) or Eq. 11 (``keep`` = all but ``j``).
    """
    logits = _vector("logits", logits)
    values = _matrix("values", values)
    if values.shape[0] != logits.shape[0]:
        raise ValueError(f"values must have {logits.shape[0]} rows (one per logit), got {values.shape[0]}")
    if keep is None:
        return _softmax(logits) @ values
    idx = _subset("keep", keep, logits.shape[0])
    if idx.size == 0:
        raise ValueError("keep must hold at least one token (attention over nothing is undefined)")
    return _softmax(logits[idx]) @ values[idx]


def attention_after_eviction(logits, j) -> np.ndarray:
    """Attention weights after token ``j`` leaves the cache, recomputed from the logits.

    CAOTE Thm 3.1 states that they equal ``a_i / (1 - a_j)`` with ``a = softmax(logits)``;
    this function does not use that formula: it takes the softmax of the remaining logits.

    Parameters
    ----------
    logits : (n,) array, n >= 2
    j : int
        The evicted token.

    Returns
    -------
    (n,) array with entry ``j`` set to 0 and the others summing to 1.
    """
    logits = _vector("logits", logits, min_len=2)
    j = check_int("j", j, 0, logits.shape[0] - 1)
    rest = np.delete(np.arange(logits.shape[0]), j)
    out = np.zeros_like(logits)
    out[rest] = _softmax(logits[rest])
    return out


def eviction_errors(logits, values) -> np.ndarray:
    """CAOTE Eq. 9 for every token: ``e_j = ||X_attn - X'_attn,j||_2``, by recomputation.

    ``X_attn`` is the attention output with all ``n`` tokens (Eq. 10), ``X'_attn,j`` the output
    of attention recomputed over the cache without token ``j`` (Eq. 11). Thm 3.2 claims
    ``e_j`` equals the closed-form CAOTE score (Eq. 8).

    Parameters
    ----------
    logits : (n,) array, n >= 2
        One query's logits over the cache (the last token's, during generation).
    values : (n, d) array

    Returns
    -------
    (n,) array of float

    Notes
    -----
    Recomputation subtracts two nearly equal vectors when ``a_j`` is tiny, so its absolute
    error is about ``eps * max_i ||v_i||`` whatever ``e_j`` is; compare against it with an
    absolute tolerance of that size. The norm is scaled by the largest entry, so values as
    small as 1e-300 do not underflow when squared.
    """
    logits = _vector("logits", logits, min_len=2)
    values = _matrix("values", values)
    n = logits.shape[0]
    full = attention_output(logits, values)
    return np.array([_norm(full - attention_output(logits, values, np.delete(np.arange(n), j)))
                     for j in range(n)], dtype=full.dtype)


class AttentionOnlyOutput(NamedTuple):
    """What :func:`attention_only_logits` returns (shapes for ``H`` query heads, ``Hkv`` KV heads).

    Attributes
    ----------
    logits : (vocab,)
        Logits of the last token.
    head_outputs : (H, d)
        The last token's per-head attention outputs ``X_A`` (before ``W_O``).
    weights : (H, m)
        The last token's attention weights over the ``m`` tokens it attended to.
    values : (Hkv, m, d)
        Their values.
    """

    logits: np.ndarray
    head_outputs: np.ndarray
    weights: np.ndarray
    values: np.ndarray


def attention_only_logits(model, tokens, evict: int | None = None) -> AttentionOnlyOutput:
    """Last-token logits of a one-layer decoder *without norms and without MLP* (CAOTE App. B.2).

    Built from refkv's decoder pieces: the model's embedding, its layer-0 projections
    ``W_Q, W_K, W_V, W_O``, RoPE (:meth:`refkv.model.Model.rope`), causal attention
    (:func:`refkv.attention.attend`) and the LM head ``W_H`` (tied embedding or
    ``lm_head``). The RMSNorms and the MLP are skipped, which is the paper's case 1
    (one head) and case 2 (several heads):

    .. math:: l_{b+1} = W_H \\left(x_{b+1} + W_O X_{A,b+1}\\right)

    (written here with row vectors: ``(x + o W_O) W_H``).

    Parameters
    ----------
    model : refkv.model.Model
        Must have ``n_layers == 1``.
    tokens : sequence of int
        The ``b + 1`` tokens; the last one is the query.
    evict : int, optional
        Column removed from every KV head's cache before the last token attends (it may be
        the last token itself). ``None`` attends to all ``b + 1``.

    Returns
    -------
    AttentionOnlyOutput
    """
    from ..attention import attend
    from ..model.decoder import _split_heads  # (T, heads * d) -> (heads, T, d), as the decoder does
    from ..model.layers import apply_rope

    cfg = model.config
    if cfg.n_layers != 1:
        raise ValueError(f"model must have exactly one layer (CAOTE App. B.2 case 1/2), got n_layers={cfg.n_layers}")
    tokens = model.check_tokens(tokens)
    t = len(tokens)
    positions = np.arange(t, dtype=np.int64)
    lw = model.weights.layers[0]
    x = model.embed(tokens)  # no attention norm: the paper ignores layer norms
    cos, sin = model.rope(positions)

    q = apply_rope(_split_heads(x @ lw.wq, cfg.n_heads), cos, sin)  # (H, T, d)
    k = apply_rope(_split_heads(x @ lw.wk, cfg.n_kv_heads), cos, sin)  # (Hkv, T, d)
    v = _split_heads(x @ lw.wv, cfg.n_kv_heads)  # (Hkv, T, d)
    keep = np.arange(t)
    if evict is not None:
        keep = np.delete(keep, check_int("evict", evict, 0, t - 1))
    k_pos = np.broadcast_to(positions[keep], (cfg.n_kv_heads, keep.size))
    out, weights = attend(q[:, -1:], k[:, keep], v[:, keep], positions[-1:], k_pos, return_weights=True)
    w_h = model.weights.embed.T if model.weights.lm_head is None else model.weights.lm_head
    logits = (x[-1:] + model.attn_out(0, out)) @ w_h  # no final norm either
    return AttentionOnlyOutput(logits[0], out[:, 0], weights.reshape(cfg.n_heads, keep.size), v[:, keep])
