"""cupyops.launch's host helpers that kernels rely on."""
from __future__ import annotations

import numpy
import pytest

from cupyops.launch import fast_divisor


def fast_quotient(n: int, multiplier: int, shift: int) -> int:
    """kernels/common.cuh's fast_quotient: (n * multiplier >> 32) >> shift."""
    return ((n * multiplier) >> 32) >> shift


@pytest.mark.parametrize("seed", range(4))
def test_fast_divisor_divides_every_31_bit_dividend(seed):
    """fast_quotient with fast_divisor(d) gives n // d for 0 <= n < 2**31: divisors small, near
    powers of two, those the elementwise kernels meet and random ones; dividends at the edges (0,
    multiples of d and their neighbours, 2**31 - 1) and random."""
    rng = numpy.random.default_rng(seed)
    divisors = [*range(2, 600), *(2 ** k + e for k in range(1, 32) for e in (-1, 0, 1)), 1031, 8192, 12345,
                2 ** 20 + 1, *(int(d) for d in rng.integers(2, 2 ** 31, 600))]
    for d in divisors:
        if not 2 <= d < 2 ** 31:
            continue
        multiplier, shift = fast_divisor(d)
        assert 0 < multiplier < 2 ** 32 and 0 <= shift < 32
        edges = [0, 1, d - 1, d, d + 1, 2 ** 31 - 2, 2 ** 31 - 1,
                 *(k * d + r for k in (2, 3, (2 ** 31 - 1) // d) for r in (-1, 0, 1))]
        for n in [*edges, *(int(n) for n in rng.integers(0, 2 ** 31, 40))]:
            if 0 <= n < 2 ** 31:
                assert fast_quotient(n, multiplier, shift) == n // d, (n, d)


@pytest.mark.parametrize("d", [0, 1, 2 ** 31])
def test_fast_divisor_refuses_what_it_cannot_divide_by(d):
    with pytest.raises(ValueError):
        fast_divisor(d)
