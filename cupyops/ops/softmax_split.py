"""Row-wise softmax / log_softmax, forward and backward, with each row split
across several blocks: for a few long rows, which one block per row would
leave most of the GPU idle (8 rows x 2**20 columns: 8 blocks on 132 SMs).

Each row is cut into `splits` chunks of `chunk_cols` columns, a block per
chunk, in two launches over the same rows * splits blocks
(kernels/softmax_split.cuh):
1. "partials": each block reduces its chunk to a partial in a workspace
   (float32, float64 for float64 arrays): forward an online (max, sum) pair,
   backward the sum of dy * y (softmax) or dy (log-softmax);
2. "finish": each block combines its row's partials in a fixed order
   (deterministic), reads its chunk again and writes the outputs. It walks
   the chunks in reverse, re-reading first what the partials launch read
   last, so the second read hits L2 for as much of the rows as L2 holds
   (all of it up to ~50 MB on H100 / 60 MB on H200).

Planner rule (the thresholds below are data: first guesses, to be tuned on
the GPU):
1. rows >= SPLIT_MAX_ROWS_PER_SM x SMs fill the GPU with a block per row,
   and rows of fewer than SPLIT_MIN_ROW_BYTES bytes (per input) are cached on
   chip by the ordinary paths and read once: the ordinary path -> None.
2. pack = the largest 16-byte-or-smaller vector dividing cols that every
   operand's address and row stride allow (softmax.vector_pack_size).
3. blocks of SPLIT_BLOCK_SIZE threads; resident blocks = the partials
   kernel's occupancy x SMs; splits = enough chunks for SPLIT_WAVES full
   waves (ceil(SPLIT_WAVES x resident / rows)), fewer where a chunk would be
   shorter than SPLIT_MIN_CHUNK_BYTES (per input); chunk_cols = the row
   shared evenly among them, rounded up to SPLIT_CHUNK_GRANULE_BYTES (every
   chunk starts on a sector boundary of a 128-byte-aligned row); splits then
   = the chunks of that size covering the row.
4. fewer than 2 chunks per row: the ordinary path -> None.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy

from .. import arrays, dtypes, jit
from ..launch import LaunchCache, Target, live_function
from .softmax import INPUTS, OPS, vector_pack_size

STAGES = ("partials", "finish")

SPLIT_BLOCK_SIZE = 512
# Blocks for this many full waves of the GPU.
SPLIT_WAVES = 2
# Smallest chunk a block owns, in bytes of each input.
SPLIT_MIN_CHUNK_BYTES = 16 * 1024
# Chunk lengths are multiples of this many bytes.
SPLIT_CHUNK_GRANULE_BYTES = 128
# Rows at least this many times the SM count: a block per row fills the GPU.
SPLIT_MAX_ROWS_PER_SM = 1
# Rows shorter than this (bytes of each input) are left to the ordinary paths.
SPLIT_MIN_ROW_BYTES = 128 * 1024
# Bytes of each input a thread loads before using the first of them, in at
# most SPLIT_MAX_LOADS_IN_FLIGHT packs.
SPLIT_BYTES_IN_FLIGHT = 64
SPLIT_MAX_LOADS_IN_FLIGHT = 8


@dataclass(frozen=True)
class SoftmaxSplitSpec(jit.KernelSpec):
    template = "softmax_split.cu.j2"

    op: str
    stage: str              # "partials" or "finish"
    dtype: str              # short name of the storage type
    pack_size: int
    block_size: int
    loads_in_flight: int    # packs of each input loaded before the first is used

    @property
    def ftype(self) -> dtypes.FloatType:
        return dtypes.BY_SHORT[self.dtype]

    @property
    def name(self) -> str:
        return (f"{self.op}_split_{self.stage}_{self.dtype}_{self.ftype.compute}_p{self.pack_size}"
                f"_b{self.block_size}_l{self.loads_in_flight}")

    @property
    def threads_per_block(self) -> int:
        return self.block_size

    def template_args(self) -> dict:
        ftype = self.ftype
        return {**super().template_args(), "inputs": INPUTS[self.op],
                "backward": self.op.endswith("_backward"),
                "algorithm": "kLogSoftmax" if self.op.startswith("log_") else "kSoftmax",
                "storage_type": ftype.c_type, "compute_type": ftype.compute_c_type}


@dataclass(frozen=True)
class SplitPlan:
    partials: SoftmaxSplitSpec
    finish: SoftmaxSplitSpec
    splits: int             # chunks per row
    chunk_cols: int         # columns per chunk (the last of a row may be shorter)
    block: tuple
    grid: tuple             # both launches: a block per chunk

    @property
    def spec(self) -> SoftmaxSplitSpec:
        """The finish kernel, named in explain() as "kernel" (as other plans' spec)."""
        return self.finish

    @property
    def partial_size(self) -> int:
        """Workspace values per chunk: (max, sum) forward, the sum backward."""
        return 1 if self.finish.op.endswith("_backward") else 2

    def explain(self) -> dict:
        spec = self.finish
        return {"op": spec.op, "impl": "split", "pack_size": spec.pack_size,
                "splits": self.splits, "chunk_cols": self.chunk_cols,
                "block": list(self.block), "grid": list(self.grid), "smem_bytes": 0,
                "kernel": spec.name, "partials_kernel": self.partials.name}


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


@functools.lru_cache(maxsize=4096)
def plan(op: str, rows: int, cols: int, dtype: str, target: Target,
         align: int = 16) -> Optional[SplitPlan]:
    """The split-row plan for `rows` x `cols` of dtype (short name) on `target`,
    or None when the ordinary row paths should run (rule in the module docstring).

    `align` is the largest power of two (<= 16) dividing every operand's
    address and row stride in bytes."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
    facts = target.facts
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    if rows >= SPLIT_MAX_ROWS_PER_SM * facts.sm_count or cols * itemsize < SPLIT_MIN_ROW_BYTES:
        return None
    pack_size = vector_pack_size(cols, itemsize, align)
    pack_bytes = pack_size * itemsize
    num_packs = cols // pack_size
    loads_in_flight = min(SPLIT_MAX_LOADS_IN_FLIGHT, max(1, SPLIT_BYTES_IN_FLIGHT // pack_bytes))
    partials, finish = (SoftmaxSplitSpec(op, stage, dtype, pack_size, SPLIT_BLOCK_SIZE,
                                         loads_in_flight) for stage in STAGES)
    resident = facts.sm_count * target.max_active_blocks(partials, SPLIT_BLOCK_SIZE, 0, opt_in=False)
    splits = min(-(-SPLIT_WAVES * resident // rows), num_packs * pack_bytes // SPLIT_MIN_CHUNK_BYTES)
    if splits < 2:
        return None
    granule = max(1, SPLIT_CHUNK_GRANULE_BYTES // pack_bytes)
    chunk_packs = _round_up(-(-num_packs // splits), granule)
    splits = -(-num_packs // chunk_packs)
    return SplitPlan(partials, finish, splits, chunk_packs * pack_size,
                     (SPLIT_BLOCK_SIZE, 1, 1), (rows * splits, 1, 1))


# -- launch ------------------------------------------------------------------

_launches = LaunchCache()


def _launch_config(op, rows, cols, dtype, align, device_id):
    """(partials function, finish function, plan) for a live GPU, or None; memoised."""
    def make():
        chosen = plan(op, rows, cols, dtype, Target.live(device_id), align)
        return None if chosen is None else (
            live_function(chosen.partials, device_id), live_function(chosen.finish, device_id), chosen)

    return _launches.get((op, rows, cols, dtype, align, device_id), make)


def run(op: str, inputs, output, rows: int, cols: int) -> bool:
    """Runs `op` by the split-row kernels when the planner prefers them.

    `inputs` (the op's arrays, softmax.INPUTS) and `output` are
    rowwise.Operand objects of one float dtype on one GPU, laid out as `rows`
    rows of `cols` contiguous elements; the output may be one of the inputs
    (same address and row stride). Returns False, having launched nothing,
    when the ordinary row paths should run."""
    import cupy

    first = inputs[0].array
    ftype = dtypes.BY_DTYPE[first.dtype]
    operands = (*inputs, output)
    align = arrays.alignment(*(value for o in operands for value in (o.byte_address, o.byte_row_stride)))
    config = _launch_config(op, rows, cols, ftype.short, align, first.device.id)
    if config is None:
        return False
    partials_function, finish_function, chosen = config
    workspace = cupy.empty(rows * chosen.splits * chosen.partial_size,
                           dtypes.DTYPE_OF_SHORT[ftype.compute])
    scalars = (numpy.int64(cols), numpy.int64(chosen.splits), numpy.int64(chosen.chunk_cols))
    partials_function(chosen.grid, chosen.block,
                      (*(o.array for o in inputs), workspace, *scalars,
                       *(numpy.int64(o.row_stride) for o in inputs)))
    finish_function(chosen.grid, chosen.block,
                    (*(o.array for o in operands), workspace, *scalars,
                     *(numpy.int64(o.row_stride) for o in operands)))
    return True
