"""layer_norm and rms_norm, forward and backward: plan -> launch -> public functions.

Forward paths (SPEC §5): "warp" (a row per group of lanes, registers),
"block_regs" (a row per block, registers; auto only), "block_async" (a row
per block of 16-byte packs, cached by cp.async in shared memory and a
register tail; auto only), "block_smem" (a row per block, shared memory)
and "block_uncached" (a row per block, read twice).
Statistics (kernels/welford.cuh), the same in both policies: paths that hold
the row in registers (warp, block_regs) sum it over the row's threads for the
mean, then sum the squared deviations from that mean (two exact passes, two
one-value reductions); the streaming paths (block_smem, block_uncached) take
each pack's (count, mean, m2) without a division per value and join them by
Chan's combine, as Welford's would. All of it on x - K with K
the row's first value (every thread of the row loads it; mean = K + shifted
mean, y = ((x - K) - shifted mean) * rstd): float32 statistics of the raw
values lose a std of 1e-2 under a mean of 1e4. RMSNorm sums squares.

policy="oneflow" reproduces OneFlow's layer_norm.cuh / rms_norm.cuh dispatch
(paths, packs, ladders, block sizes and grids, below); the kernels it launches
are ours, with the statistics above (OneFlow runs Welford's update per value;
the results agree within rounding):
- float64: uncached, always.
- cols <= 1024: warp path. pack 2 if cols is even (and the pointers allow
  it), else 1. Ladder: cols <= g * pack for g in 4, 8, 16, 32 ->
  cols_per_thread = pack, width g, two rows per access when rows is even;
  then cols <= max * 32 for (max, min) in (2, 1) [pack 1 only], (4, 2),
  (8, 4), (12, 8), ..., (32, 28) -> width 32, max_cols_per_thread = max;
  the first min / pack packs of a lane are read without a bounds check
  (min_cols_per_thread = max when cols == max * 32, i.e. no padding).
  Grid: GetNumBlocks with OneFlow's occupancy form, sm_count * active * 32.
- otherwise block_smem with cols * sizeof(compute) bytes when it can launch;
  pack 4, 2 or 1 (largest dividing cols). LayerNorm opts in beyond 48 KB and
  takes the first of 1024, 512, 256 with the occupancy of 128 (or any
  occupancy when rows <= SM count), else 128; RMSNorm does not opt in and
  takes the block size of highest occupancy (larger on ties).
- else block_uncached with 1024 threads.
- backward: dx the same way (smem caches dy and xhat: 2 * cols * sizeof(compute));
  dweight / dbias by a separate column-reduction kernel, as OneFlow does.

policy="auto" (default): 16-byte packs. Forward rows off the 16-byte grid
(every operand at the same phase) of at least AUTO_PEELED_SMALL_MIN_COLS
first take a peeled register block of one warp (two rows a block) or two
(the softmax's AUTO_PEELED_SMALL_* rule); then warp groups of 1 .. 32 lanes with two
rows per access (odd row counts included, the last row guarded) and lanes
holding up to 128 bytes (backward: 64), forward groups of a whole warp in
blocks of two warps bound to 18 blocks an SM (MIN_RESIDENT_THREADS); then the
register block path (forward:
rows that allow no 16-byte pack, e.g. odd cols, peel their edges and read
16-byte packs when every row operand has the same phase, weight and bias
realigned in registers, a thread's packs that every row fills unchecked
(full_packs); 16-bit LayerNorm rows may be held as loaded,
AUTO_PACKED_RUNG_BYTES, peeled ones first at block sizes fitted to the row,
AUTO_PEELED_FULL_PACKS, and peeled 16-bit RMSNorm rows are held as loaded,
AUTO_PEELED_PACKED_LADDER); then rows of 16-byte packs cached by cp.async
(AUTO_ASYNC_LADDER); then shared memory beyond 48 KB caching the storage
type; then uncached. Forward rows of 16-byte packs from AUTO_ASYNC_FIRST's
cols are cached by cp.async before the register block path; RMSNorm
bfloat16 rows of 16384 to 19999 cols go to shared memory first
(AUTO_SMEM_FIRST); rows of 16-byte packs from AUTO_REGS_FROM_COLS's cols
(1024: both norms in float32; with a residual also RMSNorm 16-bit,
AUTO_RESIDUAL_REGS_FROM_COLS) skip the warp path. Forward warp lanes with a
weight or bias and no residual read their columns' weight / bias once,
before their rows, under launch bounds that keep them in registers
(AUTO_HELD_AFFINE_*). The
backward pass folds dweight / dbias partial sums into the dx kernel while they
fit in registers or shared memory, in one wave of resident blocks (one
workspace row each): rungs that keep the row in registers or read it twice,
with the partial sums in registers or shared memory (AUTO_GRAD_BLOCK_LADDER;
16-bit rows first in the fewest whole warps that hold them, AUTO_GRAD_FITTED_ITEMSIZES;
rows on the 16-byte grid no block holds shared by a thread-block cluster of
two on sm_90 and newer, each block a rung's half of the row, AUTO_GRAD_CLUSTER_SIZES);
rows no held rung holds read twice, their partial sums in shared memory,
AUTO_GRAD_LONG_ROW_LADDER;
16-bit and float32 rows off the 16-byte grid peel (AUTO_GRAD_PEEL_ITEMSIZES),
on a grid of whole phase periods, with
the weight copied to shared memory at the rows' phase, or read from its
phase copies in global memory (AUTO_GRAD_PHASE_COPIES_FROM_BLOCK).

dweight / dbias are always reduced in the compute type to a workspace of
[parts, cols] partial sums, then summed by a second kernel in a fixed order:
the same inputs give bit-identical gradients on every run.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy

from .. import arrays, async_row, dtypes, jit, rowwise
from ..callcache import CallCache, call_key, run_on, writable
from ..device import WARP_SIZE, has_clusters
from ..launch import BLOCK_SIZE_LADDER, MAX_GRID_X, KernelLaunch, Target, choose_block_size, get_num_blocks
from . import norm_args
from .norm_launch import (BackwardLaunch, ForwardLaunch, backward_launch, forward_launch, run_backward,
                          run_forward)
from .softmax import (AUTO_PEELED_SMALL_BLOCKS, AUTO_PEELED_SMALL_MAX_PACKS, AUTO_PEELED_SMALL_MIN_COLS,
                      peeled_pack, peeled_small_rows_per_block, vector_pack_size)

FORWARD_OPS = ("layer_norm", "rms_norm")
BACKWARD_OPS = ("layer_norm_backward", "rms_norm_backward")
OPS = FORWARD_OPS + BACKWARD_OPS

WARP_BLOCK_THREADS = 128             # OneFlow's, and the backward's
# auto, forward, warp path with groups of a whole warp: blocks of two warps
# (the same kernel, but for its launch bounds: MIN_RESIDENT_THREADS). H200,
# rows 49152, % of copy against blocks of 128 threads, five interleaved
# rounds, bitwise the same output (both bound to 1024 threads an SM):
# LayerNorm 1024 cols f16 88.3 / 87.4 (another run 89.5 / 88.0), bf16 89.8 /
# 88.5, f32 93.1 / 92.7; 512 cols f16 77.2 / 76.4, f32 90.5 / 88.7; RMSNorm
# f32 512 cols 91.1 / 89.1; 128 .. 256 cols within -0.5 .. +1.6. Groups of 4
# or 8 lanes (32 cols) lost: RMSNorm f32 37.0 / 40.4, f16 23.8 / 24.5.
# Blocks of one warp: LayerNorm f16 1024 cols 89.2, 512 cols 66.8.
AUTO_FORWARD_WARP_BLOCK_THREADS = 64
UNCACHED_BLOCK_SIZE = 1024
PARAM_GRAD_BLOCK = (32, 32)          # kParamGradRows in kernels/norm.cuh
PARAM_GRADS = {"layer_norm": 2, "rms_norm": 1}   # dweight (and dbias)
# Threads per SM each kernel is compiled to leave room for (the second
# argument of __launch_bounds__): 64 registers a thread forward, 128 backward
# (dy, x and partial sums live in registers), 64 backward with the partial
# sums in shared memory (the registers hold rows in flight). auto's two-warp
# forward warp blocks: 18 an SM, 56 registers a thread, no spills (every
# instantiation up to 1024 cols). H200, rows 49152, five interleaved rounds
# against 16 blocks, bitwise the same output, % of copy: LayerNorm f16 512
# cols 78.9 / 77.0, bf16 78.5 / 76.4; 256 cols f16 61.5 / 60.3, bf16 61.1 /
# 60.4; f16 1024 cols with a residual (4 arrays counted) 90.9 / 89.3; the
# other LayerNorm and RMSNorm cols 128 .. 1024 within -0.3 .. +0.2.
MIN_RESIDENT_THREADS = {"forward": 1024, "forward_two_warp": 1152, "backward": 512,
                        "backward_smem_partials": 1024}
ONEFLOW_WARP_MAX_COLS = 1024

# OneFlow's warp ladder: group widths of the narrow stage, then the
# (max_cols_per_thread, min_cols_per_thread) rungs at width 32.
ONEFLOW_GROUP_WIDTHS = (4, 8, 16, 32)
ONEFLOW_COLS_PER_THREAD = ((2, 1), (4, 2), (8, 4), (12, 8), (16, 12), (20, 16), (24, 20),
                           (28, 24), (32, 28))
# OneFlow's smem path per op: (opt in beyond 48 KB, block-size rule).
ONEFLOW_SMEM_RULE = {"layer_norm": (True, "same_occupancy"), "rms_norm": (False, "max_occupancy")}

AUTO_GROUP_WIDTHS = (1, 2, 4, 8, 16, 32)
# auto, forward warp path with a weight or bias and no residual, from
# AUTO_HELD_AFFINE_FROM_COLS: each lane reads its columns' weight / bias
# before its rows (hold_affine), so their loads overlap x's instead of
# following the row's reduction. The packs held take registers: the
# kernel's own launch bounds first, then these resident threads an SM while
# they keep at least AUTO_HELD_AFFINE_MIN_BYTES_IN_FLIGHT of rows loading
# (resident threads x the bytes of row a lane holds), the first without
# local memory; none: weight and bias read at each store. H200, rows 49152,
# % of copy, five interleaved rounds, against reading them at the store
# (bitwise the same output; LayerNorm's statistics then two row-wide sums,
# norm_warp): LayerNorm f16 / bf16 1024 cols (768 threads)
# 90.5 / 90.4 against 89.5 / 89.7, 768 cols (1024 threads) 88.8 / 88.6
# against 86.6 / 86.8, 64 .. 512 cols +0.3 .. +2.4; f32 768 / 1000 cols (512
# threads) 94.9 / 94.8 against 92.8 / 91.3, 64 .. 640 cols +0.2 .. +4.9;
# RMSNorm 16-bit 64 .. 1000 cols +0.9 .. +2.9, f32 +0.0 .. +3.2. Another
# run's sweep: f16 1000 cols would need 512 threads (32 KB loading), 77.0
# against 87.5; 768 cols at 768 threads (36 KB) 86.1 against 88.4 at 1024;
# 32 cols lose 0.2 .. 1.8 points but LayerNorm f32 (+3.0). With a residual
# (x and residual loaded pack by pack, h stored) holding lost: LayerNorm
# f16 / bf16 1024 cols 83.0 against 90.8 (4 arrays counted), 512 cols
# -0.1 / -0.5.
AUTO_HELD_AFFINE_FROM_COLS = 64
AUTO_HELD_AFFINE_RESIDENT_THREADS = (1024, 768, 512)
AUTO_HELD_AFFINE_MIN_BYTES_IN_FLIGHT = 48 * 1024
# auto: the warp path while a lane holds at most this many bytes of compute
# values per row (the backward pass holds dy and xhat and partial sums).
AUTO_WARP_MAX_BYTES_PER_LANE = {"forward": 128, "backward": 64}
# auto, forward, by storage itemsize: (block_size, most bytes of compute values
# a thread holds, taken only when the kernel needs no local memory on the
# target). 32 floats a thread (four 16-byte packs of 16-bit input) measured
# fastest on an H200 (scripts/tune_norm.py: 94-97 % of copy at 8192 and 16384
# f16 columns, against 64-87 % holding 16); they sit at the 64-register bound
# of 1024 resident threads, where some (peeled, with a residual) spill: each
# rung is checked. 16-bit rows start at 64 threads: LayerNorm f16 2048 cols
# at 64 x 4 packs 92.8 % of copy, against 75.2 % at 128 x 2 (bf16 88.1 %
# against 70.6 %). float32 rows start at 64 threads holding at most 20
# floats (five packs: rows of up to 1280 cols; H200, rows 49152, % of copy,
# five interleaved rounds, 64 threads against 128: LayerNorm 1024 cols 94.7
# against 91.9, 1280 cols 95.4 against 94.2; RMSNorm 1024 95.3 against 95.7,
# 1280 96.3 against 96.1; 1100 / 1200 cols, 64 x 5 against 128 x 3: LayerNorm
# 93.5 / 94.2 against 88.3 / 91.0, RMSNorm 94.0 / 95.1 against 94.9 / 95.3;
# at 1536 cols, 64 x 6 packs, LayerNorm 95.6 against 96.5). 16 doubles a
# thread at most.
AUTO_BLOCK_REGS_LADDER = {
    2: ((64, 128, True), (128, 128, True), (256, 128, True), (512, 128, True), (1024, 128, True)),
    4: ((64, 80, True), (128, 128, True), (256, 128, True), (512, 128, True), (1024, 128, True)),
    8: ((128, 64, True), (256, 64, True), (512, 64, True), (1024, 64, True)),
}
# auto, forward: (op, dtype) -> from these cols, 16-byte packs, the row cached
# as stored in shared memory with 512 threads before the register rungs.
# RMSNorm bf16 (H200): 16384 cols 97.3 % of copy against 96.8 % in registers
# (512 x 4 packs), 32768 cols 96.7 % against 96.3 % (512 x 8 as loaded); a
# near tie since bfloat16 converts by a mov (common.cuh; 84.6 and 80.1 % in
# registers before). LayerNorm bf16 is slower there (84 % at 32768 cols).
# From 20000 cols the rows cached by cp.async come first (AUTO_ASYNC_FIRST).
AUTO_SMEM_FIRST = {("rms_norm", "bf16"): 16384}
# auto, forward, rows of 16-byte packs: the row's sources (x, and the
# residual) cached by cp.async (norm_block_async), a block a row, the packs
# a thread holds in registers (a register tail) and the rest in shared
# memory. A rung (block_size, most tail packs, blocks an SM) takes the
# largest tail up to `most` that leaves the rest within the opt-in limit,
# does not spill and leaves that many blocks resident (async_row.rung_spec).
# First, from the cols of AUTO_ASYNC_FIRST, before the register block path,
# the first of its rungs that holds the row: "whole" rungs only where the
# tail is the whole row (its packs a multiple of block_size, at most `most`
# a thread), "largest" rungs with their largest tail. H200, rows 49152, % of
# copy (scripts/tune_norm.py), against the register block path:
#   LayerNorm f16 / bf16: 32768 cols whole at 512 x 8 packs 98.9 / 98.5
#     against 86.7 / 85.4 (the same packs a thread as loaded, a block a row)
#     and 89.5 / 90.1 (1024 x 4 in float, auto before); 24576 cols at 512 x 6
#     100.0 / 99.8 against 96.5 / 95.8; 16384 cols at 256 x 8 97.0 / 97.0
#     against 96.2 / 95.9 (512 x 4: 94.1 / 92.7); not 20000 cols (2500
#     packs: 512 x 4 and the rest in shared memory 88.7 / 87.9 against 91.5
#     / 90.7 at 512 x 5 as loaded) nor 8192 (128 x 8 96.3 against 97.8);
#   LayerNorm f32: 16384 cols whole at 512 x 8 98.4 against 96.8, 8192 cols
#     at 512 x 4 98.6 against 96.5 (256 x 8: 97.4); 32768 cols stay in
#     registers, 91.9 against 86.6 at 1024 x 8;
#   RMSNorm f16 / bf16: 20000 cols at 512 x 4 and the rest in shared memory
#     99.0 / 99.0 against 83.8 (1024 x 3 in float) / 94.7 (cached through
#     registers in shared memory, AUTO_SMEM_FIRST); 24576 cols 512 x 2 99.1
#     / 99.3, 512 x 4 98.4 / 98.4, against 90.7 / 97.5; 32768 cols whole at
#     512 x 8 98.3 / 98.4 against 96.5 / 96.7 (float16 now takes 7 packs and
#     8 KiB, 8 spill: 98.0 in cupyops bench). RMSNorm f32 32768 cols stays
#     in registers: 97.8 against 96.9.
AUTO_ASYNC_FIRST = {   # (op, storage itemsize) -> (from cols, "whole" or "largest", rungs)
    ("layer_norm", 2): (16384, "whole", ((256, 8, 2), (512, 8, 2))),
    ("layer_norm", 4): (8192, "whole", ((512, 8, 2),)),
    ("rms_norm", 2): (20000, "largest", ((512, 8, 2),)),
}
AUTO_ASYNC_LADDER = {   # storage itemsize -> rungs
    2: ((512, 8, 2), (1024, 8, 1)),
    4: ((1024, 8, 1),),
    8: ((1024, 3, 1),),
}
# auto, forward: (op, storage itemsize) -> rows of these cols and more, in
# 16-byte packs, skip the warp path for the register block path; with a
# residual also AUTO_RESIDUAL_REGS_FROM_COLS. RMSNorm 16-bit at 1024 cols,
# 64 x 2 packs, against the warp path holding the weight (AUTO_HELD_AFFINE_*;
# H200, % of copy, five interleaved rounds): 90.0 / 89.9 (f16 / bf16)
# against 90.8 / 90.8 without a residual, 94.1 / 94.3 against 93.0 / 93.2
# with one (4 arrays counted); LayerNorm 16-bit: the warp path, 88 % against
# 70-76 % (before holding). float32 at 1024 cols, 64 x 4
# packs (H200, five interleaved rounds): LayerNorm 94.7 % against 92.5 % on
# the warp path, RMSNorm 95.3 % against 92.9 % (768 cols, 64 x 3: 92.9 / 93.3
# against 92.5 / 93.1, a tie).
AUTO_REGS_FROM_COLS = {("layer_norm", 4): 1024, ("rms_norm", 4): 1024}
AUTO_RESIDUAL_REGS_FROM_COLS = {("rms_norm", 2): 1024}
AUTO_SMEM_FIRST_BLOCK_SIZE = 512
# auto, forward: (op, storage itemsize) -> after each block size's rung of
# AUTO_BLOCK_REGS_LADDER, the same block size holding at most this many bytes
# of packs as loaded (packed: converted at each use): 16-bit LayerNorm rows
# too long for four float packs a thread but within seven packs take them
# rather than twice the threads with fewer packs each (H200, % of copy,
# f16 / bf16): 12288 cols 256 x 6 packs 97.0 / 95.2 against 89.5 / 87.0 at
# 512 x 3; 6144 cols 128 x 6 96.8 / 95.1 against 92.4 / 89.8; peeled 12345
# cols 256 x 7 89.2 / 85.8 against 78.6 / 75.3 at 512 x 4 (now 256 x 6 and 57
# single elements past the packs, block_packs_per_thread: 88.9 / 88.3
# against 87.3 / 85.4 at 256 x 7; peeled 14389 cols 256 x 7 92.8 / 89.1
# against 82.9 / 82.1 at 512 x 4 in float). Eight packs lose
# to four in float at twice the threads (16384 cols 91.2 against 96.2, 8192
# 95.4 against 96.8), so at most seven.
AUTO_PACKED_RUNG_BYTES = {("layer_norm", 2): 112}
# auto, forward, peeled rows (off the 16-byte grid, every operand at the same
# phase): (op, storage itemsize) -> (block_size, most bytes a thread holds of
# packs as loaded), in place of the ladders above. RMSNorm f16 (H200): 12345
# cols 256 x 7 packs 95.9 % of copy against 83.1 % at 512 x 4 in float (now
# 256 x 6 and single elements past the packs: 95.4 against 95.6); 4097
# cols 128 x 4 95.5 % (64 x 8: 91.9 %); 2049 cols 64 x 4 91.8 % (128 x 2:
# 85.5 %). LayerNorm takes its ladder: 2049 cols 64 x 4 in float 89.3 %
# against 80.5 % as loaded.
AUTO_PEELED_PACKED_LADDER = {("rms_norm", 2): ((64, 64), (128, 128), (256, 128), (512, 128), (1024, 128))}
# auto, forward, peeled rows of the other ops: (op, storage itemsize) -> the
# packed rungs of their ladder from this block size. LayerNorm f16 / bf16
# 3595 cols (H200): 128 x 4 packs in float 85.5 / 84.4 % of copy against
# 80.5 / 79.5 at 64 x 7 as loaded, every pack checked (64 x 7 with no pack
# checked comes first: AUTO_PEELED_FULL_PACKS).
AUTO_PEELED_PACKED_FROM_BLOCK = {("layer_norm", 2): 128}
# auto, forward, peeled rows: (op, storage itemsize) -> packs a thread holds
# as loaded, tried in order before the ladder, each at the fewest whole warps
# (at least AUTO_PEELED_FULL_MIN_BLOCK) that hold a row with one element a
# thread past the packs (fitted_block_size: not only powers of two), taken
# where every row fills every pack (none checked).
# LayerNorm f16 / bf16 (H200, % of copy): 16385 cols 288 x 7 95.2 / 95.0
# against 90.6 / 90.8 at 512 x 4 in float (3 packs full); 20001 cols 416 x 6
# 94.6 / 94.0 (352 x 7: 94.1 / 92.7) against 83.4 / 81.9 at 512 x 5, checked;
# 32767 cols 576 x 7 90.7 / 90.3 against 78.0 / 77.9 at 1024 x 4 in float;
# 2567 cols 64 x 5 92.6 / 92.0 against 79.2 / 75.5 at 128 x 3 in float;
# 3595 cols 64 x 7 90.5 / 90.3 against 90.6 / 89.5 at 128 x 4 in float.
AUTO_PEELED_FULL_PACKS = {("layer_norm", 2): (6, 7, 5)}
AUTO_PEELED_FULL_MIN_BLOCK = 64
# auto, backward: (block_size, most bytes of each input a thread holds as
# stored, "cached" (dy and x held in registers as loaded) or "reread" (loaded
# again for the second pass), where the dweight / dbias partial sums live,
# "regs" or "smem", cached rows loaded together), tried in order, taken where
# the kernel needs no local memory and its shared memory fits. Partial sums in
# shared memory leave the registers to rows in flight: two 512-thread blocks
# an SM instead of one. 16-bit rows of 513-1024 cols take 64 threads, two
# rows loaded together (one barrier for both): 1024 cols 81.8 % of copy
# (LayerNorm f16), 78.8 % (bf16), RMSNorm 81.9 % / 80.3 %, against 69.1 /
# 71.0 / 72.0 / 73.3 % at 128 x 1 pack, a row at a time.
# Measured (H200, fraction of copy; the register partials with the next row
# prefetched before in parentheses): LayerNorm f16 2048 cols 128 x 2 packs
# cached smem 84.3 % (72.8 %), 4096 cols 87.8 %, 8192 cols 87.9 % (62.8 %),
# 16384 cols 82.8 %; bfloat16 4096 / 8192 / 16384 cols 87.3 / 86.0 / 80.9 %;
# float32 2048 / 4096 / 16384 cols 95.1 / 97.7 / 99.0 %. RMSNorm (one
# partial sum a column) takes 64 bytes a thread first at 512 threads: 16384
# cols f16 95.8 % against 85.8 % at 1024 x 32 bytes, 12345 cols 91.7 %.
# LayerNorm takes 48 bytes at 512 threads (its partials, 96 KiB, leave two
# blocks an SM): 12288 cols f16 89.4 % against 68.5 % at 1024 x 32 bytes.
AUTO_GRAD_PEEL_ITEMSIZES = (2, 4)
# auto, backward, peeled rows: the weight is copied to shared memory where
# that leaves as many blocks resident, else read from its phase copies in
# global memory (H200, % of copy, shared copy against phase copies: RMSNorm
# f16 12345 cols 512 x 3 packs 92.9 / 89.5, bf16 16383 cols 512 x 4 94.2 /
# 91.0, f32 12345 cols 1024 x 3 98.1 / 94.9; LayerNorm f16 4097 cols 256 x 2
# 80.4 / 77.8; where the copy does not fit, LayerNorm f16 / bf16 12345 cols
# 512 x 3, phase copies 78.6 / 78.1 against 76.9 / 74.5 reading the weight
# at any offset). (family, itemsize) -> from this block size the phase
# copies are read even where a shared copy fits: LayerNorm f32 12345 cols
# 1024 x 3 92.2 against 87.5, 16383 cols 1024 x 4 93.8 against 76.1 (at
# 512 x 2, 4097 cols, the shared copy: 95.4 against 92.4).
AUTO_GRAD_PHASE_COPIES_FROM_BLOCK = {("layer_norm", 4): 1024}
_GRAD_LADDER = ((64, 32, "cached", "regs", 2), (128, 16, "cached", "regs", 1), (128, 32, "cached", "smem", 1),
                (256, 32, "cached", "smem", 1), (512, 32, "cached", "smem", 1), (1024, 32, "cached", "smem", 1),
                (1024, 64, "cached", "smem", 1), (512, 64, "reread", "regs", 1))


def _grad_ladder(rung_at_512: tuple) -> tuple:
    return _GRAD_LADDER[:5] + (rung_at_512,) + _GRAD_LADDER[5:]


AUTO_GRAD_BLOCK_LADDER = {"layer_norm": _grad_ladder((512, 48, "cached", "smem", 1)),
                          "rms_norm": _grad_ladder((512, 64, "cached", "smem", 1))}
# auto, backward with fused partials: storage itemsizes whose rows on the
# 16-byte grid (peeled rows keep their rungs' blocks, not measured fitted)
# first take the fewest whole warps (fitted_grad_block_size) that hold the row at
# the rung's packs a thread, then the rung's block (where the fitted one
# spills or leaves no block resident). H200, rows 49152, % of copy, against
# the power-of-two blocks (threads past the row idle): LayerNorm f16 1536 /
# 3000 / 5000 / 6000 / 10000 cols 81.8 / 83.6 / 84.2 / 86.5 / 83.9 against
# 70.7 / 73.5 / 68.3 / 75.9 / 81.2 (96 / 192 / 320 / 384 / 640 threads),
# bf16 3000 / 5000 84.6 / 84.1 against 74.3 / 67.3; RMSNorm f16 1536 / 3000
# / 5000 / 6000 85.6 / 83.2 / 88.8 / 90.9 against 79.2 / 72.8 / 67.6 / 74.3.
# float32 not measured: its fitted blocks (960 threads at 12345 cols) spill
# under the launch bounds' rounding up (MIN_RESIDENT_THREADS).
# A fitted block that needs local memory under launch bounds of
# MIN_RESIDENT_THREADS rounded up to whole blocks (864 threads: two blocks an
# SM, 32 registers a thread) is tried again with them rounded down (one
# block, 72 registers; spec field min_blocks) before the rung's power-of-two
# block. H200, rows 49152, % of copy, 3 rounds, rounded down against the
# power-of-two block: LayerNorm f16 6912 / 10240 / 12800 / 14080 / 17408 /
# 20000 / 22016 cols 84.1 / 87.6 / 74.5 / 77.9 / 81.0 / 75.1 / 76.4 against
# 82.2 / 86.6 / 70.6 / 75.5 / 73.9 / 70.7 / 70.0, 40000 (clusters of two, 864
# threads) 66.8 against 57.6; bf16 12800 / 20000 73.8 / 76.0 against 72.4 /
# 71.0; RMSNorm (5 rounds) f16 / bf16 17408 cols 87.9 / 88.9 against 86.3 /
# 87.3, 40000 83.4 / 84.0 against 73.0 / 79.8, 12800 +0.8 / +0.2, 20000 and
# 22016 -0.3 .. -1.0 (taken: the same rule for both norms).
AUTO_GRAD_FITTED_ITEMSIZES = (2,)
AUTO_GRAD_FITTED_MIN_BLOCK = 64
# auto, backward with fused partials: rows on the 16-byte grid that no rung
# of one block holds are shared by the blocks of a thread-block cluster
# (sm_90 and newer) of the first of these sizes where a rung holds each
# block's span of the row (a cluster_size-th, in whole packs); the blocks
# combine their row sums through distributed shared memory. H200, rows
# 49152, cupyops bench, % of copy, against the dx kernel alone and the
# column reduction (before): LayerNorm f16 / bf16 32768 cols 75.3 / 75.3
# against 44.7 / 43.0, f32 20000 / 24576 / 32768 85.7 / 94.5 / 94.0 against
# 52.5 / 52.6 / 47.7, f64 8192 79.1 against 60.0; RMSNorm f16 / bf16 32768
# 92.3 / 95.1 against 43.4 / 43.0, f32 24576 / 32768 91.8 / 90.4 against
# 52.6 / 47.7. Only clusters of two: a block walks its rows and writes one
# workspace row, so every cluster must be resident at once, and the driver
# counts 30 of 33 clusters of four (15 of 16 of eight) at one 1024-thread
# block an SM, where clusters of two fill the SMs in pairs (66 of 66, and
# 132 of 132 at two blocks an SM). One block wins where it holds the row
# (A/B, 3 rounds: RMSNorm f16 16384 cols 95.1 against 83.3 in a cluster,
# LayerNorm f32 16384 97.3 against 84.6), but for LayerNorm 16-bit rows
# of 24576 cols (76.5 against 80.7 in a cluster; 20000 cols: a tie).
AUTO_GRAD_CLUSTER_SIZES = (2,)
# auto, backward with fused partials: rows that no held rung holds, in one
# block or a cluster, read dy and x twice (the second time from L2) with
# the partial sums in shared memory (which bounds the row: LayerNorm
# float32 28672 cols a block): rows on the 16-byte grid in a cluster of
# AUTO_GRAD_CLUSTER_SIZES (sm_90 and newer), then one block; peeled rows
# in one block. H200, rows 49152, % of copy, against the dx kernel and the
# column reduction: LayerNorm f32 20001 / 24577 / 40000 / 49152 / 57344 cols
# 67.0 / 65.7 / 68.8 / 71.9 / 58.4 against 44.5 / 46.3 / 45.1 / 44.6 /
# 44.0, f64 16384 / 24576 77.1 / 69.6 against 49.1 / 45.0; RMSNorm f32
# 20001 / 32767 / 40000 / 65536 67.6 / 65.8 / 68.9 / 66.3 against 43.7 /
# 34.9 / 45.9 / 43.6, f16 49151 / 98304 64.9 / 69.8 against 27.7 / 36.0,
# bf16 40001 64.1 against 31.2, f64 16384 / 32768 75.2 / 65.8 against 48.9
# / 44.2. A cluster before one block: RMSNorm f64 16384 cols 75.2 against
# 67.7. Unpeeled rows off the 16-byte grid keep the dx kernel: LayerNorm
# f16 28001 cols (too long to peel) 27.3 in one block of 1-element packs
# against 29.6.
AUTO_GRAD_LONG_ROW_LADDER = ((1024, 128, "reread", "smem", 1),)
# Where a backward register block reads the weight (kernels/norm.cuh,
# WEIGHT_*): name -> (device constant, kernel name suffix). Peeled rows read
# a copy (fused_grad_launch picks it), rows on the 16-byte grid the weight.
WEIGHT_SOURCES = {"direct": ("WEIGHT_DIRECT", ""), "shared_copy": ("WEIGHT_SHARED_COPY", "_wcopy"),
                  "phase_copies": ("WEIGHT_PHASE_COPIES", "_wphases")}
WEIGHT_PHASES_BLOCK = 256
# unfused column reduction: aim for this many 1024-thread blocks per SM.
PARAM_GRAD_BLOCKS_PER_SM = 8


def family_of(op: str) -> str:
    """The norm family of a kernel op: "layer_norm_grad" -> "layer_norm"."""
    return op.removesuffix("_grad")


def _affine_suffix(weight: bool, bias: bool) -> str:
    return {(True, True): "_affine", (True, False): "_weight", (False, True): "_bias"}.get((weight, bias), "")


@dataclass(frozen=True)
class NormSpec(jit.KernelSpec):
    """One norm kernel. op: layer_norm / rms_norm (forward), layer_norm_grad /
    rms_norm_grad (dx), layer_norm_param_grad / rms_norm_param_grad (column
    partial sums) or norm_param_grad_finish."""

    op: str
    impl: str
    dtype: str                       # short name of the storage type
    pack_size: int = 1
    cols_per_thread: int = 0         # warp: max_cols_per_thread
    min_cols_per_thread: int = 0     # warp: packs below it need no bounds check
    thread_group_width: int = 0      # warp
    rows_per_access: int = 1         # warp; backward block_regs, cached: rows loaded together
    padding: bool = False            # warp
    hold_affine: bool = False        # forward warp: lanes read their columns' weight / bias once, before their rows
    block_size: int = 0              # block paths; warp: threads a block (0: WARP_BLOCK_THREADS)
    packs_per_thread: int = 0        # block_regs
    rows_per_block: int = 1          # forward block_regs of 32 threads: rows a block, a warp each
    packed_cache: bool = False       # forward block_smem: cache the storage type
    peel: bool = False               # block_regs: rows start off the 16-byte grid
    packed: bool = False             # forward block_regs: the row held as loaded (storage type)
    full_packs: int = 0              # forward block_regs: a thread's first packs, which every row fills (unchecked)
    tail_packs: int = 0              # forward block_async: packs a thread holds in registers
    cached: bool = True              # backward block_regs: dy / x kept in registers as loaded
    smem_partials: bool = False      # backward block_regs, fused: dweight / dbias partials in shared memory
    weight_source: str = "direct"    # backward block_regs, peeled: where the weight is read (WEIGHT_SOURCES)
    weight: bool = False
    bias: bool = False
    residual: bool = False
    fuse_param_grad: bool = False    # backward: dweight / dbias partials in the dx kernel
    cluster_size: int = 1            # backward block_regs, fused: blocks of a thread-block cluster sharing a row
    min_blocks: int = 0              # __launch_bounds__' blocks an SM where not MIN_RESIDENT_THREADS rounded up

    def __post_init__(self):
        if self.cluster_size > 1 and not (self.op in ("layer_norm_grad", "rms_norm_grad")
                                          and self.impl == "block_regs" and not self.peel):
            raise ValueError(f"only the backward register block shares rows on the 16-byte grid in a cluster, "
                             f"not {self.op} {self.impl}{' peeled' if self.peel else ''}")

    @property
    def ftype(self) -> dtypes.FloatType:
        return dtypes.BY_SHORT[self.dtype]

    @property
    def centered(self) -> bool:
        return self.op.startswith("layer_norm")

    @property
    def template(self) -> str:
        return "norm.cu.j2" if self.op in FORWARD_OPS else "norm_grad.cu.j2"

    @property
    def name(self) -> str:
        types = f"{self.dtype}_{self.ftype.compute}"
        if self.impl in ("param_grad", "param_grad_finish"):
            return f"{self.op}_{types}"
        if self.impl == "weight_phases":
            return f"{self.op}_{self.dtype}_p{self.pack_size}"
        head = f"{self.op}_{self.impl}_{types}_p{self.pack_size}"
        if self.impl == "warp":
            cols = f"c{self.cols_per_thread}"
            if self.min_cols_per_thread != self.cols_per_thread:
                cols += f"m{self.min_cols_per_thread}"
            pad = "pad" if self.padding else "nopad"
            path = f"_{cols}_g{self.thread_group_width}_r{self.rows_per_access}_{pad}"
            path += f"_b{self.block_size}" if self.block_size else ""
            path += f"_mb{self.min_blocks}" if self.min_blocks else ""
            path += "_held" if self.hold_affine else ""
        elif self.impl == "block_regs":
            path = f"_k{self.packs_per_thread}_b{self.block_size}"
            path += f"x{self.rows_per_block}" if self.rows_per_block > 1 else ""
            path += f"_c{self.cluster_size}" if self.cluster_size > 1 else ""
            path += f"_mb{self.min_blocks}" if self.min_blocks else ""
            path += "_peel" if self.peel else ""
            path += "_packed" if self.packed else ""
            path += f"_full{self.full_packs}" if self.full_packs else ""
            if self.op not in FORWARD_OPS:
                path += "_cached" if self.cached else "_reread"
                path += f"_r{self.rows_per_access}" if self.rows_per_access > 1 else ""
                path += WEIGHT_SOURCES[self.weight_source][1]
        elif self.impl == "block_async":
            path = f"_b{self.block_size}" + (f"_t{self.tail_packs}" if self.tail_packs else "")
        elif self.impl == "block_smem" and self.op in FORWARD_OPS:
            path = f"_b{self.block_size}_cache{self.cache_ftype.short}"
        else:
            path = f"_b{self.block_size}"
        flags = _affine_suffix(self.weight, self.bias)
        flags += "_residual" if self.residual else ""
        flags += ("_pgradsmem" if self.smem_partials else "_pgrad") if self.fuse_param_grad else ""
        return head + path + flags

    @property
    def elements_past_packs(self) -> bool:
        """A peeled register block: up to block_size single elements past a
        row's packs (block_packs_per_thread)."""
        return self.peel

    @property
    def cache_ftype(self) -> dtypes.FloatType:
        return self.ftype if self.packed_cache else dtypes.BY_SHORT[self.ftype.compute]

    @property
    def threads_per_block(self) -> int:
        if self.impl == "warp":
            return self.block_size or WARP_BLOCK_THREADS
        if self.impl in ("param_grad", "param_grad_finish"):
            return PARAM_GRAD_BLOCK[0] * PARAM_GRAD_BLOCK[1]
        if self.impl == "weight_phases":
            return WEIGHT_PHASES_BLOCK
        return self.block_size * self.rows_per_block

    @property
    def resident_threads(self) -> int:
        """The threads an SM this kind of kernel is compiled to leave room
        for (MIN_RESIDENT_THREADS)."""
        if self.op in FORWARD_OPS:
            two_warp = self.impl == "warp" and self.block_size == AUTO_FORWARD_WARP_BLOCK_THREADS
            kind = "forward_two_warp" if two_warp else "forward"
        else:
            kind = "backward_smem_partials" if self.smem_partials else "backward"
        return MIN_RESIDENT_THREADS[kind]

    @property
    def min_blocks_per_sm(self) -> int:
        """__launch_bounds__' second argument: resident_threads in whole
        blocks, rounded up, so ptxas neither spills to reach full occupancy
        nor spends registers past it; or min_blocks where set (a fitted
        backward block rounding down, first_grad_rung)."""
        return self.min_blocks or _ceil_div(self.resident_threads, self.threads_per_block)

    def explain_extra(self) -> dict:
        return {"min_cols_per_thread": self.min_cols_per_thread}

    def template_args(self) -> dict:
        return {**super().template_args(), "storage_type": self.ftype.c_type,
                "compute_type": self.ftype.compute_c_type, "cache_type": self.cache_ftype.c_type,
                "centered": self.centered, "min_blocks_per_sm": self.min_blocks_per_sm,
                "weight_source_constant": WEIGHT_SOURCES[self.weight_source][0]}


@dataclass(frozen=True)
class NormPlan:
    """Forward: one kernel."""
    main: KernelLaunch

    @property
    def spec(self) -> NormSpec:
        return self.main.spec

    @property
    def launches(self) -> tuple:
        return (self.main,)

    def explain(self) -> dict:
        return self.main.explain()


@dataclass(frozen=True)
class NormGradPlan:
    """Backward: the weight's phase copies when the dx kernel reads them, the
    dx kernel (partials fused or not), the column reduction when not fused,
    and the kernel that sums the [parts, cols] partials."""
    main: KernelLaunch
    param_grad: Optional[KernelLaunch]
    finish: Optional[KernelLaunch]
    num_parts: int                 # workspace rows of partial sums
    rows_per_chunk: int            # rows per workspace row of the column reduction
    weight_phases: Optional[KernelLaunch] = None

    @property
    def spec(self) -> NormSpec:
        return self.main.spec

    @property
    def launches(self) -> tuple:
        return tuple(k for k in (self.weight_phases, self.main, self.param_grad, self.finish) if k is not None)

    def explain(self) -> dict:
        info = self.main.explain()
        if self.finish is not None:
            info["param_grad"] = "fused" if self.param_grad is None else self.param_grad.spec.name
            info["workspace_rows"] = self.num_parts
            info["finish_kernel"] = self.finish.spec.name
        if self.weight_phases is not None:
            info["weight_phases_kernel"] = self.weight_phases.spec.name
        return info


# -- planning ----------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_packs_per_thread(cols: int, block_size: int, pack_size: int, elements_past_packs: bool) -> int:
    """Packs of pack_size a thread of a register block holds of a row: enough
    for every pack of the row, or, where the kernel takes single elements
    past the packs (peeled rows: BlockRowColumns in kernels/norm.cuh), the
    fewest that leave at most block_size of them:
    cols <= block_size * (packs * pack_size + 1)."""
    if elements_past_packs:
        return max(1, _ceil_div(cols - block_size, block_size * pack_size))
    return _ceil_div(cols // pack_size, block_size)


def _fewest_warps(items: int, items_per_thread: int, least: int) -> int:
    """The fewest threads, in whole warps and at least `least`, holding
    `items` at items_per_thread a thread."""
    return max(least, WARP_SIZE * _ceil_div(items, WARP_SIZE * items_per_thread))


def fitted_block_size(cols: int, pack_size: int, packs_per_thread: int) -> int:
    """The fewest threads, in whole warps and at least
    AUTO_PEELED_FULL_MIN_BLOCK, that hold a peeled row of `cols` at
    packs_per_thread packs a thread and one single element each past the
    packs (block_packs_per_thread)."""
    return _fewest_warps(cols, packs_per_thread * pack_size + 1, AUTO_PEELED_FULL_MIN_BLOCK)


def fitted_grad_block_size(cols: int, pack_size: int, packs_per_thread: int) -> int:
    """The fewest threads, in whole warps and at least
    AUTO_GRAD_FITTED_MIN_BLOCK, that hold a row of `cols` (whole packs) at
    packs_per_thread packs a thread."""
    return _fewest_warps(cols // pack_size, packs_per_thread, AUTO_GRAD_FITTED_MIN_BLOCK)


def full_packs_per_thread(cols: int, block_size: int, pack_size: int, peel: bool) -> int:
    """How many packs of each thread of a register block every row of `cols`
    fills (a peeled row at any phase: up to pack_size - 1 elements before its
    first pack)."""
    fewest_packs = (cols - (pack_size - 1)) // pack_size if peel else cols // pack_size
    return fewest_packs // block_size


def cluster_shares_rows(spec: NormSpec, cols: int) -> bool:
    """Whether the blocks of a backward register kernel's cluster, each
    owning a span of block_size x packs_per_thread packs (BlockRowColumns in
    kernels/norm.cuh), together cover a row of `cols` (whole packs) and each
    own a part of it."""
    span_packs = spec.block_size * spec.packs_per_thread
    num_packs, whole = divmod(cols, spec.pack_size)
    return whole == 0 and (spec.cluster_size - 1) * span_packs < num_packs <= spec.cluster_size * span_packs


@functools.lru_cache(maxsize=4096)
def check_block_covers(spec: NormSpec, cols: int) -> None:
    """Refuses a register block plan whose threads would not reach every
    column of a row, or that leaves packs unchecked (full_packs) which a row
    may not fill (a hand-built spec; the planner's never do)."""
    if spec.impl != "block_regs":
        return
    if spec.cluster_size > 1:
        if not cluster_shares_rows(spec, cols):
            raise ValueError(f"{spec.name} does not leave each block of its cluster a part of rows of "
                             f"{cols} columns")
    elif spec.packs_per_thread < block_packs_per_thread(cols, spec.block_size, spec.pack_size,
                                                        spec.elements_past_packs):
        raise ValueError(f"{spec.name} holds too few packs a thread for rows of {cols} columns")
    if spec.full_packs > min(spec.packs_per_thread,
                             full_packs_per_thread(cols, spec.block_size, spec.pack_size, spec.peel)):
        raise ValueError(f"{spec.name} leaves {spec.full_packs} packs a thread unchecked, "
                         f"but rows of {cols} columns fill fewer")


def oneflow_warp_ladder(cols: int, rows: int, pack_size: int):
    """OneFlow's (max_cols_per_thread, min_cols_per_thread, width, rows_per_access)."""
    for width in ONEFLOW_GROUP_WIDTHS:
        if cols <= width * pack_size:
            return pack_size, 0, width, 2 if rows % 2 == 0 else 1
    for max_cols, min_cols in ONEFLOW_COLS_PER_THREAD:
        if max_cols % pack_size == 0 and min_cols % pack_size == 0 and cols <= max_cols * 32:
            return max_cols, min_cols, 32, 1
    return None


def auto_warp_ladder(cols: int, pack_size: int, max_cols_per_thread: int):
    """auto's (max_cols_per_thread, min_cols_per_thread, width, rows_per_access):
    groups of 1 .. 32 lanes reading two rows at a time, then cols_per_thread
    growing by pack_size; min is the exact number of columns every lane has."""
    for width in AUTO_GROUP_WIDTHS:
        if cols <= width * pack_size:
            return pack_size, (cols // (width * pack_size)) * pack_size, width, 2
    for cols_per_thread in range(2 * pack_size, max_cols_per_thread + 1, pack_size):
        if cols <= cols_per_thread * 32:
            return cols_per_thread, (cols // (32 * pack_size)) * pack_size, 32, 1
    return None


def _oneflow_grid(target: Target, spec: NormSpec, block_threads: int, smem: int, opt_in: bool,
                  max_blocks: int) -> int:
    """OneFlow's layer_norm GetNumBlocks: sm_count * active blocks per SM * 32 waves."""
    active = target.max_active_blocks(spec, block_threads, smem, opt_in)
    return max(1, min(max_blocks, target.facts.sm_count * active * 32))


def _warp_launch(spec_fields: dict, rows: int, cols: int, pack_size: int, ladder, target: Target,
                 policy: str, smem_per_group_col: int = 0, block_threads: int = 0) -> KernelLaunch:
    """block_threads: threads a block, 0 for WARP_BLOCK_THREADS (and a name without it)."""
    max_cols, min_cols, width, rows_per_access = ladder
    padding = cols != max_cols * width
    spec = NormSpec(impl="warp", pack_size=pack_size, cols_per_thread=max_cols,
                    min_cols_per_thread=min_cols if padding else max_cols, thread_group_width=width,
                    rows_per_access=rows_per_access, padding=padding, block_size=block_threads,
                    **spec_fields)
    groups_per_block = spec.threads_per_block // width
    smem = smem_per_group_col * groups_per_block * cols
    if policy == "oneflow":
        needed = _ceil_div(rows // rows_per_access, groups_per_block)
        grid = _oneflow_grid(target, spec, spec.threads_per_block, smem, False, needed)
    else:
        needed = _ceil_div(_ceil_div(rows, rows_per_access), groups_per_block)
        grid = get_num_blocks(target.facts, spec.threads_per_block, needed)
    return KernelLaunch(spec, (width, groups_per_block, 1), (grid, 1, 1), smem)


def _block_launch(spec: NormSpec, rows: int, smem: int, target: Target, policy: str,
                  opt_in: bool) -> KernelLaunch:
    if policy == "oneflow":
        grid = _oneflow_grid(target, spec, spec.block_size, smem, opt_in, rows)
    else:
        grid = get_num_blocks(target.facts, spec.threads_per_block,
                              _ceil_div(rows, spec.rows_per_access * spec.rows_per_block))
    return KernelLaunch(spec, (spec.block_size, spec.rows_per_block, 1), (grid, 1, 1), smem)


def _max_occupancy_block_size(target, spec_of, smem: int, opt_in: bool) -> Optional[int]:
    """OneFlow's RMSNorm rule: the block size with the most active blocks per
    SM, trying 1024, 512, 256, 128 and keeping the first maximum."""
    best, best_active = None, 0
    for block_size in (*BLOCK_SIZE_LADDER, 128):
        active = target.max_active_blocks(spec_of(block_size), block_size, smem, opt_in)
        if active > best_active:
            best, best_active = block_size, active
    return best


def _smem_launch(spec_fields, rows, cols, pack_size, smem, target, policy, opt_in, rule,
                 packed_cache=False) -> Optional[KernelLaunch]:
    def spec_of(block_size):
        return NormSpec(impl="block_smem", pack_size=pack_size, block_size=block_size,
                        packed_cache=packed_cache, **spec_fields)

    if rule == "max_occupancy":
        block_size = _max_occupancy_block_size(target, spec_of, smem, opt_in)
    else:
        few_rows = policy == "oneflow" and rows <= target.facts.sm_count
        block_size = choose_block_size(target, spec_of, smem, opt_in, accept_any=few_rows)
    if block_size is None:
        return None
    return _block_launch(spec_of(block_size), rows, smem, target, policy, opt_in)


def _uncached_launch(spec_fields, rows, pack_size, target, policy) -> KernelLaunch:
    spec = NormSpec(impl="block_uncached", pack_size=pack_size, block_size=UNCACHED_BLOCK_SIZE,
                    **spec_fields)
    return _block_launch(spec, rows, 0, target, policy, False)


def _oneflow_block_pack(cols: int, itemsize: int, align: int) -> int:
    """OneFlow's block paths: pack 4, 2 or 1, the largest dividing cols (and the alignment)."""
    for pack in (4, 2):
        if cols % pack == 0 and pack * itemsize <= align:
            return pack
    return 1


def _oneflow_main(family, spec_fields, rows, cols, align, target, smem_arrays) -> KernelLaunch:
    ftype = dtypes.BY_SHORT[spec_fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    block_pack = _oneflow_block_pack(cols, ftype.itemsize, align)
    if ftype.short != "f64":
        if cols <= ONEFLOW_WARP_MAX_COLS:
            pack = 2 if cols % 2 == 0 and align >= 2 * ftype.itemsize else 1
            ladder = oneflow_warp_ladder(cols, rows, pack)
            return _warp_launch(spec_fields, rows, cols, pack, ladder, target, "oneflow")
        opt_in, rule = ONEFLOW_SMEM_RULE[family]
        launch = _smem_launch(spec_fields, rows, cols, block_pack, smem_arrays * cols * compute_itemsize,
                              target, "oneflow", opt_in, rule)
        if launch is not None:
            return launch
    return _uncached_launch(spec_fields, rows, block_pack, target, "oneflow")


def _uses_local_memory(spec: NormSpec, target: Target) -> bool:
    """Whether the kernel spills (or keeps a stack) when compiled for the target."""
    return target.resources(spec)["local_bytes"] > 0


def _auto_registers(fields, rows, cols, align, target, direction, block_ladder, peel_allowed=False,
                    peeled_ladder=None):
    """auto's warp path, else its register block path: (launch or None, pack size).

    block_ladder: (block_size, most bytes a thread holds (compute values, or
    packs as loaded with packed=True), extra spec fields, only without local
    memory), tried in order. peel_allowed: every row operand starts at the
    same offset from a 16-byte boundary, so a register block whose rows allow
    no 16-byte pack peels each row's edges and reads 16-byte packs, trying
    peeled_ladder (default block_ladder)."""
    ftype = dtypes.BY_SHORT[fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    pack = vector_pack_size(cols, ftype.itemsize, align)
    max_cols_per_thread = max(AUTO_WARP_MAX_BYTES_PER_LANE[direction] // compute_itemsize, pack)
    regs_pack, peel = peeled_pack(pack, ftype.itemsize, peel_allowed)
    if peel and cols >= AUTO_PEELED_SMALL_MIN_COLS:
        small_rungs = [(block_size, AUTO_PEELED_SMALL_MAX_PACKS * regs_pack * compute_itemsize,
                        {"rows_per_block": peeled_small_rows_per_block(block_size)}, True)
                       for block_size in AUTO_PEELED_SMALL_BLOCKS]
        launch = _first_register_rung(fields, rows, cols, target, direction, small_rungs, regs_pack, peel)
        if launch is not None:
            return launch, pack
    ladder = auto_warp_ladder(cols, pack, max_cols_per_thread)
    regs_tables = (AUTO_REGS_FROM_COLS, AUTO_RESIDUAL_REGS_FROM_COLS if fields.get("residual") else {})
    regs_first = pack * ftype.itemsize == 16 and any(
        cols >= table.get((fields["op"], ftype.itemsize), cols + 1) for table in regs_tables)
    if ladder is not None and not regs_first:
        group_width = ladder[2]
        two_warp = direction == "forward" and group_width == WARP_SIZE
        block_threads = AUTO_FORWARD_WARP_BLOCK_THREADS if two_warp else 0
        launch = _warp_launch(fields, rows, cols, pack, ladder, target, "auto", block_threads=block_threads)
        if direction == "forward":
            launch = _held_affine(launch, cols, target)
        return launch, pack
    rungs = (peeled_ladder or block_ladder) if peel else block_ladder
    return _first_register_rung(fields, rows, cols, target, direction, rungs, regs_pack, peel), pack


def _held_affine(launch: KernelLaunch, cols: int, target: Target) -> KernelLaunch:
    """The forward warp launch with its lanes holding weight and bias
    (AUTO_HELD_AFFINE_*), or the launch as given."""
    spec = launch.spec
    if not (spec.weight or spec.bias) or spec.residual or cols < AUTO_HELD_AFFINE_FROM_COLS:
        return launch
    row_bytes_a_lane = spec.cols_per_thread * spec.rows_per_access * spec.ftype.itemsize
    bounds = [0] + [resident // spec.threads_per_block for resident in AUTO_HELD_AFFINE_RESIDENT_THREADS
                    if resident < spec.resident_threads
                    and resident * row_bytes_a_lane >= AUTO_HELD_AFFINE_MIN_BYTES_IN_FLIGHT]
    for min_blocks in bounds:
        held = replace(spec, hold_affine=True, min_blocks=min_blocks)
        if not _uses_local_memory(held, target):
            return replace(launch, spec=held)
    return launch


def _first_register_rung(fields, rows, cols, target, direction, rungs, regs_pack, peel) -> Optional[KernelLaunch]:
    """The register block launch of the first of `rungs` (as _auto_registers
    takes them) that holds the row, or None."""
    ftype = dtypes.BY_SHORT[fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    for block_size, max_bytes, extra, spill_checked in rungs:
        packs_per_thread = block_packs_per_thread(cols, block_size, regs_pack, peel)
        held_itemsize = ftype.itemsize if extra.get("packed") else compute_itemsize
        if packs_per_thread * regs_pack * held_itemsize <= max_bytes:
            # Peeled forward rows leave unchecked the packs every row fills at
            # every phase (H200, % of copy, against every pack checked:
            # LayerNorm f16 / bf16 12345 cols 256 x 6 packs as loaded, all
            # full, 95.8 / 96.0 against 90.1 / 89.3; 3595 cols 128 x 4 in
            # float, 3 full, 90.6 / 89.5 against 86.1 / 84.9; 16385 cols 512
            # x 4, 3 full, 91.4 / 90.8 against 87.8 / 87.8; float32 20001
            # cols 1024 x 5, 4 full, 85.0 against 83.7). Rows held as loaded
            # keep every check unless all their packs are full: ptxas then
            # issues the checked pack's load after math on the others
            # (RMSNorm f16 3595 cols 128 x 4, 3 full, 88.3 against 95.7;
            # LayerNorm f16 20001 cols 512 x 5, 4 full, 74.4 against 83.4).
            # Rows on the grid keep every check (LayerNorm 16-bit 8192 /
            # 12288 cols lost 1 point without; 5000 / 10000 cols at 4 full
            # 89.3 / 84.0 against 97.4 / 96.4).
            full_packs = 0
            if direction == "forward" and peel:
                full_packs = min(packs_per_thread, full_packs_per_thread(cols, block_size, regs_pack, True))
                if extra.get("packed") and full_packs < packs_per_thread:
                    full_packs = 0
            spec = NormSpec(impl="block_regs", pack_size=regs_pack, block_size=block_size,
                            packs_per_thread=packs_per_thread, peel=peel, full_packs=full_packs, **extra, **fields)
            if not (spill_checked and _uses_local_memory(spec, target)):
                return _block_launch(spec, rows, 0, target, "auto", False)
    return None


def _async_launch(spec_fields, rows, cols, pack_size, target, rungs, whole_rows) -> Optional[KernelLaunch]:
    """The first of `rungs` that holds the row (whole_rows: all of it in the
    register tail); None when none does."""
    itemsize = dtypes.BY_SHORT[spec_fields["dtype"]].itemsize
    num_inputs = 2 if spec_fields["residual"] else 1
    row_bytes = cols * itemsize
    row_packs = row_bytes // async_row.PACK_BYTES
    for block_size, most, min_blocks in rungs:
        if whole_rows:
            if row_packs % block_size or row_packs > block_size * most:
                continue
            tails = (row_packs // block_size,)
        else:
            tails = async_row.largest_tails_first(num_inputs, row_bytes, block_size,
                                                  target.facts.smem_per_block_optin, 1, most)

        def spec_of(tail_packs):
            return NormSpec(impl="block_async", pack_size=pack_size, block_size=block_size,
                            tail_packs=tail_packs, **spec_fields)

        found = async_row.rung_spec(spec_of, num_inputs, row_bytes, target, 1, block_size, tails, min_blocks)
        if found is not None:
            spec, smem = found
            return KernelLaunch(spec, (block_size, 1, 1), (min(rows, MAX_GRID_X), 1, 1), smem)
    return None


def _peeled_full_rungs(op: str, itemsize: int, cols: int) -> list:
    """Register ladder rungs (as _auto_registers takes them) of
    AUTO_PEELED_FULL_PACKS for peeled rows of `cols`: each packs count held
    as loaded at its fitted block size, where every row fills every pack."""
    pack_size = async_row.PACK_BYTES // itemsize
    rungs = []
    for packs in AUTO_PEELED_FULL_PACKS.get((op, itemsize), ()):
        block_size = fitted_block_size(cols, pack_size, packs)
        if block_size <= max(BLOCK_SIZE_LADDER) and full_packs_per_thread(cols, block_size, pack_size, True) >= packs:
            rungs.append((block_size, packs * async_row.PACK_BYTES, {"packed": True}, True))
    return rungs


def _auto_forward(spec_fields, rows, cols, align, same_phase, target) -> KernelLaunch:
    itemsize = dtypes.BY_SHORT[spec_fields["dtype"]].itemsize
    pack = vector_pack_size(cols, itemsize, align)
    aligned = pack * itemsize == async_row.PACK_BYTES
    from_cols, tails, first_rungs = AUTO_ASYNC_FIRST.get((spec_fields["op"], itemsize), (math.inf, None, ()))
    if aligned and cols >= from_cols:
        launch = _async_launch(spec_fields, rows, cols, pack, target, first_rungs, tails == "whole")
        if launch is not None:
            return launch
    first_cols = AUTO_SMEM_FIRST.get((spec_fields["op"], spec_fields["dtype"]))
    if first_cols is not None and cols >= first_cols and aligned:
        spec = NormSpec(impl="block_smem", pack_size=pack, block_size=AUTO_SMEM_FIRST_BLOCK_SIZE,
                        packed_cache=True, **spec_fields)
        if target.max_active_blocks(spec, spec.block_size, cols * itemsize, True):
            return _block_launch(spec, rows, cols * itemsize, target, "auto", True)
    packed_bytes = AUTO_PACKED_RUNG_BYTES.get((spec_fields["op"], itemsize))
    block_ladder = []
    for block_size, max_bytes, spill_checked in AUTO_BLOCK_REGS_LADDER[itemsize]:
        block_ladder.append((block_size, max_bytes, {}, spill_checked))
        if packed_bytes:
            block_ladder.append((block_size, packed_bytes, {"packed": True}, True))
    peeled_ladder = [(block_size, max_bytes, {"packed": True}, True)
                     for block_size, max_bytes in AUTO_PEELED_PACKED_LADDER.get((spec_fields["op"], itemsize), ())]
    packed_from = AUTO_PEELED_PACKED_FROM_BLOCK.get((spec_fields["op"], itemsize), 0)
    peeled_ladder = peeled_ladder or [(block_size, max_bytes, extra, spill_checked)
                                      for block_size, max_bytes, extra, spill_checked in block_ladder
                                      if block_size >= packed_from or not extra.get("packed")]
    full_rungs = _peeled_full_rungs(spec_fields["op"], itemsize, cols)
    launch, pack = _auto_registers(spec_fields, rows, cols, align, target, "forward", block_ladder,
                                   peel_allowed=same_phase, peeled_ladder=full_rungs + peeled_ladder)
    if launch is not None:
        return launch
    if aligned:
        launch = _async_launch(spec_fields, rows, cols, pack, target, AUTO_ASYNC_LADDER[itemsize], False)
        if launch is not None:
            return launch
    launch = _smem_launch(spec_fields, rows, cols, pack, cols * itemsize, target, "auto", True,
                          "same_occupancy", packed_cache=True)
    return launch or _uncached_launch(spec_fields, rows, pack, target, "auto")


def _whole_phase_periods(launch: KernelLaunch, rows: int) -> KernelLaunch:
    """A grid on which every row a block visits (row += grid) starts at the
    phase of its first row, for peeled rows whose threads own the same
    columns in every row: a row a block, or a multiple of the longest phase
    period (rows of 16-byte packs are at most pack_size phases apart)."""
    period = launch.spec.pack_size
    if launch.grid[0] >= rows:
        return launch
    return replace(launch, grid=(max(period, launch.grid[0] // period * period), 1, 1))


def _resident_launch(spec: NormSpec, block: tuple, rows_per_block: int, rows: int, smem: int,
                     target: Target) -> KernelLaunch:
    """One wave of as many blocks as can be resident, each walking its rows:
    what a block sets up once (a workspace row of partial sums, a copy of
    the weight in shared memory) serves all of them, no block waits for a second
    wave, and the workspace is no larger than the blocks that run at once.
    A cluster of spec.cluster_size blocks walks rows as one block does."""
    threads = block[0] * block[1]
    active = max(1, target.max_active_blocks(spec, threads, smem, smem > 0))
    clusters = max(1, min(_ceil_div(rows, rows_per_block), active * target.facts.sm_count // spec.cluster_size))
    return KernelLaunch(spec, block, (clusters * spec.cluster_size, 1, 1), smem)


def _grad_holding(held: str, partials: str = "regs", rows_per_access: int = 1) -> dict:
    """NormSpec fields of a backward ladder rung's holding ("cached" /
    "reread"), partial sums ("regs" / "smem") and rows loaded together."""
    return {"cached": held == "cached", "smem_partials": partials == "smem", "rows_per_access": rows_per_access}


def _auto_backward_fused(spec_fields, rows, cols, align, same_phase, target) -> Optional[KernelLaunch]:
    """The dx kernel with dweight / dbias partials fused (in registers or
    shared memory), if they fit: the warp path, else the first register
    block rung that holds the row (first_grad_rung).

    Rows that allow no 16-byte pack (dy, x and dx at the same phase) peel
    their edges in the register block path (AUTO_GRAD_PEEL_ITEMSIZES); a
    block's rows then all start at the same phase: one row each, or a grid
    that is a multiple of the phase period. Rows on the 16-byte grid that no
    block holds are shared by the blocks of a thread-block cluster on sm_90
    and newer (AUTO_GRAD_CLUSTER_SIZES). Rows that no held rung holds are
    read twice, in a cluster or one block (AUTO_GRAD_LONG_ROW_LADDER)."""
    ftype = dtypes.BY_SHORT[spec_fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    pack = vector_pack_size(cols, ftype.itemsize, align)
    max_cols_per_thread = max(AUTO_WARP_MAX_BYTES_PER_LANE["backward"] // compute_itemsize, pack)
    ladder = auto_warp_ladder(cols, pack, max_cols_per_thread)
    if ladder is not None:
        # partials of the groups meet in shared memory: 2 values per group and column
        warp = _warp_launch(spec_fields, rows, cols, pack, ladder, target, "auto",
                            smem_per_group_col=2 * compute_itemsize)
        groups = warp.block[1]
        return _resident_launch(warp.spec, warp.block, groups * warp.spec.rows_per_access, rows,
                                warp.smem_bytes, target)

    on_grid = pack * ftype.itemsize == 16
    peeled = [(16 // ftype.itemsize, True, 1)] if (same_phase and not on_grid and
                                                   ftype.itemsize in AUTO_GRAD_PEEL_ITEMSIZES) else []
    one_block = [(pack, False, 1)]
    clusters = [(pack, False, size) for size in AUTO_GRAD_CLUSTER_SIZES] if (
        on_grid and has_clusters(target.facts.arch)) else []
    family = family_of(spec_fields["op"])
    for rungs, tries in ((AUTO_GRAD_BLOCK_LADDER[family], peeled + one_block + clusters),
                         (AUTO_GRAD_LONG_ROW_LADDER, peeled + clusters + (one_block if on_grid else []))):
        for pack_size, peel, cluster_size in tries:
            launch = first_grad_rung(rungs, spec_fields, rows, cols, pack_size, peel, cluster_size, target)
            if launch is not None:
                return launch
    return None


def first_grad_rung(ladder, spec_fields, rows, cols, pack_size, peel, cluster_size,
                    target) -> Optional[KernelLaunch]:
    """The first rung of `ladder` (AUTO_GRAD_BLOCK_LADDER's or
    AUTO_GRAD_LONG_ROW_LADDER; 16-bit rows on the 16-byte
    grid first at the fewest whole warps holding the row, with launch bounds
    rounded up, then down) whose block holds its span of a row, all of it or
    a cluster_size-th in whole packs, in a fused dx kernel that needs no
    local memory; None where none does."""
    ftype = dtypes.BY_SHORT[spec_fields["dtype"]]
    span_cols = cols if cluster_size == 1 else _ceil_div(cols // pack_size, cluster_size) * pack_size
    for block_size, max_bytes, *holding in ladder:
        packs_per_thread = block_packs_per_thread(span_cols, block_size, pack_size, peel)
        if packs_per_thread * pack_size * ftype.itemsize > max_bytes:
            continue
        block_sizes = [block_size]
        if ftype.itemsize in AUTO_GRAD_FITTED_ITEMSIZES and not peel:
            fitted = fitted_grad_block_size(span_cols, pack_size, packs_per_thread)
            block_sizes = [fitted, block_size] if fitted < block_size else block_sizes
        for threads in block_sizes:
            spec = NormSpec(impl="block_regs", pack_size=pack_size, block_size=threads,
                            packs_per_thread=packs_per_thread, peel=peel, cluster_size=cluster_size,
                            **_grad_holding(*holding), **spec_fields)
            if cluster_size > 1 and not cluster_shares_rows(spec, cols):
                continue
            specs = [spec]
            rounded_down = max(1, spec.resident_threads // threads)
            if threads != block_size and rounded_down < spec.min_blocks_per_sm:
                specs.append(replace(spec, min_blocks=rounded_down))
            for candidate in specs:
                launch = fused_grad_launch(candidate, rows, cols, target)
                if launch is not None and not _uses_local_memory(launch.spec, target):
                    return launch
    return None


def shifted_copy_elements(pack_size: int, cols: int) -> int:
    """Elements of a copy of the weight that starts up to pack_size - 1
    elements in (kernels/norm.cuh: shifted_copy_start), on whole packs: the
    shared copy's size and the stride of the phase copies."""
    return (cols + 2 * pack_size - 2) // pack_size * pack_size


def _weight_copy_bytes(spec: NormSpec, cols: int) -> int:
    """Shared memory of NormGradIO::with_weight_copied."""
    return shifted_copy_elements(spec.pack_size, cols) * spec.ftype.itemsize


def _grad_smem_bytes(spec: NormSpec, cols: int) -> int:
    """Dynamic shared memory of a register block dx kernel: its dweight /
    dbias partial sums (a value per owned column and gradient) when they are
    kept there, then the weight's copy."""
    smem = _weight_copy_bytes(spec, cols) if spec.weight_source == "shared_copy" else 0
    if spec.smem_partials:
        grads = PARAM_GRADS[family_of(spec.op)]
        compute_itemsize = dtypes.BY_SHORT[spec.ftype.compute].itemsize
        smem += grads * spec.packs_per_thread * spec.block_size * spec.pack_size * compute_itemsize
    return smem


def weight_phases_launch(spec: NormSpec, cols: int) -> Optional[KernelLaunch]:
    """The kernel writing the weight's pack_size phase copies, when the dx
    kernel `spec` reads them."""
    if spec.weight_source != "phase_copies":
        return None
    copies = NormSpec("norm_weight_phases", "weight_phases", spec.dtype, spec.pack_size)
    grid = (_ceil_div(cols, WEIGHT_PHASES_BLOCK), spec.pack_size, 1)
    return KernelLaunch(copies, (WEIGHT_PHASES_BLOCK, 1, 1), grid, 0)


def fused_grad_launch(spec: NormSpec, rows: int, cols: int, target: Target) -> Optional[KernelLaunch]:
    """A register block dx kernel with fused partials: one resident wave
    (a workspace row a block), whole phase periods for peeled rows; None
    where its shared memory leaves no block resident. Peeled rows read the
    weight from a copy in shared memory or from its phase copies
    (AUTO_GRAD_PHASE_COPIES_FROM_BLOCK)."""
    if spec.peel and spec.weight:
        spec = replace(spec, weight_source="phase_copies")
    smem = _grad_smem_bytes(spec, cols)
    blocks = target.max_active_blocks(spec, spec.block_size, smem, True)
    phases_from = AUTO_GRAD_PHASE_COPIES_FROM_BLOCK.get((family_of(spec.op), spec.ftype.itemsize), math.inf)
    if spec.peel and spec.weight and blocks and spec.block_size < phases_from:
        copied = replace(spec, weight_source="shared_copy")
        copied_smem = _grad_smem_bytes(copied, cols)
        if target.max_active_blocks(copied, spec.block_size, copied_smem, True) == blocks:
            spec, smem = copied, copied_smem
    if smem > target.facts.smem_per_block_optin or not blocks:
        return None
    launch = _resident_launch(spec, (spec.block_size, 1, 1), 1, rows, smem, target)
    return _whole_phase_periods(launch, rows) if spec.peel else launch


def fused_grad_plan(main: KernelLaunch, cols: int) -> NormGradPlan:
    """The backward plan around a dx kernel with fused partials: the weight's
    phase copies it may read, its workspace row a block (a cluster), the
    finish kernel."""
    spec = main.spec
    return NormGradPlan(main, None, _finish_launch(family_of(spec.op), spec.dtype, cols),
                        main.grid[0] // spec.cluster_size, 0, weight_phases_launch(spec, cols))


def _param_grad_launches(family, dtype, rows, cols, target):
    """The column reduction (dy * xhat and dy over chunks of rows) and its grid."""
    col_tiles = _ceil_div(cols, PARAM_GRAD_BLOCK[0])
    row_tiles = _ceil_div(rows, PARAM_GRAD_BLOCK[1])
    wanted = _ceil_div(target.facts.sm_count * PARAM_GRAD_BLOCKS_PER_SM, col_tiles)
    rows_per_chunk = _ceil_div(rows, min(row_tiles, wanted))
    chunks = _ceil_div(rows, rows_per_chunk)
    spec = NormSpec(f"{family}_param_grad", "param_grad", dtype)
    return KernelLaunch(spec, PARAM_GRAD_BLOCK + (1,), (col_tiles, chunks, 1), 0), chunks, rows_per_chunk


def _finish_launch(family, dtype, cols) -> KernelLaunch:
    """One launch sums the partials of every parameter gradient: blockIdx.y
    picks dweight (0) or dbias (1, LayerNorm only)."""
    spec = NormSpec("norm_param_grad_finish", "param_grad_finish", dtype)
    grid = (_ceil_div(cols, PARAM_GRAD_BLOCK[0]), PARAM_GRADS[family], 1)
    return KernelLaunch(spec, PARAM_GRAD_BLOCK + (1,), grid, 0)


@functools.lru_cache(maxsize=4096)
def plan(op: str, rows: int, cols: int, dtype: str, policy: str, target: Target, align: int = 16, *,
         weight: bool = True, bias: bool = True, residual: bool = False,
         param_grad: bool = True, same_phase: bool = True):
    """The launch plan of `op` for `rows` x `cols` of dtype (short name) on `target`.

    Forward ops take weight / bias / residual flags; backward ops take weight
    (dy is multiplied by it) and param_grad (dweight / dbias wanted). `align`
    is the largest power of two (<= 16) dividing every operand's address and
    row stride in bytes; `same_phase` says every row of every row operand
    starts at the same offset from a 16-byte boundary (auto then peels rows
    that allow no 16-byte pack: the forward, and the backward with fused
    dweight / dbias). The flags are keyword-only: passed by position,
    param_grad once landed in `bias` and the backward planned fused partials
    that were never allocated."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    arrays.check_policy(policy)
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
    family = op.replace("_backward", "")
    centered = family == "layer_norm"
    if op in FORWARD_OPS:
        fields = dict(op=op, dtype=dtype, weight=weight, bias=bias and centered, residual=residual)
        if policy == "oneflow":
            return NormPlan(_oneflow_main(family, fields, rows, cols, align, target, 1))
        return NormPlan(_auto_forward(fields, rows, cols, align, same_phase, target))

    fields = dict(op=f"{family}_grad", dtype=dtype, weight=weight)
    main = None
    if policy == "auto" and param_grad:
        main = _auto_backward_fused({**fields, "fuse_param_grad": True}, rows, cols, align, same_phase, target)
    if main is not None:
        return fused_grad_plan(main, cols)
    if policy == "oneflow":
        main = _oneflow_main(family, fields, rows, cols, align, target, 2)
    else:
        main = _auto_backward_dx(fields, rows, cols, align, target)
    if not param_grad:
        return NormGradPlan(main, None, None, 0, 0)
    column_reduction, chunks, rows_per_chunk = _param_grad_launches(family, dtype, rows, cols, target)
    return NormGradPlan(main, column_reduction, _finish_launch(family, dtype, cols), chunks, rows_per_chunk)


def _auto_backward_dx(fields, rows, cols, align, target) -> KernelLaunch:
    """auto's dx kernel without fused partials (rows too long for register
    partials, or no dweight / dbias wanted)."""
    ftype = dtypes.BY_SHORT[fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    # the ladder counts bytes as stored, _auto_registers in the compute type
    widening = compute_itemsize // ftype.itemsize
    ladder = AUTO_GRAD_BLOCK_LADDER[family_of(fields["op"])]
    block_ladder = [(block_size, max_bytes * widening, _grad_holding(held, "regs", rows_per_access), True)
                    for block_size, max_bytes, held, _, rows_per_access in ladder]
    launch, pack = _auto_registers(fields, rows, cols, align, target, "backward", block_ladder)
    if launch is not None:
        return launch
    launch = _smem_launch(fields, rows, cols, pack, 2 * cols * compute_itemsize, target, "auto", True,
                          "same_occupancy")
    return launch or _uncached_launch(fields, rows, pack, target, "auto")


# -- launch ------------------------------------------------------------------

def launch_forward(chosen: NormPlan, device_id: int, rows: int, cols: int, x, y, eps: float, *,
                   residual=None, h=None, weight=None, bias=None, mean=None, rstd=None) -> ForwardLaunch:
    """Runs a forward plan: x, y and residual are rowwise.Operands, h (stored
    when residual is given) a contiguous [rows, cols] array, weight / bias
    contiguous [cols], mean / rstd [rows] in the compute type (None: not
    stored). Returns the ready launch it ran."""
    check_block_covers(chosen.main.spec, cols)
    launch = forward_launch(chosen, device_id, rows, cols, dtypes.float_type(x.array.dtype), eps, x.row_stride,
                            0 if residual is None else residual.row_stride, y.row_stride)
    run_forward(launch, x.array, None if residual is None else residual.array, weight, bias, y.array, h, mean, rstd)
    return launch


def launch_backward(chosen: NormGradPlan, device_id: int, rows: int, cols: int, dy, x, dx, rstd, *,
                    mean=None, weight=None, dweight=None, dbias=None) -> BackwardLaunch:
    """Runs a backward plan: dy, x and dx are rowwise.Operands, rstd / mean
    (None for RMSNorm) [rows] in the compute type, weight contiguous [cols];
    dweight / dbias [cols] are written when given (the plan must then reduce
    them). Allocates the workspace of the gradients wanted; the kernels skip
    a null one. Returns the ready launch it ran."""
    check_block_covers(chosen.main.spec, cols)
    phases = chosen.weight_phases
    phase_stride = 0 if phases is None else shifted_copy_elements(phases.spec.pack_size, cols)
    launch = backward_launch(chosen, device_id, rows, cols, dy.row_stride, x.row_stride, dx.row_stride,
                             phase_stride)
    run_backward(launch, dy.array, x.array, dx.array, rstd, mean, weight, dweight, dbias)
    return launch


# Whole calls memoised (callcache): one launch on the caller's arrays.
_calls = CallCache()


def _remember(key, launched: list, caller: tuple, result, call: tuple) -> None:
    """Remembers `call` (the ready launch and how to allocate the outputs)
    under `key` when rowwise.run made one launch, writing `result` and
    reading the memory of the caller's arrays (cupy.ndarray or None, as the
    key says) rather than copies."""
    if key is None or len(launched) != 1:
        return
    read, written, ready = launched[0]
    if written is result and all(a is b or (a is not None and b is not None and a.data.ptr == b.data.ptr)
                                 for a, b in zip(read, caller)):
        _calls.remember(key, (ready, *call))


# -- forward -------------------------------------------------------------------

def _forward_outputs(x, residual: bool, lead_shape: tuple, stats_dtype, centered: bool, return_stats: bool):
    import cupy

    h = cupy.empty(x.shape, x.dtype) if residual else None
    mean = cupy.empty(lead_shape, stats_dtype) if return_stats and centered else None
    rstd = cupy.empty(lead_shape, stats_dtype) if return_stats else None
    return h, mean, rstd


def _forward_result(y, h, mean, rstd, return_stats: bool):
    result = (y,) if h is None else (y, h)
    if return_stats:
        result += (rstd,) if mean is None else (mean, rstd)
    return result[0] if len(result) == 1 else result


def _replay_forward(call, x, weight, bias, residual, out):
    import cupy

    launch, *outputs = call
    y = out if out is not None else cupy.empty(x.shape, x.dtype)
    h, mean, rstd = _forward_outputs(x, residual is not None, *outputs)
    run_forward(launch, x, residual, weight, bias, y, h, mean, rstd)
    return _forward_result(y, h, mean, rstd, outputs[-1])


def _forward(op, x, weight, bias, axis, eps, residual, return_stats, out, policy, stream):
    import cupy

    key = call_key((op, policy, axis, eps, return_stats), (x, weight, bias, residual, out))
    call = _calls.find(key)
    if call is not None and writable(out, (x, residual)):
        return run_on(stream, _replay_forward, call, x, weight, bias, residual, out)

    caller = (x, residual, weight, bias)
    x = norm_args.float_input(x)
    arrays.check_policy(policy)
    eps = norm_args.check_eps(eps)
    ftype = dtypes.float_type(x.dtype)
    num_axes = norm_args.normalized_axes(x, axis)
    normalized_shape = x.shape[x.ndim - num_axes:]
    device_id = x.device.id
    weight = norm_args.check_like(weight, "weight", normalized_shape, x.dtype, device_id)
    bias = norm_args.check_like(bias, "bias", normalized_shape, x.dtype, device_id)
    residual = norm_args.check_like(residual, "residual", x.shape, x.dtype, device_id)
    out = arrays.check_out(out, x.shape, x.dtype, device_id)
    outputs = (x.shape[:x.ndim - num_axes], norm_args.stats_dtype(x.dtype), op == "layer_norm", bool(return_stats))
    launched = []

    with arrays.on_device(x, stream):
        weight = None if weight is None else cupy.ascontiguousarray(weight)
        bias = None if bias is None else cupy.ascontiguousarray(bias)
        h, mean, rstd = _forward_outputs(x, residual is not None, *outputs)

        def launch(operands, output, rows, cols):
            x_op = operands[0]
            res_op = operands[1] if residual is not None else None
            pointers = [x_op.byte_address, x_op.byte_row_stride, output.byte_address, output.byte_row_stride]
            if res_op is not None:
                pointers += [res_op.byte_address, res_op.byte_row_stride, h.data.ptr, cols * x.itemsize]
            pointers += [vector.data.ptr for vector in (weight, bias) if vector is not None]
            align = arrays.alignment(*pointers)
            row_operands = [x_op, output] + ([] if res_op is None else [res_op, rowwise.Operand(h, cols)])
            chosen = plan(op, rows, cols, ftype.short, policy, Target.live(device_id), align,
                          weight=weight is not None, bias=bias is not None,
                          residual=residual is not None, same_phase=arrays.same_phase(*row_operands))
            ready = launch_forward(chosen, device_id, rows, cols, x_op, output, eps, residual=res_op, h=h,
                                   weight=weight, bias=bias, mean=mean, rstd=rstd)
            launched.append(((x_op.array, None if res_op is None else res_op.array, weight, bias), output.array,
                             ready))

        if x.size == 0:
            y = out if out is not None else cupy.empty(x.shape, x.dtype)
            for stat in (mean, rstd):
                if stat is not None:
                    stat.fill(numpy.nan)
        else:
            inputs = [x] if residual is None else [x, residual]
            y = rowwise.run(inputs, tuple(range(x.ndim - num_axes, x.ndim)), out, x.dtype, launch)
    _remember(key, launched, caller, y, outputs)
    return _forward_result(y, h, mean, rstd, outputs[-1])


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False,
               out=None, policy: str = "auto", stream=None):
    """Layer normalisation of `x` over the trailing `axis` (an int or a tuple).

    Equivalent to ``torch.nn.functional.layer_norm(x, x.shape[axes], weight,
    bias, eps)``: ``(x - mean) / sqrt(var + eps) * weight + bias`` with the
    biased variance, statistics and affine in float32 for 16-bit inputs.
    weight / bias are shaped like the normalised axes. With `residual`,
    ``h = x + residual`` is normalised in the same kernel and returned as
    ``(y, h)``; with `return_stats` the per-row ``mean`` and ``rstd`` (compute
    type: float32, or float64 for float64 input) are appended."""
    return _forward("layer_norm", x, weight, bias, axis, eps, residual, return_stats, out, policy, stream)


def rms_norm(x, weight=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False, out=None,
             policy: str = "auto", stream=None):
    """RMS normalisation of `x` over the trailing `axis`: ``x * rsqrt(mean(x**2) + eps) * weight``.

    Equivalent to ``torch.nn.functional.rms_norm(x, x.shape[axes], weight, eps)``.
    `residual` and `return_stats` as for :func:`layer_norm` (the statistic
    appended is ``rstd`` alone)."""
    return _forward("rms_norm", x, weight, None, axis, eps, residual, return_stats, out, policy, stream)


# -- backward ------------------------------------------------------------------

def _param_grads(x, grads_shape: tuple, need_weight_grad: bool, need_bias_grad: bool):
    """dweight and dbias (None unless wanted) to write."""
    import cupy

    # the finish kernel writes every element; no rows: all zeros
    allocate = cupy.empty if x.size else cupy.zeros
    return (allocate(grads_shape, x.dtype) if need_weight_grad else None,
            allocate(grads_shape, x.dtype) if need_bias_grad else None)


def _replay_backward(call, dy, x, mean, rstd, weight):
    import cupy

    launch, grads_shape, need_weight_grad, need_bias_grad, centered = call
    dx = cupy.empty(x.shape, x.dtype)
    dweight, dbias = _param_grads(x, grads_shape, need_weight_grad, need_bias_grad)
    run_backward(launch, dy, x, dx, rstd, mean, weight, dweight, dbias)
    return (dx, dweight, dbias) if centered else (dx, dweight)


def _backward(op, dy, x, mean, rstd, weight, axis, need_weight_grad, need_bias_grad, policy, stream):
    import cupy

    key = call_key((op, policy, axis, need_weight_grad, need_bias_grad), (x, dy, mean, rstd, weight))
    call = _calls.find(key)
    if call is not None:
        return run_on(stream, _replay_backward, call, dy, x, mean, rstd, weight)

    caller = (dy, x, mean, rstd, weight)
    x = norm_args.float_input(x)
    arrays.check_policy(policy)
    device_id = x.device.id
    dy = norm_args.check_like(dy, "dy", x.shape, x.dtype, device_id)
    if dy is None:
        raise TypeError("dy must be a GPU array")
    ftype = dtypes.float_type(x.dtype)
    num_axes = norm_args.normalized_axes(x, axis)
    normalized_shape = x.shape[x.ndim - num_axes:]
    weight = norm_args.check_like(weight, "weight", normalized_shape, x.dtype, device_id)
    stats_dtype = norm_args.stats_dtype(x.dtype)
    cols = math.prod(normalized_shape)
    rows = x.size // cols if cols else 0
    centered = op == "layer_norm_backward"
    outputs = (normalized_shape, bool(need_weight_grad), bool(need_bias_grad) and centered, centered)
    param_grad = outputs[1] or outputs[2]
    launched = []

    with arrays.on_device(x, stream):
        mean = norm_args.check_stat(mean, "mean", rows, stats_dtype, device_id) if centered else None
        rstd = norm_args.check_stat(rstd, "rstd", rows, stats_dtype, device_id)
        weight = None if weight is None else cupy.ascontiguousarray(weight)
        dweight, dbias = _param_grads(x, *outputs[:3])

        def launch(operands, output, rows, cols):
            dy_op, x_op = operands
            pointers = [op_.byte_address for op_ in (dy_op, x_op, output)]
            pointers += [op_.byte_row_stride for op_ in (dy_op, x_op, output)]
            if weight is not None:
                pointers.append(weight.data.ptr)
            chosen = plan(op, rows, cols, ftype.short, policy, Target.live(device_id),
                          arrays.alignment(*pointers), weight=weight is not None, param_grad=param_grad,
                          same_phase=arrays.same_phase(dy_op, x_op, output))
            _check_grad_plan(chosen, param_grad)
            ready = launch_backward(chosen, device_id, rows, cols, dy_op, x_op, output, rstd, mean=mean,
                                    weight=weight, dweight=dweight, dbias=dbias)
            launched.append(((dy_op.array, x_op.array, mean, rstd, weight), output.array, ready))

        if x.size == 0:
            dx = cupy.empty(x.shape, x.dtype)
        else:
            dx = rowwise.run([dy, x], tuple(range(x.ndim - num_axes, x.ndim)), None, x.dtype, launch)
    _remember(key, launched, caller, dx, outputs)
    return (dx, dweight, dbias) if centered else (dx, dweight)


def _check_grad_plan(chosen: NormGradPlan, param_grad: bool) -> None:
    """A backward plan writes partial sums exactly when they were asked for
    (and so allocated): no kernel may be handed a null workspace to fill."""
    writes_parts = chosen.main.spec.fuse_param_grad or chosen.param_grad is not None
    if writes_parts != param_grad or (chosen.finish is not None) != param_grad:
        raise AssertionError(f"backward plan {chosen.explain()} does not match param_grad={param_grad}")
    if param_grad and chosen.num_parts < 1:
        raise AssertionError(f"backward plan {chosen.explain()} has no workspace rows")


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, axis=-1, need_weight_grad=True,
                        need_bias_grad=True, policy: str = "auto", stream=None):
    """Gradients of :func:`layer_norm`: ``(dx, dweight, dbias)``.

    `mean` and `rstd` are the statistics of the forward pass (return_stats=True;
    with a residual, `x` is h). Equivalent to torch autograd through
    ``torch.nn.functional.layer_norm``. dweight / dbias (None unless wanted)
    are reduced in float32 (float64 for float64) in a fixed order:
    bit-identical on every run."""
    return _backward("layer_norm_backward", dy, x, mean, rstd, weight, axis, need_weight_grad,
                     need_bias_grad, policy, stream)


def rms_norm_backward(dy, x, rstd, weight=None, *, axis=-1, need_weight_grad=True, policy: str = "auto",
                      stream=None):
    """Gradients of :func:`rms_norm`: ``(dx, dweight)``.

    Equivalent to torch autograd through ``torch.nn.functional.rms_norm``;
    dweight as for :func:`layer_norm_backward`."""
    return _backward("rms_norm_backward", dy, x, None, rstd, weight, axis, need_weight_grad, False,
                     policy, stream)
