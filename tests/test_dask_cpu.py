"""CPU tests of cupyops.dask (no GPU): graphs, chunking and rechunking rules, meta and
dtype, refusal of NumPy-chunked arrays.

Graphs are built over Dask arrays whose meta is a CuPy array (made without a GPU:
dask_chunks.cupy_meta) and whose blocks, when computed here, are NumPy arrays; the
single-array ops are then replaced by float64 NumPy references (fixture
`numpy_kernels`), so that the graphs really run: block decomposition, rechunks,
dropout's per-block offsets and causal diagonals, the fixed-order sums of norm
gradients and the batch split of the convolution are checked against the reference
over the whole array. On a machine without a GPU (CI) building a graph that touched
the GPU would raise.
"""
from __future__ import annotations

import itertools
import math
import warnings

import numpy
import pytest
from click.testing import CliRunner
from scipy import special

cupy = pytest.importorskip("cupy")
da = pytest.importorskip("dask.array")
cloudpickle = pytest.importorskip("cloudpickle")

import cupyops  # noqa: E402
import cupyops.dask as cd  # noqa: E402
from cupyops import dask_chunks, dask_cluster, dask_graph, dtypes, fx, philox  # noqa: E402
from cupyops.cli import dask_bench  # noqa: E402
from cupyops.cli.main import main  # noqa: E402
from cupyops.ops import conv_layout, conv_reference, norm_args  # noqa: E402
from cupyops.ops import elementwise as ew  # noqa: E402
from dask.array.core import PerformanceWarning  # noqa: E402

import fused_softmax_reference as fused_ref  # noqa: E402
from fx_reference import evaluate  # noqa: E402

F16, F32, F64 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)


def lazy(values, chunks):
    """A Dask array of `values` in `chunks` that says its chunks are CuPy arrays (its meta);
    computed here, its blocks are the NumPy values."""
    values = numpy.asarray(values)
    return da.from_array(values, chunks=chunks, meta=dask_chunks.cupy_meta(values.dtype, values.ndim))


def compute(*arrays, scheduler="synchronous"):
    return da.compute(*arrays, scheduler=scheduler)


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- NumPy stand-ins of the single-array ops ----------------------------------------------------

def _keep(p, seed, offset, shape):
    return philox.keep_mask_reference(math.prod(shape), p, seed, offset).reshape(shape)


def _softmax(x, axis=None, policy="auto"):
    return special.softmax(x.astype(F64), axis=axis).astype(dtypes.result_dtype(x.dtype))


def _layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False,
                policy="auto"):
    axes = tuple(range(x.ndim - norm_args.normalized_axes(x, axis), x.ndim))
    h = x if residual is None else (x.astype(F64) + residual).astype(x.dtype)
    v = h.astype(F64)
    mean = v.mean(axis=axes, keepdims=True)
    rstd = 1.0 / numpy.sqrt(v.var(axis=axes, keepdims=True) + eps)
    y = (v - mean) * rstd * (1.0 if weight is None else weight) + (0.0 if bias is None else bias)
    lead = x.shape[:x.ndim - len(axes)]
    stats = norm_args.stats_dtype(x.dtype)
    result = (y.astype(x.dtype),) + (() if residual is None else (h,))
    result += (mean.reshape(lead).astype(stats), rstd.reshape(lead).astype(stats)) if return_stats else ()
    return result[0] if len(result) == 1 else result


def _layer_norm_backward(dy, x, mean, rstd, weight=None, *, axis=-1, need_weight_grad=True, need_bias_grad=True,
                         policy="auto"):
    num_axes = norm_args.normalized_axes(x, axis)
    axes, lead = tuple(range(x.ndim - num_axes, x.ndim)), tuple(range(x.ndim - num_axes))
    shape = x.shape[:x.ndim - num_axes] + (1,) * num_axes
    xhat = (x.astype(F64) - mean.reshape(shape)) * rstd.reshape(shape)
    g = dy.astype(F64) * (1.0 if weight is None else weight)
    dx = rstd.reshape(shape) * (g - g.mean(axes, keepdims=True) - xhat * (g * xhat).mean(axes, keepdims=True))
    # the kernels' partials: float32 sums, then x's dtype
    dweight = (dy * xhat).sum(lead, dtype=F32).astype(x.dtype) if need_weight_grad else None
    dbias = dy.sum(lead, dtype=F32).astype(x.dtype) if need_bias_grad else None
    return dx.astype(x.dtype), dweight, dbias


def _fused_softmax(x, *, scale=1.0, bias=None, mask=None, causal=False, diagonal=0, dropout=0.0, seed=0,
                   offset=0, axis=-1, return_lse=False, policy="auto"):
    assert axis % x.ndim == x.ndim - 1, "the stand-in reduces the last axis"
    y, lse = fused_ref.forward(x, scale, bias, mask, causal, diagonal, dropout, seed, offset)
    return (y.astype(x.dtype), lse.astype(F32)) if return_lse else y.astype(x.dtype)


def _bias_dropout_add(x, bias, residual, p, seed, offset=0, *, policy="auto"):
    value = x.astype(F64) + bias
    shape = numpy.broadcast_shapes(value.shape, residual.shape)
    dropped = numpy.where(_keep(p, seed, offset, shape), value / (1.0 - p), 0.0)
    return (residual + dropped).astype(numpy.result_type(x, bias, residual))


class _NumpyFused:
    """cupyops.fuse(fn) evaluated by fx_reference on NumPy operands, traced as the real one."""

    def __init__(self, fn):
        self.traced = ew.fuse(fn)

    def trace(self, kinds):
        return self.traced.trace(kinds)

    def __call__(self, *args, policy="auto"):
        kinds = tuple(ew.ArrayInfo.contiguous(a.dtype, a.shape) if isinstance(a, numpy.ndarray) else type(a)
                      for a in args)
        shape = numpy.broadcast_shapes(*(a.shape for a in args if isinstance(a, numpy.ndarray)))
        results = [evaluate(root, list(args), shape, _keep).astype(root.dtype) for root in self.trace(kinds)]
        return results[0] if len(results) == 1 else tuple(results)


def _conv2d_int8(x, w, bias=None, z=None, *, stride=1, padding=0, dilation=1, alpha=1.0, beta=1.0, gamma=0.0,
                 relu=False, out_dtype="int8", policy="auto"):
    acc = conv_reference.accumulators(conv_layout.from_nchw32(x), conv_layout.from_nchw32(w),
                                      conv_layout.pair(stride, "stride"), conv_layout.pair(padding, "padding"),
                                      conv_layout.pair(dilation, "dilation"))
    value = conv_reference.epilogue(acc, alpha, beta, gamma, bias, None if z is None else conv_layout.from_nchw32(z),
                                    relu)
    out = conv_reference.quantize(value) if out_dtype == "int8" else value.astype(out_dtype)
    return conv_layout.to_nchw32(out)


@pytest.fixture
def numpy_kernels(monkeypatch):
    """The single-array ops replaced by NumPy references while a test builds and runs its graphs."""
    for name, function in (("softmax", _softmax), ("layer_norm", _layer_norm),
                           ("layer_norm_backward", _layer_norm_backward), ("fused_softmax", _fused_softmax),
                           ("bias_dropout_add", _bias_dropout_add), ("fuse", _NumpyFused),
                           ("conv2d_int8", _conv2d_int8)):
        monkeypatch.setattr(cupyops, name, function)


# -- chunk arithmetic ---------------------------------------------------------------------------

@pytest.mark.parametrize("chunks, slab", [
    (((2, 2), (5,)), True), (((1, 1, 1), (2, 3), (4,)), True), (((2, 1), (2, 3), (4,)), False),
    (((4,), (2, 3)), False), (((1, 1), (1, 1), (7,)), True), (((3,),), True), (((1, 2), (3,)), True)])
def test_is_slab(chunks, slab):
    assert dask_chunks.is_slab(chunks) is slab


def test_slab_blocks_are_contiguous_runs():
    """Every block of a slab chunking covers linear indices start .. start + size, start as linear_start says."""
    chunks = ((1, 1, 1), (2, 1, 3), (4,))
    shape = dask_chunks.shape_of(chunks)
    index = numpy.arange(math.prod(shape)).reshape(shape)
    starts = dask_chunks.chunk_starts(chunks)
    for block_id in numpy.ndindex(*(len(c) for c in chunks)):
        block = index[tuple(slice(s[b], s[b] + c[b]) for s, c, b in zip(starts, chunks, block_id))]
        first = dask_chunks.linear_start(starts, shape, block_id)
        numpy.testing.assert_array_equal(block.ravel(), numpy.arange(first, first + block.size))


@pytest.mark.parametrize("chunks, whole, expected", [
    (((4, 4), (3, 3), (5,)), (2,), ((4, 4), (6,), (5,))),            # blocks of 60: cut at 0 gives 120, at 1 15
    (((4, 4), (2,) * 8, (5,)), (2,), ((1,) * 8, (2,) * 8, (5,))),    # 40: at 1 10, at 0 320
    (((2, 2), (3, 3), (5,)), (2,), ((1,) * 4, (3, 3), (5,))),        # 30: 15 and 60, a tie: the deeper cut
    (((4, 4), (2,) * 8, (5,)), (1,), ((4, 4), (16,), (5,))),         # axis 1 must stay whole
    (((2, 2), (3, 3)), (0,), ((4,), (6,))),                          # no cut before the whole axis
])
def test_slab_chunks(chunks, whole, expected):
    slabs = dask_chunks.slab_chunks(chunks, whole)
    assert slabs == expected
    assert dask_chunks.is_slab(slabs)


@pytest.mark.parametrize("old, new, moved", [
    (((4, 4), (6,)), ((4, 4), (6,)), 0),
    (((4, 4), (3, 3)), ((4, 4), (6,)), 48),          # merged along axis 1: every element
    (((4, 4), (6,)), ((2, 2, 2, 2), (6,)), 0),       # split: views
    (((4, 4), (6,)), ((2, 4, 2), (6,)), 24),         # the middle chunk straddles a boundary
])
def test_moved_bytes(old, new, moved):
    assert dask_chunks.moved_bytes(old, new, 1) == moved


def test_meta_needs_no_gpu():
    meta = dask_chunks.cupy_meta(dtypes.result_dtype(numpy.int32), 3)
    assert type(meta) is cupy.ndarray and meta.shape == (0, 0, 0) and meta.dtype == F64


# -- refusals -----------------------------------------------------------------------------------

def _numpy_chunked(shape, dtype=F32):
    return da.zeros(shape, chunks=2, dtype=dtype)


def _gpu_like(shape, dtype=F32):
    return lazy(numpy.zeros(shape, dtype), 2)


REFUSALS = {   # (op, the argument given NumPy chunks): the call
    ("softmax", "x"): lambda bad, ok: cd.softmax(bad(), axis=-1),
    ("log_softmax", "x"): lambda bad, ok: cd.log_softmax(bad(), axis=-1),
    ("softmax_backward", "y"): lambda bad, ok: cd.softmax_backward(ok(), bad()),
    ("log_softmax_backward", "dy"): lambda bad, ok: cd.log_softmax_backward(bad(), ok()),
    ("layer_norm", "x"): lambda bad, ok: cd.layer_norm(bad()),
    ("layer_norm", "residual"): lambda bad, ok: cd.layer_norm(ok(), residual=bad()),
    ("rms_norm", "weight"): lambda bad, ok: cd.rms_norm(ok(), bad((4,))),
    ("layer_norm_backward", "rstd"): lambda bad, ok: cd.layer_norm_backward(ok(), ok(), ok((4,)), bad((4,))),
    ("rms_norm_backward", "dy"): lambda bad, ok: cd.rms_norm_backward(bad(), ok(), ok((4,))),
    ("fused_softmax", "mask"): lambda bad, ok: cd.fused_softmax(ok(), mask=bad((4,), bool)),
    ("fused_softmax_backward", "lse"): lambda bad, ok: cd.fused_softmax_backward(ok(), ok(), bad((4,))),
    ("bias_gelu", "bias"): lambda bad, ok: cd.bias_gelu(ok(), bad((4,))),
    ("swiglu", "a"): lambda bad, ok: cd.swiglu(bad(), ok()),
    ("bias_dropout_add", "residual"): lambda bad, ok: cd.bias_dropout_add(ok(), ok((4,)), bad(), 0.1, 1),
    ("elementwise", "b"): lambda bad, ok: cd.elementwise("a * b", a=ok(), b=bad()),
    ("fuse", "argument 1"): lambda bad, ok: cd.fuse(lambda a, b: a + b)(ok(), bad()),
    ("conv2d_int8", "x"): lambda bad, ok: cd.conv2d_int8(bad((2, 1, 4, 4, 32), numpy.int8),
                                                         ok((32, 1, 1, 1, 32), numpy.int8)),
}


@pytest.mark.parametrize("op, name", sorted(REFUSALS))
def test_numpy_chunks_are_refused_naming_the_argument(op, name):
    with pytest.raises(TypeError, match=rf"^{name} is a Dask array of numpy\.ndarray chunks"):
        REFUSALS[op, name](lambda shape=(4, 4), dtype=F32: _numpy_chunked(shape, dtype),
                           lambda shape=(4, 4), dtype=F32: _gpu_like(shape, dtype))


def test_host_arrays_are_refused():
    with pytest.raises(TypeError, match=r"^x must be a Dask array of CuPy chunks .*got ndarray"):
        cd.softmax(numpy.zeros((2, 3)))
    with pytest.raises(TypeError, match=r"^weight must be a Dask array of CuPy chunks or a CuPy array"):
        cd.layer_norm(_gpu_like((4, 4)), numpy.ones(4, F32))


def test_argument_errors_name_the_argument():
    x = _gpu_like((4, 6))
    with pytest.raises(ValueError, match=r"^weight has shape \(4,\), expected \(6,\)"):
        cd.layer_norm(x, _gpu_like((4,)))
    with pytest.raises(ValueError, match=r"^dy \(\(4, 6\), float32\) and y \(\(4, 5\), float32\)"):
        cd.softmax_backward(x, _gpu_like((4, 5)))
    with pytest.raises(ValueError, match=r"^bias of shape \(5,\) does not broadcast"):
        cd.fused_softmax(x, bias=_gpu_like((5,)))
    with pytest.raises(ValueError, match=r"^causal needs x"):
        cd.fused_softmax(x, causal=True, axis=0)
    with pytest.raises(ValueError, match=r"^dropout must be in \[0, 1\)"):
        cd.fused_softmax(x, dropout=1.0)
    with pytest.raises(ValueError, match=r"^operands cannot be broadcast together: a \(4, 6\), b \(5,\)"):
        cd.swiglu(x, _gpu_like((5,)))
    with pytest.raises(ValueError, match=r"^approximate must be one of"):
        cd.geglu(x, x, approximate="erf")
    with pytest.raises(TypeError, match=r"^unsupported dtype complex64"):
        cd.rms_norm(lazy(numpy.zeros((2, 2), numpy.complex64), 1))


# -- meta, dtype and chunks, nothing computed ---------------------------------------------------

def _assert_lazy(array, shape, dtype, chunks):
    assert isinstance(array, da.Array)
    assert type(array._meta) is cupy.ndarray and array._meta.ndim == len(shape)
    assert (array.shape, array.dtype, array.chunks) == (shape, numpy.dtype(dtype), chunks)


def test_softmax_meta_and_chunks(no_warnings):
    x = lazy(numpy.zeros((6, 4, 5), numpy.int32), (2, 2, 5))
    _assert_lazy(cd.softmax(x, axis=-1), (6, 4, 5), F64, ((2, 2, 2), (2, 2), (5,)))
    y = lazy(numpy.zeros((6, 4, 5), F16), (3, 4, 1))
    _assert_lazy(cd.log_softmax_backward(y, y, axis=1), (6, 4, 5), F16, ((3, 3), (4,), (1,) * 5))


def test_norm_meta_and_chunks(no_warnings):
    x = lazy(numpy.zeros((6, 3, 8), F16), (4, 1, 8))
    chunks = ((4, 2), (1, 1, 1), (8,))
    y, h, mean, rstd = cd.layer_norm(x, lazy(numpy.ones(8, F16), 8), residual=x, return_stats=True)
    _assert_lazy(y, x.shape, F16, chunks)
    _assert_lazy(h, x.shape, F16, chunks)
    for stat in (mean, rstd):
        _assert_lazy(stat, (6, 3), F32, chunks[:2])
    with pytest.warns(PerformanceWarning, match=f"moves {x.nbytes} bytes"):
        y, rstd = cd.rms_norm(x, axis=(1, 2), return_stats=True)
    assert y.chunks == ((4, 2), (3,), (8,)) and rstd.chunks == ((4, 2),) and rstd.dtype == F32
    dx, dweight, dbias = cd.layer_norm_backward(x, x, mean, rstd_of(x), need_bias_grad=True)
    _assert_lazy(dx, x.shape, F16, chunks)
    _assert_lazy(dweight, (8,), F16, ((8,),))
    dx, dweight = cd.rms_norm_backward(x, x, rstd_of(x), need_weight_grad=False)
    assert dweight is None and dx.chunks == chunks


def rstd_of(x):
    return lazy(numpy.ones(x.shape[:-1], F32), x.chunksize[:-1])


def test_fused_softmax_meta_and_chunks(no_warnings):
    x = lazy(numpy.zeros((2, 3, 4, 8), F16), (1, 3, 2, 8))
    y, lse = cd.fused_softmax(x, bias=lazy(numpy.zeros((4, 8), F32), (2, 8)), causal=True, return_lse=True)
    _assert_lazy(y, x.shape, F16, x.chunks)
    _assert_lazy(lse, (2, 3, 4), F32, x.chunks[:3])
    with pytest.warns(PerformanceWarning, match="fused_softmax_backward: rechunking (dy|x|lse) into blocks that"):
        dx = cd.fused_softmax_backward(x, x, lse, causal=True, dropout=0.1, seed=3)
    _assert_lazy(dx, x.shape, F16, ((1, 1), (3,), (4,), (8,)))     # slabs of 96 elements: 48 before


@pytest.mark.parametrize("expr, operands, dtypes", [
    ("a + b", dict(a=F16, b=F32), [F32]),
    ("gelu(a) * b", dict(a=numpy.int32, b=F16), [F64]),
    ("a * 2.0, sigmoid(b)", dict(a=F16, b=F16), [F16, F16]),
])
def test_elementwise_dtypes_follow_the_trace(expr, operands, dtypes):
    values = {name: lazy(numpy.zeros((4, 6), dtype), (2, 3)) for name, dtype in operands.items()}
    result = cd.elementwise(expr, **values)
    results = result if isinstance(result, tuple) else (result,)
    assert [r.dtype for r in results] == dtypes
    for r in results:
        _assert_lazy(r, (4, 6), r.dtype, ((2, 2), (3, 3)))


def test_elementwise_aligns_and_broadcasts_chunks(no_warnings):
    x = lazy(numpy.zeros((6, 8), F16), (4, 3))
    bias = lazy(numpy.zeros((1, 8), F32), (1, 4))
    y = cd.bias_gelu(x, bias)
    _assert_lazy(y, (6, 8), F32, ((4, 2), (3, 1, 2, 2)))


def test_conv2d_int8_meta_and_chunks(no_warnings):
    x = lazy(numpy.zeros((6, 2, 5, 7, 32), numpy.int8), (4, 2, 5, 7, 32))
    w = lazy(numpy.zeros((64, 2, 3, 3, 32), numpy.int8), -1)
    y = cd.conv2d_int8(x, w, padding=1, stride=2, out_dtype="float16")
    _assert_lazy(y, (6, 2, 3, 4, 32), F16, ((4, 2), (2,), (3,), (4,), (32,)))


# -- rechunking rules ---------------------------------------------------------------------------

def test_rowwise_ops_map_blocks_when_the_axis_is_whole(no_warnings):
    x = lazy(numpy.zeros((8, 16), F32), (2, 16))
    y = cd.softmax(x, axis=-1)
    assert y.chunks == x.chunks
    assert len(y.__dask_graph__().layers) == len(x.__dask_graph__().layers) + 1   # no rechunk layer


@pytest.mark.parametrize("op", ["softmax", "layer_norm"])
def test_a_cut_axis_is_rechunked_with_a_warning_of_its_bytes(op):
    x = lazy(numpy.zeros((8, 16), F32), (2, 5))
    with pytest.warns(PerformanceWarning, match=rf"cupyops\.dask\.{op}: rechunking x so that axis 1 lies in one "
                                                rf"chunk moves {8 * 16 * 4} bytes") as caught:
        y = getattr(cd, op)(x, axis=-1)
    assert caught[0].filename == __file__
    assert y.chunks == ((2, 2, 2, 2), (16,))


def test_axes_tuple_rechunks_only_the_cut_axes():
    x = lazy(numpy.zeros((4, 6, 10), F16), (2, 3, 10))
    with pytest.warns(PerformanceWarning, match=rf"axis 1 lies in one chunk moves {4 * 6 * 10 * 2} bytes"):
        y = cd.softmax(x, axis=(1, 2))
    assert y.chunks == ((2, 2), (6,), (10,))


def test_dropout_rechunks_blocks_that_are_not_slabs():
    x = lazy(numpy.zeros((4, 6, 8), F16), (2, 3, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cd.fused_softmax(x).chunks == x.chunks     # no dropout: the blocks stay
    y = cd.fused_softmax(x, dropout=0.2)
    assert y.chunks == ((1, 1, 1, 1), (3, 3), (8,))       # a split: views, no bytes move


def test_dropout_slabs_warn_where_bytes_move():
    x = lazy(numpy.zeros((4, 6, 8), F32), (2, 3, 4))
    with pytest.warns(PerformanceWarning, match=r"bias_dropout_add: rechunking (x|residual) into blocks that are "
                                                r"contiguous runs of the whole array \(dropout's counters\) moves "
                                                f"{x.nbytes} bytes"):
        y = cd.bias_dropout_add(x, lazy(numpy.zeros(8, F32), 8), x, 0.1, 5)
    assert dask_chunks.is_slab(y.chunks)


# -- graphs run on NumPy stand-ins --------------------------------------------------------------

def test_softmax_over_a_cut_axis_equals_the_whole(rng, numpy_kernels):
    values = rng.standard_normal((6, 20)).astype(F32)
    with pytest.warns(PerformanceWarning):
        y = cd.softmax(lazy(values, (4, 7)), axis=-1)
    numpy.testing.assert_array_equal(compute(y)[0], _softmax(values, axis=-1))


def test_layer_norm_outputs_equal_the_whole(rng, numpy_kernels):
    x, residual = rng.standard_normal((2, 9, 16)).astype(F32), rng.standard_normal((2, 9, 16)).astype(F32)
    weight, bias = rng.standard_normal(16).astype(F32), rng.standard_normal(16).astype(F32)
    results = cd.layer_norm(lazy(x, (1, 4, 16)), weight=lazy(weight, 16), bias=lazy(bias, 16),
                            residual=lazy(residual, (2, 3, 16)), return_stats=True)
    expected = _layer_norm(x, weight, bias, residual=residual, return_stats=True)
    for actual, reference in zip(compute(*results), expected):
        numpy.testing.assert_allclose(actual, reference, rtol=1e-6)


def test_norm_gradients_sum_partials_in_a_fixed_order(rng, numpy_kernels):
    # rows of very different scales: a sum in another order rounds differently
    x = (rng.standard_normal((64, 32)) * numpy.logspace(-3, 3, 64)[:, None]).astype(F16)
    dy = rng.standard_normal((64, 32)).astype(F16)
    mean, rstd = (s.astype(F32) for s in (x.astype(F64).mean(-1), 1 / numpy.sqrt(x.astype(F64).var(-1) + 1e-5)))
    dx, dweight, dbias = cd.layer_norm_backward(lazy(dy, (5, 32)), lazy(x, (5, 32)), lazy(mean, 5), lazy(rstd, 5))
    first = compute(dx, dweight, dbias)
    again = compute(dx, dweight, dbias, scheduler="threads")
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()
    assert dweight.dtype == F16 and dweight.shape == (32,)
    # each block's partial in x's dtype, summed in float32 and rounded once: within one float16 ulp of the exact sum
    partials = [_layer_norm_backward(dy[i:i + 5], x[i:i + 5], mean[i:i + 5], rstd[i:i + 5]) for i in range(0, 64, 5)]
    for k, grad in ((1, first[1]), (2, first[2])):
        expected = numpy.sum([p[k].astype(F64) for p in partials], axis=0)
        ulp = numpy.spacing(numpy.abs(expected).astype(F16)).astype(F64)
        assert numpy.all(numpy.abs(grad.astype(F64) - expected) <= ulp)
    numpy.testing.assert_array_equal(first[0], _layer_norm_backward(dy, x, mean, rstd)[0])


@pytest.mark.parametrize("chunks", [(1, 2, 4, 16), (2, 1, 3, 16), (2, 4, 2, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_softmax_dropout_and_causal_match_the_whole(rng, numpy_kernels, chunks, causal):
    x = rng.standard_normal((2, 4, 8, 16)).astype(F32)
    bias = rng.standard_normal((8, 16)).astype(F32)
    kwargs = dict(scale=0.5, causal=causal, diagonal=3, dropout=0.3, seed=11, offset=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        y, lse = cd.fused_softmax(lazy(x, chunks), bias=lazy(bias, (3, 16)), return_lse=True, **kwargs)
    expected_y, expected_lse = _fused_softmax(x, bias=bias, return_lse=True, **kwargs)
    actual_y, actual_lse = compute(y, lse)
    numpy.testing.assert_array_equal(actual_y == 0, expected_y == 0)     # the same dropout and causal masks
    numpy.testing.assert_allclose(actual_y, expected_y, rtol=1e-6)
    numpy.testing.assert_allclose(actual_lse, expected_lse, rtol=1e-6)


def test_bias_dropout_add_matches_the_whole(rng, numpy_kernels):
    x, bias, residual = (rng.standard_normal(s).astype(F32) for s in ((3, 5, 12), (12,), (5, 12)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        y = cd.bias_dropout_add(lazy(x, (2, 2, 12)), lazy(bias, 6), lazy(residual, (3, 4)), 0.4, seed=9, offset=77)
    numpy.testing.assert_array_equal(compute(y)[0], _bias_dropout_add(x, bias, residual, 0.4, 9, 77))


def test_fused_dropout_offset_argument_moves_per_block(rng, numpy_kernels):
    @cd.fuse
    def dropped(a, b, seed, offset):
        return fx.dropout(a * b, 0.25, seed, offset), a - b

    a, b = rng.standard_normal((6, 10)).astype(F32), rng.standard_normal((6, 10)).astype(F32)
    y, diff = dropped(lazy(a, (2, 10)), lazy(b, (3, 10)), 4, 100)
    expected = numpy.where(_keep(0.25, 4, 100, a.shape), a.astype(F64) * b / 0.75, 0.0).astype(F32)
    actual, actual_diff = compute(y, diff)
    numpy.testing.assert_array_equal(actual, expected)
    numpy.testing.assert_array_equal(actual_diff, a - b)


def test_fused_dropout_with_a_constant_offset_is_refused():
    fused = cd.fuse(lambda a: fx.dropout(a, 0.1, 3))
    with pytest.raises(ValueError, match="constant offset over several blocks"):
        fused(lazy(numpy.zeros((4, 4), F32), 2))
    assert fused(lazy(numpy.zeros((4, 4), F32), 4)).shape == (4, 4)    # one block: its counters are the array's


def test_conv2d_int8_splits_the_batch(rng, numpy_kernels):
    x = rng.integers(-128, 128, (5, 1, 6, 6, 32), dtype=numpy.int8)
    w = rng.integers(-128, 128, (32, 1, 3, 3, 32), dtype=numpy.int8)
    z = rng.integers(-128, 128, (5, 1, 6, 6, 32), dtype=numpy.int8)
    bias = rng.standard_normal(32).astype(F32)
    kwargs = dict(padding=1, alpha=1 / 512, gamma=0.5, relu=True)
    with pytest.warns(PerformanceWarning, match="rechunking x"):
        y = cd.conv2d_int8(lazy(x, (2, 1, 3, 6, 32)), lazy(w, -1), lazy(bias, 32), lazy(z, (3, 1, 6, 6, 32)),
                           **kwargs)
    assert y.chunks[0] == (2, 1, 1, 1)      # x's and z's chunks aligned
    numpy.testing.assert_array_equal(compute(y)[0], _conv2d_int8(x, w, bias, z, **kwargs))


class _Tagged(numpy.ndarray):
    """A block that says it is the one the graph made (a copy, as a concatenation makes, is not)."""
    made = False


def _tagged(block):
    block = block.view(_Tagged)
    block.made = True
    return block


def test_conv2d_int8_gets_its_operands_unconcatenated(rng, monkeypatch):
    """w, bias and z reach the op as their blocks, not joined by Dask's concatenation in a task of
    its own (a copy, with CuPy on the thread's current GPU rather than the block's)."""
    data = {"x": rng.integers(-128, 128, (4, 1, 6, 6, 32), dtype=numpy.int8),
            "w": rng.integers(-128, 128, (32, 1, 3, 3, 32), dtype=numpy.int8),
            "bias": rng.standard_normal(32).astype(F32),
            "z": rng.integers(-128, 128, (4, 1, 6, 6, 32), dtype=numpy.int8)}
    kwargs = dict(padding=1, alpha=1 / 512, gamma=0.5)
    made = []

    def kernel(x, w, bias=None, z=None, **options):
        made.append(tuple(getattr(v, "made", False) for v in (w, bias, z)))
        return _conv2d_int8(*(numpy.asarray(v) for v in (x, w, bias, z)), **options)

    monkeypatch.setattr(cupyops, "conv2d_int8", kernel)
    lazies = [lazy(data["x"], (2, 1, 6, 6, 32)), lazy(data["w"], -1), lazy(data["bias"], 32),
              lazy(data["z"], (2, 1, 6, 6, 32))]
    y = cd.conv2d_int8(*(a.map_blocks(_tagged, meta=a._meta) for a in lazies), **kwargs)
    numpy.testing.assert_array_equal(compute(y)[0], _conv2d_int8(*data.values(), **kwargs))
    assert made == [(True, True, True)] * 2


# -- bfloat16 between workers -------------------------------------------------------------------

def _stock_dumps(x):
    """A stand-in of distributed's CuPy serializer: the bytes, and the dtype as the array
    interface's typestr (dtype.str), which for bfloat16 is '<V2'."""
    return {"typestr": x.dtype.str, "shape": x.shape}, [x.tobytes()]


def _stock_loads(header, frames):
    return numpy.frombuffer(frames[0], dtype=header["typestr"]).reshape(header["shape"])


def test_bfloat16_survives_the_serializers_round_trip():
    x = numpy.arange(-6, 6, dtype=numpy.float32).reshape(3, 4).astype(dtypes.BFLOAT16)
    assert _stock_loads(*_stock_dumps(x)).dtype.kind == "V"      # what the workers got: void
    dumps, loads = dask_graph.carrying_dtype(_stock_dumps), dask_graph.restoring_dtype(_stock_loads)
    header, frames = dumps(x)
    restored = loads(header, frames)
    assert restored.dtype == dtypes.BFLOAT16
    numpy.testing.assert_array_equal(restored.astype(F32), x.astype(F32))
    half = x.astype(F16)
    assert dask_graph.DTYPE_HEADER not in dumps(half)[0]     # dtype.str names float16: the header as it was
    assert loads(*dumps(half)).dtype == F16
    assert dask_graph.carrying_dtype(dumps) is dumps and dask_graph.restoring_dtype(loads) is loads


def test_bfloat16_cupy_arrays_keep_their_dtype_through_distributed(monkeypatch):
    """distributed.protocol's serialize / deserialize of a (zero-size, so no GPU) bfloat16 CuPy array
    through its "dask" family, its CuPy functions replaced by the stand-ins and then wrapped."""
    protocol = pytest.importorskip("distributed.protocol")
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    def stock_dumps(x):
        return {"typestr": x.dtype.str, "shape": x.shape}, []

    def stock_loads(header, frames):
        return dask_chunks.cupy_meta(header["typestr"], len(header["shape"]))

    monkeypatch.setitem(dask_serialize._lookup, cupy.ndarray, stock_dumps)
    monkeypatch.setitem(dask_deserialize._lookup, cupy.ndarray, stock_loads)
    x = dask_chunks.cupy_meta(dtypes.BFLOAT16, 2)
    assert protocol.deserialize(*protocol.serialize(x, serializers=("dask",))).dtype.kind == "V"
    for _ in range(2):     # wrapped once, however often
        dask_graph.wrap_serializers(cupy.ndarray, [(dask_serialize, dask_deserialize)])
    assert dask_serialize.dispatch(cupy.ndarray).carries_dtype and dask_deserialize.dispatch(cupy.ndarray).carries_dtype
    restored = protocol.deserialize(*protocol.serialize(x, serializers=("dask",)))
    assert isinstance(restored, cupy.ndarray) and restored.dtype == dtypes.BFLOAT16 and restored.shape == (0, 0)


# -- graphs travel ------------------------------------------------------------------------------

def test_graphs_pickle_for_distributed_workers():
    x = lazy(numpy.zeros((4, 8), F32), (2, 8))
    graphs = [cd.fuse(lambda a: fx.sigmoid(a) * 2.0)(x), cd.softmax(x, axis=-1), cd.swiglu(x, x),
              cd.fused_softmax(x, dropout=0.1, causal=True), cd.layer_norm_backward(x, x, rstd_of(x), rstd_of(x))[1]]
    for graph in graphs:
        restored = cloudpickle.loads(cloudpickle.dumps(dict(graph.__dask_graph__())))
        assert set(restored) == set(graph.__dask_graph__())


# -- the cluster helpers and `cupyops bench dask` -----------------------------------------------

def test_random_normal_is_a_lazy_cupy_array():
    x = dask_cluster.random_normal((1000, 64), (300, 64), F16, seed=2)
    _assert_lazy(x, (1000, 64), F16, ((300, 300, 300, 100), (64,)))
    host = dask_cluster.to_host(x)
    assert type(host._meta) is numpy.ndarray and host.chunks == x.chunks and host.dtype == F16


def test_bench_dask_refuses_what_it_cannot_run():
    result = CliRunner().invoke(main, ["bench", "dask", "--op", "layer_norm,gelu"])
    assert result.exit_code == 2 and "unknown op(s) ['gelu']" in result.output
    result = CliRunner().invoke(main, ["bench", "dask", "--gpus", "1,64"])
    assert result.exit_code == 2 and "this machine has" in result.output


def test_bench_dask_table_gives_scaling_and_the_plain_ratio():
    point = dict(op="softmax", chunk_mib=256, blocks=64)
    result = {"dtype": "float16", "rows": 1 << 20, "cols": 8192, "bytes": 2 << 34, "clusters": {1: "a", 2: "b"},
              "points": [dict(point, gpus=1, seconds=0.02, gbs=1600.0, floor_seconds=0.0125),
                         dict(point, gpus=2, seconds=0.0125, gbs=2560.0)],
              "plain": [dict(op="softmax", gpus=1, rows=1 << 20, seconds=0.0125, gbs=2000.0),
                        dict(op="softmax", gpus=2, rows=1 << 19, seconds=0.00625, gbs=1600.0)]}
    lines = dask_bench.format_table(result).splitlines()
    one, two = (line.split() for line in lines[2:4])
    assert one[-2:] == ["1.00", "0.80"]        # 1600 GB/s on one GPU, the plain op 2000
    assert one[5] == "12.5" and two[5] == "nan"   # the floor, where it was measured
    assert two[-3:] == ["1280", "1.60", "0.80"]   # 2560 GB/s, 1280 a GPU against the plain op's 1600


def test_bench_dask_reruns_a_graph_of_the_same_keys(monkeypatch):
    """Each timed run persists a graph of the same keys as the last: its futures are released and
    the scheduler has forgotten them before the next (cancelling them instead, the scheduler's
    report of the cancellation reaches the next run's futures: FuturesCancelledError)."""
    distributed = pytest.importorskip("distributed")
    monkeypatch.setattr(dask_cluster, "synchronize_workers", lambda client: None)
    with distributed.LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        x = client.persist(da.random.random((2048, 64), chunks=(32, 64)))
        keys = set()
        for _ in range(12):
            graph = (x * 2).sum(axis=1)
            keys.update(graph.__dask_keys__())
            assert dask_bench._persist_seconds(client, graph) > 0
        assert len(keys) == 64 and client.run_on_scheduler(dask_bench._known_tasks, list(keys)) == 0
        assert not any(client.run(dask_bench._held_keys, list(keys)).values())
        assert distributed.futures_of(x) and all(f.status == "finished" for f in distributed.futures_of(x))


def test_bench_dask_reports_what_fails_and_goes_on(monkeypatch):
    """With no GPU, every measurement fails: each is reported and the others still run."""
    distributed = pytest.importorskip("distributed")
    started = []

    def local_cluster(gpus):
        if gpus == 3:
            raise RuntimeError("no such cluster")
        started.append(gpus)
        return distributed.LocalCluster(n_workers=gpus, processes=False, dashboard_address=None), "in-process"

    monkeypatch.setattr(dask_cluster, "local_cluster", local_cluster)
    monkeypatch.setattr(dask_cluster, "synchronize_workers", lambda client: None)
    lines = []
    result = dask_bench.measure(["softmax"], 2 ** -10, 64, [1], [3, 1], F16, 1, lambda r, line: lines.append(line))
    assert started == [1] and result["clusters"] == {1: "in-process"} and not result["points"]
    stages = [(e["gpus"], e["stage"]) for e in result["errors"]]
    assert stages[0] == (3, "cluster") and "RuntimeError: no such cluster" in result["errors"][0]["error"]
    assert (1, "plain") in stages and ((1, "x") in stages or (1, "dask") in stages)
    assert sum(line.startswith("FAILED") for line in lines) == len(result["errors"])
    assert "FAILED (gpus 3, stage cluster): RuntimeError: no such cluster" in dask_bench.format_table(result)


@pytest.mark.parametrize("chain", [1, 3])
def test_bench_dask_measures_every_point(monkeypatch, chain):
    """The whole sweep on in-process clusters, NumPy stand-ins for the GPU parts: every point and
    plain op measured, several runs of each over the same x; a chain of ops counts each op's bytes."""
    distributed = pytest.importorskip("distributed")

    def random_normal(shape, chunks, dtype, seed=0):
        return da.random.default_rng(seed).standard_normal(shape, chunks=chunks).astype(dtype)

    def apply(op, library, x, weight, bias):
        return (x - x.mean(axis=-1, keepdims=True)) * weight + bias if op == "layer_norm" else x * 2

    monkeypatch.setattr(dask_cluster, "local_cluster", lambda gpus: (distributed.LocalCluster(
        n_workers=gpus, processes=False, dashboard_address=None), "in-process"))
    monkeypatch.setattr(dask_cluster, "synchronize_workers", lambda client: None)
    monkeypatch.setattr(dask_cluster, "random_normal", random_normal)
    monkeypatch.setattr(dask_bench, "_apply", apply)
    monkeypatch.setattr(dask_bench, "_plain_seconds", lambda op, rows, cols, dtype, reps: 1e-3)
    monkeypatch.setattr(dask_bench, "_free_pools", lambda: None)
    applied = []
    monkeypatch.setattr(dask_bench, "_apply", lambda *args: applied.append(args[0]) or apply(*args))
    result = dask_bench.measure(["layer_norm", "softmax"], 2 ** -8, 64, [1, 2], [1, 2], F32, 3, chain=chain)
    assert not result["errors"]
    # ops x GPU counts x chunk sizes x runs, each a chain, over x and over the floor's array
    assert len(applied) == 2 * 2 * 2 * 4 * chain * 2
    assert result["bytes"] == 2 * 2 ** -8 * dask_bench.GIB * chain and {p["gbs"] for p in result["plain"]} == \
        {2 ** -7 * dask_bench.GIB / g / 1e-3 / 1e9 for g in (1, 2)}
    assert sorted((p["op"], p["gpus"], p["chunk_mib"], p["blocks"]) for p in result["points"]) == \
        [(op, g, c, 4 // c) for op in ("layer_norm", "softmax") for g in (1, 2) for c in (1, 2)]
    assert len(result["plain"]) == 4 and all(p["floor_seconds"] > 0 for p in result["points"])
    lines = dask_bench.format_table(result).splitlines()
    assert len(lines) == 2 + 8 + 4 and "nan" not in "".join(lines)


def test_local_cluster_workers_import_the_serializers(monkeypatch):
    """The fallback cluster's workers (here on the CPU) import cupyops.dask_graph as they start."""
    distributed = pytest.importorskip("distributed")
    monkeypatch.setattr(dask_cluster, "gpu_count", lambda: 1)
    monkeypatch.setitem(__import__("sys").modules, "dask_cuda", None)     # dask-cuda missing: the fallback
    cluster, started = dask_cluster.local_cluster(1)
    assert started.startswith("distributed.SpecCluster")
    with cluster, distributed.Client(cluster) as client:
        imported = client.run(lambda: "cupyops.dask_graph" in __import__("sys").modules)
    assert list(imported.values()) == [True]


def test_persist_spread_gives_each_worker_an_even_run_of_blocks():
    distributed = pytest.importorskip("distributed")
    x = da.arange(1100, chunks=100).reshape(1100, 1)
    with distributed.LocalCluster(n_workers=3, processes=False, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        spread = dask_cluster.persist_spread(client, x)
        distributed.wait(spread)
        holders = [next(iter(client.who_has(future)[future.key])) for future in distributed.futures_of(spread)]
        runs = [len(list(group)) for _, group in itertools.groupby(holders)]
        assert sorted(runs) == [3, 4, 4] and len(set(holders)) == 3
        numpy.testing.assert_array_equal(spread.compute(), x.compute())


def test_persist_spread_adds_no_task_to_the_graphs_built_on_it():
    """Its blocks are keys in memory: an op over it runs one task a block (a concatenation of the
    runs left in its graph would run one more a block, every time), each where its block is."""
    distributed = pytest.importorskip("distributed")
    x = da.arange(1100, chunks=100).reshape(1100, 1)
    with distributed.LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        spread = dask_cluster.persist_spread(client, x)
        assert set(dict(spread.__dask_graph__())) == {f.key for f in distributed.futures_of(spread)}
        assert len(distributed.futures_of(spread)) == spread.npartitions == 11
        with distributed.get_task_stream(client) as stream:
            doubled = client.persist(spread * 2)
            distributed.wait(doubled)
        assert len(stream.data) == 11 and {r["key"][0] for r in stream.data} == {doubled.name}
        assert all(r["worker"] in client.who_has(source)[source.key] for r in stream.data
                   for source in distributed.futures_of(spread) if source.key[1:] == r["key"][1:])
        numpy.testing.assert_array_equal(doubled.compute(), 2 * x.compute())
