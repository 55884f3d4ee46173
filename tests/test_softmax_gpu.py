"""GPU tests of softmax / log_softmax (SPEC §8, §10): every path and path boundary,
every dtype and both policies against float64 NumPy references of SciPy's
formulas, on fresh random data, with poisoned outputs; layouts, special values,
bad input, and the occupancy calculator against the driver.

Inputs are drawn in float64, rounded to the tested dtype, and the reference is
computed from the rounded values, so only the kernel's arithmetic is measured.
"""
from __future__ import annotations

from dataclasses import replace

import numpy
import pytest
from conftest import assert_close, peeled_cols
from numpy.exceptions import AxisError

import cupyops
from cupyops import arrays, device, dtypes, jit
from cupyops.dtypes import BFLOAT16
from cupyops.launch import Target, live_function
from cupyops.ops import softmax_rows as sm
from cupyops.profile import profile_for

pytestmark = pytest.mark.gpu

DTYPES = [numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32),
          numpy.dtype(numpy.float64)]
DTYPE_IDS = ["float16", "bfloat16", "float32", "float64"]
COMPUTE_ITEMSIZE = {2: 4, 4: 4, 8: 8}     # storage itemsize -> compute itemsize
POLICIES = ("auto", "oneflow")
FUNCTIONS = {"softmax": cupyops.softmax, "log_softmax": cupyops.log_softmax}


# -- float64 references: scipy.special.softmax / log_softmax, step for step ----------

def reference_softmax(x, axis=None):
    """scipy.special.softmax: exp(x - max) / sum(exp(x - max))."""
    x = numpy.asarray(x, dtype=numpy.float64)
    x_max = numpy.amax(x, axis=axis, keepdims=True)
    with numpy.errstate(invalid="ignore", over="ignore"):
        exp_x_shifted = numpy.exp(x - x_max)
        return exp_x_shifted / numpy.sum(exp_x_shifted, axis=axis, keepdims=True)


def reference_log_softmax(x, axis=None):
    """scipy.special.log_softmax: shift by the max where it is finite (else by 0),
    then tmp - log(sum(exp(tmp)))."""
    x = numpy.asarray(x, dtype=numpy.float64)
    x_max = numpy.amax(x, axis=axis, keepdims=True)
    x_max = numpy.where(numpy.isfinite(x_max), x_max, 0.0)
    with numpy.errstate(invalid="ignore", over="ignore", divide="ignore"):
        tmp = x - x_max
        s = numpy.sum(numpy.exp(tmp), axis=axis, keepdims=True)
        return tmp - numpy.log(s)


REFERENCES = {"softmax": reference_softmax, "log_softmax": reference_log_softmax}


# -- helpers ---------------------------------------------------------------------------

def random_input(rng, shape, dtype, scale=4.0, offset=0.0):
    """(host array rounded to dtype, its exact float64 value)."""
    host = (rng.standard_normal(shape) * scale + offset).astype(dtype)
    return host, host.astype(numpy.float64)


def poisoned(shape, dtype, value=numpy.nan):
    """A device array full of `value`: elements a kernel leaves unwritten fail."""
    import cupy

    return cupy.asarray(numpy.full(shape, value, dtype=dtype))


def to_host(array):
    import cupy

    return cupy.asnumpy(array)


def same_bytes(a, b) -> bool:
    return a.shape == b.shape and numpy.array_equal(numpy.ascontiguousarray(a).view(numpy.uint8),
                                                    numpy.ascontiguousarray(b).view(numpy.uint8))


def check(op, policy, dtype, rows, cols, rng, **input_kwargs):
    """One (rows, cols) run into a NaN-poisoned out= against the reference."""
    import cupy

    host, exact = random_input(rng, (rows, cols), dtype, **input_kwargs)
    x = cupy.asarray(host)
    out = poisoned((rows, cols), dtype)
    y = FUNCTIONS[op](x, axis=-1, out=out, policy=policy)
    assert y is out
    try:
        assert_close(to_host(y), REFERENCES[op](exact, axis=-1), dtype)
    except AssertionError as error:
        chosen = sm.plan(op, rows, cols, dtypes.BY_DTYPE[dtype].short, policy,
                         Target.live(x.device.id)).spec.name
        raise AssertionError(f"{op} policy={policy} {dtype} rows={rows} cols={cols} "
                             f"({chosen}):\n{error}") from None
    assert same_bytes(to_host(x), host), "the input was modified"


def live_target():
    import cupy

    return Target.live(cupy.cuda.runtime.getDevice())


def short(dtype) -> str:
    return dtypes.BY_DTYPE[numpy.dtype(dtype)].short


def rows_for(cols: int, even: bool = False) -> int:
    """Moderate row counts, fewer for long rows; odd unless asked for even."""
    rows = 64 if cols <= 4096 else 16 if cols <= 40000 else 6 if cols <= 150000 else 4
    return rows if even else rows + 1


# -- path boundaries ------------------------------------------------------------------

def boundary_groups(policy, dtype, facts) -> dict:
    """Named groups of column counts at every path boundary (and one past it)."""
    tuned = profile_for(facts)
    itemsize = dtype.itemsize
    groups = {"narrow": [1, 2, 3, 5, 7, 31, 32, 33]}
    if policy == "oneflow":
        # warp while cols < 1024 (softmax) / <= 1024 (log-softmax); then a float32
        # cache in at most 48 KB of shared memory (12288 columns, less the block
        # reduction's static shared memory); float64 always uncached
        groups["warp-limit"] = [1023, 1024, 1025]
        groups["smem-limit"] = [12280, 12288, 12289]
    else:
        vec = 16 // itemsize                          # a 16-byte pack
        compute = COMPUTE_ITEMSIZE[itemsize]
        warp = 32 * tuned.AUTO_WARP_MAX_BYTES_PER_LANE // compute
        groups["warp-limit"] = [warp - 1, warp, warp + 1]
        # odd rows (off the 16-byte grid): the warp path below AUTO_PEELED_SMALL_MIN_COLS,
        # then peeled blocks of one warp a row (two rows a block) and of two warps while
        # a thread holds at most AUTO_PEELED_SMALL_MAX_PACKS packs, then the register ladder
        small = tuned.AUTO_PEELED_SMALL_MIN_COLS | 1
        most = tuned.AUTO_PEELED_SMALL_MAX_PACKS * vec
        groups["peeled-short"] = [small - 2, small, small + 2, 32 * most + vec - 1, 32 * most + vec + 1,
                                  64 * most + vec - 1, 64 * most + vec + 1]
        max_packs = max(tuned.AUTO_BLOCK_REGS_MAX_PACKS.get((itemsize, inputs), 4) for inputs in (1, 2))
        regs = sorted({bs * vec * min(max_packs, tuned.AUTO_BLOCK_REGS_MAX_BYTES // (vec * compute * bs))
                       for bs in sm.AUTO_BLOCK_REGS_SIZES} - {0})
        groups["regs-limits"] = [c for limit in regs for c in (limit, limit + 1, limit + vec)]
        # past the register path: 16-byte packs (cp.async), and odd rows that have none
        groups["past-regs"] = [regs[-1] + 2 * vec, 2 * regs[-1] + 1]
        # the largest row the device's opt-in shared memory holds, around it
        limit = facts.smem_per_block_optin // itemsize // vec * vec
        groups["optin-limit"] = [limit - 16 * vec, limit - vec, limit, limit + 1]
    groups["huge"] = [1_000_000]                      # past every plan that caches the row
    return groups


GROUP_NAMES = ["narrow", "warp-limit", "peeled-short", "smem-limit", "regs-limits", "past-regs",
               "optin-limit", "huge"]


@pytest.mark.parametrize("group", GROUP_NAMES)
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_path_boundaries(policy, dtype, op, group, rng):
    groups = boundary_groups(policy, dtype, live_target().facts)
    if group not in groups:
        pytest.skip(f"no {group} boundary for policy={policy}")
    for cols in groups[group]:
        # two rows per access happen on narrow rows with an even row count
        for even in ((False, True) if cols <= 256 else (False,)):
            check(op, policy, dtype, rows_for(cols, even), cols, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_boundaries_reach_every_path(policy, dtype):
    target = live_target()
    seen = set()
    groups = boundary_groups(policy, dtype, target.facts)
    groups.pop("optin-limit", None)     # tested for itself in test_path_boundaries
    for cols_list in groups.values():
        for cols in cols_list:
            seen.add(sm.plan("softmax", rows_for(cols), cols, short(dtype), policy, target).spec.impl)
    if policy == "oneflow":
        expected = {"block_uncached"} if dtype.itemsize == 8 else {"warp", "block_smem",
                                                                   "block_uncached"}
    else:
        expected = {"warp", "block_regs", "block_async", "block_smem", "block_uncached"}
    assert seen == expected


# column counts shared with the boundary tests, so few extra kernels compile
@pytest.mark.parametrize("cols", [1, 2, 33, 1025, 4097, 20000, 32769, 1_000_000])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_single_row(policy, dtype, cols, rng):
    for op in FUNCTIONS:
        check(op, policy, dtype, 1, cols, rng)


def run_plan(chosen, x, out):
    """Launches a row plan's kernel on x (rows x cols, contiguous) into out."""
    rows, cols = x.shape
    function = live_function(chosen.spec, x.device.id, chosen.smem_bytes)
    strides = (numpy.int64(cols),) * 2
    function(chosen.grid, chosen.block, (x, out, numpy.int64(rows), numpy.int64(cols), *strides),
             shared_mem=chosen.smem_bytes)


@pytest.mark.parametrize("stages, cluster_size, tail_packs", [(1, 1, 0), (2, 1, 0), (1, 2, 0), (2, 4, 0),
                                                              (1, 1, 1), (1, 4, 1)])
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_async_grid_walks_its_rows(op, stages, cluster_size, tail_packs, rng):
    """The async row kernel on fewer blocks (clusters) than rows: each walks
    rows grid-stride, two stages prefetching the next row, clusters publishing
    their partials in alternate slots, register tails loaded with the next row."""
    import cupy

    target = live_target()
    if cluster_size > 1 and not device.has_clusters(target.facts.arch):
        pytest.skip("no thread-block clusters before sm_90")
    dtype = numpy.dtype(numpy.float32)
    cols, blocks = 8 * 1000 + 4 * 3, 5              # 16-byte packs; shares end mid-row
    spec = sm.SoftmaxSpec(op, "block_async", "f32", 4, block_size=256, stages=stages, online=True,
                          cluster_size=cluster_size, tail_packs=tail_packs)
    share_bytes = sm.async_share_bytes(spec, cols)
    chosen = sm.SoftmaxPlan(spec, (256, 1, 1), (blocks * cluster_size, 1, 1), stages * share_bytes)
    rows = 2 * blocks + 3
    host, exact = special_rows(rng, cols, dtype)
    host = numpy.concatenate([host, random_input(rng, (rows - len(host), cols), dtype)[0]])
    x = cupy.asarray(host)
    out = poisoned(host.shape, dtype)
    run_plan(chosen, x, out)
    assert_close(to_host(out), REFERENCES[op](host.astype(numpy.float64), axis=-1), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_peeled_warp_rows_walk_the_grid(op, dtype, rng):
    """Peeled rows of one warp, two a block (AUTO_PEELED_SMALL_*), on fewer
    blocks than row pairs: each warp walks its rows grid-stride, every row at
    its own phase (odd cols), the last block's second warp past the rows."""
    import cupy

    cols = {2: 1023, 4: 513, 8: 255}[dtype.itemsize]    # four 16-byte packs a lane at most
    chosen = sm.plan(op, 64, cols, short(dtype), "auto", live_target())
    assert chosen.spec.peel and chosen.block == (32, 2, 1), chosen.spec.name
    rows = 2 * 5 * 3 + 1
    host, exact = random_input(rng, (rows, cols), dtype)
    out = poisoned((rows, cols), dtype)
    run_plan(replace(chosen, grid=(5, 1, 1)), cupy.asarray(host), out)
    assert_close(to_host(out), REFERENCES[op](exact, axis=-1), dtype)


def check_long_rows(op, dtype, cols, rows, rng, expect):
    """Plans `rows` x `cols` (expect(plan) must hold), then checks the values,
    NaN and inf rows among them, into a poisoned output and in place."""
    import cupy

    chosen = sm.plan(op, rows, cols, short(dtype), "auto", live_target())
    assert expect(chosen.spec), chosen
    host = random_input(rng, (rows, cols), dtype)[0]
    host[:9] = special_rows(rng, cols, dtype)[0]
    expected = REFERENCES[op](host.astype(numpy.float64), axis=-1)
    x = cupy.asarray(host)
    y = FUNCTIONS[op](x, axis=-1, out=poisoned(host.shape, dtype))
    assert_close(to_host(y), expected, dtype)
    assert FUNCTIONS[op](x, axis=-1, out=x) is x
    assert_close(to_host(x), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_rows_past_shared_memory(op, dtype, rng):
    """Rows from half to four times what a block's shared memory holds (and a
    pack more, so that the cluster's shares end mid-row), held on chip all the
    same: one block (16-bit rows past half of it with a register tail, two
    blocks an SM), one block with a register tail, then (sm_90+) thread-block
    clusters whose blocks each hold a register tail; rows >= SMs, so that the
    rows are not split instead."""
    target = live_target()
    vec = 16 // dtype.itemsize
    room = target.facts.smem_per_block_optin // dtype.itemsize       # cols a block's shared memory holds
    rows = target.facts.sm_count + 1
    clusters = device.has_clusters(target.facts.arch)
    for times in (0.5, 1, 2, 4):
        def expect(spec):
            if times > 1 and not clusters:
                return spec.cluster_size == 1
            tail = times >= 1 or dtype.itemsize == 2
            return (spec.impl, spec.tail_packs > 0, spec.cluster_size > 1) == ("block_async", tail, times > 1)
        check_long_rows(op, dtype, int(times * room) + vec, rows, rng, expect)


@pytest.mark.parametrize("kind", ["smem", "uncached"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_peeled_rows_past_the_register_path(op, dtype, kind, rng):
    """Odd rows (each at its own phase, input and output at the same one) past
    the register path: 16-byte packs between each row's single-element edges,
    cached in shared memory or read again; NaN and inf rows, one at a row's
    first and last element (its edges), into a poisoned output, in place, and
    on fewer blocks than rows."""
    import cupy

    target = live_target()
    cols = peeled_cols(target, 1, dtype.itemsize, kind)
    rows = target.facts.sm_count + 1                 # not split across blocks
    check_long_rows(op, dtype, cols, rows, rng,
                    lambda spec: (spec.impl, spec.peel, spec.pack_size * dtype.itemsize)
                    == ("block_" + kind, True, 16))
    chosen = sm.plan(op, rows, cols, short(dtype), "auto", target)
    host, exact = random_input(rng, (11, cols), dtype)
    out = poisoned(host.shape, dtype)
    run_plan(replace(chosen, grid=(3, 1, 1)), cupy.asarray(host), out)
    assert_close(to_host(out), REFERENCES[op](exact, axis=-1), dtype)


# -- special values -----------------------------------------------------------------

def special_rows(rng, cols, dtype):
    """Rows with NaN, +inf, -inf, all -inf and mixtures, at random and edge positions
    (nine rows: an odd count, as in the boundary tests)."""
    host, _ = random_input(rng, (9, cols), dtype)
    host = host.astype(numpy.float64)
    pick = lambda: int(rng.integers(cols))  # noqa: E731
    host[1, pick()] = numpy.nan
    host[2, pick()] = numpy.inf
    host[3, pick()] = -numpy.inf
    host[4, :] = -numpy.inf
    host[5, pick()] = numpy.inf
    host[5, pick()] = -numpy.inf
    host[6, pick()] = numpy.inf
    host[6, pick()] = numpy.inf
    host[7, -1] = numpy.nan
    host[7, 0] = numpy.inf
    host = host.astype(dtype)
    return host, host.astype(numpy.float64)


@pytest.mark.parametrize("cols", [1, 33, 1025, 4097, 20000, 32769, 300_000])
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_nan_and_inf_like_scipy(policy, dtype, op, cols, rng):
    import cupy

    host, exact = special_rows(rng, cols, dtype)
    # a finite poison neither function can produce (softmax <= 1, log-softmax <= 0)
    out = poisoned(host.shape, dtype, 7.0)
    y = FUNCTIONS[op](cupy.asarray(host), axis=-1, out=out, policy=policy)
    expected = REFERENCES[op](exact, axis=-1)
    actual = to_host(y).astype(numpy.float64)
    assert not (actual == 7.0).any(), "unwritten elements"
    numpy.testing.assert_array_equal(numpy.isnan(actual), numpy.isnan(expected))
    numpy.testing.assert_array_equal(numpy.isposinf(actual), numpy.isposinf(expected))
    numpy.testing.assert_array_equal(numpy.isneginf(actual), numpy.isneginf(expected))
    assert_close(actual, expected, dtype)


# -- layouts: axes, views, out= ------------------------------------------------------

AXES = [None, 0, 1, 2, -1, -2, (0, 2), (1, 2), (0, 1), (-1, -3), (2, 0, 1)]
AXES_4D = [0, 1, 3, (1, 3), (2, 3), (0, 1, 2, 3), None]


# the layout logic is the policies' common front: OneFlow's dispatch on two dtypes
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
@pytest.mark.parametrize("policy, dtype", [("auto", d) for d in DTYPES] + [
    ("oneflow", DTYPES[2]), ("oneflow", DTYPES[3])],
    ids=[f"auto-{d}" for d in DTYPE_IDS] + ["oneflow-float32", "oneflow-float64"])
def test_every_axis(policy, dtype, op, rng):
    import cupy

    for shape, axes in (((3, 5, 7), AXES), ((2, 3, 4, 5), AXES_4D), ((4, 3, 1030), [-1, 0, (1, 2)])):
        host, exact = random_input(rng, shape, dtype)
        x = cupy.asarray(host)
        for axis in axes:
            out = poisoned(shape, dtype)
            y = FUNCTIONS[op](x, axis=axis, out=out, policy=policy)
            assert y is out and y.shape == shape and y.dtype == dtype
            try:
                assert_close(to_host(y), REFERENCES[op](exact, axis=axis), dtype)
            except AssertionError as error:
                raise AssertionError(f"shape {shape} axis {axis}: {error}") from None
            z = FUNCTIONS[op](x, axis=axis, policy=policy)           # without out=
            assert isinstance(z, cupy.ndarray) and z.shape == shape and z.dtype == dtype
            assert_close(to_host(z), REFERENCES[op](exact, axis=axis), dtype)


VIEWS = {
    "transposed": lambda a: a.T,
    "cols-step-2": lambda a: a[:, ::2],
    "rows-step-2": lambda a: a[::2],
    "rows-reversed": lambda a: a[::-1],
    "cols-reversed": lambda a: a[:, ::-1],
    "cols-offset-1": lambda a: a[:, 1:],             # rows off the 16-byte grid
    "cols-offset-3": lambda a: a[:, 3:-2],
    "rows-offset-1": lambda a: a[1:],
}


@pytest.mark.parametrize("cols", [33, 4097, 20001])
@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("dtype", [DTYPES[0], DTYPES[2], DTYPES[3]],
                         ids=["float16", "float32", "float64"])
@pytest.mark.parametrize("policy", POLICIES)
def test_views(policy, dtype, view, cols, rng):
    import cupy

    host, exact = random_input(rng, (17, cols + 3), dtype)
    base = cupy.asarray(host)
    x = VIEWS[view](base)
    expected_input = VIEWS[view](exact)
    for op in FUNCTIONS:
        for axis in (-1, 0):
            out = poisoned(x.shape, dtype)
            y = FUNCTIONS[op](x, axis=axis, out=out, policy=policy)
            try:
                assert_close(to_host(y), REFERENCES[op](expected_input, axis=axis), dtype)
            except AssertionError as error:
                raise AssertionError(f"{op} axis {axis}: {error}") from None
    assert same_bytes(to_host(base), host), "the input was modified"


@pytest.mark.parametrize("cols", [1023, 1024, 4096, 4097, 20000, 70000])
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=DTYPE_IDS[:3])
@pytest.mark.parametrize("policy", POLICIES)
def test_misaligned_rows(policy, dtype, cols, rng):
    """Rows starting off the 16-byte grid: a flat offset of one element, and
    column offsets with an output at the same offset (the peeled register path),
    at another offset, and in place."""
    import cupy

    rows = 9
    for op in FUNCTIONS:
        # flat offset by one element
        base_host, base_exact = random_input(rng, rows * cols + 1, dtype)
        x = cupy.asarray(base_host)[1:].reshape(rows, cols)
        y = FUNCTIONS[op](x, axis=-1, out=poisoned((rows, cols), dtype), policy=policy)
        assert_close(to_host(y), REFERENCES[op](base_exact[1:].reshape(rows, cols), axis=-1), dtype)
        # column offsets: x[:, 1:] with out[:, 1:] (same phase) and out[:, 2:] (not)
        host, exact = random_input(rng, (rows, cols + 2), dtype)
        x = cupy.asarray(host)[:, 1:-1]
        expected = REFERENCES[op](exact[:, 1:-1], axis=-1)
        for start in (1, 2):
            frame = poisoned((rows, cols + 2), dtype)
            out = frame[:, start:start + cols]
            y = FUNCTIONS[op](x, axis=-1, out=out, policy=policy)
            assert y is out
            assert_close(to_host(y), expected, dtype)
            outside = numpy.concatenate([to_host(frame[:, :start]), to_host(frame[:, start + cols:])], 1)
            assert numpy.isnan(outside.astype(numpy.float64)).all(), "wrote outside out"
        # in place on the offset view
        inplace = cupy.asarray(host)
        view = inplace[:, 1:-1]
        assert FUNCTIONS[op](view, axis=-1, out=view, policy=policy) is view
        assert_close(to_host(view), expected, dtype)
        assert same_bytes(to_host(inplace[:, :1]), host[:, :1])
        assert same_bytes(to_host(inplace[:, -1:]), host[:, -1:])


def test_broadcast_rows(rng):
    import cupy

    host, exact = random_input(rng, (1, 3000), numpy.float32)
    x = cupy.broadcast_to(cupy.asarray(host), (5, 3000))       # row stride 0
    for policy in POLICIES:
        y = FUNCTIONS["softmax"](x, axis=-1, policy=policy)
        assert_close(to_host(y), numpy.broadcast_to(reference_softmax(exact, -1), (5, 3000)),
                     numpy.float32)


@pytest.mark.parametrize("cols", [33, 1025, 4097, 20000])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_out_variants(policy, dtype, cols, rng):
    import cupy

    rows = 6
    host, exact = random_input(rng, (rows, cols), dtype)
    for op in FUNCTIONS:
        expected = REFERENCES[op](exact, axis=-1)
        # a strided out: every other column of a poisoned frame
        frame = poisoned((rows, 2 * cols), dtype)
        y = FUNCTIONS[op](cupy.asarray(host), axis=-1, out=frame[:, ::2], policy=policy)
        assert_close(to_host(y), expected, dtype)
        assert numpy.isnan(to_host(frame[:, 1::2]).astype(numpy.float64)).all()
        # rows of out padded apart: the kernel must stop at each row's end
        frame = poisoned((rows, cols + 5), dtype)
        out = frame[:, :cols]
        assert FUNCTIONS[op](cupy.asarray(host), axis=-1, out=out, policy=policy) is out
        assert_close(to_host(out), expected, dtype)
        assert numpy.isnan(to_host(frame[:, cols:]).astype(numpy.float64)).all()
        # in place
        x = cupy.asarray(host)
        assert FUNCTIONS[op](x, axis=-1, out=x, policy=policy) is x
        assert_close(to_host(x), expected, dtype)
        # in place through another view of x's elements (the second call replays the first)
        for _ in range(2):
            x = cupy.asarray(host)
            view = x.view()
            assert FUNCTIONS[op](x, axis=-1, out=view, policy=policy) is view
            assert_close(to_host(view), expected, dtype)
        # out overlapping the input one row further on: computed as if apart
        both = cupy.asarray(numpy.concatenate([host, host[:1]]))
        y = FUNCTIONS[op](both[:-1], axis=-1, out=both[1:], policy=policy)
        assert_close(to_host(y), expected, dtype)


def test_stream(rng):
    import cupy

    host, exact = random_input(rng, (64, 3000), numpy.float32)
    x = cupy.asarray(host)
    stream = cupy.cuda.Stream(non_blocking=True)
    y = FUNCTIONS["log_softmax"](x, axis=-1, stream=stream)
    stream.synchronize()
    assert_close(to_host(y), reference_log_softmax(exact, -1), numpy.float32)


def test_integer_input_is_float64(rng):
    import cupy

    host = rng.integers(-20, 20, size=(7, 300)).astype(numpy.int32)
    for policy in POLICIES:
        for op in FUNCTIONS:
            y = FUNCTIONS[op](cupy.asarray(host), axis=1, policy=policy)
            assert y.dtype == numpy.float64
            assert_close(to_host(y), REFERENCES[op](host, axis=1), numpy.float64)
    y = FUNCTIONS["softmax"](cupy.asarray(host.astype(numpy.uint8)))
    assert y.dtype == numpy.float64
    assert_close(to_host(y), reference_softmax(host.astype(numpy.uint8)), numpy.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zero_dimensional(dtype):
    import cupy

    x = cupy.asarray(numpy.array(2.5, dtype=dtype))
    for op, value in (("softmax", 1.0), ("log_softmax", 0.0)):
        y = FUNCTIONS[op](x)
        assert y.shape == () and y.dtype == dtype
        assert float(to_host(y).astype(numpy.float64)) == value


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3)])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_empty(shape, axis):
    import cupy

    for dtype in (numpy.float32, numpy.float16, numpy.int64):
        x = cupy.zeros(shape, dtype=dtype)
        for op in FUNCTIONS:
            y = FUNCTIONS[op](x, axis=axis)
            assert isinstance(y, cupy.ndarray) and y.shape == shape
            assert y.dtype == (numpy.float64 if dtype == numpy.int64 else dtype)
    out = cupy.empty(shape, numpy.float32)
    assert FUNCTIONS["softmax"](cupy.zeros(shape, numpy.float32), axis=axis, out=out) is out


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_torch_tensors_without_copy(dtype_name, rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    host, exact = random_input(rng, (33, 1000), getattr(numpy, dtype_name))
    t = torch.from_numpy(host).cuda()
    assert arrays.as_cupy(t).data.ptr == t.data_ptr()          # zero-copy view
    for op, torch_op in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
        y = FUNCTIONS[op](t, axis=-1)
        assert_close(to_host(y), REFERENCES[op](exact, axis=-1), host.dtype)
        assert_close(to_host(y), torch_op(t.double(), dim=-1).cpu().numpy(), host.dtype)


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("cols", [2, 100, 1024, 3000, 40000])
@pytest.mark.parametrize("policy", POLICIES)
def test_log_softmax_keeps_precision_with_large_logits(policy, dtype, cols, rng):
    """SciPy subtracts the max before the log of the sum: (x - m) - log(s). Logits
    far from zero must not lose the small log(s) to the rounding of m + log(s)."""
    offset = 1000.0 if dtype == numpy.float32 else 1e5
    check("log_softmax", policy, numpy.dtype(dtype), 16, cols, rng, offset=offset)
    check("softmax", policy, numpy.dtype(dtype), 16, cols, rng, offset=offset)


# -- bad input -----------------------------------------------------------------------

def test_bad_input():
    import cupy

    x = cupy.ones((4, 5), cupy.float32)
    for function in FUNCTIONS.values():
        with pytest.raises(TypeError, match="cupy"):
            function(numpy.ones((4, 5), numpy.float32))
        with pytest.raises(TypeError):
            function([[1.0, 2.0]])
        with pytest.raises(TypeError, match="complex"):
            function(cupy.ones((4, 5), cupy.complex64))
        with pytest.raises(TypeError, match="boolean"):
            function(cupy.ones((4, 5), bool))
        with pytest.raises(AxisError):
            function(x, axis=2)
        with pytest.raises(AxisError):
            function(x, axis=(0, -3))
        with pytest.raises(ValueError, match="duplicate"):
            function(x, axis=(1, -1))
        with pytest.raises(TypeError):
            function(x, axis=1.0)
        with pytest.raises(ValueError, match="shape"):
            function(x, axis=-1, out=cupy.empty((5, 4), cupy.float32))
        with pytest.raises(ValueError, match="dtype"):
            function(x, axis=-1, out=cupy.empty((4, 5), cupy.float64))
        with pytest.raises(TypeError):
            function(x, axis=-1, out=numpy.empty((4, 5), numpy.float32))
        with pytest.raises(ValueError, match="policy"):
            function(x, axis=-1, policy="fastest")


# -- occupancy: the calculator against the driver -------------------------------------

SWEEP_COLS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 1000, 1536, 3000,
              12345, 65536, 131072, 262144)


def _live_sweep_specs(target) -> list:
    specs = set()
    for op in FUNCTIONS:
        for dtype in DTYPES:
            for policy in POLICIES:
                for cols in SWEEP_COLS:
                    spec = sm.plan(op, 49152, cols, short(dtype), policy, target).spec
                    specs.add(spec)
                    if spec.impl == "block_smem" and not spec.storage_cache:
                        specs.update(sm.SoftmaxSpec(op, "block_smem", spec.dtype, spec.pack_size,
                                                    block_size=b) for b in (128, 256, 512, 1024))
    return sorted(specs, key=lambda s: s.name)


def _driver_occupancy(raw, block_size, dynamic_smem):
    import cupy

    try:
        return cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            raw.kernel.ptr, block_size, dynamic_smem)
    except cupy.cuda.driver.CUDADriverError:
        return 0


def test_occupancy_calculator_agrees_with_the_driver():
    import cupy

    target = live_target()
    facts = target.facts
    wrong = []
    for spec in _live_sweep_specs(target):
        raw = jit.kernel(spec, target.device_id)
        bound = spec.threads_per_block
        for block_size in sorted({32, 64, 96, 128, 256, 512, 1024, bound}):
            if block_size > bound:
                continue
            for dynamic_smem in (0, 4096):
                calculated = device.max_active_blocks(facts, block_size, raw.num_regs,
                                                      raw.shared_size_bytes + dynamic_smem, bound)
                driver = _driver_occupancy(raw, block_size, dynamic_smem)
                if calculated != driver:
                    wrong.append(f"{spec.name} block {block_size} dyn {dynamic_smem}: "
                                 f"calculator {calculated}, driver {driver}")
    assert not wrong, "\n".join(wrong[:20])
    assert cupy.cuda.runtime.getDevice() == target.device_id


def _private_kernel(spec):
    """A RawKernel of its own (a distinct CuPy module), so raising its shared-memory
    limit leaves the memoised kernel the library launches untouched."""
    import cupy

    return cupy.RawKernel(jit.render(spec), spec.name,
                          options=jit.compile_options() + ("-DCUPYOPS_OCCUPANCY_TEST=1",),
                          backend="nvrtc")


def test_occupancy_with_large_and_opt_in_shared_memory():
    target = live_target()
    facts = target.facts
    optin = facts.smem_per_block_optin
    representatives = {}
    for spec in _live_sweep_specs(target):
        representatives.setdefault((spec.impl, spec.threads_per_block, spec.dtype == "f64"), spec)
    wrong = []
    for spec in representatives.values():
        raw = _private_kernel(spec)
        block, static, regs = spec.threads_per_block, raw.shared_size_bytes, raw.num_regs

        def calculated(dynamic_smem):
            return device.max_active_blocks(facts, block, regs, static + dynamic_smem, block)

        def compare(dynamic_smem, expected):
            driver = _driver_occupancy(raw, block, dynamic_smem)
            if driver != expected:
                wrong.append(f"{spec.name} dyn {dynamic_smem} (static {static}): "
                             f"expected {expected}, driver {driver}")

        # without opting in, a block may use 48 KB of static + dynamic shared memory
        compare(device.STATIC_SMEM_LIMIT - static, calculated(device.STATIC_SMEM_LIMIT - static))
        compare(device.STATIC_SMEM_LIMIT,
                calculated(device.STATIC_SMEM_LIMIT) if static == 0 else 0)
        # opted in up to the device's limit
        raw.max_dynamic_shared_size_bytes = optin - static
        for dynamic_smem in (device.STATIC_SMEM_LIMIT, 100 * 1024, optin - static):
            compare(dynamic_smem, calculated(dynamic_smem))
        compare(optin - static + 128, 0)
        assert calculated(optin - static + 128) == 0
    assert not wrong, "\n".join(wrong)


def test_live_occupancy_at_the_opt_in_limit():
    """Planning near the opt-in limit must answer 0 (cannot launch), not raise:
    a kernel's static shared memory counts against the limit too."""
    target = live_target()
    optin = target.facts.smem_per_block_optin
    for spec in (sm.SoftmaxSpec("softmax", "block_async", "f16", 8, block_size=512, stages=1),
                 sm.SoftmaxSpec("softmax", "block_smem", "f16", 8, block_size=256,
                                storage_cache=True)):
        static = jit.kernel(spec, target.device_id).shared_size_bytes
        assert static > 0
        assert target.max_active_blocks(spec, spec.block_size, optin - static, True) > 0
        assert target.max_active_blocks(spec, spec.block_size, optin - static + 16, True) == 0
        assert target.max_active_blocks(spec, spec.block_size, optin, True) == 0


def test_profile_and_live_planning_agree_at_48k():
    """OneFlow's shared-memory path without opt-in: the profile calculator must
    refuse 48 KB of dynamic shared memory plus static, as the driver does."""
    live = live_target()
    calculator = Target(live.facts)            # the no-GPU path, same device facts
    spec = sm.SoftmaxSpec("softmax", "block_smem", "f32", 2, block_size=128)
    static = jit.kernel(spec, live.device_id).shared_size_bytes
    for dynamic_smem in (device.STATIC_SMEM_LIMIT - static, device.STATIC_SMEM_LIMIT):
        assert (calculator.max_active_blocks(spec, 128, dynamic_smem, False) > 0) == \
            (live.max_active_blocks(spec, 128, dynamic_smem, False) > 0), dynamic_smem
