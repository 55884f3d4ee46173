"""Times the elementwise launch candidates (block, packs a thread) against OneFlow's launch
to choose AUTO_LAUNCH, and the host cost of a repeated small call against a bare RawKernel
launch of the same kernel.

Bytes counted: each operand read once at its own size, each output written once. Every
candidate is run once into a NaN-filled output and checked against the default plan's
result before it is timed. Usage: python scripts/tune_elementwise.py [--budget 0.1] [--host-only] [--expr TEXT] [--dtype NAME]
"""
from __future__ import annotations

import argparse
import math
import time

import cupy
import numpy

import cupyops
from cupyops import jit
from cupyops.dtypes import BFLOAT16
from cupyops.ops import elementwise as ew
from call_overhead import per_call_us
from tuning import Tuning

CASES = [   # expression, operand shapes as fractions of (rows, cols)
    ("sigmoid(a + b)", ("full", "full")),
    ("relu(a + b) * 0.5", ("full", "full")),
    ("gelu(x + bias)", ("full", "cols")),
    ("gelu_tanh(x + bias)", ("full", "cols")),
    ("silu(x + bias)", ("full", "cols")),
    ("silu(a) * b", ("full", "full")),
    ("residual + dropout(x + bias, 0.1, 7)", ("full", "cols", "full")),
]
SHAPES = [(16384, 8192), (2048, 2048)]
DTYPES = [numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32)]


def operands(expr, kinds, shape, dtype):
    _, names = cupyops.fx.parse(expr)
    rng = cupy.random.default_rng()
    return [rng.standard_normal(shape if kind == "full" else shape[-1:], dtype=cupy.float32).astype(dtype)
            for name, kind in zip(names, kinds)]


def throughput(tuning: Tuning, only: list, dtypes: list):
    print(f"{'expression':<40} {'dtype':<9} {'shape':<11} {'launch':<16} {'us':>8} {'GB/s':>7} {'copy':>6}")
    for expr, kinds in CASES:
        if only and not any(word in expr for word in only):
            continue
        function = ew.compiled_expression(expr)
        for dtype in dtypes:
            for shape in SHAPES:
                args = operands(expr, kinds, shape, dtype)
                try:
                    reference = function(*args)
                except jit.CompileError as error:      # e.g. a header this checkout lacks
                    print(f"{expr:<40} skipped: {str(error).splitlines()[0]}")
                    break
                num_bytes = sum(a.nbytes for a in args) + math.prod(shape) * dtype.itemsize
                launches = [("oneflow", None), ("auto", None)] + [(f"b{b} f{f} w{w}", (b, f, w))
                                                                  for b, f, w in ew.launch_candidates()]
                for label, launch in launches:
                    plan = function.plan(tuple(args), None, "oneflow" if label == "oneflow" else "auto",
                                         tuning.target, launch)
                    out = cupy.empty(shape, dtype)
                    launcher = ew._Launcher(plan, jit.kernel(plan.spec, tuning.device_id), tuple(args), out)

                    def run(launcher=launcher, out=out):
                        launcher(tuple(args), out, None)

                    def error_of(out):
                        return float(cupy.max(cupy.abs(out.astype(cupy.float32) - reference.astype(cupy.float32))))
                    us, gbs, of_copy, error = tuning.measure(run, out, error_of, num_bytes)
                    assert error == 0.0, (expr, label, error)
                    print(f"{expr:<40} {dtype.name:<9} {'x'.join(map(str, shape)):<11} {label:<16} {us:>8.1f} "
                          f"{gbs:>7.0f} {of_copy:>6.1%}", flush=True)


def host_cost(tuning: Tuning):
    a = cupy.random.default_rng().standard_normal((64, 128), dtype=cupy.float32)
    b, out = cupy.empty_like(a), cupy.empty_like(a)
    function = ew.compiled_expression("sigmoid(a + b)")
    plan = function.plan((a, b), target=tuning.target)
    raw = jit.kernel(plan.spec, tuning.device_id)
    bare_args = ew._Launcher(plan, raw, (a, b), out).arguments((a, b), (out,))   # the kernel's own
    bare = per_call_us(lambda: raw((plan.grid,), (plan.block,), bare_args), 20000)
    print(f"bare RawKernel launch                     {bare:6.2f} us/call")

    @cupyops.fuse
    def fused(a, b):
        return cupyops.fx.sigmoid(a + b)
    for label, fn in [("elementwise('sigmoid(a + b)', out=)", lambda: cupyops.elementwise("sigmoid(a + b)", a=a, b=b, out=out)),
                      ("elementwise('sigmoid(a + b)')", lambda: cupyops.elementwise("sigmoid(a + b)", a=a, b=b)),
                      ("fuse(f)(a, b, out=)", lambda: fused(a, b, out=out)),
                      ("fuse(f)(a, b)", lambda: fused(a, b)),
                      ("bias_gelu(a, bias)", lambda: cupyops.bias_gelu(a, a[0]))]:
        us = per_call_us(fn, 20000)
        print(f"{label:<41} {us:6.2f} us/call  ({us / bare:.2f}x bare)")
    expr = f"tanh(a * {time.time()!r}) + b"          # a new expression: render + NVRTC
    for label in ("first call of a new expression", "first call, kernel in CuPy's disk cache"):
        ew._expressions.clear()
        jit._kernels.clear()
        began = time.perf_counter()
        cupyops.elementwise(expr, a=a, b=b)
        cupy.cuda.Device().synchronize()
        print(f"{label:<41} {(time.perf_counter() - began) * 1e3:6.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--host-only", action="store_true")
    parser.add_argument("--expr", action="append", default=[], help="only the cases containing this text")
    parser.add_argument("--dtype", action="append", default=[], help="only these dtypes")
    options = parser.parse_args()
    tuning = Tuning(options.budget)
    host_cost(tuning)
    if not options.host_only:
        dtypes = [d for d in DTYPES if not options.dtype or d.name in options.dtype]
        throughput(tuning, options.expr, dtypes)


if __name__ == "__main__":
    main()
