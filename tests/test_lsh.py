"""SimHash codes, bit packing and Hamming distances (HashEvict Eqs. 2-3)."""

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refkv.lsh import gaussian_planes, hamming, hamming_unpacked, pack_codes, simhash, unpack_codes

# Zero or 1e-6 <= |x| <= 10: far from the subnormal range, where scaling is not exact.
FLOATS = st.one_of(st.just(0.0), st.builds(lambda m, s: m * s, st.floats(1e-6, 10), st.sampled_from([-1.0, 1.0])))


def bits(shape):
    return hnp.arrays(np.bool_, shape)


# -- planes ---------------------------------------------------------------------------------

def test_planes_are_seeded_gaussian():
    a = gaussian_planes(16, 8, seed=3)
    assert a.shape == (16, 8) and a.dtype == np.float64
    np.testing.assert_array_equal(a, gaussian_planes(16, 8, seed=3))
    assert not np.array_equal(a, gaussian_planes(16, 8, seed=4))
    # float32 planes are the float64 draws rounded, so both dtypes hash nearly alike.
    np.testing.assert_array_equal(gaussian_planes(16, 8, seed=3, dtype=np.float32), a.astype(np.float32))
    # Standard normal entries: over 40,000 draws mean ~ 0 +- 0.005, variance ~ 1 +- 0.007 (1 sigma).
    big = gaussian_planes(200, 200, seed=0)
    assert abs(big.mean()) < 0.03 and abs(big.var() - 1.0) < 0.04


@pytest.mark.parametrize(("n_bits", "d"), [(0, 4), (4, 0), (-1, 4), (True, 4), (2.0, 4)])
def test_planes_reject_bad_sizes(n_bits, d):
    with pytest.raises(ValueError, match=r"(n_bits|d) must"):
        gaussian_planes(n_bits, d)


# -- simhash ----------------------------------------------------------------------------------

PLANES = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, -1.0]])


@pytest.mark.parametrize(("x", "expected"), [
    ([2.0, -1.0], [True, False, True, True]),      # R x = (2, -1, 1, 3)
    ([-1.0, 1.0], [False, True, True, False]),     # R x = (-1, 1, 0, -2): H(0) = 1
    ([1.0, 1.0], [True, True, True, True]),        # R x = (1, 1, 2, 0)
    ([0.0, 0.0], [True, True, True, True]),        # the zero vector hashes to all ones
    ([-0.0, -3.0], [True, False, False, True]),    # -0.0 counts as zero: (−0, −3, −3, 3)
])
def test_simhash_by_hand(x, expected):
    np.testing.assert_array_equal(simhash(np.array(x), PLANES), expected)


def test_simhash_batches_and_dtypes():
    x = np.array([[[2.0, -1.0], [-1.0, 1.0]]])
    codes = simhash(x, PLANES)
    assert codes.shape == (1, 2, 4) and codes.dtype == np.bool_
    np.testing.assert_array_equal(codes[0, 1], [False, True, True, False])
    np.testing.assert_array_equal(simhash(x.astype(np.float32), PLANES), codes)


def test_simhash_rejects_bad_input():
    with pytest.raises(ValueError, match="finite"):
        simhash(np.array([np.nan, 1.0]), PLANES)
    with pytest.raises(ValueError, match="shape"):
        simhash(np.ones(3), PLANES)
    with pytest.raises(ValueError, match="planes"):
        simhash(np.ones(2), np.ones(2))


@given(x=hnp.arrays(np.float64, (5, 6), elements=FLOATS), exponent=st.integers(-20, 20), seed=st.integers(0, 99))
def test_simhash_invariant_to_power_of_two_scaling(x, exponent, seed):
    """Scaling by 2^e is exact in floating point, so the codes are exactly equal."""
    planes = gaussian_planes(24, 6, seed=seed)
    np.testing.assert_array_equal(simhash(x * 2.0**exponent, planes), simhash(x, planes))


@given(x=hnp.arrays(np.float64, (6,), elements=FLOATS), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 99))
def test_simhash_invariant_to_positive_scaling(x, scale, seed):
    """Any positive scale, away from projections that rounding could flip."""
    planes = gaussian_planes(32, 6, seed=seed)
    margin = np.abs(planes @ x)
    assume(margin.min() > 1e-9 * (np.abs(planes) @ np.abs(x)).max())
    np.testing.assert_array_equal(simhash(scale * x, planes), simhash(x, planes))


def test_hamming_estimates_the_angle():
    """Eq. 3: E[d_H(h(x), h(y))] / c = theta / pi, checked with 20,000 seeded planes.

    The fraction of differing bits is a mean of 20,000 Bernoulli(theta/pi) draws, so its
    standard deviation is at most 0.0036; the tolerance is 5 sigma.
    """
    planes = gaussian_planes(20000, 3, seed=7)
    x = np.array([1.0, 0.0, 0.0])
    for theta in (0.1, math.pi / 3, math.pi / 2, 2.5, math.pi):
        y = np.array([math.cos(theta), math.sin(theta), 0.0])
        fraction = hamming_unpacked(simhash(x, planes), simhash(y, planes)) / 20000
        assert abs(fraction - theta / math.pi) < 0.018


# -- packing ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "packed"), [
    ([1, 0, 0, 0, 0, 0, 0, 0], [1]),
    ([0, 0, 0, 0, 0, 0, 0, 1], [128]),
    ([1, 0, 0, 0, 0, 0, 0, 0, 1, 1], [1, 3]),   # bit j -> byte j // 8, value 1 << (j % 8)
    ([0, 1, 1], [6]),                            # padding bits are zero
    ([1] * 16, [255, 255]),
])
def test_pack_by_hand(code, packed):
    code = np.array(code, dtype=bool)
    got = pack_codes(code)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, packed)
    np.testing.assert_array_equal(unpack_codes(got, len(code)), code)


def test_packed_bytes_are_the_little_endian_integer():
    """The packed code is the little-endian byte string of sum_j b_j 2^j."""
    code = np.array([1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1], dtype=bool)
    value = sum(1 << j for j, bit in enumerate(code) if bit)
    assert pack_codes(code).tobytes() == value.to_bytes(2, "little")


@given(codes=st.integers(1, 40).flatmap(lambda c: bits((3, 2, c))))
def test_pack_unpack_round_trip(codes):
    packed = pack_codes(codes)
    assert packed.shape == (3, 2, math.ceil(codes.shape[-1] / 8))
    np.testing.assert_array_equal(unpack_codes(packed, codes.shape[-1]), codes)


def test_packing_rejects_bad_input():
    with pytest.raises(ValueError, match="bool"):
        pack_codes(np.array([1, 0]))
    with pytest.raises(ValueError, match="n_bits"):
        pack_codes(np.zeros((2, 0), dtype=bool))
    with pytest.raises(ValueError, match="shape"):
        unpack_codes(np.zeros(2, dtype=np.uint8), 20)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(np.zeros(2, dtype=np.int64), 16)
    with pytest.raises(ValueError, match="n_bits"):
        unpack_codes(np.zeros(1, dtype=np.uint8), 0)


# -- Hamming distance -------------------------------------------------------------------------

def test_hamming_by_hand():
    assert hamming(np.array([0b10101010], np.uint8), np.array([0b01010101], np.uint8)) == 8
    assert hamming(np.array([255, 1], np.uint8), np.array([0, 0], np.uint8)) == 9
    assert hamming(np.array([7, 0], np.uint8), np.array([7, 0], np.uint8)) == 0
    a = np.array([True, False, True])
    b = np.array([False, False, True])
    assert hamming_unpacked(a, b) == 1
    assert hamming(pack_codes(a), pack_codes(b)) == 1


def test_hamming_broadcasts():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, (3, 1, 12)).astype(bool)
    b = rng.integers(0, 2, (1, 4, 12)).astype(bool)
    got = hamming(pack_codes(a), pack_codes(b))
    assert got.shape == (3, 4) and got.dtype == np.int64
    for i in range(3):
        for j in range(4):
            assert got[i, j] == sum(int(x != y) for x, y in zip(a[i, 0], b[0, j]))


@given(data=st.data(), n_bits=st.integers(1, 70))
def test_packed_hamming_equals_unpacked_count(data, n_bits):
    a = data.draw(bits((4, n_bits)))
    b = data.draw(bits((4, n_bits)))
    expected = [sum(int(x != y) for x, y in zip(ra, rb)) for ra, rb in zip(a, b)]
    np.testing.assert_array_equal(hamming_unpacked(a, b), expected)
    np.testing.assert_array_equal(hamming(pack_codes(a), pack_codes(b)), expected)


def test_hamming_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        hamming(np.zeros(2, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="last axis"):
        hamming(np.zeros(2, np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="bool"):
        hamming_unpacked(np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="last axis"):
        hamming_unpacked(np.zeros(2, bool), np.zeros(3, bool))
