"""CPU tests of `cupyops explain / compile / bench` for fused_softmax and fused_softmax_backward."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import GPU

from cupyops.cli.main import main


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("op, stage", [("fused_softmax", "forward"), ("fused_softmax_backward", "backward")])
def test_explain_json_names_the_kernel_and_its_path(op, stage):
    result = run("explain", op, "--shape", "4,8,1000,1000", "--mask-shape", "4,1,1,1000", "--bias-shape",
                 "8,1000,1000", "--causal", "--dropout", "0.1", "--device", "h100", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["stage"] == stage and info["kernel"].startswith("fused_softmax")
    assert info["fusion"] == "scale_biasf16v_maskw_causal_drop"   # fresh operands: aligned packs
    assert info["impl"] in ("warp", "block_regs", "block_smem", "block_uncached")
    # packs of 8 in rows of 1000: calls at offsets that are multiples of 8 run the grouped kernel
    assert info["kernel_offset_8"] == info["kernel"].replace("_drop", "_drop8")


def test_explain_human_readable_and_source():
    result = run("explain", "fused_softmax", "--shape", "2,2,128,128", "--causal", "--device", "a100", "--source")
    assert result.exit_code == 0, result.output
    assert "forward:" in result.output and "ScoresLoad" in result.output and "impl" in result.output


def test_compile_lists_the_kernels():
    """The plan's kernel and, with dropout on packs of 8, its grouped variant."""
    result = run("compile", "fused_softmax_backward", "--shape", "2,4,256,256", "--dropout", "0.2",
                 "--mask-shape", "256", "--arch", "sm_80")
    assert result.exit_code == 0, result.output
    assert "fused_softmax_backward_" in result.output and "2 kernels compiled for sm_80, 0 failed" in result.output
    assert "_maskw_drop8" in result.output
    result = run("compile", "fused_softmax", "--shape", "2,4,256,256", "--causal", "--arch", "sm_80")
    assert result.exit_code == 0 and "1 kernels compiled for sm_80, 0 failed" in result.output, result.output


@pytest.mark.parametrize("args, message", [
    (["--shape", "2,4,8,8", "--mask-shape", "3,8"], "does not broadcast"),
    (["--shape", "2,4,8,8", "--bias-shape", "2,5,8,8"], "does not broadcast"),
    (["--shape", "2,4,8,8", "--dropout", "1.0"], "dropout"),
    (["--shape", "2,0,8,8"], "positive"),
])
def test_bad_arguments(args, message):
    result = run("explain", "fused_softmax", *args, "--device", "h100")
    assert result.exit_code == 2 and message in result.output, result.output
    result = run("bench", "fused_softmax", *args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.skipif(GPU, reason="checks the message given where no GPU is usable")
def test_bench_without_gpu_fails_cleanly():
    result = run("bench", "fused_softmax", "--shape", "2,4,128,128", "--causal")
    assert result.exit_code == 2 and "no GPU is usable" in result.output, result.output


def test_bench_unknown_baseline():
    result = run("bench", "fused_softmax_backward", "--baseline", "tensorflow")
    assert result.exit_code == 2 and "tensorflow" in result.output


def test_bench_return_lse_only_forward():
    result = run("bench", "fused_softmax_backward", "--return-lse")
    assert result.exit_code == 2 and "only fused_softmax returns it" in result.output


def test_bench_counts_the_lse_written():
    import dataclasses

    import numpy

    from cupyops.cli.fused_softmax_providers import Case

    case = Case("fused_softmax", (2, 3, 5, 8), numpy.dtype(numpy.float16), None, None, numpy.dtype(numpy.float16),
                False, 0, 0.0)
    with_lse = dataclasses.replace(case, return_lse=True)
    assert case.bytes_moved() == 2 * 240 * 2 and with_lse.bytes_moved() == case.bytes_moved() + 30 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("op, extra", [("fused_softmax", []), ("fused_softmax", ["--return-lse"]),
                                       ("fused_softmax_backward", [])])
def test_bench_runs(op, extra):
    result = run("bench", op, "--shape", "2,4,256,256", "--mask-shape", "2,1,1,256", "--dropout", "0.1",
                 "--baseline", "oneflow,copy,torch,torch_compile", *extra)
    assert result.exit_code == 0, result.output
    assert "xoneflow" in result.output and "xcopy" in result.output
