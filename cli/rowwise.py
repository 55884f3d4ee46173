"""`explain`, `compile` and `bench` for the row-wise ops (softmax family, norms): one
subcommand of each verb per op, sharing the options below."""
from __future__ import annotations

import math

import click

from cupyops import dtypes, jit
from cupyops.device import ARCH_PROFILES
from cupyops.launch import Target

from .common import (bench, compile_, compile_and_report, device_option, dtype_option, explain, int_list,
                     json_flag, live_device, plot_option, policy_option, positive_shape, show_plan,
                     source_flag, target)
from .ops import OPS

DEFAULT_ROWS = 49152
DEFAULT_COLS = "32,64,128,256,512,1000,1024,1536,2048,3000,4096,8192,12345,16384,32768"


def _shape_and_axis(op: str, shape: str, axis: int) -> tuple:
    """--shape and --axis checked: (dims, axis counted from the front)."""
    dims = positive_shape(shape)
    if not -len(dims) <= axis < len(dims):
        raise click.BadParameter(f"axis {axis} is out of range for {len(dims)} dimensions",
                                 param_hint="--axis")
    axis %= len(dims)
    if axis != len(dims) - 1 and OPS[op].axis_plan is None:
        raise click.BadParameter(f"{op} normalises the last axis; axis {axis} of {len(dims)} is not "
                                 "the last", param_hint="--axis")
    return dims, axis


def _explain_command(op: str):
    @click.option("--shape", required=True, help="Array shape, e.g. 49152,1024.")
    @click.option("--axis", default=-1, show_default=True, type=int, help="Reduced axis.")
    @dtype_option
    @policy_option
    @device_option
    @json_flag
    @source_flag
    def command(shape, axis, dtype, policy, device_name, as_json, source):
        dims, axis = _shape_and_axis(op, shape, axis)
        cols = dims[axis]
        rows = math.prod(dims) // cols
        plan_target = target(device_name)
        entry, dtype_short = OPS[op], dtypes.NAMES[dtype]
        last = axis == len(dims) - 1
        plan = None if last else entry.axis_plan(math.prod(dims[:axis]), cols, math.prod(dims[axis + 1:]),
                                                 dtype_short, policy, plan_target)
        copied = plan is None and not last
        plan = plan or entry.plan(rows, cols, dtype_short, policy, plan_target)
        header = (f"{op} over axis {axis} of {tuple(dims)} {dtype} on {plan_target.facts.name}: "
                  f"rows={rows} cols={cols} policy={policy}")
        if copied:
            header += ("\n  (the reduced axis is not last and the axis kernel does not apply: the input "
                       "is first copied to rows)")
        info = plan.explain()
        info.setdefault("source", "rule")   # a plan of the tuning table says "tuned"
        show_plan(info, header, as_json, jit.render(plan.spec) if source else None)

    command.__doc__ = f"Show the launch plan cupyops picks for {op} on an array of SHAPE."
    return click.command(name=op)(command)


def _compile_command(op: str):
    @dtype_option
    @click.option("--cols", default=DEFAULT_COLS, show_default=True, help="Comma-separated row lengths.")
    @click.option("--rows", default=DEFAULT_ROWS, show_default=True, type=int)
    @click.option("--arch", default="sm_90", show_default=True, type=click.Choice(sorted(ARCH_PROFILES)))
    @policy_option
    def command(dtype, cols, rows, arch, policy):
        plan_target = Target.profile(ARCH_PROFILES[arch])
        compile_and_report((f"cols={num_cols}", arch, lambda num_cols=num_cols: OPS[op].plan(
            rows, num_cols, dtypes.NAMES[dtype], policy, plan_target).spec) for num_cols in int_list(cols))

    command.__doc__ = f"Render and NVRTC-compile every kernel {op}'s plans need (no GPU needed)."
    return click.command(name=op)(command)


def _bench_command(op: str):
    @dtype_option
    @click.option("--rows", default=None, type=int, help=f"Rows of the sweep over --cols  [default: {DEFAULT_ROWS}]")
    @click.option("--cols", default=None, help=f"Comma-separated row lengths  [default: {DEFAULT_COLS}]")
    @click.option("--shape", "shapes", multiple=True,
                  help="Time this shape instead of a sweep over cols (repeatable), e.g. 64,4096,256.")
    @click.option("--axis", default=-1, show_default=True, type=int,
                  help="Reduced axis of every --shape.")
    @click.option("--baseline", default="cupyx,torch,oneflow,copy", show_default=True,
                  help="Providers to compare with: cupyx, torch, oneflow, copy (a device-to-device "
                       "copy moving the op's bytes).")
    @click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Write the table as CSV.")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results as JSON.")
    @plot_option
    def command(dtype, rows, cols, shapes, axis, baseline, csv_path, json_path, plot_path):
        from . import benchmark

        baselines = [name.strip() for name in baseline.split(",") if name.strip()]
        unknown = set(baselines) - set(benchmark.BASELINES)
        if unknown:
            raise click.BadParameter(f"unknown baseline(s) {sorted(unknown)}; "
                                     f"known: {', '.join(benchmark.BASELINES)}", param_hint="--baseline")
        if shapes:
            if rows is not None or cols is not None:
                raise click.UsageError("--shape names whole shapes: give it without --rows and --cols")
            sweep = dict(shapes=[_shape_and_axis(op, shape, axis)[0] for shape in shapes], axis=axis,
                         rows=None)
        else:
            if axis != -1:
                raise click.UsageError("--axis applies to --shape; a sweep over --cols reduces rows")
            rows = DEFAULT_ROWS if rows is None else rows
            if rows < 1:
                raise click.BadParameter(f"rows must be positive, got {rows}", param_hint="--rows")
            cols_list = int_list(DEFAULT_COLS if cols is None else cols)
            if not cols_list or min(cols_list) < 1:
                raise click.BadParameter(f"cols must be positive, got {cols!r}", param_hint="--cols")
            sweep = dict(shapes=[[rows, c] for c in cols_list], axis=-1, rows=rows)
        live_device("bench times the live GPU, and no GPU is usable here")
        result = benchmark.run(op, OPS[op], dtypes.parse_dtype(dtype), baselines=baselines, **sweep)
        benchmark.emit(result, csv_path, json_path, plot_path)

    command.__doc__ = (f"Time {op} against baselines on the live GPU (L2 flushed, copy ceiling measured).\n\n"
                       "Either a sweep over row lengths (--rows, --cols) or the shapes given with --shape, "
                       "each reduced over --axis (softmax ops: any axis, in place; norms: the last).")
    return click.command(name=op)(command)


for _op in OPS:
    explain.add_command(_explain_command(_op))
    compile_.add_command(_compile_command(_op))
    bench.add_command(_bench_command(_op))
