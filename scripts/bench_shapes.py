"""Times softmax on the shapes the issues name outside the rows-49152 sweep:
long rows (few rows, many cols) and a non-last axis. L2 flushed, copy ceiling
measured in the same run. Bytes counted: x read once, y written once
(2 * size * itemsize); backward adds dy (3 * size * itemsize).

Usage: python scripts/bench_shapes.py [--dtypes float16,float32]"""
from __future__ import annotations

import argparse

import cupy

import cupyops
from cupyops import bench, dtypes
from cupyops.device import live_facts

# (shape, axis) pairs
SHAPES = [((16384, 65536), -1), ((8192, 131072), -1), ((4096, 262144), -1), ((8, 1 << 20), -1),
          ((64, 4096, 256), 1)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float16,bfloat16,float32")
    parser.add_argument("--ops", default="softmax,log_softmax,softmax_backward")
    parser.add_argument("--policies", default="auto,oneflow")
    args = parser.parse_args()
    timer = bench.Timer()
    copy = bench.copy_ceiling_gbs(timer)
    print(f"# {live_facts(cupy.cuda.runtime.getDevice()).name}; copy ceiling {copy:.0f} GB/s")
    for dtype_name in args.dtypes.split(","):
        dtype = dtypes.parse_dtype(dtype_name)
        for shape, axis in SHAPES:
            generator = cupy.random.default_rng()
            x = generator.standard_normal(shape, dtype=cupy.float32).astype(dtype)
            y = cupy.empty_like(x)
            dy = generator.standard_normal(shape, dtype=cupy.float32).astype(dtype)
            for op in args.ops.split(","):
                inputs = (dy, x) if op.endswith("_backward") else (x,)
                for policy in args.policies.split(","):
                    t = timer.time(lambda: getattr(cupyops, op)(*inputs, axis=axis, out=y, policy=policy))
                    gbs = bench.gbs((len(inputs) + 1) * x.size * dtype.itemsize, t)
                    print(f"{op:<17} {policy:<8} {dtype_name:<9} {str(shape):<18} axis={axis:<3} "
                          f"{t.median_us:>9.1f} us {gbs:>6.0f} GB/s {gbs / copy:>6.1%}", flush=True)
            x = y = dy = None   # free before the next shape
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
