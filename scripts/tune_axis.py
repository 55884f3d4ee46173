"""Times hand-built plans of the non-last-axis softmax kernels against each
other and against the planner's choice, forward (softmax) and backward
(softmax_backward), to tune softmax_axis's tables.

Candidates for each op, shape and dtype (t: threads a block; m: blocks an SM
its registers are bound to; a: blocks an SM holds, from the driver; local:
bytes of local memory, spills included):
  auto      the planner's choice (not repeated among the others)
  r{n}      a block a tile of n bytes of each row (n in ROW_BYTES), cached
            when it fits
  r{n} c{k} clusters of k = 2, 4, 8 blocks sharing such a tile's rows (sm_90+)
each with 256, 512 and 1024 threads. A cached candidate's registers are bound
to the blocks its shared memory and thread slots allow (the planner bounds
them at AXIS_THREAD_REGISTERS a thread). Bytes counted: 2 x size x itemsize
forward, 3 x size x itemsize backward. Each candidate is checked against a
float64 reference of the whole output before it is timed (a fast
wrong kernel cannot win). Usage: python scripts/tune_axis.py
[--shapes 64x4096x256,...] [--dtypes float16,float32]
[--ops softmax,softmax_backward] [--top 8] [--row-bytes 32,64,128]
[--pack-bytes 16,8]
"""
from __future__ import annotations

import argparse
import math

import cupy
import numpy

from cupyops import dtypes
from cupyops.device import has_clusters
from cupyops.launch import live_function
from cupyops.ops import softmax_axis as sa
from cupyops.ops.row_packs import vector_pack_size
from cupyops.ops.softmax_rows import INPUTS
from tuning import Tuning

SHAPES = "64x4096x256,32x4096x512,64x1024x1024,256x512x256,16x16384x256"
THREADS = (256, 512, 1024)
ROW_BYTES = (32, 64, 128)
# Largest error against the reference, relative to the reference's largest
# value, of a candidate that is timed.
TOLERANCE = {"f16": 1e-2, "bf16": 5e-2, "f32": 1e-4}
# With registers of 32 a thread an SM's registers hold as many threads as its
# thread slots: the bound then asks only what shared memory and threads allow.
UNBOUND_REGISTERS = 32


def variant(op, dtype, pack, block_x, block_y, cluster, cached, block_bytes, facts):
    """The spec of a hand-built candidate; a cached one bound to the blocks its
    shared memory and thread slots allow."""
    threads = block_x * block_y
    pack_bytes = pack * dtypes.BY_SHORT[dtype].itemsize
    loads = sa.loads_in_flight(threads, len(INPUTS[op]) * pack_bytes, pack_bytes, cached)
    min_blocks = sa.resident_blocks(facts, block_bytes, threads, UNBOUND_REGISTERS) if cached else 1
    return sa.SoftmaxAxisSpec(op, dtype, pack, block_x, block_y, loads, cached, cluster, min_blocks,
                              base2_exp=sa.base2_terms(op, dtype, cached))


def candidates(op, outer, cols, inner, dtype, target, row_bytes_list=ROW_BYTES, pack_bytes_list=(16,)):
    """(label, spec, grid, smem) for the planner's choice and the variants:
    each cached where it can launch, else (without a cluster) read twice."""
    facts = target.facts
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    found = []
    chosen = sa.plan(op, outer, cols, inner, dtype, target)
    if chosen is not None:
        found.append(("auto", chosen.spec, chosen.grid[0], chosen.smem_bytes))
    clusters = (1,)
    if has_clusters(facts.arch):
        clusters += sa.AXIS_CLUSTER_SIZES
    packs = sorted({vector_pack_size(inner, itemsize, pack_bytes) for pack_bytes in pack_bytes_list}, reverse=True)
    variants = [(f"r{row_bytes}" + (f" c{size}" if size > 1 else "") + (f" p{pack}" if pack != packs[0] else ""),
                 pack, max(1, row_bytes // (pack * itemsize)), size)
                for pack in packs for row_bytes in row_bytes_list for size in clusters]
    for name, pack, block_x, cluster in variants:
        row_pack_bytes = len(INPUTS[op]) * pack * itemsize
        block_rows = -(-cols // cluster)
        block_bytes = block_rows * block_x * row_pack_bytes
        tiles = outer * -(-(inner // pack) // block_x)
        for threads in THREADS:
            block_y = min(threads // block_x, 1 << (block_rows.bit_length() - 1))
            if block_x * pack > inner or block_x * block_y != threads:   # too few packs or rows
                continue
            for cached in (True, False) if cluster == 1 else (True,):
                spec = variant(op, dtype, pack, block_x, block_y, cluster, cached, block_bytes, facts)
                smem = block_bytes if cached else 0
                active = target.max_active_blocks(spec, threads, smem, opt_in=True)
                if active:
                    break
            if not active or any(spec == other for _, other, _, _ in found):
                continue
            local_bytes = target.resources(spec)["local_bytes"]
            label = (f"{name} t{threads} m{spec.min_blocks} a{active}{'' if cached else ' online'}"
                     f"{f' local{local_bytes}' if local_bytes else ''}")
            found.append((label, spec, sa.grid_size(facts, threads, tiles, cluster), smem))
    return found


def make_inputs(op, shape, dtype):
    """(inputs, float64 reference of the output): x forward;
    dy and a softmax y backward."""
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=cupy.float32) * 3
    if op == "softmax":
        x = x.astype(dtype)
        x64 = x.astype(cupy.float64)
        e = cupy.exp(x64 - x64.max(axis=1, keepdims=True))
        return (x,), e / e.sum(axis=1, keepdims=True)
    e = cupy.exp(x - x.max(axis=1, keepdims=True))
    y = (e / e.sum(axis=1, keepdims=True)).astype(dtype)
    dy = rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)
    dy64, y64 = dy.astype(cupy.float64), y.astype(cupy.float64)
    return (dy, y), (dy64 - (dy64 * y64).sum(axis=1, keepdims=True)) * y64


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--ops", default="softmax,softmax_backward")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--row-bytes", default=",".join(map(str, ROW_BYTES)),
                        help="bytes of each row a candidate's tile covers")
    parser.add_argument("--pack-bytes", default="16", help="largest bytes of a pack, e.g. 16,8")
    args = parser.parse_args()
    tuning = Tuning(budget_s=0.1)
    device_id, target = tuning.device_id, tuning.target
    for op in args.ops.split(","):
        for dtype_name in args.dtypes.split(","):
            dtype = dtypes.parse_dtype(dtype_name)
            short = dtypes.float_type(dtype).short
            for shape in args.shapes.split(","):
                outer, cols, inner = map(int, shape.split("x"))
                inputs, expect = make_inputs(op, (outer, cols, inner), dtype)
                out = cupy.empty_like(inputs[0])
                scale = float(cupy.abs(expect).max())
                num_bytes = (len(inputs) + 1) * math.prod((outer, cols, inner)) * dtype.itemsize
                results = []
                for label, spec, grid, smem in candidates(
                        op, outer, cols, inner, short, target, tuple(map(int, args.row_bytes.split(","))),
                        tuple(map(int, args.pack_bytes.split(",")))):
                    function = live_function(spec, device_id, smem)
                    arguments = (*inputs, out, numpy.int64(outer), numpy.int64(cols), numpy.int64(inner))
                    block = (spec.block_x, spec.block_y, 1)
                    run = lambda: function((grid, 1, 1), block, arguments, shared_mem=smem)  # noqa: E731
                    median_us, gbs, fraction, error = tuning.measure(
                        run, out, lambda result: float(cupy.abs(result - expect).max()) / scale, num_bytes)
                    if not error <= TOLERANCE[short]:
                        print(f"{op} {short} {shape} {label}: WRONG, error {error:.1e} ({spec.name})")
                        continue
                    results.append((median_us, label, gbs, fraction, error, spec.name))
                results.sort()
                for median_us, label, gbs, fraction, error, name in results[:args.top]:
                    print(f"{op:<16} {short:<4} {shape:<13} {label:<24} {median_us:>8.1f} us {gbs:>5.0f} GB/s "
                          f"{fraction:>6.1%} err={error:.0e} {name}", flush=True)
                auto = next((r for r in results if r[1] == "auto"), None)
                if auto:
                    print(f"{op:<16} {short:<4} {shape:<13} AUTO {auto[3]:.1%} (best {results[0][3]:.1%} "
                          f"{results[0][1]}) {auto[5]}", flush=True)
                del inputs, out
                cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
