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
  tokens. The authors' code differs (its ``argmin`` takes the first *slot*, and a new token
  fills the slot it freed): ``form="authors"``.
* **Authors' form** (``form="authors"``, :class:`HashEvict`): the decisions of
  minghui-liu/cold-compress@b2ae9f0 ``KVCacheLSH`` (see its docstring).
* **Hash planes.** One Gaussian ``R`` of ``c`` rows (``refkv.lsh.gaussian_planes(c, d_head,
  seed)``) shared by every layer and head, as Eq. 2 defines a single ``R``. The product
  ``R x`` is formed in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..cache import FieldSpec
from ..lsh import gaussian_planes, hamming, pack_codes, simhash
from ..model.config import ModelConfig
from ..validation import check_choice
from .base import Policy, View, check_int, first_tokens, recent_tokens, register
from .card import PolicyCard

#: Most SimHash bits per code (the paper uses 16; 1024 bits already cost 128 bytes per token and head).
MAX_BITS = 1024

__all__ = ["CODE_FIELD", "FORMS", "SLOT_FIELD", "HashEvict", "authors_slots", "hamming_scores", "layer_seed"]

#: Name of the cache field holding each token's packed key code.
CODE_FIELD = "hash_code"
#: Name of the cache field holding each token's slot in the authors' fixed-size buffer
#: (``form="authors"`` only): the tie order of their ``argmin``.
SLOT_FIELD = "hash_slot"
#: ``"paper"``: Algorithm 1 as written; ``"authors"``: the authors' code (see :class:`HashEvict`).
FORMS = ("paper", "authors")
#: Where each form comes from, and what proves it (the ``forms`` map of the policies).
AUTHORS_SOURCE = ("minghui-liu/cold-compress@b2ae9f0b3610f4ba2ecec4ae5fb323880daa3679:cache.py:1477-1551 "
                  "(KVCacheLSH), prompt_compression.py:128-145, model.py:357-425")


def layer_seed(seed: int, layer: int) -> int:
    """The seed of layer ``layer``'s hash planes in ``form="authors"``: one ``R`` per layer, as
    the authors' code draws one per cache object (``cache.py:1494``), here from
    ``numpy.random.SeedSequence([seed, layer])`` (their draws come from torch's global RNG,
    which no seed of ours reproduces; the harness hands our planes to their code)."""
    return int(np.random.SeedSequence([int(seed), int(layer)]).generate_state(1, dtype=np.uint64)[0])


def authors_slots(old_slots: np.ndarray, old_positions: np.ndarray, n_new: int, first_new: int,
                  budget: int | None, sink: int) -> np.ndarray:
    """The slots of the authors' buffer after ``n_new`` tokens were appended: (Hkv, n_old + n_new).

    The authors' cache is a buffer of ``N`` slots (``cache.py:190-233``); the prompt fills
    slots ``0, 1, ...`` in position order (``cache.py:395-416``); each generated token is
    written into the slot its eviction freed, or the first empty one (``cache.py:1504-1512``:
    ``argmin`` puts empty slots, scored ``-inf``, first). Both are "the lowest slot no
    survivor holds", which is how the new tokens get theirs here, in position order.

    A prompt longer than ``N`` was cut by the authors to its first ``sink`` and last
    ``N - sink`` tokens in slots ``0 .. N-1`` (``prompt_compression.py:21-26, 128-145``);
    refkv numbered the uncut prompt's slots by position, so survivors whose slot is ``>= N``
    (only right after that cut) are renumbered as the authors' buffer holds them:
    ``slot - (T - N)`` past the sinks, ``T`` the first new position (the prompt's length).

    Parameters
    ----------
    old_slots, old_positions : (Hkv, n_old) int arrays
        The survivors' slots and positions.
    n_new : int
        Tokens appended.
    first_new : int
        Position of the first appended token.
    budget : int or None
        ``N`` (``None``: no eviction in this step, the slots just grow).
    sink : int
        ``global_tokens``.
    """
    old = np.array(old_slots, dtype=np.int64)
    if budget is not None and old.size and old.max() >= budget:
        shift = first_new - budget
        old = np.where(np.asarray(old_positions) < sink, old, old - shift)
    hkv = old.shape[0]
    new = np.empty((hkv, n_new), dtype=np.int64)
    for h in range(hkv):
        held = set(old[h].tolist())
        free, slot = [], 0
        while len(free) < n_new:
            if slot not in held:
                free.append(slot)
            slot += 1
        new[h] = free
    return np.concatenate([old, new], axis=1)


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
    form : {"paper", "authors"}, default "paper"
        ``"authors"``: the decisions of the authors' ``KVCacheLSH`` (below); needs
        ``hash="key"``.

    Notes
    -----
    ``form="authors"`` reproduces minghui-liu/cold-compress@b2ae9f0 (the HashEvict authors'
    fork) in its regime, a prompt processed one-shot then one token at a time:

    * **Key hashing** (``cache.py:1502, 1536``) and **one** ``R`` **per layer**
      (``cache.py:1494``; :func:`layer_seed`).
    * **Recent window**: the ``recent`` cached tokens before the new one are protected
      (``self.pos >= input_pos - self.recent_window``, ``cache.py:1539``), so ``recent + 1``
      recent tokens stay once the new one is in: one more than the paper's.
    * **Tie order**: ``torch.argmin`` over the buffer's slots evicts the first minimal slot
      (``cache.py:1529``; documented first-index behaviour), and the new token takes the freed
      slot (``cache.py:1504-1512``). Each token's slot is kept as state (:data:`SLOT_FIELD`,
      :func:`authors_slots`) and the score is ``-d_H * M + slot`` (``M`` above every slot), so
      the shared selection evicts the largest distance and, among equal ones, the lowest slot.
    * **Prompt stage**: a prompt longer than ``N`` is cut to its first ``sink`` and last
      ``N - sink`` tokens without hashing (the default ``recent_global`` compressor,
      ``cache.py:76-80``, ``prompt_compression.py:128-145``, ``model.py:357-362``). refkv
      runs the prompt uncompressed and the first generated token's eviction (which sees
      more than ``N`` candidates) gives every token outside that set the score ``-inf``:
      the cut, then the one key-hash eviction the authors' first decoding step makes.
    * Blocks of ``B > 1`` that evict are refused (:meth:`max_block` is 1): the code evicts
      one token per generated token.
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
        variants=({"hash": "key"}, {"block_query": "last"}, {"hash": "key", "form": "authors"}),
    )
    needs = frozenset({"keys", "queries", "positions"})
    evict_before_attention = True
    #: Each form's source and what proves it (``refkv policies --forms``).
    forms = MappingProxyType({
        "paper": {"source": "Liu et al. 2024, HashEvict, Algorithm 1, Eqs. 2-6, Sec. 4 (c = 16, first 4, last 10)",
                  "proven": "not proven against code (no code of the paper form exists); Algorithm 1 replayed "
                            "literally in tests/policies/test_policy_hashevict.py"},
        "authors": {"source": AUTHORS_SOURCE,
                    "proven": "identical on 6 configurations (tests/authors/hashevict/)"},
    })

    n_bits: int = 16
    sink: int = 4
    recent: int = 10
    hash: str = "query"
    block_query: str = "sum"
    seed: int = 0
    form: str = "paper"

    def __post_init__(self):
        check_int("n_bits", self.n_bits, 1, MAX_BITS)  # bounded: d x n_bits planes, codes per token
        check_int("sink", self.sink, 0)
        check_int("recent", self.recent, 0)
        check_int("seed", self.seed, 0)
        if self.hash not in ("query", "key"):
            raise ValueError(f"hash must be 'query' or 'key', got {self.hash!r}")
        if self.block_query not in ("sum", "last"):
            raise ValueError(f"block_query must be 'sum' or 'last', got {self.block_query!r}")
        check_choice("form", self.form, FORMS)
        if self.form == "authors" and self.hash != "key":
            raise ValueError("form='authors' hashes the incoming key, as the authors' code does: "
                             "use hash='key' with it")

    @property
    def authors(self) -> bool:
        """True for form="authors"."""
        return self.form == "authors"

    def check(self, budget: int, config: ModelConfig) -> None:
        least = self.sink + self.recent + (1 if self.authors else 0)
        if budget < least:
            raise ValueError(f"budget must be >= sink + recent{' + 1' if self.authors else ''} = {least} for "
                             f"hashevict{' (form=authors)' if self.authors else ''}, got {budget}")

    def max_block(self, budget: int, config: ModelConfig) -> int:
        """``B <= N - sink``: the block must fit beside the sink tokens (with ``N >= sink + recent``,
        the recent ones kept at that eviction, ``max(recent - B, 0)``, then fit too).
        ``form="authors"``: 1 (the authors' code evicts one token per generated token)."""
        return 1 if self.authors else budget - self.sink

    @property
    def n_bytes(self) -> int:
        """Bytes per packed code, ``ceil(n_bits / 8)``."""
        return -(-self.n_bits // 8)

    def planes(self, d: int, dtype=np.float64, layer: int = 0) -> np.ndarray:
        """The hash planes ``R``: ``(n_bits, d)``, seeded by ``seed`` (the same in every layer),
        or by :func:`layer_seed` of ``(seed, layer)`` in ``form="authors"``."""
        seed = layer_seed(self.seed, layer) if self.authors else self.seed
        return gaussian_planes(self.n_bits, d, seed, dtype)

    def codes(self, x: np.ndarray, layer: int = 0) -> np.ndarray:
        """Packed SimHash codes of ``x`` (..., d) -> (..., n_bytes) uint8 (``layer``: form="authors")."""
        planes = self.planes(x.shape[-1], x.dtype, layer) if self.authors else self.planes(x.shape[-1], x.dtype)
        return pack_codes(simhash(x, planes))

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        out = {CODE_FIELD: FieldSpec(dtype=np.uint8, shape=(self.n_bytes,), fill=0)}
        if self.authors:
            out[SLOT_FIELD] = FieldSpec(dtype=np.int64, shape=(), fill=-1)
        return out

    def observe(self, view: View) -> dict[str, np.ndarray]:
        """Add ``h(k_t)`` of the block's keys to the hash table (Alg. 1 line 5)."""
        b = view.block_keys.shape[1]
        if not np.array_equal(view.positions[:, -b:], np.broadcast_to(view.query_positions, (view.n_kv_heads, b))):
            raise ValueError("hashevict expects the block to be the last columns of the cache when observing")
        table = view.fields[CODE_FIELD].copy()
        table[:, -b:] = self.codes(view.block_keys, view.layer)
        if not self.authors:
            return {CODE_FIELD: table}
        slots = authors_slots(view.fields[SLOT_FIELD][:, :-b], view.positions[:, :-b], b,
                              int(view.query_positions[0]), view.budget, self.sink)
        return {CODE_FIELD: table, SLOT_FIELD: slots}

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
        codes = self.codes(vectors, view.layer)
        return codes.reshape(view.n_kv_heads, -1, self.n_bytes)

    def score(self, view: View) -> np.ndarray:
        scores = hamming_scores(self.probes(view), view.fields[CODE_FIELD])
        return self._authors_scores(view, scores) if self.authors else scores

    def _authors_scores(self, view: View, scores: np.ndarray) -> np.ndarray:
        """``-d_H * M + slot`` (ties: the lowest slot goes), ``-inf`` outside the prompt cut."""
        if len(view.query_positions) != 1:
            raise ValueError(f"hashevict form='authors' evicts for one token at a time (the authors' code "
                             f"decodes token by token), got a block of {len(view.query_positions)}")
        slots = np.asarray(view.fields[SLOT_FIELD])
        scale = float(max(int(slots.max(initial=0)) + 1, 1))
        out = scores * scale + slots  # small integers: exact in float64
        if view.budget is not None and view.n > view.budget:  # the authors' prompt stage
            first = int(view.query_positions[0])
            cut = (view.positions < self.sink) | (view.positions >= first - (view.budget - self.sink))
            out = np.where(cut, out, -np.inf)
        return out

    def protected(self, view: View) -> np.ndarray:
        b = len(view.query_positions)
        recent = self.recent if self.authors else max(self.recent - b, 0)  # authors: cache.py:1539
        mask = first_tokens(view, self.sink) | recent_tokens(view, recent)
        if view.keep is not None and mask.sum(axis=1).max(initial=0) > view.keep:
            raise ValueError(f"a block of B={b} leaves N - B = {view.keep} cache places, fewer than the "
                             f"{int(mask.sum(axis=1).max())} protected tokens (sink={self.sink}, recent="
                             f"{self.recent}); use B <= N - sink - max(recent - B, 0)")
        return mask
