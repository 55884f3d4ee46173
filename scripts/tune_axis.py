"""Times hand-built plans of the non-last-axis softmax kernel against each
other and against the planner's choice, to tune softmax_axis's tables.

Bytes counted: 2 * size * itemsize (x read once, y written once). Each
candidate is checked against a float64 CuPy reference (a fast wrong kernel
cannot win). Usage: python scripts/tune_axis.py [--shapes 64x4096x256]
[--dtypes float16,float32]
"""
from __future__ import annotations

import argparse

import cupy
import numpy

from cupyops import dtypes, jit
from cupyops.launch import get_num_blocks, live_function
from cupyops.ops.softmax import vector_pack_size
from cupyops.ops.softmax_axis import SoftmaxAxisSpec, plan
from tuning import Tuning

SHAPES = "64x4096x256,32x4096x512,64x1024x1024,256x512x256"


def candidates(outer, cols, inner, dtype, target):
    """(label, spec, grid, block, smem) for the planner's choice and variants."""
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack = vector_pack_size(inner, itemsize, 16)
    pack_bytes = pack * itemsize
    facts = target.facts
    found = []
    chosen = plan("softmax", outer, cols, inner, dtype, target)
    if chosen is not None:
        found.append(("auto", chosen.spec, chosen.grid, chosen.block, chosen.smem_bytes))
    for block_x in (1, 2, 4, 8, 16, 32):
        if block_x * pack > inner:
            continue
        tiles = outer * -(-(inner // pack) // block_x)
        for threads in (256, 512, 1024):
            block_y = min(threads // block_x, 1 << (cols.bit_length() - 1))
            if block_x * block_y < 32:
                continue
            tile_bytes = cols * block_x * pack_bytes
            for cached in (True, False):
                smem = tile_bytes if cached else 0
                loads = 0 if cached and pack_bytes >= 4 else max(1, min(8, 64 // pack_bytes))
                spec = SoftmaxAxisSpec("softmax", dtype, pack, block_x, block_y, loads, cached)
                if smem > facts.smem_per_block_optin:
                    continue
                try:
                    active = target.max_active_blocks(spec, block_x * block_y, smem, opt_in=True)
                except (jit.CompileError, cupy.cuda.compiler.CompileException):
                    # the block's reduction partials exceed static shared memory
                    continue
                if not active:
                    continue
                grid = (min(tiles, get_num_blocks(facts, block_x * block_y, tiles)), 1, 1)
                label = f"x{block_x} y{block_y} {'cached' if cached else 'online'} a{active}"
                found.append((label, spec, grid, (block_x, block_y, 1), smem))
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dtypes", default="float16,float32")
    args = parser.parse_args()
    tuning = Tuning(budget_s=0.1)
    device_id, target = tuning.device_id, tuning.target
    for dtype_name in args.dtypes.split(","):
        dtype = dtypes.parse_dtype(dtype_name)
        short = dtypes.float_type(dtype).short
        for shape in args.shapes.split(","):
            outer, cols, inner = map(int, shape.split("x"))
            x = (cupy.random.default_rng(0).standard_normal((outer, cols, inner), dtype=cupy.float32)
                 * 3).astype(dtype)
            y = cupy.empty_like(x)
            head = x[:2].astype(cupy.float64)
            e = cupy.exp(head - head.max(axis=1, keepdims=True))
            expect = e / e.sum(axis=1, keepdims=True)
            num_bytes = 2 * x.size * dtype.itemsize
            results = []
            for label, spec, grid, block, smem in candidates(outer, cols, inner, short, target):
                function = live_function(spec, device_id, smem)
                arguments = (x, y, numpy.int64(outer), numpy.int64(cols), numpy.int64(inner))
                run = lambda: function(grid, block, arguments, shared_mem=smem)  # noqa: E731
                median_us, gbs, fraction, error = tuning.measure(
                    run, y, lambda result: float(cupy.abs(result[:2].astype(cupy.float64) - expect).max()), num_bytes)
                results.append((median_us, label, gbs, fraction, error, spec.name))
            for median_us, label, gbs, fraction, error, name in sorted(results)[:12]:
                print(f"{short:<4} {shape:<14} {label:<28} {median_us:>9.1f} us {gbs:>6.0f} GB/s "
                      f"{fraction:>6.1%}  err={error:.1e} {name}", flush=True)
            auto = [r for r in results if r[1] == "auto"]
            if auto:
                print(f"{short:<4} {shape:<14} auto {auto[0][0]:.1f} us {auto[0][3]:.1%} {auto[0][5]}")
            del x, y
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
