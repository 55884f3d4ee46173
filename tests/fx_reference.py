"""float64 NumPy evaluation of cupyops.fx trees: what a fused kernel must compute."""
from __future__ import annotations

import numpy
from scipy import special

from cupyops import fx
from cupyops.dtypes import BFLOAT16


def _relu(x):
    return numpy.where(numpy.isnan(x), x, numpy.maximum(x, 0)) if x.dtype.kind == "f" else numpy.maximum(x, 0)


def _sigmoid(x):
    with numpy.errstate(over="ignore"):
        return 1.0 / (1.0 + numpy.exp(-x))


FUNCTIONS = {
    "exp": numpy.exp, "log": numpy.log, "tanh": numpy.tanh, "erf": special.erf,
    "rsqrt": lambda x: 1.0 / numpy.sqrt(x), "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1.0 + special.erf(x / numpy.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + numpy.tanh(numpy.sqrt(2.0 / numpy.pi) * (x + 0.044715 * x ** 3))),
    "relu": _relu, "abs": numpy.abs, "maximum": numpy.maximum, "minimum": numpy.minimum,
    "add": numpy.add, "subtract": numpy.subtract, "multiply": numpy.multiply,
    "divide": numpy.true_divide, "power": numpy.power,
    "less": numpy.less, "less_equal": numpy.less_equal, "greater": numpy.greater,
    "greater_equal": numpy.greater_equal, "equal": numpy.equal, "not_equal": numpy.not_equal,
    "negative": numpy.negative,
}


# Kernels compute these in float32 with subnormals flushed to zero (CuPy compiles every
# kernel with -ftz=true): a subnormal input reads as a zero of its sign.
FLUSHED = (numpy.dtype(numpy.float32), BFLOAT16)
FLOAT32_TINY = numpy.finfo(numpy.float32).tiny


def _compute(dtype):
    """float64 for floats (bfloat16 among them: its NumPy kind is "V"), the dtype itself for
    integers and bool (exact)."""
    return numpy.float64 if numpy.dtype(dtype).kind == "f" or numpy.dtype(dtype) == BFLOAT16 else dtype


def evaluate(node: fx.Node, values: list, shape: tuple, keep=None):
    """node over operand values (NumPy arrays or numbers), in float64 (integers exact).
    keep(p, seed, offset, shape) gives a dropout node's mask."""
    def dropout(x, p, seed, offset):
        return numpy.where(keep(p, seed, offset, shape), numpy.asarray(x, numpy.float64) / (1.0 - p), 0.0)

    def convert(n, value):
        if n.type.weak:
            return value
        value = numpy.asarray(value).astype(_compute(n.dtype))
        if n.op == "operand" and n.dtype in FLUSHED:
            value = numpy.where(numpy.abs(value) < FLOAT32_TINY, 0.0 * value, value)
        return value

    functions = {**FUNCTIONS, "dropout": dropout, "cast": lambda x, dtype: numpy.asarray(x).astype(dtype),
                 "where": lambda c, a, b: numpy.where(numpy.asarray(c).astype(bool), a, b)}
    with numpy.errstate(all="ignore"):
        (result,) = fx.evaluate((node,), values, functions, convert)
    return numpy.broadcast_to(result, shape)


def rounded(reference, dtype):
    """The float64 reference rounded to the output dtype (overflow to inf as the kernel's store
    does), back in float64 for comparison."""
    with numpy.errstate(all="ignore"):
        return numpy.asarray(reference).astype(dtype).astype(_compute(dtype))
