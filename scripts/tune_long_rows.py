"""Times the plans for long rows against each other to choose softmax_split's
tables and the async row path's ladder (softmax_rows.AUTO_ASYNC_LADDERS): the
ordinary row plan (auto), the two-launch split, the cooperative split
holding each of COOP_SIZES bytes a thread, the async row kernel with a row
shared by the blocks of a thread-block cluster, and the async row kernel
with register tails, in one block or in each block of a cluster.

Bytes counted: (inputs + 1) * rows * cols * itemsize (forward: x read, y
written; backward: dy and y read, dx written). Each candidate is checked
against a float64 CuPy reference on its first and last rows (a fast wrong
kernel cannot win). Usage: python scripts/tune_long_rows.py [--dtypes float16,float32]
[--ops softmax,softmax_backward] [--shapes 8x1048576,8192x131072] [--only clusters|coop|tails]
[--extra-tail-packs N]
"""
from __future__ import annotations

import argparse
import itertools

import cupy
import numpy

from cupyops import async_row, dtypes
from cupyops.device import has_clusters
from cupyops.launch import live_function
from cupyops.ops import row_packs, softmax_rows, softmax_split
from cupyops.ops.softmax_tune import reference
from cupyops.rowwise import Operand
from tuning import Tuning

COOP_SIZES = (32, 64, 96, 128)     # bytes of each input a coop thread holds
CLUSTER_SIZES = (1, 2, 4, 8)
CLUSTER_BLOCK_SIZES = (256, 512, 1024)
TAIL_EXTRA_PACKS = 2
TAIL_MOST_PACKS = 8
SHAPES = "16384x32768,16384x65536,8192x131072,4096x262144,8x1048576,64x1048576,1x16777216,49152x32768"


def async_pack(dtype, cols):
    """The 16-byte pack the async row kernel moves (the planner's
    row_packs.vector_pack_size), or None where cols allow none."""
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack = row_packs.vector_pack_size(cols, itemsize, 16)
    return pack if pack * itemsize == 16 else None


def cluster_candidates(op, rows, cols, dtype, target):
    """(label, plan) for the async row kernel with a row shared by a cluster of
    each of CLUSTER_SIZES blocks, each stage count and block size: its grid
    persistent (the resident clusters) or a cluster per row."""
    pack = async_pack(dtype, cols)
    if pack is None:
        return []
    found = []
    for cluster in CLUSTER_SIZES:
        for stages in (1, 2):
            for block in CLUSTER_BLOCK_SIZES:
                spec = softmax_rows.SoftmaxSpec(op, "block_async", dtype, pack, block_size=block, stages=stages,
                                           online=not op.endswith("_backward"), cluster_size=cluster)
                smem = stages * softmax_rows.async_share_bytes(spec, cols)
                active = target.max_active_blocks(spec, block, smem, True)
                if not active:
                    continue
                resident = active * target.facts.sm_count // cluster
                for grid_name, clusters in (("persistent", min(rows, resident)), ("per-row", rows)):
                    if grid_name == "per-row" and (clusters == resident or stages == 2):
                        continue
                    found.append((f"c{cluster} s{stages} b{block} a{active} {grid_name}",
                                  softmax_rows.SoftmaxPlan(spec, (block, 1, 1), (clusters * cluster, 1, 1), smem)))
    return found


def tail_candidates(op, rows, cols, dtype, target, extra_packs=TAIL_EXTRA_PACKS):
    """(label, plan) for the async row kernel holding the part of the row its
    blocks' shared memory does not in registers: the fewest packs a thread
    that leave the rest within shared memory and up to extra_packs more (at
    most TAIL_MOST_PACKS, none spilling), at each of CLUSTER_BLOCK_SIZES
    threads, a block or a cluster of each of CLUSTER_SIZES blocks (where the
    GPU has clusters) per row."""
    pack = async_pack(dtype, cols)
    if pack is None:
        return []
    found = []
    cluster_sizes = CLUSTER_SIZES if has_clusters(target.facts.arch) else (1,)
    for cluster, block in itertools.product(cluster_sizes, CLUSTER_BLOCK_SIZES):
        tails = async_row.tails(len(softmax_rows.INPUTS[op]), cols * dtypes.BY_SHORT[dtype].itemsize, block,
                                target.facts.smem_per_block_optin, cluster, TAIL_MOST_PACKS)
        for tail in tails[:extra_packs + 1]:
            spec = softmax_rows.SoftmaxSpec(op, "block_async", dtype, pack, block_size=block, stages=1,
                                       online=not op.endswith("_backward"), cluster_size=cluster, tail_packs=tail)
            smem = softmax_rows.async_share_bytes(spec, cols)
            if target.resources(spec)["local_bytes"] or not target.max_active_blocks(spec, block, smem, True):
                continue
            found.append((f"c{cluster} tail b{block} t{tail}",
                          softmax_rows.SoftmaxPlan(spec, (block, 1, 1), (rows * cluster, 1, 1), smem)))
    return found


def candidates(op, rows, cols, dtype, target, only=None, extra_tail_packs=TAIL_EXTRA_PACKS):
    """(label, plan) for each plan worth timing at this shape (auto, then the
    `only` family when given)."""
    found = [("auto", softmax_split.plan(op, rows, cols, dtype, target)
              or softmax_rows.plan(op, rows, cols, dtype, "auto", target))]
    if only is None:
        found.append(("rows", softmax_rows.plan(op, rows, cols, dtype, "auto", target)))
        found.append(("two-launch", softmax_split.two_launch_plan(op, rows, cols, dtype, target)))
        # rows off the 16-byte grid: the two launches in the row's own packs, not peeled
        found.append(("two-launch unpeeled", softmax_split.two_launch_plan(op, rows, cols, dtype, target, 16, False)))
    if only in (None, "coop"):
        for size in COOP_SIZES:
            found.append((f"coop {size}B", softmax_split.coop_candidate(op, rows, cols, dtype, target, 16, size)))
    if only in (None, "clusters"):
        found += cluster_candidates(op, rows, cols, dtype, target)
    if only in (None, "tails"):
        found += tail_candidates(op, rows, cols, dtype, target, extra_tail_packs)
    unique = {}
    for label, chosen in found:   # the first label of each plan
        if chosen is not None:
            unique.setdefault(chosen, label)
    return [(label, chosen) for chosen, label in unique.items()]


def launcher(chosen, inputs, out, device_id):
    rows, cols = out.shape
    if isinstance(chosen, (softmax_split.CoopPlan, softmax_split.SplitPlan)):
        functions = softmax_split.functions_of(chosen, device_id)
        operands = [Operand(a, cols) for a in inputs]
        return lambda: softmax_split.launch(chosen, functions, operands, Operand(out, cols), rows, cols)
    function = live_function(chosen.spec, device_id, chosen.smem_bytes)
    args = (*inputs, out, numpy.int64(rows), numpy.int64(cols), *[numpy.int64(cols)] * (len(inputs) + 1))
    return lambda: function(chosen.grid, chosen.block, args, shared_mem=chosen.smem_bytes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--ops", default="softmax,softmax_backward")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--only", choices=("clusters", "coop", "tails"),
                        help="auto and this family of candidates alone")
    parser.add_argument("--extra-tail-packs", type=int, default=TAIL_EXTRA_PACKS,
                        help="register tails tried past the fewest that fit")
    args = parser.parse_args()
    tuning = Tuning(budget_s=0.15)
    device_id, target = tuning.device_id, tuning.target
    for dtype_name in args.dtypes.split(","):
        dtype = dtypes.parse_dtype(dtype_name)
        short = dtypes.float_type(dtype).short
        for shape in args.shapes.split(","):
            rows, cols = map(int, shape.split("x"))
            generator = cupy.random.default_rng(0)
            arrays = [(generator.standard_normal((rows, cols), dtype=cupy.float32) * 3).astype(dtype)
                      for _ in range(2)]
            out = cupy.empty_like(arrays[0])
            for op in args.ops.split(","):
                inputs = arrays[:len(softmax_rows.INPUTS[op])]
                checked = sorted({*range(min(rows, 4)), *range(max(rows - 4, 0), rows)})
                expect = reference(op, [a[checked] for a in inputs])
                num_bytes = (len(inputs) + 1) * rows * cols * dtype.itemsize
                for label, chosen in candidates(op, rows, cols, short, target, args.only, args.extra_tail_packs):
                    median_us, gbs, fraction, error = tuning.measure(
                        launcher(chosen, inputs, out, device_id), out,
                        lambda result: float(cupy.abs(result[checked].astype(cupy.float64) - expect).max()), num_bytes)
                    print(f"{op:<16} {short:<4} {rows:>6}x{cols:<9} {label:<20} {median_us:>9.1f} us "
                          f"{gbs:>6.0f} GB/s {fraction:>6.1%}  err={error:.1e} {chosen.spec.name}",
                          flush=True)
            del arrays, out, inputs
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
