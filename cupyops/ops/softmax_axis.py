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

Planner rule (the thresholds below are data: first guesses, not yet measured;
to be tuned on the GPU):
1. inner < AXIS_MIN_INNER: the rows path (transpose copy) -> None.
2. pack = the largest 16-byte-or-smaller vector dividing inner that the
   pointers' alignment allows; block_x = the packs covering
   AXIS_TILE_ROW_BYTES of a row (at most the packs of inner).
3. cached when a tile (inputs x cols x block_x packs: x forward, dy and y
   backward) fits AXIS_CACHE_MAX_BYTES of shared memory and can launch; then
   blocks get enough threads that the resident ones fill the SM's thread slots.
4. threads per block start at AXIS_BLOCK_THREADS and double (up to
   AXIS_MAX_BLOCK_THREADS) while the tiles' threads do not fill the GPU
   (SMs x threads per SM): the cols axis is then split among more threads.
5. block_y = threads / block_x, at most the largest power of two <= cols;
   threads left over by short cols widen block_x (up to a warp).
6. tiles too large to cache and fewer than AXIS_MIN_TILES_PER_SM x SMs of
   them: the rows path -> None (only a block's threads split cols, so a few
   long tiles leave most SMs idle while the rows path spreads the rows).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy

from .. import arrays, dtypes, jit
from ..device import WARP_SIZE
from ..launch import LaunchCache, Target, get_num_blocks, live_function
from .softmax import INPUTS, vector_pack_size

OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")

# Slices narrower than this (elements along inner) take the rows path with a copy.
AXIS_MIN_INNER = 32
# Bytes of each row a tile covers at first: one 32-byte sector.
AXIS_TILE_ROW_BYTES = 32
# Most threads along inner (a warp).
AXIS_MAX_BLOCK_X = 32
AXIS_BLOCK_THREADS = 256
AXIS_MAX_BLOCK_THREADS = 1024
# Loads through registers: bytes a thread loads before using the first of
# them, by block size (a 1024-thread block gets 64 registers a thread), in at
# most AXIS_MAX_LOADS_IN_FLIGHT rows of a pack of every input. A cached tile
# of packs of 4 bytes or more is filled by cp.async instead: all of it in
# flight, no registers.
AXIS_BYTES_IN_FLIGHT = ((512, 64), (1024, 32))     # (most threads, bytes)
AXIS_MAX_LOADS_IN_FLIGHT = 8
AXIS_ASYNC_MIN_PACK_BYTES = 4
# Largest tile kept in shared memory for a single read of the array.
AXIS_CACHE_MAX_BYTES = 128 * 1024
# Tiles too large to cache and fewer than this many per SM: the rows path.
AXIS_MIN_TILES_PER_SM = 0.25


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

    @property
    def ftype(self) -> dtypes.FloatType:
        return dtypes.BY_SHORT[self.dtype]

    @property
    def name(self) -> str:
        loads = f"_l{self.loads_in_flight}" if self.loads_in_flight else "_async"
        return (f"{self.op}_axis_{self.dtype}_{self.ftype.compute}_p{self.pack_size}"
                f"_b{self.block_x}x{self.block_y}{loads}_{'cached' if self.cached else 'online'}")

    @property
    def threads_per_block(self) -> int:
        return self.block_x * self.block_y

    def template_args(self) -> dict:
        return {**super().template_args(), "inputs": INPUTS[self.op],
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
    grid: tuple
    smem_bytes: int         # dynamic shared memory: the cached tile of every input

    def explain(self) -> dict:
        spec = self.spec
        return {"op": spec.op, "impl": "axis", "outer": self.outer, "cols": self.cols,
                "inner": self.inner, "pack_size": spec.pack_size, "cached": spec.cached,
                "block": list(self.block), "grid": list(self.grid),
                "smem_bytes": self.smem_bytes, "kernel": spec.name}


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _prev_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@functools.lru_cache(maxsize=4096)
def plan(op: str, outer: int, cols: int, inner: int, dtype: str, target: Target,
         align: int = 16) -> Optional[SoftmaxAxisPlan]:
    """The axis-kernel plan for (outer, cols, inner) of dtype (short name) on
    `target`, or None when the rows path (with a transpose copy) should run.

    `align` is the largest power of two (<= 16) dividing the inputs' and the
    output's addresses in bytes."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if outer < 1 or cols < 1 or inner < 1:
        raise ValueError(f"outer, cols and inner must be positive, got {outer} x {cols} x {inner}")
    if inner < AXIS_MIN_INNER:
        return None
    facts = target.facts
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack_size = vector_pack_size(inner, itemsize, align)
    pack_bytes = pack_size * itemsize
    row_pack_bytes = len(INPUTS[op]) * pack_bytes   # a pack of every input: a thread's row of a tile
    inner_packs = inner // pack_size
    block_x = min(_next_power_of_two(inner_packs), max(1, AXIS_TILE_ROW_BYTES // pack_bytes))

    threads = AXIS_BLOCK_THREADS
    tile_bytes = cols * block_x * row_pack_bytes
    if tile_bytes <= AXIS_CACHE_MAX_BYTES:   # shared memory bounds the resident blocks
        resident = max(1, facts.smem_per_sm // (tile_bytes + facts.smem_reserved_per_block))
        while threads < AXIS_MAX_BLOCK_THREADS and threads * resident < facts.max_threads_per_sm:
            threads *= 2
    gpu_threads = facts.sm_count * facts.max_threads_per_sm
    while (threads < AXIS_MAX_BLOCK_THREADS
           and outer * -(-inner_packs // block_x) * threads < gpu_threads):
        threads *= 2

    block_y = min(threads // block_x, _prev_power_of_two(cols))
    block_x = min(max(block_x, threads // block_y), _next_power_of_two(inner_packs),
                  AXIS_MAX_BLOCK_X)
    block_y = max(block_y, WARP_SIZE // block_x)
    num_tiles = outer * -(-inner_packs // block_x)
    tile_bytes = cols * block_x * row_pack_bytes
    if tile_bytes > AXIS_CACHE_MAX_BYTES and num_tiles < AXIS_MIN_TILES_PER_SM * facts.sm_count:
        return None

    threads = block_x * block_y
    bytes_in_flight = next(size for most, size in AXIS_BYTES_IN_FLIGHT if threads <= most)
    loads_in_flight = min(AXIS_MAX_LOADS_IN_FLIGHT, max(1, bytes_in_flight // row_pack_bytes))
    async_fill = pack_bytes >= AXIS_ASYNC_MIN_PACK_BYTES
    spec = SoftmaxAxisSpec(op, dtype, pack_size, block_x, block_y,
                           0 if async_fill else loads_in_flight, cached=True)
    if not (tile_bytes <= AXIS_CACHE_MAX_BYTES
            and target.max_active_blocks(spec, threads, tile_bytes, opt_in=True)):
        spec = SoftmaxAxisSpec(op, dtype, pack_size, block_x, block_y, loads_in_flight,
                               cached=False)
        tile_bytes = 0
    grid = get_num_blocks(facts, threads, num_tiles)
    return SoftmaxAxisPlan(spec, outer, cols, inner, (block_x, block_y, 1), (grid, 1, 1),
                           tile_bytes)


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
    input, either that input itself or not overlapping it, and the planner
    prefers it; otherwise None, and nothing was written."""
    import cupy

    if len(inputs) != len(INPUTS[op]):
        raise ValueError(f"{op} reads {len(INPUTS[op])} arrays, got {len(inputs)}")
    first = inputs[0]
    if first.size == 0 or axis >= first.ndim - 1 or not all(a.flags.c_contiguous for a in inputs):
        return None
    if out is not None:
        if not out.flags.c_contiguous:
            return None
        for a in inputs:
            same = out.data.ptr == a.data.ptr and out.strides == a.strides
            if not same and cupy.may_share_memory(out, a):
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
