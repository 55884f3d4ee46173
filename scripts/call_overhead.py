"""Host cost of a repeated small call: cupyops.softmax on 64 x 128 float32
against a bare cupy.RawKernel launch of the same kernel with the same arguments."""
from __future__ import annotations

import time

import cupy
import numpy

import cupyops
from cupyops import jit
from cupyops.launch import Target
from cupyops.ops.softmax import plan

CALLS = 20000


def per_call_us(fn) -> float:
    for _ in range(100):
        fn()
    cupy.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(CALLS):
            fn()
        cupy.cuda.Device().synchronize()
        best = min(best, (time.perf_counter() - began) / CALLS * 1e6)
    return best


def main():
    x = cupy.random.default_rng().standard_normal((64, 128), dtype=cupy.float32)
    y = cupy.empty_like(x)
    device_id = x.device.id
    chosen = plan("softmax", 64, 128, "f32", "auto", Target.live(device_id))
    raw = jit.kernel(chosen.spec, device_id)
    args = (x, y, numpy.int64(64), numpy.int64(128), numpy.int64(128), numpy.int64(128))
    bare = per_call_us(lambda: raw(chosen.grid, chosen.block, args))
    with_out = per_call_us(lambda: cupyops.softmax(x, axis=-1, out=y))
    allocating = per_call_us(lambda: cupyops.softmax(x, axis=-1))
    print(f"bare RawKernel launch      {bare:6.2f} us/call")
    print(f"softmax(x, axis=-1, out=y) {with_out:6.2f} us/call  ({with_out / bare:.2f}x bare)")
    print(f"softmax(x, axis=-1)        {allocating:6.2f} us/call  ({allocating / bare:.2f}x bare)")


if __name__ == "__main__":
    main()
