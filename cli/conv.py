"""`explain`, `compile`, `bench` and `tune` for the int8 convolution (conv2d_int8).

Bench figures: TOPS = 2 * GEMM_M * GEMM_N * GEMM_K / median time (L2 flushed),
the fraction of the device's dense int8 peak measured in the same run (the best
of the tensor-core instructions' peak kernels, cupyops.ops.mma_peak), and ratios to torch's float16
conv2d (cuDNN, channels_last, cudnn.benchmark), to torch._int_mm at the
implicit GEMM's shape (N*OH*OW x C*R*S) @ (C*R*S x K), and to policy="megengine"."""
from __future__ import annotations

import csv
import json

import click

from cupyops import jit
from cupyops.device import ARCH_PROFILES
from cupyops.ops import conv2d_int8 as conv
from cupyops.ops import conv_plan
from cupyops.ops import mma_peak
from cupyops.ops.conv_layout import ConvGeometry, pair

from .common import (bench, compile_, compile_and_report, device_option, explain, int_list, json_flag,
                     live_device, show_plan, source_flag, target)
from .common import tune as tune_group

OP = "conv2d_int8"
# (label, N, C, H, W, K, R, S, stride, padding, cuDNN fp16 TFLOPS and torch._int_mm TOPS measured on H100)
LAYERS = {
    "resnet50": [
        ("3x3 64ch@56", 64, 64, 56, 56, 64, 3, 3, 1, 1, 309, 65),
        ("3x3 128ch@28", 64, 128, 28, 28, 128, 3, 3, 1, 1, 452, 115),
        ("3x3 256ch@14", 64, 256, 14, 14, 256, 3, 3, 1, 1, 477, 90),
        ("3x3 512ch@7", 64, 512, 7, 7, 512, 3, 3, 1, 1, 486, 87),
        ("3x3 128ch@56 s2", 64, 128, 56, 56, 128, 3, 3, 2, 1, 354, 115),
        ("1x1 256->64@56", 64, 256, 56, 56, 64, 1, 1, 1, 0, 118, 53),
        ("1x1 1024->256@14", 64, 1024, 14, 14, 256, 1, 1, 1, 0, 332, 86),
    ],
    "others": [
        ("vgg 3x3 256ch@56", 32, 256, 56, 56, 256, 3, 3, 1, 1, 666, 126),
        ("5x5 96->128@28", 32, 96, 28, 28, 128, 5, 5, 1, 2, 461, 102),
        ("7x7 64ch@56", 32, 64, 56, 56, 64, 7, 7, 1, 3, 343, 70),
    ],
}
LAYERS["all"] = LAYERS["resnet50"] + LAYERS["others"]
BASELINES = ("cudnn_fp16", "int_mm", "megengine")


def _layer(entry) -> dict:
    """A layers-table row or a file's record -> {label, geometry, reference figures}."""
    if isinstance(entry, tuple):
        label, n, c, h, w, k, r, s, stride, padding, cudnn, int_mm = entry
        return {"label": label, "geometry": ConvGeometry(n, c, h, w, k, r, s, (stride, stride), (padding, padding)),
                "ref_cudnn_tflops": cudnn, "ref_int_mm_tops": int_mm}
    try:
        geometry = ConvGeometry(*(int(entry[key]) for key in ("n", "c", "h", "w", "k", "r", "s")),
                                pair(_ints(entry.get("stride", 1)), "stride"),
                                pair(_ints(entry.get("padding", 0)), "padding"),
                                pair(_ints(entry.get("dilation", 1)), "dilation"))
    except KeyError as missing:
        raise click.BadParameter(f"a layer lacks {missing}: give n, c, h, w, k, r, s "
                                 "(stride, padding, dilation optional)", param_hint="--layers") from None
    return {"label": entry.get("name") or geometry.key(), "geometry": geometry}


def _ints(value):
    """1, "1" or "2x1" / [2, 1] -> an int or a pair."""
    if isinstance(value, str):
        parts = [int(v) for v in value.replace("x", ",").split(",") if v.strip()]
        return parts[0] if len(parts) == 1 else parts
    return value


def load_layers(name: str) -> list:
    """A named table (resnet50, others, all) or a JSON list / CSV file of layers."""
    if name in LAYERS:
        return [_layer(entry) for entry in LAYERS[name]]
    try:
        with open(name, newline="") as handle:
            records = json.load(handle) if name.endswith(".json") else list(csv.DictReader(handle))
    except OSError as error:
        raise click.BadParameter(f"{name!r} is neither a layer table ({', '.join(LAYERS)}) nor a readable "
                                 f"file: {error}", param_hint="--layers") from None
    return [_layer(record) for record in records]


def _geometry(input_shape: str, filter_shape: str, stride: str, padding: str, dilation: str) -> ConvGeometry:
    n, c, h, w = _four(input_shape, "--input")
    k, c_filter, r, s = _four(filter_shape, "--filter")
    if c_filter != c:
        raise click.BadParameter(f"the filter has {c_filter} input channels, the input {c}", param_hint="--filter")
    geometry = ConvGeometry(n, c, h, w, k, r, s, pair(_ints(stride), "stride"), pair(_ints(padding), "padding"),
                            pair(_ints(dilation), "dilation"))
    try:
        geometry.check()
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return geometry


def _four(text: str, hint: str) -> list:
    dims = int_list(text)
    if len(dims) != 4 or min(dims) < 1:
        raise click.BadParameter(f"expected four positive sizes, got {text!r}", param_hint=hint)
    return dims


policy_option = click.option("--policy", default="auto", show_default=True, type=click.Choice(conv.POLICIES))
layers_option = click.option("--layers", "layers_name", default="resnet50", show_default=True,
                             help=f"A layer table ({', '.join(LAYERS)}) or a JSON / CSV file of layers "
                                  "(n, c, h, w, k, r, s, stride, padding, dilation, name).")


@explain.command(name=OP)
@click.option("--input", "input_shape", required=True, help="N,C,H,W of the input.")
@click.option("--filter", "filter_shape", required=True, help="K,C,R,S of the filter.")
@click.option("--stride", default="1", show_default=True, help="An int or H,W.")
@click.option("--padding", default="0", show_default=True, help="An int or H,W.")
@click.option("--dilation", default="1", show_default=True, help="An int or H,W.")
@policy_option
@device_option
@json_flag
@source_flag
def explain_conv(input_shape, filter_shape, stride, padding, dilation, policy, device_name, as_json, source):
    """Show the plan of conv2d_int8 (tile, warp, stages, instruction, grid, shared memory,
    kernel, and whether it was tuned) for an NCHW input and a KCRS filter."""
    from cupyops import tune

    geometry = _geometry(input_shape, filter_shape, stride, padding, dilation)
    plan_target = target(device_name)
    tuned = None
    if plan_target.device_id is not None and policy == "auto":
        tuned = tune.default_table().lookup(tune.DeviceKey.live(plan_target.device_id), OP, geometry.key())
    chosen = conv_plan.plan(geometry, policy, plan_target, tuned)
    info = {"output": list(geometry.output_shape), **chosen.explain()}
    show_plan(info, f"{OP} input {input_shape} filter {filter_shape} stride {geometry.stride} padding "
                    f"{geometry.padding} dilation {geometry.dilation} on {plan_target.facts.name}",
              as_json, jit.render(chosen.spec) if source else None, source_key="source_code", width=12)


@compile_.command(name=OP)
@click.option("--arch", "archs", multiple=True, type=click.Choice(sorted(ARCH_PROFILES)),
              help="Target arch (repeatable)  [default: every one]")
def compile_conv(archs):
    """NVRTC-compile every configuration the conv2d_int8 generator can produce (both policies,
    wgmma on sm_90 (for sm_90a), the split-K reduction and the int8 peak kernels bench
    measures), with registers, shared memory and spills (no GPU needed)."""
    compile_and_report(((spec.name, arch, lambda spec=spec: spec) for arch in archs or sorted(ARCH_PROFILES)
                        for spec in compiled_specs(arch)), spills_fail=True)


def compiled_specs(arch: str) -> list:
    """What `compile conv2d_int8` compiles for `arch` (the halo tiles of the "all" layers)."""
    geometries = tuple(layer["geometry"] for layer in load_layers("all"))
    return conv_plan.all_specs(arch, geometries) + [conv_plan.SplitReduceSpec()] + mma_peak.peak_specs(arch)


@bench.command(name=OP)
@layers_option
@click.option("--baseline", default=",".join(BASELINES), show_default=True,
              help="cudnn_fp16 (torch conv2d, channels_last, cudnn.benchmark), int_mm (torch._int_mm at "
                   "the GEMM's shape), megengine (policy='megengine').")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results as JSON.")
def bench_conv(layers_name, baseline, json_path):
    """Time conv2d_int8 over a layer table on the live GPU: TOPS, fraction of the int8 peak
    (measured first, per tensor-core instruction), and ratios to cuDNN float16,
    torch._int_mm and the megengine policy."""
    from . import conv_bench

    baselines = [b.strip() for b in baseline.split(",") if b.strip()]
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise click.BadParameter(f"unknown baseline(s) {sorted(unknown)}; known: {', '.join(BASELINES)}",
                                 param_hint="--baseline")
    layers = load_layers(layers_name)
    live_device("bench times the live GPU, and no GPU is usable here")
    result = conv_bench.run(layers, baselines)
    click.echo(conv_bench.format_table(result))
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(result, handle, indent=1)


@tune_group.command(name=OP)
@layers_option
def tune_conv(layers_name):
    """Time every candidate configuration of each layer on the live GPU and keep the winners."""
    import time

    from cupyops import tune

    device_id = live_device("tune times the live GPU, and no GPU is usable here")
    table = tune.default_table()
    for layer in load_layers(layers_name):
        began = time.perf_counter()
        result = conv.tune_shape(layer["geometry"], device_id, table)
        best = result.best
        group = "wgmma warpgroup" if best.get("wgmma") else "mma.sync warp"
        copy = {"filter": " warp-specialised", "im2col": " warp-specialised im2col", "rows": " warp-specialised rows",
                "halo": f" halo p{best.get('halo_pitch')} r{best.get('halo_filter_rows')}"}.get(best.get("tma", ""), "")
        copy += " in pairs" if best.get("cluster", 1) > 1 else ""   # blocks sharing the filter's copies
        click.echo(f"{layer['label']:<20} {best['tile_m']}x{best['tile_n']} {group} {best['warp_m']}x{best['warp_n']} "
                   f"st{best['stages']}{copy} split {best['splits']}: {result.best_us:.1f} us "
                   f"({len(result.timings)} candidates, {time.perf_counter() - began:.1f} s)")
    click.echo(f"kept in {table.path}")
