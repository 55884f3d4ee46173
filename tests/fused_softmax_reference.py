"""float64 NumPy references of cupyops.fused_softmax and fused_softmax_backward."""
from __future__ import annotations

import numpy

from cupyops import philox


def masked_positions(shape, mask=None, causal=False, diagonal=0):
    """True where a score is dropped: ~mask (broadcast), or col > row + diagonal (causal)."""
    dropped = numpy.zeros(shape, dtype=bool)
    if mask is not None:
        dropped |= ~numpy.broadcast_to(numpy.asarray(mask, dtype=bool), shape)
    if causal:
        rows, cols = shape[-2], shape[-1]
        dropped |= numpy.arange(cols)[None, :] > numpy.arange(rows)[:, None] + diagonal
    return dropped


def scores(x, scale=1.0, bias=None, mask=None, causal=False, diagonal=0):
    """(z, dropped): z = x * scale + bias in float64, -inf where dropped."""
    z = numpy.asarray(x, dtype=numpy.float64) * scale
    if bias is not None:
        z = z + numpy.asarray(bias, dtype=numpy.float64)
    dropped = masked_positions(z.shape, mask, causal, diagonal)
    return numpy.where(dropped, -numpy.inf, z), dropped


def keep_scale(shape, dropout, seed, offset):
    """keep / (1 - p) per element (1 without dropout)."""
    if dropout == 0:
        return numpy.ones(shape)
    keep = philox.keep_mask_reference(int(numpy.prod(shape)), dropout, seed, offset).reshape(shape)
    return keep / (1.0 - dropout)


def forward(x, scale=1.0, bias=None, mask=None, causal=False, diagonal=0, dropout=0.0, seed=0, offset=0):
    """(y, lse) over the last axis: masked positions 0, rows with none kept all 0, lse -inf there."""
    z, dropped = scores(x, scale, bias, mask, causal, diagonal)
    with numpy.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = z.max(axis=-1, keepdims=True)
        e = numpy.exp(z - m)
        s = e.sum(axis=-1, keepdims=True)
        y = numpy.where(dropped, 0.0, e / s)
        lse = numpy.where(m == -numpy.inf, -numpy.inf, m + numpy.log(s))[..., 0]
    kept = keep_scale(y.shape, dropout, seed, offset)
    return numpy.where(kept == 0, 0.0, y * kept), lse       # a dropped element is 0, NaN rows too


def backward(dy, x, scale=1.0, bias=None, mask=None, causal=False, diagonal=0, dropout=0.0, seed=0, offset=0):
    """dx of forward's y w.r.t. x, by the softmax's Jacobian in float64, the
    probabilities exp(z - lse) (0 where z or lse is -inf) as the kernels recompute them."""
    z, _ = scores(x, scale, bias, mask, causal, diagonal)
    lse = forward(x, scale, bias, mask, causal, diagonal)[1][..., None]
    with numpy.errstate(invalid="ignore"):
        y = numpy.where((z == -numpy.inf) | (lse == -numpy.inf), 0.0, numpy.exp(z - lse))
    dp = numpy.asarray(dy, dtype=numpy.float64) * keep_scale(y.shape, dropout, seed, offset)
    dz = y * (dp - (dp * y).sum(axis=-1, keepdims=True))
    return scale * dz
