"""CPU tests of `cupyops bench --plot`: the figure drawn from a result, the PNG written, and the
usage error where matplotlib is missing."""
from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from cupyops.cli import benchmark
from cupyops.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _result(rows=49152) -> dict:
    """A sweep over cols (rows given) or over shapes (rows None), as benchmark.time_points returns it."""
    points = []
    for cols, ours, torch, copy in [(128, 2376.0, 1550.0, 3900.0), (1024, 3811.0, 2430.0, 4150.0),
                                    (8192, 4100.0, 1073.0, 4200.0)]:
        points.append({"shape": [rows or 64, cols], "cols": cols, "bytes": 2 * (rows or 64) * cols * 2,
                       "compile_s": 0.1, "cupyops": {"us": 1.0, "reps": 10, "gbs": ours},
                       "torch": {"us": 1.5, "reps": 10, "gbs": torch}, "copy": {"us": 0.9, "reps": 10, "gbs": copy}})
    return {"op": "softmax", "rows": rows, "axis": -1, "dtype": "float16", "device": "NVIDIA Test GPU",
            "copy_gbs": 4230.0, "baselines": ["torch", "copy"], "notes": [], "points": points}


def test_figure_has_a_line_per_provider_and_the_copy_ceiling():
    pytest.importorskip("matplotlib")
    (axes,) = benchmark.figure(_result()).axes
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert list(lines) == ["cupyops", "torch", "copy of the same bytes", "copy ceiling (1 GiB)"]
    assert list(lines["cupyops"].get_xdata()) == [128, 1024, 8192]
    assert list(lines["torch"].get_ydata()) == [1550.0, 2430.0, 1073.0]
    ceiling = lines["copy ceiling (1 GiB)"]
    assert ceiling.get_linestyle() == "--" and set(ceiling.get_ydata()) == {4230.0}
    assert axes.get_ylim()[0] == 0
    assert axes.get_xscale() == "log" and axes.get_xlabel() == "cols" and axes.get_ylabel() == "GB/s"
    title = axes.get_title()
    assert "softmax" in title and "float16" in title and "NVIDIA Test GPU" in title and "rows=49152" in title


def test_figure_of_shapes_labels_each_shape():
    pytest.importorskip("matplotlib")
    result = _result(rows=None)
    (axes,) = benchmark.figure(result).axes
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["64x128", "64x1024", "64x8192"]
    assert axes.get_xlabel() == "shape" and "axis=-1" in axes.get_title()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "bench.png"
    benchmark.plot(_result(), str(path))
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = imread(path).shape
    assert (width, height) == (960, 540)        # 8 x 4.5 inches at 120 dpi


def test_emit_writes_the_plot_beside_the_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "out.png"
    benchmark.emit(_result(), plot_path=str(path))
    assert capsys.readouterr().out.startswith("softmax float16 rows=49152 on NVIDIA Test GPU")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("args", [["softmax", "--cols", "32"], ["elementwise", "--expr", "swiglu", "--shape", "64,64"],
                                  ["fused_softmax", "--shape", "1,1,8,8"]], ids=["rowwise", "elementwise", "fused"])
def test_plot_without_matplotlib_is_a_usage_error(monkeypatch, tmp_path, args):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib raises ImportError
    path = tmp_path / "out.png"
    result = CliRunner().invoke(main, ["bench", *args, "--plot", str(path)])
    assert result.exit_code == 2, result.output
    assert "--plot needs matplotlib" in result.output and "Traceback" not in result.output
    assert not path.exists()
