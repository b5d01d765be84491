"""The explicit KV cache of one layer, with per-token policy state.

Every KV head may hold different tokens. Under a uniform budget every head also holds
the same number ``n`` of them; a policy with uneven per-head budgets (AdaKV) leaves
heads with different counts (see *Uneven heads* below).
Keys are stored after RoPE at their original positions. Per-token policy state (H2O's
accumulated attention, HashEvict's hash codes, ...) lives here as *fields*, arrays whose
first two axes are ``(Hkv, n)`` like ``positions``: :meth:`LayerCache.keep` gathers
keys, values, positions and every field with the same indices, so state can never
drift away from its token.

The cache holds at most ``N + B`` tokens (between appending a block and evicting);
nothing in it grows with the prompt length ``T``.

Storage
-------
Each array lives in a buffer with room to spare along the token axis (a growing
buffer, like a Python list): appending a block writes into the spare room, so a
decoding step (``B = 1``) costs ``O(B)``, not a copy of the whole cache; when the room
runs out the buffer grows by half, so appends are amortised ``O(1)`` per token.
:meth:`LayerCache.keep` compacts the kept tokens to the front of the buffer in place.

The attributes ``keys``, ``values``, ``positions`` and ``fields`` are **read-only views
of the live region** ``[:, :n]``, never copies (reading them is free). They are safe to
hold on to: the cache never writes into memory a view handed out earlier can see.

* An append writes only past ``n``, outside every view already handed out.
* :meth:`LayerCache.keep` and :meth:`LayerCache.set_field` rewrite the live region, so
  they do it in place only when no view of the buffer is alive (no reference besides
  the cache's own); otherwise the result goes to a fresh buffer and the old one stays,
  unchanged, with whoever still holds it (copy on write).

Uneven heads
------------
When the heads hold different numbers of tokens (:attr:`LayerCache.head_lengths`), the
arrays stay rectangular, ``(Hkv, n, ...)`` with ``n`` the largest count: each head's real
tokens come first, in increasing position order, and the rest of its row is **empty
slots** whose position is :data:`EMPTY` (the largest int64), whose keys and values are
zero and whose fields hold their ``fill``. The choice keeps the attention kernel
unchanged: its causal mask ``key_position <= query_position`` already excludes a key at
position :data:`EMPTY`, so an empty slot gets weight exactly 0 and adds exactly 0 to the
output. Rows stay sorted (real positions, then :data:`EMPTY`), and :meth:`LayerCache.keep`
refuses to keep an empty slot, so policies never keep one over a real token.

An append to an uneven cache writes each head's block right after its real tokens, so
it rebuilds the buffers (``O(n)``, not ``O(B)``); an eviction that leaves the heads even
restores the ``O(B)`` append. A cache whose heads are even never holds an empty slot,
and every operation on it is exactly what it was before uneven heads existed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

__all__ = ["EMPTY", "FieldSpec", "LayerCache"]

#: Growth factor of a full buffer: geometric growth makes appends amortised O(1) and
#: wastes at most half of the buffer (a cache under a budget stops growing at N + B).
GROWTH = 1.5

#: Position of an empty slot (a head holding fewer tokens than the widest head): larger
#: than any query position, so the causal mask hides it.
EMPTY = np.iinfo(np.int64).max


@dataclass(frozen=True)
class FieldSpec:
    """Declaration of a per-token state field.

    Attributes
    ----------
    dtype : numpy dtype
    shape : tuple of int
        Trailing shape per token (``()`` for a scalar per token).
    fill : scalar
        Value given to newly appended tokens until a policy's ``observe`` writes them.
    """

    dtype: object = np.float64
    shape: tuple[int, ...] = ()
    fill: object = 0


def _references(buffers: dict, name: str) -> int:
    return sys.getrefcount(buffers[name])


#: References a buffer has when only the cache's dict holds it, counted by the same call
#: the cache makes (so the figure is right whatever the interpreter counts for the call).
_OWN_REFERENCES = _references({"probe": np.empty(0)}, "probe")


class LayerCache:
    """KV cache of one layer.

    Parameters
    ----------
    n_kv_heads, d_head : int
    dtype : float dtype of keys and values
    fields : dict of str to FieldSpec, optional
        Per-token state fields to carry.

    Attributes
    ----------
    keys, values : (Hkv, n, d) arrays
    positions : (Hkv, n) int64 array, strictly increasing along each row over the real
        tokens, then :data:`EMPTY` in empty slots (uneven heads only)
    head_lengths : (Hkv,) int64 array
        Real tokens per head (all ``n`` unless the heads are uneven).
    fields : read-only mapping of str to (Hkv, n, \\*shape) arrays
    next_position : int
        Position of the next token to arrive: the number of tokens this layer has seen.

    Notes
    -----
    ``keys``, ``values``, ``positions`` and each array of ``fields`` are read-only views
    of the live tokens that no later :meth:`append`, :meth:`keep` or :meth:`set_field`
    changes (see the module notes); write state with :meth:`set_field`.
    """

    def __init__(self, n_kv_heads: int, d_head: int, dtype, fields: dict[str, FieldSpec] | None = None):
        self.specs = dict(fields or {})
        # Every per-token array, keyed "keys", "values", "positions" or "field:<name>";
        # each (Hkv, capacity, ...) with the live tokens in [:, :n].
        self._buffers = {"keys": np.zeros((n_kv_heads, 0, d_head), dtype=dtype),
                         "values": np.zeros((n_kv_heads, 0, d_head), dtype=dtype),
                         "positions": np.zeros((n_kv_heads, 0), dtype=np.int64)}
        for name, spec in self.specs.items():
            self._buffers["field:" + name] = np.zeros((n_kv_heads, 0, *spec.shape), dtype=spec.dtype)
        self._n = 0
        self._lengths = np.zeros(n_kv_heads, dtype=np.int64)  # real tokens per head
        self.next_position = 0

    # -- read-only views of the live region ------------------------------------------------
    def _live(self, name: str) -> np.ndarray:
        view = self._buffers[name][:, :self._n]
        view.flags.writeable = False
        return view

    @property
    def keys(self) -> np.ndarray:
        return self._live("keys")

    @property
    def values(self) -> np.ndarray:
        return self._live("values")

    @property
    def positions(self) -> np.ndarray:
        return self._live("positions")

    @property
    def fields(self) -> MappingProxyType:
        # read-only: assigning an entry would otherwise change a temporary dict, silently
        return MappingProxyType({name: self._live("field:" + name) for name in self.specs})

    def __len__(self) -> int:
        """Slots per head: the largest head's token count."""
        return self._n

    @property
    def head_lengths(self) -> np.ndarray:
        """(Hkv,) int64: real tokens each head holds (a copy)."""
        return self._lengths.copy()

    @property
    def total(self) -> int:
        """Real tokens over all heads: the layer's share of the budget in use."""
        return int(self._lengths.sum())

    @property
    def uneven(self) -> bool:
        """Whether some head holds fewer tokens than the widest (the cache has empty slots)."""
        return bool((self._lengths != self._n).any())

    def positions_or(self, empty: int = -1) -> np.ndarray:
        """A copy of ``positions`` with ``empty`` in the empty slots (how traces record them)."""
        positions = self.positions.copy()
        positions[positions == EMPTY] = empty
        return positions

    @property
    def n_kv_heads(self) -> int:
        return self._buffers["keys"].shape[0]

    @property
    def capacity(self) -> int:
        """Tokens per head the buffers can hold before they must grow."""
        return self._buffers["keys"].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the live tokens' keys, values, positions and fields."""
        return sum(self._buffers[name][:, :self._n].nbytes for name in self._buffers)

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of the buffers, spare room included (at most ``GROWTH`` times the peak ``nbytes``)."""
        return sum(buffer.nbytes for buffer in self._buffers.values())

    # -- copy on write -----------------------------------------------------------------------
    def _shared(self, name: str) -> bool:
        """Whether something besides the cache references buffer ``name`` (a view handed out)."""
        if not hasattr(sys, "getrefcount"):  # an interpreter that cannot tell: assume shared
            return True
        return _references(self._buffers, name) > _OWN_REFERENCES

    def _writable(self, name: str) -> np.ndarray:
        """Buffer ``name`` ready to have its live region rewritten: itself, or a fresh one if shared."""
        if self._shared(name):  # asked before any local name holds the buffer
            self._buffers[name] = np.empty_like(self._buffers[name])
        return self._buffers[name]

    # -- changes -------------------------------------------------------------------------
    def append(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Append a block of ``B`` tokens at positions ``next_position .. + B - 1``.

        Parameters
        ----------
        keys, values : (Hkv, B, d) arrays of the cache dtype

        Returns
        -------
        (B,) int64 array: the positions given to the block.
        """
        d_head, dtype = self._buffers["keys"].shape[2], self._buffers["keys"].dtype
        if keys.shape != values.shape or keys.shape[0] != self.n_kv_heads or keys.shape[2] != d_head:
            raise ValueError(f"keys and values must both have shape ({self.n_kv_heads}, B, "
                             f"{d_head}), got {keys.shape} and {values.shape}")
        if keys.dtype != dtype or values.dtype != dtype:
            raise ValueError(f"keys/values dtype must be {dtype}, got {keys.dtype}/{values.dtype}")
        n, b = self._n, keys.shape[1]
        if self.uneven:
            return self._append_uneven(keys, values)
        if n + b > self.capacity:
            self._grow(max(n + b, int(GROWTH * self.capacity)))
        new_positions = np.arange(self.next_position, self.next_position + b, dtype=np.int64)
        # Writes go past n only: no view handed out so far covers them.
        self._buffers["keys"][:, n:n + b] = keys
        self._buffers["values"][:, n:n + b] = values
        self._buffers["positions"][:, n:n + b] = new_positions
        for name, spec in self.specs.items():
            self._buffers["field:" + name][:, n:n + b] = spec.fill
        self._n += b
        self._lengths += b
        self.next_position += b
        return new_positions

    def _append_uneven(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Append to an uneven cache: each head's block goes right after its real tokens.

        Rebuilds every buffer (fresh arrays, so no view handed out changes): the block lands
        at a different column in each head, which rewrites the live region.
        """
        n, b = self._n, keys.shape[1]
        width = n + b
        capacity = max(width, self.capacity)
        new_positions = np.arange(self.next_position, self.next_position + b, dtype=np.int64)
        block = {"keys": keys, "values": values, "positions": new_positions}
        for name, old in list(self._buffers.items()):
            spec = self.specs.get(name[len("field:"):]) if name.startswith("field:") else None
            new = np.empty((old.shape[0], capacity, *old.shape[2:]), dtype=old.dtype)
            new[:, :width] = _empty_value(name, spec)
            for h, length in enumerate(self._lengths):
                new[h, :length] = old[h, :length]
                new[h, length:length + b] = block[name][h] if name in ("keys", "values") else (
                    block[name] if spec is None else spec.fill)
            self._buffers[name] = new
        self._n = width
        self._lengths += b
        self.next_position += b
        return new_positions

    def _grow(self, capacity: int) -> None:
        """Move the live tokens to new buffers of ``capacity`` tokens (old buffers untouched)."""
        for name, old in self._buffers.items():
            new = np.empty((old.shape[0], capacity, *old.shape[2:]), dtype=old.dtype)
            new[:, :self._n] = old[:, :self._n]
            self._buffers[name] = new

    def set_field(self, name: str, array: np.ndarray) -> None:
        """Replace a state field (whole array, shape and dtype checked; the values are copied)."""
        if name not in self.specs:
            raise ValueError(f"unknown cache field {name!r}; declared: {sorted(self.specs)}")
        spec = self.specs[name]
        expected = (self.n_kv_heads, len(self), *spec.shape)
        array = np.asarray(array)
        if array.shape != expected:
            raise ValueError(f"field {name!r} must have shape {expected}, got {array.shape}")
        self._writable("field:" + name)[:, :self._n] = array  # cast to spec.dtype on the way in

    def keep(self, indices) -> None:
        """Keep, per KV head, the tokens at ``indices`` and drop the rest.

        Parameters
        ----------
        indices : (Hkv, m) integer array, or a sequence of ``Hkv`` 1-D integer arrays
            Column indices into the current cache, strictly increasing along each row
            (so retained tokens stay in position order). An array keeps ``m`` tokens in
            every head; a sequence may keep a different count per head (uneven budgets),
            and the heads then hold empty slots after their tokens (module notes).
            Every index must name a real token (below the head's
            :attr:`head_lengths`), never an empty slot.
        """
        if isinstance(indices, (list, tuple)):
            rows = [np.asarray(row) for row in indices]
            if len(rows) != self.n_kv_heads or any(row.ndim != 1 for row in rows):
                raise ValueError(f"indices must hold {self.n_kv_heads} 1-D rows (one per KV head), "
                                 f"got {len(rows)} rows of dimensions {[row.ndim for row in rows]}")
            if len({len(row) for row in rows}) == 1:
                indices = np.stack(rows) if rows else np.zeros((0, 0), dtype=np.int64)
            else:
                for h, row in enumerate(rows):
                    self._check_row(row, h)
                self._keep_uneven(rows)
                return
        indices = np.asarray(indices)
        if indices.ndim != 2 or indices.shape[0] != self.n_kv_heads:
            raise ValueError(f"indices must have shape ({self.n_kv_heads}, m), got {indices.shape}")
        if not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f"indices must be integers, got dtype {indices.dtype}")
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise ValueError(f"indices must be in [0, {len(self) - 1}]")
        if np.any(np.diff(indices, axis=1) <= 0):
            raise ValueError("indices must be strictly increasing along each row")
        if self.uneven and indices.size and (indices.max(axis=1) >= self._lengths).any():
            h = int(np.argmax(indices.max(axis=1) >= self._lengths))
            raise ValueError(f"head {h}: indices must name real tokens, in [0, {int(self._lengths[h]) - 1}] "
                             f"(the rest are empty slots)")
        n, m = self._n, indices.shape[1]
        for name in self._buffers:
            if self._shared(name):  # copy on write: the old buffer stays as its readers saw it
                new = np.empty_like(self._buffers[name])
                _gather(self._buffers[name], new, indices, n)
                self._buffers[name] = new
            else:
                _gather(self._buffers[name], self._buffers[name], indices, n)
        self._n = m
        self._lengths[:] = m

    def _check_row(self, row: np.ndarray, h: int) -> None:
        if row.size and not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"indices must be integers, got dtype {row.dtype} (head {h})")
        length = int(self._lengths[h])
        if row.size and (row.min() < 0 or row.max() >= length):
            raise ValueError(f"head {h}: indices must name real tokens, in [0, {length - 1}]")
        if np.any(np.diff(row) <= 0):
            raise ValueError(f"head {h}: indices must be strictly increasing")

    def _keep_uneven(self, rows: list[np.ndarray]) -> None:
        """Keep ``len(rows[h])`` tokens in head ``h``; the shorter heads end in empty slots."""
        n = self._n
        width = max(len(row) for row in rows)
        for name in self._buffers:
            spec = self.specs.get(name[len("field:"):]) if name.startswith("field:") else None
            shared = self._shared(name)  # asked before a local name holds the buffer
            source = self._buffers[name]
            target = np.empty_like(source) if shared else source
            for h, row in enumerate(rows):
                # np.take copies when its output overlaps its input (target may be source)
                np.take(source[h, :n], row.astype(np.int64), axis=0, out=target[h, :len(row)], mode="clip")
                target[h, len(row):width] = _empty_value(name, spec)
            self._buffers[name] = target
        self._n = width
        self._lengths[:] = [len(row) for row in rows]


def _empty_value(name: str, spec: FieldSpec | None):
    """What an empty slot holds in buffer ``name``: :data:`EMPTY`, zeros, or the field's fill."""
    if name == "positions":
        return EMPTY
    return 0 if spec is None else spec.fill


def _gather(source: np.ndarray, target: np.ndarray, indices: np.ndarray, n: int) -> None:
    """``target[h, :m] = source[h, indices[h]]`` for every head ``h`` (``m = indices.shape[1]``).

    Row by row along the token axis with ``np.take`` (each head's tokens are contiguous
    rows, so this is a copy of whole rows, several times faster than a general fancy-index
    gather). ``target`` may be ``source``: ``np.take`` copies when its output overlaps
    its input.
    """
    m = indices.shape[1]
    for h in range(source.shape[0]):
        # mode="clip" skips a second bounds check (keep() checked the indices) and the buffering it implies
        np.take(source[h, :n], indices[h], axis=0, out=target[h, :m], mode="clip")
