"""The row kernels of softmax and log_softmax, forward and backward: their
instantiations (SoftmaxSpec) and the planner that picks one for a shape.

Paths (kernels/softmax.cuh): "warp" holds a row in the registers of a group
of lanes; "block_regs" holds a row in the registers of a block (auto only);
"block_async" caches a row in shared memory by cp.async, shared by a
thread-block cluster where one block's shared memory falls short, with a
register tail (auto only); "block_smem" caches a row in shared memory filled
through registers; "block_uncached" reads a row again for each pass.
policy="oneflow" is OneFlow's dispatch; policy="auto" adds 16-byte packs,
rows off the 16-byte grid read in 16-byte packs between peeled edges
(row_packs), the register and async block paths and shared memory beyond
48 KB, with the measured choices in the tables below.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .. import arrays, async_row, dtypes, jit
from ..device import has_clusters
from ..launch import MAX_GRID_X, KernelLaunch, Target, choose_block_size, get_num_blocks
from ..profile import profile_for
from .row_packs import peeled_pack, peeled_small_rows_per_block, vector_pack_size

OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")
# Arrays each op reads (the kernel's parameters, in order).
INPUTS = {"softmax": ("x",), "log_softmax": ("x",),
          "softmax_backward": ("dy", "y"), "log_softmax_backward": ("dy", "y")}
# The leading inputs a row's sum reads (kernels/softmax.cuh, sum_inputs): the
# rest only its outputs read.
SUM_INPUTS = {"softmax": 1, "log_softmax": 1, "softmax_backward": 2, "log_softmax_backward": 1}
WARP_BLOCK_THREADS = 128
UNCACHED_BLOCK_SIZE = 1024
ONEFLOW_MAX_COLS_PER_THREAD = 32
THREAD_GROUP_WIDTHS = (1, 2, 4, 8, 16, 32)

# auto, measured on an H200 (rows 49152, f16 and f32, 512 ... 65536 cols,
# forward and backward; the budgets are per input array):
# the warp path while a lane holds at most this many bytes of the row,
# AUTO_WARP_MAX_BYTES_PER_LANE: a value of the device profile (cupyops/profiles/*.json).
# one row per access for 16-bit and float32 types where OneFlow takes two
# (bf16 256 cols: 67 % of copy against 60 %; 128 cols: 54 % against 49 %;
# f32 128 cols: 71.3 % against 70.2 %);
# AUTO_WARP_ROWS_PER_ACCESS: a value of the device profile (cupyops/profiles/*.json).
# then the register block path: the smallest of these block sizes giving a
# thread at most AUTO_BLOCK_REGS_MAX_PACKS[itemsize] packs (peeled rows, off
# the 16-byte grid: AUTO_PEELED_MAX_PACKS) while a block holds at most 64 KiB
# of compute values, taken when AUTO_BLOCK_REGS_MIN_RESIDENT threads of it fit
# an SM by its registers. 16-bit rows are held as loaded (storage_cache: half
# the registers). Measured (scripts/tune_softmax.py, H200, rows 49152):
#   f32 holds up to 16 packs: 8192 cols at 128 x 16 97.4 % of copy against
#       96.0 % at 512 x 4; log-softmax 16384 cols: 256 x 16 has 142 registers
#       (256 threads an SM) and 89.6 %, 512 x 8 has 2 blocks an SM and 96.7 %;
#       peeled 12345 cols at 256 x 13: 96.7 % against 79.6 % at 512 x 7;
#   16-bit stays at 4 packs (f16 16384 cols: 256 x 8 93 % against 97 % at
#       512 x 4), 8 peeled: 12345 cols 256 x 7 held as loaded 96.6 % (64
#       registers) against 86.7 % in float (87 registers, two blocks an SM);
#   the backward (two inputs) keeps 4 and 8 packs for every type.
AUTO_BLOCK_REGS_SIZES = (128, 256, 512, 1024)
# log-softmax stops at 512 threads (f32 16384 cols: 77.6 % at 1024 x 4 against
# 91.9 % through cp.async)
# AUTO_BLOCK_REGS_LARGEST: a value of the device profile (cupyops/profiles/*.json).
# AUTO_BLOCK_REGS_MAX_PACKS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_PEELED_MAX_PACKS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_BLOCK_REGS_MAX_BYTES: a value of the device profile (cupyops/profiles/*.json).
# AUTO_BLOCK_REGS_MIN_RESIDENT: a value of the device profile (cupyops/profiles/*.json).
# then cp.async into shared memory (16-byte packs), a block or a cluster per
# row (the GPU's scheduler starts the next row's block as one leaves, rather
# than a persistent block fetching its next row), the forward maximum and sum
# in one pass over the cache. H200, rows 49152, % of copy, against a
# persistent grid prefetching the next row where two fit: f16 20480 / 32768
# / 40960 cols 97.5 / 97.6 / 98.2 against 89.5 / 91.5 / 92.3; f32 20480 /
# 32768 98.1 / 98.7 against 93.2 / 93.3; backward 101-103 against 95.7-97.6
# (reading twice as much as it writes beats the copy).
# Rows of at least this many bytes of each input take that path before the
# register path (H200, % of copy, async against registers: f16 12288 cols
# 98.7 / 96.7, f32 16384 97.5 / 96.9, log-softmax backward bf16 16384 102.0
# / 95.6; f32 12288 97.0 / 97.5; at 8192 cols the register path is as fast or
# faster: f16 97.3 / 96.4 for regs, backward bf16 102.2 / 101.2);
# AUTO_ASYNC_MIN_ROW_BYTES: a value of the device profile (cupyops/profiles/*.json).
# The async plan is the first rung of a ladder that holds the row, each rung
# (cluster_size, block_size, most tail packs, blocks an SM): the row shared
# by cluster_size blocks (a thread-block cluster, sm_90 and newer), each
# holding the last tail_packs packs a thread of its part of every input in
# registers (a register tail) and the rest in shared memory. A rung takes
# the largest tail up to `most` (0: none) that leaves the rest within the
# opt-in limit, does not spill, and leaves that many blocks resident an SM.
# A block reads, reduces and writes one row at a time, so 16-bit forward
# rows (twice the exponentials a byte) want two blocks an SM, and a
# cluster's blocks wait for one another once a row. Measured with
# scripts/tune_long_rows.py --only tails (H200, % of copy, against the
# plans that ran before):
#   16-bit forward: 16384 x 65536 at 512 x 8 packs, two blocks an SM, f16 /
#     bf16 97.2 / 97.2 against 91.6 / 89.6 (no tail, one an SM); 8192 x
#     131072 f16 at 1024 x 8 96.6 against 94.6 (1024 x 2); 4096 x 262144 f16
#     in clusters of 4 at 512 x 7 86.3 against 76.1 (clusters of 8, no tail;
#     2 x 1024 x 8: 83.5); 2048 x 524288 f16 in clusters of 8 at 512 x 7
#     80.9 against 74.5 split across cooperative blocks; longer rows stay
#     split (1024 x 1048576 f16 in 8 x 1024 x 8: 66.3 against 70.9);
#   float32 forward: 8192 x 131072 in clusters of 2 at 1024 x 8 95.6 against
#     82.4 (clusters of 8, no tail; 4 x 512 x 8: 93.3); 4096 x 262144 in
#     clusters of 4 90.2 against 74.6; 1024 x 524288 in clusters of 8 79.1
#     against 73.9 split; 16384 x 65536 at 1024 x 8 97.6 (1024 x 2: 97.7);
#     49152 x 32768 unchanged, 99.3 (512 x 8: 97.2);
#   backward: 16384 x 65536 f32 in clusters of 4 at 256 x 8, two an SM, 97.1
#     against 84.3 (split across cooperative blocks; 2 x 1024 x 4: 94.7);
#     8192 x 131072 f16 / f32 95.9 / 93.9 (clusters of 4 / 8) against 87.3 /
#     83.7; 4096 x 262144 f16 91.2 (clusters of 8) against 87.7, f32 83.9
#     (8 x 512 x 8) against 75.9; 4096 x 45056 f32 at 1024 x 4 98.8 against
#     81.8 split; rows one block holds 102-103 as before. 16-bit rows past
#     one 256-thread block's shared memory go to 1024 threads with a register
#     tail, not 256: log_softmax_backward (an exponential an output) f16
#     16384 x 65536 103.4 against 89.1, 16384 x 60000 103.2 against 84.8,
#     bf16 103.4 / 103.2 against 88.1 / 81.2; softmax_backward f16 / bf16
#     16384 x 60000 103.1 / 103.2 against 100.8 / 97.1. float32 within 0.6
#     either way; float64 log_softmax_backward 16384 x 16384 gains too (102.7
#     against 78.1) but 16384 x 15000 does not (94.9 either way), nor 512
#     threads at 18000 cols (94.6 against 102.7 in clusters of 4).
# AUTO_ASYNC_LADDERS: a value of the device profile (cupyops/profiles/*.json),
# (inputs, itemsize) -> rungs; float64 forward as float32, its tails up to 3
# packs (4 spill at 1024 threads).
# rows that allow no 16-byte pack: shared memory filled through registers,
# blocks of AUTO_SMEM_BLOCK_SIZES[(inputs, itemsize)] threads, else
# AUTO_SMEM_BLOCK_SIZE. A row's cache leaves few blocks an SM, and 256
# threads of 2- and 4-byte loads keep too few in flight. H200, % of copy,
# 1024 against 256 threads: log_softmax_backward f16 / f32 459 x 18246 (rows
# at 4- and 8-byte phases) 51.2 / 59.4 against 38.4 / 37.3, f16 49152 x 18246
# 91.3 against 76.8; softmax_backward f16 2048 x 55758 64.9 against 42.1,
# f32 4096 x 20001 68.1 against 43.1; float32 forward 287 / 16384 x 40001
# 45.8 / 67.0 against 34.7 / 49.2; 16-bit forward keeps 256 (f16 459 /
# 49152 x 20001: 36.4 / 66.7, 1024 threads 34.3 / 56.1).
# Caching dy alone (log_softmax_backward, SUM_INPUTS), narrow packs at 1024
# threads, against both inputs: f16 16384 x 30001 53.5 against 48.4, 16384 x
# 40001 54.7 / 49.2, 2048 x 55758 66.6 / 66.5, 459 x 18246 44.6 / 51.3; f32
# 459 x 18246 65.9 / 59.7.
# AUTO_SMEM_BLOCK_SIZE: a value of the device profile (cupyops/profiles/*.json).
# AUTO_SMEM_BLOCK_SIZES: a value of the device profile (cupyops/profiles/*.json).
# Such rows whose operands share each row's phase (odd cols of contiguous
# arrays) peel their edges and cache 16-byte packs between them, in blocks of
# AUTO_PEELED_SMEM_BLOCKS[(inputs, itemsize)] = (threads, launch bounds'
# blocks an SM where the cache leaves room for them; 0: none), else
# AUTO_SMEM_BLOCK_SIZE (float64, not measured); rows too long for shared
# memory are read again in 16-byte packs too, by blocks of
# AUTO_PEELED_UNCACHED_BLOCK_SIZE. Only the inputs the row's sum reads are
# cached (SUM_INPUTS; log-softmax backward reads y with the outputs). H200,
# % of copy, peeled 512 / 1024 threads against the narrow packs before:
#   forward f16 / f32 49152 x 20001 89.3 / 87.0 and 69.0 / 81.2 against 66.5
#     / 83.8; f32 16384 x 40001 71.2 / 70.9 against 67.4;
#   softmax_backward f16 49152 x 20001 84.3, 1024 bound to two blocks an SM
#     (32 registers, 20 bytes spilled) 91.3, unbound (40 registers, one
#     block) 61.0, against 58.8; bf16 84.2 / 90.4 against 61.4; 16384 x 30001
#     (one block) 60.8 / 70.7; f32 49152 x 20001 82.9 / 82.8 against 73.4;
#   log_softmax_backward caching dy alone, f16 16384 x 30001 95.9 / 100.1
#     (both cached: 60.9 / 72.4, narrow 48.4), 16384 x 40001 84.4 / 101.1,
#     2048 x 55758 77.7 / 85.0 (narrow, both cached: 66.5); f32 49152 x 20001
#     93.6 / 85.6, 16384 x 30001 70.2 / 81.1, 4096 x 24001 86.3 / 80.6, 459 x
#     18246 66.1 / 58.3;
#   uncached (287 x 116863, 512 / 1024 threads, narrow 1024): softmax f16 /
#     f32 47.4 / 45.3 / 24.5 and 50.5 / 47.3 / 35.9; softmax_backward 52.1 /
#     49.5 and 53.7 / 50.5; log_softmax_backward 63.8 / 56.9 and 65.0 / 61.2.
# AUTO_PEELED_SMEM_BLOCKS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_PEELED_UNCACHED_BLOCK_SIZE: a value of the device profile (cupyops/profiles/*.json).
# Rows of at most AUTO_NARROW_MAX_COLS cols in 1-element packs (odd cols) of
# 16-bit and float32 types (AUTO_NARROW_ITEMSIZES) take the narrowest group of
# lanes each holding at most AUTO_NARROW_LANE_ELEMENTS[inputs] elements (a
# lane a row for 3 cols), instead of a lane an element with the group padded
# to a power of two. H200, % of copy, rows x cols = 2^25, forward f16 / f32
# and backward f16 / f32: 3 cols (a lane) 60.4 / 89.7 and 78.3 / 96.5 against
# 24.3 / 45.5 and 37.7 / 65.0; 5 cols 72.5 / 93.0 (a lane) and 71.1 / 95.9
# (two lanes of 3) against 19.9 / 37.9 and 31.9 / 57.2; 7 cols (two lanes of
# 4) 64.0 / 90.8 and 70.5 / 91.8 against 26.3 / 48.8 and 41.3 / 69.3 (a lane
# of 7: 26.6 / 38.9 and 36.9 / 53.2).
# AUTO_NARROW_MAX_COLS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_NARROW_ITEMSIZES: a value of the device profile (cupyops/profiles/*.json).
AUTO_NARROW_LANE_ELEMENTS = {1: 5, 2: 4}


@dataclass(frozen=True)
class SoftmaxSpec(jit.KernelSpec):
    template = "softmax.cu.j2"

    op: str
    impl: str
    dtype: str                    # short name of the storage type
    pack_size: int
    cols_per_thread: int = 0      # warp
    thread_group_width: int = 0   # warp
    rows_per_access: int = 1      # warp
    padding: bool = False         # warp
    block_size: int = 0           # block paths
    packs_per_thread: int = 0     # block_regs
    rows_per_block: int = 1       # block_regs of 32 threads: rows a block, a warp each
    peel: bool = False            # block_regs, block_smem, block_uncached: rows start off the 16-byte grid
    storage_cache: bool = False   # block_smem, block_regs: cache packs of the input's type
    stages: int = 0               # block_async: rows in flight per block
    online: bool = False          # block_uncached, block_async: max and sum in one pass
    cluster_size: int = 1         # block_async: blocks of a thread-block cluster sharing a row
    tail_packs: int = 0           # block_async: packs of each input a thread holds in registers
    min_blocks: int = 0           # block_smem, block_regs: __launch_bounds__' blocks an SM (0: threads alone)
    cached_inputs: int = 0        # block_smem: inputs held in shared memory (0: all; the rest read twice)

    @property
    def ftype(self) -> dtypes.FloatType:
        return dtypes.BY_SHORT[self.dtype]

    @property
    def inputs(self) -> tuple:
        return INPUTS[self.op]

    @property
    def name(self) -> str:
        head = f"{self.op}_{self.impl}_{self.dtype}_{self.ftype.compute}_p{self.pack_size}"
        peel = "_peel" if self.peel else ""
        if self.impl == "warp":
            pad = "pad" if self.padding else "nopad"
            return (f"{head}_c{self.cols_per_thread}_g{self.thread_group_width}"
                    f"_r{self.rows_per_access}_{pad}")
        if self.impl == "block_regs":
            storage = "_packed" if self.storage_cache else ""
            rows = f"x{self.rows_per_block}" if self.rows_per_block > 1 else ""
            bound = f"_mb{self.min_blocks}" if self.min_blocks else ""
            return f"{head}_k{self.packs_per_thread}_b{self.block_size}{rows}{peel}{storage}{bound}"
        if self.impl == "block_smem":
            bound = f"_mb{self.min_blocks}" if self.min_blocks else ""
            cached = f"_cached{self.cached_inputs}" if self.cached_inputs else ""
            return (f"{head}_b{self.block_size}_{'packed' if self.storage_cache else 'strided'}{peel}"
                    f"{cached}{bound}")
        if self.impl == "block_async":
            cluster = f"_c{self.cluster_size}" if self.cluster_size > 1 else ""
            tail = f"_t{self.tail_packs}" if self.tail_packs else ""
            return (f"{head}_b{self.block_size}_s{self.stages}{'_online' if self.online else ''}"
                    f"{cluster}{tail}")
        passes = "online" if self.online else ("2pass" if self.op.endswith("_backward") else "3pass")
        return f"{head}_b{self.block_size}_{passes}{peel}"

    @property
    def threads_per_block(self) -> int:
        return WARP_BLOCK_THREADS if self.impl == "warp" else self.block_size * self.rows_per_block

    def explain_extra(self) -> dict:
        if self.impl != "block_async":
            return {}
        return {"stages": self.stages, "online": self.online, "cluster_size": self.cluster_size,
                "tail_packs": self.tail_packs}

    def template_args(self) -> dict:
        ftype = self.ftype
        return {**super().template_args(), "inputs": self.inputs,
                "backward": self.op.endswith("_backward"),
                "algorithm": "kLogSoftmax" if self.op.startswith("log_") else "kSoftmax",
                "storage_type": ftype.c_type,
                "compute_type": ftype.compute_c_type,
                "cache_type": ftype.c_type if self.storage_cache else ftype.compute_c_type,
                "cached_inputs": self.cached_inputs or len(self.inputs),
                "packed_cache": self.storage_cache}


SoftmaxPlan = KernelLaunch   # a row kernel's plan is its one launch


def warp_ladder(cols: int, rows: int, pack_size: int, max_cols_per_thread: int):
    """OneFlow's (cols_per_thread, thread_group_width, rows_per_access) for the warp path.

    Narrow rows: a group of g lanes (g = 1 .. 32) with one pack each, two rows
    per access when rows is even. Wider rows: a full warp with cols_per_thread
    growing by pack_size up to max_cols_per_thread. None when cols is wider."""
    for width in THREAD_GROUP_WIDTHS:
        if cols <= width * pack_size:
            return pack_size, width, 2 if rows % 2 == 0 else 1
    for cols_per_thread in range(2 * pack_size, max_cols_per_thread + 1, pack_size):
        if cols <= cols_per_thread * 32:
            return cols_per_thread, 32, 1
    return None


def narrow_ladder(cols: int, num_inputs: int):
    """(cols_per_thread, thread_group_width, rows_per_access) of rows of
    AUTO_NARROW_MAX_COLS cols or fewer in 1-element packs: the narrowest
    power-of-two group whose lanes hold at most AUTO_NARROW_LANE_ELEMENTS."""
    width = 1
    while -(-cols // width) > AUTO_NARROW_LANE_ELEMENTS[num_inputs]:
        width *= 2
    return -(-cols // width), width, 1


def warp_plan(op, dtype, rows, cols, pack_size, ladder, target) -> SoftmaxPlan:
    """The warp path's plan for one (cols_per_thread, width, rows_per_access)
    ladder step (the planners' and the tuner's)."""
    cols_per_thread, width, rows_per_access = ladder
    spec = SoftmaxSpec(op, "warp", dtype, pack_size, cols_per_thread=cols_per_thread,
                       thread_group_width=width, rows_per_access=rows_per_access,
                       padding=cols != cols_per_thread * width)
    return warp_spec_plan(spec, rows, target)


def warp_spec_plan(spec: SoftmaxSpec, rows: int, target) -> SoftmaxPlan:
    """A warp-path spec's launch: 128-thread blocks of groups of lanes, enough for the waves."""
    width = spec.thread_group_width
    groups_per_block = WARP_BLOCK_THREADS // width
    row_groups = -(-rows // spec.rows_per_access)
    grid = get_num_blocks(target.facts, WARP_BLOCK_THREADS, -(-row_groups // groups_per_block))
    return SoftmaxPlan(spec, (width, groups_per_block, 1), (grid, 1, 1), 0)


def block_plan(spec: SoftmaxSpec, rows: int, smem: int, target) -> SoftmaxPlan:
    """A block path's launch: a block (rows_per_block rows) at a time, enough blocks for the waves."""
    grid = get_num_blocks(target.facts, spec.threads_per_block, -(-rows // spec.rows_per_block))
    return SoftmaxPlan(spec, (spec.block_size, spec.rows_per_block, 1), (grid, 1, 1), smem)


def per_row_plan(spec: SoftmaxSpec, rows: int, smem: int) -> SoftmaxPlan:
    """A block, or a cluster of cluster_size blocks, a row (as many as a grid takes)."""
    clusters = min(rows, MAX_GRID_X // spec.cluster_size)
    return SoftmaxPlan(spec, (spec.block_size, 1, 1), (clusters * spec.cluster_size, 1, 1), smem)


def _oneflow_smem_plan(op, dtype, rows, cols, pack_size, target):
    smem = len(INPUTS[op]) * cols * dtypes.BY_SHORT[dtypes.BY_SHORT[dtype].compute].itemsize

    def spec_of(block_size):
        return SoftmaxSpec(op, "block_smem", dtype, pack_size, block_size=block_size)

    block_size = choose_block_size(target, spec_of, smem, opt_in=False)
    return None if block_size is None else block_plan(spec_of(block_size), rows, smem, target)


def uncached_plan(op, dtype, rows, pack_size, online, target, peel=False):
    """online: a running (max, sum) pass instead of separate max and sum passes (forward only);
    peel: 16-byte packs between each row's edges (auto)."""
    tuned = profile_for(target.facts)
    block_size = tuned.AUTO_PEELED_UNCACHED_BLOCK_SIZE if peel else UNCACHED_BLOCK_SIZE
    spec = SoftmaxSpec(op, "block_uncached", dtype, pack_size, block_size=block_size,
                       online=online and len(INPUTS[op]) == 1, peel=peel)
    return block_plan(spec, rows, 0, target)


def _oneflow_plan(op, dtype, rows, cols, align, target) -> SoftmaxPlan:
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack_size = 2 if cols % 2 == 0 and align >= 2 * itemsize else 1
    if dtype != "f64":
        warp = cols < 1024 if op == "softmax" else cols <= 1024   # OneFlow's forward uses <
        if warp:
            ladder = warp_ladder(cols, rows, pack_size, ONEFLOW_MAX_COLS_PER_THREAD)
            return warp_plan(op, dtype, rows, cols, pack_size, ladder, target)
        plan = _oneflow_smem_plan(op, dtype, rows, cols, pack_size, target)
        if plan is not None:
            return plan
    return uncached_plan(op, dtype, rows, pack_size, False, target)


def regs_plan(op, dtype, rows, cols, pack_size, same_phase, target, small_peeled=False):
    """A block per row cached in registers, or None where no block size fits.
    small_peeled: only AUTO_PEELED_SMALL_BLOCKS, for rows off the 16-byte grid."""
    tuned = profile_for(target.facts)
    ftype = dtypes.BY_SHORT[dtype]
    num_inputs = len(INPUTS[op])
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    # Rows off the 16-byte grid still take 16-byte packs when input and output
    # are off by the same amount: the register path peels each row's edges.
    regs_pack, peel = peeled_pack(pack_size, ftype.itemsize, same_phase)
    if small_peeled and not peel:
        return None
    num_packs = cols // regs_pack
    if small_peeled:
        block_sizes, max_packs = tuned.AUTO_PEELED_SMALL_BLOCKS, tuned.AUTO_PEELED_SMALL_MAX_PACKS
    else:
        largest = tuned.AUTO_BLOCK_REGS_LARGEST.get(op, AUTO_BLOCK_REGS_SIZES[-1])
        block_sizes = [size for size in AUTO_BLOCK_REGS_SIZES if size <= largest]
        max_packs = (tuned.AUTO_PEELED_MAX_PACKS.get((ftype.itemsize, num_inputs), 8) if peel
                     else tuned.AUTO_BLOCK_REGS_MAX_PACKS.get((ftype.itemsize, num_inputs), 4))
    for block_size in block_sizes:
        packs_per_thread = -(-num_packs // block_size)
        if (packs_per_thread <= max_packs and
                packs_per_thread * regs_pack * compute_itemsize * block_size <= tuned.AUTO_BLOCK_REGS_MAX_BYTES):
            rows_per_block = peeled_small_rows_per_block(block_size) if small_peeled else 1
            spec = SoftmaxSpec(op, "block_regs", dtype, regs_pack, block_size=block_size,
                               packs_per_thread=packs_per_thread, rows_per_block=rows_per_block, peel=peel,
                               storage_cache=ftype.itemsize < compute_itemsize)
            threads = spec.threads_per_block
            resident = target.max_active_blocks(spec, threads, 0, False) * threads
            if resident >= tuned.AUTO_BLOCK_REGS_MIN_RESIDENT:
                return block_plan(spec, rows, 0, target)
    return None


def async_share_bytes(spec: SoftmaxSpec, cols: int) -> int:
    """Shared memory an async block caches a stage (async_row.share_bytes)."""
    return async_row.share_bytes(len(spec.inputs), cols * spec.ftype.itemsize, spec.block_size,
                                 spec.tail_packs, spec.cluster_size)


def _async_plan(op, dtype, rows, cols, pack_size, target):
    """cp.async into shared memory: the first rung of AUTO_ASYNC_LADDERS that
    holds the row (a block or a cluster per row, with or without a register
    tail); None when none does."""
    tuned = profile_for(target.facts)
    num_inputs = len(INPUTS[op])
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    row_bytes = cols * itemsize
    for cluster_size, block_size, most, min_blocks in tuned.AUTO_ASYNC_LADDERS[num_inputs, itemsize]:
        if cluster_size > 1 and not has_clusters(target.facts.arch):
            continue

        def spec_of(tail_packs):
            return SoftmaxSpec(op, "block_async", dtype, pack_size, block_size=block_size, stages=1,
                               online=num_inputs == 1, cluster_size=cluster_size, tail_packs=tail_packs)

        tails = async_row.largest_tails_first(num_inputs, row_bytes, block_size, target.facts.smem_per_block_optin,
                                              cluster_size, most)
        found = async_row.rung_spec(spec_of, num_inputs, row_bytes, target, cluster_size, block_size, tails,
                                    min_blocks)
        if found is not None:
            spec, share_bytes = found
            return per_row_plan(spec, rows, share_bytes)
    return None


def _auto_plan(op, dtype, rows, cols, align, same_phase, target) -> SoftmaxPlan:
    tuned = profile_for(target.facts)
    ftype = dtypes.BY_SHORT[dtype]
    num_inputs = len(INPUTS[op])
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    pack_size = vector_pack_size(cols, ftype.itemsize, align)
    max_cols_per_thread = max(tuned.AUTO_WARP_MAX_BYTES_PER_LANE // compute_itemsize, pack_size)
    if cols >= tuned.AUTO_PEELED_SMALL_MIN_COLS:
        small_plan = regs_plan(op, dtype, rows, cols, pack_size, same_phase, target, small_peeled=True)
        if small_plan is not None:
            return small_plan
    if pack_size == 1 and cols <= tuned.AUTO_NARROW_MAX_COLS and ftype.itemsize in tuned.AUTO_NARROW_ITEMSIZES:
        ladder = narrow_ladder(cols, num_inputs)
    else:
        ladder = warp_ladder(cols, rows, pack_size, max_cols_per_thread)
    if ladder is not None:
        cols_per_thread, width, rows_per_access = ladder
        rows_per_access = tuned.AUTO_WARP_ROWS_PER_ACCESS.get(ftype.itemsize, rows_per_access)
        return warp_plan(op, dtype, rows, cols, pack_size, (cols_per_thread, width, rows_per_access),
                          target)
    aligned = pack_size * ftype.itemsize == 16   # cp.async's 16-byte packs
    if not (aligned and cols * ftype.itemsize >= tuned.AUTO_ASYNC_MIN_ROW_BYTES):
        in_registers = regs_plan(op, dtype, rows, cols, pack_size, same_phase, target)
        if in_registers is not None:
            return in_registers
    if aligned:
        async_plan = _async_plan(op, dtype, rows, cols, pack_size, target)
        if async_plan is not None:
            return async_plan
    # Rows off the 16-byte grid whose operands share each row's phase keep
    # 16-byte packs between the row's peeled edges here too. Only the inputs
    # the row's sum reads are cached (log-softmax backward: dy).
    cache_pack, peel = peeled_pack(pack_size, ftype.itemsize, same_phase)
    cached_inputs = SUM_INPUTS[op]
    cache_bytes = cached_inputs * cols * ftype.itemsize
    key = (num_inputs, ftype.itemsize)
    if peel:
        block_size, min_blocks = tuned.AUTO_PEELED_SMEM_BLOCKS.get(key, (tuned.AUTO_SMEM_BLOCK_SIZE, 0))
    else:
        block_size, min_blocks = tuned.AUTO_SMEM_BLOCK_SIZES.get(key, tuned.AUTO_SMEM_BLOCK_SIZE), 0
    spec = SoftmaxSpec(op, "block_smem", dtype, cache_pack, block_size=block_size, storage_cache=True, peel=peel,
                       cached_inputs=cached_inputs if cached_inputs < num_inputs else 0)
    if min_blocks:   # where the row's cache leaves room for them
        bound = replace(spec, min_blocks=min_blocks)
        if target.max_active_blocks(bound, block_size, cache_bytes, True) >= min_blocks:
            spec = bound
    if target.max_active_blocks(spec, spec.block_size, cache_bytes, True):
        return block_plan(spec, rows, cache_bytes, target)
    return uncached_plan(op, dtype, rows, cache_pack, True, target, peel)


@functools.lru_cache(maxsize=4096)
def plan(op: str, rows: int, cols: int, dtype: str, policy: str, target: Target,
         align: int = 16, same_phase: bool = True) -> SoftmaxPlan:
    """The launch plan for `rows` x `cols` of dtype (short name) on `target`.

    `align` is the largest power of two (<= 16) dividing every operand's
    address and row stride in bytes; `same_phase` says every row of every
    operand starts at the same offset from a 16-byte boundary."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    arrays.check_policy(policy)
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
    if policy == "oneflow":
        return _oneflow_plan(op, dtype, rows, cols, align, target)
    return _auto_plan(op, dtype, rows, cols, align, same_phase, target)
