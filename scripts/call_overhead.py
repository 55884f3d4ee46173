"""Host cost of a repeated small call of every public op against bare
cupy launches of the same kernels with the same arguments.

Each op runs on a 64 x 128 float32 array (--rows, --cols, --dtype), with
`out=` where it takes one and allocating. Its launches are recorded once (the
compiled functions wrapped while the call memos are rebuilt), then timed
plain: µs per call over repeated calls, against µs per round of the recorded
launches made directly through their cupy.RawKernel objects (same grid,
block, shared memory and arguments, outputs included). The backward norms
launch two kernels (dx with fused dweight / dbias partial sums, and the
kernel summing the partials): their bare round is those two launches. Exits
1 when an op costs more than MAX_RATIO times its bare launches.

Usage (repository root): PYTHONPATH=. python scripts/call_overhead.py
"""
from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy

import cupyops
from cupyops import jit, launch
from cupyops.callcache import CallCache
from cupyops.device import live_facts
from cupyops.dtypes import parse_dtype
from cupyops.launch import LaunchCache
from cupyops.ops import norm, norm_launch, softmax

MAX_RATIO = 2.0


def per_call_us(fn, calls: int) -> float:
    """Best of five rounds of `calls` calls, synchronised at the end of each."""
    for _ in range(100):
        fn()
    cupy.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        cupy.cuda.Device().synchronize()
        best = min(best, (time.perf_counter() - began) / calls * 1e6)
    return best


def _fresh_memos() -> None:
    softmax._calls, softmax._launches = CallCache(), LaunchCache()
    norm._calls, norm_launch._ready_launches = CallCache(), {}


def recorded_launches(call) -> list:
    """The launches of call() taken from the call memo (its second run):
    [(cupy.RawKernel, grid, block, args, smem)]."""
    log = []

    def recording(spec, device_id, dynamic_smem=0):
        function = launch.live_function(spec, device_id, dynamic_smem)
        raw = jit.kernel(spec, device_id)

        def record(grid, block, args, shared_mem=0):
            log.append((raw, grid, block, args, shared_mem))
            function(grid, block, args, shared_mem=shared_mem)
        return record

    modules = (softmax, norm_launch)
    for module in modules:
        module.live_function = recording
    _fresh_memos()
    try:
        call()
        del log[:]
        call()
    finally:
        for module in modules:
            module.live_function = launch.live_function
        _fresh_memos()
    return log


def bare_round(launches: list):
    def run():
        for raw, grid, block, args, smem in launches:
            raw(grid, block, args, shared_mem=smem)
    return run


def cases(rows: int, cols: int, dtype) -> list:
    """(label, call) of every public op, with out= and allocating."""
    rng = cupy.random.default_rng(0)

    def array(*shape):
        return rng.standard_normal(shape, dtype=numpy.float32).astype(dtype)

    x, dy, out = array(rows, cols), array(rows, cols), cupy.empty((rows, cols), dtype)
    weight, bias = array(cols), array(cols)
    y = cupyops.softmax(x, axis=-1)
    log_y = cupyops.log_softmax(x, axis=-1)
    _, mean, rstd = cupyops.layer_norm(x, weight, bias, return_stats=True)
    _, rms_rstd = cupyops.rms_norm(x, weight, return_stats=True)
    found = []
    for name in ("softmax", "log_softmax"):
        function = getattr(cupyops, name)
        found += [(f"{name}(x, out=)", lambda f=function: f(x, axis=-1, out=out)),
                  (f"{name}(x)", lambda f=function: f(x, axis=-1))]
    for name, forward in (("softmax_backward", y), ("log_softmax_backward", log_y)):
        function = getattr(cupyops, name)
        found += [(f"{name}(dy, y, out=)", lambda f=function, fy=forward: f(dy, fy, out=out)),
                  (f"{name}(dy, y)", lambda f=function, fy=forward: f(dy, fy))]
    found += [("layer_norm(x, w, b, out=)", lambda: cupyops.layer_norm(x, weight, bias, out=out)),
              ("layer_norm(x, w, b)", lambda: cupyops.layer_norm(x, weight, bias)),
              ("rms_norm(x, w, out=)", lambda: cupyops.rms_norm(x, weight, out=out)),
              ("rms_norm(x, w)", lambda: cupyops.rms_norm(x, weight)),
              ("layer_norm_backward(dy, x, mean, rstd, w)",
               lambda: cupyops.layer_norm_backward(dy, x, mean, rstd, weight)),
              ("rms_norm_backward(dy, x, rstd, w)", lambda: cupyops.rms_norm_backward(dy, x, rms_rstd, weight))]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=20000)
    options = parser.parse_args()
    dtype = parse_dtype(options.dtype)
    device_name = live_facts(cupy.cuda.Device().id).name
    print(f"{device_name}, {options.rows} x {options.cols} {options.dtype}, host time per call")
    print(f"{'op':44s} {'kernels':>7s} {'us/call':>8s} {'bare us':>8s} {'ratio':>6s}")
    worst = 0.0
    for label, call in cases(options.rows, options.cols, dtype):
        launches = recorded_launches(call)
        bare = per_call_us(bare_round(launches), options.calls)
        took = per_call_us(call, options.calls)
        ratio = took / bare
        worst = max(worst, ratio)
        flag = "" if ratio <= MAX_RATIO else f"  > {MAX_RATIO}x"
        print(f"{label:44s} {len(launches):7d} {took:8.2f} {bare:8.2f} {ratio:6.2f}{flag}")
    print(f"worst ratio {worst:.2f} (limit {MAX_RATIO})")
    return 0 if worst <= MAX_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
