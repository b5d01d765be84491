"""``hashevict``: evict, before attention, the keys whose SimHash is farthest from the query's.

HashEvict (Liu et al. 2024, "HashEvict: A Pre-Attention KV Cache Eviction Strategy using
Locality-Sensitive Hashing"). Keys are hashed once, when their token is processed, into
``c``-bit SimHash codes ``h(k) = H(R k)`` (Eq. 2, :mod:`refkv.lsh`) kept in a hash table
:math:`\\mathcal H` beside the cache (Eq. 4). At step ``t`` the incoming query is hashed and
every cached key is scored by minus the Hamming distance of the codes (Eq. 5),

.. math:: F_{score}(q, \\mathcal H) = -d_H(h(q), \\mathcal H),

and the key of lowest score, the one estimated to have the lowest cosine with the query
(Eq. 3), is evicted *before* the token attends (Eq. 6, Algorithm 1):

1. :math:`e_t \\leftarrow \\arg\\min F_{score}(q_t, \\mathcal H_{t-1})`;
2. delete entry :math:`e_t` of ``K``, ``V`` and :math:`\\mathcal H`;
3. append :math:`k_t, v_t, h(k_t)`; 4. attend over the updated cache.

The cache is first filled to ``N`` with the first tokens (the prompt encoding stage); the
first 4 and the most recent 10 tokens are always kept (Sec. 4, "Configuration and Setup").

Notes
-----
* **Engine mapping.** ``evict_before_attention = True``: the engine evicts the cache to
  ``N - B`` before appending a block of ``B``, so the block attends to at most ``N`` tokens.
  With ``B = 1`` this is Algorithm 1 step for step (tested against a literal simulation).
* **Query or key (default: query).** The paper hashes the current query (Eq. 5, Alg. 1
  line 1); the authors' code hashes the incoming key. ``hash="key"`` selects the latter.
* **GQA.** The paper only says the method is "agnostic to grouped-query attention". refkv
  scores a KV head's keys by the Hamming distances to all ``g`` query heads of its group,
  summed: the counterpart of averaging attention over the group (KeyDiff App. B.2); with
  ``g = 1`` it is the paper's rule.
* **Blocks, B > 1 (an extension).** Algorithm 1 evicts one token per query. For a block,
  ``block_query="sum"`` (default) scores by the Hamming distances summed over the block's
  ``B`` queries (or keys): the "average Hamming distance to the following queries" the
  authors rank by in App. D; ``block_query="last"`` uses the block's last query only, like
  TOVA. Both equal Algorithm 1 for ``B = 1``.
* **Protected tokens.** The first ``sink`` tokens and the ``recent`` most recent ones *after*
  the block is appended: at eviction time (before the block is in the cache) that is the
  last ``max(recent - B, 0)`` cached tokens. A block with ``N - B < sink + max(recent - B,
  0)`` leaves no room for them and raises a ValueError.
* **Ties.** Hamming distances are small integers, so ties are common; equal scores keep the
  more recent token (the shared tie rule), i.e. ``argmin`` evicts the oldest of the tied
  tokens, as PyTorch's ``argmin`` (first index) does.
* **Hash planes.** One Gaussian ``R`` of ``c`` rows (``refkv.lsh.gaussian_planes(c, d_head,
  seed)``) shared by every layer and head, as Eq. 2 defines a single ``R``. The product
  ``R x`` is formed in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cache import FieldSpec
from ..lsh import gaussian_planes, hamming, pack_codes, simhash
from ..model.config import ModelConfig
from .base import Policy, View, check_int, first_tokens, recent_tokens, register
from .card import PolicyCard

#: Most SimHash bits per code (the paper uses 16; 1024 bits already cost 128 bytes per token and head).
MAX_BITS = 1024

__all__ = ["CODE_FIELD", "HashEvict", "hamming_scores"]

#: Name of the cache field holding each token's packed key code.
CODE_FIELD = "hash_code"


def hamming_scores(query_codes: np.ndarray, key_codes: np.ndarray) -> np.ndarray:
    """Eq. 5 summed over queries: ``-sum_q d_H(h(q), h(k_i))``.

    Parameters
    ----------
    query_codes : (Hkv, m, n_bytes) uint8
        Packed codes of the ``m`` vectors each KV head is scored against (its query heads
        times the block's queries, flattened).
    key_codes : (Hkv, n, n_bytes) uint8
        Packed codes of the cached keys.

    Returns
    -------
    (Hkv, n) float64 scores, higher = keep.
    """
    distances = hamming(query_codes[:, :, None, :], key_codes[:, None, :, :])  # (Hkv, m, n)
    return -distances.sum(axis=1).astype(np.float64)


@register
@dataclass(frozen=True)
class HashEvict(Policy):
    """HashEvict (Liu et al. 2024), Algorithm 1, Eqs. 2-6: LSH eviction before attention.

    Parameters
    ----------
    n_bits : int, default 16
        ``c``, bits per SimHash code (Table 10 finds 4-64 about equal).
    sink : int, default 4
        First tokens always kept.
    recent : int, default 10
        Most recent tokens always kept (counted after the block is appended).
    hash : {"query", "key"}, default "query"
        What is compared with the cached key codes: the incoming query (paper) or the
        incoming key (authors' code).
    block_query : {"sum", "last"}, default "sum"
        How a block of ``B > 1`` is scored (an extension, see Notes): distances summed over
        the block, or the last token's only.
    seed : int, default 0
        Seed of the hash planes ``R``.
    """

    name = "hashevict"
    card = PolicyCard(
        summary="HashEvict: SimHash Hamming distance of query and keys, evict before attention; attention-free",
        paper="Liu et al. 2024, HashEvict, Algorithm 1, Eqs. 2-6; c = 16, first 4 + last 10 kept",
        label="HashEvict",
        citation="HashEvict (Liu et al. 2024)",
        score_rule=":math:`-` Hamming distance of SimHash codes of query and key, :math:`c = 16`",
        protects="first 4, last 10",
        implements=("HashEvict: Algorithm 1, Eqs. 2-6, SimHash codes as cache state (refkv/lsh.py), eviction before "
                    "attention; query or key hashing"),
        table_order=80,
        variants=({"hash": "key"}, {"block_query": "last"}),
    )
    needs = frozenset({"keys", "queries", "positions"})
    evict_before_attention = True

    n_bits: int = 16
    sink: int = 4
    recent: int = 10
    hash: str = "query"
    block_query: str = "sum"
    seed: int = 0

    def __post_init__(self):
        check_int("n_bits", self.n_bits, 1, MAX_BITS)  # bounded: d x n_bits planes, codes per token
        check_int("sink", self.sink, 0)
        check_int("recent", self.recent, 0)
        check_int("seed", self.seed, 0)
        if self.hash not in ("query", "key"):
            raise ValueError(f"hash must be 'query' or 'key', got {self.hash!r}")
        if self.block_query not in ("sum", "last"):
            raise ValueError(f"block_query must be 'sum' or 'last', got {self.block_query!r}")

    def check(self, budget: int, config: ModelConfig) -> None:
        if budget < self.sink + self.recent:
            raise ValueError(f"budget must be >= sink + recent = {self.sink + self.recent} for hashevict, "
                             f"got {budget}")

    def max_block(self, budget: int, config: ModelConfig) -> int:
        """``B <= N - sink``: the block must fit beside the sink tokens (with ``N >= sink + recent``,
        the recent ones kept at that eviction, ``max(recent - B, 0)``, then fit too)."""
        return budget - self.sink

    @property
    def n_bytes(self) -> int:
        """Bytes per packed code, ``ceil(n_bits / 8)``."""
        return -(-self.n_bits // 8)

    def planes(self, d: int, dtype=np.float64) -> np.ndarray:
        """The hash planes ``R``: ``(n_bits, d)``, seeded by ``seed``."""
        return gaussian_planes(self.n_bits, d, self.seed, dtype)

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Packed SimHash codes of ``x`` (..., d) -> (..., n_bytes) uint8."""
        return pack_codes(simhash(x, self.planes(x.shape[-1], x.dtype)))

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        return {CODE_FIELD: FieldSpec(dtype=np.uint8, shape=(self.n_bytes,), fill=0)}

    def observe(self, view: View) -> dict[str, np.ndarray]:
        """Add ``h(k_t)`` of the block's keys to the hash table (Alg. 1 line 5)."""
        b = view.block_keys.shape[1]
        if not np.array_equal(view.positions[:, -b:], np.broadcast_to(view.query_positions, (view.n_kv_heads, b))):
            raise ValueError("hashevict expects the block to be the last columns of the cache when observing")
        table = view.fields[CODE_FIELD].copy()
        table[:, -b:] = self.codes(view.block_keys)
        return {CODE_FIELD: table}

    def probes(self, view: View) -> np.ndarray:
        """Packed codes compared with the cached keys: (Hkv, m, n_bytes).

        ``hash="query"``: the block's queries of every query head of the group; ``"key"``:
        the block's keys. ``block_query="last"`` keeps the block's last token only.
        """
        if self.hash == "query":
            vectors = view.queries_by_kv_head()  # (Hkv, g, B, d)
        else:
            vectors = view.block_keys[:, None]  # (Hkv, 1, B, d)
        if self.block_query == "last":
            vectors = vectors[:, :, -1:]
        codes = self.codes(vectors)
        return codes.reshape(view.n_kv_heads, -1, self.n_bytes)

    def score(self, view: View) -> np.ndarray:
        return hamming_scores(self.probes(view), view.fields[CODE_FIELD])

    def protected(self, view: View) -> np.ndarray:
        b = len(view.query_positions)
        mask = first_tokens(view, self.sink) | recent_tokens(view, max(self.recent - b, 0))
        if view.keep is not None and mask.sum(axis=1).max(initial=0) > view.keep:
            raise ValueError(f"a block of B={b} leaves N - B = {view.keep} cache places, fewer than the "
                             f"{int(mask.sum(axis=1).max())} protected tokens (sink={self.sink}, recent="
                             f"{self.recent}); use B <= N - sink - max(recent - B, 0)")
        return mask
