"""Causal grouped-query attention of a block's queries over cache + block.

Three routes give the same output:

* :func:`attention_weights` forms the full weight matrix ``A`` (KeyDiff Eq. 2), and
  :func:`attend` with ``return_weights`` returns it beside the output: the definition,
  which policies that read ``A`` see in the oracle's replay.
* :func:`attend` without ``return_weights`` walks the queries in tiles of
  ``query_chunk`` and, for each, the keys it can see in chunks of ``key_chunk``, with the
  online softmax recurrence of FlashAttention; so no more than a ``(query_chunk,
  key_chunk)`` tile of weights per head ever exists and key chunks wholly in a tile's
  future are skipped. This is how attention-free policies (KeyDiff, L2, sink,
  HashEvict) are shown to run without ``A``: the engine counts every call that forms
  weights. A single query (``B = 1``, decoding) takes a shorter road to the same
  result: its weights are one row of ``n`` numbers per head, so each query head meets
  its KV head's keys and values in two matrix-vector products, with no tiles.
* :func:`attend_summary` computes, beside the output, only what of ``A`` a policy reads
  (:class:`AttentionNeed`: the last rows, the column sums over all queries), one query
  tile at a time, so a one-shot prefill of ``T`` tokens holds ``O(T x query_chunk)``
  weights per head instead of ``T x T``.

Shapes: ``H`` query heads, ``Hkv`` KV heads, ``g = H / Hkv`` queries per KV head,
``B`` queries in the block, ``n`` keys (cache + block), ``d`` head width. The causal
mask is built from positions, not from indices, because after eviction each KV head
holds its own set of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .validation import check_int

__all__ = ["DEFAULT_KEY_CHUNK", "DEFAULT_QUERY_CHUNK", "AttentionNeed", "AttentionSummary", "NonFiniteError",
           "attend", "attend_summary", "attention_weights", "causal_logits", "softmax"]

#: Keys per tile of the online-softmax route: large enough that NumPy's per-call
#: overhead is amortised and a 2K-token prompt needs no rescaling between chunks, small
#: enough that a (Hkv, g, 64, 2048) tile of logits (4.5 MiB on SmolLM2) stays in the
#: last-level cache.
DEFAULT_KEY_CHUNK = 2048
#: Queries per tile of the tiled routes. A one-shot prefill of ``T`` tokens is walked as
#: ``T / 64`` tiles, each over the keys it can see: the arithmetic of blocks of 64,
#: without their per-block projections. With all ``T`` queries in one tile, a (Hkv, g,
#: T, key_chunk) tile of logits (150 MB at 4K tokens on SmolLM2) left the cache at every
#: pass and one-shot prefill ran at about half the speed of blocks of 128. Tiles of 64
#: queries and chunks of 2,048 keys took 0.90 of the attention time of tiles of 128 and
#: chunks of 1,024 in a one-shot prefill of 2K tokens (0.93 in blocks of 128): half the
#: masked square on each tile's diagonal, and no second key chunk.
DEFAULT_QUERY_CHUNK = 64
#: log2(e): the tiled routes take the softmax in base 2 (see :func:`_attend`).
LOG2_E = float(np.log2(np.e))


@dataclass(frozen=True)
class AttentionNeed:
    """What of a block's attention weights ``A`` (Hkv, g, B, n) a policy reads.

    A policy declares it (:meth:`refkv.policies.Policy.attention_need`) so that the engine
    computes only that, one query tile at a time (:func:`attend_summary`), instead of the
    ``B x n`` matrix per head: the difference between ``O(T^2)`` and ``O(T x tile)``
    memory in one-shot prefill.

    Attributes
    ----------
    rows : int or None, default None
        The last ``min(rows, B)`` query rows of ``A`` (TOVA: 1, SnapKV: its window,
        Scissorhands: its history); ``0``: none. ``None``: every row, the whole matrix.
    column_sums : bool, default False
        ``A.sum(axis=-2)``, (Hkv, g, n): the weight each key received from all ``B``
        queries (H2O's accumulator).
    """

    rows: int | None = None
    column_sums: bool = False

    def __post_init__(self):
        if self.rows is not None:
            check_int("rows", self.rows, 0)
        if not isinstance(self.column_sums, (bool, np.bool_)):
            raise ValueError(f"column_sums must be True or False, got {self.column_sums!r}")

    @property
    def whole(self) -> bool:
        """True if the need is the whole matrix (``rows is None``)."""
        return self.rows is None


@dataclass(frozen=True)
class AttentionSummary:
    """The parts of ``A`` that :func:`attend_summary` computed for an :class:`AttentionNeed`.

    Attributes
    ----------
    rows : (Hkv, g, r, n) or None
        The last ``r = min(need.rows, B)`` query rows of ``A`` (all ``B`` for a whole
        need; ``None`` when ``r = 0``): the weights of queries ``B - r .. B - 1``, zero on
        keys in their future.
    column_sums : (Hkv, g, n) or None
        ``A.sum(axis=-2)``, when the need asked for it.
    """

    rows: np.ndarray | None = None
    column_sums: np.ndarray | None = None


class NonFiniteError(ValueError):
    """NaN or infinity where a finite number is required (attention inputs or outputs,
    hidden states, logits). A ``ValueError``, so the command reports it in one line; the
    engine adds the layer it happened in."""


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax (the maximum is subtracted before ``exp``)."""
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def causal_logits(q: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """Scaled logits ``q k^T / sqrt(d)`` with ``-inf`` where a key is in a query's future.

    Parameters
    ----------
    q : (H, B, d) block queries
    k : (Hkv, n, d) keys
    q_pos : (B,) positions of the queries
    k_pos : (Hkv, n) positions of the keys

    Returns
    -------
    (Hkv, g, B, n) array
    """
    # The scale goes on the queries, (H, B, d), not on the (Hkv, g, B, n) logits: one pass
    # over a small array instead of the largest one. For d = 64 or 256 the scale is a power
    # of two and the logits are the same to the bit.
    return _masked_logits(q * (1.0 / float(np.sqrt(k.shape[-1]))), k, q_pos, k_pos)


def _masked_logits(q_scaled: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """``q_scaled k^T``, (Hkv, g, B, n), with ``-inf`` where a key is in a query's future:
    :func:`causal_logits` with the scale already on the queries (H, B, d)."""
    n_kv, n, d = k.shape
    qg = _group(q_scaled, n_kv)
    g, b = qg.shape[1], qg.shape[2]
    # The g query heads of a KV head, stacked, meet its keys in one product: (Hkv, g B, d) @
    # (Hkv, d, n). Broadcasting k over g instead would pack every key tile g times.
    logits = (qg.reshape(n_kv, g * b, d) @ k.swapaxes(-1, -2)).reshape(n_kv, g, b, n)
    # Only keys later than the earliest query can be in some query's future, so the mask
    # starts at the first such column (in the engine: the block's own keys).
    late = (k_pos > q_pos.min()).any(axis=0) if b else np.zeros(n, dtype=bool)
    if late.any():
        lo = int(np.argmax(late))
        future = k_pos[:, None, None, lo:] > q_pos[None, None, :, None]  # (Hkv, 1, B, n - lo)
        np.copyto(logits[..., lo:], -np.inf, where=future)
    return logits


def attention_weights(q, k, q_pos, k_pos) -> np.ndarray:
    """The attention weights ``A`` (Hkv, g, B, n); rows sum to 1 over visible keys."""
    a = causal_logits(q, k, q_pos, k_pos)
    # softmax(a), in place: the operations of softmax() without its three extra
    # (Hkv, g, B, n) temporaries (a quarter of the peak memory).
    a -= a.max(axis=-1, keepdims=True)
    np.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    return a


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, *,
           return_weights: bool = False, key_chunk: int = DEFAULT_KEY_CHUNK,
           query_chunk: int = DEFAULT_QUERY_CHUNK):
    """Attention outputs of the block's queries, and the weights only if asked for.

    Parameters
    ----------
    q : (H, B, d)
    k, v : (Hkv, n, d)
    q_pos : (B,)
    k_pos : (Hkv, n)
    return_weights : bool
        If true, materialise and return ``A`` (Hkv, g, B, n).
    key_chunk, query_chunk : int
        Tile sizes of the online-softmax route (ignored when ``return_weights``).

    Returns
    -------
    out : (H, B, d)
    weights : (Hkv, g, B, n) or None

    Raises
    ------
    NonFiniteError
        If the output holds NaN or inf, naming the input (``q``, ``k`` or ``v``) that does;
        a non-finite key or value that no query can see changes nothing and is let pass.
    ValueError
        If ``key_chunk`` or ``query_chunk`` is not an integer >= 1.
    """
    check_int("key_chunk", key_chunk, 1)
    check_int("query_chunk", query_chunk, 1)
    if return_weights:
        out, weights = _attend(q, k, v, q_pos, k_pos, True, key_chunk)
    else:
        out, weights = _tiled(q, k, v, q_pos, k_pos, 0, False, key_chunk, query_chunk)[0], None
    if not np.isfinite(out).all():  # (H, B, d): cheap next to the attention itself
        _explain_non_finite(q, k, v)
    return out, weights


def attend_summary(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                   need: AttentionNeed, *, key_chunk: int = DEFAULT_KEY_CHUNK,
                   query_chunk: int = DEFAULT_QUERY_CHUNK) -> tuple[np.ndarray, AttentionSummary]:
    """Attention outputs and only the parts of the weights ``A`` that ``need`` names.

    The queries are walked in tiles of ``query_chunk``, each over the keys it can see
    (keys in the future of every query of a tile are never touched). A tile that holds
    one of the needed rows, or any tile when column sums are needed, forms its own
    (Hkv, g, query_chunk, n) weights exactly as :func:`attention_weights` does, adds their
    column sums and copies the needed rows out; the other tiles run the online softmax of
    :func:`attend`. So the weights held at once are ``O(query_chunk x n)`` per head, plus
    the ``rows x n`` of the result, never ``B x n``. Each row of ``A`` is a softmax over
    the same logits as in :func:`attention_weights`; only the rounding of the products and
    sums may differ (the products have other shapes), by a few units in the last place.

    Parameters
    ----------
    q, k, v, q_pos, k_pos
        As in :func:`attend`.
    need : AttentionNeed
        What to compute besides the output.
    key_chunk, query_chunk : int
        Tile sizes.

    Returns
    -------
    out : (H, B, d)
    summary : AttentionSummary
        ``rows`` (Hkv, g, min(need.rows, B), n), all ``B`` rows if ``need.whole``;
        ``column_sums`` (Hkv, g, n) if ``need.column_sums``.

    Raises
    ------
    NonFiniteError, ValueError
        As :func:`attend`; ``ValueError`` also if ``need`` is not an :class:`AttentionNeed`.
    """
    check_int("key_chunk", key_chunk, 1)
    check_int("query_chunk", query_chunk, 1)
    if not isinstance(need, AttentionNeed):
        raise ValueError(f"need must be an AttentionNeed, got {type(need).__name__}")
    b = q.shape[1]
    rows = b if need.whole else min(need.rows, b)
    out, kept, sums = _tiled(q, k, v, q_pos, k_pos, rows, bool(need.column_sums), key_chunk, query_chunk)
    if not np.isfinite(out).all():
        _explain_non_finite(q, k, v)
    return out, AttentionSummary(rows=kept, column_sums=sums)


def _explain_non_finite(q, k, v) -> None:
    """Raise :class:`NonFiniteError` saying which input made the attention output non-finite.

    Only reached when the output is already non-finite, so a NaN in a key no query may
    see (masked, hence harmless) never raises.
    """
    for name, array in (("q", q), ("k", k), ("v", v)):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        if bad:
            raise NonFiniteError(f"attention input {name} has {bad} non-finite value(s) (NaN or inf)")
    raise NonFiniteError(f"attention output is non-finite although q, k and v are finite: q.k overflows "
                         f"{np.result_type(q, k)}, or a query sees no key")


def _attend(q, k, v, q_pos, k_pos, return_weights: bool, key_chunk: int):
    """The weights route and the online-softmax route of one query tile (arguments as in
    :func:`attend`, already checked)."""
    n = k.shape[1]
    heads, b, d = q.shape
    if b == 1 and not return_weights:
        return _attend_one_query(q, k, v, q_pos, k_pos), None
    # Both routes take the softmax in base 2: softmax(x) = 2^(x log2(e) - max) / sum, with
    # log2(e) folded into the query scale (a pass over (H, B, d), not over the logits) and
    # exp2 for exp. NumPy's float32 exp2 takes half the time of its exp, and the
    # exponential is the costliest elementwise pass of a layer (FlashAttention-2 does the
    # same). The weights are those of attention_weights() up to the last bits.
    q_scaled = q * (LOG2_E / float(np.sqrt(d)))  # (H, B, d)
    if return_weights:
        logits = _masked_logits(q_scaled, k, q_pos, k_pos)  # (Hkv, g, B, n), in units of log2
        logits -= logits.max(axis=-1, keepdims=True)
        p = np.exp2(logits, out=logits)
        total = _row_sums(p)  # (Hkv, g, B, 1)
        out = _weighted_values(p, v) / total  # (Hkv, g, B, d)
        p /= total
        return out.reshape(heads, b, d), p  # (H, B, d), (Hkv, g, B, n)

    # Online softmax (FlashAttention): keep a running max m, normaliser l and
    # unnormalised output acc, (Hkv, g, B, 1), (Hkv, g, B, 1) and (Hkv, g, B, d); rescale
    # them by 2^(m_old - m_new) as each chunk of keys arrives. The first chunk has nothing
    # to rescale, so a single chunk performs exactly the operations of the branch above.
    m = l = acc = None
    for start in range(0, n, key_chunk):
        stop = min(start + key_chunk, n)
        s = _masked_logits(q_scaled, k[:, start:stop], q_pos, k_pos[:, start:stop])  # (Hkv, g, B, c), log2 units
        m_new = s.max(axis=-1, keepdims=True) if m is None else np.maximum(m, s.max(axis=-1, keepdims=True))
        # A row whose keys so far are all in its future has m_new = -inf; keep it at 0.
        safe = np.where(np.isfinite(m_new), m_new, 0.0)
        s -= safe
        p = np.exp2(s, out=s)
        if m is None:
            l, acc = _row_sums(p), _weighted_values(p, v[:, start:stop])
        else:
            correction = np.exp2(m - safe)
            l = l * correction + _row_sums(p)
            acc = acc * correction + _weighted_values(p, v[:, start:stop])  # (Hkv, g, B, d)
        m = m_new
    if acc is None:  # no keys at all: 0 / 0, as a row that sees no key (attend reports it)
        return np.full((heads, b, d), np.nan, dtype=np.result_type(q, v)), None
    return (acc / l).reshape(heads, b, d), None  # (H, B, d)


def _tiled(q, k, v, q_pos, k_pos, rows: int, column_sums: bool, key_chunk: int, query_chunk: int):
    """The query-tiled walk of :func:`attend` and :func:`attend_summary` (arguments checked).

    Returns ``out`` (H, B, d), the last ``rows`` rows of ``A`` (Hkv, g, rows, n) or None, and
    the column sums of ``A`` (Hkv, g, n) or None.
    """
    n_kv, n, d = k.shape
    heads, b, _ = q.shape
    if b == 1 and not rows and not column_sums:
        return _attend_one_query(q, k, v, q_pos, k_pos), None, None
    g = _group(q, n_kv).shape[1]
    weight_dtype = np.result_type(q, k)  # the dtype of causal_logits, hence of A
    out = np.empty((heads, b, d), dtype=np.result_type(q, k, v))
    first = b - rows  # the first query whose row of A is returned
    kept = np.zeros((n_kv, g, rows, n), dtype=weight_dtype) if rows else None
    sums = np.zeros((n_kv, g, n), dtype=weight_dtype) if column_sums else None
    for start in range(0, b, query_chunk):
        stop = min(start + query_chunk, b)
        tile_pos = q_pos[start:stop]
        # Keys after the last one any query of the tile sees, in any head, are all masked:
        # their tiles would add exp(-inf) = 0 and leave max and sums as they are.
        seen = (k_pos <= tile_pos.max()).any(axis=0)  # (n,)
        # (at least one key, so a tile that sees none still ends in NonFiniteError, as before)
        visible = max(int(n - np.argmax(seen[::-1])) if seen.any() else 0, min(n, 1))
        keys, values, key_pos = k[:, :visible], v[:, :visible], k_pos[:, :visible]
        if column_sums or stop > first:
            o, p = _attend(q[:, start:stop], keys, values, tile_pos, key_pos, True, key_chunk)
            if column_sums:
                sums[..., :visible] += p.sum(axis=-2)  # (Hkv, g, visible)
            if stop > first:
                lo = max(first, start)
                kept[:, :, lo - first:stop - first, :visible] = p[:, :, lo - start:]
        else:
            o, _ = _attend(q[:, start:stop], keys, values, tile_pos, key_pos, False, key_chunk)
        out[:, start:stop] = o
    return out, kept, sums


def _attend_one_query(q, k, v, q_pos, k_pos) -> np.ndarray:
    """One query per head (decoding): ``softmax(K q / sqrt(d)) V`` for each query head,
    in two matrix-vector products over its KV head's whole row, with no key tiles.
    (H, 1, d) -> (H, 1, d).

    Decoding reads the whole cache for one token, so it is bound by memory traffic. The
    tiled route spends about twenty NumPy calls per tile of 1,024 keys and a (g, d) @
    (d, n) product runs below the rate of a matrix-vector one at these shapes; over 30
    layers of 3 KV heads with cold caches this route took 26 ms per token at 2K keys and
    83 ms at 8K, against 32 and 115 ms for the tiled one (``bench/decoder.py`` has the
    model-level figures).
    """
    n_kv, _, d = k.shape
    heads = q.shape[0]
    g = _group(q, n_kv).shape[1]
    scaled = q[:, 0] * (1.0 / float(np.sqrt(d)))  # (H, d), the scale on the query as in causal_logits
    future = k_pos > q_pos[0]  # (Hkv, n): keys after the query (none when decoding)
    masked = bool(future.any())
    out = np.empty((heads, 1, d), dtype=np.result_type(q, k, v))
    for h in range(heads):
        s = k[h // g] @ scaled[h]  # (n, d) @ (d,) -> (n,): the logits of query head h
        if masked:
            s[future[h // g]] = -np.inf
        s -= s.max()
        np.exp(s, out=s)
        out[h, 0] = (v[h // g].T @ s) / s.sum()  # (d, n) @ (n,) -> (d,)
    return out


def _weighted_values(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p @ v`` per KV head with the group's rows stacked: (Hkv, g, B, n) x (Hkv, n, d) ->
    (Hkv, g, B, d), as one (g B, n) @ (n, d) product per KV head (see :func:`causal_logits`)."""
    n_kv, g, b, n = p.shape
    return (p.reshape(n_kv, g * b, n) @ v).reshape(n_kv, g, b, v.shape[-1])


def _row_sums(p: np.ndarray) -> np.ndarray:
    """``p.sum(axis=-1, keepdims=True)`` of (Hkv, g, B, n) weights, (Hkv, g, B, 1), as one
    (g B, n) @ (n,) product with ones per KV head: BLAS reads the tile about three times as
    fast as NumPy's pairwise summation (the order of the additions differs, so the last
    bits may)."""
    n_kv, g, b, n = p.shape
    return (p.reshape(n_kv, g * b, n) @ np.ones(n, dtype=p.dtype)).reshape(n_kv, g, b, 1)


def _group(q: np.ndarray, n_kv: int) -> np.ndarray:
    """(H, B, d) -> (Hkv, g, B, d): query head ``h`` belongs to KV head ``h // g``."""
    heads, b, d = q.shape
    if heads % n_kv:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({n_kv})")
    return q.reshape(n_kv, heads // n_kv, b, d)
