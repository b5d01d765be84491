"""SimHash codes, bit packing and Hamming distance (HashEvict Eqs. 2-3).

SimHash (Charikar 2002; Goemans and Williamson 1995) maps a vector ``x`` in
:math:`\\mathbb{R}^d` to the ``c``-bit code

.. math:: h(x) = H(R x), \\qquad R \\in \\mathbb{R}^{c \\times d},\\ R_{ij} \\sim \\mathcal{N}(0, 1),

where :math:`H` is the element-wise Heaviside step (HashEvict Eq. 2). Each row of ``R`` is a
random hyperplane and each bit says on which side of it ``x`` lies, so for two vectors at
angle :math:`\\theta` the expected Hamming distance of their codes is :math:`c\\,\\theta/\\pi`
(HashEvict Eq. 3): a small distance means a small angle, i.e. a large cosine.

Codes are stored packed, eight bits per byte (HashEvict keeps ``C * c`` bits per head), and
compared with a popcount of their XOR.

Notes
-----
* **Heaviside at zero.** ``H(0) = 1``, as in HashEvict Eq. 2 (``sgn(x) = 1`` for ``x >= 0``).
  A zero vector therefore hashes to all ones; ``-0.0`` counts as zero.
* **Arithmetic dtype.** ``R x`` is formed in the dtype of ``x`` (the planes are cast to it),
  as a float32 kernel would; float32 and float64 inputs may therefore disagree on a bit
  whose projection is within rounding of zero.
* **Bit layout.** Bit ``j`` of a code goes to byte ``j // 8`` at bit value ``1 << (j % 8)``
  (little-endian bit order); unused high bits of the last byte are zero. The packed bytes
  of a code are thus the little-endian bytes of the integer :math:`\\sum_j b_j 2^j`.
* **Popcount.** :func:`hamming` XORs the codes as the widest unsigned words that divide
  their byte count (one ``uint16`` per 16-bit code) and counts the one bits with
  :func:`numpy.bitwise_count` (NumPy >= 2.0), falling back to a 256-entry byte table on
  older NumPy. A word's count is the sum of its bytes' counts, so both give the same
  integers; for 16-bit codes the word route is 12-60x faster (``bench/policies.py``).
"""

from __future__ import annotations

import numpy as np

from .validation import check_int

__all__ = ["gaussian_planes", "hamming", "hamming_unpacked", "pack_codes", "simhash", "unpack_codes"]

# Number of one bits of every byte value.
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def gaussian_planes(n_bits: int, d: int, seed: int = 0, dtype=np.float64) -> np.ndarray:
    """The seeded random projection ``R`` of SimHash: ``(n_bits, d)`` standard normal entries.

    Parameters
    ----------
    n_bits : int
        ``c``, the code length (``>= 1``).
    d : int
        Width of the hashed vectors (``>= 1``).
    seed : int
        Seed of :func:`numpy.random.default_rng`; the same seed gives the same planes on
        every platform (the draws are made in float64, then cast to ``dtype``).
    dtype : float dtype

    Returns
    -------
    (n_bits, d) array of ``dtype``
    """
    n_bits = check_int("n_bits", n_bits, 1)
    d = check_int("d", d, 1)
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_bits, d)).astype(dtype, copy=False)


def simhash(x: np.ndarray, planes: np.ndarray) -> np.ndarray:
    """SimHash codes ``H(R x)`` of the vectors ``x`` (HashEvict Eq. 2), one bit per plane.

    Parameters
    ----------
    x : (..., d) float array
    planes : (n_bits, d) float array
        ``R``, e.g. from :func:`gaussian_planes`.

    Returns
    -------
    (..., n_bits) bool array: ``True`` where ``R x >= 0`` (``H(0) = 1``).

    Raises
    ------
    ValueError
        If the widths differ or ``x`` holds NaN or infinity (whose side of a plane is
        undefined).
    """
    x = np.asarray(x)
    planes = np.asarray(planes)
    if planes.ndim != 2:
        raise ValueError(f"planes must have shape (n_bits, d), got {planes.shape}")
    if x.ndim < 1 or x.shape[-1] != planes.shape[1]:
        raise ValueError(f"x must have shape (..., {planes.shape[1]}) to match planes, got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise ValueError("x must be finite to be hashed")
    projections = x @ planes.astype(x.dtype, copy=False).T
    return projections >= 0


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Pack boolean codes eight bits per byte: ``(..., n_bits)`` -> ``(..., ceil(n_bits / 8))`` uint8.

    Bit ``j`` goes to byte ``j // 8`` at bit value ``1 << (j % 8)``; padding bits are zero.
    """
    codes = np.asarray(codes)
    if codes.dtype != np.bool_:
        raise ValueError(f"codes must be a bool array, got dtype {codes.dtype}")
    if codes.ndim < 1 or codes.shape[-1] < 1:
        raise ValueError(f"codes must have shape (..., n_bits) with n_bits >= 1, got {codes.shape}")
    return np.packbits(codes, axis=-1, bitorder="little")


def unpack_codes(packed: np.ndarray, n_bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``(..., ceil(n_bits / 8))`` uint8 -> ``(..., n_bits)`` bool."""
    n_bits = check_int("n_bits", n_bits, 1)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed must be a uint8 array, got dtype {packed.dtype}")
    n_bytes = -(-n_bits // 8)
    if packed.ndim < 1 or packed.shape[-1] != n_bytes:
        raise ValueError(f"packed must have shape (..., {n_bytes}) for n_bits={n_bits}, got {packed.shape}")
    return np.unpackbits(packed, axis=-1, count=n_bits, bitorder="little").astype(bool)


def hamming(packed_a: np.ndarray, packed_b: np.ndarray) -> np.ndarray:
    """Hamming distances of packed codes: popcount of ``a XOR b`` summed over the last axis.

    Parameters
    ----------
    packed_a, packed_b : (..., n_bytes) uint8 arrays
        Broadcast against each other on the leading axes.

    Returns
    -------
    (...) int64 array
    """
    a, b = np.asarray(packed_a), np.asarray(packed_b)
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise ValueError(f"packed codes must be uint8, got {a.dtype} and {b.dtype}")
    if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"packed codes must share their last axis (bytes per code), got {a.shape} and {b.shape}")
    if not hasattr(np, "bitwise_count"):  # NumPy < 2.0: count byte by byte
        return _POPCOUNT[np.bitwise_xor(a, b)].sum(axis=-1, dtype=np.int64)
    ones = np.bitwise_count(np.bitwise_xor(_as_words(a), _as_words(b)))
    if ones.shape[-1] == 1:  # one word per code: no reduction over a length-1 axis
        return ones[..., 0].astype(np.int64)
    return ones.sum(axis=-1, dtype=np.int64)


def _as_words(packed: np.ndarray) -> np.ndarray:
    """View ``(..., n_bytes)`` uint8 codes as the widest unsigned words dividing ``n_bytes``.

    Only the grouping of bits changes (the bytes are not reordered), so popcounts of XORs
    are unchanged whatever the byte order.
    """
    n_bytes = packed.shape[-1]
    width = next(w for w in (8, 4, 2, 1) if n_bytes % w == 0)
    if width == 1:
        return packed
    if packed.strides[-1] != 1:  # a view changing the item size needs contiguous bytes
        packed = np.ascontiguousarray(packed)
    return packed.view(np.dtype(f"u{width}"))


def hamming_unpacked(codes_a: np.ndarray, codes_b: np.ndarray) -> np.ndarray:
    """Hamming distances of boolean codes: the count of differing bits (the slow reference).

    Parameters
    ----------
    codes_a, codes_b : (..., n_bits) bool arrays, broadcast on the leading axes.

    Returns
    -------
    (...) int64 array
    """
    a, b = np.asarray(codes_a), np.asarray(codes_b)
    if a.dtype != np.bool_ or b.dtype != np.bool_:
        raise ValueError(f"codes must be bool arrays, got {a.dtype} and {b.dtype}")
    if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"codes must share their last axis (bits), got {a.shape} and {b.shape}")
    return np.count_nonzero(a != b, axis=-1).astype(np.int64)
