"""GPU tests of fused elementwise kernels against float64 NumPy: every function of the
namespace on random and edge values, broadcasting, misaligned and strided views, odd sizes,
several outputs, promotion, out= and in place, empty arrays, both policies, the named ops,
dropout's mask, and refusals. Outputs are poisoned before each run."""
from __future__ import annotations

import numpy
import pytest
from conftest import assert_close
from fx_reference import evaluate, rounded

import cupyops
from cupyops import fx
from cupyops.dtypes import BFLOAT16
from cupyops.ops import elementwise as ew

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

FLOATS = [numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)]
POLICIES = ["auto", "oneflow"]
# NVRTC's float functions (expf, erff, tanhf, powf) are within a few ulp: float32 outputs get
# a looser relative tolerance than one rounding.
SCALE = {numpy.dtype(numpy.float32): 8.0}


def random(rng, shape, dtype, scale=2.0):
    values = numpy.asarray(rng.standard_normal(shape) * scale)
    return values.astype(dtype) if numpy.dtype(dtype).kind == "f" or dtype == BFLOAT16 else \
        (values * 10).astype(dtype)


def poisoned_out(shape, dtype):
    out = cupy.empty(shape, dtype)
    if numpy.dtype(dtype).kind == "f" or dtype == BFLOAT16:
        out.fill(numpy.nan)
    else:
        out.fill(7)
    return out


def check(expr, host: dict, policy="auto", scale=1.0, keep=None):
    """Runs `expr` on the GPU copies of `host` into poisoned outputs; compares every output with
    the float64 reference rounded to its dtype."""
    function = ew.compiled_expression(expr)
    values = [host[name] for name in function._names]
    device = [cupy.asarray(v) if isinstance(v, numpy.ndarray) else v for v in values]
    roots = function.trace(tuple(ew.operand_kind(d, n) for d, n in zip(device, function._names)))
    shape = numpy.broadcast_shapes(*(v.shape for v in values if isinstance(v, numpy.ndarray)))
    outs = tuple(poisoned_out(shape, r.dtype) for r in roots)
    result = cupyops.elementwise(expr, out=outs if len(outs) > 1 else outs[0], policy=policy,
                                 **dict(zip(function._names, device)))
    results = result if isinstance(result, tuple) else (result,)
    for root, actual, out in zip(roots, results, outs):
        assert actual is out
        expected = rounded(evaluate(root, values, shape, keep), root.dtype)
        got = cupy.asnumpy(actual)
        if root.dtype.kind in "biu":
            numpy.testing.assert_array_equal(got, expected)
        else:
            assert_close(got.astype(numpy.float64), expected, root.dtype, scale=scale * SCALE.get(root.dtype, 1.0))
    return results


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", [*fx.FLOAT_FUNCTIONS, "relu", "abs", "neg"])
def test_unary_functions_random(rng, name, dtype, policy):
    x = random(rng, (37, 129), dtype)
    if name in ("log", "rsqrt"):
        x = numpy.abs(x) + numpy.asarray(0.01, dtype)
    expr = "-x" if name == "neg" else f"{name}(x)"
    check(expr, {"x": x}, policy)


EDGES = [0.0, -0.0, numpy.inf, -numpy.inf, numpy.nan, 1e-40, -1e-40, 5e-8, 88.0, -88.0, 100.0, -100.0,
         1e4, -1e4, 1e30, -1e30, 0.5, -0.5, 3.0, -3.0, 1e-3]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", [*fx.FLOAT_FUNCTIONS, "relu", "abs"])
def test_unary_functions_edge_values(name, dtype):
    x = numpy.array(EDGES * 3, dtype=numpy.float64).astype(dtype)
    check(f"{name}(x)", {"x": x})


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("expr", ["maximum(x, y)", "minimum(x, y)", "x / y", "x - y", "x * y",
                                  "x ** y", "where(x > y, x, y)", "x < y", "x >= y", "x == y", "x != y"])
def test_binary_functions(rng, expr, dtype):
    x = random(rng, (1000,), dtype)
    y = numpy.concatenate([numpy.array(EDGES, numpy.float64), random(rng, 1000 - len(EDGES), numpy.float64)]
                          ).astype(dtype)
    if "**" in expr:
        x = numpy.abs(x)
    check(expr, {"x": x, "y": y})


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shapes", [
    ((64, 1024), (1024,)), ((64, 1000), (1000,)), ((64, 1024), (64, 1)), ((63, 1001), (63, 1)),
    ((8, 4, 128), (4, 128)), ((8, 4, 128), (8, 1, 128)), ((8, 4, 128), ()), ((8, 4, 128), (1, 1, 1)),
    ((5,), (3, 1)), ((2, 1, 7, 1), (1, 3, 1, 5)), ((), ()), ((1,), (2048,)),
], ids=str)
def test_broadcasting(rng, shapes, policy):
    x, y = random(rng, shapes[0], numpy.float32), random(rng, shapes[1], numpy.float16)
    check("sigmoid(x + y) * y", {"x": x, "y": y}, policy)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("size", [1, 7, 8, 9, 255, 4097, 65543, 1 << 20])
def test_odd_sizes_and_tail(rng, size, policy):
    a, b = random(rng, size, numpy.float16), random(rng, size, numpy.float16)
    check("relu(a + b) * 0.5", {"a": a, "b": b}, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_misaligned_and_strided_views(rng, policy):
    base = cupy.asarray(random(rng, (65, 1031), numpy.float16))
    other = cupy.asarray(random(rng, (1031, 65), numpy.float32))
    flat = cupy.asarray(random(rng, 64 * 1024 + 1, numpy.float16))
    views = {"x": base[1:, 3:1027], "y": other.T[1:, 3:1027], "z": base[1:, ::-1][:, :1024],
             "w": flat[1:].reshape(64, 1024)}                 # contiguous, 2 bytes off the pack grid
    host = {name: cupy.asnumpy(view) for name, view in views.items()}
    expected = rounded(host["x"].astype(numpy.float64) * host["y"] - host["z"] + host["w"], numpy.float32)
    out = poisoned_out((64, 1024), numpy.float32)
    cupyops.elementwise("x * y - z + w", out=out, policy=policy, **views)
    assert_close(cupy.asnumpy(out), expected, numpy.float32)


def test_several_outputs_and_promotion(rng):
    host = {"a": random(rng, (300, 77), numpy.float16), "b": random(rng, (77,), BFLOAT16),
            "i": random(rng, (300, 1), numpy.int8), "m": rng.random((300, 77)) > 0.5}
    results = check("where(m, a, b) + i, a > b, cast(a * 3, 'int32'), i * 2", host)
    assert [r.dtype for r in results] == [numpy.float32, numpy.bool_, numpy.int32, numpy.int8]


def test_scalars_python_and_numpy(rng):
    x = random(rng, (100,), numpy.float16)
    check("x * a + b", {"x": x, "a": 2.5, "b": 3})
    assert cupyops.elementwise("x * a", x=cupy.asarray(x), a=2.5).dtype == numpy.float16
    assert cupyops.elementwise("x * a", x=cupy.asarray(x), a=numpy.float32(2.5)).dtype == numpy.float32
    # a new scalar value reuses the kernel
    function = ew.compiled_expression("x * a")
    before = len(function._launchers._entries)
    cupyops.elementwise("x * a", x=cupy.asarray(x), a=-1.25)
    assert len(function._launchers._entries) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_out_in_place_and_overlapping(rng, policy):
    host = random(rng, (128, 256), numpy.float32)
    x = cupy.asarray(host)
    cupyops.elementwise("x * 2 + 1", x=x, out=x, policy=policy)          # in place
    assert_close(cupy.asnumpy(x), host * 2 + 1, numpy.float32)
    y = cupy.asarray(host)
    cupyops.elementwise("x + 1", x=y[:, :-1], out=y[:, 1:], policy=policy)   # shifted: read before written
    expected = host.copy()
    expected[:, 1:] = host[:, :-1] + 1
    assert_close(cupy.asnumpy(y), expected, numpy.float32)
    flat = cupy.asarray(host.ravel())
    cupyops.elementwise("x * 3", x=flat[:-1], out=flat[1:], policy=policy)   # contiguous, overlapping
    assert_close(cupy.asnumpy(flat[1:]), host.ravel()[:-1] * 3, numpy.float32)
    strided = cupy.zeros((128, 512), numpy.float32)
    cupyops.elementwise("x - 1", x=cupy.asarray(host), out=strided[:, ::2], policy=policy)
    assert_close(cupy.asnumpy(strided[:, ::2]), host - 1, numpy.float32)
    assert not cupy.asnumpy(strided[:, 1::2]).any()


def test_empty_and_zero_dim():
    empty = cupyops.elementwise("exp(x) + y", x=cupy.empty((0, 5), cupy.float32), y=cupy.ones(5, cupy.float32))
    assert empty.shape == (0, 5) and empty.dtype == numpy.float32
    zero_dim = cupyops.elementwise("x * 2", x=cupy.asarray(3.0, dtype=cupy.float16))
    assert zero_dim.shape == () and float(zero_dim) == 6.0


def test_fuse_traces_once_per_signature(rng):
    calls = []

    @cupyops.fuse
    def f(a, b):
        calls.append(1)
        return cupyops.fx.sigmoid(a + b), a * b

    a, b = (cupy.asarray(random(rng, (64, 128), numpy.float32)) for _ in range(2))
    first, second = f(a, b)
    f(a[1:], b[1:])                                  # another shape: no new trace
    assert len(calls) == 1
    ha, hb = cupy.asnumpy(a), cupy.asnumpy(b)
    assert_close(cupy.asnumpy(first), 1 / (1 + numpy.exp(-(ha.astype(numpy.float64) + hb))), numpy.float32)
    assert_close(cupy.asnumpy(second), ha.astype(numpy.float64) * hb, numpy.float32)
    f(a.astype(cupy.float16), b)                      # other dtypes: traced again
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", FLOATS[:3], ids=str)
def test_named_ops(rng, dtype):
    x, bias, residual = random(rng, (96, 1024), dtype), random(rng, (1024,), dtype), random(rng, (96, 1024), dtype)
    dx, db = cupy.asarray(x), cupy.asarray(bias)
    x64, b64 = x.astype(numpy.float64), bias.astype(numpy.float64)
    from fx_reference import FUNCTIONS as F
    cases = [
        (cupyops.bias_gelu(dx, db), F["gelu"](x64 + b64)),
        (cupyops.bias_gelu(dx, db, approximate="tanh"), F["gelu_tanh"](x64 + b64)),
        (cupyops.bias_silu(dx, db), F["silu"](x64 + b64)),
        (cupyops.swiglu(dx, cupy.asarray(residual)), F["silu"](x64) * residual.astype(numpy.float64)),
        (cupyops.geglu(dx, cupy.asarray(residual)), F["gelu"](x64) * residual.astype(numpy.float64)),
        (cupyops.bias_dropout_add(dx, db, cupy.asarray(residual), 0.0, 5), x64 + b64 + residual.astype(numpy.float64)),
    ]
    for actual, expected in cases:
        assert actual.dtype == dtype
        assert_close(cupy.asnumpy(actual).astype(numpy.float64), rounded(expected, dtype), dtype,
                     scale=SCALE.get(dtype, 1.0))


def test_stream_argument_and_recycled_outputs(rng):
    """A call given stream= runs there and its dropped output is recycled for calls on that
    stream only: a call on the current stream never gets memory a kernel on another may
    still write."""
    from fx_reference import FUNCTIONS as F

    a, b = random(rng, (64, 128), numpy.float32), random(rng, (64, 128), numpy.float32)
    da, db = cupy.asarray(a), cupy.asarray(b)
    expected = F["silu"](a.astype(numpy.float64)) * b
    cupyops.release_kept_outputs()
    side = cupy.cuda.Stream(non_blocking=True)
    first = cupyops.swiglu(da, db, stream=side)
    side.synchronize()
    assert_close(cupy.asnumpy(first).astype(numpy.float64), expected, numpy.float32)
    held = first.data.ptr
    del first
    here = cupyops.swiglu(da, db)                    # the current stream: not the side stream's array
    again = cupyops.swiglu(da, db, stream=side)      # the side stream: its dropped array back
    side.synchronize()
    assert here.data.ptr != held and again.data.ptr == held
    for got in (here, again):
        assert_close(cupy.asnumpy(got).astype(numpy.float64), expected, numpy.float32)
    cupyops.release_kept_outputs()


@pytest.mark.parametrize("policy", POLICIES)
def test_bias_dropout_add_mask_is_dropout_mask(rng, policy):
    from cupyops import philox

    shape, p, seed, offset = (257, 1031), 0.3, 123456789, 17
    x, bias, residual = (random(rng, s, numpy.float32) for s in (shape, shape[-1:], shape))
    y = cupyops.bias_dropout_add(cupy.asarray(x), cupy.asarray(bias), cupy.asarray(residual), p, seed, offset,
                                 policy=policy)
    keep = philox.keep_mask_reference(x.size, p, seed, offset).reshape(shape)
    expected = residual + numpy.where(keep, (x.astype(numpy.float64) + bias) / (1 - p), 0.0)
    assert_close(cupy.asnumpy(y), expected, numpy.float32)
    numpy.testing.assert_array_equal(cupy.asnumpy(cupyops.dropout_mask(shape, p, seed, offset)), keep)


def test_dropout_keep_rate():
    n, p = 10**7, 0.1
    kept = cupyops.elementwise("dropout(x, p, s)", x=cupy.ones(n, cupy.float32), p=p, s=99) != 0
    rate = float(kept.mean())
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma


def test_bad_input():
    x = cupy.ones((4, 3), cupy.float32)
    with pytest.raises(TypeError, match="x is a host value"):
        cupyops.elementwise("x + 1", x=numpy.ones(3))
    with pytest.raises(TypeError, match="complex64"):
        cupyops.elementwise("x + 1", x=cupy.ones(3, cupy.complex64))
    with pytest.raises(TypeError, match="complex"):
        cupyops.elementwise("x + y", x=x, y=1j)
    with pytest.raises(ValueError, match="cannot be broadcast together: x \\(4, 3\\), y \\(4,\\)"):
        cupyops.elementwise("x + y", x=x, y=cupy.ones(4, cupy.float32))
    with pytest.raises(ValueError, match="out has shape"):
        cupyops.elementwise("x + 1", x=x, out=cupy.empty((3, 4), cupy.float32))
    with pytest.raises(ValueError, match="dtype float16"):
        cupyops.elementwise("x + 1", x=x, out=cupy.empty((4, 3), cupy.float16))
    with pytest.raises(TypeError, match="out must be a cupy.ndarray"):
        cupyops.elementwise("x + 1", x=x, out=numpy.empty((4, 3), numpy.float32))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        cupyops.elementwise("dropout(x, p, 1)", x=x, p=1.5)
    with pytest.raises(ValueError, match="policy"):
        cupyops.elementwise("x + 1", x=x, policy="fastest")


def test_torch_tensors_zero_copy(rng):
    torch = pytest.importorskip("torch")
    t = torch.randn(64, 32, device="cuda")
    y = cupyops.elementwise("relu(t) * 2", t=t)
    numpy.testing.assert_allclose(cupy.asnumpy(y), (torch.relu(t) * 2).cpu().numpy(), rtol=1e-6)

