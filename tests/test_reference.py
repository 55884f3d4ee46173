"""CPU check that the float64 references of the GPU tests are scipy.special's
softmax / log_softmax, on random data and on rows holding NaN and +-inf."""
from __future__ import annotations

import numpy
import pytest
from test_softmax_gpu import reference_log_softmax, reference_softmax

special = pytest.importorskip("scipy.special")

PAIRS = [(reference_softmax, "softmax"), (reference_log_softmax, "log_softmax")]
PAIR_IDS = ["softmax", "log_softmax"]


def agree(reference, name, x, axis):
    with numpy.errstate(all="ignore"):
        expected = getattr(special, name)(x, axis=axis)
    actual = reference(x, axis=axis)
    assert actual.dtype == numpy.float64 and actual.shape == numpy.shape(x)
    numpy.testing.assert_allclose(actual, expected, rtol=1e-15, atol=0, equal_nan=True)
    numpy.testing.assert_array_equal(numpy.isnan(actual), numpy.isnan(expected))
    numpy.testing.assert_array_equal(numpy.isinf(actual), numpy.isinf(expected))


@pytest.mark.parametrize("reference, name", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("shape, axis", [
    ((7, 33), -1), ((7, 33), 0), ((7, 33), None), ((3, 4, 5), (0, 2)), ((3, 4, 5), (1, 2)),
    ((2, 3, 4, 5), 1), ((1000,), 0), ((1,), None),
])
def test_random_data(reference, name, shape, axis):
    x = numpy.random.default_rng().standard_normal(shape) * 4
    agree(reference, name, x, axis)
    agree(reference, name, x + 1000, axis)


@pytest.mark.parametrize("reference, name", PAIRS, ids=PAIR_IDS)
def test_special_values(reference, name):
    inf, nan = numpy.inf, numpy.nan
    rows = numpy.array([
        [0.5, -1.0, 2.0, 3.0],
        [0.5, nan, 2.0, 3.0],          # NaN: the whole row is NaN
        [0.5, inf, 2.0, 3.0],          # +inf: softmax NaN; log-softmax -inf, and NaN at +inf
        [0.5, -inf, 2.0, 3.0],         # -inf: 0 / -inf there
        [-inf, -inf, -inf, -inf],      # all -inf: NaN
        [inf, -inf, 1.0, 2.0],
        [inf, inf, 1.0, 2.0],
        [inf, 1.0, 2.0, nan],
    ])
    agree(reference, name, rows, -1)
    agree(reference, name, rows.T, 0)
    # a few facts the GPU tests rely on, spelled out
    with numpy.errstate(all="ignore"):
        result = reference(rows, axis=-1)
    assert numpy.isnan(result[1]).all() and numpy.isnan(result[4]).all()
    if name == "softmax":
        assert numpy.isnan(result[2]).all() and result[3, 1] == 0
    else:
        assert numpy.isneginf(result[2, [0, 2, 3]]).all() and numpy.isnan(result[2, 1])
        assert numpy.isneginf(result[3, 1])


@pytest.mark.parametrize("reference, name", PAIRS, ids=PAIR_IDS)
def test_integers_and_scalars(reference, name):
    x = numpy.arange(-6, 6, dtype=numpy.int32).reshape(3, 4)
    agree(reference, name, x, 1)
    agree(reference, name, numpy.float64(2.5), None)
    assert reference(numpy.float64(2.5)).shape == ()
