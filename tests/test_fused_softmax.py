"""GPU tests of cupyops.fused_softmax / fused_softmax_backward / dropout_mask against
the float64 references of tests/fused_softmax_reference.py (SPEC §10)."""
from __future__ import annotations

import numpy
import pytest

from conftest import TOLERANCES, assert_close
from cupyops import philox
from cupyops.dtypes import BFLOAT16
from cupyops.ops import fused_softmax as fs

import fused_softmax_reference as ref

pytestmark = pytest.mark.gpu

DTYPES = [numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)]


def to_gpu(a):
    import cupy

    return None if a is None else cupy.asarray(a)


def host(a):
    import cupy

    return cupy.asnumpy(a.astype(numpy.float64) if a.dtype.itemsize == 2 else a)


def rounded(x, dtype):
    """x as the kernel sees it (rounded to dtype), in float64."""
    return numpy.asarray(x, dtype=dtype).astype(numpy.float64)


def check_forward(rng, shape, dtype, *, scale=1.0, bias_shape=None, mask_shape=None, causal=False, diagonal=0,
                  dropout=0.0, seed=0, offset=0, policy="auto", x=None):
    x = rng.standard_normal(shape) * 3 if x is None else x
    x = rounded(x, dtype)
    bias = None if bias_shape is None else rng.standard_normal(bias_shape).astype(numpy.float32)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.8
    args = dict(scale=scale, causal=causal, diagonal=diagonal, dropout=dropout, seed=seed, offset=offset)
    y, lse = fs.fused_softmax(to_gpu(x.astype(dtype)), bias=to_gpu(bias), mask=to_gpu(mask), return_lse=True,
                              policy=policy, **args)
    y_ref, lse_ref = ref.forward(x, bias=bias, mask=mask, **args)
    assert y.dtype == dtype and y.shape == tuple(shape) and lse.dtype == numpy.float32
    assert_close(host(y), y_ref, dtype, scale=2.0)
    numpy.testing.assert_allclose(host(lse), lse_ref, rtol=1e-5, atol=1e-5)
    return x, bias, mask, args, lse


def check_backward(rng, x, bias, mask, args, lse, dtype, policy="auto"):
    dy = rounded(rng.standard_normal(x.shape), dtype)
    dx = fs.fused_softmax_backward(to_gpu(dy.astype(dtype)), to_gpu(x.astype(dtype)), lse, bias=to_gpu(bias),
                                   mask=to_gpu(mask), policy=policy, **args)
    assert_gradient_close(host(dx), ref.backward(dy, x, bias=bias, mask=mask, **args), dtype)


def assert_gradient_close(actual, expected, dtype, err_msg=""):
    """dx against float64, relative to its largest magnitude: the probabilities come back
    through the float32 lse, so float64 is as close as float32."""
    rtol = max(4 * TOLERANCES[numpy.dtype(dtype)]["rtol"], 4e-5)
    big = max(1.0, float(numpy.nanmax(numpy.abs(expected), initial=0)))
    numpy.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * big, equal_nan=True, err_msg=err_msg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["plain", "scale", "bias", "mask", "causal", "dropout", "all"])
def test_variants_forward_and_backward(rng, dtype, variant):
    shape = (2, 3, 33, 160)
    kw = {"plain": {}, "scale": dict(scale=0.125), "bias": dict(bias_shape=(3, 33, 160)),
          "mask": dict(mask_shape=(2, 1, 1, 160)), "causal": dict(causal=True, diagonal=127),
          "dropout": dict(dropout=0.2, seed=7, offset=3),
          "all": dict(scale=0.3, bias_shape=(1, 3, 1, 160), mask_shape=(2, 1, 33, 160), causal=True, diagonal=0,
                      dropout=0.1, seed=99)}[variant]
    found = check_forward(rng, shape, dtype, **kw)
    check_backward(rng, *found, dtype)


MASK_SHAPES = [(2, 3, 17, 40), (2, 1, 17, 40), (2, 1, 1, 40), (1, 1, 17, 40), (3, 17, 40), (17, 40), (40,), (1,),
               (2, 3, 1, 40), (2, 1, 17, 1), (1, 3, 1, 1), (2, 3, 17, 1)]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_every_mask_and_bias_broadcast(rng, mask_shape):
    found = check_forward(rng, (2, 3, 17, 40), numpy.float32, mask_shape=mask_shape, bias_shape=mask_shape)
    check_backward(rng, *found, numpy.float32)


@pytest.mark.parametrize("sq, sk, diagonal", [(5, 9, 0), (5, 9, 4), (9, 5, -4), (9, 5, -2), (7, 7, 3),
                                              (7, 7, -7), (16, 64, 48), (64, 16, -1)])
def test_causal(rng, sq, sk, diagonal):
    found = check_forward(rng, (2, sq, sk), numpy.float16, causal=True, diagonal=diagonal)
    check_backward(rng, *found, numpy.float16)


def every_candidate(stage, operands, shape, dtype, dy=None, lse=None, *, seed, offset, impls=()):
    """Runs each candidate plan the tuner offers for `stage` of `operands` (the `impls` paths
    among them) into a NaN-filled output and, forward, a NaN-filled lse (backward: reads `lse`);
    yields (label, out, lse)."""
    import cupy

    from cupyops.launch import Target
    from cupyops.ops import fused_softmax_tune as tuner

    short = {2: "f16", 4: "f32"}[numpy.dtype(dtype).itemsize]
    found = tuner.candidates(stage, short, operands.rows, shape[-1], Target.live(0), operands.fusion)
    assert set(impls) <= {launch.spec.path.impl for _, launch in found}
    for description, launch in found:
        out = cupy.full(shape, numpy.nan, dtype)
        if stage == "forward":
            lse = cupy.full(shape[:-1], numpy.nan, numpy.float32)
        main = fs.stage_launch(stage, operands, "auto", out, dy=dy, chosen=launch)
        main.run(tuple(a.data.ptr for a in (*fs.stage_inputs(operands.x, dy, operands), out, lse)), seed, offset)
        yield description["label"], out, lse


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("cols", [1001, 4096, 4097, 20001])
@pytest.mark.parametrize("dtype", [numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)], ids=str)
def test_causal_rows_on_every_plan(rng, stage, cols, dtype):
    """Every candidate plan of a stage (the tuner's, so every path that stops a row at its last
    kept column, and the register paths that do not) under the causal rule, alone and with
    dropout, against float64: rows ending before, inside and past a pack, none kept (a negative
    diagonal), peeled rows (odd cols), rows cached by cp.async (4096), a row whose backward sum
    is NaN (a NaN score: NaN past its end too), into a NaN-filled output; y and lse, or dx."""
    sq = 9
    impls = {"block_regs"} | ({"block_smem"} if cols >= 4096 else set()) | \
        ({"block_uncached"} if cols >= 16384 else set()) | ({"block_async"} if cols % 8 == 0 else set())
    for diagonal, dropout in ((cols - sq, 0.0), (-3, 0.0), (cols // 2, 0.1)):
        x = rounded(rng.standard_normal((sq, cols)) * 3, dtype)
        if stage == "backward":
            x[4, 0] = numpy.nan
        dy = rounded(rng.standard_normal((sq, cols)), dtype)
        args = dict(scale=0.5, causal=True, diagonal=diagonal, dropout=dropout, seed=5, offset=3)
        y_ref, lse_ref = ref.forward(x, **args)
        operands = fs.prepare(to_gpu(x.astype(dtype)), bias=None, mask=None, axis=-1,
                              **{k: args[k] for k in ("scale", "causal", "diagonal", "dropout")})
        if stage == "backward":
            dx_ref = ref.backward(dy, x, **args)
            dy_gpu, lse_gpu = to_gpu(dy.astype(dtype)), to_gpu(lse_ref.astype(numpy.float32))
        else:
            dy_gpu = lse_gpu = None
        for label, out, lse in every_candidate(stage, operands, (sq, cols), dtype, dy_gpu, lse_gpu, seed=5, offset=3,
                                               impls=impls):
            label = f"{label} diagonal {diagonal} dropout {dropout}"
            if stage == "backward":
                assert_gradient_close(host(out), dx_ref, dtype, err_msg=label)
                continue
            assert_close(host(out), y_ref, dtype, scale=2.0, err_msg=label)
            numpy.testing.assert_allclose(host(lse), lse_ref, rtol=1e-5, atol=1e-5, err_msg=label)


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("cols", [2048, 4096])
@pytest.mark.parametrize("dtype", [numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)], ids=str)
def test_every_plan_with_bias_mask_and_dropout(rng, stage, cols, dtype):
    """Every candidate plan of a stage (the tuner's; from 2048 aligned columns the asynchronous
    path's, whose LOADs fuse after shared memory, among them), in both row orders, with a
    position bias, a padding mask and dropout, against float64: a -inf and a NaN score, a row
    with none kept, rows of scores about +-200 (whose 16-bit outputs do not fold:
    kernels/softmax.cuh's FoldedNaturalExp); outputs (y and lse, dx) NaN-filled first; dropout
    offsets that do and do not start whole groups of eight."""
    shape = (2, 2, 3, cols)
    x = rounded(rng.standard_normal(shape) * 3 + numpy.array([0, 400, -400])[:, None], dtype)
    x[0, 0, 1, 5], x[1, 1, 2, 7] = -numpy.inf, numpy.nan
    dy = rounded(rng.standard_normal(shape), dtype)
    bias = rng.standard_normal(shape[1:]).astype(numpy.float32)
    mask = rng.random((2, 1, 3, cols)) < 0.8
    mask[1, 0, 0] = False
    operands = fs.prepare(to_gpu(x.astype(dtype)), bias=to_gpu(bias), mask=to_gpu(mask), axis=-1, scale=0.5,
                          causal=False, diagonal=0, dropout=0.1)
    dy_gpu = to_gpu(dy.astype(dtype)) if stage == "backward" else None
    for offset in (3, 8):
        args = dict(scale=0.5, bias=bias, mask=mask, dropout=0.1, seed=5, offset=offset)
        y_ref, lse_ref = ref.forward(x, **args)
        dx_ref = ref.backward(dy, x, **args) if stage == "backward" else None
        lse_gpu = to_gpu(lse_ref.astype(numpy.float32))
        for label, out, lse in every_candidate(stage, operands, shape, dtype, dy_gpu, lse_gpu, seed=5, offset=offset,
                                               impls={"block_async", "block_regs"}):
            label = f"{label} offset {offset}"
            if stage == "forward":
                assert_close(host(out), y_ref, dtype, scale=2.0, err_msg=label)
                numpy.testing.assert_allclose(host(lse), lse_ref, rtol=1e-5, atol=1e-5, err_msg=label)
            else:
                assert_gradient_close(host(out), dx_ref, dtype, err_msg=label)


def test_fully_masked_rows_give_zeros(rng):
    import cupy

    mask = rng.random((4, 1, 6, 50)) < 0.5
    mask[0, :, 2] = False
    mask[3] = False
    x, *_ = check_forward(rng, (4, 2, 6, 50), numpy.float16, mask_shape=mask.shape,
                          x=rng.standard_normal((4, 2, 6, 50)))
    # check_forward drew a fresh mask: run again with the one above
    y, lse = fs.fused_softmax(to_gpu(x.astype(numpy.float16)), mask=to_gpu(mask), return_lse=True)
    assert bool(cupy.all(y[3] == 0)) and bool(cupy.all(y[0, :, 2] == 0))
    assert bool(cupy.all(cupy.isneginf(lse[3])))
    dx = fs.fused_softmax_backward(cupy.ones_like(y), to_gpu(x.astype(numpy.float16)), lse, mask=to_gpu(mask))
    assert not bool(cupy.isnan(dx).any()) and bool(cupy.all(dx[3] == 0))


def test_inf_and_nan_in_x(rng):
    x = rng.standard_normal((6, 300))
    x[0, 5] = numpy.nan
    x[1, :] = -numpy.inf
    x[2, 7] = numpy.inf
    x[3, ::2] = -numpy.inf
    found = check_forward(rng, x.shape, numpy.float32, x=x, mask_shape=(300,))
    check_backward(rng, *found, numpy.float32)


@pytest.mark.parametrize("dtype", [numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)], ids=str)
@pytest.mark.parametrize("offset", [0, 1, 4, 8])
def test_masks_at_any_address_and_rows_without_finite_scores(rng, dtype, offset):
    """A mask at any byte offset (packs on aligned addresses read as words, others byte by
    byte), with rows of no kept position, a +inf or a NaN score: each masked position gives 0,
    the rest match the reference."""
    import cupy

    shape = (4, 2, 6, 64)
    mask = rng.random((4, 1, 6, 64)) < 0.6
    mask[0, :, 2] = False
    x = rng.standard_normal(shape) * 3
    for (b, h, q, k), value in (((1, 0, 3, 5), numpy.inf), ((2, 1, 4, 9), numpy.nan), ((3, 1, 1, 60), -numpy.inf)):
        x[b, h, q, k], mask[b, 0, q, k] = value, True
    x = rounded(x, dtype)
    buffer = cupy.zeros(mask.size + offset, dtype=bool)
    buffer[offset:] = cupy.asarray(mask.ravel())
    gpu_mask = buffer[offset:].reshape(mask.shape)
    y, lse = fs.fused_softmax(to_gpu(x.astype(dtype)), mask=gpu_mask, return_lse=True)
    y_ref, lse_ref = ref.forward(x, mask=mask)
    assert_close(host(y), y_ref, dtype, scale=2.0)
    numpy.testing.assert_allclose(host(lse), lse_ref, rtol=1e-5, atol=1e-5)
    assert bool(cupy.all(y[~cupy.broadcast_to(gpu_mask, shape)] == 0))
    check_backward(rng, x, None, mask, {}, lse, dtype)


PATH_COLS = [1, 2, 7, 8, 31, 32, 33, 127, 128, 129, 254, 255, 256, 1023, 1024, 1025, 2047, 2048, 4095, 4096,
             4097, 8191, 8192, 12287, 12288, 12289, 16383, 16384, 16385, 32768, 65535, 65536]


@pytest.mark.parametrize("cols", PATH_COLS)
@pytest.mark.parametrize("dtype", [numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)], ids=str)
def test_path_boundaries(rng, cols, dtype):
    rows = 3 if cols > 8192 else 37
    found = check_forward(rng, (rows, cols), dtype, scale=0.5, bias_shape=(cols,), mask_shape=(rows, 1, cols)[1:],
                          dropout=0.1, seed=3)
    check_backward(rng, *found, dtype)


@pytest.mark.parametrize("cols", [2 ** 17, 2 ** 17 + 3, 2 ** 20])
@pytest.mark.parametrize("dtype", [numpy.dtype(numpy.float16), BFLOAT16], ids=str)
def test_long_rows(rng, cols, dtype):
    found = check_forward(rng, (2, cols), dtype, mask_shape=(cols,), dropout=0.05, seed=1)
    check_backward(rng, *found, dtype)


@pytest.mark.parametrize("cols", [33, 160, 1001, 4096, 20001])
@pytest.mark.parametrize("dtype", [numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)], ids=str)
def test_interleaved_rows(rng, monkeypatch, cols, dtype):
    """The batch entries' rows taken in turn (forced: at these sizes the L2 keeps a broadcast
    bias in order): forward, lse, dropout and backward against float64 on every path."""
    from cupyops.launch import LaunchCache, Target

    monkeypatch.setattr(fs, "interleave_rule", lambda rows, cols, dtype, fusion, target: fusion.entries > 1)
    monkeypatch.setattr(fs, "_launches", LaunchCache())
    args = dict(scale=0.5, bias_shape=(2, 5, cols), mask_shape=(3, 1, 1, cols), causal=True, diagonal=cols - 5,
                dropout=0.2, seed=11, offset=2)
    x, bias, mask, call_args, lse = check_forward(rng, (3, 2, 5, cols), dtype, **args)
    check_backward(rng, x, bias, mask, call_args, lse, dtype)
    operands = fs.prepare(to_gpu(x.astype(dtype)), bias=to_gpu(bias), mask=to_gpu(mask), axis=-1,
                          **{k: call_args[k] for k in ("scale", "causal", "diagonal", "dropout")})
    assert operands.fusion.entries == 3
    short = {2: "f16", 4: "f32"}[numpy.dtype(dtype).itemsize]
    assert fs.plan("forward", operands.rows, cols, short, "auto", Target.live(0), operands.fusion).spec.interleaved


@pytest.mark.parametrize("policy", ["auto", "oneflow"])
def test_policies_agree(rng, policy):
    found = check_forward(rng, (4, 8, 64, 1000), numpy.float16, mask_shape=(4, 1, 1, 1000), causal=True,
                          diagonal=936, dropout=0.3, seed=5, policy=policy)
    check_backward(rng, *found, numpy.float16, policy=policy)


def test_other_axis(rng):
    x = rounded(rng.standard_normal((5, 70, 3)), numpy.float32)
    bias = rng.standard_normal((70, 1)).astype(numpy.float32)
    y, lse = fs.fused_softmax(to_gpu(x), bias=to_gpu(bias), axis=1, return_lse=True, dropout=0.2, seed=4)
    moved = numpy.moveaxis(x + bias, 1, -1)
    y_ref, lse_ref = ref.forward(moved)
    y_ref = numpy.moveaxis(y_ref, -1, 1) * ref.keep_scale(x.shape, 0.2, 4, 0)
    assert_close(host(y), y_ref, numpy.float32, scale=2.0)
    numpy.testing.assert_allclose(host(lse), lse_ref, rtol=1e-5)


# -- dropout mask ------------------------------------------------------------------

def test_dropout_mask_is_the_reference():
    keep = fs.dropout_mask((3, 1000, 37), 0.3, seed=2 ** 40 + 5, offset=2 ** 33 + 1)
    expected = philox.keep_mask_reference(3 * 1000 * 37, 0.3, 2 ** 40 + 5, 2 ** 33 + 1).reshape(3, 1000, 37)
    numpy.testing.assert_array_equal(host(keep), expected)


def test_dropout_keep_rate_within_5_sigma():
    p, size = 0.25, 10 ** 7
    kept = int(fs.dropout_mask((size,), p, seed=77).sum())
    assert abs(kept - size * (1 - p)) < 5 * (size * p * (1 - p)) ** 0.5


@pytest.mark.parametrize("cols", [1, 100, 1024, 5000, 40000])
@pytest.mark.parametrize("offset", [11, 0, 2 ** 33 + 8])   # packs straddling groups; whole groups (grouped_variant)
def test_forward_dropout_is_dropout_mask_on_every_plan(cols, offset):
    import cupy

    x = cupy.zeros((7, cols), numpy.float16)
    keep = fs.dropout_mask(x.shape, 0.4, seed=9, offset=offset)
    for policy in ("auto", "oneflow"):
        y = fs.fused_softmax(x, dropout=0.4, seed=9, offset=offset, policy=policy)
        assert bool(cupy.all((y != 0) == keep))


def test_philox_known_answers_on_the_gpu():
    import cupy

    from test_philox import KNOWN_ANSWERS

    source = """#include "philox.cuh"
extern "C" __global__ void run(const unsigned* in, unsigned* out) {
  const int i = threadIdx.x;
  const uint4 o = cupyops::philox4x32_10(make_uint4(in[6 * i], in[6 * i + 1], in[6 * i + 2], in[6 * i + 3]),
                                         make_uint2(in[6 * i + 4], in[6 * i + 5]));
  out[4 * i] = o.x; out[4 * i + 1] = o.y; out[4 * i + 2] = o.z; out[4 * i + 3] = o.w;
}"""
    from cupyops import jit

    kernel = cupy.RawKernel(source, "run", options=jit.compile_options(), backend="nvrtc")
    inputs = cupy.asarray([list(c) + list(k) for c, k, _ in KNOWN_ANSWERS], dtype=cupy.uint32)
    out = cupy.zeros((len(KNOWN_ANSWERS), 4), dtype=cupy.uint32)
    kernel((1,), (len(KNOWN_ANSWERS),), (inputs, out))
    assert host(out).tolist() == [list(expected) for _, _, expected in KNOWN_ANSWERS]


# -- bad input -----------------------------------------------------------------------

def test_bad_input_names_the_argument():
    import cupy

    x = cupy.zeros((2, 3, 4), numpy.float32)
    cases = [(dict(mask=cupy.ones((2, 3, 4), numpy.float32)), TypeError, "mask"),
             (dict(mask=cupy.ones((5, 4), bool)), ValueError, "mask"),
             (dict(bias=cupy.ones((3, 5), numpy.float32)), ValueError, "bias"),
             (dict(bias=cupy.ones((4,), numpy.int32)), TypeError, "bias"),
             (dict(dropout=1.0), ValueError, "dropout"), (dict(dropout=-0.1), ValueError, "dropout"),
             (dict(scale=float("inf")), ValueError, "scale"), (dict(scale=float("nan")), ValueError, "scale")]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            fs.fused_softmax(x, **kwargs)
    with pytest.raises(ValueError, match="lse"):
        fs.fused_softmax_backward(x, x, cupy.zeros((2, 4), numpy.float32))
    with pytest.raises(TypeError, match="bias"):
        fs.fused_softmax(x, bias=numpy.ones(4, numpy.float32))


def test_bias_gradient_sums_broadcast_axes(rng):
    import cupy

    dx = cupy.asarray(rng.standard_normal((2, 3, 4, 5)).astype(numpy.float32))
    grad = fs.bias_gradient(dx, (3, 1, 5), scale=2.0)
    numpy.testing.assert_allclose(host(grad), host(dx).sum(axis=(0, 2), keepdims=True)[0] / 2.0,
                                  rtol=1e-5, atol=1e-5)   # sums of 8 float32 values: cancellation near 0


@pytest.mark.parametrize("layout", ["direct", "strided", "is_x", "axis0"])
def test_out_written_directly_or_through_a_copy(rng, layout):
    """out= of x's shape and dtype, contiguous, overlapping no input, is the kernel's own output
    (forward and backward); any other out gets the same values through a copy."""
    import cupy

    x = cupy.asarray(rng.standard_normal((4, 8, 384)).astype(numpy.float16))
    dy = cupy.asarray(rng.standard_normal((4, 8, 384)).astype(numpy.float16))
    axis = 0 if layout == "axis0" else -1
    options = dict(scale=0.5, causal=axis == -1, dropout=0.1, seed=3, axis=axis)
    y, lse = fs.fused_softmax(x, return_lse=True, **options)
    dx = fs.fused_softmax_backward(dy, x, lse, **options)
    for stage, expect in (("forward", y), ("backward", dx)):
        source = x.copy()
        out = {"strided": cupy.full((4, 8, 768), numpy.nan, numpy.float16)[..., ::2],
               "is_x": source}.get(layout, cupy.full(x.shape, numpy.nan, numpy.float16))
        if stage == "forward":
            found = fs.fused_softmax(source, out=out, **options)
        else:
            found = fs.fused_softmax_backward(dy, source, lse, out=out, **options)
        assert found is out
        numpy.testing.assert_array_equal(host(out), host(expect))


def test_poisoned_out_is_overwritten(rng):
    import cupy

    x = cupy.asarray(rng.standard_normal((9, 777)).astype(numpy.float16))
    out = cupy.full(x.shape, numpy.nan, numpy.float16)
    y = fs.fused_softmax(x, out=out, mask=cupy.ones((777,), bool))
    assert y is out and not bool(cupy.isnan(out).any())
