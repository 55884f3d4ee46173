"""Times the elementwise launch candidates (block, packs a thread) against OneFlow's launch
to choose the profiles' ELEMENTWISE_AUTO_LAUNCH, and the first call of a new expression
(render and NVRTC, then from CuPy's disk cache). The host cost of a repeated small call of
every elementwise op against its bare launch is in scripts/call_overhead.py.

Bytes counted: each operand read once at its own size, each output written once. Every
candidate is run once into a NaN-filled output and checked against the default plan's
result before it is timed. Usage (repository root):
PYTHONPATH=. python scripts/tune_elementwise.py [--budget 0.1] [--first-call-only] [--expr TEXT] [--dtype NAME]
[--shape ROWS,COLS]; same: a device copy of the same bytes (half read, half written) over the candidate's time.
"""
from __future__ import annotations

import argparse
import math
import time

import cupy
import numpy

import cupyops
from cupyops import bench, jit
from cupyops.device import live_facts
from cupyops.dtypes import BFLOAT16
from cupyops.ops import elementwise as ew
from cupyops.ops.elementwise_launch import Launcher
from tuning import Tuning

CASES = [   # expression, operand shapes as fractions of (rows, cols), or the number an operand is
    ("sigmoid(a + b)", ("full", "full")),
    ("relu(a + b) * 0.5", ("full", "full")),
    ("gelu(x + bias)", ("full", "cols")),
    ("gelu_tanh(x + bias)", ("full", "cols")),
    ("silu(x + bias)", ("full", "cols")),
    ("silu(a) * b", ("full", "full")),
    ("residual + dropout(x + bias, p, seed, offset)", ("full", "full", "cols", 0.1, 7, 0)),   # as bias_dropout_add
]
SHAPES = [(16384, 8192), (4096, 4096)]
DTYPES = [numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32)]


def operands(expr, kinds, shape, dtype):
    _, names = cupyops.fx.parse(expr)
    rng = cupy.random.default_rng()
    return [rng.standard_normal(shape if kind == "full" else shape[-1:], dtype=cupy.float32).astype(dtype)
            if isinstance(kind, str) else kind for name, kind in zip(names, kinds)]


def throughput(tuning: Tuning, only: list, dtypes: list, shapes: list):
    print(f"{'expression':<40} {'dtype':<9} {'shape':<11} {'launch':<16} {'us':>8} {'GB/s':>7} {'copy':>6} {'same':>6}")
    for expr, kinds in CASES:
        if only and not any(word in expr for word in only):
            continue
        function = ew.compiled_expression(expr)
        for dtype in dtypes:
            for shape in shapes:
                args = operands(expr, kinds, shape, dtype)
                try:
                    reference = function(*args)
                except jit.CompileError as error:      # e.g. a header this checkout lacks
                    print(f"{expr:<40} skipped: {str(error).splitlines()[0]}")
                    break
                num_bytes = (sum(a.nbytes for a in args if isinstance(a, cupy.ndarray)) +
                             math.prod(shape) * dtype.itemsize)
                copy_us = tuning.timer.time(bench.device_copy(num_bytes // 2)).median_us
                launches = [("oneflow", None), ("auto", None)] + [(f"b{b} f{f} w{w}", (b, f, w))
                                                                  for b, f, w in ew.launch_candidates()]
                for label, launch in launches:
                    plan = function.plan(tuple(args), None, "oneflow" if label == "oneflow" else "auto",
                                         tuning.target, launch)
                    out = cupy.empty(shape, dtype)
                    launcher = Launcher(plan, jit.kernel(plan.spec, tuning.device_id).kernel, tuple(args), out)

                    def run(launcher=launcher, out=out):
                        launcher.run(tuple(args), out, None)

                    def error_of(out):
                        return float(cupy.max(cupy.abs(out.astype(cupy.float32) - reference.astype(cupy.float32))))
                    us, gbs, of_copy, error = tuning.measure(run, out, error_of, num_bytes)
                    assert error == 0.0, (expr, label, error)
                    print(f"{expr:<40} {dtype.name:<9} {'x'.join(map(str, shape)):<11} {label:<16} {us:>8.1f} "
                          f"{gbs:>7.0f} {of_copy:>6.1%} {copy_us / us:>6.2f}", flush=True)


def first_call_cost() -> None:
    """The first call of a new expression: rendered and compiled (the process's first compile,
    which also loads NVRTC, then another), then from CuPy's disk cache."""
    rng = cupy.random.default_rng()
    a, b = (rng.standard_normal((64, 128), dtype=cupy.float32) for _ in range(2))
    print(f"# {live_facts(cupy.cuda.runtime.getDevice()).name}")
    stamp = repr(time.time())
    for label, expr in (("first call of a new expression, first compile", f"tanh(a * {stamp}) + b"),
                        ("first call of another new expression", f"exp(a * {stamp}) - b"),
                        ("first call, kernel in CuPy's disk cache", f"exp(a * {stamp}) - b")):
        ew._expressions.clear()
        jit._kernels.clear()
        began = time.perf_counter()
        cupyops.elementwise(expr, a=a, b=b)
        cupy.cuda.Device().synchronize()
        print(f"{label:<48} {(time.perf_counter() - began) * 1e3:8.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--first-call-only", action="store_true")
    parser.add_argument("--expr", action="append", default=[], help="only the cases containing this text")
    parser.add_argument("--dtype", action="append", default=[], help="only these dtypes")
    parser.add_argument("--shape", action="append", default=[], help="ROWS,COLS in place of the default shapes")
    options = parser.parse_args()
    first_call_cost()
    if not options.first_call_only:
        dtypes = [d for d in DTYPES if not options.dtype or d.name in options.dtype]
        shapes = [tuple(int(n) for n in text.split(",")) for text in options.shape] or SHAPES
        throughput(Tuning(options.budget), options.expr, dtypes, shapes)


if __name__ == "__main__":
    main()
