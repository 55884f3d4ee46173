"""GPU tests of conv2d_int8 against the exact NumPy reference (tests/conftest.py
skips them where no GPU is usable): every filter shape, stride, padding,
dilation, tails, both policies, every kernel configuration (wgmma's on sm_90,
the warp-specialised ones on every shape),
every candidate the generator yields for tail shapes with every out_dtype,
split-K, the epilogue (bias, z, per-channel alpha, ReLU), an out overlapping an
operand, the int8 peak kernels, bad input."""
from __future__ import annotations

from dataclasses import replace

import numpy
import pytest

import cupyops
from cupyops import jit, tune
from cupyops.callcache import CallCache
from cupyops.launch import Target
from cupyops.ops import conv2d_int8 as conv
from cupyops.ops import conv_plan
from cupyops.ops import conv_reference as ref
from cupyops.ops import mma_peak
from cupyops.ops.conv_layout import ConvGeometry

pytestmark = pytest.mark.gpu

# (N, C, H, W, K, R, S, stride, padding, dilation)
SHAPES = [
    (2, 64, 7, 9, 32, 1, 1, 1, 0, 1),            # 1x1, one GEMM_K step
    (2, 64, 13, 11, 64, 3, 3, 1, 1, 1),
    (3, 32, 15, 14, 96, 3, 3, 2, 1, 1),          # stride 2, K not a multiple of a tile
    (1, 96, 12, 12, 128, 5, 5, 1, 2, 1),
    (2, 32, 23, 23, 64, 7, 7, 2, 3, 1),
    (1, 64, 9, 17, 32, 1, 7, 1, (0, 3), 1),      # 1x7
    (2, 64, 16, 16, 64, 3, 3, 1, 2, 2),          # dilation 2
    (1, 32, 8, 8, 32, 3, 3, 1, 1, 1),            # N = 1, C = K = 32, odd chunks (a half step)
    (1, 32, 5, 5, 32, 3, 3, 1, 3, 1),            # padding 3: rows and columns of padding only
    (4, 128, 20, 20, 256, 3, 3, 1, 0, 1),        # several tiles each way
    (1, 256, 7, 7, 256, 3, 3, 1, 1, 1),          # a small grid: split-K under auto
    (3, 64, 1, 1, 64, 1, 1, 1, 0, 1),            # one output pixel an image (OH * OW = 1)
]

# 1x1 filters at stride 1 without padding, images of 224 pixels: the kernels taking the
# pixels as rows of four (conv_tma.rows_fit)
ROWS_SHAPES = [(2, 96, 8, 28, 160, 1, 1, 1, 0, 1), (3, 64, 14, 16, 64, 1, 1, 1, 0, 1)]


@pytest.fixture(autouse=True)
def no_autotune(monkeypatch):
    monkeypatch.setenv(tune.AUTOTUNE_ENV, "0")


def _geometry(shape) -> ConvGeometry:
    n, c, h, w, k, r, s, stride, padding, dilation = shape
    as_pair = lambda v: v if isinstance(v, tuple) else (v, v)   # noqa: E731
    return ConvGeometry(n, c, h, w, k, r, s, as_pair(stride), as_pair(padding), as_pair(dilation))


def _inputs(rng, g):
    x = rng.integers(-128, 128, (g.n, g.c, g.h, g.w), dtype=numpy.int8)
    w = rng.integers(-128, 128, (g.k, g.c, g.r, g.s), dtype=numpy.int8)
    return x, w


def _scale(g) -> float:
    """An alpha that puts most outputs within int8 and saturates some."""
    return 40.0 / (numpy.sqrt(g.gemm[2]) * 74.0 * 74.0)


def _check_int8(y, value, label):
    bad = ref.int8_mismatches(cupyops.from_nchw32(y).get(), value)
    if len(bad):
        first = tuple(bad[0])
        got = cupyops.from_nchw32(y).get()[first]
        pytest.fail(f"{label}: {len(bad)} int8 outputs differ; first (n, k, oh, ow) {list(first)}: "
                    f"got {got}, float64 value {value[first]!r}")


def _check_exact(y, expected, label):
    got = cupyops.from_nchw32(y).get()
    bad = numpy.argwhere(got != expected)
    if len(bad):
        first = tuple(bad[0])
        pytest.fail(f"{label}: {len(bad)} outputs differ; first (n, k, oh, ow) {list(first)}: got {got[first]}, "
                    f"expected {expected[first]}")


def _check_output(y, value, label):
    """int32: exact; int8: exact but next to a rounding boundary; float16 / float32: close."""
    if y.dtype == numpy.int32:
        _check_exact(y, value, label)
    elif y.dtype == numpy.int8:
        _check_int8(y, value, label)
    else:
        tolerance = dict(rtol=1e-3, atol=2e-2) if y.dtype == numpy.float16 else dict(rtol=1e-5, atol=1e-4)
        numpy.testing.assert_allclose(cupyops.from_nchw32(y).get().astype(numpy.float64), value,
                                      err_msg=label, **tolerance)


def _run(x, w, g, **options):
    import cupy

    x5 = cupy.asarray(cupyops.to_nchw32(x))
    w5 = cupy.asarray(cupyops.pack_conv_filter(w))
    return cupyops.conv2d_int8(x5, w5, stride=g.stride, padding=g.padding, dilation=g.dilation, **options)


@pytest.mark.parametrize("policy", conv.POLICIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_accumulators_exact(rng, shape, policy):
    g = _geometry(shape)
    x, w = _inputs(rng, g)
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    y = _run(x, w, g, out_dtype="int32", policy=policy)
    _check_exact(y, acc, f"{shape} {policy} int32")


@pytest.mark.parametrize("policy", conv.POLICIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_output(rng, shape, policy):
    g = _geometry(shape)
    x, w = _inputs(rng, g)
    alpha = _scale(g)
    value = ref.epilogue(ref.accumulators(x, w, g.stride, g.padding, g.dilation), alpha=alpha)
    _check_int8(_run(x, w, g, alpha=alpha, policy=policy), value, f"{shape} {policy}")


@pytest.mark.parametrize("out_dtype", ["int8", "float16", "float32"])
@pytest.mark.parametrize("policy", conv.POLICIES)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[7], SHAPES[10]])
@pytest.mark.parametrize("bias_dtype", [numpy.float32, numpy.int32])
def test_full_epilogue(rng, shape, policy, out_dtype, bias_dtype):
    import cupy

    g = _geometry(shape)
    x, w = _inputs(rng, g)
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    alpha = (_scale(g) * rng.uniform(0.5, 1.5, g.k)).astype(numpy.float32)
    bias = rng.integers(-20, 20, g.k).astype(bias_dtype)
    z = rng.integers(-128, 128, (g.n, g.k, g.oh, g.ow), dtype=numpy.int8)
    beta, gamma = 0.75, 0.125
    value = ref.epilogue(acc, alpha=alpha, beta=beta, gamma=gamma, bias=bias, z=z, relu=True)
    out = cupy.full(g.output_shape, 77, dtype=out_dtype)   # poisoned: unwritten outputs fail
    y = _run(x, w, g, bias=cupy.asarray(bias), z=cupy.asarray(cupyops.to_nchw32(z)), alpha=cupy.asarray(alpha),
             beta=beta, gamma=gamma, relu=True, out_dtype=out_dtype, out=out, policy=policy)
    assert y is out
    _check_output(y, value, f"{shape} {policy} {out_dtype} bias {numpy.dtype(bias_dtype)}")


@pytest.mark.parametrize("spec_index", range(len(conv_plan.all_specs("sm_90"))))
@pytest.mark.parametrize("splits", [1, 3])
def test_every_configuration(rng, spec_index, splits):
    """Each kernel the generator can produce, launched directly, with and without split-K
    (those taking the pixels as rows of four on the 1x1 filter they serve)."""
    import cupy

    target_arch = Target.live(cupy.cuda.runtime.getDevice()).facts.arch
    spec = conv_plan.all_specs(target_arch)[spec_index]
    g = _geometry(ROWS_SHAPES[0] if spec.tma == "rows" else (2, 96, 19, 17, 160, 3, 3, 1, 1, 1))
    x, w = _inputs(rng, g)
    per_split = -(-g.k_steps // splits)
    chosen = conv_plan.ConvPlan(spec, g, -(-g.k_steps // per_split), per_split, "test", "auto")
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    y = cupy.full(g.output_shape, -7, dtype=numpy.int32)
    conv.launch(chosen, x5, w5, y, None, None, None, conv.Epilogue(out_dtype="int32"))
    _check_exact(y, ref.accumulators(x, w, g.stride, g.padding, g.dilation), f"{spec.name} splits {splits}")


def _check_persistent(rng, monkeypatch, shape, configs_of) -> None:
    """The persistent (warp-specialised) kernels of configs_of(g) on `shape`, whole and
    split along GEMM_K in three, into poisoned outputs; on their persistent grid and on
    two blocks, each then walking many tiles and splits."""
    import cupy

    g = _geometry(shape)
    x, w = _inputs(rng, g)
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    configs = configs_of(g)
    assert configs, f"no configuration for {g}"
    resident = conv._resident_blocks
    for blocks in (None, 2):
        monkeypatch.setattr(conv, "_resident_blocks", resident if blocks is None else lambda spec, device_id: blocks)
        for config in configs:
            spec = conv_plan.spec_for(config, "auto", conv_plan.WGMMA_ARCH)
            steps = conv_plan.split_steps(g, spec)
            for splits in (1, 3):
                per_split = -(-steps // splits)
                chosen = conv_plan.ConvPlan(spec, g, -(-steps // per_split), per_split, "test", "auto")
                y = cupy.full(g.output_shape, -7, dtype=numpy.int32)
                conv.launch(chosen, x5, w5, y, None, None, None, conv.Epilogue(out_dtype="int32"))
                _check_exact(y, acc, f"{spec.name} splits {chosen.splits} blocks {blocks or 'resident'}")


def _live_arch() -> str:
    import cupy

    return Target.live(cupy.cuda.runtime.getDevice()).facts.arch


@pytest.mark.parametrize("tma", ["filter", "im2col"])
@pytest.mark.parametrize("shape", SHAPES)
def test_warp_specialised_kernels_every_shape(rng, monkeypatch, shape, tma):
    """The warp-specialised kernels (the copy engine bringing the filter, or the
    filter and the pixels), the first and last configuration of each, on every filter
    shape, stride, padding and dilation above (_check_persistent)."""
    if _live_arch() != conv_plan.WGMMA_ARCH:
        pytest.skip("the copy engine's kernels are sm_90a code")
    configs = [c for c in conv_plan.TMA_CONFIGS if c.tma == tma]
    _check_persistent(rng, monkeypatch, shape, lambda g: (configs[0], configs[-1]))


@pytest.mark.parametrize("relu, per_channel", [(False, True), (True, False)])
@pytest.mark.parametrize("shape", ROWS_SHAPES)
def test_pixels_as_rows_of_four(rng, monkeypatch, shape, relu, per_channel):
    """The kernels whose pixels come as rows of four (1x1 filters, stride 1, no padding,
    images of whole tiles; GEMM_M tails of 160 channels, three channel groups): every
    configuration raw (_check_persistent), then int8 without z, one alpha or per channel,
    ReLU or not, through the epilogue by warpgroup (the tile's pixels reordered back,
    RowsPixels)."""
    import cupy

    if _live_arch() != conv_plan.WGMMA_ARCH:
        pytest.skip("the copy engine's kernels are sm_90a code")
    configs = [c for c in conv_plan.TMA_CONFIGS if c.tma == "rows"]
    _check_persistent(rng, monkeypatch, shape, lambda g: configs)
    g = _geometry(shape)
    x, w = _inputs(rng, g)
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    alpha = (_scale(g) * rng.uniform(0.5, 1.5, g.k)).astype(numpy.float32) if per_channel else _scale(g)
    bias = rng.integers(-20, 20, g.k).astype(numpy.float32)
    epilogue = conv.Epilogue("int8", "float32", relu, False, per_channel, 1.0 if per_channel else float(alpha), 0.75)
    value = ref.epilogue(acc, alpha=alpha, beta=0.75, bias=bias, relu=relu)
    arrays = (None, cupy.asarray(alpha) if per_channel else None, cupy.asarray(bias))
    for config in configs:
        spec = conv_plan.spec_for(config, "auto", conv_plan.WGMMA_ARCH)
        y = cupy.full(g.output_shape, 77, dtype=numpy.int8)
        conv.launch(conv_plan.ConvPlan(spec, g, 1, g.k_steps, "test", "auto"), x5, w5, y, *arrays, epilogue)
        _check_output(y, value, f"{spec.name} relu {relu}")


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[10]])
def test_pairs_splitting_gemm_k(rng, monkeypatch, shape):
    """The pairs of blocks that split a tile's GEMM_K and sum in distributed shared memory,
    whole and split along GEMM_K in three, one of a pair's shares empty on the 1x1 shape
    (one GEMM_K step) (_check_persistent; one tile a pair, so both runs launch every pair)."""
    if _live_arch() != conv_plan.WGMMA_ARCH:
        pytest.skip("the copy engine's kernels are sm_90a code")
    _check_persistent(rng, monkeypatch, shape, lambda g: [c for c in conv_plan.TMA_CONFIGS if c.k_blocks > 1])


@pytest.mark.parametrize("shape", [s for s in SHAPES if _geometry(s).stride == (1, 1) and _geometry(s).s > 1] +
                         [(1, 32, 5, 10, 32, 2, 3, 1, (0, 1), 1)])   # 2 x 3: stages of 5 rows of 12 slots
def test_halo_kernels_every_shape(rng, monkeypatch, shape):
    """Every halo tile the generator yields for each stride-1 shape above (whole input
    rows in shared memory, read once for all R filter rows' taps where they fit; rows of
    slots not a multiple of 8, stages not whole runs of 8 slots), and the first with one
    filter row's taps a stage (_check_persistent)."""
    import cupy

    if _live_arch() != conv_plan.WGMMA_ARCH:
        pytest.skip("halo tiles are sm_90a code")
    smem = Target.live(cupy.cuda.runtime.getDevice()).facts.smem_per_block_optin
    def with_one_row(g):
        configs = conv_plan.halo_configs(g, smem)
        return tuple(dict.fromkeys((*configs, replace(configs[0], halo_filter_rows=1))))
    _check_persistent(rng, monkeypatch, shape, with_one_row)


@pytest.mark.parametrize("relu, per_channel, bias_dtype", [(False, True, numpy.float32), (True, False, numpy.int32)])
@pytest.mark.parametrize("shape", [(2, 96, 19, 17, 160, 3, 3, 1, 1, 1), SHAPES[3], SHAPES[6], SHAPES[9]])
def test_halo_tiles_int8_without_z(rng, shape, relu, per_channel, bias_dtype):
    """Every halo tile's int8 epilogue without z (the exchange-free one where its registers
    allow, kernels/conv_halo.cuh: conv_halo_epilogue_s8, else through shared memory) into
    poisoned outputs: per-channel or one alpha, float32 or int32 bias, ReLU or not, on shapes
    with tails in GEMM_M (160 channels), in a row's slots (OW 17 in 24 or 32) and in the rows."""
    import cupy

    if _live_arch() != conv_plan.WGMMA_ARCH:
        pytest.skip("halo tiles are sm_90a code")
    g = _geometry(shape)
    x, w = _inputs(rng, g)
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    alpha = (_scale(g) * rng.uniform(0.5, 1.5, g.k)).astype(numpy.float32) if per_channel else _scale(g)
    bias = rng.integers(-20, 20, g.k).astype(bias_dtype)
    epilogue = conv.Epilogue("int8", numpy.dtype(bias_dtype).name, relu, False, per_channel,
                             1.0 if per_channel else float(alpha), 0.75, 0.0)
    value = ref.epilogue(acc, alpha=alpha, beta=0.75, bias=bias, relu=relu)
    arrays = (None, cupy.asarray(alpha) if per_channel else None, cupy.asarray(bias))
    facts = Target.live(cupy.cuda.runtime.getDevice()).facts
    configs = conv_plan.halo_configs(g, facts.smem_per_block_optin, facts.sm_count)
    assert configs
    for config in configs:
        spec = conv_plan.spec_for(config, "auto", conv_plan.WGMMA_ARCH)
        chosen = conv_plan.ConvPlan(spec, g, 1, conv_plan.split_steps(g, spec), "test", "auto")
        y = cupy.full(g.output_shape, 77, dtype=numpy.int8)
        conv.launch(chosen, x5, w5, y, *arrays, epilogue)
        _check_output(y, value, f"{spec.name} relu {relu}")


GENERATOR_SHAPES = [SHAPES[2], SHAPES[7], (2, 96, 19, 17, 160, 3, 3, 1, 1, 1), SHAPES[10]]


@pytest.mark.parametrize("out_dtype", ["int32", "int8", "float16", "float32"])
@pytest.mark.parametrize("shape", GENERATOR_SHAPES)
def test_every_candidate_of_the_generator(rng, shape, out_dtype):
    """Every auto candidate the generator yields on this GPU (wgmma's on sm_90) for shapes
    with tails in GEMM_M, GEMM_N and GEMM_K, N = 1, C = K = 32 and a small grid, each also
    split along GEMM_K in three, through the whole epilogue (raw int32: none)."""
    import cupy

    g = _geometry(shape)
    x, w = _inputs(rng, g)
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    if out_dtype == "int32":
        arrays, epilogue, value = (None, None, None), conv.Epilogue(out_dtype="int32"), acc
    else:
        alpha = (_scale(g) * rng.uniform(0.5, 1.5, g.k)).astype(numpy.float32)
        bias = rng.integers(-20, 20, g.k).astype(numpy.float32)
        z = rng.integers(-128, 128, (g.n, g.k, g.oh, g.ow), dtype=numpy.int8)
        arrays = (cupy.asarray(cupyops.to_nchw32(z)), cupy.asarray(alpha), cupy.asarray(bias))
        epilogue = conv.Epilogue(out_dtype, "float32", True, True, True, 1.0, 0.75, 0.125)
        value = ref.epilogue(acc, alpha=alpha, beta=0.75, gamma=0.125, bias=bias, z=z, relu=True)
    facts = Target.live(cupy.cuda.runtime.getDevice()).facts
    found = conv_plan.candidates(g, facts.sm_count, facts.smem_per_block_optin, facts.arch)
    assert any(c["wgmma"] for c in found) == (facts.arch == conv_plan.WGMMA_ARCH)
    split = [{**c, "splits": 3, "steps_per_split": -(-conv_plan.split_steps(g, conv_plan.config_of(c)) // 3)}
             for c in found]
    for candidate in found + split:
        chosen = conv_plan.plan_from(g, candidate, facts.arch, "test")
        if (chosen.splits - 1) * chosen.steps_per_split >= conv_plan.split_steps(g, chosen.spec):
            continue   # a split would be empty
        y = cupy.full(g.output_shape, -7 if out_dtype == "int32" else 77, dtype=out_dtype)   # poisoned
        conv.launch(chosen, x5, w5, y, *arrays, epilogue)
        _check_output(y, value, f"{chosen.spec.name} splits {chosen.splits} {out_dtype}")


def test_int8_peak_kernels_run():
    """Each peak kernel of this GPU's arch runs and reports a plausible figure (TOPS)."""
    import cupy

    device_id = cupy.cuda.runtime.getDevice()
    peaks = mma_peak.measure_peaks(device_id)
    assert set(peaks) == {s.instruction for s in mma_peak.peak_specs(Target.live(device_id).facts.arch)}
    assert all(10 < tops < 20000 for tops in peaks.values()), peaks


def test_repeated_calls_take_the_memo_and_stay_right(rng, monkeypatch):
    """A repeated call of one layout replays its ready launch (conv2d_int8._calls); views
    of another layout, a per-channel alpha changed in place and fresh arrays of the same
    layout all still give the reference's values."""
    import cupy

    g = _geometry((2, 64, 13, 11, 64, 3, 3, 1, 1, 1))
    x, w = _inputs(rng, g)
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    options = dict(stride=g.stride, padding=g.padding, dilation=g.dilation)
    monkeypatch.setattr(conv, "_calls", CallCache())
    for _ in range(2):
        _check_exact(cupyops.conv2d_int8(x5, w5, out_dtype="int32", **options), acc, "allocating")
        y = cupy.full(g.output_shape, -7, dtype=numpy.int32)
        assert cupyops.conv2d_int8(x5, w5, out_dtype="int32", out=y, **options) is y
        _check_exact(y, acc, "out=")
    assert len(conv._calls._entries) == 2
    wide = cupy.zeros((*x5.shape[:-1], 64), numpy.int8)
    wide[..., :32] = x5   # a strided view: copied by the slow path, never remembered
    _check_exact(cupyops.conv2d_int8(wide[..., :32], w5, out_dtype="int32", **options), acc, "strided x")
    _check_exact(cupyops.conv2d_int8(wide[..., :32], w5, out_dtype="int32", **options), acc, "strided x again")
    assert len(conv._calls._entries) == 2
    alpha = cupy.full(g.k, _scale(g), numpy.float32)
    for scale in (1.0, 0.5):
        alpha *= scale   # the same array, new values
        value = ref.epilogue(acc, alpha=alpha.get(), beta=1.0, gamma=0.0, bias=None, z=None, relu=False)
        _check_int8(cupyops.conv2d_int8(x5, w5, alpha=alpha, **options), value, f"per-channel alpha x{scale}")
    fresh_x, fresh_w = x5.copy(), w5.copy()   # new addresses: new tensor maps where the plan uses them
    _check_exact(cupyops.conv2d_int8(fresh_x, fresh_w, out_dtype="int32", **options), acc, "fresh arrays")


@pytest.mark.parametrize("policy", conv.POLICIES)
def test_out_overlapping_an_operand(rng, monkeypatch, policy):
    """out = x (a 3x3 filter at padding 1 keeps the shape) and an out sharing w's memory get
    the result through a fresh array, on the first call and on the memoised one; out = z
    updates the residual in place. Each against the reference of the operands' values before
    the call; the tiles outnumber the SMs, so a kernel writing x or w while later tiles read
    them would be caught."""
    import cupy

    g = _geometry((8, 64, 48, 48, 64, 3, 3, 1, 1, 1))
    x, w = _inputs(rng, g)
    acc = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    options = dict(stride=g.stride, padding=g.padding, dilation=g.dilation, policy=policy)
    monkeypatch.setattr(conv, "_calls", CallCache())
    alpha = _scale(g)
    value = ref.epilogue(acc, alpha=alpha)
    for call in range(3):   # the first call plans; the later ones replay the memo
        _check_int8(cupyops.conv2d_int8(x5, w5, alpha=alpha, **options), value, f"{policy} fresh output, call {call}")
        inputs = x5.copy()
        assert cupyops.conv2d_int8(inputs, w5, alpha=alpha, out=inputs, **options) is inputs
        _check_int8(inputs, value, f"{policy} out=x, call {call}")
        memory = cupy.zeros(x5.size, numpy.int8)    # the filter, then the output over it
        filters = memory[:w5.size].reshape(w5.shape)
        filters[...] = w5
        out = memory.reshape(x5.shape)
        assert cupyops.conv2d_int8(x5, filters, alpha=alpha, out=out, **options) is out
        _check_int8(out, value, f"{policy} out over w's memory, call {call}")
    z = rng.integers(-128, 128, (g.n, g.k, g.oh, g.ow), dtype=numpy.int8)
    with_z = ref.epilogue(acc, alpha=alpha, beta=1.0, gamma=0.5, bias=None, z=z, relu=False)
    for call in range(2):
        residual = cupy.asarray(cupyops.to_nchw32(z))
        assert cupyops.conv2d_int8(x5, w5, z=residual, alpha=alpha, gamma=0.5, out=residual, **options) is residual
        _check_int8(residual, with_z, f"{policy} out=z, call {call}")


def test_first_use_tunes_and_explain_says_so(rng, monkeypatch, tmp_path):
    import cupy

    monkeypatch.setenv(tune.AUTOTUNE_ENV, "1")
    table = tune.TuningTable(tmp_path / "tuning.json")
    monkeypatch.setattr(tune, "_default_table", table)
    g = _geometry((2, 64, 10, 10, 64, 3, 3, 1, 1, 1))
    x, w = _inputs(rng, g)
    _check_exact(_run(x, w, g, out_dtype="int32"), ref.accumulators(x, w, g.stride, g.padding), "tuned plan")
    device = tune.DeviceKey.live(cupy.cuda.runtime.getDevice())
    assert table.lookup(device, conv_plan.OP, g.key()) is not None
    assert conv.live_plan(g, "auto", cupy.cuda.runtime.getDevice()).source == "tuned"


def test_precompile_compiles_every_kernel_for_the_gpu_it_is_given(monkeypatch):
    """The tuner's precompile with a GPU compiles the kernels that are not arch-specific
    too (each once, for that GPU, in its threads); without one it leaves them to their
    first launch."""
    import threading

    import cupy

    calls = []

    class Recorded:
        def __init__(self, spec, device_id):
            self.spec, self.device_id = spec, device_id

        def compile(self):
            calls.append((self.spec.name, self.device_id, cupy.cuda.runtime.getDevice(), threading.get_ident()))

    monkeypatch.setattr(jit, "kernel", Recorded)
    generic = [conv_plan.spec_for(c, "auto", "sm_80") for c in conv_plan.AUTO_CONFIGS[:3]]
    device = cupy.cuda.runtime.getDevice()
    jit.precompile(generic + generic[:1], "sm_80", device)
    assert sorted(name for name, *_ in calls) == sorted(spec.name for spec in generic)
    assert all(given == current == device for _, given, current, _ in calls)
    assert any(thread != threading.get_ident() for *_, thread in calls)
    calls.clear()
    jit.precompile(generic, "sm_80")
    assert not calls


def test_bad_input_names_the_argument(rng):
    import cupy

    g = _geometry(SHAPES[1])
    x, w = _inputs(rng, g)
    x5, w5 = cupy.asarray(cupyops.to_nchw32(x)), cupy.asarray(cupyops.pack_conv_filter(w))
    cases = [
        (TypeError, "x must be int8", lambda: cupyops.conv2d_int8(x5.astype(cupy.int16), w5)),
        (TypeError, "w must be int8", lambda: cupyops.conv2d_int8(x5, w5.astype(cupy.float32))),
        (ValueError, "to_nchw32", lambda: cupyops.conv2d_int8(cupy.asarray(x), w5)),
        (ValueError, "pack_conv_filter", lambda: cupyops.conv2d_int8(x5, cupy.asarray(w))),
        (ValueError, "input channels", lambda: cupyops.conv2d_int8(x5[:, :1], w5)),
        (ValueError, "does not fit", lambda: cupyops.conv2d_int8(x5[:, :, :2, :2], w5)),
        (ValueError, "bias", lambda: cupyops.conv2d_int8(x5, w5, cupy.zeros(g.k + 1, cupy.float32))),
        (TypeError, "bias", lambda: cupyops.conv2d_int8(x5, w5, cupy.zeros(g.k, cupy.float64))),
        (ValueError, "alpha", lambda: cupyops.conv2d_int8(x5, w5, alpha=cupy.ones(3, cupy.float32))),
        (ValueError, "z has shape", lambda: cupyops.conv2d_int8(x5, w5, z=x5)),
        (ValueError, "raw accumulators", lambda: cupyops.conv2d_int8(x5, w5, relu=True, out_dtype="int32")),
        (ValueError, "out_dtype", lambda: cupyops.conv2d_int8(x5, w5, out_dtype="bfloat16")),
        (ValueError, "out has shape", lambda: cupyops.conv2d_int8(x5, w5, out=cupy.empty(3, cupy.int8))),
        (ValueError, "stride", lambda: cupyops.conv2d_int8(x5, w5, stride=0)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    cupy.cuda.Device().synchronize()   # no launch faulted


def test_arrays_on_another_device_are_refused(rng):
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    g = _geometry(SHAPES[0])
    x, w = _inputs(rng, g)
    x5 = cupy.asarray(cupyops.to_nchw32(x))
    with cupy.cuda.Device(1):
        w5 = cupy.asarray(cupyops.pack_conv_filter(w))
    with pytest.raises(ValueError, match="w is on GPU 1"):
        cupyops.conv2d_int8(x5, w5)


def test_layout_helpers_on_the_gpu(rng):
    import cupy

    x = rng.integers(-128, 128, (2, 40, 3, 5), dtype=numpy.int8)
    packed = cupyops.to_nchw32(cupy.asarray(x))
    assert isinstance(packed, cupy.ndarray) and packed.shape == (2, 2, 3, 5, 32)
    numpy.testing.assert_array_equal(cupyops.from_nchw32(packed, 40).get(), x)
