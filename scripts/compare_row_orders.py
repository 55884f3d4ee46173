"""The fused softmax with a position bias, its rows taken as the rules take them against in
order (every other choice of the plan the same), timed in one run: forward and backward of
scores (B, H, S, S) with an (H, S, S) bias, float16, L2 flushed, % of the copy ceiling measured
in the same run (bytes: x and y, or dy, x and dx, the bias and the lse once). Where a tuning
table (the user's or the shipped one) holds a shape, its winner plans both runs.

Usage (repository root, on a GPU): PYTHONPATH=. python scripts/compare_row_orders.py
"""
from __future__ import annotations

import cupy
import numpy

import cupyops
from cupyops.bench import Timer, copy_ceiling_gbs
from cupyops.launch import LaunchCache
from cupyops.ops import fused_softmax as fs

SHAPES = ((64, 128, 128, 128), (16, 32, 512, 512), (8, 16, 1024, 1024), (2, 16, 2048, 2048), (1, 8, 4096, 4096))


def main():
    timer = Timer()
    copy = copy_ceiling_gbs(timer)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
    print(f"{name.decode() if isinstance(name, bytes) else name}; copy {copy:.0f} GB/s")
    rule = fs.interleave_rule
    for shape in SHAPES:
        generator = cupy.random.default_rng(0)
        x = generator.standard_normal(shape, dtype=numpy.float32).astype(numpy.float16)
        bias = generator.standard_normal(shape[1:], dtype=numpy.float32).astype(numpy.float16)
        _, lse = cupyops.fused_softmax(x, scale=0.125, bias=bias, return_lse=True)
        dy = cupy.ones_like(x)
        row = []
        for label, order in (("rules", rule), ("in order", lambda *args: False)):
            fs.interleave_rule = order
            fs._launches = LaunchCache()     # plan afresh
            entries = fs.prepare(x, scale=0.125, bias=bias, mask=None, causal=False, diagonal=0, dropout=0.0,
                                 axis=-1).fusion.entries
            forward = timer.time(lambda: cupyops.fused_softmax(x, scale=0.125, bias=bias)).median_us
            backward = timer.time(lambda: cupyops.fused_softmax_backward(dy, x, lse, scale=0.125,
                                                                         bias=bias)).median_us
            forward_bytes, backward_bytes = 2 * x.nbytes + bias.nbytes, 3 * x.nbytes + bias.nbytes + lse.nbytes
            row.append(f"{label}: forward {forward:7.1f} us {100 * forward_bytes / forward / 1e3 / copy:5.1f} %, "
                       f"backward {backward:7.1f} us {100 * backward_bytes / backward / 1e3 / copy:5.1f} %")
        fs.interleave_rule = rule
        print(f"{shape} bias {shape[1:]} (entries {entries}): " + " | ".join(row))


if __name__ == "__main__":
    main()
