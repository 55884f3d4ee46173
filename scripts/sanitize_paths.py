"""Runs every kernel path once on small shapes, for compute-sanitizer
(memcheck, racecheck): python scripts/sanitize_paths.py.

Each shape is chosen to reach one path of the auto or OneFlow plans (printed
with the kernel name: for the norms, the main kernel of the plan with weight
and bias), forward and backward, softmax and the norms, and the non-last-axis
kernels and the long rows (a register tail; thread-block clusters on sm_90
and newer; split rows, prefetching, held partly in shared memory)."""
from __future__ import annotations

import cupy
import numpy

import cupyops
from cupyops.launch import Target, live_function
from cupyops.ops import norm as norm_ops
from cupyops.ops import norm_spec
from cupyops.ops import softmax_rows as softmax_ops
from cupyops.ops import softmax_axis, softmax_split

# (rows, cols): warp (rows of 3 and 7 cols in groups of one and two lanes
# holding several elements each), peeled registers (the norm forward's weight and bias
# realigned to each row's phase, also at different offsets, and at 12543
# cols 255 single elements past its packs in every row, no pack checked
# against the row (full_packs), at 3590 cols LayerNorm 16-bit's last pack a
# thread checked and RMSNorm 16-bit's every pack, at 20001 cols LayerNorm
# 16-bit's blocks of 416 threads (13 warps); more rows than a resident grid:
# the norm backward's blocks walking rows at their phase, its block reduction
# alternating halves of its partials with one barrier a row, its partial sums
# and weight copy in shared memory, 127 single elements past its packs; at
# 12543 cols LayerNorm's weight read from its phase copies; 16-bit rows of
# 1023 cols two at a time, the last pair of some blocks one row short; the
# forward's short peeled rows: one warp a row, two a block, the last block's
# second warp without a row at 7 x 255 and 2999 x 1023 (float32 1023: two
# warps a row), two warps at 16-bit 7 x 2055; the 16-bit backward's blocks
# fitted to rows of 3000 cols, 192 threads), registers, cp.async (the
# norms' 16-bit rows of 32768 cols whole in a register tail, 65536 cols a
# tail and shared memory, also with a residual), the norm backward's
# thread-block clusters of two sharing rows (67 x 32768: the first cluster
# walks two rows; 40001 cols peeled, without), and reading them twice with
# their partial sums in shared memory (float32 RMSNorm 3 x 65536 in
# clusters; 16-bit RMSNorm 3 x 40001 peeled in one block), shared memory
# (softmax rows of 20001 cols peeled: 16-byte packs between single-element
# edges), uncached, split rows; the forward warp lanes holding weight and
# bias, padded, at 300 x 1000
ROW_SHAPES = [(6, 3), (9, 7), (6, 100), (300, 1000), (2500, 4223), (40, 12543), (40, 3590), (40, 20001), (2999, 1023), (7, 255), (7, 2055),
              (40, 3000), (4, 4096), (600, 2048),
              (67, 32768), (3, 65536), (3, 40001), (2, 300000), (2, 1 << 19)]
# norm backward only (racecheck's host memory): float32 rows read twice in
# clusters of two, some clusters walking two rows
NORM_BACKWARD_SHAPES = [(70, 40000)]
DTYPES = (cupy.float16, cupy.float32)


def main():
    target = Target.live(cupy.cuda.runtime.getDevice())
    rng = cupy.random.default_rng(0)
    for dtype in DTYPES:
        short = "f16" if dtype == cupy.float16 else "f32"
        for rows, cols in ROW_SHAPES:
            x = rng.standard_normal((rows, cols), dtype=cupy.float32).astype(dtype)
            dy = rng.standard_normal((rows, cols), dtype=cupy.float32).astype(dtype)
            for op in softmax_ops.OPS:
                inputs = (dy, x) if op.endswith("_backward") else (x,)
                for policy in ("auto", "oneflow"):
                    split = softmax_split.plan(op, rows, cols, short, target) if policy == "auto" else None
                    chosen = split or softmax_ops.plan(op, rows, cols, short, policy, target)
                    print(f"{op:<21} {policy:<8} {rows}x{cols:<7} {chosen.spec.name}", flush=True)
                    getattr(cupyops, op)(*inputs, axis=-1, policy=policy)
            weight = rng.standard_normal(cols, dtype=cupy.float32).astype(dtype)
            bias_off_the_grid = rng.standard_normal(cols + 1, dtype=cupy.float32).astype(dtype)[1:]
            cupyops.layer_norm(x, weight, bias_off_the_grid)
            for policy in ("auto", "oneflow"):
                for op in norm_ops.OPS:
                    kernel = norm_ops.plan(op, rows, cols, short, policy, target).explain()["kernel"]
                    print(f"{op:<21} {policy:<8} {rows}x{cols:<7} {kernel}", flush=True)
                y, mean, rstd = cupyops.layer_norm(x, weight, weight, return_stats=True, policy=policy)
                cupyops.layer_norm(x, weight, weight, residual=dy, policy=policy)
                cupyops.layer_norm_backward(dy, x, mean, rstd, weight, policy=policy)
                y, rstd = cupyops.rms_norm(x, weight, return_stats=True, policy=policy)
                cupyops.rms_norm_backward(dy, x, rstd, weight, policy=policy)
        for rows, cols in NORM_BACKWARD_SHAPES:
            x = rng.standard_normal((rows, cols), dtype=cupy.float32).astype(dtype)
            dy = rng.standard_normal((rows, cols), dtype=cupy.float32).astype(dtype)
            weight = rng.standard_normal(cols, dtype=cupy.float32).astype(dtype)
            for op in norm_spec.BACKWARD_OPS:
                kernel = norm_ops.plan(op, rows, cols, short, "auto", target).explain()["kernel"]
                print(f"{op:<21} auto     {rows}x{cols:<7} {kernel}", flush=True)
            y, mean, rstd = cupyops.layer_norm(x, weight, weight, return_stats=True)
            cupyops.layer_norm_backward(dy, x, mean, rstd, weight)
            y, rstd = cupyops.rms_norm(x, weight, return_stats=True)
            cupyops.rms_norm_backward(dy, x, rstd, weight)
        # rows no block's shared memory holds (as many rows as SMs, else they
        # are split), one block with a register tail: forward rows of 256 KB,
        # backward rows of 128 KB of each input; forward rows of 8 x 64 KB and
        # of 7 x 64 KB and a pack, backward rows of 256 KB of each input, a
        # thread-block cluster per row (sm_90+) whose blocks hold register
        # tails, the last share shorter
        itemsize = cupy.dtype(dtype).itemsize
        rows = target.facts.sm_count
        for cols, ops in ((4 * 65536 // itemsize, ("softmax", "log_softmax")),
                          (2 * 65536 // itemsize, ("softmax_backward", "log_softmax_backward")),
                          (8 * 65536 // itemsize, ("softmax", "log_softmax")),
                          (7 * 65536 // itemsize + 16 // itemsize, ("softmax", "log_softmax")),
                          (4 * 65536 // itemsize, ("softmax_backward", "log_softmax_backward"))):
            x = rng.standard_normal((rows, cols), dtype=cupy.float32).astype(dtype)
            for op in ops:
                chosen = softmax_split.plan(op, rows, cols, short, target) or \
                    softmax_ops.plan(op, rows, cols, short, "auto", target)
                print(f"{op:<21} auto     {rows}x{cols:<7} {chosen.spec.name}", flush=True)
                getattr(cupyops, op)(*((x, x) if op.endswith("_backward") else (x,)), axis=-1)
        # rows off the 16-byte grid too long for shared memory, each row at its
        # own phase: 16-byte packs between peeled edges, read again (40 x 20001
        # above caches them), the row kernel launched directly (the split path
        # takes so few rows)
        rows, cols = 5, 4 * 65536 // itemsize + 1
        x = rng.standard_normal((rows, cols), dtype=cupy.float32).astype(dtype)
        for op in softmax_ops.OPS:
            chosen = softmax_ops.plan(op, rows, cols, short, "auto", target)
            print(f"{op:<21} auto     {rows}x{cols:<7} {chosen.spec.name}", flush=True)
            operands = (x, x, cupy.empty_like(x)) if op.endswith("_backward") else (x, cupy.empty_like(x))
            function = live_function(chosen.spec, x.device.id, chosen.smem_bytes)
            function(chosen.grid, chosen.block, (*operands, numpy.int64(rows), numpy.int64(cols),
                                                 *(numpy.int64(cols) for _ in operands)),
                     shared_mem=chosen.smem_bytes)
        # split rows held partly in shared memory, one round (forward: 8 rows of
        # 2^20 and a short last chunk of 12 columns; backward: 32 MB of each
        # input); more than one round a slot, the next row prefetched (float32
        # forward): 16-byte packs, and 4-byte packs with a short last chunk
        # (the input's rows one element apart from the output's phase: odd
        # rows at one phase take two launches, peeled); odd rows in two
        # launches, peeled
        forward, backward = ("softmax", "log_softmax"), ("softmax_backward", "log_softmax_backward")
        for rows, cols, ops, shift in ((8, 1 << 20, forward, 0), (8, (1 << 20) + 12, forward, 0),
                                       (16, 1 << 20, forward, 0), (16, (1 << 20) + 1, forward, 1),
                                       (8 * 2 // itemsize, 1 << 20, backward, 0),
                                       (3, (1 << 17) + 1, forward + backward, 0)):
            x = rng.standard_normal((rows, cols + shift), dtype=cupy.float32).astype(dtype)[:, shift:]
            for op in ops:
                chosen = softmax_split.plan(op, rows, cols, short, target, itemsize if shift else 16, not shift)
                print(f"{op:<21} auto     {rows}x{cols:<7} {chosen.spec.name}", flush=True)
                getattr(cupyops, op)(*((x, x) if op.endswith("_backward") else (x,)), axis=-1)
        x = rng.standard_normal((4, 4096, 64), dtype=cupy.float32).astype(dtype)
        dy = rng.standard_normal(x.shape, dtype=cupy.float32).astype(dtype)
        for axis in (0, 1):
            y = cupyops.softmax(x, axis=axis)
            cupyops.softmax_backward(dy, y, axis=axis)
            y = cupyops.log_softmax(x, axis=axis)
            cupyops.log_softmax_backward(dy, y, axis=axis)
        for shape in ((3, 700, 64), (8, 4096, 256)):   # backward axis tiles: cached, read twice
            x = rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)
            cupyops.softmax_backward(x, x, axis=1)
            cupyops.log_softmax_backward(x, x, axis=1)
        # axis tiles shared by thread-block clusters (sm_90+), forward and
        # backward: 4 or 8 blocks (float32 forward: a block alone); 8 blocks,
        # the last with fewer rows; 8 blocks of 64 KB and of 128 KB
        for shape in ((3, 1500, 256), (3, 4099, 64), (2, 16384, 256)):
            x = rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)
            for op in softmax_ops.OPS:
                inputs = (x, x) if op.endswith("_backward") else (x,)
                chosen = softmax_axis.plan(op, *shape, short, target)
                print(f"{op:<21} axis 1   {'x'.join(map(str, shape)):<15} {chosen.spec.name}", flush=True)
                getattr(cupyops, op)(*inputs, axis=1)
    cupy.cuda.Device().synchronize()
    print("all paths ran")


if __name__ == "__main__":
    main()
