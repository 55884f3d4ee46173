"""The exact NumPy reference of conv2d_int8: int32 accumulators by im2col,
the epilogue in float64, int8 rounded half to even and saturated. Plain NCHW /
KCRS arrays in and out, independent of the kernel's layouts."""
from __future__ import annotations

import numpy


def accumulators(x_nchw, w_kcrs, stride=(1, 1), padding=(0, 0), dilation=(1, 1)) -> numpy.ndarray:
    """int32 (N, K, OH, OW): sum over c, fh, fw of x[n, c, ih, iw] * w[k, c, fh, fw] (im2col)."""
    x = numpy.asarray(x_nchw, dtype=numpy.float64)
    w = numpy.asarray(w_kcrs, dtype=numpy.float64)
    n, c, h, width = x.shape
    k, _, r, s = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh = (h + 2 * ph - dh * (r - 1) - 1) // sh + 1
    ow = (width + 2 * pw - dw * (s - 1) - 1) // sw + 1
    padded = numpy.zeros((n, c, h + 2 * ph, width + 2 * pw))
    padded[:, :, ph:ph + h, pw:pw + width] = x
    columns = numpy.empty((n, c, r, s, oh, ow))   # im2col
    for fh in range(r):
        for fw in range(s):
            columns[:, :, fh, fw] = padded[:, :, fh * dh: fh * dh + sh * (oh - 1) + 1: sh,
                                           fw * dw: fw * dw + sw * (ow - 1) + 1: sw]
    # float64 sums of int8 products are exact far past int32's range
    acc = numpy.einsum("ncrsyx,kcrs->nkyx", columns, w, optimize=True)
    return numpy.rint(acc).astype(numpy.int64).astype(numpy.int32)


def epilogue(acc, alpha=1.0, beta=1.0, gamma=0.0, bias=None, z=None, relu=False) -> numpy.ndarray:
    """float64 alpha * acc + beta * bias + gamma * z, then ReLU; acc (N, K, OH, OW),
    alpha a scalar or (K,), bias (K,), z (N, K, OH, OW)."""
    channel = (1, -1, 1, 1)
    value = numpy.asarray(alpha, dtype=numpy.float64).reshape(channel if numpy.ndim(alpha) else ()) * acc
    if bias is not None:
        value = value + beta * numpy.asarray(bias, dtype=numpy.float64).reshape(channel)
    if z is not None:
        value = value + gamma * numpy.asarray(z, dtype=numpy.float64)
    return numpy.maximum(value, 0.0) if relu else value


def quantize(value) -> numpy.ndarray:
    """float64 -> int8: round half to even, saturate."""
    return numpy.clip(numpy.rint(value), -128, 127).astype(numpy.int8)


def int8_mismatches(actual, value, window: float = 1e-4) -> numpy.ndarray:
    """Coordinates where int8 `actual` differs from quantize(value), except by one
    where the float64 value lies within `window` of a rounding boundary."""
    actual = numpy.asarray(actual).astype(numpy.int64)
    expected = quantize(value).astype(numpy.int64)
    near_boundary = numpy.abs(numpy.abs(value - numpy.floor(value)) - 0.5) < window
    allowed = near_boundary & (numpy.abs(actual - expected) <= 1)
    return numpy.argwhere((actual != expected) & ~allowed)
