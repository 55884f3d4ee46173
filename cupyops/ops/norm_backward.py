"""The backward plan of LayerNorm / RMSNorm: the dx kernel, with the dweight /
dbias partial sums fused into it under auto where they fit (in registers or
shared memory, one resident wave of blocks, each with a workspace row), else
a column reduction after it; then the kernel that sums the partials in a
fixed order. The tables below hold auto's measured choices."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from .. import dtypes
from ..device import has_clusters
from ..launch import KernelLaunch, Target
from ..profile import profile_for
from .norm_paths import (auto_warp_ladder, first_register_rung, oneflow_launch, smem_launch, uncached_launch,
                         uses_local_memory, warp_launch, warp_max_cols_per_thread)
from .norm_spec import (PARAM_GRAD_BLOCK, WEIGHT_PHASES_BLOCK, NormGradPlan, NormSpec, block_packs_per_thread,
                        ceil_div, cluster_shares_rows, family_of, fewest_warps, shifted_copy_elements)
from .row_packs import vector_pack_size

PARAM_GRADS = {"layer_norm": 2, "rms_norm": 1}   # dweight (and dbias)
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
# AUTO_GRAD_PEEL_ITEMSIZES: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_GRAD_PHASE_COPIES_FROM_BLOCK: a value of the device profile (cupyops/profiles/*.json).
# AUTO_GRAD_BLOCK_LADDER: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_GRAD_FITTED_ITEMSIZES: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_GRAD_CLUSTER_SIZES: a value of the device profile (cupyops/profiles/*.json).
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
# AUTO_GRAD_LONG_ROW_LADDER: a value of the device profile (cupyops/profiles/*.json).
# unfused column reduction: aim for this many 1024-thread blocks per SM.
# PARAM_GRAD_BLOCKS_PER_SM: a value of the device profile (cupyops/profiles/*.json).


def fitted_grad_block_size(cols: int, pack_size: int, packs_per_thread: int) -> int:
    """The fewest threads, in whole warps and at least
    AUTO_GRAD_FITTED_MIN_BLOCK, that hold a row of `cols` (whole packs) at
    packs_per_thread packs a thread."""
    return fewest_warps(cols // pack_size, packs_per_thread, AUTO_GRAD_FITTED_MIN_BLOCK)


def _whole_phase_periods(launch: KernelLaunch, rows: int) -> KernelLaunch:
    """A grid on which every row a block visits (row += grid) starts at the
    phase of its first row, for peeled rows whose threads own the same
    columns in every row: a row a block, or a multiple of the longest phase
    period (rows of 16-byte packs are at most pack_size phases apart)."""
    period = launch.spec.pack_size
    if launch.grid[0] >= rows:
        return launch
    return replace(launch, grid=(max(period, launch.grid[0] // period * period), 1, 1))


def resident_launch(spec: NormSpec, rows: int, smem: int, target: Target) -> KernelLaunch:
    """A dx kernel with fused partials over `rows`: one wave of as many
    blocks as can be resident, each walking its rows, so what a block sets
    up once (a workspace row of partial sums, a copy of the weight in shared
    memory) serves all of them, no block waits for a second wave, and the
    workspace is no larger than the blocks that run at once. A cluster of
    spec.cluster_size blocks walks rows as one block does; peeled rows take
    whole phase periods (_whole_phase_periods)."""
    if spec.impl == "warp":
        block = (spec.thread_group_width, spec.threads_per_block // spec.thread_group_width, 1)
        rows_per_block = block[1] * spec.rows_per_access
    else:
        block, rows_per_block = (spec.block_size, 1, 1), 1
    threads = block[0] * block[1]
    active = max(1, target.max_active_blocks(spec, threads, smem, smem > 0))
    clusters = max(1, min(ceil_div(rows, rows_per_block), active * target.facts.sm_count // spec.cluster_size))
    launch = KernelLaunch(spec, block, (clusters * spec.cluster_size, 1, 1), smem)
    return _whole_phase_periods(launch, rows) if spec.peel else launch


def grad_holding(held: str, partials: str = "regs", rows_per_access: int = 1) -> dict:
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
    tuned = profile_for(target.facts)
    ftype = dtypes.BY_SHORT[spec_fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    pack = vector_pack_size(cols, ftype.itemsize, align)
    ladder = auto_warp_ladder(cols, pack, warp_max_cols_per_thread("backward", compute_itemsize, pack))
    if ladder is not None:
        # partials of the groups meet in shared memory: 2 values per group and column
        warp = warp_launch(spec_fields, rows, cols, pack, ladder, target, "auto",
                            smem_per_group_col=2 * compute_itemsize)
        return resident_launch(warp.spec, rows, warp.smem_bytes, target)

    on_grid = pack * ftype.itemsize == 16
    peeled = [(16 // ftype.itemsize, True, 1)] if (same_phase and not on_grid and
                                                   ftype.itemsize in tuned.AUTO_GRAD_PEEL_ITEMSIZES) else []
    one_block = [(pack, False, 1)]
    clusters = [(pack, False, size) for size in tuned.AUTO_GRAD_CLUSTER_SIZES] if (
        on_grid and has_clusters(target.facts.arch)) else []
    family = family_of(spec_fields["op"])
    for rungs, tries in ((tuned.AUTO_GRAD_BLOCK_LADDER[family], peeled + one_block + clusters),
                         (tuned.AUTO_GRAD_LONG_ROW_LADDER, peeled + clusters + (one_block if on_grid else []))):
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
    tuned = profile_for(target.facts)
    ftype = dtypes.BY_SHORT[spec_fields["dtype"]]
    span_cols = cols if cluster_size == 1 else ceil_div(cols // pack_size, cluster_size) * pack_size
    for block_size, max_bytes, *holding in ladder:
        packs_per_thread = block_packs_per_thread(span_cols, block_size, pack_size, peel)
        if packs_per_thread * pack_size * ftype.itemsize > max_bytes:
            continue
        block_sizes = [block_size]
        if ftype.itemsize in tuned.AUTO_GRAD_FITTED_ITEMSIZES and not peel:
            fitted = fitted_grad_block_size(span_cols, pack_size, packs_per_thread)
            block_sizes = [fitted, block_size] if fitted < block_size else block_sizes
        for threads in block_sizes:
            spec = NormSpec(impl="block_regs", pack_size=pack_size, block_size=threads,
                            packs_per_thread=packs_per_thread, peel=peel, cluster_size=cluster_size,
                            **grad_holding(*holding), **spec_fields)
            if cluster_size > 1 and not cluster_shares_rows(spec, cols):
                continue
            specs = [spec]
            rounded_down = max(1, spec.resident_threads // threads)
            if threads != block_size and rounded_down < spec.min_blocks_per_sm:
                specs.append(replace(spec, min_blocks=rounded_down))
            for candidate in specs:
                launch = fused_grad_launch(candidate, rows, cols, target)
                if launch is not None and not uses_local_memory(launch.spec, target):
                    return launch
    return None


def weight_copy_bytes(spec: NormSpec, cols: int) -> int:
    """Shared memory of NormGradIO::with_weight_copied."""
    return shifted_copy_elements(spec.pack_size, cols) * spec.ftype.itemsize


def grad_smem_bytes(spec: NormSpec, cols: int) -> int:
    """Dynamic shared memory of a register block dx kernel: its dweight /
    dbias partial sums (a value per owned column and gradient) when they are
    kept there, then the weight's copy."""
    smem = weight_copy_bytes(spec, cols) if spec.weight_source == "shared_copy" else 0
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
    grid = (ceil_div(cols, WEIGHT_PHASES_BLOCK), spec.pack_size, 1)
    return KernelLaunch(copies, (WEIGHT_PHASES_BLOCK, 1, 1), grid, 0)


def fused_grad_launch(spec: NormSpec, rows: int, cols: int, target: Target) -> Optional[KernelLaunch]:
    """A register block dx kernel with fused partials: one resident wave
    (a workspace row a block), whole phase periods for peeled rows; None
    where its shared memory leaves no block resident. Peeled rows read the
    weight from a copy in shared memory or from its phase copies
    (AUTO_GRAD_PHASE_COPIES_FROM_BLOCK)."""
    tuned = profile_for(target.facts)
    if spec.peel and spec.weight:
        spec = replace(spec, weight_source="phase_copies")
    smem = grad_smem_bytes(spec, cols)
    blocks = target.max_active_blocks(spec, spec.block_size, smem, True)
    phases_from = tuned.AUTO_GRAD_PHASE_COPIES_FROM_BLOCK.get((family_of(spec.op), spec.ftype.itemsize), math.inf)
    if spec.peel and spec.weight and blocks and spec.block_size < phases_from:
        copied = replace(spec, weight_source="shared_copy")
        copied_smem = grad_smem_bytes(copied, cols)
        if target.max_active_blocks(copied, spec.block_size, copied_smem, True) == blocks:
            spec, smem = copied, copied_smem
    if smem > target.facts.smem_per_block_optin or not blocks:
        return None
    return resident_launch(spec, rows, smem, target)


def fused_grad_plan(main: KernelLaunch, cols: int) -> NormGradPlan:
    """The backward plan around a dx kernel with fused partials: the weight's
    phase copies it may read, its workspace row a block (a cluster), the
    finish kernel."""
    spec = main.spec
    return NormGradPlan(main, None, finish_launch(family_of(spec.op), spec.dtype, cols),
                        main.grid[0] // spec.cluster_size, 0, weight_phases_launch(spec, cols))


def param_grad_launches(family, dtype, rows, cols, target):
    """The column reduction (dy * xhat and dy over chunks of rows) and its grid."""
    tuned = profile_for(target.facts)
    col_tiles = ceil_div(cols, PARAM_GRAD_BLOCK[0])
    row_tiles = ceil_div(rows, PARAM_GRAD_BLOCK[1])
    wanted = ceil_div(target.facts.sm_count * tuned.PARAM_GRAD_BLOCKS_PER_SM, col_tiles)
    rows_per_chunk = ceil_div(rows, min(row_tiles, wanted))
    chunks = ceil_div(rows, rows_per_chunk)
    spec = NormSpec(f"{family}_param_grad", "param_grad", dtype)
    return KernelLaunch(spec, PARAM_GRAD_BLOCK + (1,), (col_tiles, chunks, 1), 0), chunks, rows_per_chunk


def finish_launch(family, dtype, cols) -> KernelLaunch:
    """One launch sums the partials of every parameter gradient: blockIdx.y
    picks dweight (0) or dbias (1, LayerNorm only)."""
    spec = NormSpec("norm_param_grad_finish", "param_grad_finish", dtype)
    grid = (ceil_div(cols, PARAM_GRAD_BLOCK[0]), PARAM_GRADS[family], 1)
    return KernelLaunch(spec, PARAM_GRAD_BLOCK + (1,), grid, 0)


def auto_backward_dx(fields, rows, cols, align, target) -> KernelLaunch:
    """auto's dx kernel without fused partials (rows too long for register
    partials, or no dweight / dbias wanted): the warp path, a register block
    rung, shared memory or the row read twice."""
    tuned = profile_for(target.facts)
    ftype = dtypes.BY_SHORT[fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    pack = vector_pack_size(cols, ftype.itemsize, align)
    ladder = auto_warp_ladder(cols, pack, warp_max_cols_per_thread("backward", compute_itemsize, pack))
    if ladder is not None:
        return warp_launch(fields, rows, cols, pack, ladder, target, "auto")
    # the ladder counts bytes as stored, register rungs in the compute type
    widening = compute_itemsize // ftype.itemsize
    ladder = tuned.AUTO_GRAD_BLOCK_LADDER[family_of(fields["op"])]
    block_ladder = [(block_size, max_bytes * widening, grad_holding(held, "regs", rows_per_access), True)
                    for block_size, max_bytes, held, _, rows_per_access in ladder]
    launch = first_register_rung(fields, rows, cols, target, "backward", block_ladder, pack, False)
    if launch is not None:
        return launch
    launch = smem_launch(fields, rows, cols, pack, 2 * cols * compute_itemsize, target, "auto", True,
                         "same_occupancy")
    return launch or uncached_launch(fields, rows, pack, target, "auto")


def plan(family: str, rows: int, cols: int, dtype: str, policy: str, target: Target, align: int,
         weight: bool, param_grad: bool, same_phase: bool) -> NormGradPlan:
    """The backward plan of `family` ("layer_norm" or "rms_norm"), as
    norm.plan takes its arguments: auto fuses the partial sums into the dx
    kernel where they fit, else (and under oneflow) a column reduction
    follows the dx kernel; without param_grad, the dx kernel alone."""
    fields = dict(op=f"{family}_grad", dtype=dtype, weight=weight)
    main = None
    if policy == "auto" and param_grad:
        main = _auto_backward_fused({**fields, "fuse_param_grad": True}, rows, cols, align, same_phase, target)
    if main is None and policy == "oneflow":
        main = oneflow_launch(family, fields, rows, cols, align, target, 2)
    elif main is None:
        main = auto_backward_dx(fields, rows, cols, align, target)
    return grad_plan(main, rows, cols, param_grad, target)


def grad_plan(main: KernelLaunch, rows: int, cols: int, param_grad: bool, target: Target) -> NormGradPlan:
    """The backward plan around the dx kernel `main`: with fused partials
    fused_grad_plan's; else, where dweight / dbias are wanted, the column
    reduction and the finish kernel after it; else the dx kernel alone."""
    spec = main.spec
    if spec.fuse_param_grad:
        return fused_grad_plan(main, cols)
    if not param_grad:
        return NormGradPlan(main, None, None, 0, 0)
    family = family_of(spec.op)
    column_reduction, chunks, rows_per_chunk = param_grad_launches(family, spec.dtype, rows, cols, target)
    return NormGradPlan(main, column_reduction, finish_launch(family, spec.dtype, cols), chunks, rows_per_chunk)
