"""`cupyops bench conv2d_int8`: the device's int8 tensor-core peak per instruction
(cupyops.ops.mma_peak), then each layer of a table timed with L2 flushed
(cupyops.bench.Timer), against torch float16 conv2d on cuDNN, torch._int_mm at
the implicit GEMM's shape and policy="megengine"."""
from __future__ import annotations

import click

from cupyops import bench as timing


def _providers(geometry, baselines: list) -> dict:
    """{name: callable} for one layer: cupyops first, then the baselines available."""
    import cupy
    import numpy

    import cupyops

    g = geometry
    rng = cupy.random.default_rng()
    x = rng.integers(-128, 128, (g.n, g.c // 32, g.h, g.w, 32), dtype=numpy.int8)
    w = rng.integers(-128, 128, (g.k, g.c // 32, g.r, g.s, 32), dtype=numpy.int8)
    y = cupy.empty(g.output_shape, numpy.int8)
    options = dict(stride=g.stride, padding=g.padding, dilation=g.dilation, alpha=1.0 / 4096, out=y)
    found = {"cupyops": lambda: cupyops.conv2d_int8(x, w, **options)}
    if "megengine" in baselines:
        found["megengine"] = lambda: cupyops.conv2d_int8(x, w, policy="megengine", **options)
    try:
        import torch
    except ImportError:
        return found
    if "cudnn_fp16" in baselines:
        torch.backends.cudnn.benchmark = True
        xt = torch.randn(g.n, g.c, g.h, g.w, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        wt = torch.randn(g.k, g.c, g.r, g.s, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        found["cudnn_fp16"] = lambda: torch.nn.functional.conv2d(xt, wt, stride=g.stride, padding=g.padding,
                                                                 dilation=g.dilation)
    if "int_mm" in baselines:
        m, n, k = g.gemm
        a = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
        b = torch.randint(-128, 128, (m, k), device="cuda", dtype=torch.int8).t()   # column-major (k, m)
        found["int_mm"] = lambda: torch._int_mm(a, b)
    return found


def run(layers: list, baselines: list) -> dict:
    """Measures the int8 peaks, then times every layer with each provider."""
    import cupy

    from cupyops.device import live_facts
    from cupyops.ops import conv2d_int8, mma_peak

    device_id = cupy.cuda.runtime.getDevice()
    facts = live_facts(device_id)
    peaks = mma_peak.measure_peaks(device_id)
    peak = max(peaks.values())
    timer = timing.Timer()
    points = []
    with click.progressbar(layers, label="conv2d_int8", file=click.get_text_stream("stderr")) as bar:
        for layer in bar:
            g = layer["geometry"]
            providers = _providers(g, baselines)
            point = {"label": layer["label"], "gemm_mnk": list(g.gemm), "ops": g.ops,
                     "first_call_s": timing.compile_seconds(providers["cupyops"]),
                     "kernel": _kernel(conv2d_int8.live_plan(g, "auto", device_id)),
                     "ref_cudnn_tflops": layer.get("ref_cudnn_tflops"), "ref_int_mm_tops": layer.get("ref_int_mm_tops")}
            for name, fn in providers.items():
                try:
                    us = timer.time(fn).median_us
                except Exception as error:   # a baseline this torch build cannot run
                    point[name] = {"error": str(error)}
                    continue
                point[name] = {"us": us, "tops": g.ops / us / 1e6}
            points.append(point)
            del providers
            cupy.get_default_memory_pool().free_all_blocks()
    return {"op": "conv2d_int8", "device": facts.name, "int8_peak_tops": peak, "int8_peak_tops_by_instruction": peaks,
            "baselines": baselines, "points": points}


def _kernel(plan) -> str:
    """The kernel a plan launches, with its split of GEMM_K where it has one."""
    return plan.spec.name + (f" (split-K {plan.splits})" if plan.splits > 1 else "")


def _ratio(point: dict, name: str, of: str = "cupyops") -> float:
    ours, theirs = point.get(of, {}), point.get(name, {})
    if "tops" not in ours or "tops" not in theirs:
        return float("nan")
    return ours["tops"] / theirs["tops"]


def format_table(result: dict) -> str:
    """The bench's table: the measured peaks, then a line per layer."""
    peak = result["int8_peak_tops"]
    by_instruction = ", ".join(f"{name} {tops:.0f}" for name, tops in result["int8_peak_tops_by_instruction"].items())
    lines = [f"conv2d_int8 on {result['device']}; int8 dense peak {peak:.0f} TOPS measured "
             f"(per instruction: {by_instruction}); 'peak' is the fraction of it"]
    header = f"{'layer':<20} {'us':>9} {'TOPS':>7} {'peak':>6}"
    for name in result["baselines"]:
        header += f" {'x' + name:>12}"
    if "megengine" in result["baselines"] and "cudnn_fp16" in result["baselines"]:
        header += f" {'mge/cudnn':>10}"
    lines.append(header + f" {'first s':>8}")
    for point in result["points"]:
        ours = point["cupyops"]
        line = f"{point['label']:<20} {ours['us']:>9.1f} {ours['tops']:>7.0f} "
        line += f"{ours['tops'] / peak:>6.1%}"
        for name in result["baselines"]:
            line += f" {_ratio(point, name):>12.2f}"
        if "megengine" in result["baselines"] and "cudnn_fp16" in result["baselines"]:
            line += f" {_ratio(point, 'cudnn_fp16', of='megengine'):>10.2f}"
        lines.append(line + f" {point['first_call_s']:>8.2f}")
    lines += ["kernels (policy auto):"] + [f"  {point['label']:<20} {point['kernel']}" for point in result["points"]
                                           if "kernel" in point]
    return "\n".join(lines)
