"""refkv.lsh.hamming's word-wide popcount (a speed-up measured by bench/policies.py) equals a bit count.

The expected distances come from an independent route: unpack every byte with
``numpy.unpackbits`` and count differing bits, so the test does not reuse the byte table or
the word views it checks.
"""

import numpy as np
import pytest

from refkv.lsh import hamming


def bit_count_distance(a, b):
    """Count differing bits after unpacking every byte (no popcount involved)."""
    a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
    return (np.unpackbits(a, axis=-1) != np.unpackbits(b, axis=-1)).sum(axis=-1)


@pytest.mark.parametrize("n_bytes", [1, 2, 3, 4, 6, 8, 12, 16, 17])
def test_word_popcount_equals_bit_count(n_bytes):
    rng = np.random.default_rng(n_bytes)
    a = rng.integers(0, 256, (3, 5, 1, n_bytes), dtype=np.uint8)
    b = rng.integers(0, 256, (3, 1, 7, n_bytes), dtype=np.uint8)
    got = hamming(a, b)
    assert got.shape == (3, 5, 7) and got.dtype == np.int64
    np.testing.assert_array_equal(got, bit_count_distance(a, b))


def test_extreme_words():
    # All ones against all zeros: every bit differs, in every word width.
    for n_bytes in (1, 2, 4, 8, 16):
        ones, zeros = np.full(n_bytes, 255, np.uint8), np.zeros(n_bytes, np.uint8)
        assert hamming(ones, zeros) == 8 * n_bytes
        assert hamming(ones, ones) == 0


def test_non_contiguous_and_broadcast_inputs():
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 256, (4, 6, 8), dtype=np.uint8)
    strided = wide[:, ::2, ::2]  # last axis not contiguous: (4, 3, 4)
    shifted = wide[:, :3, 1:5]  # contiguous bytes, odd start address
    spread = np.broadcast_to(wide[:1, :1, :4], (4, 3, 4))  # zero strides
    for a, b in [(strided, shifted), (shifted, spread), (spread, strided)]:
        np.testing.assert_array_equal(hamming(a, b), bit_count_distance(a, b))
    np.testing.assert_array_equal(wide, wide.copy())  # inputs untouched


def test_byte_table_fallback_without_bitwise_count(monkeypatch):
    # NumPy < 2.0 has no bitwise_count; the byte-table route must give the same integers.
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (2, 9, 1, 4), dtype=np.uint8)
    b = rng.integers(0, 256, (2, 1, 5, 4), dtype=np.uint8)
    monkeypatch.delattr(np, "bitwise_count")
    got = hamming(a, b)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, bit_count_distance(a, b))
