"""Times hand-built softmax plans against each other to choose the auto planner's tables.

The candidates are the package's (cupyops.ops.softmax_candidates, the ones
`cupyops tune softmax` times and keeps winners of); this script prints every
timing of a sweep with its registers, to read rather than to keep.
Bytes counted: (inputs + 1) * rows * cols * itemsize (forward: x read, y
written; backward: dy and y read, dx written).
Each candidate is also checked against a float64 CuPy reference on its first
rows, so a fast wrong kernel cannot win. Usage: python scripts/tune_softmax.py
[--rows 49152] [--dtypes float16,float32] > table.
"""
from __future__ import annotations

import argparse

import cupy
import numpy

from cupyops import dtypes
from cupyops.launch import live_function
from cupyops.ops.softmax_candidates import candidates
from cupyops.ops.softmax_tune import moved_bytes, reference, sample_inputs
from tuning import Tuning


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--ops", default="softmax")
    parser.add_argument("--cols", default="256,512,1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--kinds", default="", help="comma-separated label prefixes to time (default: all)")
    args = parser.parse_args()
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    tuning = Tuning(budget_s=0.15)
    device_id, target = tuning.device_id, tuning.target
    for op in args.ops.split(","):
        for dtype_name in args.dtypes.split(","):
            dtype = dtypes.parse_dtype(dtype_name)
            short = dtypes.float_type(dtype).short
            for cols in map(int, args.cols.split(",")):
                rows = min(args.rows, (4 << 30) // (cols * dtype.itemsize))
                inputs = sample_inputs(op, short, rows, cols)
                y = cupy.empty_like(inputs[0])
                expect = reference(op, [a[:64] for a in inputs])
                num_bytes = moved_bytes(op, short, rows, cols)
                for candidate in candidates(op, short, rows, cols, target):
                    label, launch = candidate.label, candidate.launch
                    if kinds and not label.startswith(kinds):
                        continue
                    function = live_function(launch.spec, device_id, launch.smem_bytes)
                    args_ = (*inputs, y, numpy.int64(rows), numpy.int64(cols),
                             *[numpy.int64(cols)] * (len(inputs) + 1))
                    run = lambda: function(launch.grid, launch.block, args_, shared_mem=launch.smem_bytes)  # noqa: E731
                    median_us, gbs, fraction, error = tuning.measure(
                        run, y, lambda result: float(cupy.abs(result[:64].astype(cupy.float64) - expect).max()), num_bytes)
                    regs = target.resources(launch.spec)["registers"]
                    print(f"{op:<11} {short:<4} rows={rows:<6} cols={cols:<7} {label:<18} "
                          f"{median_us:>9.1f} us {gbs:>6.0f} GB/s {fraction:>6.1%}  "
                          f"err={error:.1e} regs={regs} {launch.spec.name}", flush=True)
                del inputs, y
                cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
