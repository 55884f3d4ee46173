"""Times hand-built softmax plans against each other to choose the auto planner's tables.

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

from cupyops import dtypes, jit
from cupyops.launch import get_num_blocks
from cupyops.ops.row_packs import peeled_pack, vector_pack_size
from cupyops.ops.softmax_rows import INPUTS, SUM_INPUTS, SoftmaxSpec, async_share_bytes, plan, warp_ladder, warp_plan
from tuning import Tuning


def candidates(op, dtype, rows, cols, target):
    """(label, spec, grid, block, smem) for each variant worth timing at this shape."""
    ftype = dtypes.BY_SHORT[dtype]
    pack = vector_pack_size(cols, ftype.itemsize, 16)
    num_inputs = len(INPUTS[op])
    found = []
    for policy in ("auto", "oneflow"):
        chosen = plan(op, rows, cols, dtype, policy, target)
        found.append((policy, chosen.spec, chosen.grid, chosen.block, chosen.smem_bytes))
    for warp_pack in sorted({pack, 2, 4} & {p for p in (2, 4, 8) if p <= pack}):
        for max_cols_per_thread in (16, 32, 64):
            ladder = warp_ladder(cols, rows, warp_pack, max_cols_per_thread)
            if ladder is None or ladder[0] * num_inputs * 4 > 256:
                continue
            for rows_per_access in (1, 2):
                variant = (ladder[0], ladder[1], rows_per_access)
                warp = warp_plan(op, dtype, rows, cols, warp_pack, variant, target)
                found.append((f"warp p{warp_pack} c{ladder[0]} g{ladder[1]} r{rows_per_access}",
                              warp.spec, warp.grid, warp.block, 0))
    regs_pack, peel = peeled_pack(pack, ftype.itemsize, True)   # rows off the 16-byte grid: peel their edges
    num_packs = cols // regs_pack
    for block in (128, 256, 512, 1024):
        per_thread = -(-num_packs // block)
        if per_thread * regs_pack * 4 * num_inputs <= 256 and num_packs >= block // 2:
            for storage_cache in ((False, True) if ftype.itemsize == 2 else (False,)):
                spec = SoftmaxSpec(op, "block_regs", dtype, regs_pack, block_size=block,
                                   packs_per_thread=per_thread, peel=peel, storage_cache=storage_cache)
                grid = (get_num_blocks(target.facts, block, rows), 1, 1)
                label = f"regs b{block} k{per_thread}{' packed' if storage_cache else ''}"
                found.append((label, spec, grid, (block, 1, 1), 0))
    num_packs = cols // pack
    if pack * ftype.itemsize == 16 and cols >= 2048:
        for stages in (1, 2):
            for block in (128, 256, 512, 1024):
                for online in ((False, True) if num_inputs == 1 else (False,)):
                    spec = SoftmaxSpec(op, "block_async", dtype, pack, block_size=block, stages=stages,
                                       online=online)
                    smem = stages * async_share_bytes(spec, cols)
                    if num_packs < block or smem > target.facts.smem_per_block_optin:
                        continue
                    active = target.max_active_blocks(spec, block, smem, True)
                    if active:   # persistent (each resident block walks rows), or a block per row
                        grid = (min(rows, active * target.facts.sm_count), 1, 1)
                        label = f"async b{block} s{stages}{' online' if online else ''}"
                        found.append((label, spec, grid, (block, 1, 1), smem))
                        if stages == 1:
                            found.append((f"{label} per-row", spec, (rows, 1, 1), (block, 1, 1), smem))
    # shared memory and uncached rows in the row's own packs, and peeled (16-byte packs between the edges);
    # the shared memory caching every input, or those the sum reads
    layouts = ((pack, False),) + (((regs_pack, True),) if peel else ())
    for cached in sorted({num_inputs, SUM_INPUTS[op]}):
        smem = cached * cols * ftype.itemsize
        if cols < 8192 or smem > target.facts.smem_per_block_optin:
            continue
        for cache_pack, peeled in layouts:
            for block, min_blocks in ((256, 0), (512, 0), (1024, 0), (1024, 2)):
                spec = SoftmaxSpec(op, "block_smem", dtype, cache_pack, block_size=block, storage_cache=True,
                                   peel=peeled, min_blocks=min_blocks,
                                   cached_inputs=cached if cached < num_inputs else 0)
                if target.max_active_blocks(spec, block, smem, True) >= max(1, min_blocks):
                    grid = (get_num_blocks(target.facts, block, rows), 1, 1)
                    label = (f"smem b{block}{' peel' if peeled else ''}{f' mb{min_blocks}' if min_blocks else ''}"
                             f"{f' c{cached}' if cached < num_inputs else ''}")
                    found.append((label, spec, grid, (block, 1, 1), smem))
    if cols >= 32768:
        for cache_pack, peeled in layouts:
            for online in ((True, False) if num_inputs == 1 else (False,)):
                for block in ((256, 512, 1024) if peeled else (1024,)):
                    spec = SoftmaxSpec(op, "block_uncached", dtype, cache_pack, block_size=block, online=online,
                                       peel=peeled)
                    grid = (get_num_blocks(target.facts, block, rows), 1, 1)
                    label = f"uncached b{block} {'online' if online else 'passes'}{' peel' if peeled else ''}"
                    found.append((label, spec, grid, (block, 1, 1), 0))
    unique = {}
    for candidate in found:    # the first label of each launch (the policies come first)
        unique.setdefault((candidate[1].name, candidate[2]), candidate)
    return list(unique.values())


def reference(op, inputs):
    values = [a.astype(cupy.float64) for a in inputs]
    if op == "softmax_backward":
        dy, y = values
        return (dy - (dy * y).sum(axis=-1, keepdims=True)) * y
    if op == "log_softmax_backward":
        dy, y = values
        return dy - cupy.exp(y) * dy.sum(axis=-1, keepdims=True)
    shifted = values[0] - values[0].max(axis=-1, keepdims=True)
    if op == "softmax":
        e = cupy.exp(shifted)
        return e / e.sum(axis=-1, keepdims=True)
    return shifted - cupy.log(cupy.exp(shifted).sum(axis=-1, keepdims=True))


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
                generator = cupy.random.default_rng(0)
                inputs = [(generator.standard_normal((rows, cols), dtype=cupy.float32) * 3).astype(dtype)
                          for _ in INPUTS[op]]
                y = cupy.empty_like(inputs[0])
                expect = reference(op, [a[:64] for a in inputs])
                num_bytes = (len(inputs) + 1) * rows * cols * dtype.itemsize
                for label, spec, grid, block, smem in candidates(op, short, rows, cols, target):
                    if kinds and not label.startswith(kinds):
                        continue
                    raw = jit.kernel(spec, device_id)
                    if smem > 48 * 1024:
                        raw.max_dynamic_shared_size_bytes = smem
                    args_ = (*inputs, y, numpy.int64(rows), numpy.int64(cols),
                             *[numpy.int64(cols)] * (len(inputs) + 1))
                    run = lambda: raw(grid, block, args_, shared_mem=smem)  # noqa: E731
                    median_us, gbs, fraction, error = tuning.measure(
                        run, y, lambda result: float(cupy.abs(result[:64].astype(cupy.float64) - expect).max()), num_bytes)
                    print(f"{op:<11} {short:<4} rows={rows:<6} cols={cols:<7} {label:<18} "
                          f"{median_us:>9.1f} us {gbs:>6.0f} GB/s {fraction:>6.1%}  "
                          f"err={error:.1e} regs={raw.num_regs} {spec.name}", flush=True)
                del inputs, y
                cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
