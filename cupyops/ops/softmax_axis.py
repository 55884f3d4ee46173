"""softmax and log_softmax, forward and backward, over one non-last axis,
without a transpose copy.

A C-contiguous array reduced over axis k is seen as (outer, cols, inner):
outer = product of the axes before k, cols = shape[k], inner = product of the
axes after k. The kernel (kernels/softmax_axis.cuh) gives a block a tile of
one `outer` index and block_x packs of consecutive `inner` indices, so a
warp reads whole sectors of consecutive rows; block_y rows of threads split
the `cols` axis and combine their partial reductions (forward: (max, sum);
backward: sum(dy * y) or sum(dy)) through shuffles and shared memory.
"cached" keeps the tile of every input (x; or dy and y) in shared memory (one
read of the arrays); "online" reads them again for the outputs (two reads).
On sm_90 and newer a large cached tile is shared by the cluster_size blocks of
a thread-block cluster, each caching a share of its cols; they combine their
reductions through distributed shared memory (kernels/cluster.cuh).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy

from .. import arrays, dtypes, jit
from ..callcache import writable
from ..device import WARP_SIZE, DeviceFacts, has_clusters
from ..launch import LaunchCache, Target, get_num_blocks, live_function
from ..profile import profile_for
from .row_packs import vector_pack_size
from .softmax_rows import INPUTS

OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")

# Slices narrower than this (elements along inner) take the rows path with a copy.
# AXIS_MIN_INNER: a value of the device profile (cupyops/profiles/*.json).
# Bytes of each row a tile covers (plan()'s rule 3): the wide tiles, widest first,
# then the narrow one (a 32-byte sector) for the longest cols.
AXIS_TILE_ROW_BYTES = (128, 64)
AXIS_NARROW_ROW_BYTES = 32
# Most threads along inner (a warp).
AXIS_MAX_BLOCK_X = 32
# AXIS_BLOCK_THREADS: a value of the device profile (cupyops/profiles/*.json).
# AXIS_CACHED_MAX_BLOCK_THREADS: a value of the device profile (cupyops/profiles/*.json).
AXIS_MAX_BLOCK_THREADS = 1024
STATIC_SMEM_BYTES = 48 * 1024      # CUDA's limit on a kernel's static shared memory
# Loads through registers: bytes a thread loads before using the first of
# them, by block size (a 1024-thread block gets 64 registers a thread), in at
# most AXIS_MAX_LOADS_IN_FLIGHT rows of a pack of every input. A cached tile
# of packs of 4 bytes or more is filled by cp.async instead: all of it in
# flight, no registers.
AXIS_BYTES_IN_FLIGHT = ((512, 64), (1024, 32))     # (most threads, bytes)
AXIS_MAX_LOADS_IN_FLIGHT = 8
AXIS_ASYNC_MIN_PACK_BYTES = 4
# Registers a thread is planned with when blocks share an SM: the most the
# kernels take unbounded (32 to 64); bound to 40, some spill.
AXIS_THREAD_REGISTERS = 64
# Largest share of a tile a block keeps in shared memory for a single read of
# the array, and (plan()'s rule 3) the largest a block caches alone.
AXIS_CACHE_MAX_BYTES = 128 * 1024
# AXIS_ALONE_MAX_BYTES: a value of the device profile (cupyops/profiles/*.json).
# AXIS_ALONE_MAX_BYTES_16BIT_FORWARD: a value of the device profile (cupyops/profiles/*.json).
# Tiles too large to cache and fewer than this many per SM: the rows path.
# AXIS_MIN_TILES_PER_SM: a value of the device profile (cupyops/profiles/*.json).
# Thread-block clusters (sm_90 and newer, device.has_clusters): a tile too
# large for a block alone is shared by the blocks of a cluster of one of
# AXIS_CLUSTER_SIZES (the portable sizes, fewest first), each caching at most
# AXIS_CLUSTER_BLOCK_BYTES, so that several blocks reside on an SM and one's
# loads overlap another's writes.
AXIS_CLUSTER_SIZES = (2, 4, 8)
AXIS_CLUSTER_BLOCK_BYTES = 64 * 1024
# Backward tiles too large for AXIS_CLUSTER_BLOCK_BYTES shares are read twice
# (plan()'s rule 3d) rather than cached in 8-block clusters of AXIS_CACHE_MAX_BYTES
# shares (one block an SM), in the widest tiles that still number this many
# an SM. H200, % of copy, read twice against the clusters: (16, 16384, 256)
# f16 50.7 against 48.3, f32 57.1 against 50.5; (8, 16384, 512) f16 53.5
# against 47.3, f32 57.9 against 49.8. Past them, wide tiles read twice beat
# the 32-byte tile: (64, 32768, 256) f16 57.9 in 128-byte tiles, at most
# 42.0 in 32-byte ones. Forward keeps the clusters: (16, 16384, 256) f16 52.9
# against 46.9 read twice in 64-byte tiles.
AXIS_TWICE_MIN_TILES_PER_SM = 0.9


@dataclass(frozen=True)
class SoftmaxAxisSpec(jit.KernelSpec):
    template = "softmax_axis.cu.j2"

    op: str
    dtype: str              # short name of the storage type
    pack_size: int          # elements along inner per access
    block_x: int            # threads along inner
    block_y: int            # threads splitting the cols axis
    loads_in_flight: int    # packs loaded through registers before use; 0: cp.async fills the cache
    cached: bool            # tile kept in shared memory (one read) or read twice
    cluster_size: int = 1   # blocks of a thread-block cluster sharing a tile's cols (cached only)
    min_blocks: int = 1     # blocks per SM its registers must allow (__launch_bounds__)
    base2_exp: bool = False  # terms 2^(x log2(e) - shift) (Base2Exp, kernels/softmax.cuh): base2_terms

    def __post_init__(self):
        if self.base2_exp and not base2_terms(self.op, self.dtype, self.cached):
            raise ValueError(f"base-2 terms are for float16 softmax over a cached tile, not {self.op} "
                             f"{self.dtype} {'cached' if self.cached else 'online'}")

    @property
    def ftype(self) -> dtypes.FloatType:
        return dtypes.BY_SHORT[self.dtype]

    @property
    def name(self) -> str:
        loads = f"_l{self.loads_in_flight}" if self.loads_in_flight else "_async"
        cluster = f"_c{self.cluster_size}" if self.cluster_size > 1 else ""
        min_blocks = f"_m{self.min_blocks}" if self.min_blocks > 1 else ""
        exp = "_e2" if self.base2_exp else ""
        return (f"{self.op}_axis_{self.dtype}_{self.ftype.compute}_p{self.pack_size}"
                f"_b{self.block_x}x{self.block_y}{loads}_{'cached' if self.cached else 'online'}"
                f"{cluster}{min_blocks}{exp}")

    @property
    def threads_per_block(self) -> int:
        return self.block_x * self.block_y

    def template_args(self) -> dict:
        exp_form = "Base2Exp" if self.base2_exp else f"NaturalExp<{self.ftype.compute_c_type}>"
        return {**super().template_args(), "inputs": INPUTS[self.op], "exp_form": exp_form,
                "backward": self.op.endswith("_backward"),
                "algorithm": "kLogSoftmax" if self.op.startswith("log_") else "kSoftmax",
                "storage_type": self.ftype.c_type, "compute_type": self.ftype.compute_c_type}


@dataclass(frozen=True)
class SoftmaxAxisPlan:
    spec: SoftmaxAxisSpec
    outer: int
    cols: int
    inner: int
    block: tuple
    grid: tuple             # a multiple of the cluster size
    smem_bytes: int         # dynamic shared memory: a block's rows of the cached tile of every input

    def explain(self) -> dict:
        spec = self.spec
        return {"op": spec.op, "impl": "axis", "outer": self.outer, "cols": self.cols,
                "inner": self.inner, "pack_size": spec.pack_size, "cached": spec.cached,
                "cluster_size": spec.cluster_size, "base2_exp": spec.base2_exp,
                "block": list(self.block), "grid": list(self.grid),
                "smem_bytes": self.smem_bytes, "kernel": spec.name}


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _prev_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def base2_terms(op: str, dtype: str, cached: bool) -> bool:
    """plan()'s rule 9: whether the kernel sums base-2 terms (Base2Exp): float16 softmax over a cached tile.

    Its compute passes bound it, and the base-2 term is an FFMA and an EX2
    where the natural one is an FADD, an FMUL and an EX2 (H200, (64, 4096, 256)
    over axis 1: 77.3 -> 79.4 % of copy; (32, 4096, 512) 77.0 -> 78.6). Not for
    log_softmax (it subtracts the natural sum's log), bfloat16 and float32
    (m log2(e) overflows past 2.3e38), nor the running sums of tiles read twice."""
    return op == "softmax" and dtype == "f16" and cached


def _tile_width(row_bytes: int, inner_packs: int, pack_bytes: int) -> int:
    """block_x of a tile covering `row_bytes` of each row (fewer where inner is narrower)."""
    return min(_next_power_of_two(inner_packs), max(1, row_bytes // pack_bytes), AXIS_MAX_BLOCK_X)


def tile_shape(arch: str, cols: int, inner_packs: int, pack_bytes: int, num_inputs: int,
               alone_bytes: int, twice_width: Optional[int] = None) -> tuple:
    """(block_x, cluster size) of a tile on `arch` (e.g. "sm_90"): the first
    of plan()'s rule 3 choices whose share of `cols` rows, block_x packs of
    `pack_bytes` of each of `num_inputs` inputs a row, fits. `alone_bytes`:
    the most a block caches alone; twice_width (plan()'s rule 3d, twice_tile_width):
    clusters take no shares over AXIS_CLUSTER_BLOCK_BYTES, and a tile none
    of the choices fits is this wide (else the narrow tile)."""
    def share(block_x: int, size: int) -> int:
        return -(-cols // size) * block_x * num_inputs * pack_bytes

    sizes = AXIS_CLUSTER_SIZES if has_clusters(arch) else ()
    alone = min(alone_bytes, AXIS_CACHE_MAX_BYTES)
    budget = min(AXIS_CLUSTER_BLOCK_BYTES, AXIS_CACHE_MAX_BYTES)
    wide = [_tile_width(row_bytes, inner_packs, pack_bytes) for row_bytes in AXIS_TILE_ROW_BYTES]
    narrow = _tile_width(AXIS_NARROW_ROW_BYTES, inner_packs, pack_bytes)
    ladder = ([(block_x, 1, alone) for block_x in wide]
              + [(block_x, size, budget) for block_x in wide for size in sizes]
              + [(narrow, 1, alone)] + [(narrow, size, budget) for size in sizes]
              + [(narrow, size, AXIS_CACHE_MAX_BYTES) for size in sizes if twice_width is None])
    return next(((block_x, size) for block_x, size, limit in ladder if share(block_x, size) <= limit),
                (twice_width or narrow, 1))


def twice_tile_width(outer: int, inner_packs: int, pack_bytes: int, sm_count: int) -> Optional[int]:
    """block_x of a backward tile read twice (plan()'s rule 3d): the widest of
    AXIS_TILE_ROW_BYTES and AXIS_NARROW_ROW_BYTES of which the array has at
    least AXIS_TWICE_MIN_TILES_PER_SM x SMs tiles; None where none has."""
    widths = [_tile_width(row_bytes, inner_packs, pack_bytes)
              for row_bytes in AXIS_TILE_ROW_BYTES + (AXIS_NARROW_ROW_BYTES,)]
    return next((block_x for block_x in widths
                 if outer * -(-inner_packs // block_x) >= AXIS_TWICE_MIN_TILES_PER_SM * sm_count), None)


def resident_blocks(facts: DeviceFacts, block_bytes: int, threads: int, registers_per_thread: int) -> int:
    """Blocks of `threads` caching `block_bytes` each that an SM holds by its
    shared memory, its thread slots and its registers."""
    by_smem = facts.smem_per_sm // (block_bytes + facts.smem_reserved_per_block)
    by_registers = facts.regs_per_sm // (threads * registers_per_thread)
    return max(1, min(by_smem, facts.max_threads_per_sm // threads, by_registers, facts.max_blocks_per_sm))


def loads_in_flight(threads: int, row_pack_bytes: int, pack_bytes: int, cached: bool) -> int:
    """The spec's loads_in_flight for blocks of `threads` loading `row_pack_bytes`
    a row (a pack of every input): 0 where cp.async fills a cached tile (packs
    of AXIS_ASYNC_MIN_PACK_BYTES or more), else AXIS_BYTES_IN_FLIGHT's bytes
    in whole rows, 1 to AXIS_MAX_LOADS_IN_FLIGHT."""
    if cached and pack_bytes >= AXIS_ASYNC_MIN_PACK_BYTES:
        return 0
    bytes_in_flight = next(size for most, size in AXIS_BYTES_IN_FLIGHT if threads <= most)
    return min(AXIS_MAX_LOADS_IN_FLIGHT, max(1, bytes_in_flight // row_pack_bytes))


def static_smem_bytes(block_x: int, block_y: int, pack_size: int, compute_itemsize: int) -> int:
    """A bound on the kernel's static shared memory (kernels/softmax_axis.cuh): two column
    reductions' partials, one a warp-row of the block, and the totals and cluster buffers,
    each a tile row of packs in the compute type."""
    partials = block_y // max(1, WARP_SIZE // block_x)
    return (2 * partials + 4) * block_x * pack_size * compute_itemsize


def grid_size(facts: DeviceFacts, threads: int, num_tiles: int, cluster_size: int) -> int:
    """OneFlow's waves of blocks for the tiles' blocks, rounded down to whole clusters."""
    return get_num_blocks(facts, threads, num_tiles * cluster_size) // cluster_size * cluster_size


@functools.lru_cache(maxsize=4096)
def plan(op: str, outer: int, cols: int, inner: int, dtype: str, target: Target,
         align: int = 16) -> Optional[SoftmaxAxisPlan]:
    """The axis-kernel plan for (outer, cols, inner) of dtype (short name) on
    `target`, or None when the rows path (with a transpose copy) should run.

    `align` is the largest power of two (<= 16) dividing the inputs' and the
    output's addresses in bytes. The rule (its tables tuned on an H200 with
    scripts/tune_axis.py):
    1. inner < AXIS_MIN_INNER: the rows path (transpose copy) -> None.
    2. pack = the largest 16-byte-or-smaller vector dividing inner that the
       pointers' alignment allows.
    3. the tile (tile_shape): block_x packs covering R bytes of each row (at
       most the packs of inner and AXIS_MAX_BLOCK_X), shared by a cluster of S
       blocks; a block caches its share, cols / S rows of a pack of every input
       (x forward, dy and y backward). The first of these whose share fits wins
       (H200, (64, 4096, 256) float16 forward: 128-byte tiles in clusters of 8,
       67 % of copy (77 % since the cluster barriers order shared memory only,
       kernels/cluster.cuh, 79 % with base-2 terms, rule 9; 16-block clusters,
       non-portable, 76 %); 32-byte tiles in clusters of 2, 56 %; one block, 47 %):
       a. R in AXIS_TILE_ROW_BYTES (widest first; whole lines of a row read DRAM
          best), a block alone, within the alone limit: AXIS_ALONE_MAX_BYTES, or
          AXIS_ALONE_MAX_BYTES_16BIT_FORWARD for 16-bit forward (two exponentials
          every 2 bytes want the threads of several blocks an SM);
       b. on sm_90 and newer (device.has_clusters), the same R, each with the
          fewest blocks of AXIS_CLUSTER_SIZES whose shares fit
          AXIS_CLUSTER_BLOCK_BYTES;
       c. R = AXIS_NARROW_ROW_BYTES: alone within the alone limit, then the
          fewest cluster blocks within AXIS_CLUSTER_BLOCK_BYTES, then (forward)
          within AXIS_CACHE_MAX_BYTES; else alone (read twice unless it fits
          AXIS_CACHE_MAX_BYTES, as where no cluster can form);
       d. backward on sm_90 and newer, when some R of a and c gives at least
          AXIS_TWICE_MIN_TILES_PER_SM x SMs tiles (twice_tile_width): c without
          its last step, and a tile a-c leave read twice takes the widest such R.
    4. cached when a block's share fits AXIS_CACHE_MAX_BYTES of shared memory and
       can launch. Threads per block start at AXIS_BLOCK_THREADS; blocks caching
       a tile take the most threads (by powers of two, up to
       AXIS_CACHED_MAX_BLOCK_THREADS) that keep as many of them resident on an SM
       as its shared memory, thread slots and registers (at
       AXIS_THREAD_REGISTERS a thread) allow, and the kernel is bound to that
       many resident blocks (min_blocks, its __launch_bounds__).
    5. threads double (up to AXIS_MAX_BLOCK_THREADS) while the blocks (tiles x
       cluster_size) are too few: a block's rows are then split among more
       threads. Blocks reading twice: while their threads do not fill the GPU
       (SMs x threads per SM). Blocks caching: while fewer than the SMs (their
       tiles are in flight whole; more threads a block would cost resident
       blocks: H200, (8, 2048, 1024) float16 forward, 4-block clusters of 256
       threads 52 % of copy, of 1024 threads 31 %).
    6. block_y = threads / block_x, at most the largest power of two <= a block's
       rows; threads left over by short cols widen block_x (up to a warp).
    7. tiles too large to cache and fewer than AXIS_MIN_TILES_PER_SM x SMs of
       them: the rows path -> None (only a block's threads split cols, so a few
       long tiles leave most SMs idle while the rows path spreads the rows).
    8. grid: OneFlow's waves of blocks for the tiles x cluster_size blocks,
       rounded down to whole clusters.
    9. float16 softmax over a cached tile sums base-2 terms (base2_terms), and
       its threads write 2^(x log2(e) - (shift + log2 s)) where every slice they
       hold allows it (kernels/softmax.cuh, RowSoftmax): 80.7 % of copy at
       (64, 4096, 256), 79.1 % dividing by the sum.
    """
    tuned = profile_for(target.facts)
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if outer < 1 or cols < 1 or inner < 1:
        raise ValueError(f"outer, cols and inner must be positive, got {outer} x {cols} x {inner}")
    if inner < tuned.AXIS_MIN_INNER:
        return None
    facts = target.facts
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack_size = vector_pack_size(inner, itemsize, align)
    pack_bytes = pack_size * itemsize
    row_pack_bytes = len(INPUTS[op]) * pack_bytes   # a pack of every input: a thread's row of a tile
    inner_packs = inner // pack_size
    backward = op.endswith("_backward")
    alone_bytes = tuned.AXIS_ALONE_MAX_BYTES
    if not backward and itemsize == 2:
        alone_bytes = min(alone_bytes, tuned.AXIS_ALONE_MAX_BYTES_16BIT_FORWARD)
    twice_width = (twice_tile_width(outer, inner_packs, pack_bytes, facts.sm_count)
                   if backward and has_clusters(facts.arch) else None)
    block_x, cluster = tile_shape(facts.arch, cols, inner_packs, pack_bytes, len(INPUTS[op]), alone_bytes,
                                  twice_width)
    block_rows = -(-cols // cluster)     # the rows of a tile a block caches

    # Threads per block (rules 4 and 5), from the tile's share before short
    # cols widen block_x (below, which then recomputes the share).
    threads = tuned.AXIS_BLOCK_THREADS
    share_bytes = block_rows * block_x * row_pack_bytes
    if share_bytes <= AXIS_CACHE_MAX_BYTES:   # shared memory bounds the resident blocks
        def resident(block_threads: int) -> int:
            return resident_blocks(facts, share_bytes, block_threads, AXIS_THREAD_REGISTERS)

        while threads < tuned.AXIS_CACHED_MAX_BLOCK_THREADS and resident(2 * threads) == resident(threads):
            threads *= 2
    num_blocks = outer * -(-inner_packs // block_x) * cluster
    gpu_threads = facts.sm_count * facts.max_threads_per_sm
    while threads < AXIS_MAX_BLOCK_THREADS and (num_blocks < facts.sm_count if share_bytes <= AXIS_CACHE_MAX_BYTES
                                                else num_blocks * threads < gpu_threads):
        threads *= 2

    block_y = min(threads // block_x, _prev_power_of_two(block_rows))
    block_x = min(max(block_x, threads // block_y), _next_power_of_two(inner_packs),
                  AXIS_MAX_BLOCK_X)
    block_y = max(block_y, WARP_SIZE // block_x)
    compute_itemsize = dtypes.BY_SHORT[dtypes.BY_SHORT[dtype].compute].itemsize
    while block_y > WARP_SIZE // block_x and \
            static_smem_bytes(block_x, block_y, pack_size, compute_itemsize) > STATIC_SMEM_BYTES:
        block_y //= 2
    num_tiles = outer * -(-inner_packs // block_x)
    block_bytes = block_rows * block_x * row_pack_bytes
    if block_bytes > AXIS_CACHE_MAX_BYTES and num_tiles < tuned.AXIS_MIN_TILES_PER_SM * facts.sm_count:
        return None

    threads = block_x * block_y
    min_blocks = resident_blocks(facts, block_bytes, threads, AXIS_THREAD_REGISTERS)
    spec = SoftmaxAxisSpec(op, dtype, pack_size, block_x, block_y,
                           loads_in_flight(threads, row_pack_bytes, pack_bytes, cached=True),
                           cached=True, cluster_size=cluster, min_blocks=min_blocks,
                           base2_exp=base2_terms(op, dtype, cached=True))
    if not (block_bytes <= AXIS_CACHE_MAX_BYTES
            and target.max_active_blocks(spec, threads, block_bytes, opt_in=True)):
        spec = SoftmaxAxisSpec(op, dtype, pack_size, block_x, block_y,
                               loads_in_flight(threads, row_pack_bytes, pack_bytes, cached=False),
                               cached=False)
        block_bytes = 0
    # A cluster's blocks are scheduled together on the SMs of one GPC; what
    # bounds the blocks resident on an SM is still its registers and shared
    # memory (the occupancy above, per SM).
    grid = grid_size(facts, threads, num_tiles, spec.cluster_size)
    return SoftmaxAxisPlan(spec, outer, cols, inner, (block_x, block_y, 1), (grid, 1, 1),
                           block_bytes)


# -- launch ------------------------------------------------------------------

_launches = LaunchCache()


def _launch_config(op, dtype, outer, cols, inner, align, device_id):
    """(function, grid, block, smem) for a live GPU, or None for the rows path; memoised."""
    def make():
        chosen = plan(op, outer, cols, inner, dtype, Target.live(device_id), align)
        if chosen is None:
            return None
        return (live_function(chosen.spec, device_id, chosen.smem_bytes), chosen.grid, chosen.block,
                chosen.smem_bytes)

    return _launches.get((op, dtype, outer, cols, inner, align, device_id), make)


def run(op: str, x, axis: int, out):
    """softmax / log_softmax of `x` over `axis` by the axis kernel, or None (see _run)."""
    return _run(op, (x,), axis, out)


def run_backward(op: str, dy, y, axis: int, out):
    """softmax_backward / log_softmax_backward of (dy, y) over `axis` by the
    axis kernel, or None (see _run). dy and y have the same shape and dtype."""
    return _run(op, (dy, y), axis, out)


def _run(op: str, inputs: tuple, axis: int, out):
    """`op` of `inputs` (the arrays INPUTS[op] names) over `axis` by the axis kernel, or None.

    The inputs are cupy arrays of one float dtype, shape and device, `axis` a
    non-negative axis other than the last, `out` None or already validated for
    shape, dtype and device. Returns the result (`out` when given) when the
    kernel applies: every input C-contiguous, out C-contiguous and, for each
    input, either holding that input's very elements or not overlapping it
    (callcache.writable), and the planner prefers it; otherwise None, and
    nothing was written."""
    import cupy

    if len(inputs) != len(INPUTS[op]):
        raise ValueError(f"{op} reads {len(INPUTS[op])} arrays, got {len(inputs)}")
    first = inputs[0]
    if first.size == 0 or axis >= first.ndim - 1 or not all(a.flags.c_contiguous for a in inputs):
        return None
    if out is not None and (not out.flags.c_contiguous or not writable(out, inputs)):
        return None
    shape = first.shape
    outer, cols, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    # A fresh output comes from CuPy's allocator, aligned to at least 256 bytes.
    align = arrays.alignment(*(a.data.ptr for a in inputs), out.data.ptr if out is not None else 0)
    config = _launch_config(op, dtypes.BY_DTYPE[first.dtype].short, outer, cols, inner, align,
                            first.device.id)
    if config is None:
        return None
    function, grid, block, smem = config
    result = out if out is not None else cupy.empty(shape, first.dtype)
    function(grid, block, (*inputs, result, numpy.int64(outer), numpy.int64(cols), numpy.int64(inner)),
             shared_mem=smem)
    return result
