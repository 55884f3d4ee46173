"""cupyops command line: explain, compile, bench, info."""
from __future__ import annotations

import json
import math
import os
import sys

import click

from cupyops import dtypes, jit
from cupyops.device import ARCH_PROFILES, PROFILES
from cupyops.launch import Target

from .ops import OPS

DEFAULT_ROWS = 49152
DEFAULT_COLS = "32,64,128,256,512,1000,1024,1536,2048,3000,4096,8192,12345,16384,32768"


def _int_list(text: str) -> list:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def _shape_and_axis(op: str, shape: str, axis: int) -> tuple:
    """--shape and --axis checked: (dims, axis counted from the front)."""
    dims = _int_list(shape)
    if not dims or any(d < 1 for d in dims):
        raise click.BadParameter(f"shape needs positive sizes, got {shape!r}", param_hint="--shape")
    if not -len(dims) <= axis < len(dims):
        raise click.BadParameter(f"axis {axis} is out of range for {len(dims)} dimensions",
                                 param_hint="--axis")
    axis %= len(dims)
    if axis != len(dims) - 1 and OPS[op].axis_plan is None:
        raise click.BadParameter(f"{op} normalises the last axis; axis {axis} of {len(dims)} is not "
                                 "the last", param_hint="--axis")
    return dims, axis


def _live_device(no_gpu_message: str) -> int:
    """The current device's id, or a usage error saying no_gpu_message where no GPU is usable."""
    import cupy

    if not cupy.is_available():
        raise click.UsageError(no_gpu_message)
    return cupy.cuda.runtime.getDevice()


def _target(device_name):
    if device_name is not None:
        return Target.profile(device_name)
    return Target.live(_live_device("no GPU here: name a device profile with --device "
                                    f"({', '.join(PROFILES)})"))


op_argument = click.argument("op", type=click.Choice(sorted(OPS)))
dtype_option = click.option("--dtype", default="float16", show_default=True,
                            type=click.Choice(sorted(dtypes.NAMES)))
policy_option = click.option("--policy", default="auto", show_default=True,
                             type=click.Choice(["auto", "oneflow"]))


@click.group()
@click.version_option(package_name="cupyops", message="cupyops %(version)s")
def main():
    """Fused GPU kernels for CuPy arrays."""


@main.command()
@op_argument
@click.option("--shape", required=True, help="Array shape, e.g. 49152,1024.")
@click.option("--axis", default=-1, show_default=True, type=int, help="Reduced axis.")
@dtype_option
@policy_option
@click.option("--device", "device_name", type=click.Choice(sorted(PROFILES)), default=None,
              help="Plan for a device profile (no GPU needed) instead of the live GPU.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--source", is_flag=True, help="Also print the rendered CUDA source.")
def explain(op, shape, axis, dtype, policy, device_name, as_json, source):
    """Show the launch plan cupyops picks for OP on an array of SHAPE."""
    dims, axis = _shape_and_axis(op, shape, axis)
    cols = dims[axis]
    rows = math.prod(dims) // cols
    target = _target(device_name)
    entry, dtype_short = OPS[op], dtypes.NAMES[dtype]
    last = axis == len(dims) - 1
    plan = None if last else entry.axis_plan(math.prod(dims[:axis]), cols, math.prod(dims[axis + 1:]),
                                             dtype_short, policy, target)
    copied = plan is None and not last
    plan = plan or entry.plan(rows, cols, dtype_short, policy, target)
    info = plan.explain()
    if as_json:
        if source:
            info["source"] = jit.render(plan.spec)
        click.echo(json.dumps(info))
        return
    click.echo(f"{op} over axis {axis} of {tuple(dims)} {dtype} on {target.facts.name}: "
               f"rows={rows} cols={cols} policy={policy}")
    if copied:
        click.echo("  (the reduced axis is not last and the axis kernel does not apply: the input "
                   "is first copied to rows)")
    for key, value in info.items():
        click.echo(f"  {key:<20} {value}")
    if source:
        click.echo(jit.render(plan.spec))


@main.command(name="compile")
@op_argument
@dtype_option
@click.option("--cols", default=DEFAULT_COLS, show_default=True, help="Comma-separated row lengths.")
@click.option("--rows", default=DEFAULT_ROWS, show_default=True, type=int)
@click.option("--arch", default="sm_90", show_default=True, type=click.Choice(sorted(ARCH_PROFILES)))
@policy_option
def compile_(op, dtype, cols, rows, arch, policy):
    """Render and NVRTC-compile every kernel the plans need (no GPU needed)."""
    target = Target.profile(ARCH_PROFILES[arch])
    failures = 0
    seen = set()
    click.echo(f"{'kernel':<58} {'regs':>5} {'smem':>6} {'spill':>6} {'stack':>6}")
    for num_cols in _int_list(cols):
        try:
            spec = OPS[op].plan(rows, num_cols, dtypes.NAMES[dtype], policy, target).spec
            if spec in seen:
                continue
            seen.add(spec)
            report = jit.compile_cubin(spec, arch)
        except jit.CompileError as error:
            failures += 1
            click.echo(f"FAILED cols={num_cols}: {error}", err=True)
            continue
        click.echo(f"{report.name:<58} {report.registers:>5} {report.smem_bytes:>6} "
                   f"{report.spill_bytes:>6} {report.stack_bytes:>6}")
    click.echo(f"{len(seen)} kernels compiled for {arch}, {failures} failed")
    if failures:
        sys.exit(1)


@main.command()
@op_argument
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
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG plot.")
def bench(op, dtype, rows, cols, shapes, axis, baseline, csv_path, json_path, plot_path):
    """Time OP against baselines on the live GPU (L2 flushed, copy ceiling measured).

    Either a sweep over row lengths (--rows, --cols) or the shapes given with --shape, each
    reduced over --axis (softmax ops: any axis, in place; norms: the last)."""
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
        cols_list = _int_list(DEFAULT_COLS if cols is None else cols)
        if not cols_list or min(cols_list) < 1:
            raise click.BadParameter(f"cols must be positive, got {cols!r}", param_hint="--cols")
        sweep = dict(shapes=[[rows, c] for c in cols_list], axis=-1, rows=rows)
    _live_device("bench times the live GPU, and no GPU is usable here")
    result = benchmark.run(op, OPS[op], dtypes.parse_dtype(dtype), baselines=baselines, **sweep)
    click.echo(benchmark.format_table(result))
    if csv_path:
        benchmark.write_csv(result, csv_path)
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(result, handle, indent=1)
    if plot_path:
        benchmark.plot(result, plot_path)


@main.command()
def info():
    """Device, CuPy / CUDA / NVRTC versions, kernel cache location and size."""
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    click.echo(f"cupyops       {__import__('cupyops').__version__} (kernels/ {jit.headers_fingerprint()})")
    click.echo(f"cupy          {cupy.__version__}")
    try:
        click.echo(f"nvrtc         {'.'.join(map(str, nvrtc.getVersion()))}")
    except Exception as error:  # NVRTC missing
        click.echo(f"nvrtc         unavailable ({error})")
    if cupy.is_available():
        from cupyops.device import live_facts

        device_id = cupy.cuda.runtime.getDevice()
        facts = live_facts(device_id)
        click.echo(f"device        {device_id}: {facts.name} ({facts.arch}, {facts.sm_count} SMs, "
                   f"L2 {facts.l2_bytes >> 20} MiB)")
        click.echo(f"cuda runtime  {cupy.cuda.runtime.runtimeGetVersion()}")
        click.echo(f"cuda driver   {cupy.cuda.runtime.driverGetVersion()}")
    else:
        click.echo("device        none (no usable GPU)")
    cache_dir = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    size = count = 0
    for root, _, files in os.walk(cache_dir):
        for name in files:
            count += 1
            size += os.path.getsize(os.path.join(root, name))
    click.echo(f"kernel cache  {cache_dir} ({count} files, {size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
