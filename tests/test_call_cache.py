"""The public functions' call memo (cupyops/callcache.py).

CPU, on a GPU stand-in (fake_device.py: fake device memory, kernels recorded,
plans for the H100 profile): a repeated call takes the fast path (no second
rowwise.run) and launches exactly what the first call launched: the same
kernels, grids, blocks, shared memory and scalar arguments, on the caller's
arrays and on fresh outputs of the same shapes, which it returns. A call of
another layout (alignment, strides, dtype), flag or eps misses; keys and
overlap checks. GPU (marked gpu): repeated calls give the first call's
values, calls the memo must not take (integer input, overlapping out) stay
right.
"""
from __future__ import annotations

import collections

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cupyops  # noqa: E402
from cupyops import callcache  # noqa: E402
from fake_device import FakeDevice  # noqa: E402


@pytest.fixture
def device(monkeypatch):
    return FakeDevice(monkeypatch)


def _described(launches, names: dict) -> list:
    """Each launch as (kernel, grid, block, smem, args), arrays named by role
    (`names`: address -> name), fresh ones by shape and dtype."""
    def arg(value):
        if isinstance(value, cupy.ndarray):
            return names.get(value.data.ptr, ("fresh", value.shape, value.dtype.str))
        if isinstance(value, numpy.uint64) and value:
            return "pointer into a workspace"
        return type(value).__name__, value.item()
    return [(k.name, k.grid, k.block, k.smem, tuple(arg(a) for a in k.args)) for k in launches]


def _results(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _call_twice(device, call, **arrays) -> list:
    """call() twice: the first by the slow path, the second by the memo,
    launching the same, every launch of its packed (packed.PackedLaunch);
    returns the launches described."""
    seen = []
    slow_calls = device.slow_calls + 1
    for _ in range(2):
        device.launches.clear()
        results = _results(call())
        assert device.slow_calls == slow_calls, "the repeated call took the slow path"
        names = {a.data.ptr: name for name, a in arrays.items() if a is not None}
        for i, a in enumerate(results):
            if a is not None:
                names.setdefault(a.data.ptr, f"result {i}")
        seen.append((_described(device.launches, names),
                     [None if a is None else (a.shape, a.dtype) for a in results]))
    assert seen[1] == seen[0]
    assert seen[0][0], "nothing launched"
    assert all(launch.packed for launch in device.launches), "a repeated call converted its arguments"
    return seen[0][0]


FORWARD_SHAPES = [((64, 128), "float32", 0), ((3, 5, 257), "float16", 2), ((16, 1000), "float64", 8)]


@pytest.mark.parametrize("shape, dtype, offset", FORWARD_SHAPES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("out", ["fresh", "disjoint", "in place"])
def test_softmax_forward_repeats(device, op, shape, dtype, offset, out):
    x = device.array(shape, dtype, offset)
    y = {"fresh": None, "disjoint": device.array(shape, dtype, offset), "in place": x}[out]
    launches = _call_twice(device, lambda: getattr(cupyops, op)(x, axis=-1, out=y), x=x)
    assert len(launches) == 1


@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward"])
@pytest.mark.parametrize("in_place", [False, True])
def test_softmax_backward_repeats(device, op, in_place):
    dy, y = device.array((64, 128), "float32"), device.array((64, 128), "float32")
    out = dy if in_place else None
    launches = _call_twice(device, lambda: getattr(cupyops, op)(dy, y, out=out), dy=dy, y=y)
    assert len(launches) == 1 and launches[0][4][:2] == ("dy", "y")


@pytest.mark.parametrize("shape, dtype, offset", FORWARD_SHAPES)
@pytest.mark.parametrize("affine", ["weight and bias", "weight", "none"])
def test_layer_norm_repeats(device, shape, dtype, offset, affine):
    x = device.array(shape, dtype, offset)
    weight = device.array(shape[-1:], dtype) if affine != "none" else None
    bias = device.array(shape[-1:], dtype) if affine == "weight and bias" else None
    launches = _call_twice(device, lambda: cupyops.layer_norm(x, weight, bias, eps=1e-3), x=x, weight=weight,
                           bias=bias)
    (_, _, _, _, args), = launches
    null = ("uint64", 0)
    assert args[:4] == ("x", null, "weight" if weight is not None else null, "bias" if bias is not None else null)
    assert args[-1] == (("float64", 1e-3) if dtype == "float64" else ("float32", numpy.float32(1e-3).item()))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("return_stats", [False, True])
@pytest.mark.parametrize("out", [False, True])
def test_norm_residual_stats_and_out_repeat(device, op, return_stats, out):
    shape, dtype = (2, 3, 96), "float16"
    x, residual = device.array(shape, dtype), device.array(shape, dtype, 16)
    weight = device.array(shape[-1:], dtype)
    y = device.array(shape, dtype) if out else None
    function = getattr(cupyops, op)
    launches = _call_twice(device, lambda: function(x, weight, residual=residual, return_stats=return_stats, out=y),
                           x=x, residual=residual, weight=weight, y=y)
    results = _results(function(x, weight, residual=residual, return_stats=return_stats, out=y))
    assert len(results) == 2 + (return_stats and (2 if op == "layer_norm" else 1))
    assert (results[0] is y) == out
    if return_stats:
        assert all(stat.shape == (2, 3) and stat.dtype == numpy.float32 for stat in results[2:])
    assert len(launches) == 1


@pytest.mark.parametrize("need_weight_grad, need_bias_grad", [(True, True), (True, False), (False, True),
                                                              (False, False)])
@pytest.mark.parametrize("policy", ["auto", "oneflow"])
def test_layer_norm_backward_repeats(device, need_weight_grad, need_bias_grad, policy):
    rows, cols = 64, 128
    dy, x = device.array((rows, cols), "float32"), device.array((rows, cols), "float32")
    mean, rstd, weight = device.array((rows,), "float32"), device.array((rows,), "float32"), device.array((cols,),
                                                                                                        "float32")
    launches = _call_twice(device, lambda: cupyops.layer_norm_backward(
        dy, x, mean, rstd, weight, need_weight_grad=need_weight_grad, need_bias_grad=need_bias_grad,
        policy=policy), dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    param_grad = need_weight_grad or need_bias_grad
    # dx (fused partials in auto), the column reduction (oneflow), the finish kernel
    assert len(launches) == 1 + (param_grad and policy == "oneflow") + param_grad


def test_norm_backward_repeats_with_weight_phase_copies(device):
    """Peeled float32 LayerNorm rows of 1023 cols read the weight from its
    phase copies: three launches."""
    rows, cols = 64, 1023
    dy, x = device.array((rows, cols), "float32"), device.array((rows, cols), "float32")
    mean, rstd = device.array((rows,), "float32"), device.array((rows,), "float32")
    weight = device.array((cols,), "float32")
    launches = _call_twice(device, lambda: cupyops.layer_norm_backward(dy, x, mean, rstd, weight),
                           dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    assert len(launches) == 3 and launches[0][0].startswith("norm_weight_phases")
    _call_twice(device, lambda: cupyops.rms_norm_backward(dy, x, rstd, weight), dy=dy, x=x, rstd=rstd, weight=weight)


def _replayed(device, replay, names: dict, outputs: list = None) -> list:
    """The launches of replay(), described with the outputs it writes (`outputs`, or what it
    returns) named as results."""
    device.launches.clear()
    returned = replay()
    outputs = [a for a in _results(returned) if a is not None] if outputs is None else outputs
    names = {**names, **{a.data.ptr: f"result {i}" for i, a in enumerate(outputs)}}
    return _described(device.launches, names)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("residual", [False, True])
def test_remembered_norm_calls_replay_on_addresses(device, op, residual):
    """norm.remembered_forward / remembered_backward: nothing before a call, then its ready
    launch and outputs, which replayed on addresses (norm_launch.run_forward_at /
    run_backward_at) launch what the memoised call launches. Peeled rows of 1023 float32
    cols: layer_norm's backward also writes the weight's phase copies."""
    from cupyops.ops import norm, norm_launch

    rows, cols, centered = 64, 1023, op == "layer_norm"
    x, dy = device.array((rows, cols), "float32"), device.array((rows, cols), "float32")
    res = device.array((rows, cols), "float32") if residual else None
    w, b = device.array((cols,), "float32"), device.array((cols,), "float32") if centered else None
    inputs = {"x": x, "dy": dy, "residual": res, "weight": w, "bias": b}
    names = {a.data.ptr: name for name, a in inputs.items() if a is not None}
    forward = getattr(cupyops, op)
    affine = (w, b) if centered else (w,)

    def call():
        return forward(x, *affine, eps=1e-5, residual=res, return_stats=True)

    assert norm.remembered_forward(op, x, w, b, -1, 1e-5, res, True) is None
    call()
    launch, outputs = norm.remembered_forward(op, x, w, b, -1, 1e-5, res, True)
    results = _results(call())
    expected = _replayed(device, call, names)
    made = {k: device.empty(shape, dtype) if wanted else None for k, shape, dtype, wanted in (
        ("y", outputs.shape, outputs.dtype, True), ("h", outputs.shape, outputs.dtype, outputs.residual),
        ("mean", outputs.stats_shape, outputs.stats_dtype, outputs.mean),
        ("rstd", outputs.stats_shape, outputs.stats_dtype, outputs.rstd))}
    order = (x, res, w, b, made["y"], made["h"], made["mean"], made["rstd"])
    written = [a for a in made.values() if a is not None]
    assert len(written) == len(results)
    assert _replayed(device, lambda: norm_launch.run_forward_at(
        launch, tuple(0 if a is None else a.data.ptr for a in order)), names, written) == expected

    mean, rstd = (results[-2] if centered else None), results[-1]
    backward_op = f"{op}_backward"
    stats = (mean, rstd) if centered else (rstd,)

    def backward():
        return getattr(cupyops, backward_op)(dy, x, *stats, w)

    assert norm.remembered_backward(backward_op, dy, x, mean, rstd, w, -1, True, centered) is None
    names.update({a.data.ptr: name for name, a in (("mean", mean), ("rstd", rstd)) if a is not None})
    grads = _results(backward())
    launch, outputs = norm.remembered_backward(backward_op, dy, x, mean, rstd, w, -1, True, centered)
    expected = _replayed(device, backward, names)
    assert len(expected) >= 2 and (expected[0][0].startswith("norm_weight_phases") or not centered)
    dx, dweight = device.empty(outputs.shape, outputs.dtype), device.empty(outputs.grads_shape, outputs.dtype)
    dbias = device.empty(outputs.grads_shape, outputs.dtype) if outputs.bias_grad else None
    written = [a for a in (dx, dweight, dbias) if a is not None]
    assert len(written) == len(grads) and outputs.weight_grad and outputs.bias_grad == centered
    assert _replayed(device, lambda: norm_launch.run_backward_at(
        launch, rstd.itemsize, w.itemsize, dy.data.ptr, x.data.ptr, dx.data.ptr, rstd.data.ptr,
        0 if mean is None else mean.data.ptr, w.data.ptr, dweight.data.ptr, 0 if dbias is None else dbias.data.ptr),
        names, written) == expected


@pytest.mark.parametrize("op", ["softmax", "log_softmax_backward"])
def test_remembered_softmax_calls_replay_on_addresses(device, op):
    """softmax.remembered_call: nothing before a call, then its ready call, which replayed on
    addresses (run_at) launches what the memoised call launches."""
    from cupyops.ops import softmax as softmax_ops

    x, dy = device.array((64, 1000), "float32"), device.array((64, 1000), "float32")
    inputs = (x,) if op == "softmax" else (dy, x)
    names = {x.data.ptr: "x", dy.data.ptr: "dy"}

    def call():
        return getattr(cupyops, op)(*inputs, axis=-1)

    assert softmax_ops.remembered_call(op, inputs, -1) is None
    call()
    ready = softmax_ops.remembered_call(op, inputs, -1)
    expected = _replayed(device, call, names)
    made = device.empty(ready.shape, ready.dtype)
    assert _replayed(device, lambda: ready.run_at(tuple(a.data.ptr for a in inputs), made.data.ptr), names,
                     [made]) == expected
    assert softmax_ops.remembered_call(op, inputs, 0) is None


ROW_CALLS = {   # label -> call(x, dy, weight, stats, out)
    "softmax": lambda x, dy, w, stats, out: cupyops.softmax(x, axis=-1),
    "log_softmax out=": lambda x, dy, w, stats, out: cupyops.log_softmax(x, axis=-1, out=out),
    "softmax_backward": lambda x, dy, w, stats, out: cupyops.softmax_backward(dy, x),
    "log_softmax_backward out=": lambda x, dy, w, stats, out: cupyops.log_softmax_backward(dy, x, out=out),
    "layer_norm": lambda x, dy, w, stats, out: cupyops.layer_norm(x, w, w),
    "rms_norm out=": lambda x, dy, w, stats, out: cupyops.rms_norm(x, w, out=out),
    "rms_norm stats": lambda x, dy, w, stats, out: cupyops.rms_norm(x, w, return_stats=True),
    "layer_norm_backward": lambda x, dy, w, stats, out: cupyops.layer_norm_backward(dy, x, stats, stats, w),
    "rms_norm_backward": lambda x, dy, w, stats, out: cupyops.rms_norm_backward(dy, x, stats, w),
}


@pytest.mark.parametrize("label", sorted(ROW_CALLS))
def test_repeated_calls_neither_check_nor_plan(device, monkeypatch, label):
    """The memo's hit path runs no argument check or conversion, no planner and no
    rowwise.run: the key implies what they found for the first call."""
    from cupyops import arrays, rowwise
    from cupyops.ops import norm, norm_args, softmax

    counts = collections.Counter()
    for owner, name in ((softmax, "plan"), (norm, "plan"), (arrays, "as_cupy"), (arrays, "check_out"),
                        (arrays, "normalize_axes"), (norm_args, "check_like"), (norm_args, "check_stat"),
                        (rowwise, "run")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _name=name, _original=original, **k:
                            counts.update([_name]) or _original(*a, **k))
    x, dy, out = (device.array((64, 128), "float32") for _ in range(3))
    weight, stats = device.array((128,), "float32"), device.array((64,), "float32")
    ROW_CALLS[label](x, dy, weight, stats, out)
    assert counts["run"] == 1
    counts.clear()
    ROW_CALLS[label](x, dy, weight, stats, out)
    assert not counts, f"the repeated call ran {dict(counts)}"


def test_another_layout_flag_or_eps_misses(device):
    x = device.array((64, 128), "float32")
    cupyops.layer_norm(x)
    cupyops.layer_norm(device.array((64, 128), "float32"))              # same layout, other memory
    assert device.slow_calls == 1
    for call in (lambda: cupyops.layer_norm(device.array((64, 128), "float32", 4)),   # alignment 4
                 lambda: cupyops.layer_norm(device.array((64, 128), "float16")),
                 lambda: cupyops.layer_norm(device.array((64, 128), "float32", strides=(1024, 4))),
                 lambda: cupyops.layer_norm(x, eps=1e-3),
                 lambda: cupyops.layer_norm(x, return_stats=True),
                 lambda: cupyops.layer_norm(x, policy="oneflow"),
                 lambda: cupyops.rms_norm(x)):
        slow_calls = device.slow_calls
        call()
        assert device.slow_calls == slow_calls + 1


def test_call_key():
    class NotAnArray:
        pass

    assert callcache.call_key(("op",), (NotAnArray(),)) is None
    assert callcache.call_key(("op",), (numpy.zeros(3),)) is None


def test_call_key_layouts(device):
    x = device.array((4, 6), "float16", 6)
    assert callcache.call_key(("op", -1), (x, None)) == (("op", -1), (4, 6), True, x.dtype, 6, 0, None)
    strided = device.array((4, 6), "float16", 6, strides=(24, 2))
    assert callcache.call_key(("op", -1), (strided,)) == (("op", -1), (4, 6), (24, 2), x.dtype, 6, 0)
    assert callcache.call_key(("op", -1), (None, x)) is None        # the first array decides the GPU
    # the keys read CuPy's flag behind flags.c_contiguous
    assert (x._c_contiguous, strided._c_contiguous) == (x.flags.c_contiguous, strided.flags.c_contiguous)


def test_writable(device):
    x = device.array((8, 8), "float32")
    shifted = cupy.ndarray((8, 8), numpy.float32, x.data + 4)
    assert callcache.writable(None, (x,)) and callcache.writable(x, (x, None))
    assert callcache.writable(device.array((8, 8), "float32"), (x,))
    assert not callcache.writable(shifted, (x,))
    assert not callcache.writable(x, (x,), in_place=False)       # fused_softmax: no output in place
    # another view of x's very elements is in place too; one of another shape, dtype or order is not
    assert callcache.writable(x.view(), (x,)) and not callcache.writable(x.view(), (x,), in_place=False)
    assert not callcache.writable(x.reshape(4, 16), (x,))
    assert not callcache.writable(x.view(numpy.int32), (x,))
    assert not callcache.writable(x.T, (x,))
    assert callcache.same_elements(x.view(), x) and not callcache.same_elements(x[:4], x)


def test_delivered(device):
    x, y = device.array((4, 4), "float32"), device.array((4, 4), "float32")
    assert callcache.delivered(x, None) is x and callcache.delivered(x, x) is x
    copied = []

    class Out:
        def __setitem__(self, index, value):
            copied.append((index, value))

    out = Out()
    assert callcache.delivered(y, out) is out and copied == [(Ellipsis, y)]


def test_unhashable_flags_take_the_slow_path():
    cache = callcache.CallCache()
    key = (("op", [1]), ())
    assert cache.find(key) is None and cache.find(None) is None
    cache.remember(key, "call")
    assert cache.find((("op", 1), ())) is None


def test_stream_is_current_while_a_memoised_call_runs(device):
    class Stream:
        entered = 0

        def __enter__(self):
            Stream.entered += 1

        def __exit__(self, *exc):
            pass

    x = device.array((64, 128), "float32")
    cupyops.softmax(x, axis=-1)
    cupyops.softmax(x, axis=-1, stream=Stream())
    assert device.slow_calls == 1 and Stream.entered == 1 and len(device.launches) == 2


class _Array:
    """What the recycler reads of an array: shape, nbytes, C-contiguity (weak references allowed)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self._c_contiguous = shape, dtype, True
        self.nbytes = int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize


def test_recycling_hands_out_only_arrays_nothing_else_holds():
    """Two arrays kept per shape, dtype, GPU and stream; one is handed out again only once
    its caller, views, weak references and other threads are gone and its shape unchanged;
    large arrays are never kept."""
    import weakref

    made, place = [0], {"device": 0, "stream": 7}

    def make(shape, dtype):
        made[0] += 1
        return _Array(shape, dtype)

    cupyops.release_kept_outputs()
    empty_on = callcache.recycling(make)

    def empty(shape, dtype):
        return empty_on(shape, dtype, place["device"], place["stream"])

    shape = (64, 128)
    first = empty(shape, "float32")
    held = id(first)
    del first
    again = empty(shape, "float32")
    assert id(again) == held and made[0] == 1                    # dropped: recycled
    second = empty(shape, "float32")                              # `again` held: a new one
    assert second is not again and made[0] == 2
    del again
    kept = empty(shape, "float32")
    assert id(kept) == held and made[0] == 2                     # the older slot, dropped
    view = [second]                                               # anything referring to it
    del second
    third = empty(shape, "float32")
    assert third is not view[0] and third is not kept and made[0] == 3
    del view, kept, third
    alive = empty(shape, "float32")
    reference = weakref.ref(alive)
    del alive
    handed = empty(shape, "float32")   # not inside an assert: pytest's rewrite would hold reference()'s value
    assert reference() is not None and handed is not reference() and made[0] == 3
    count = made[0]
    for other in ({"device": 1}, {"stream": 8}):
        place.update(other)
        assert empty(shape, "float32") is not None and made[0] == count + 1   # another GPU or stream
        count = made[0]
        place.update(device=0, stream=7)
    assert empty(shape, "float16") is not None and made[0] == count + 1
    reshaped = empty((8, 8), "float32")
    reshaped.shape = (64,)
    del reshaped
    assert empty((8, 8), "float32").shape == (8, 8)
    large = (1, callcache.RECYCLE_BYTES // 4 + 1)
    count = made[0]
    empty(large, "float32")
    empty(large, "float32")
    assert made[0] == count + 2                                   # never kept
    cupyops.release_kept_outputs()
    assert not callcache._recycled


# -- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_repeated_calls_give_the_first_calls_values(dtype):
    rng = numpy.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((33, 257)).astype(dtype))
    dy = cupy.asarray(rng.standard_normal((33, 257)).astype(dtype))
    weight, bias = cupy.asarray(rng.standard_normal(257).astype(dtype)), cupy.asarray(rng.standard_normal(257).astype(dtype))
    calls = [lambda: cupyops.softmax(x, axis=-1), lambda: cupyops.log_softmax(x, axis=-1),
             lambda: cupyops.softmax_backward(dy, cupyops.softmax(x, axis=-1)),
             lambda: cupyops.layer_norm(x, weight, bias, return_stats=True),
             lambda: cupyops.rms_norm(x, weight, residual=dy),
             lambda: cupyops.layer_norm_backward(dy, x, *cupyops.layer_norm(x, weight, bias, return_stats=True)[1:],
                                                 weight),
             lambda: cupyops.rms_norm_backward(dy, x, cupyops.rms_norm(x, weight, return_stats=True)[1], weight)]
    for call in calls:
        first = [a.get() for a in _results(call()) if a is not None]
        for _ in range(3):
            again = [a.get() for a in _results(call()) if a is not None]
            for a, b in zip(first, again):
                numpy.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_calls_the_memo_must_not_take():
    """Integer input (a converted copy is read), an out overlapping the
    input, a 0-d array, statistics read as a converted copy: each repeated,
    each right."""
    import scipy.special

    x = cupy.arange(40, dtype=numpy.int32).reshape(4, 10)
    for _ in range(3):
        numpy.testing.assert_allclose(cupyops.softmax(x, axis=-1).get(),
                                      scipy.special.softmax(x.get().astype(numpy.float64), axis=-1), rtol=1e-12)
    base = cupy.asarray(numpy.random.default_rng(1).standard_normal(48), dtype=numpy.float32)
    expected = scipy.special.softmax(base[:40].get().reshape(4, 10).astype(numpy.float64), axis=-1)
    for _ in range(3):
        data = base.copy()
        cupyops.softmax(data[:40].reshape(4, 10), axis=-1, out=data[8:].reshape(4, 10))
        numpy.testing.assert_allclose(data[8:].get().reshape(4, 10), expected, rtol=1e-5)
    for _ in range(3):
        assert float(cupyops.softmax(cupy.asarray(3.0, dtype=numpy.float32))) == 1.0
    # statistics the kernels read as a converted copy (float64, strided)
    x = cupy.asarray(numpy.random.default_rng(2).standard_normal((8, 64)), dtype=numpy.float32)
    dy = cupy.ones_like(x)
    _, mean, rstd = cupyops.layer_norm(x, return_stats=True)
    expected = [a.get() for a in cupyops.layer_norm_backward(dy, x, mean, rstd) if a is not None]
    strided = cupy.empty(16, numpy.float32)
    strided[::2] = rstd
    for stats in [(mean.astype(numpy.float64), rstd.astype(numpy.float64)), (mean, strided[::2])] * 2:
        got = [a.get() for a in cupyops.layer_norm_backward(dy, x, *stats) if a is not None]
        for a, b in zip(got, expected):
            numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_dropped_small_outputs_are_recycled_held_ones_never():
    """A softmax output its caller dropped is handed out by the next call of its shape on
    that stream; one still held (by a name, by a view), or a call on another stream, gets
    new memory; values stay right throughout."""
    import scipy.special

    rng = numpy.random.default_rng(5)
    xs = [cupy.asarray(rng.standard_normal((64, 128)), dtype=numpy.float32) for _ in range(4)]
    expected = [scipy.special.softmax(x.get().astype(numpy.float64), axis=-1) for x in xs]
    cupyops.release_kept_outputs()
    y = cupyops.softmax(xs[0], axis=-1)
    first = y.data.ptr
    z = cupyops.softmax(xs[1], axis=-1)
    assert z.data.ptr != first
    numpy.testing.assert_allclose(y.get(), expected[0], rtol=1e-5)
    del y
    w = cupyops.softmax(xs[2], axis=-1)
    assert w.data.ptr == first
    view = w[1:]
    del w
    v = cupyops.softmax(xs[3], axis=-1)
    assert v.data.ptr not in (first, z.data.ptr)
    with cupy.cuda.Stream(non_blocking=True) as stream:
        del v
        u = cupyops.softmax(xs[0], axis=-1)
        stream.synchronize()
    for got, want in ((z, expected[1]), (view, expected[2][1:]), (u, expected[0])):
        numpy.testing.assert_allclose(got.get(), want, rtol=1e-5)
    assert u.data.ptr not in (first, z.data.ptr)
    cupyops.release_kept_outputs()
