"""Philox4x32-10 and the dropout keep mask in NumPy: the reference of kernels/philox.cuh.

Element i of a tensor is kept iff 16-bit half (n & 7) of Philox(counter = (lo, hi of
n >> 3, 0, 0), key = (lo, hi of seed)) is >= round(p * 2^16), n = i + offset; half h is the
(h & 1)-th half, low first, of word h >> 1. One Philox call serves eight elements; the
dropped fraction is threshold / 2^16, p rounded to a multiple of 2^-16.
"""
from __future__ import annotations

import struct

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> np.ndarray:
    """Random123's philox4x32_10: uint32 counters (..., 4) and keys (..., 2) -> (..., 4)."""
    counter = np.asarray(counter, dtype=np.uint32)
    key = np.asarray(key, dtype=np.uint32)
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[..., 0].copy(), key[..., 1].copy()
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0, p1 = _M0 * c[0], _M1 * c[2]
            c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0.astype(np.uint64), p1 & _LOW,
                 (p0 >> np.uint64(32)) ^ c[3] ^ k1.astype(np.uint64), p0 & _LOW]
            k0, k1 = k0 + _W0, k1 + _W1
    return np.stack([w.astype(np.uint32) for w in c], axis=-1)


def round_keys(seed: int) -> np.ndarray:
    """The ten round keys of `seed`'s Philox key as kernels/philox.cuh's RoundKeys lays them out:
    uint32 (20,), the low words key_lo + r * W0 then the high words key_hi + r * W1 (mod 2^32)."""
    seed = int(seed) % 2 ** 64
    rounds = np.arange(10, dtype=np.uint64)
    low = (np.uint64(seed & 0xFFFFFFFF) + rounds * np.uint64(_W0)) & _LOW
    high = (np.uint64(seed >> 32) + rounds * np.uint64(_W1)) & _LOW
    return np.concatenate([low, high]).astype(np.uint32)


_ROUND_KEY_WORDS = struct.Struct("=20I")


def round_key_bytes(seed: int) -> bytes:
    """round_keys(seed).tobytes(), in plain integers: a launch with a fresh seed pays for it."""
    seed = int(seed) % 2 ** 64
    low, high = seed & 0xFFFFFFFF, seed >> 32
    return _ROUND_KEY_WORDS.pack(*[(low + r * 0x9E3779B9) & 0xFFFFFFFF for r in range(10)],
                                 *[(high + r * 0xBB67AE85) & 0xFFFFFFFF for r in range(10)])


def check_dropout(p, name: str = "dropout") -> float:
    """p as a float, or ValueError naming `name` unless 0 <= p < 1."""
    p = float(p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return p


def dropout_threshold(p) -> int:
    """round(p * 2^16) (half to even), at most 2^16 - 1: the smallest Philox half of a kept
    element (ValueError unless 0 <= p < 1)."""
    return min(round(check_dropout(p, "p") * 2.0 ** 16), 2 ** 16 - 1)


def keep_mask_reference(size: int, p, seed: int, offset: int = 0) -> np.ndarray:
    """The boolean keep mask of linear indices 0..size-1 (what the kernels apply)."""
    threshold = np.uint32(dropout_threshold(p))
    n = np.arange(size, dtype=np.uint64) + np.uint64(offset)
    groups, halves = n >> np.uint64(3), n & np.uint64(7)
    first = int(offset) >> 3
    unique = np.arange(first, first + (size + 7) // 8 + 1, dtype=np.uint64)
    counter = np.zeros(unique.shape + (4,), dtype=np.uint32)
    counter[:, 0] = (unique & _LOW).astype(np.uint32)
    counter[:, 1] = (unique >> np.uint64(32)).astype(np.uint32)
    key = np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], dtype=np.uint32)
    words = philox4x32_10(counter, np.broadcast_to(key, unique.shape + (2,)))
    word = words[(groups - np.uint64(first)).astype(np.intp), (halves >> np.uint64(1)).astype(np.intp)]
    half = (word >> ((halves & np.uint64(1)) * np.uint64(16)).astype(np.uint32)) & np.uint32(0xFFFF)
    return half >= threshold
