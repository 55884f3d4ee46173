"""GPU tests of softmax_backward / log_softmax_backward against float64 NumPy
references, for every path boundary of both policies, every dtype, any axis,
poisoned outputs, and bad input."""
from __future__ import annotations

import numpy
import pytest
from conftest import TOLERANCES, peeled_cols

import cupyops
from cupyops.dtypes import BFLOAT16

pytestmark = pytest.mark.gpu

DTYPES = [numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32),
          numpy.dtype(numpy.float64)]
DTYPE_IDS = ["float16", "bfloat16", "float32", "float64"]
FORWARD = {"softmax_backward": "softmax", "log_softmax_backward": "log_softmax"}
# Column counts around every path boundary of both policies: OneFlow's warp
# limit (1024), its 48 KB shared-memory limit for two float32 rows (6144), auto's
# peeled one- and two-warp rows (odd cols from 255: 16-bit up to 1031 / 2055),
# warp / register / cp.async / shared-memory limits, and the uncached path.
COLS = [1, 2, 3, 5, 7, 31, 32, 33, 253, 255, 511, 512, 513, 1023, 1024, 1025, 1033, 2048, 2057, 3001, 6144, 6145,
        8192, 16384, 20000, 28000, 70000]


def reference(op, dy, y, axis):
    dy, y = dy.astype(numpy.float64), y.astype(numpy.float64)
    if op == "softmax_backward":
        return (dy - numpy.sum(dy * y, axis=axis, keepdims=True)) * y
    return dy - numpy.exp(y) * numpy.sum(dy, axis=axis, keepdims=True)


def make_inputs(rng, op, shape, dtype, axis):
    """dy and a genuine forward output y (a softmax / log_softmax of random data), rounded to dtype."""
    import scipy.special

    x = rng.standard_normal(shape) * 3
    y = getattr(scipy.special, FORWARD[op])(x, axis=axis).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    return dy, y


def check(actual, expected, dtype):
    """Elementwise against the reference, with the absolute tolerance scaled by
    the largest gradient (dx cancels: dy - sum(dy * y) can be near 0)."""
    tol = TOLERANCES[numpy.dtype(dtype)]["rtol"]
    actual = numpy.asarray(actual, dtype=numpy.float64)
    scale = float(numpy.max(numpy.abs(expected))) if expected.size else 1.0
    numpy.testing.assert_allclose(actual, expected, rtol=tol, atol=4 * tol * scale)


def check_out_and_in_place(op, dy, y, dtype):
    """op(dy, y) over the last axis into a NaN-poisoned out and in place (out =
    dy, out = y), against the reference; returns the reference."""
    import cupy

    expected = reference(op, dy, y, -1)
    out = cupy.full(dy.shape, numpy.nan, dtype=dtype)
    assert getattr(cupyops, op)(cupy.asarray(dy), cupy.asarray(y), axis=-1, out=out) is out
    check(cupy.asnumpy(out), expected, dtype)
    for position in range(2):
        inputs = [cupy.asarray(dy), cupy.asarray(y)]
        getattr(cupyops, op)(*inputs, axis=-1, out=inputs[position])
        check(cupy.asnumpy(inputs[position]), expected, dtype)
    return expected


@pytest.mark.parametrize("policy", ["auto", "oneflow"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", sorted(FORWARD))
@pytest.mark.parametrize("cols", COLS)
def test_every_path_boundary(rng, op, dtype, policy, cols):
    import cupy

    rows = 3 if cols > 8192 else 37
    dy, y = make_inputs(rng, op, (rows, cols), dtype, -1)
    out = cupy.full((rows, cols), numpy.nan, dtype=dtype)
    result = getattr(cupyops, op)(cupy.asarray(dy), cupy.asarray(y), axis=-1, out=out, policy=policy)
    assert result is out
    check(cupy.asnumpy(out), reference(op, dy, y, -1), dtype)


@pytest.mark.parametrize("op", sorted(FORWARD))
@pytest.mark.parametrize("axis", [0, 1, 2, -1, (1, 2), None])
def test_any_axis(rng, op, axis):
    import cupy

    dtype = numpy.dtype(numpy.float32)
    dy, y = make_inputs(rng, op, (5, 6, 7), dtype, axis)
    result = getattr(cupyops, op)(cupy.asarray(dy), cupy.asarray(y), axis=axis)
    check(cupy.asnumpy(result), reference(op, dy, y, axis), dtype)


@pytest.mark.parametrize("op", sorted(FORWARD))
def test_strided_views_and_in_place(rng, op):
    import cupy

    dtype = numpy.dtype(numpy.float16)
    dy, y = make_inputs(rng, op, (64, 2050), dtype, -1)
    dy_view, y_view = cupy.asarray(dy)[:, 1:2049], cupy.asarray(y)[:, 1:2049]   # rows off the 16-byte grid
    expected = reference(op, dy[:, 1:2049], y[:, 1:2049], -1)
    check(cupy.asnumpy(getattr(cupyops, op)(dy_view, y_view, axis=-1)), expected, dtype)
    dy_copy = cupy.ascontiguousarray(dy_view)
    result = getattr(cupyops, op)(dy_copy, cupy.ascontiguousarray(y_view), axis=-1, out=dy_copy)
    assert result is dy_copy
    check(cupy.asnumpy(dy_copy), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", sorted(FORWARD))
def test_rows_past_shared_memory(rng, op, dtype):
    """Rows of dy and y one, two and four times what a block's shared memory
    holds (and a pack more, so that the cluster's shares end mid-row), held on
    chip all the same: one block with a register tail, then (sm_90+)
    thread-block clusters whose blocks each hold a register tail. Rows >= SMs,
    so that they are not split instead. Into a poisoned output and in place
    (out = dy, out = y)."""
    import cupy

    from cupyops.device import has_clusters
    from cupyops.dtypes import BY_DTYPE
    from cupyops.launch import Target
    from cupyops.ops import softmax_rows as sm

    target = Target.live(cupy.cuda.runtime.getDevice())
    vec = 16 // dtype.itemsize
    room = target.facts.smem_per_block_optin // (2 * dtype.itemsize)   # cols of each input it holds
    rows = target.facts.sm_count + 1
    for times in (1, 2, 4):
        cols = times * room + vec
        spec = sm.plan(op, rows, cols, BY_DTYPE[dtype].short, "auto", target).spec
        if times > 1 and not has_clusters(target.facts.arch):
            assert spec.cluster_size == 1, spec.name
        else:
            assert (spec.impl, spec.tail_packs > 0, spec.cluster_size > 1) == ("block_async", True, times > 1), \
                spec.name
        check_out_and_in_place(op, *make_inputs(rng, op, (rows, cols), dtype, -1), dtype)


@pytest.mark.parametrize("kind", ["smem", "uncached"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", sorted(FORWARD))
def test_peeled_rows_past_the_register_path(rng, op, dtype, kind):
    """Odd rows of dy, y and dx (each row at its own phase, every operand at
    the same one) past the register path: 16-byte packs between each row's
    single-element edges, cached in shared memory (log-softmax: dy alone, y
    read with the outputs) or read again, into a poisoned output and in place
    (out = dy, out = y); then dy at another phase than y and dx (no 16-byte
    packs: the row's own)."""
    import cupy

    from cupyops.dtypes import BY_DTYPE
    from cupyops.launch import Target
    from cupyops.ops import softmax_rows as sm

    target = Target.live(cupy.cuda.runtime.getDevice())
    short = BY_DTYPE[dtype].short
    cols = peeled_cols(target, sm.SUM_INPUTS[op], dtype.itemsize, kind)
    rows = target.facts.sm_count + 1                 # not split across blocks
    spec = sm.plan(op, rows, cols, short, "auto", target).spec
    assert (spec.impl, spec.peel, spec.pack_size * dtype.itemsize) == ("block_" + kind, True, 16), spec.name
    dy, y = make_inputs(rng, op, (rows, cols), dtype, -1)
    expected = check_out_and_in_place(op, dy, y, dtype)
    unpeeled = sm.plan(op, rows, cols, short, "auto", target, align=dtype.itemsize, same_phase=False).spec
    assert (unpeeled.impl, unpeeled.peel) == ("block_" + kind, False), unpeeled.name
    dy_shifted = cupy.asarray(numpy.pad(dy, ((0, 0), (1, 0))))[:, 1:]    # one element past y's phase
    out = cupy.full((rows, cols), numpy.nan, dtype=dtype)
    assert getattr(cupyops, op)(dy_shifted, cupy.asarray(y), axis=-1, out=out) is out
    check(cupy.asnumpy(out), expected, dtype)


def test_bad_input():
    import cupy

    dy = cupy.zeros((4, 8), dtype=cupy.float32)
    with pytest.raises(TypeError):
        cupyops.softmax_backward(numpy.zeros((4, 8), dtype=numpy.float32), dy)
    with pytest.raises(ValueError):
        cupyops.softmax_backward(dy, dy[:, :4])
    with pytest.raises(ValueError):
        cupyops.softmax_backward(dy, dy.astype(cupy.float16))
    with pytest.raises(TypeError):
        cupyops.softmax_backward(dy.astype(cupy.int32), dy.astype(cupy.int32))
    with pytest.raises(ValueError):
        cupyops.log_softmax_backward(dy, dy, out=cupy.zeros((4, 9), dtype=cupy.float32))
    with pytest.raises(numpy.exceptions.AxisError):
        cupyops.log_softmax_backward(dy, dy, axis=2)


def test_torch_parity(rng):
    torch = pytest.importorskip("torch")
    import cupy

    x = torch.randn(64, 3000, device="cuda", dtype=torch.float32, requires_grad=True)
    for op, fn in (("softmax_backward", torch.softmax), ("log_softmax_backward", torch.log_softmax)):
        y = fn(x, dim=-1)
        dy = torch.randn_like(y)
        (expected,) = torch.autograd.grad(y, x, dy)
        ours = getattr(cupyops, op)(dy, y.detach(), axis=-1)
        assert isinstance(ours, cupy.ndarray)
        numpy.testing.assert_allclose(cupy.asnumpy(ours), expected.cpu().numpy(), rtol=1e-4, atol=1e-6)
