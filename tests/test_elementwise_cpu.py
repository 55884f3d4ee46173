"""CPU tests of the fused elementwise family: the parser's whitelist, tracing and NumPy
promotion, operand layouts, launch plans of both policies, rendering, NVRTC compiles of
every named op and namespace function for sm_80 and sm_90 (no GPU needed), and repeated
calls on a GPU stand-in (fake_device.py) taking the memoised launcher."""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import types

import numpy
import pytest
from fx_reference import evaluate, rounded

import cupyops
from cupyops import fx, jit, profile
from cupyops.dtypes import BFLOAT16
from cupyops.launch import LaunchCache, Target
from cupyops.ops import activations
from cupyops.ops import elementwise as ew
from cupyops.ops.elementwise_launch import Launcher

F16, F32, F64 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)
H100 = Target.profile("h100")


def info(dtype, shape, misalignment=0, strides=None):
    base = ew.ArrayInfo.contiguous(dtype, shape)
    return ew.ArrayInfo(base.dtype, base.shape, tuple(strides) if strides else base.strides, misalignment)


# -- the string front end ----------------------------------------------------------------------

@pytest.mark.parametrize("expr, message", [
    ("foo(x)", "unknown function 'foo'"),
    ("__import__('os')", "unknown function '__import__'"),
    ("x.__class__", "Attribute"),
    ("x.real", "Attribute"),
    ("x[0]", "Subscript"),
    ("lambda: x", "Lambda"),
    ("x if y else z", "IfExp"),
    ("x // y", "FloorDiv"),
    ("x % y", "Mod"),
    ("x and y", "BoolOp"),
    ("not x", "Not"),
    ("~x", "Invert"),
    ("0 < x < 1", "chained"),
    ("x in y", "chained or unknown"),
    ("exp(x=y)", "keyword"),
    ("'text'", "constant 'text'"),
    ("1j * x", "constant 1j"),
    ("exp", "without a call"),
    ("x +", "not valid Python"),
    ("[x, y]", "List"),
    ("(x, (y, z))", "Tuple"),
])
def test_parser_refuses(expr, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fx.parse(expr)


def test_parser_names_in_order_of_first_use():
    _, names = fx.parse("gelu_tanh(x + bias) * x, where(mask, y, 0.5)")
    assert names == ("x", "bias", "mask", "y")


def test_parser_checks_arity():
    tree, names = fx.parse("maximum(x)")
    with pytest.raises(ValueError, match=r"maximum\(\) takes 2 arguments, got 1"):
        fx.build(tree, {"x": fx.operand(0, F32)})


def test_elementwise_refuses_missing_and_unused_operands():
    with pytest.raises(ValueError, match="'y'.*no operand"):
        cupyops.elementwise("x + y", x=1.0)
    with pytest.raises(ValueError, match="'z'.*not used"):
        cupyops.elementwise("x + 1", x=1.0, z=2.0)


def test_string_and_traced_trees_agree():
    tree, names = fx.parse("sigmoid(a + b) * 0.5")
    a, b = fx.operand(0, F16), fx.operand(1, F16)
    assert fx.build(tree, {"a": a, "b": b}).key == (fx.sigmoid(a + b) * 0.5).key


# -- tracing and promotion -----------------------------------------------------------------------

PROMOTIONS = [
    (F16, F16), (F16, F32), (BFLOAT16, BFLOAT16), (BFLOAT16, F16), (BFLOAT16, F32), (F32, F64),
    (numpy.dtype(numpy.int8), F16), (numpy.dtype(numpy.int32), F32), (numpy.dtype(numpy.int32), numpy.dtype(numpy.int64)),
    (numpy.dtype(numpy.bool_), numpy.dtype(numpy.int16)), (numpy.dtype(numpy.uint8), numpy.dtype(numpy.int8)),
]


@pytest.mark.parametrize("a, b", PROMOTIONS, ids=lambda d: str(d))
@pytest.mark.parametrize("op", ["add", "multiply", "divide", "maximum"])
def test_array_promotion_is_numpys(a, b, op):
    node = getattr(fx, op)(fx.operand(0, a), fx.operand(1, b)) if op in ("maximum",) else \
        fx.binary(op, fx.operand(0, a), fx.operand(1, b))
    ufunc = {"add": numpy.add, "multiply": numpy.multiply, "divide": numpy.true_divide,
             "maximum": numpy.maximum}[op]
    assert node.dtype == ufunc(numpy.ones(1, a), numpy.ones(1, b)).dtype


@pytest.mark.parametrize("dtype, scalar, expected", [
    (F16, 2.5, F16), (BFLOAT16, 2.5, BFLOAT16), (F32, 2, F32), (numpy.dtype(numpy.int8), 3, numpy.int8),
    (numpy.dtype(numpy.int8), 2.5, F64), (numpy.dtype(numpy.bool_), 1, numpy.int64), (F16, True, F16),
])
def test_python_scalars_are_weak(dtype, scalar, expected):
    assert (fx.operand(0, dtype) + scalar).dtype == numpy.dtype(expected)
    assert (scalar * fx.operand(0, dtype)).dtype == numpy.dtype(expected)


@pytest.mark.parametrize("dtype", [F16, BFLOAT16, F32, F64, numpy.dtype(numpy.int8), numpy.dtype(numpy.int32)])
def test_float_functions_follow_numpy_exp(dtype):
    x = fx.operand(0, dtype)
    expected = numpy.exp(numpy.ones(1, dtype)).dtype
    for name in fx.FLOAT_FUNCTIONS:
        assert getattr(fx, name)(x).dtype == expected, name
    assert fx.relu(x).dtype == dtype and fx.abs_(x).dtype == dtype
    assert (x < 1).dtype == numpy.bool_ and fx.cast(x, "bfloat16").dtype == BFLOAT16


def test_tracing_refusals():
    x = fx.operand(0, F32)
    with pytest.raises(TypeError, match="truth value"):
        bool(x > 0)
    with pytest.raises(TypeError, match="booleans"):
        fx.operand(0, numpy.bool_) - True
    with pytest.raises(TypeError, match="negating a boolean"):
        -fx.operand(0, numpy.bool_)
    with pytest.raises(TypeError, match=r"\*\* of integers"):
        fx.operand(0, numpy.int32) ** 2
    with pytest.raises(TypeError, match="complex"):
        fx.operand(0, numpy.complex64)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        fx.dropout(x, 1.0, 0)
    with pytest.raises(ValueError, match="p must be a Python number"):
        fx.dropout(x, x, 0)
    with pytest.raises(TypeError, match="seed and offset must be integers"):
        fx.dropout(x, 0.1, 0.5)
    with pytest.raises(TypeError, match="cannot be used"):
        x + "text"


# -- layouts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_shape, shape, strides, expected", [
    ((64, 128), (64, 128), None, ("linear", 1, 0)),
    ((64, 128), (128,), None, ("inner", 128, 0)),
    ((8, 4, 128), (4, 128), None, ("inner", 512, 0)),
    ((64, 128), (64, 1), None, ("outer", 128, 0)),
    ((8, 4, 128), (8, 1, 1), None, ("outer", 512, 0)),
    ((64, 128), (), None, ("scalar", 1, 0)),
    ((64, 128), (1, 1), None, ("scalar", 1, 0)),
    ((64, 128), (64, 128), (1, 64), ("strided", 1, 2)),       # a transposed view
    ((8, 4, 128), (8, 1, 128), None, ("strided", 1, 3)),      # broadcast in the middle
    ((64, 128), (64, 128), (256, 1), ("strided", 1, 2)),      # every other row
])
def test_operand_layouts(out_shape, shape, strides, expected):
    operand = info(F32, shape, strides=strides)
    sizes, merged = ew.merged_axes(out_shape, [ew.broadcast_strides_of(operand, len(out_shape))])
    assert ew.classify(sizes, merged[0]) == expected


def test_merged_axes_join_what_every_operand_walks_as_one():
    shape = (8, 4, 128)
    full, bias = info(F32, shape), info(F32, (128,))
    sizes, strides = ew.merged_axes(shape, [ew.broadcast_strides_of(o, 3) for o in (full, bias)])
    assert sizes == [32, 128] and strides == [[128, 1], [0, 1]]


# -- plans ---------------------------------------------------------------------------------------

def plan(expr, *args, out=None, policy="auto"):
    return ew.compiled_expression(expr).plan(args, out, policy, H100)


@pytest.mark.parametrize("dtypes, pack", [((F16, F16), 8), ((F32, F32), 4), ((F64, F64), 2),
                                          ((F16, F32), 4), ((numpy.int8, numpy.int8), 8)])
def test_oneflow_pack_is_the_smallest_over_operands(dtypes, pack):
    chosen = plan("a + b", info(dtypes[0], (4096, 1024)), info(dtypes[1], (4096, 1024)), policy="oneflow")
    assert chosen.spec.pack_size == pack
    assert chosen.block == 256 and chosen.spec.packs_per_thread == 1
    packs = 4096 * 1024 // pack
    assert chosen.grid == min(-(-packs // 256), 132 * 2048 // 256 * 32)


def test_oneflow_misaligned_pointer_means_pack_1_auto_keeps_the_rest():
    a, b = info(F16, (4096, 1024)), info(F16, (4096, 1024), misalignment=2)
    oneflow = plan("a + b", a, b, policy="oneflow")
    assert oneflow.spec.pack_size == 1
    auto = plan("a + b", a, b)
    assert auto.spec.pack_size == 8
    assert [o.vector for o in auto.spec.operands] == [True, False]


def test_auto_covers_the_array_in_one_pass():
    chosen = plan("a * b", info(F16, (16384, 8192)), info(F16, (16384, 8192)))
    per_block = chosen.block * chosen.spec.packs_per_thread * chosen.spec.pack_size
    assert chosen.grid == -(-16384 * 8192 // per_block)


def test_a_grid_covering_every_pack_runs_no_loop_at_full_occupancy():
    # one pass: no grid-stride loop, and __launch_bounds__ asking for every thread an SM holds
    once = plan("residual + dropout(x + bias, p, seed, offset)", info(F16, (4096, 4096)), info(F16, (4096,)),
                info(F16, (4096, 4096)), float, int, int)
    assert once.spec.one_pass and once.spec.name.endswith("_1p_mb8")
    assert (once.explain()["loop"], once.explain()["min_blocks_per_sm"]) == ("none (one pass)", 8)
    assert once.grid * once.block * once.spec.packs_per_thread * once.spec.pack_size >= 4096 * 4096
    source = jit.render(once.spec)
    assert "first += step" not in source and f"__launch_bounds__({once.block}, 8)" in source
    report = jit.compile_cubin(once.spec, "sm_90")
    assert report.registers <= 32 and report.spill_bytes == 0
    # a grid capped at its waves walks the array: the loop, no bounds on blocks
    walked = plan("gelu(x + bias)", info(F16, (16384, 8192)), info(F16, (8192,)))
    assert walked.grid * walked.block * walked.spec.packs_per_thread * walked.spec.pack_size < 16384 * 8192
    assert not walked.spec.one_pass and walked.spec.min_blocks == 0
    assert "first += step" in jit.render(walked.spec)
    assert (walked.explain()["loop"], walked.explain()["min_blocks_per_sm"]) == ("grid-stride", None)
    # OneFlow's launch keeps its loop
    assert not plan("a * b", info(F16, (64, 64)), info(F16, (64, 64)), policy="oneflow").spec.one_pass


def test_cli_explains_and_compiles_the_kernel_each_named_op_runs():
    """explain / compile plan the function a named op calls, with its arguments in its order
    (bias_dropout_add: p, seed and offset are kernel arguments, not constants)."""
    import json

    from click.testing import CliRunner

    from cli.elementwise import named_call
    from cupyops.cli.main import main

    run = CliRunner().invoke
    result = run(main, ["explain", "elementwise", "--expr", "bias_dropout_add", "--shape", "64,1024",
                        "--device", "h100", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    runs = activations._bias_dropout_add.plan(
        (info(F16, (64, 1024)), info(F16, (1024,)), info(F16, (64, 1024)), float, int, int), None, "auto", H100)
    assert shown["kernel"] == runs.spec.name and len(runs.spec.scalars) == 3
    refused = run(main, ["explain", "elementwise", "--expr", "bias_dropout_add", "--shape", "64,64",
                         "--operand", "p=4", "--device", "h100"])
    assert refused.exit_code != 0 and "'p' is not an operand" in refused.output
    function, arguments = named_call("bias_dropout_add")
    assert function is activations.named_function("bias_dropout_add")
    assert arguments({"residual": "R", "x": "X", "bias": "B"}) == ("X", "B", "R", 0.1, 1234, 0)
    assert named_call("bias_gelu_tanh")[0] is activations.named_function("bias_gelu", "tanh")
    compiled = run(main, ["compile", "elementwise", "--arch", "sm_90", "--dtype", "bfloat16"])
    assert compiled.exit_code == 0, compiled.output
    assert "6 kernels compiled for sm_90, 0 failed" in compiled.output


def test_full_occupancy_is_not_bought_with_a_spill():
    names = "abcdefgh"
    heavy = plan("a * b + c * d - e / f + exp(g) * log(h)", *(info(F64, (4096, 4096)) for _ in names))
    assert heavy.spec.one_pass and heavy.spec.min_blocks == 0
    bounded = dataclasses.replace(heavy.spec, min_blocks=H100.facts.max_threads_per_sm // heavy.block)
    assert jit.compile_cubin(bounded, "sm_90").spill_bytes > 0
    assert jit.compile_cubin(heavy.spec, "sm_90").spill_bytes == 0


def test_per_column_operand_is_read_in_packs_when_cols_divide():
    even = plan("x + bias", info(F16, (64, 1024)), info(F16, (1024,)))
    assert even.spec.operands[1] == ew.OperandSpec("float16", "inner", True)
    odd = plan("x + bias", info(F16, (64, 1001)), info(F16, (1001,)))
    assert odd.spec.operands[1].access == "inner" and not odd.spec.operands[1].vector
    assert odd.explain()["operands"] == ["float16 linear", "float16 inner (element loads)"]


def test_plan_refuses_bad_broadcast_and_out():
    with pytest.raises(ValueError, match=r"cannot be broadcast together: x \(4, 3\), y \(4,\)"):
        plan("x + y", info(F32, (4, 3)), info(F32, (4,)))
    with pytest.raises(ValueError, match="out has shape"):
        plan("x + 1", info(F32, (4, 3)), out=info(F32, (4, 4)))
    with pytest.raises(ValueError, match="out has shape .* dtype float16"):
        plan("x + 1", info(F32, (4, 3)), out=info(F16, (4, 3)))
    with pytest.raises(ValueError, match="2 outputs"):
        plan("x + 1, x", info(F32, (4, 3)), out=info(F32, (4, 3)))


def test_index_type_widens_past_2_31():
    assert plan("x * 2", info(F16, (2**21, 1024))).spec.index_type == "long long"
    assert plan("x * 2", info(F16, (2**10, 1024))).spec.index_type == "int"


def test_kernel_name_is_readable_and_stable():
    first = plan("gelu_tanh(x + bias)", info(F16, (64, 1024)), info(F16, (1024,)))
    again = plan("gelu_tanh(x + bias)", info(F16, (8, 1024)), info(F16, (1024,)))
    name = first.spec.name
    assert name.startswith("elementwise_gelu_tanh_") and "_f16l_f16c_to_f16_p8_" in name
    assert name == again.spec.name          # the shape is a kernel argument
    assert first.explain()["expression"] == "gelu_tanh(add(in0, in1))"


def test_scalars_are_kernel_arguments():
    # the same kernel for every value; a Python float is a double argument
    chosen = plan("x * a + 1.5", info(F32, (64, 64)), float)
    assert chosen.spec.scalars == ("double",)
    assert "1.5" in jit.render(chosen.spec) and chosen.scalars == ((1, numpy.float64),)


def test_shared_subexpressions_are_computed_once():
    chosen = plan("exp(x + y) * exp(x + y)", info(F32, (64,)), info(F32, (64,)))
    assert sum("fx_exp" in line for line in chosen.spec.body) == 1


# -- rendering and compiling ------------------------------------------------------------------------

NAMED = {
    "bias_gelu": (activations._bias_gelu, 2), "bias_gelu_tanh": (activations._bias_gelu_tanh, 2),
    "bias_silu": (activations._bias_silu, 2), "swiglu": (activations._swiglu, 2),
    "geglu": (activations._geglu, 2), "geglu_tanh": (activations._geglu_tanh, 2),
}


def _named_plans(dtype):
    rows, cols = 64, 1024
    for name, (function, _) in NAMED.items():
        second = info(dtype, (cols,)) if name.startswith("bias") else info(dtype, (rows, cols))
        yield name, function.plan((info(dtype, (rows, cols)), second), None, "auto", H100)
    yield "bias_dropout_add", activations._bias_dropout_add.plan(
        (info(dtype, (rows, cols)), info(dtype, (cols,)), info(dtype, (rows, cols)), float, int, int),
        None, "auto", H100)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", [F16, BFLOAT16, F32])
def test_named_ops_compile(arch, dtype):
    for name, chosen in _named_plans(dtype):
        report = jit.compile_cubin(chosen.spec, arch)
        assert report.registers > 0 and report.spill_bytes == 0, (name, report)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", [F16, BFLOAT16, F32, F64])
def test_every_function_compiles(arch, dtype):
    names = ", ".join(f"{name}(x)" for name in fx.FLOAT_FUNCTIONS)
    expr = (f"{names}, relu(x), abs(x), maximum(x, y), minimum(x, y), where(x > y, x, y), x ** y, "
            "cast(x, 'float16'), cast(x, 'bfloat16'), cast(x, 'int32'), -x / y, x != y")
    for policy in ("auto", "oneflow"):
        chosen = plan(expr, info(dtype, (1000, 77)), info(dtype, (77,)), policy=policy)
        report = jit.compile_cubin(chosen.spec, arch)
        assert report.spill_bytes == 0 and len(chosen.spec.outputs) == 20


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fast_forms_compile_where_every_output_is_16_bit(arch):
    names = ", ".join(f"{name}(x)" for name in fx.FLOAT_FUNCTIONS)
    for dtype, fast in ((F16, True), (BFLOAT16, True), (F32, False)):
        chosen = plan(names, info(dtype, (1000, 77)))
        assert chosen.spec.fast_math is fast
        assert ("constexpr bool F = true;" in jit.render(chosen.spec)) is fast
        assert jit.compile_cubin(chosen.spec, arch).spill_bytes == 0
    assert not plan("gelu(x), x > 0", info(F16, (64,))).spec.fast_math          # a bool output
    assert not plan("cast(gelu(x), 'float32')", info(F16, (64,))).spec.fast_math


def _fast_gelu_float32(x):
    """kernels/elementwise.cuh fx_gelu<true> step by step in float32 (hardware 2^x and 1/x
    taken exact), its coefficients read from the header."""
    source = (jit.resource_dir("kernels") / "elementwise.cuh").read_text()
    fit = source[source.index("fx_half_erfc_log2_fit(float t)"):]
    coefficients = [numpy.float32(c) for c in re.findall(r"(-?\d+\.\d+)f", fit[:fit.index("}")])]
    (t_scale,) = re.findall(r"fx_rcp_approx\(fmaf\(fabsf\(x\), (\d+\.\d+)f, 1\.0f\)\)", source)
    assert len(coefficients) == 7
    f = numpy.float32
    t = (f(1) / (numpy.abs(x) * f(t_scale) + f(1))).astype(f)
    e = coefficients[0]
    for c in coefficients[1:]:
        e = (e * t + c).astype(f)
    h = (t * numpy.exp2((x * x).astype(f) * f(-0.72134752044448170368) + e).astype(f)).astype(f)
    return x * numpy.where(x >= 0, f(1) - h, h)


def test_fast_gelu_is_within_a_small_fraction_of_a_16_bit_rounding():
    special = pytest.importorskip("scipy.special")
    x = numpy.concatenate([numpy.linspace(-14, 14, 400001), numpy.geomspace(1e-6, 14, 20001),
                           -numpy.geomspace(1e-6, 14, 20001)]).astype(numpy.float32)
    exact = 0.5 * x.astype(numpy.float64) * special.erfc(-x.astype(numpy.float64) / math.sqrt(2))
    got = _fast_gelu_float32(x).astype(numpy.float64)
    tiny = numpy.abs(exact) < 1e-30          # flushed or far below bfloat16's smallest normal
    relative = numpy.abs(got - exact)[~tiny] / numpy.abs(exact)[~tiny]
    assert relative.max() < 3e-5             # float16 rounds at 4.9e-4, bfloat16 at 3.9e-3
    assert numpy.all(numpy.abs(got[tiny]) < 1e-29)


def test_every_layout_compiles():
    chosen = plan("a + b + c + d + e", info(F16, (8, 4, 128)), info(F16, (128,)), info(F16, (8, 1, 1)),
                  info(F16, ()), info(F16, (8, 4, 128), strides=(1, 8, 32)))
    assert [o.access for o in chosen.spec.operands] == ["linear", "inner", "outer", "scalar", "strided"]
    report = jit.compile_cubin(chosen.spec, "sm_90")
    assert report.spill_bytes == 0


def test_mixed_types_compile():
    chosen = plan("where(m, a, b) + i, a > 0.5", info(numpy.bool_, (64, 64)), info(F16, (64, 64)),
                  info(BFLOAT16, (64,)), info(numpy.int8, (64, 1)))
    assert [d.name for d in chosen.out_dtypes] == ["float32", "bool"]
    jit.compile_cubin(chosen.spec, "sm_90")


# -- the reference itself ------------------------------------------------------------------------

def test_reference_evaluates_like_numpy():
    x = numpy.linspace(-3, 3, 13)
    node = fx.sigmoid(fx.operand(0, F64) * 2.0) - fx.operand(1, F64, weak=True)
    expected = 1 / (1 + numpy.exp(-2 * x)) - 0.25
    numpy.testing.assert_allclose(evaluate(node, [x, 0.25], x.shape), expected, rtol=1e-15)
    assert rounded(numpy.array([1e6]), numpy.float16)[0] == numpy.inf
    assert math.isclose(rounded(numpy.array([1 / 3]), numpy.float16)[0], 0.333251953125)


def test_launch_geometry_caps_the_grid_at_its_waves():
    facts = H100.facts
    assert ew.launch_geometry((256, 32, None), 10**6, 16, facts) == (256, 2, -(-10**6 // 512))
    assert ew.launch_geometry((256, 32, 2), 10**7, 16, facts) == (256, 2, 2 * 132 * 8)
    assert ew.launch_geometry((256, 32, 2), 10**5, 16, facts) == (256, 2, -(-10**5 // 512))
    assert ew.launch_geometry((1024, 16, None), 5, 16, facts) == (1024, 1, 1)


@pytest.mark.parametrize("tuned", profile.profiles(), ids=lambda p: p.name)
def test_profiles_launch_among_the_candidates(tuned):
    rows = tuned.ELEMENTWISE_AUTO_LAUNCH
    assert rows[0][0] == 0.0 and [least for least, _ in rows] == sorted(least for least, _ in rows)
    assert all(tuple(launch) in ew.launch_candidates() for _, launch in rows)


# -- repeated calls (a GPU stand-in: tests/fake_device.py) -----------------------------------------

@pytest.fixture
def device(monkeypatch):
    return pytest.importorskip("fake_device").FakeDevice(monkeypatch)


def count_calls(monkeypatch, counts, *targets):
    """Counts calls of each (owner, name) in `counts` under that name."""
    for owner, name in targets:
        original = getattr(owner, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)


def described(launches, arrays: dict) -> list:
    """Each launch as (kernel, grid, block, args): arrays by name (fresh ones by shape), scalars by value."""
    names = {a.data.ptr: name for name, a in arrays.items()}
    return [(k.name, k.grid, k.block, tuple((type(a).__name__, a.item()) if isinstance(a, numpy.generic)
                                            else names.get(a.data.ptr, ("fresh", a.shape)) for a in k.args))
            for k in launches]


REPEATED = {   # label -> call(arrays, seed)
    "fuse(f)(a, b)": lambda v, seed: FUSED_SIGMOID(v["x"], v["y"]),
    "fuse(f)(a, b, out=)": lambda v, seed: FUSED_SIGMOID(v["x"], v["y"], out=v["out"]),
    "fuse(f)(a, 0.5, out=a)": lambda v, seed: FUSED_AXPY(v["x"], 0.5, out=v["x"]),
    "elementwise(expr, out=)": lambda v, seed: cupyops.elementwise("sigmoid(a + b)", a=v["x"], b=v["y"], out=v["out"]),
    "elementwise(expr)": lambda v, seed: cupyops.elementwise("relu(a + b) * 0.5", a=v["x"], b=v["y"]),
    "bias_gelu": lambda v, seed: cupyops.bias_gelu(v["x"], v["bias"]),
    "bias_gelu tanh, out=": lambda v, seed: cupyops.bias_gelu(v["x"], v["bias"], "tanh", out=v["out"]),
    "bias_silu": lambda v, seed: cupyops.bias_silu(v["x"], v["bias"]),
    "swiglu": lambda v, seed: cupyops.swiglu(v["x"], v["y"]),
    "geglu tanh": lambda v, seed: cupyops.geglu(v["x"], v["y"], approximate="tanh"),
    "bias_dropout_add": lambda v, seed: cupyops.bias_dropout_add(v["x"], v["bias"], v["y"], 0.1, seed, 2 * seed),
}


@cupyops.fuse
def FUSED_SIGMOID(a, b):
    return fx.sigmoid(a + b)


@cupyops.fuse
def FUSED_AXPY(a, s):
    return a * s + 1.0


@pytest.mark.parametrize("label", sorted(REPEATED))
def test_repeated_calls_neither_trace_nor_plan(device, monkeypatch, label):
    """A repeated call with operands of one signature takes its memoised launcher: no parsing,
    tracing, planning or preparing, the same kernel launched with the call's own arrays and
    scalars (a new seed goes into the kernel's arguments)."""
    values = {"x": device.array((64, 128), "float32"), "y": device.array((64, 128), "float32"),
              "bias": device.array((128,), "float32"), "out": device.array((64, 128), "float32")}
    for function in (FUSED_SIGMOID, FUSED_AXPY):     # launchers of this test's stand-in alone
        monkeypatch.setattr(function, "_launchers", LaunchCache())
    counts = collections.Counter()
    count_calls(monkeypatch, counts, (fx, "parse"), (ew.FusedFunction, "trace"), (ew, "make_plan"),
                (ew.FusedFunction, "_prepare"))
    seen = []
    for seed in (7, 8):
        counts.clear()
        device.launches.clear()
        result = REPEATED[label](values, seed)
        seen.append(described(device.launches, {**values, "result": result}))
    assert not counts, f"the repeated call ran {dict(counts)}"
    assert all(launch.packed for launch in device.launches), "the launch converted its arguments"
    (first,), (second,) = seen
    assert first[:3] == second[:3]
    if label == "bias_dropout_add":
        assert first[3][3:6] == (("float64", 0.1), ("int64", 7), ("int64", 14)) and second[3][4:6] == (("int64", 8), ("int64", 16))
    else:
        assert first == second


def test_a_call_asks_for_its_stream_once(device, monkeypatch):
    """An allocating call reads the current stream's address once and gives the recycler and the
    launch that address and the launcher's GPU; a call given stream= uses that stream's alone."""
    from cupyops import callcache, packed

    seen = []
    monkeypatch.setattr(callcache, "stream_ptr", lambda: seen.append("query") or 55)
    monkeypatch.setattr(callcache, "empty_on", lambda shape, dtype, device_id, stream_ptr:
                        seen.append(("output", device_id, stream_ptr)) or device.array(shape, dtype))
    monkeypatch.setattr(packed.PackedLaunch, "launch_on", lambda launch, values, stream_ptr:
                        seen.append(("launch", stream_ptr)))
    monkeypatch.setattr(FUSED_SIGMOID, "_launchers", LaunchCache())   # a launcher made with these stand-ins
    x, y = device.array((64, 128), "float32"), device.array((64, 128), "float32")

    class Stream:
        ptr = 99
    for stream, expected in ((None, ["query", ("output", 0, 55), ("launch", 55)]),
                             (Stream, [("output", 0, 99), ("launch", 99)])):
        for _ in range(2):   # the first call prepares its launcher, the second replays it
            seen.clear()
            FUSED_SIGMOID(x, y, stream=stream)
        assert seen == expected


def test_named_function_is_the_function_each_named_op_calls():
    assert activations.named_function("swiglu") is activations._swiglu
    assert activations.named_function("bias_silu") is activations._bias_silu
    assert activations.named_function("bias_dropout_add") is activations._bias_dropout_add
    assert activations.named_function("bias_gelu", "tanh") is activations._bias_gelu_tanh
    assert activations.named_function("geglu") is activations._geglu
    with pytest.raises(ValueError, match="approximate"):
        activations.named_function("geglu", "fast")
    with pytest.raises(ValueError, match="no named elementwise op 'gelu'"):
        activations.named_function("gelu")


REMEMBERED = {   # label -> (named op, its fused function's operands from x, y, bias)
    "swiglu": ("swiglu", lambda v: (v["x"], v["y"])),
    "bias_gelu tanh": ("bias_gelu", lambda v: (v["x"], v["bias"])),
    "bias_dropout_add": ("bias_dropout_add", lambda v: (v["x"], v["bias"], v["y"], 0.1, 7, 14)),
    "two outputs": (None, lambda v: (v["x"], v["y"])),
}


@cupyops.fuse
def FUSED_PAIR(a, b):
    return a * b, fx.sigmoid(a) - b


@pytest.mark.parametrize("label", sorted(REMEMBERED))
def test_remembered_launchers_replay_on_addresses(device, monkeypatch, label):
    """FusedFunction.remembered: None before a call, then the launcher the call took, whose
    launch_at on the operands' addresses and fresh outputs launches what the memoised call
    launches (a dropout probability still checked); None for another layout."""
    cupy = pytest.importorskip("cupy")
    values = {"x": device.array((64, 128), "float32"), "y": device.array((64, 128), "float32"),
              "bias": device.array((128,), "float32")}
    op, operands = REMEMBERED[label]
    function = FUSED_PAIR if op is None else activations.named_function(op, "tanh" if "tanh" in label else "none")
    args = operands(values)
    monkeypatch.setattr(function, "_launchers", LaunchCache())
    assert function.remembered(args) is None
    function.call(args)
    launcher = function.remembered(args)
    device.launches.clear()
    results = function.call(args)
    results = results if isinstance(results, tuple) else (results,)
    expected = described(device.launches, {**values, **{f"result {i}": r for i, r in enumerate(results)}})
    outputs = [device.empty(shape, dtype) for shape, dtype in launcher.outputs]
    assert [(o.shape, o.dtype) for o in outputs] == [(r.shape, r.dtype) for r in results]
    device.launches.clear()
    launcher.launch_at(tuple(a.data.ptr if isinstance(a, cupy.ndarray) else a for a in args),
                       tuple(o.data.ptr for o in outputs))
    assert described(device.launches, {**values, **{f"result {i}": o for i, o in enumerate(outputs)}}) == expected
    if op == "bias_dropout_add":
        with pytest.raises(ValueError, match="dropout probability"):
            launcher.launch_at((*(a.data.ptr for a in args[:3]), 1.5, 7, 14), (outputs[0].data.ptr,))
    shifted = cupy.ndarray((64, 128), numpy.float32, values["x"].data + 4)
    assert function.remembered((shifted, *args[1:])) is None


def test_memoised_signatures_still_check_their_arguments(device):
    x, bias = device.array((64, 128), "float32"), device.array((128,), "float32")
    cupyops.bias_dropout_add(x, bias, x, 0.1, 1)
    cupyops.bias_gelu(x, bias)
    launched = len(device.launches)
    with pytest.raises(ValueError, match="dropout probability"):
        cupyops.bias_dropout_add(x, bias, x, 1.5, 1)
    with pytest.raises(ValueError, match="approximate"):
        cupyops.bias_gelu(x, bias, approximate="fast")
    with pytest.raises(ValueError, match="approximate"):
        cupyops.bias_gelu(x, bias, approximate=["tanh"])
    with pytest.raises(ValueError, match="out"):
        cupyops.bias_gelu(x, bias, out=device.array((64, 128), "float16"))
    with pytest.raises(TypeError, match="out"):
        cupyops.bias_gelu(x, bias, out=(numpy.empty((64, 128), numpy.float32),))
    assert len(device.launches) == launched


def test_out_is_the_kernels_own_unless_it_overlaps_an_operand_elsewhere(device):
    """An out written by the kernel itself: C-contiguous and overlapping no operand but one read
    at the very elements written (x = f(x)); any other goes through a fresh array."""
    cupy = pytest.importorskip("cupy")
    x, y = device.array((64, 128), "float32"), device.array((64, 128), "float32")
    row = cupy.ndarray((128,), numpy.float32, x.data)                      # x's first row
    cases = [((x, y), device.array((64, 128), "float32"), True),
             ((x, y), x, True),                                           # in place
             ((x, y), cupy.ndarray((64, 128), numpy.float32, x.data + 4), False),   # x shifted
             ((y, row), x, False),                                        # a bias read where out is written
             ((x, y), device.array((64, 128), "float32", strides=(1024, 4)), False)]   # not contiguous
    for args, out, direct in cases:
        plan = FUSED_SIGMOID.plan(args, out, "auto", H100)
        launcher = Launcher(plan, types.SimpleNamespace(ptr=0), args, out)    # a kernel never launched
        assert launcher._direct(0, out, args) == direct
