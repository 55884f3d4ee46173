"""auto's forward plan of LayerNorm / RMSNorm: a row per group of lanes (warp),
per block in registers (block_regs, rows off the 16-byte grid peeled), per
block cached by cp.async with a register tail (block_async), per block in
shared memory (block_smem) or read twice (block_uncached); the tables below
hold the measured choices among them."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from .. import async_row, dtypes
from ..device import WARP_SIZE
from ..launch import BLOCK_SIZE_LADDER, MAX_GRID_X, KernelLaunch, Target
from ..profile import profile_for
from .norm_paths import (auto_warp_ladder, block_launch, first_register_rung, smem_launch, uncached_launch,
                         uses_local_memory, warp_launch, warp_max_cols_per_thread)
from .norm_spec import AUTO_FORWARD_WARP_BLOCK_THREADS, NormSpec, fewest_warps, full_packs_per_thread
from .row_packs import peeled_pack, peeled_small_rows_per_block, vector_pack_size

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
# AUTO_HELD_AFFINE_FROM_COLS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_HELD_AFFINE_RESIDENT_THREADS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_HELD_AFFINE_MIN_BYTES_IN_FLIGHT: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_BLOCK_REGS_LADDER: a value of the device profile (cupyops/profiles/*.json).
# auto, forward: (op, dtype) -> from these cols, 16-byte packs, the row cached
# as stored in shared memory with 512 threads before the register rungs.
# RMSNorm bf16 (H200): 16384 cols 97.3 % of copy against 96.8 % in registers
# (512 x 4 packs), 32768 cols 96.7 % against 96.3 % (512 x 8 as loaded); a
# near tie since bfloat16 converts by a mov (common.cuh; 84.6 and 80.1 % in
# registers before). LayerNorm bf16 is slower there (84 % at 32768 cols).
# From 20000 cols the rows cached by cp.async come first (AUTO_ASYNC_FIRST).
# AUTO_SMEM_FIRST: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_ASYNC_FIRST: a value of the device profile (cupyops/profiles/*.json).
# AUTO_ASYNC_LADDER: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_REGS_FROM_COLS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_RESIDUAL_REGS_FROM_COLS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_SMEM_FIRST_BLOCK_SIZE: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_PACKED_RUNG_BYTES: a value of the device profile (cupyops/profiles/*.json).
# auto, forward, peeled rows (off the 16-byte grid, every operand at the same
# phase): (op, storage itemsize) -> (block_size, most bytes a thread holds of
# packs as loaded), in place of the ladders above. RMSNorm f16 (H200): 12345
# cols 256 x 7 packs 95.9 % of copy against 83.1 % at 512 x 4 in float (now
# 256 x 6 and single elements past the packs: 95.4 against 95.6); 4097
# cols 128 x 4 95.5 % (64 x 8: 91.9 %); 2049 cols 64 x 4 91.8 % (128 x 2:
# 85.5 %). LayerNorm takes its ladder: 2049 cols 64 x 4 in float 89.3 %
# against 80.5 % as loaded.
# AUTO_PEELED_PACKED_LADDER: a value of the device profile (cupyops/profiles/*.json).
# auto, forward, peeled rows of the other ops: (op, storage itemsize) -> the
# packed rungs of their ladder from this block size. LayerNorm f16 / bf16
# 3595 cols (H200): 128 x 4 packs in float 85.5 / 84.4 % of copy against
# 80.5 / 79.5 at 64 x 7 as loaded, every pack checked (64 x 7 with no pack
# checked comes first: AUTO_PEELED_FULL_PACKS).
# AUTO_PEELED_PACKED_FROM_BLOCK: a value of the device profile (cupyops/profiles/*.json).
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


def fitted_block_size(cols: int, pack_size: int, packs_per_thread: int) -> int:
    """The fewest threads, in whole warps and at least
    AUTO_PEELED_FULL_MIN_BLOCK, that hold a peeled row of `cols` at
    packs_per_thread packs a thread and one single element each past the
    packs (block_packs_per_thread)."""
    return fewest_warps(cols, packs_per_thread * pack_size + 1, AUTO_PEELED_FULL_MIN_BLOCK)


def _auto_registers(fields, rows, cols, align, same_phase, target, block_ladder, peeled_ladder):
    """auto's forward warp path, else its register block path: (launch or
    None, pack size).

    block_ladder: (block_size, most bytes a thread holds (compute values, or
    packs as loaded with packed=True), extra spec fields, only without local
    memory), tried in order. same_phase: every row operand starts at the
    same offset from a 16-byte boundary, so a register block whose rows allow
    no 16-byte pack peels each row's edges and reads 16-byte packs, trying
    peeled_ladder; such rows from AUTO_PEELED_SMALL_MIN_COLS first take a
    peeled block of a warp or two (row_packs)."""
    tuned = profile_for(target.facts)
    ftype = dtypes.BY_SHORT[fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    pack = vector_pack_size(cols, ftype.itemsize, align)
    regs_pack, peel = peeled_pack(pack, ftype.itemsize, same_phase)
    if peel and cols >= tuned.AUTO_PEELED_SMALL_MIN_COLS:
        small_rungs = [(block_size, tuned.AUTO_PEELED_SMALL_MAX_PACKS * regs_pack * compute_itemsize,
                        {"rows_per_block": peeled_small_rows_per_block(block_size)}, True)
                       for block_size in tuned.AUTO_PEELED_SMALL_BLOCKS]
        launch = first_register_rung(fields, rows, cols, target, "forward", small_rungs, regs_pack, peel)
        if launch is not None:
            return launch, pack
    ladder = auto_warp_ladder(cols, pack, warp_max_cols_per_thread("forward", compute_itemsize, pack))
    regs_tables = (tuned.AUTO_REGS_FROM_COLS, tuned.AUTO_RESIDUAL_REGS_FROM_COLS if fields["residual"] else {})
    regs_first = pack * ftype.itemsize == 16 and any(
        cols >= table.get((fields["op"], ftype.itemsize), cols + 1) for table in regs_tables)
    if ladder is not None and not regs_first:
        block_threads = AUTO_FORWARD_WARP_BLOCK_THREADS if ladder[2] == WARP_SIZE else 0
        launch = warp_launch(fields, rows, cols, pack, ladder, target, "auto", block_threads=block_threads)
        return held_affine(launch, cols, target), pack
    rungs = peeled_ladder if peel else block_ladder
    return first_register_rung(fields, rows, cols, target, "forward", rungs, regs_pack, peel), pack


def held_affine(launch: KernelLaunch, cols: int, target: Target) -> KernelLaunch:
    """The forward warp launch with its lanes holding weight and bias
    (AUTO_HELD_AFFINE_*), or the launch as given."""
    tuned = profile_for(target.facts)
    spec = launch.spec
    if not (spec.weight or spec.bias) or spec.residual or cols < tuned.AUTO_HELD_AFFINE_FROM_COLS:
        return launch
    row_bytes_a_lane = spec.cols_per_thread * spec.rows_per_access * spec.ftype.itemsize
    bounds = [0] + [resident // spec.threads_per_block for resident in tuned.AUTO_HELD_AFFINE_RESIDENT_THREADS
                    if resident < spec.resident_threads
                    and resident * row_bytes_a_lane >= tuned.AUTO_HELD_AFFINE_MIN_BYTES_IN_FLIGHT]
    for min_blocks in bounds:
        held = replace(spec, hold_affine=True, min_blocks=min_blocks)
        if not uses_local_memory(held, target):
            return replace(launch, spec=held)
    return launch


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


def auto_forward(spec_fields, rows, cols, align, same_phase, target) -> KernelLaunch:
    tuned = profile_for(target.facts)
    itemsize = dtypes.BY_SHORT[spec_fields["dtype"]].itemsize
    pack = vector_pack_size(cols, itemsize, align)
    aligned = pack * itemsize == async_row.PACK_BYTES
    from_cols, tails, first_rungs = tuned.AUTO_ASYNC_FIRST.get((spec_fields["op"], itemsize), (math.inf, None, ()))
    if aligned and cols >= from_cols:
        launch = _async_launch(spec_fields, rows, cols, pack, target, first_rungs, tails == "whole")
        if launch is not None:
            return launch
    first_cols = tuned.AUTO_SMEM_FIRST.get((spec_fields["op"], spec_fields["dtype"]))
    if first_cols is not None and cols >= first_cols and aligned:
        spec = NormSpec(impl="block_smem", pack_size=pack, block_size=tuned.AUTO_SMEM_FIRST_BLOCK_SIZE,
                        packed_cache=True, **spec_fields)
        if target.max_active_blocks(spec, spec.block_size, cols * itemsize, True):
            return block_launch(spec, rows, cols * itemsize, target, "auto", True)
    packed_bytes = tuned.AUTO_PACKED_RUNG_BYTES.get((spec_fields["op"], itemsize))
    block_ladder = []
    for block_size, max_bytes, spill_checked in tuned.AUTO_BLOCK_REGS_LADDER[itemsize]:
        block_ladder.append((block_size, max_bytes, {}, spill_checked))
        if packed_bytes:
            block_ladder.append((block_size, packed_bytes, {"packed": True}, True))
    peeled_ladder = [(block_size, max_bytes, {"packed": True}, True)
                     for block_size, max_bytes in tuned.AUTO_PEELED_PACKED_LADDER.get((spec_fields["op"], itemsize), ())]
    packed_from = tuned.AUTO_PEELED_PACKED_FROM_BLOCK.get((spec_fields["op"], itemsize), 0)
    peeled_ladder = peeled_ladder or [(block_size, max_bytes, extra, spill_checked)
                                      for block_size, max_bytes, extra, spill_checked in block_ladder
                                      if block_size >= packed_from or not extra.get("packed")]
    full_rungs = _peeled_full_rungs(spec_fields["op"], itemsize, cols)
    launch, pack = _auto_registers(spec_fields, rows, cols, align, same_phase, target, block_ladder,
                                   full_rungs + peeled_ladder)
    if launch is not None:
        return launch
    if aligned:
        launch = _async_launch(spec_fields, rows, cols, pack, target, tuned.AUTO_ASYNC_LADDER[itemsize], False)
        if launch is not None:
            return launch
    launch = smem_launch(spec_fields, rows, cols, pack, cols * itemsize, target, "auto", True,
                          "same_occupancy", packed_cache=True)
    return launch or uncached_launch(spec_fields, rows, pack, target, "auto")
