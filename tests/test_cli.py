"""CPU tests of the `cupyops` command line (click): explain, compile, info, bench."""
from __future__ import annotations

import csv
import json
import math
import re

import pytest
from click.testing import CliRunner
from conftest import GPU

from cupyops.cli.main import main
from cupyops.launch import Target
from cupyops.ops import softmax_axis
from cupyops.ops.softmax import plan

EXPLAIN_KEYS = {"op", "impl", "pack_size", "cols_per_thread", "thread_group_width",
                "rows_per_access", "padding", "block", "grid", "smem_bytes", "kernel", "source"}


def run(*args, **kwargs):
    return CliRunner().invoke(main, list(args), **kwargs)


def explain_json(*args) -> dict:
    result = run("explain", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)        # exactly one JSON object, nothing else


@pytest.mark.parametrize("policy", ["auto", "oneflow"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_explain_json_is_the_plan(op, policy):
    info = explain_json(op, "--shape", "49152,1024", "--device", "h100", "--policy", policy)
    assert set(info) == EXPLAIN_KEYS
    expected = plan(op, 49152, 1024, "f16", policy, Target.profile("h100")).explain()
    assert info == {"source": "rule", **expected}     # "shipped" where the profile's shipped table has the shape
    assert info["op"] == op and info["kernel"].startswith(f"{op}_{info['impl']}_f16_f32_")


def test_explain_default_is_auto_float16():
    info = explain_json("softmax", "--shape", "49152,1024", "--device", "h100")
    assert info["kernel"] == "softmax_warp_f16_f32_p8_c32_g32_r1_nopad"
    assert (info["block"], info["grid"], info["smem_bytes"]) == ([32, 4, 1], [12288, 1, 1], 0)


def test_explain_rows_are_the_other_axes():
    # shape 8 x 1000 x 6, reduced over axis 1: 48 rows of 1000 columns
    info = explain_json("softmax", "--shape", "8,1000,6", "--axis", "1", "--device", "a100",
                        "--dtype", "float32")
    assert info == {**plan("softmax", 48, 1000, "f32", "auto", Target.profile("a100")).explain(), "source": "rule"}
    assert softmax_axis.plan("softmax", 8, 1000, 6, "f32", Target.profile("a100")) is None


@pytest.mark.parametrize("op", ["softmax", "softmax_backward"])
def test_explain_non_last_axis_is_the_axis_kernel(op):
    # (64, 4096, 256) over axis 1: auto reduces it in place; oneflow copies it to 16384 rows
    shape = ("--shape", "64,4096,256", "--axis", "1", "--device", "h200")
    info = explain_json(op, *shape)
    assert info == {**softmax_axis.plan(op, 64, 4096, 256, "f16", Target.profile("h200")).explain(), "source": "rule"}
    assert info["impl"] == "axis" and (info["outer"], info["cols"], info["inner"]) == (64, 4096, 256)
    text = run("explain", op, *shape).output
    assert info["kernel"] in text and "copied" not in text
    text = run("explain", op, *shape, "--policy", "oneflow").output
    assert plan(op, 16384, 4096, "f16", "oneflow", Target.profile("h200")).spec.name in text
    assert "first copied to rows" in text


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm_backward"])
def test_explain_norm_takes_only_the_last_axis(op):
    result = run("explain", op, "--shape", "8,1000,64", "--axis", "1", "--device", "h100")
    assert result.exit_code == 2 and "not the last" in result.output, result.output
    assert explain_json(op, "--shape", "8,1000,64", "--axis", "2", "--device", "h100") == \
        explain_json(op, "--shape", "8000,64", "--device", "h100")


def test_explain_oneflow_warp_limit():
    def impl(op, cols):
        return explain_json(op, "--shape", f"49152,{cols}", "--device", "h100",
                            "--policy", "oneflow")["impl"]

    assert (impl("softmax", 1023), impl("softmax", 1024)) == ("warp", "block_smem")
    assert (impl("log_softmax", 1023), impl("log_softmax", 1024)) == ("warp", "warp")
    assert impl("log_softmax", 1025) == "block_smem"


def test_explain_human_readable():
    result = run("explain", "softmax", "--shape", "64,3000", "--device", "h100", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    kernel = plan("softmax", 64, 3000, "bf16", "auto", Target.profile("h100")).spec.name
    assert "rows=64 cols=3000" in result.output and kernel in result.output


@pytest.mark.parametrize("as_json", [False, True])
def test_explain_source(as_json):
    args = ["explain", "log_softmax", "--shape", "64,4096", "--device", "h100", "--source"]
    result = run(*args, *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    kernel = plan("log_softmax", 64, 4096, "f16", "auto", Target.profile("h100")).spec.name
    source = json.loads(result.stdout)["source"] if as_json else result.output
    assert re.search(rf'extern "C" __global__ void __launch_bounds__\(\d+\)\s*{kernel}\(', source)


@pytest.mark.parametrize("args, message", [
    (["--shape", "0,5"], "positive"),
    (["--shape", "4,-5"], "positive"),
    (["--shape", "4,x"], "integers"),
    (["--shape", ""], "positive"),
    (["--shape", "4,5", "--axis", "2"], "out of range"),
    (["--shape", "4,5", "--axis", "-3"], "out of range"),
    (["--shape", "4,5", "--dtype", "int8"], "int8"),
    (["--shape", "4,5", "--device", "h300"], "h300"),
], ids=["zero", "negative", "not-int", "empty", "axis", "negative-axis", "dtype", "device"])
def test_explain_bad_arguments(args, message):
    result = run("explain", "softmax", *args, "--device", "h100") if "--device" not in args \
        else run("explain", "softmax", *args)
    assert result.exit_code == 2, result.output           # click's usage error
    assert message in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


@pytest.mark.skipif(GPU, reason="a GPU is present: explain plans for it without --device")
def test_explain_without_gpu_needs_device():
    result = run("explain", "softmax", "--shape", "49152,1024")
    assert result.exit_code == 2, result.output
    assert "--device" in result.output
    assert isinstance(result.exception, SystemExit)


@pytest.mark.gpu
def test_explain_live_gpu():
    import cupy

    result = run("explain", "softmax", "--shape", "49152,1024", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    expected = plan("softmax", 49152, 1024, "f16", "auto", Target.live(cupy.cuda.runtime.getDevice())).explain()
    assert info == {"source": "rule", **expected}     # "tuned" or "shipped" where a table gave the plan


def test_compile_lists_the_kernels():
    result = run("compile", "softmax", "--dtype", "float16", "--cols", "32,1024,4096",
                 "--arch", "sm_80")
    assert result.exit_code == 0, result.output
    target = Target.profile("a100")
    names = [plan("softmax", 49152, cols, "f16", "auto", target).spec.name for cols in (32, 1024, 4096)]
    assert len(set(names)) == 3
    for name in names:
        assert name in result.output
    assert "3 kernels compiled for sm_80, 0 failed" in result.output


def test_compile_oneflow_dedupes():
    # 2048 and 4096 columns of float32 may share one OneFlow shared-memory kernel: listed once
    result = run("compile", "softmax", "--dtype", "float32", "--cols", "2048,4096",
                 "--arch", "sm_90", "--policy", "oneflow")
    assert result.exit_code == 0, result.output
    target = Target.profile("h100")
    names = {plan("softmax", 49152, cols, "f32", "oneflow", target).spec.name for cols in (2048, 4096)}
    assert f"{len(names)} kernels compiled for sm_90, 0 failed" in result.output


def test_compile_bad_cols():
    result = run("compile", "softmax", "--cols", "32,abc")
    assert result.exit_code == 2 and "integers" in result.output


def test_info_prints_the_cache(tmp_path):
    (tmp_path / "kernel.cubin").write_bytes(b"\0" * 2048)
    result = run("info", env={"CUPY_CACHE_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert str(tmp_path) in result.output and "1 files" in result.output
    assert "cupy" in result.output and "nvrtc" in result.output
    if not GPU:
        assert "none (no usable GPU)" in result.output


@pytest.mark.skipif(GPU, reason="a GPU is present: bench would run")
@pytest.mark.parametrize("args", [["--cols", "32"], ["--shape", "4,96,64", "--axis", "1"]],
                         ids=["cols", "shape"])
def test_bench_without_gpu_fails_cleanly(args):
    result = run("bench", "softmax", *args, "--baseline", "cupyx")
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception   # no uncaught error
    assert "Traceback" not in result.output
    assert "no GPU is usable" in result.output


@pytest.mark.parametrize("op, args, message", [
    ("softmax", ["--baseline", "tensorflow"], "tensorflow"),
    ("softmax", ["--shape", "64,4096,256", "--cols", "32"], "without --rows and --cols"),
    ("softmax", ["--shape", "64,4096,256", "--rows", "8"], "without --rows and --cols"),
    ("softmax", ["--axis", "0"], "--axis applies to --shape"),
    ("softmax", ["--shape", "64,0,256"], "positive"),
    ("softmax", ["--shape", "64,4096", "--shape", "8,64,4096", "--axis", "2"], "out of range"),
    ("softmax", ["--cols", "32,0"], "positive"),
    ("softmax", ["--rows", "0"], "positive"),
    ("rms_norm", ["--shape", "64,4096,256", "--axis", "1"], "not the last"),
], ids=["baseline", "shape-and-cols", "shape-and-rows", "axis-alone", "shape-zero",
        "axis-of-one-shape", "cols-zero", "rows-zero", "norm-axis"])
def test_bench_bad_arguments(op, args, message):
    result = run("bench", op, *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def _bench_result(**over) -> dict:
    point = {"shape": [64, 256], "cols": 256, "bytes": 4_000_000, "compile_s": 0.5,
             "cupyops": {"us": 2.0, "reps": 10, "gbs": 2000.0},
             "torch": {"us": 3.0, "reps": 10, "gbs": 1333.3},
             "copy": {"us": 1.6, "reps": 10, "gbs": 2500.0}}
    result = {"op": "softmax", "dtype": "float16", "rows": 64, "axis": -1, "device": "GPU",
              "copy_gbs": 4000.0, "baselines": ["torch", "copy"], "notes": [], "points": [point]}
    point.update(over.pop("point", {}))
    return {**result, **over}


def test_bench_table_gives_each_baseline_as_a_speedup():
    from cupyops.cli import benchmark

    title, header, row = benchmark.format_table(_bench_result()).splitlines()
    assert title.startswith("softmax float16 rows=64 on GPU")
    assert header.split() == ["cols", "us", "GB/s", "copy", "xtorch", "xcopy", "compile", "s"]
    assert row.split() == ["256", "2.0", "2000", "50.0%", "1.50", "0.80", "0.50"]


def test_bench_table_names_shapes_and_axis(tmp_path):
    from cupyops.cli import benchmark

    result = _bench_result(rows=None, axis=1, point={"shape": [64, 4096, 256], "cols": 4096})
    title, header, row = benchmark.format_table(result).splitlines()
    assert title.startswith("softmax float16 axis=1 on GPU")
    assert header.split()[0] == "shape" and row.split()[:2] == ["64x4096x256", "2.0"]
    path = tmp_path / "bench.csv"
    benchmark.write_csv(result, str(path))
    (line,) = csv.DictReader(path.open())
    assert (line["shape"], line["cols"], line["axis"], line["rows"]) == ("64x4096x256", "4096", "1", "")
    assert float(line["x_torch"]) == 1.5


@pytest.mark.gpu
def test_bench_times_a_copy_of_the_same_bytes(tmp_path):
    path = tmp_path / "bench.json"
    result = run("bench", "softmax_backward", "--rows", "64", "--cols", "96", "--dtype", "float32",
                 "--baseline", "copy", "--json", str(path))
    assert result.exit_code == 0, result.output
    assert "xcopy" in result.output
    (point,) = json.loads(path.read_text())["points"]
    assert point["bytes"] == 3 * 64 * 96 * 4 and point["shape"] == [64, 96]
    assert point["copy"]["us"] > 0 and point["copy"]["gbs"] == pytest.approx(point["bytes"] / point["copy"]["us"] / 1e3)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["softmax", "softmax_backward"])
def test_bench_times_a_shape_over_an_axis(tmp_path, op):
    pytest.importorskip("torch", reason="the torch baseline needs torch")
    path = tmp_path / "bench.json"
    result = run("bench", op, "--shape", "4,96,64", "--shape", "2,3,40,32", "--axis", "-2",
                 "--dtype", "float32", "--baseline", "copy,torch", "--json", str(path))
    assert result.exit_code == 0, result.output
    assert "axis=-2" in result.output and "4x96x64" in result.output and "2x3x40x32" in result.output
    saved = json.loads(path.read_text())
    assert (saved["rows"], saved["axis"]) == (None, -2)
    arrays = 3 if op.endswith("_backward") else 2
    for point, shape in zip(saved["points"], ([4, 96, 64], [2, 3, 40, 32])):
        assert point["shape"] == shape and point["cols"] == shape[-2]
        assert point["bytes"] == arrays * math.prod(shape) * 4
        assert point["cupyops"]["us"] > 0 and point["copy"]["us"] > 0
        assert point["torch"]["us"] > 0      # torch's op over the same axis


def test_help_lists_the_commands():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("explain", "compile", "bench", "info"):
        assert command in result.output


def test_conv_bench_table_gives_ratios_and_names_each_layers_kernel():
    """A line per layer: µs, TOPS, the fraction of the measured peak, each baseline as a
    speedup; then the kernel policy="auto" launched for each layer, with its split of GEMM_K."""
    from cli import conv_bench

    point = {"label": "1x1 256->64@56", "gemm_mnk": [64, 200704, 256], "ops": 1, "first_call_s": 0.25,
             "kernel": "conv2d_int8_fprop_sm90a_wgmma_x (split-K 2)",
             "cupyops": {"us": 10.0, "tops": 500.0}, "cudnn_fp16": {"us": 15.0, "tops": 250.0}}
    result = {"device": "GPU", "int8_peak_tops": 2000.0, "int8_peak_tops_by_instruction": {"wgmma": 2000.0},
              "baselines": ["cudnn_fp16"], "points": [point]}
    title, header, row, footer, kernel = conv_bench.format_table(result).splitlines()
    assert title.startswith("conv2d_int8 on GPU; int8 dense peak 2000 TOPS")
    assert header.split() == ["layer", "us", "TOPS", "peak", "xcudnn_fp16", "first", "s"]
    assert row.split() == ["1x1", "256->64@56", "10.0", "500", "25.0%", "2.00", "0.25"]
    assert footer == "kernels (policy auto):"
    assert kernel.split(None, 2) == ["1x1", "256->64@56", "conv2d_int8_fprop_sm90a_wgmma_x (split-K 2)"]
