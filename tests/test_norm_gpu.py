"""GPU tests of layer_norm / rms_norm and their backward passes against float64 NumPy references."""
from __future__ import annotations

from dataclasses import replace

import numpy
import pytest

from conftest import DTYPES, TOLERANCES, assert_close
from cupyops import dtypes
from cupyops.device import has_clusters
from cupyops.dtypes import BFLOAT16
from cupyops.launch import KernelLaunch, Target
from cupyops.ops import norm, norm_paths, norm_spec, row_packs
from cupyops.profile import profile_for
from cupyops.rowwise import Operand

import cupyops

pytestmark = pytest.mark.gpu

POLICIES = ("auto", "oneflow")
# every path boundary of both policies (warp widths, (max, min) rungs, warp /
# block at 1024, register / shared-memory / uncached sizes), odd sizes, cols = 1
BOUNDARY_COLS = (1, 2, 3, 5, 8, 17, 32, 33, 64, 65, 129, 257, 511, 512, 1000, 1023, 1024, 1025, 1536,
                 3000, 4096, 8193, 12345, 16384, 32768)
EPS = 1e-5


def _cupy():
    import cupy
    return cupy


def _data(rng, shape, dtype, loc=0.0, scale=1.0):
    """Random data as `dtype` on the GPU and the same values in float64 on the host."""
    host = (loc + scale * rng.standard_normal(shape)).astype(dtype)
    return _cupy().asarray(host), host.astype(numpy.float64)


def _reference(x, weight, bias, num_axes, centered, eps=EPS):
    axes = tuple(range(x.ndim - num_axes, x.ndim))
    lead = x.shape[:x.ndim - num_axes]
    mean = x.mean(axis=axes, keepdims=True) if centered else numpy.zeros(lead + (1,) * num_axes)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    rstd = 1 / numpy.sqrt(var + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, mean.reshape(lead), rstd.reshape(lead)


def _reference_backward(dy, x, weight, num_axes, centered, eps=EPS):
    axes = tuple(range(x.ndim - num_axes, x.ndim))
    lead = tuple(range(x.ndim - num_axes))
    _, mean, rstd = _reference(x, None, None, num_axes, centered, eps)
    mean = mean.reshape(mean.shape + (1,) * num_axes)
    rstd = rstd.reshape(rstd.shape + (1,) * num_axes)
    xhat = (x - mean) * rstd
    g = dy * (weight if weight is not None else 1)
    mean_g = g.mean(axis=axes, keepdims=True) if centered else 0
    dx = rstd * (g - mean_g - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead)


def _assert_column_sums_close(got, expected, terms, dtype, scale):
    """dweight / dbias, sums over rows of `terms` (float64): the dtype's
    tolerance on the result (stored in the dtype) plus the compute type's on
    the sum of the terms' magnitudes (the accumulation's rounding, which stays
    where a column's sum cancels to near zero)."""
    tol = TOLERANCES[numpy.dtype(dtype)]
    compute = TOLERANCES[numpy.dtype(_stats_tolerance_dtype(dtype))]
    bound = (tol["rtol"] * scale * numpy.abs(expected) + tol["atol"] * scale
             + compute["rtol"] * scale * numpy.abs(terms).sum(axis=0))
    error = numpy.abs(numpy.asarray(got, dtype=numpy.float64) - expected)
    assert (error <= bound).all(), f"{int((error > bound).sum())} columns off, worst {error.max():.3g}"


def _poisoned(shape, dtype):
    out = _cupy().empty(shape, dtype)
    out.fill(numpy.nan)
    return out


def _stats_tolerance_dtype(dtype):
    return numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32


# -- forward --------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", BOUNDARY_COLS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_forward_matches_reference(rng, op, cols, dtype, policy):
    centered = op == "layer_norm"
    rows = 7 if cols % 2 else 8     # rows_per_access 2 with odd and even row counts
    x, x64 = _data(rng, (rows, cols), dtype)
    w, w64 = _data(rng, (cols,), dtype, 1.0, 0.2)
    b, b64 = _data(rng, (cols,), dtype, 0.0, 0.2)
    y_ref, mean_ref, rstd_ref = _reference(x64, w64, b64 if centered else None, 1, centered)
    out = _poisoned((rows, cols), dtype)
    if centered:
        y, mean, rstd = cupyops.layer_norm(x, w, b, eps=EPS, return_stats=True, out=out, policy=policy)
        assert mean.dtype == _stats_tolerance_dtype(dtype)
        assert_close(mean.get(), mean_ref, _stats_tolerance_dtype(dtype), scale=10)
    else:
        y, rstd = cupyops.rms_norm(x, w, eps=EPS, return_stats=True, out=out, policy=policy)
    assert y is out
    assert_close(rstd.get(), rstd_ref, _stats_tolerance_dtype(dtype), scale=10)
    assert_close(y.get(), y_ref, dtype, scale=4)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("rows", [1, 2, 3, 131, 132, 133, 4097])
def test_row_counts_and_no_write_past_the_end(rng, rows, policy):
    """rows_per_access 2 on odd rows: the row after the last stays untouched."""
    cupy = _cupy()
    for cols in (4, 16, 48, 1024, 3000):
        x, x64 = _data(rng, (rows, cols), numpy.float16)
        big = _poisoned((rows + 1, cols), numpy.float16)
        cupyops.rms_norm(x, eps=EPS, out=big[:rows], policy=policy)
        assert bool(cupy.isnan(big[rows]).all())
        assert_close(big[:rows].get(), _reference(x64, None, None, 1, False)[0], numpy.float16, scale=4)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_is_added_stored_and_normalised(rng, dtype, policy):
    for cols in (7, 256, 1000, 4096):
        x, x64 = _data(rng, (9, cols), dtype)
        r, r64 = _data(rng, (9, cols), dtype)
        w, w64 = _data(rng, (cols,), dtype, 1.0, 0.2)
        b, b64 = _data(rng, (cols,), dtype, 0.0, 0.2)
        compute = numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32
        h_expected = (x64.astype(compute) + r64.astype(compute)).astype(dtype)   # rounded as torch
        y, h = cupyops.layer_norm(x, w, b, residual=r, eps=EPS, policy=policy)
        numpy.testing.assert_array_equal(h.get().astype(numpy.float64), h_expected.astype(numpy.float64))
        y_ref = _reference(h.get().astype(numpy.float64), w64, b64, 1, True)[0]
        assert_close(y.get(), y_ref, dtype, scale=4)
        y, h = cupyops.rms_norm(x, w, residual=r, eps=EPS, policy=policy)
        assert_close(y.get(), _reference(h.get().astype(numpy.float64), w64, None, 1, False)[0], dtype,
                     scale=4)


@pytest.mark.parametrize("policy", POLICIES)
def test_out_over_weight_and_bias(rng, policy):
    """An out whose memory holds the weight and bias (its first and last rows) gets the result
    through a fresh array, on the first call and on the memoised one; out = x stays in place.
    Against the reference of the values before the call; the rows outnumber a wave."""
    cupy = _cupy()
    rows, cols = 8192, 1024
    x, x64 = _data(rng, (rows, cols), numpy.float32)
    w, w64 = _data(rng, (cols,), numpy.float32, 1.0, 0.2)
    b, b64 = _data(rng, (cols,), numpy.float32, 0.0, 0.2)
    for op, centered in (("layer_norm", True), ("rms_norm", False)):
        expected = _reference(x64, w64, b64 if centered else None, 1, centered)[0]
        for call in range(3):   # the first call plans; the later ones replay the memo
            out = _poisoned((rows, cols), numpy.float32)
            weight, bias = out[0], out[-1]
            weight[...], bias[...] = w, b
            affine = (weight, bias) if centered else (weight,)
            assert getattr(cupyops, op)(x, *affine, eps=EPS, out=out, policy=policy) is out
            assert_close(out.get(), expected, numpy.float32, scale=4)
            inputs = x.copy()
            assert getattr(cupyops, op)(inputs, w, *((b,) if centered else ()), eps=EPS, out=inputs,
                                        policy=policy) is inputs
            assert_close(inputs.get(), expected, numpy.float32, scale=4)
    assert numpy.array_equal(cupy.asnumpy(x).astype(numpy.float64), x64)   # x itself never written


def _check_forward_plan(rng, chosen, op, rows, cols, dtype, residual, label):
    """Runs a hand-built forward plan on random rows (mean 1e3 for LayerNorm:
    the row shift), weight and bias (and a residual), into poisoned outputs,
    and checks h (bitwise, rounded as torch), y, mean and rstd against float64."""
    centered = op == "layer_norm"
    itemsize = numpy.dtype(dtype).itemsize
    x, x64 = _data(rng, (rows, cols), dtype, loc=1e3 if centered else 0.0)
    r, r64 = _data(rng, (rows, cols), dtype)
    w, w64 = _data(rng, (cols,), dtype, 1.0, 0.2)
    b, b64 = _data(rng, (cols,), dtype, 0.0, 0.2)
    y, h = _poisoned((rows, cols), dtype), _poisoned((rows, cols), dtype)
    stats_dtype = _stats_tolerance_dtype(dtype)
    mean, rstd = _poisoned((rows,), stats_dtype), _poisoned((rows,), stats_dtype)
    norm.launch_forward(chosen, _cupy().cuda.runtime.getDevice(), rows, cols, Operand(x, cols), Operand(y, cols),
                        EPS, residual=Operand(r, cols) if residual else None, h=h if residual else None,
                        weight=w, bias=b if centered else None, mean=mean if centered else None, rstd=rstd)
    if residual:
        compute = numpy.float64 if itemsize == 8 else numpy.float32
        x64 = (x64.astype(compute) + r64.astype(compute)).astype(dtype).astype(numpy.float64)
        numpy.testing.assert_array_equal(h.get().astype(numpy.float64), x64)
    y_ref, mean_ref, rstd_ref = _reference(x64, w64, b64 if centered else None, 1, centered)
    assert_close(y.get(), y_ref, dtype, scale=4 if itemsize < 8 else 1e3), label
    assert_close(rstd.get(), rstd_ref, stats_dtype, scale=10), label
    if centered:
        assert_close(mean.get(), mean_ref, stats_dtype, scale=10), label


@pytest.mark.parametrize("residual", [False, True], ids=["x", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_rows_cached_by_cp_async(rng, op, dtype, residual):
    """norm_block_async on hand-built plans: rows in shared memory alone,
    with a register tail of part of the row, and with the whole row in the
    tail (no shared memory); a pack count that is no multiple of the block;
    a grid smaller than the rows (a block fetches its next row); y, h, mean
    and rstd against float64, rows at mean 1e3 (the row shift)."""
    centered = op == "layer_norm"
    itemsize = numpy.dtype(dtype).itemsize
    pack = 16 // itemsize
    rows = 37
    # (packs in the row, block size, tail packs a thread, grid)
    for packs, block_size, tail_packs, grid in ((1025, 256, 0, rows), (1025, 256, 2, 5), (512, 256, 2, rows),
                                                (2047, 128, 1, 16)):
        cols = packs * pack
        spec = norm_spec.NormSpec(op=op, impl="block_async", dtype=dtypes.float_type(dtype).short, pack_size=pack,
                             block_size=block_size, tail_packs=tail_packs, weight=True, bias=centered,
                             residual=residual)
        smem = (packs - tail_packs * block_size) * 16 * (2 if residual else 1)
        chosen = norm.NormPlan(KernelLaunch(spec, (block_size, 1, 1), (grid, 1, 1), smem))
        _check_forward_plan(rng, chosen, op, rows, cols, dtype, residual, f"{spec.name}, {cols} cols, grid {grid}")


HELD_AFFINE_CASES = [(cols, dtype) for cols in (64, 200, 500, 1000, 1024) for dtype in DTYPES
                     if numpy.dtype(dtype).itemsize < 8 or cols <= 512]   # float64 warp rows: up to 512 cols


@pytest.mark.parametrize("residual", [False, True], ids=["x", "residual"])
@pytest.mark.parametrize("cols, dtype", HELD_AFFINE_CASES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_held_weight_and_bias_serve_every_row_a_warp_visits(rng, op, cols, dtype, residual):
    """The forward warp kernel holding weight and bias (hold_affine) on a
    grid of 3 blocks: each group of lanes normalises many rows with the
    packs it read once; padded rows (200, 500, 1000 cols), two rows per
    access at an odd row count (64, 200 cols), a residual; y, h, mean and
    rstd against float64."""
    centered = op == "layer_norm"
    itemsize = numpy.dtype(dtype).itemsize
    short = dtypes.float_type(dtype).short
    rows = 101
    pack = row_packs.vector_pack_size(cols, itemsize, 16)
    ladder = norm_paths.auto_warp_ladder(cols, pack, max(128 // max(itemsize, 4), pack))
    fields = dict(op=op, dtype=short, weight=True, bias=centered, residual=residual)
    launch = norm_paths.warp_launch(fields, rows, cols, pack, ladder, Target.live(0), "auto",
                               block_threads=64 if ladder[2] == 32 else 0)
    launch = replace(launch, spec=replace(launch.spec, hold_affine=True), grid=(3, 1, 1))
    _check_forward_plan(rng, norm.NormPlan(launch), op, rows, cols, dtype, residual, launch.spec.name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cols_one_and_constant_rows(rng, dtype):
    cupy = _cupy()
    for cols in (1, 100, 5000):
        x = cupy.asarray(numpy.full((6, cols), 3.25, dtype))
        b, b64 = _data(rng, (cols,), dtype)
        y, mean, rstd = cupyops.layer_norm(x, None, b, eps=EPS, return_stats=True)
        assert_close(y.get(), numpy.broadcast_to(b64, (6, cols)), dtype)
        assert_close(mean.get(), numpy.full(6, 3.25), numpy.float32)
        assert_close(rstd.get(), numpy.full(6, 1 / numpy.sqrt(EPS)), numpy.float32)


# 256, 300: warp (padded); 1024: warp; 4096: register block (auto) / shared memory
# (oneflow); 20000: register block / shared memory; 40000: shared memory;
# 100000: uncached (both policies)
LARGE_OFFSET_COLS = (256, 300, 1024, 4096, 20000, 40000, 100000)


@pytest.mark.parametrize("residual", [False, True], ids=["x", "residual"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cols", LARGE_OFFSET_COLS)
def test_large_offset_needs_welford(rng, cols, policy, residual):
    """mean 1e4, std 1e-2: sum(x^2) / n - mean^2 loses every digit in float32, and
    so does Welford on the raw values (the float32 mean resolves 1e4 to ~1e-3, a
    tenth of the std). The kernels take the statistics of x - x[row, 0]: exact
    here (Sterbenz), so rstd is good to ~1e-5 relative and y to ~1e-4."""
    rows = 15      # odd: the warp paths' second row per access is guarded
    x, x64 = _data(rng, (rows, cols), numpy.float32, loc=1e4, scale=1e-2)
    # rows whose first element is the row's extreme: the shift is not the mean
    x[3, 0] = numpy.float32(1e4 + 0.1)
    x[4, 0] = numpy.float32(1e4 - 0.1)
    if residual:
        r, _ = _data(rng, (rows, cols), numpy.float32, scale=1e-2)
        y, h, mean, rstd = cupyops.layer_norm(x, residual=r, eps=EPS, return_stats=True, policy=policy)
        x64 = h.get().astype(numpy.float64)          # the float32 h the kernel normalised
    else:
        y, mean, rstd = cupyops.layer_norm(x, eps=EPS, return_stats=True, policy=policy)
        x64 = x.get().astype(numpy.float64)          # the rounded float32 input
    y_ref, mean_ref, rstd_ref = _reference(x64, None, None, 1, True)
    # float32 Welford on x - K: ~1e-7 relative in a NumPy emulation (raw values: 2e-2)
    numpy.testing.assert_allclose(rstd.get(), rstd_ref, rtol=1e-4)
    # the float32 mean itself is only known to half an ulp of 1e4 (4.9e-4)
    numpy.testing.assert_allclose(mean.get(), mean_ref, rtol=0, atol=float(numpy.spacing(numpy.float32(1e4))))
    # y is computed from (x - K) - shifted mean: no ulp of 1e4 in it
    numpy.testing.assert_allclose(y.get(), y_ref, rtol=0, atol=1e-3)
    x, x64 = _data(rng, (rows, cols), numpy.float64, loc=1e4, scale=1e-2)
    y, rstd = cupyops.layer_norm(x, eps=EPS, policy=policy, return_stats=True)[::2]
    # x at 1e4 has a float64 spacing of 1.8e-12, 1.8e-10 of the std: y can be no closer.
    assert_close(y.get(), _reference(x64, None, None, 1, True)[0], numpy.float64, scale=1e5)
    numpy.testing.assert_allclose(rstd.get(), _reference(x64, None, None, 1, True)[2], rtol=1e-9)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cols", [64, 1024, 4096, 40000])
def test_large_offset_16_bit(rng, cols, policy, dtype):
    """16-bit input far from 0 (the storage-type shared-memory cache holds x, not x - K)."""
    np_dtype = BFLOAT16 if dtype == "bfloat16" else numpy.dtype(dtype)
    x, x64 = _data(rng, (9, cols), np_dtype, loc=300.0, scale=4.0)
    y, mean, rstd = cupyops.layer_norm(x, eps=EPS, return_stats=True, policy=policy)
    y_ref, mean_ref, rstd_ref = _reference(x64, None, None, 1, True)
    numpy.testing.assert_allclose(rstd.get(), rstd_ref, rtol=1e-4)
    numpy.testing.assert_allclose(mean.get(), mean_ref, rtol=1e-6)
    assert_close(y.get(), y_ref, np_dtype, scale=4)


def test_trailing_axes_views_and_offsets(rng):
    cupy = _cupy()
    x, x64 = _data(rng, (3, 5, 6, 8), numpy.float32)
    w, w64 = _data(rng, (6, 8), numpy.float32)
    y = cupyops.layer_norm(x, w, axis=(-2, -1), eps=EPS)
    assert_close(y.get(), _reference(x64, w64, None, 2, True)[0], numpy.float32, scale=4)
    base, base64 = _data(rng, (9, 1001), numpy.float16)
    view, view64 = base[1:, 1:], base64[1:, 1:]          # misaligned: falls back to pack 1
    assert_close(cupyops.rms_norm(view, eps=EPS).get(), _reference(view64, None, None, 1, False)[0],
                 numpy.float16, scale=4)
    strided, strided64 = base[::2, :512], base64[::2, :512]
    assert_close(cupyops.layer_norm(strided, eps=EPS).get(),
                 _reference(strided64, None, None, 1, True)[0], numpy.float16, scale=4)
    transposed = cupy.asfortranarray(x.reshape(15, 48))
    assert_close(cupyops.layer_norm(transposed, eps=EPS).get(),
                 _reference(x64.reshape(15, 48), None, None, 1, True)[0], numpy.float32, scale=4)


# odd cols: warp rows (1, 3, 17, 253) and register-block rows whose edges are
# peeled: one warp a row, two a block (255, 1023, 1055), two warps (1057, 2049), the ladder
PEEL_COLS = (1, 3, 17, 253, 255, 1023, 1055, 1057, 2049, 12345)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", PEEL_COLS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_rows_off_the_16_byte_grid(rng, op, cols, dtype):
    """Contiguous odd cols (each row at another phase), views at the same
    offset in input and output (every row's head the same), an input view at
    another phase than the output (no peel), and a residual: all match the
    reference and nothing outside the rows is written."""
    cupy = _cupy()
    centered = op == "layer_norm"
    rows = 9
    w, w64 = _data(rng, (cols,), dtype, 1.0, 0.2)
    b, b64 = _data(rng, (cols,), dtype, 0.0, 0.2)
    affine = dict(weight=w, bias=b) if centered else dict(weight=w)
    run = getattr(cupyops, op)

    def check(y, x64, stats=None):
        y_ref, mean_ref, rstd_ref = _reference(x64, w64, b64 if centered else None, 1, centered)
        assert_close(y.get(), y_ref, dtype, scale=4)
        if stats is not None:
            assert_close(stats[-1].get(), rstd_ref, _stats_tolerance_dtype(dtype), scale=10)
            if centered:
                assert_close(stats[0].get(), mean_ref, _stats_tolerance_dtype(dtype), scale=10)

    itemsize = numpy.dtype(dtype).itemsize
    peeled = norm.plan(op, rows, cols, dtypes.float_type(dtype).short, "auto", Target.live(0), itemsize,
                       bias=centered).spec
    small_min_cols = profile_for(Target.live(0).facts).AUTO_PEELED_SMALL_MIN_COLS
    # from AUTO_PEELED_SMALL_MIN_COLS a register block peels the row edges; float64
    # rows of 12345 (over 16 doubles a thread at 1024 threads) go to shared memory
    assert peeled.peel == (cols >= small_min_cols and peeled.impl == "block_regs")
    assert peeled.impl == "block_regs" or cols < small_min_cols or itemsize == 8
    assert peeled.rows_per_block == (2 if peeled.peel and peeled.block_size == 32 else 1)

    x, x64 = _data(rng, (rows, cols), dtype)
    y, *stats = run(x, **affine, eps=EPS, return_stats=True)
    check(y, x64, stats)

    base, base64 = _data(rng, (rows, cols + 16), dtype)
    out_base = _poisoned((rows, cols + 16), dtype)
    y = run(base[:, 3:3 + cols], **affine, eps=EPS, out=out_base[:, 3:3 + cols])
    check(y, base64[:, 3:3 + cols])
    assert bool(cupy.isnan(out_base[:, :3]).all()) and bool(cupy.isnan(out_base[:, 3 + cols:]).all())

    check(run(base[:, 1:1 + cols], **affine, eps=EPS), base64[:, 1:1 + cols])

    r, r64 = _data(rng, (rows, cols), dtype)
    y, h = run(x, **affine, residual=r, eps=EPS)
    check(y, h.get().astype(numpy.float64))


@pytest.mark.parametrize("dtype, cols", [("float16", 12544), (BFLOAT16, 12544), ("float32", 12800),
                                         ("float16", 12543), ("float32", 12799)], ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_peeled_rows_with_a_block_of_single_elements(rng, op, dtype, cols):
    """Peeled forward register rows whose packs stop at block_size x
    packs_per_thread: views at an offset (every row's head 5 or 1 elements)
    leave exactly block_size single elements past the packs (12544 f16 /
    bf16, 12800 f32), contiguous odd cols one fewer at every phase; y and the
    statistics match the reference at mean 1e3, and nothing outside the
    views is written."""
    cupy = _cupy()
    centered = op == "layer_norm"
    itemsize = numpy.dtype(dtype).itemsize
    rows = 2 * 16 // itemsize + 3
    spec = norm.plan(op, rows, cols, dtypes.float_type(dtype).short, "auto", Target.live(0), itemsize,
                     bias=centered).spec
    past_packs = cols - spec.block_size * spec.packs_per_thread * spec.pack_size
    assert spec.peel and past_packs == spec.block_size - cols % 2, (spec.name, past_packs)
    w, w64 = _data(rng, (cols,), dtype, 1.0, 0.2)
    b, b64 = _data(rng, (cols,), dtype, 0.0, 0.2)
    affine = dict(weight=w, bias=b) if centered else dict(weight=w)
    if cols % 2:    # the output at the input's phases, row by row
        x, x64 = _data(rng, (rows, cols), dtype, 1e3, 1.0)
        out = out_base = _poisoned((rows, cols), dtype)
    else:
        base, base64 = _data(rng, (rows, cols + 16), dtype, 1e3, 1.0)
        x, x64 = base[:, 3:3 + cols], base64[:, 3:3 + cols]
        out_base = _poisoned((rows, cols + 16), dtype)
        out = out_base[:, 3:3 + cols]
    y, *stats = getattr(cupyops, op)(x, **affine, eps=EPS, out=out, return_stats=True)
    y_ref, mean_ref, rstd_ref = _reference(x64, w64, b64 if centered else None, 1, centered)
    assert_close(y.get(), y_ref, dtype, scale=4)
    assert_close(stats[-1].get(), rstd_ref, _stats_tolerance_dtype(dtype), scale=10)
    if centered:
        assert_close(stats[0].get(), mean_ref, _stats_tolerance_dtype(dtype), scale=10)
    if cols % 2 == 0:
        assert bool(cupy.isnan(out_base[:, :3]).all()) and bool(cupy.isnan(out_base[:, 3 + cols:]).all())


@pytest.mark.parametrize("shorter", [0, 1])
@pytest.mark.parametrize("dtype", ["float16", BFLOAT16, "float32"], ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_peeled_rows_with_unchecked_packs(rng, op, dtype, shorter):
    """Peeled forward rows whose first packs a thread are not checked
    (full_packs) at the fewest cols that fill them all: the row at the last
    head holds exactly block_size x packs_per_thread packs and nothing past
    them, the others up to pack_size - 1 single elements; one col shorter
    the last pack is checked (rows held as loaded: every pack). Contiguous
    rows at every phase, with statistics at mean 1e3 and with a residual,
    against the reference (_check_peeled_forward)."""
    centered = op == "layer_norm"
    itemsize = numpy.dtype(dtype).itemsize
    pack = 16 // itemsize
    short = dtypes.float_type(dtype).short
    spec = norm.plan(op, 64, 12345, short, "auto", Target.live(0), itemsize, bias=centered).spec
    cols = spec.block_size * spec.packs_per_thread * pack + pack - 1 - shorter
    chosen = norm.plan(op, 64, cols, short, "auto", Target.live(0), itemsize, bias=centered).spec
    assert chosen.peel and chosen.packs_per_thread == spec.packs_per_thread, chosen.name
    unchecked = 0 if shorter and chosen.packed else chosen.packs_per_thread - shorter
    assert chosen.full_packs == unchecked, chosen.name
    _check_peeled_forward(rng, op, dtype, cols)


@pytest.mark.parametrize("dtype", ["float16", BFLOAT16], ids=str)
@pytest.mark.parametrize("cols", [3891, 16385, 20001])
def test_peeled_rows_at_fitted_block_sizes(rng, dtype, cols):
    """LayerNorm 16-bit peeled rows at block sizes fitted to the row (96, 288
    and 416 threads: a block reduction over 3, 9 and 13 warps), every pack
    full; rows at every phase, statistics at mean 1e3, with a residual."""
    spec = norm.plan("layer_norm", 64, cols, dtypes.float_type(dtype).short, "auto", Target.live(0), 2).spec
    assert spec.peel and spec.full_packs == spec.packs_per_thread, spec.name
    assert spec.block_size == {3891: 96, 16385: 288, 20001: 416}[cols], spec.name
    _check_peeled_forward(rng, "layer_norm", dtype, cols)


def _check_peeled_forward(rng, op, dtype, cols):
    """Contiguous rows of `cols` at every phase, statistics at mean 1e3, and
    with a residual, against the reference."""
    centered = op == "layer_norm"
    rows = 2 * (16 // numpy.dtype(dtype).itemsize) + 3
    w, w64 = _data(rng, (cols,), dtype, 1.0, 0.2)
    b, b64 = _data(rng, (cols,), dtype, 0.0, 0.2)
    affine = dict(weight=w, bias=b) if centered else dict(weight=w)
    x, x64 = _data(rng, (rows, cols), dtype, 1e3, 1.0)
    y, *stats = getattr(cupyops, op)(x, **affine, eps=EPS, return_stats=True)
    y_ref, mean_ref, rstd_ref = _reference(x64, w64, b64 if centered else None, 1, centered)
    assert_close(y.get(), y_ref, dtype, scale=4)
    assert_close(stats[-1].get(), rstd_ref, _stats_tolerance_dtype(dtype), scale=10)
    if centered:
        assert_close(stats[0].get(), mean_ref, _stats_tolerance_dtype(dtype), scale=10)
    r, _ = _data(rng, (rows, cols), dtype)
    y, h = getattr(cupyops, op)(x, **affine, residual=r, eps=EPS)
    y_ref = _reference(h.get().astype(numpy.float64), w64, b64 if centered else None, 1, centered)[0]
    assert_close(y.get(), y_ref, dtype, scale=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [2049, 12345, 12543])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_peeled_rows_read_weight_and_bias_at_any_offset(rng, op, cols, dtype):
    """Peeled register-block rows read weight and bias as 16-byte packs
    realigned to each row's phase: weight and bias views at every element
    offset from the 16-byte grid (every word shift, and half words for 16-bit
    types), both at the same offset (one word shift a row) and at different
    offsets (the shift found in every pack), against the reference; the
    backward (dx, dweight, dbias) with each weight view, read from its copy
    in shared memory (RMSNorm, and 2049 cols) or from its phase copies in
    global memory (LayerNorm at 12345 and 12543 cols). 12543 cols leave the
    backward up to 255 single elements past its packs (512 x 3, f16)."""
    centered = op == "layer_norm"
    itemsize = numpy.dtype(dtype).itemsize
    per_pack = 16 // itemsize
    rows = 2 * per_pack + 3             # contiguous odd cols: rows at every phase
    spec = norm.plan(op, rows, cols, dtypes.float_type(dtype).short, "auto", Target.live(0), itemsize,
                     bias=centered).spec
    assert spec.impl != "block_regs" or spec.peel, spec.name
    grad = norm.plan(f"{op}_backward", rows, cols, spec.dtype, "auto", Target.live(0), itemsize).spec
    if grad.peel:
        assert grad.weight_source == ("phase_copies" if centered and cols > 4096 else "shared_copy"), grad.name
    x, x64 = _data(rng, (rows, cols), dtype)
    weight_base, weight_base64 = _data(rng, (cols + per_pack,), dtype, 1.0, 0.2)
    bias_base, bias_base64 = _data(rng, (cols + per_pack,), dtype, 0.0, 0.2)
    offsets = [(offset, offset) for offset in range(per_pack)] + [(0, 1), (per_pack - 1, per_pack // 2)]
    for weight_offset, bias_offset in offsets:
        w, w64 = weight_base[weight_offset:][:cols], weight_base64[weight_offset:][:cols]
        b, b64 = bias_base[bias_offset:][:cols], bias_base64[bias_offset:][:cols]
        if centered:
            y = cupyops.layer_norm(x, w, b, eps=EPS)
        else:
            y = cupyops.rms_norm(x, w, eps=EPS)
        y_ref, _, _ = _reference(x64, w64, b64 if centered else None, 1, centered)
        assert_close(y.get(), y_ref, dtype, scale=4)
        if bias_offset == weight_offset:
            check_backward(rng, centered, rows, cols, dtype, "auto", weight=(w, w64))


# -- backward -------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", (1, 3, 32, 33, 512, 1000, 1024, 1025, 4096, 12345, 16384, 40000))
@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_backward_matches_reference(rng, centered, cols, dtype, policy):
    check_backward(rng, centered, 37 if cols % 2 else 64, cols, dtype, policy)


def check_backward(rng, centered, rows, cols, dtype, policy, weight=None):
    """dx, dweight (and dbias) of random rows against the float64 reference;
    weight: (array, float64 copy), else random."""
    x, x64 = _data(rng, (rows, cols), dtype)
    dy, dy64 = _data(rng, (rows, cols), dtype)
    w, w64 = weight or _data(rng, (cols,), dtype, 1.0, 0.2)
    dx_ref, dw_ref, db_ref = _reference_backward(dy64, x64, w64, 1, centered)
    if centered:
        _, mean, rstd = cupyops.layer_norm(x, w, eps=EPS, return_stats=True)
        dx, dw, db = cupyops.layer_norm_backward(dy, x, mean, rstd, w, policy=policy)
        _assert_column_sums_close(db.get(), db_ref, dy64, dtype, scale=10)
    else:
        _, rstd = cupyops.rms_norm(x, w, eps=EPS, return_stats=True)
        dx, dw = cupyops.rms_norm_backward(dy, x, rstd, w, policy=policy)
    scale = 10 if numpy.dtype(dtype) != numpy.float64 else 1e3
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) cancels: an element's
    # error follows the row's largest value (3-column rows), not its own
    tol = TOLERANCES[numpy.dtype(dtype)]
    row_atol = tol["rtol"] * scale * numpy.abs(dx_ref).max(axis=-1, keepdims=True) + tol["atol"] * scale
    got = dx.get().astype(numpy.float64)
    close = numpy.isclose(got, dx_ref, rtol=tol["rtol"] * scale, atol=row_atol)
    assert close.all(), f"dx: {int((~close).sum())} elements off, worst {numpy.abs(got - dx_ref).max():.3g}"
    xhat64 = _reference(x64, None, None, 1, centered)[0]
    _assert_column_sums_close(dw.get(), dw_ref, dy64 * xhat64, dtype, scale=scale * 10)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("cols", [1023, 1024, 2048, 3000, 4096, 4097, 5000, 12345, 12543])
@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_backward_register_paths_walk_their_rows(rng, centered, cols, dtype):
    """Rows past the grid (two rounds and a partial one) through the register
    block paths with fused dweight / dbias (partial sums in shared memory at
    2048 and 4096 cols; 16-bit rows of 1023 and 1024 cols two at a time, the
    last pair of some blocks one row short), and peeling rows off the 16-byte
    grid (1023, 4097, 12345 and 12543 cols: the grid a multiple of the rows'
    phase period, each thread owning the same columns in every row, up to
    255 of them single elements past the packs, the weight read at the rows'
    phase); 16-bit rows of 3000 and 5000 cols in blocks fitted to the row (192
    and 320 threads, AUTO_GRAD_FITTED_ITEMSIZES)."""
    op = "layer_norm_backward" if centered else "rms_norm_backward"
    short = dtypes.float_type(numpy.dtype(dtype)).short
    chosen = norm.plan(op, 1 << 20, cols, short, "auto", Target.live(0)).main
    assert chosen.spec.impl == "block_regs" and chosen.spec.fuse_param_grad, chosen.spec.name
    assert chosen.spec.peel == (cols % 2 == 1), chosen.spec.name
    if cols in (2048, 4096):
        assert chosen.spec.smem_partials and chosen.spec.cached, chosen.spec.name
    if cols in (3000, 5000) and short != "f32":
        assert chosen.spec.block_size == {3000: 192, 5000: 320}[cols], chosen.spec.name
    assert chosen.spec.rows_per_access == (2 if cols <= 1024 and short != "f32" else 1), chosen.spec.name
    rows = 2 * chosen.grid[0] + 3
    assert norm.plan(op, rows, cols, short, "auto", Target.live(0)).main.spec == chosen.spec
    check_backward(rng, centered, rows, cols, dtype, "auto")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("cols", [20000, 24576, 32768, 32776, 40000])
@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_backward_clusters_share_long_rows(rng, centered, cols, dtype):
    """Rows no block holds with fused dweight / dbias (16-bit past 24576
    cols, float32 past 16384) shared by the two blocks of a thread-block
    cluster: one row (one cluster), and rows past the resident clusters (two
    rounds and a partial one). The second block's span is a pack short of
    the first's at 32776 16-bit cols, and of its threads' packs at 20000
    float32 cols (1928 of 3072); float32 rows of 32776 and 40000 cols, too
    long for the pair to hold, are read twice (AUTO_GRAD_LONG_ROW_LADDER)."""
    op = "layer_norm_backward" if centered else "rms_norm_backward"
    short = dtypes.float_type(numpy.dtype(dtype)).short
    target = Target.live(0)
    chosen = norm.plan(op, 1 << 20, cols, short, "auto", target).main
    longest_block_row = 16384 if short == "f32" else 24576
    clustered = longest_block_row < cols and has_clusters(target.facts.arch)
    assert chosen.spec.cluster_size == (2 if clustered else 1), chosen.spec.name
    assert chosen.spec.fuse_param_grad == (clustered or cols <= longest_block_row), chosen.spec.name
    assert chosen.spec.cached == (cols <= 2 * longest_block_row), chosen.spec.name
    for rows in (1, chosen.grid[0] + 3):
        check_backward(rng, centered, rows, cols, dtype, "auto")


# (op, dtype, cols, cluster_size) of rows no held rung holds, in one block
# or a pair, read twice with their partials in shared memory
# (AUTO_GRAD_LONG_ROW_LADDER): peeled rows in one block, rows on the
# 16-byte grid in a cluster of two (the last block's span short of the
# first's at 40000 and 57000 cols; RMSNorm float64 16384 cols, which one
# block would hold at 8 packs a thread).
LONG_ROWS_READ_TWICE = [
    ("layer_norm_backward", "float32", 20001, 1), ("rms_norm_backward", "float32", 32767, 1),
    ("rms_norm_backward", "float16", 49151, 1), ("rms_norm_backward", "float64", 16384, 2),
    ("layer_norm_backward", "float32", 40000, 2), ("layer_norm_backward", "float32", 57000, 2),
    ("rms_norm_backward", "float32", 65536, 2), ("rms_norm_backward", "bfloat16", 98304, 2),
    ("layer_norm_backward", "float64", 24576, 2), ("rms_norm_backward", "float64", 32760, 2),
]


@pytest.mark.parametrize("op,dtype,cols,cluster_size", LONG_ROWS_READ_TWICE)
def test_backward_long_rows_read_twice(rng, op, dtype, cols, cluster_size):
    """Rows too long for a held rung, in one block or a cluster, keep their
    dweight / dbias partials in shared memory and read dy and x a second time
    for dx: one row, and rows past the resident blocks (two rounds and a
    partial one), against float64."""
    short = dtypes.float_type(numpy.dtype(dtype)).short
    target = Target.live(0)
    if cluster_size > 1 and not has_clusters(target.facts.arch):
        pytest.skip("thread-block clusters need sm_90 or newer")
    chosen = norm.plan(op, 1 << 20, cols, short, "auto", target).main
    spec = chosen.spec
    assert (spec.impl, spec.cached, spec.smem_partials, spec.cluster_size) == \
        ("block_regs", False, True, cluster_size), spec.name
    assert spec.peel == (cols % 2 == 1), spec.name
    for rows in (1, chosen.grid[0] // cluster_size * 2 + 3):
        check_backward(rng, op == "layer_norm_backward", rows, cols, dtype, "auto")


def _max_active_clusters(launch) -> int:
    """The driver's count of co-resident clusters of a planned launch
    (cuOccupancyMaxActiveClusters; CuPy has no binding)."""
    import ctypes

    class LaunchConfig(ctypes.Structure):   # CUlaunchConfig
        _fields_ = [(name, ctypes.c_uint) for name in ("grid_x", "grid_y", "grid_z", "block_x", "block_y",
                                                       "block_z", "smem")] + \
                   [("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]

    from cupyops.launch import live_function
    function = live_function(launch.spec, 0, launch.smem_bytes)
    config = LaunchConfig(*launch.grid, *launch.block, launch.smem_bytes, None, None, 0)
    count = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters(
        ctypes.byref(count), ctypes.c_void_p(function.ptr), ctypes.byref(config))
    assert status == 0, f"cuOccupancyMaxActiveClusters: CUresult {status}"
    return count.value


@pytest.mark.parametrize("short", ["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("op", norm_spec.BACKWARD_OPS)
def test_planned_clusters_are_resident_at_once(op, short):
    """Each block walks its rows and writes one workspace row, so a cluster
    left for a second wave would run its rows after all the others: every
    planned cluster must be co-resident (clusters of two fill the SMs in
    pairs, at one and at two blocks an SM)."""
    target = Target.live(0)
    if not has_clusters(target.facts.arch):
        pytest.skip("thread-block clusters need sm_90")
    for cols in (8192, 20000, 24576, 32768, 40000, 65536):
        launch = norm.plan(op, 1 << 20, cols, short, "auto", target).main
        if launch.spec.cluster_size > 1:
            assert _max_active_clusters(launch) >= launch.grid[0] // launch.spec.cluster_size, launch.spec.name


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cols", [64, 1024, 3000, 4096, 16384, 40000])
def test_backward_is_deterministic(rng, cols, policy):
    cupy = _cupy()
    x, _ = _data(rng, (3001, cols), BFLOAT16)
    dy, _ = _data(rng, (3001, cols), BFLOAT16)
    w, _ = _data(rng, (cols,), BFLOAT16, 1.0, 0.2)
    _, mean, rstd = cupyops.layer_norm(x, w, eps=EPS, return_stats=True)
    first = cupyops.layer_norm_backward(dy, x, mean, rstd, w, policy=policy)
    second = cupyops.layer_norm_backward(dy, x, mean, rstd, w, policy=policy)
    for a, b in zip(first, second):
        assert bool(cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16)))


# 300: warp (padded); 1024: warp / register block; 4096: register block / shared
# memory; 20000: shared memory / uncached; 40000: uncached
GRAD_PATH_COLS = (300, 1024, 4096, 20000, 40000)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cols", GRAD_PATH_COLS)
@pytest.mark.parametrize("with_weight", [False, True], ids=["no_weight", "weight"])
@pytest.mark.parametrize("wanted", [(False, False), (True, False), (False, True)],
                         ids=["dx_only", "dweight_only", "dbias_only"])
def test_backward_without_param_grads(rng, wanted, with_weight, cols, policy):
    """Gradients not wanted are None and their workspace is never allocated:
    no kernel may write partial sums through a null pointer (this once ran the
    fused kernel with a null workspace: cudaErrorIllegalAddress)."""
    need_weight_grad, need_bias_grad = wanted
    rows = 11
    x, x64 = _data(rng, (rows, cols), numpy.float32)
    dy, dy64 = _data(rng, (rows, cols), numpy.float32)
    w, w64 = _data(rng, (cols,), numpy.float32, 1.0, 0.2) if with_weight else (None, None)
    dx_ref, dw_ref, db_ref = _reference_backward(dy64, x64, w64, 1, True)
    _, mean, rstd = cupyops.layer_norm(x, w, eps=EPS, return_stats=True)
    dx, dw, db = cupyops.layer_norm_backward(dy, x, mean, rstd, w, need_weight_grad=need_weight_grad,
                                             need_bias_grad=need_bias_grad, policy=policy)
    _cupy().cuda.get_current_stream().synchronize()      # a fault surfaces here, named
    assert (dw is None) == (not need_weight_grad) and (db is None) == (not need_bias_grad)
    assert_close(dx.get(), dx_ref, numpy.float32, scale=10)
    if dw is not None:
        assert_close(dw.get(), dw_ref, numpy.float32, scale=100)
    if db is not None:
        assert_close(db.get(), db_ref, numpy.float32, scale=100)
    dx_ref, dw_ref, _ = _reference_backward(dy64, x64, w64, 1, False)
    _, rstd = cupyops.rms_norm(x, w, eps=EPS, return_stats=True)
    dx, dw = cupyops.rms_norm_backward(dy, x, rstd, w, need_weight_grad=need_weight_grad, policy=policy)
    _cupy().cuda.get_current_stream().synchronize()
    assert (dw is None) == (not need_weight_grad)
    assert_close(dx.get(), dx_ref, numpy.float32, scale=10)
    if dw is not None:
        assert_close(dw.get(), dw_ref, numpy.float32, scale=100)


# -- more than 2^31 elements ------------------------------------------------------

def _require_free_bytes(needed):
    cupy = _cupy()
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < needed:
        pytest.skip(f"needs {needed / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cols", [1000, 4096])
def test_more_than_2_31_elements(rng, cols, policy):
    """rows * cols > 2^31: row offsets are 64-bit in every path (the last rows
    are checked; a 32-bit row * stride would wrap to the start)."""
    cupy = _cupy()
    rows = (2**31) // cols + 3
    _require_free_bytes(rows * cols * 2 * 5 + 2**30)          # x, y, dy, dx (float16) and slack
    x = cupy.empty((rows, cols), numpy.float16)
    x[:] = 1.0
    tail = slice(rows - 3, rows)
    x_tail = rng.standard_normal((3, cols)).astype(numpy.float16)
    x[tail] = cupy.asarray(x_tail)
    dy = cupy.full((rows, cols), 0.5, numpy.float16)
    dy_tail = rng.standard_normal((3, cols)).astype(numpy.float16)
    dy[tail] = cupy.asarray(dy_tail)
    x64, dy64 = x_tail.astype(numpy.float64), dy_tail.astype(numpy.float64)
    y, mean, rstd = cupyops.layer_norm(x, eps=EPS, return_stats=True, policy=policy)
    assert_close(y[tail].get(), _reference(x64, None, None, 1, True)[0], numpy.float16, scale=4)
    assert_close(y[:2].get(), numpy.zeros((2, cols)), numpy.float16)
    del y
    dx, dw, db = cupyops.layer_norm_backward(dy, x, mean, rstd, need_bias_grad=False, policy=policy)
    dx_ref, dw_ref, _ = _reference_backward(dy64, x64, None, 1, True)
    assert_close(dx[tail].get(), dx_ref, numpy.float16, scale=10)
    # constant rows have xhat = 0 exactly: dweight is the tail rows' alone
    assert db is None
    assert_close(dw.get(), dw_ref, numpy.float16, scale=10)


# -- torch parity ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("cols", [96, 1024, 3000, 16384])
def test_torch_parity(rng, dtype, cols):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    cupy = _cupy()
    tdtype = getattr(torch, dtype)
    tx = torch.randn(64, cols, device="cuda", dtype=tdtype, requires_grad=True)
    tw = (1 + 0.2 * torch.randn(cols, device="cuda", dtype=tdtype)).requires_grad_()
    tb = (0.2 * torch.randn(cols, device="cuda", dtype=tdtype)).requires_grad_()
    tdy = torch.randn(64, cols, device="cuda", dtype=tdtype)
    x, w, b, dy = (cupy.from_dlpack(t.detach()) for t in (tx, tw, tb, tdy))
    np_dtype = BFLOAT16 if dtype == "bfloat16" else numpy.dtype(dtype)

    def close(ours, theirs):
        assert_close(ours.get(), theirs.detach().float().cpu().numpy().astype(numpy.float64), np_dtype,
                     scale=10)

    ty = F.layer_norm(tx, (cols,), tw, tb, EPS)
    y, mean, rstd = cupyops.layer_norm(x, w, b, eps=EPS, return_stats=True)
    close(y, ty)
    for ours, theirs in zip(cupyops.layer_norm_backward(dy, x, mean, rstd, w),
                            torch.autograd.grad(ty, (tx, tw, tb), tdy)):
        close(ours, theirs)
    if hasattr(F, "rms_norm"):
        ty = F.rms_norm(tx, (cols,), tw, EPS)
        y, rstd = cupyops.rms_norm(x, w, eps=EPS, return_stats=True)
        close(y, ty)
        for ours, theirs in zip(cupyops.rms_norm_backward(dy, x, rstd, w),
                                torch.autograd.grad(ty, (tx, tw), tdy)):
            close(ours, theirs)


# -- bad input ------------------------------------------------------------------

def test_bad_input_names_the_argument():
    cupy = _cupy()
    x = cupy.ones((4, 8), cupy.float16)
    good = cupy.ones(8, cupy.float16)
    cases = [
        (dict(weight=cupy.ones(7, cupy.float16)), ValueError, "weight"),
        (dict(weight=cupy.ones(8, cupy.float32)), TypeError, "weight"),
        (dict(weight=numpy.ones(8, numpy.float16)), TypeError, "weight"),
        (dict(bias=cupy.ones((1, 8), cupy.float16)), ValueError, "bias"),
        (dict(bias=cupy.ones(8, cupy.float64)), TypeError, "bias"),
        (dict(residual=cupy.ones((4, 7), cupy.float16)), ValueError, "residual"),
        (dict(residual=cupy.ones((4, 8), cupy.float32)), TypeError, "residual"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(eps=-1e-5), ValueError, "eps"),
        (dict(axis=0), ValueError, "axis"),
        (dict(weight=good, policy="fast"), ValueError, "policy"),
    ]
    for kwargs, error, word in cases:
        with pytest.raises(error, match=word):
            cupyops.layer_norm(x, **kwargs)
    with pytest.raises(TypeError, match="x"):
        cupyops.layer_norm(numpy.ones((4, 8)))
    with pytest.raises(TypeError):
        cupyops.rms_norm(cupy.ones((4, 8), cupy.int32))
    with pytest.raises(ValueError, match="rstd"):
        cupyops.rms_norm_backward(x, x, cupy.ones(3, cupy.float32))
    with pytest.raises(ValueError, match="dy"):
        cupyops.layer_norm_backward(x[:2], x, cupy.ones(4, cupy.float32), cupy.ones(4, cupy.float32))
