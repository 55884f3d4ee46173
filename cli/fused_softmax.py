"""`explain`, `compile`, `bench` and `tune` for the fused attention softmax (fused_softmax,
fused_softmax_backward) on scores of shape B,H,Sq,Sk with a broadcast mask and bias,
the causal rule and dropout."""
from __future__ import annotations

import json
import math

import click
import numpy

from cupyops import dtypes, jit
from cupyops.device import ARCH_PROFILES
from cupyops.launch import Target
from cupyops.ops import fused_softmax as fs, fused_softmax_operands

from .common import (bench, compile_, compile_and_report, device_option, dtype_option, echo_tuned, explain,
                     json_flag, live_device, plot_option, policy_option, positive_shape, source_flag, target)
from .common import tune as tune_group

OPS = {"fused_softmax": "forward", "fused_softmax_backward": "backward"}   # the stage each op runs
DEFAULT_SHAPES = ("8,16,128,128", "8,16,512,512", "8,16,1024,1024", "4,16,4096,4096", "1,4,16384,16384")
BASELINES = ("torch", "torch_compile", "oneflow", "copy")


def fusion_options(command):
    for option in reversed([
            click.option("--mask-shape", default=None, help="Bool mask shape broadcast to the scores, e.g. 8,1,1,1024."),
            click.option("--bias-shape", default=None, help="Bias shape broadcast to the scores, e.g. 16,1024,1024."),
            click.option("--bias-dtype", default=None, type=click.Choice(sorted(dtypes.NAMES)),
                         help="Bias dtype  [default: --dtype]"),
            click.option("--causal", is_flag=True, help="Drop col > row + diagonal."),
            click.option("--diagonal", default=0, show_default=True, type=int),
            click.option("--dropout", default=0.0, show_default=True, type=float)]):
        command = option(command)
    return command


def _fusion(dtype, mask_shape, bias_shape, bias_dtype, causal, dropout, x_dims) -> fs.Fusion:
    operand_dims = {}
    for name, text in (("--mask-shape", mask_shape), ("--bias-shape", bias_shape)):
        if text is not None:
            dims = positive_shape(text, name)
            try:
                if tuple(numpy.broadcast_shapes(dims, x_dims)) != tuple(x_dims):
                    raise ValueError
            except ValueError:
                raise click.BadParameter(f"{text} does not broadcast to {x_dims}", param_hint=name) from None
            operand_dims[name] = (1,) * (len(x_dims) - len(dims)) + tuple(dims)
    if not 0 <= dropout < 1:
        raise click.BadParameter(f"dropout must be in [0, 1), got {dropout}", param_hint="--dropout")
    bias_short = dtypes.NAMES[bias_dtype or dtype] if bias_shape is not None else ""
    if bias_short in ("f16", "bf16") and dtypes.NAMES[dtype] == "f64":
        bias_short = "f64"   # fused_softmax converts it
    bias_dims, mask_dims = operand_dims.get("--bias-shape"), operand_dims.get("--mask-shape")
    layout = fused_softmax_operands.geometry(tuple(x_dims), bias_dims, mask_dims, 1, 0)
    if layout is None:   # fused_softmax reads them expanded to x's shape
        bias_dims, mask_dims = (None if dims is None else tuple(x_dims) for dims in (bias_dims, mask_dims))
        layout = fused_softmax_operands.geometry(tuple(x_dims), bias_dims, mask_dims, 1, 0)
    # fresh operands' addresses: CuPy's allocations are 256-byte aligned
    return fused_softmax_operands.with_layout(
        fs.Fusion(bias_short, mask_shape is not None, causal, dropout > 0), layout,
        *((None, 0, 0) if bias_dims is None else (0, dtypes.BY_SHORT[bias_short].itemsize, math.prod(bias_dims))),
        *((None, 0) if mask_dims is None else (0, math.prod(mask_dims))))


def _plan(op, dims, dtype, policy, plan_target, fusion):
    rows, cols = math.prod(dims[:-1]), dims[-1]
    return fs.plan(OPS[op], rows, cols, dtypes.NAMES[dtype], policy, plan_target, fusion)


def _explain_command(op: str):
    @click.option("--shape", required=True, help="Scores shape, e.g. 8,16,1024,1024 (B,H,Sq,Sk).")
    @fusion_options
    @dtype_option
    @policy_option
    @device_option
    @json_flag
    @source_flag
    def command(shape, mask_shape, bias_shape, bias_dtype, causal, diagonal, dropout, dtype, policy, device_name,
                as_json, source):
        dims = positive_shape(shape)
        fusion = _fusion(dtype, mask_shape, bias_shape, bias_dtype, causal, dropout, dims)
        plan_target = target(device_name)
        plan = _plan(op, dims, dtype, policy, plan_target, fusion)
        info = plan.explain()
        grouped = fs.grouped_variant(plan.spec, plan_target)
        if grouped is not None:   # what calls whose offset is a multiple of 8 run
            info["kernel_offset_8"] = grouped.name
        if as_json:
            if source:
                info["source"] = jit.render(plan.spec)
            click.echo(json.dumps(info))
            return
        click.echo(f"{op} of {tuple(dims)} {dtype} policy={policy} fusion={fusion}")
        click.echo(f" {info['stage']}:")
        for key, value in info.items():
            click.echo(f"  {key:<20} {value}")
        if source:
            click.echo(jit.render(plan.spec))

    command.__doc__ = f"Show the launch plan cupyops picks for {op} on scores of SHAPE."
    return click.command(name=op)(command)


def _compile_command(op: str):
    @click.option("--shape", "shapes", multiple=True, help="Scores shape (repeatable)  [default: a sweep of S]")
    @fusion_options
    @dtype_option
    @policy_option
    @click.option("--arch", default="sm_90", show_default=True, type=click.Choice(sorted(ARCH_PROFILES)))
    def command(shapes, mask_shape, bias_shape, bias_dtype, causal, diagonal, dropout, dtype, policy, arch):
        plan_target = Target.profile(ARCH_PROFILES[arch])

        def kernels():
            for shape in shapes or DEFAULT_SHAPES:
                dims = positive_shape(shape)
                fusion = _fusion(dtype, mask_shape, bias_shape, bias_dtype, causal, dropout, dims)
                plan = _plan(op, dims, dtype, policy, plan_target, fusion)
                yield shape, arch, lambda plan=plan: plan.spec
                grouped = fs.grouped_variant(plan.spec, plan_target)
                if grouped is not None:   # run by calls whose offset is a multiple of 8
                    yield shape, arch, lambda grouped=grouped: grouped
        compile_and_report(kernels())

    command.__doc__ = f"Render and NVRTC-compile every kernel {op}'s plans need (no GPU needed)."
    return click.command(name=op)(command)


def _bench_command(op: str):
    @click.option("--shape", "shapes", multiple=True, help="Scores shape (repeatable)  [default: a sweep of S]")
    @fusion_options
    @dtype_option
    @click.option("--baseline", default=",".join(BASELINES), show_default=True,
                  help="torch (eager), torch_compile, oneflow (policy='oneflow'), copy.")
    @click.option("--return-lse", is_flag=True, hidden=op != "fused_softmax",
                  help="The forward also returns each row's log-sum-exp (torch: torch.logsumexp), as in training.")
    @click.option("--csv", "csv_path", type=click.Path(dir_okay=False))
    @click.option("--json", "json_path", type=click.Path(dir_okay=False))
    @plot_option
    def command(shapes, mask_shape, bias_shape, bias_dtype, causal, diagonal, dropout, dtype, baseline, return_lse,
                csv_path, json_path, plot_path):
        from . import benchmark, fused_softmax_providers as providers

        baselines = [name.strip() for name in baseline.split(",") if name.strip()]
        unknown = set(baselines) - set(BASELINES)
        if unknown:
            raise click.BadParameter(f"unknown baseline(s) {sorted(unknown)}", param_hint="--baseline")
        if return_lse and op != "fused_softmax":
            raise click.BadParameter("the backward reads the lse; only fused_softmax returns it",
                                     param_hint="--return-lse")
        numpy_dtype = dtypes.parse_dtype(dtype)
        bias_numpy = dtypes.parse_dtype(bias_dtype) if bias_dtype else numpy_dtype
        points = []
        for shape in shapes or DEFAULT_SHAPES:
            dims = positive_shape(shape)
            _fusion(dtype, mask_shape, bias_shape, bias_dtype, causal, dropout, dims)
            case = providers.Case(op, tuple(dims), numpy_dtype, mask_shape and tuple(positive_shape(mask_shape)),
                                  bias_shape and tuple(positive_shape(bias_shape)), bias_numpy, causal, diagonal,
                                  dropout, return_lse)
            points.append((dims, dims[-1], case.bytes_moved(),
                           lambda case=case: providers.make(case, baselines)))
        live_device("bench times the live GPU, and no GPU is usable here")
        result = benchmark.time_points(f"{op} {numpy_dtype.name}", numpy_dtype, points, baselines)
        benchmark.emit({"op": op, "rows": None, "axis": -1, **result}, csv_path, json_path, plot_path)

    command.__doc__ = (f"Time {op} against torch eager, torch.compile, the oneflow policy and a copy of its "
                       "bytes (x and y; dy, x and dx backward; mask and bias once each at their own size; "
                       "the float32 lse).")
    return click.command(name=op)(command)


for _op in OPS:
    explain.add_command(_explain_command(_op))
    compile_.add_command(_compile_command(_op))
    bench.add_command(_bench_command(_op))


@tune_group.command(name="fused_softmax")
@click.option("--shape", "shapes", multiple=True, help="Scores shape (repeatable)  [default: a sweep of S]")
@fusion_options
@dtype_option
@click.option("--stage", "stages", default="forward,backward", show_default=True,
              help="Comma-separated stages: forward, backward.")
def tune_fused_softmax(shapes, mask_shape, bias_shape, bias_dtype, causal, diagonal, dropout, dtype, stages):
    """Time every candidate plan of the fused softmax's stages on the live GPU (each checked against
    the oneflow policy's result first) and keep the fastest in the tuning table, which
    policy="auto" then plans those shapes and fusions from."""
    from cupyops import tune
    from cupyops.ops import fused_softmax_tune

    stage_list = [stage.strip() for stage in stages.split(",") if stage.strip()]
    if not stage_list or set(stage_list) - {"forward", "backward"}:
        raise click.BadParameter(f"stages are forward and backward, got {stages!r}", param_hint="--stage")
    dims_list = [positive_shape(shape) for shape in shapes or DEFAULT_SHAPES]
    for dims in dims_list:
        _fusion(dtype, mask_shape, bias_shape, bias_dtype, causal, dropout, dims)
    device_id = live_device("tune times the live GPU, and no GPU is usable here")
    short, bias_short = dtypes.NAMES[dtype], bias_dtype and dtypes.NAMES[bias_dtype]
    operands = dict(mask_shape=mask_shape and tuple(positive_shape(mask_shape)),
                    bias_shape=bias_shape and tuple(positive_shape(bias_shape)), bias_dtype=bias_short)
    table = tune.default_table()
    for dims in dims_list:
        for stage in stage_list:
            click.echo(f"fused_softmax {stage} {dtype} {'x'.join(map(str, dims))}")
            tuned = fused_softmax_tune.tune_shape(stage, tuple(dims), short, device_id, causal=causal,
                                                  diagonal=diagonal, dropout=dropout, table=table, **operands)
            echo_tuned(tuned, fused_softmax_tune.moved_bytes(stage, tuple(dims), short, **operands))
    click.echo(f"tuning table: {table.path}")
