"""`explain`, `compile` and `bench` for fused elementwise kernels: an expression (or a named
op) over operands of one shape, each name optionally given its own shape and dtype.

Bench bytes: each operand read once at its own size, each output written once. Baselines:
torch eager and torch.compile of the same expression, cupy.ElementwiseKernel (the same C
statements, float compute), cupy.fuse of the same function, policy="oneflow", and a copy of
the same bytes."""
from __future__ import annotations


import click

from cupyops import dtypes, fx, jit
from cupyops.device import ARCH_PROFILES
from cupyops.launch import Target
from cupyops.ops import elementwise as ew

from .common import (bench, compile_, compile_and_report, device_option, dtype_option, explain, json_flag,
                     live_device, plot_option, policy_option, positive_shape, show_plan, source_flag, target)

# Named ops: the expression they compute (its operand names), the shape of each operand ("x":
# the whole shape, "cols": the last axis), the named function's arguments in its order (operand
# names, then the numbers the CLI passes) and its approximation.
NAMED = {
    "bias_gelu": ("gelu(x + bias)", {"bias": "cols"}, ("x", "bias"), "none"),
    "bias_gelu_tanh": ("gelu_tanh(x + bias)", {"bias": "cols"}, ("x", "bias"), "tanh"),
    "bias_silu": ("silu(x + bias)", {"bias": "cols"}, ("x", "bias"), "none"),
    "swiglu": ("silu(a) * b", {}, ("a", "b"), "none"),
    "geglu": ("gelu(a) * b", {}, ("a", "b"), "none"),
    "bias_dropout_add": ("residual + dropout(x + bias, p, seed, offset)", {"bias": "cols"},
                         ("x", "bias", "residual", 0.1, 1234, 0), "none"),
}
# The numbers among a named op's operands: not arrays.
NAMED_NUMBERS = ("p", "seed", "offset")


def named_call(named: str):
    """(the named op's fused function, its arguments from {operand name: value}): the function
    each named op calls, as cupyops.torch does."""
    from cupyops.ops import activations

    _, _, arguments, approximate = NAMED[named]
    function = activations.named_function(named.removesuffix("_tanh"), approximate)
    return function, lambda values: tuple(values[a] if isinstance(a, str) else a for a in arguments)


BASELINES = ("torch", "torch_compile", "cupy_kernel", "cupy_fuse", "oneflow", "copy")

expr_option = click.option("--expr", required=True,
                           help=f"An expression such as 'sigmoid(a + b)', or a named op: {', '.join(NAMED)}.")
operand_option = click.option("--operand", "operand_specs", multiple=True, metavar="NAME=SHAPE[:DTYPE]",
                              help="Give one operand its own shape (and dtype), e.g. bias=8192:float32.")


def _operands(expr: str, shape: str, operand_specs: tuple, dtype: str) -> tuple:
    """(expression, the named op or None, {name: (shape, numpy dtype)})."""
    named = NAMED.get(expr)
    text = named[0] if named else expr
    try:
        _, names = fx.parse(text)
    except (ValueError, TypeError) as error:
        raise click.BadParameter(str(error), param_hint="--expr") from None
    names = [n for n in names if not (named and n in NAMED_NUMBERS)]     # the arrays
    dims = positive_shape(shape)
    given = {}
    for spec in operand_specs:
        name, _, rest = spec.partition("=")
        if name not in names:
            raise click.BadParameter(f"{name!r} is not an operand of {text!r} ({', '.join(names)})",
                                     param_hint="--operand")
        shape_text, _, dtype_text = rest.partition(":")
        try:
            operand_dtype = dtypes.parse_dtype(dtype_text) if dtype_text else None
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--operand") from None
        given[name] = (tuple(positive_shape(shape_text, "--operand")) if shape_text.strip() else (), operand_dtype)
    own = named[1] if named else {}
    operands = {}
    for name in names:
        op_shape, op_dtype = given.get(name, (None, None))
        if op_shape is None:
            op_shape = tuple(dims[-1:]) if own.get(name) == "cols" else tuple(dims)
        operands[name] = (op_shape, op_dtype or dtypes.parse_dtype(dtype))
    return text, expr if named else None, operands


def _plan(text, named, operands, policy, plan_target):
    infos = {name: ew.ArrayInfo.contiguous(dt, shape) for name, (shape, dt) in operands.items()}
    if named:
        function, arguments = named_call(named)
        args = arguments(infos)         # plan takes the numbers as they are
    else:
        function, args = ew.compiled_expression(text), tuple(infos.values())
    try:
        return function.plan(args, None, policy, plan_target)
    except (ValueError, TypeError) as error:
        raise click.UsageError(str(error)) from None


@explain.command(name="elementwise")
@expr_option
@click.option("--shape", required=True, help="Shape of every operand, e.g. 16384,8192.")
@operand_option
@dtype_option
@policy_option
@device_option
@json_flag
@source_flag
def explain_elementwise(expr, shape, operand_specs, dtype, policy, device_name, as_json, source):
    """Show the kernel and launch cupyops picks for an elementwise expression."""
    text, named, operands = _operands(expr, shape, operand_specs, dtype)
    plan_target = target(device_name)
    chosen = _plan(text, named, operands, policy, plan_target)
    show_plan(chosen.explain(), f"{text} on {plan_target.facts.name}, policy={policy}: "
              + ", ".join(f"{n} {s} {d.name}" for n, (s, d) in operands.items()),
              as_json, jit.render(chosen.spec) if source else None, width=18)


@compile_.command(name="elementwise")
@click.option("--expr", "exprs", multiple=True,
              help="Expressions or named ops to compile (repeatable)  [default: every named op]")
@click.option("--shape", default="4096,1024", show_default=True)
@dtype_option
@click.option("--arch", default="sm_90", show_default=True, type=click.Choice(sorted(ARCH_PROFILES)))
@policy_option
def compile_elementwise(exprs, shape, dtype, arch, policy):
    """Render and NVRTC-compile the kernels of expressions (no GPU needed)."""
    plan_target = Target.profile(ARCH_PROFILES[arch])

    def spec_of(expr):
        text, named, operands = _operands(expr, shape, (), dtype)
        return _plan(text, named, operands, policy, plan_target).spec
    compile_and_report((expr, arch, lambda expr=expr: spec_of(expr)) for expr in exprs or tuple(NAMED))


@bench.command(name="elementwise")
@expr_option
@click.option("--shape", "shapes", multiple=True, required=True,
              help="Operand shape (repeatable: one point each), e.g. 16384,8192.")
@operand_option
@dtype_option
@click.option("--baseline", default=",".join(BASELINES), show_default=True,
              help=f"Providers to compare with: {', '.join(BASELINES)}.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Write the table as CSV.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results as JSON.")
@plot_option
def bench_elementwise(expr, shapes, operand_specs, dtype, baseline, csv_path, json_path, plot_path):
    """Time an elementwise expression or named op against its baselines on the live GPU."""
    from . import benchmark, elementwise_providers

    baselines = [name.strip() for name in baseline.split(",") if name.strip()]
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise click.BadParameter(f"unknown baseline(s) {sorted(unknown)}; known: {', '.join(BASELINES)}",
                                 param_hint="--baseline")
    points = []
    for shape in shapes:
        text, named, operands = _operands(expr, shape, operand_specs, dtype)
        chosen = _plan(text, named, operands, "auto", Target.profile("h100"))   # usage errors before GPU work
        point = elementwise_providers.Point(text, named, operands, chosen.shape)
        points.append((list(chosen.shape), chosen.shape[-1] if chosen.shape else 1,
                       point.bytes_moved(chosen.out_dtypes), point.providers))
    live_device("bench times the live GPU, and no GPU is usable here")
    result = {"op": f"elementwise {expr}", "rows": None, "axis": None,
              **benchmark.time_points(f"elementwise {dtype}", dtypes.parse_dtype(dtype), points, baselines)}
    benchmark.emit(result, csv_path, json_path, plot_path)
