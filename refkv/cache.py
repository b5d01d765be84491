"""The explicit KV cache of one layer, with per-token policy state.

Every KV head holds the same number of tokens ``n`` but may hold different tokens.
Keys are stored after RoPE at their original positions. Per-token policy state (H2O's
accumulated attention, HashEvict's hash codes, ...) lives here as *fields*, arrays whose
first two axes are ``(Hkv, n)`` like ``positions``: :meth:`LayerCache.keep` gathers
keys, values, positions and every field with the same indices, so state can never
drift away from its token.

The cache holds at most ``N + B`` tokens (between appending a block and evicting);
nothing in it grows with the prompt length ``T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FieldSpec", "LayerCache"]


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
    positions : (Hkv, n) int64 array, strictly increasing along each row
    fields : dict of str to (Hkv, n, \\*shape) arrays
    next_position : int
        Position of the next token to arrive: the number of tokens this layer has seen.
    """

    def __init__(self, n_kv_heads: int, d_head: int, dtype, fields: dict[str, FieldSpec] | None = None):
        self.specs = dict(fields or {})
        self.keys = np.zeros((n_kv_heads, 0, d_head), dtype=dtype)
        self.values = np.zeros((n_kv_heads, 0, d_head), dtype=dtype)
        self.positions = np.zeros((n_kv_heads, 0), dtype=np.int64)
        self.fields = {name: np.zeros((n_kv_heads, 0, *spec.shape), dtype=spec.dtype)
                       for name, spec in self.specs.items()}
        self.next_position = 0

    def __len__(self) -> int:
        return self.keys.shape[1]

    @property
    def n_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by keys, values, positions and fields."""
        arrays = [self.keys, self.values, self.positions, *self.fields.values()]
        return sum(a.nbytes for a in arrays)

    def append(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Append a block of ``B`` tokens at positions ``next_position .. + B - 1``.

        Parameters
        ----------
        keys, values : (Hkv, B, d) arrays of the cache dtype

        Returns
        -------
        (B,) int64 array: the positions given to the block.
        """
        if keys.shape != values.shape or keys.shape[0] != self.n_kv_heads or keys.shape[2] != self.keys.shape[2]:
            raise ValueError(f"keys and values must both have shape ({self.n_kv_heads}, B, "
                             f"{self.keys.shape[2]}), got {keys.shape} and {values.shape}")
        if keys.dtype != self.keys.dtype or values.dtype != self.keys.dtype:
            raise ValueError(f"keys/values dtype must be {self.keys.dtype}, got {keys.dtype}/{values.dtype}")
        b = keys.shape[1]
        new_positions = np.arange(self.next_position, self.next_position + b, dtype=np.int64)
        self.keys = np.concatenate([self.keys, keys], axis=1)
        self.values = np.concatenate([self.values, values], axis=1)
        self.positions = np.concatenate(
            [self.positions, np.broadcast_to(new_positions, (self.n_kv_heads, b))], axis=1)
        for name, spec in self.specs.items():
            fresh = np.full((self.n_kv_heads, b, *spec.shape), spec.fill, dtype=spec.dtype)
            self.fields[name] = np.concatenate([self.fields[name], fresh], axis=1)
        self.next_position += b
        return new_positions

    def set_field(self, name: str, array: np.ndarray) -> None:
        """Replace a state field (whole array, shape and dtype checked)."""
        if name not in self.specs:
            raise ValueError(f"unknown cache field {name!r}; declared: {sorted(self.specs)}")
        spec = self.specs[name]
        expected = (self.n_kv_heads, len(self), *spec.shape)
        array = np.asarray(array)
        if array.shape != expected:
            raise ValueError(f"field {name!r} must have shape {expected}, got {array.shape}")
        self.fields[name] = array.astype(spec.dtype, copy=False)

    def keep(self, indices: np.ndarray) -> None:
        """Keep, per KV head, the tokens at ``indices`` and drop the rest.

        Parameters
        ----------
        indices : (Hkv, m) integer array
            Column indices into the current cache, strictly increasing along each row
            (so retained tokens stay in position order), the same count ``m`` per head.
        """
        indices = np.asarray(indices)
        if indices.ndim != 2 or indices.shape[0] != self.n_kv_heads:
            raise ValueError(f"indices must have shape ({self.n_kv_heads}, m), got {indices.shape}")
        if not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f"indices must be integers, got dtype {indices.dtype}")
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise ValueError(f"indices must be in [0, {len(self) - 1}]")
        if np.any(np.diff(indices, axis=1) <= 0):
            raise ValueError("indices must be strictly increasing along each row")
        self.keys = np.take_along_axis(self.keys, indices[:, :, None], axis=1)
        self.values = np.take_along_axis(self.values, indices[:, :, None], axis=1)
        self.positions = np.take_along_axis(self.positions, indices, axis=1)
        for name, array in self.fields.items():
            idx = indices.reshape(indices.shape + (1,) * (array.ndim - 2))
            self.fields[name] = np.take_along_axis(array, idx, axis=1)
