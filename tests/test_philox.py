"""Philox4x32-10 known answers (Random123's kat_vectors) and the dropout keep rule, on the CPU."""
from __future__ import annotations

import numpy
import pytest

from cupyops import philox

# (counter, key) -> output, from Random123's kat_vectors for philox4x32_10.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
    assert tuple(int(v) for v in philox.philox4x32_10(counter, key)) == expected


def test_vectorised_matches_one_at_a_time():
    counters = numpy.array([vector[0] for vector in KNOWN_ANSWERS], dtype=numpy.uint32)
    keys = numpy.array([vector[1] for vector in KNOWN_ANSWERS], dtype=numpy.uint32)
    expected = numpy.array([vector[2] for vector in KNOWN_ANSWERS], dtype=numpy.uint32)
    numpy.testing.assert_array_equal(philox.philox4x32_10(counters, keys), expected)


def test_keep_rule_half_by_half():
    """Element n takes 16-bit half n & 7 (low half of word 0 first) of Philox(counter = n >> 3,
    key = seed) against round(p 2^16)."""
    seed, p = (0x12345678 << 32) | 0x9ABCDEF0, 0.37
    keep = philox.keep_mask_reference(64, p, seed)
    key = numpy.array([seed & 0xFFFFFFFF, seed >> 32], dtype=numpy.uint32)
    for n in range(64):
        words = philox.philox4x32_10(numpy.array([n >> 3, 0, 0, 0], dtype=numpy.uint32), key)
        half = (int(words[(n & 7) // 2]) >> (16 * (n & 1))) & 0xFFFF
        assert keep[n] == (half >= round(p * 2 ** 16))


@pytest.mark.parametrize("offset", [1, 2, 3, 5, 2 ** 33 + 3])
def test_offset_shifts_the_counter(offset):
    shifted = philox.keep_mask_reference(1000, 0.5, 11, offset)
    if offset < 2 ** 20:
        whole = philox.keep_mask_reference(1000 + offset, 0.5, 11)
        numpy.testing.assert_array_equal(shifted, whole[offset:])
    else:
        assert 0.4 < shifted.mean() < 0.6


def test_threshold():
    assert philox.dropout_threshold(0) == 0
    assert philox.dropout_threshold(0.5) == 2 ** 15
    assert philox.dropout_threshold(0.1) == 6554                 # 6553.6 rounds up
    assert philox.dropout_threshold(3 / 2 ** 17) == 2            # half to even
    assert philox.dropout_threshold(numpy.nextafter(1, 0)) == 2 ** 16 - 1
    assert philox.keep_mask_reference(100, 0.0, 3).all()
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="p"):
            philox.dropout_threshold(bad)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_5_sigma(p):
    size = 10 ** 7
    kept = philox.keep_mask_reference(size, p, seed=2024, offset=7).sum()
    sigma = (size * p * (1 - p)) ** 0.5
    assert abs(kept - size * (1 - p)) < 5 * sigma


@pytest.mark.parametrize("seed", [0, 7, 2 ** 32 + 3, 2 ** 64 - 1])
def test_round_keys_are_the_key_schedule(seed):
    """RoundKeys: round r's key is (low + r * W0, high + r * W1) mod 2^32, as the rounds add them."""
    keys = philox.round_keys(seed)
    assert keys.dtype == numpy.uint32 and keys.shape == (20,)
    low, high = seed & 0xFFFFFFFF, seed >> 32
    assert [int(k) for k in keys[:10]] == [(low + r * 0x9E3779B9) % 2 ** 32 for r in range(10)]
    assert [int(k) for k in keys[10:]] == [(high + r * 0xBB67AE85) % 2 ** 32 for r in range(10)]


@pytest.mark.parametrize("seed", [0, 7, 2 ** 31 - 1, 2 ** 32 + 3, 2 ** 64 - 1, 2 ** 64 + 5, -1])
def test_round_key_bytes_are_round_keys(seed):
    """What a launch packs: the round keys' bytes, seeds taken mod 2^64 either way."""
    assert philox.round_key_bytes(seed) == philox.round_keys(seed).tobytes()

