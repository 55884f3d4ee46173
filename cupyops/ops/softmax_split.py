"""Row-wise softmax / log_softmax, forward and backward, with each row split
across several blocks: for a few long rows, which one block per row would
leave most of the GPU idle (8 rows x 2**20 columns: 8 blocks on 132 SMs), and
for rows too long for one block to keep on chip.

Each row is cut into `splits` chunks of `chunk_cols` columns, a block per
chunk (kernels/softmax_split.cuh), in one of two ways:

- "coop", one cooperative launch (every block resident at once): blocks form
  slots of `splits`; a slot takes rows slot, slot + slots, ...; each block
  keeps its chunk on chip (in registers, or partly in shared memory),
  publishes its partial, waits on the slot's counter for the others, combines
  the row's partials and writes its chunk. Each element is read once. Needs
  the chunks of a row to fit the resident blocks (splits <= resident blocks).
- two launches over rows * splits blocks: "partials" reduces each chunk to a
  partial in a workspace, "finish" combines the row's partials in a fixed
  order, reads its chunk again and writes the outputs, walking the chunks in
  reverse so the second read hits L2 for as much of the rows as L2 holds.

Partials are (max, sum) forward, the sum of dy * y (softmax) or dy
(log-softmax) backward, in float32 (float64 for float64 arrays), combined in
the same fixed order by every block of a row: deterministic.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy

from .. import dtypes, jit
from ..launch import MAX_GRID_X, LaunchCache, Target, live_function
from ..profile import profile_for
from . import softmax_rows
from .row_packs import peeled_pack, vector_pack_size
from .softmax_rows import INPUTS, OPS

STAGES = ("partials", "finish", "coop")
TWO_LAUNCH_STAGES = ("partials", "finish")

# SPLIT_BLOCK_SIZE: a value of the device profile (cupyops/profiles/*.json).
# Blocks for this many full waves of the GPU.
# SPLIT_WAVES: a value of the device profile (cupyops/profiles/*.json).
# Smallest chunk a block owns, in bytes of each input.
# SPLIT_MIN_CHUNK_BYTES: a value of the device profile (cupyops/profiles/*.json).
# Chunk lengths are multiples of this many bytes.
# SPLIT_CHUNK_GRANULE_BYTES: a value of the device profile (cupyops/profiles/*.json).
# Rows at least this many times the SM count: a block per row fills the GPU.
# SPLIT_MAX_ROWS_PER_SM: a value of the device profile (cupyops/profiles/*.json).
# Rows shorter than this (bytes of each input) are left to the ordinary paths.
# SPLIT_MIN_ROW_BYTES: a value of the device profile (cupyops/profiles/*.json).
# Bytes of each input a thread loads before using the first of them, in at
# most SPLIT_MAX_LOADS_IN_FLIGHT packs.
# SPLIT_BYTES_IN_FLIGHT: a value of the device profile (cupyops/profiles/*.json).
# SPLIT_MAX_LOADS_IN_FLIGHT: a value of the device profile (cupyops/profiles/*.json).

# Coop blocks of 256 threads. H200, % of copy, against 512-thread blocks
# (whose float32 and float64 forward threads held 64 bytes, float64 backward
# threads 128 bytes of each input), three interleaved processes:
# float32 softmax 8 x 2^20 58.1 / 53.3 (four slots of a row each instead of
# three: two rounds instead of three), 16 x 2^20 64.9 / 58.6, 4 x 2^21
# 56.0 / 48.4, 8 x 2^21 62.8 / 52.8, 32 x 2^18 59.3 / 56.1, 2 x 2^22
# 53.7 / 53.9; log_softmax 8 x 2^20 58.2 / 49.9; float16 softmax 8 x 2^20
# 47.2 / 45.2 and 16 x 2^20 56.3 / 52.0 (eight slots either way), 32 x 2^18
# 46.2 / 46.3; softmax_backward float32 8 x 2^20 58.4 / 56.4, 32 x 2^18
# 64.7 / 57.1, float16 8 x 2^20 53.0 / 52.5; float64 softmax 4096 x 2^18
# 43.3 / 32.9, softmax_backward 32 x 2^18 70.1 / 60.1. Four float32 rows of
# 2^20 held by 512 x 128 bytes or 384 x 128 lost 2-3 points against
# 256 x 128; 192 x 128 and 128 x 128 lost more.
COOP_BLOCK_SIZE = 256
# Bytes of each input a coop thread keeps in registers, by (itemsize, number
# of inputs); doubled, up to COOP_DOUBLINGS times, where a row's chunks would
# outnumber the resident blocks. None needs local memory (sm_90: 4 blocks an
# SM; 3 for float64 softmax and log_softmax_backward, 2 for float32 backward).
# COOP_BYTES_PER_THREAD: a value of the device profile (cupyops/profiles/*.json).
# COOP_DOUBLINGS: a value of the device profile (cupyops/profiles/*.json).
# Most packs (of all inputs together) a coop thread holds: each takes at least
# a register, so narrow packs hold fewer bytes.
# COOP_MAX_CACHED_PACKS: a value of the device profile (cupyops/profiles/*.json).
# Narrower packs (odd cols, misaligned rows) take the two launches.
# COOP_MIN_PACK_BYTES: a value of the device profile (cupyops/profiles/*.json).
# Rows whose operands share each row's phase take coop packs of at least this
# many bytes; narrower ones lose to the two launches peeled (16-byte packs
# between single-element edges). H200, % of copy, peeled two launches against
# coop in 4-byte packs (float32, odd cols): softmax 75 x 110997 47.2 / 32.8,
# 8 x (2^20 + 7) 47.1 / 36.3, 32 x 262145 48.7 / 38.2, 3 x (2^20 + 7) 31.4 /
# 32.7, 1 x 300001 5.5 / 5.9; log_softmax 47.8 / 32.8, 48.9 / 36.3, 47.9 /
# 38.1, 31.8 / 32.6.
# COOP_MIN_PEELABLE_PACK_BYTES: a value of the device profile (cupyops/profiles/*.json).
# Rows of at least this many bytes (all inputs together) are split even when
# many rows fill the GPU: longer than the ordinary paths keep on chip.
# COOP_MIN_ROW_BYTES: a value of the device profile (cupyops/profiles/*.json).
# Coop slots with several rows each prefetch the next one (plan()'s rule 3) below this
# many rows an SM, for the (itemsize, number of inputs) in COOP_PREFETCH.
# H200, % of copy, prefetching / reading each row after the last: float32
# softmax 8 x 2^20 58.0 / 56.4, 16 x 2^20 64.4 / 62.8, 4 x 2^21 55.9 / 53.8,
# 8 x 2^21 62.4 / 58.5, 2 x 2^22 53.7 / 52.2, 32 x 2^18 59.1 / 59.3;
# log_softmax 8 x 2^20 57.7 / 56.4, 16 x 2^20 64.8 / 63.4. Not taken: float64
# softmax (8 x 2^20 32.6 / 31.8 but 32 x 2^18 34.9 / 37.0), float32
# softmax_backward (spills); 16-bit forward kernels need more registers to
# prefetch (80 instead of 58), leaving 3 blocks an SM instead of 4.
# COOP_PREFETCH_MAX_ROWS_PER_SM: a value of the device profile (cupyops/profiles/*.json).
# COOP_PREFETCH: a value of the device profile (cupyops/profiles/*.json).
# Where the plain coop plan takes more than one round, threads of the
# (itemsize, number of inputs) in COOP_SHARED hold its bytes of each input of
# a longer chunk in registers and the rest (shared_packs, at most
# COOP_MAX_SHARED_PACKS of all inputs together) in shared memory when that
# makes every row resident at once: one round (plan()'s rule 3). H200, % of copy, one
# round / the plan without shared packs (prefetching where float32 forward),
# interleaved samples: float32 softmax 8 x 2^20 60.2 / 58.3, log_softmax
# 59.9 / 58.2, 4 x 2^21 59.1 / 56.1, 2 x 2^22 56.9 / 53.6, 32 x 2^18
# 61.0 / 59.6, 6 x 2^20 54.9 / 49.5, 40 x 2^17 51.8 / 45.0, 100 x 2^16
# 57.2 / 53.2, 3 x (2^20 + 7) (4-byte packs) 32.3 / 26.9; float16 softmax
# 12 x 2^20 53.0 / 46.7, 4 x 2^22 56.2 / 52.0, 64 x 2^18 59.3 / 56.8,
# 8 x (2^20 + 4) (8-byte packs) 37.4 / 35.1; bfloat16 100 x 100000
# 49.4 / 38.6; the worst float16 16 x 2^20 56.9 / 57.7. softmax_backward
# float16 8 x 2^20 57.7 / 53.2, 4 x 2^21 57.5 / 50.1, 64 x 2^17 59.0 / 55.1,
# log_softmax_backward 56.3 / 53.2; float32 4 x 2^20 56.4 / 51.5, 2 x 2^21
# 56.2 / 51.3, 32 x 2^17 58.2 / 55.5. Register bytes, f32 softmax 8 x 2^20:
# 80 (60.2) against 96 (60.0; log_softmax spills), 48 (58.7) and 32 (47.4:
# 57 KB of shared memory a block leave 3 blocks an SM, two rounds); f16
# softmax_backward 8 x 2^20: 32 (57.7) against 48 (57.4) and 64 (57.0;
# log_softmax_backward 48.0: 76 registers, 3 blocks an SM); f32
# softmax_backward: 48 and 80 within 0.7 of each other.
# COOP_SHARED: a value of the device profile (cupyops/profiles/*.json).
# COOP_MAX_SHARED_PACKS: a value of the device profile (cupyops/profiles/*.json).


@dataclass(frozen=True)
class SoftmaxSplitSpec(jit.KernelSpec):
    template = "softmax_split.cu.j2"

    op: str
    stage: str              # "partials", "finish" or "coop"
    dtype: str              # short name of the storage type
    pack_size: int
    block_size: int
    loads_in_flight: int    # packs of each input loaded before the first is used
                            # (coop: all the packs a thread holds)
    prefetch: bool = False  # coop: the next row's chunk is copied to shared memory ahead
    shared_packs: int = 0   # coop: packs of each input a thread holds in shared memory
                            # past its loads_in_flight in registers
    peel: bool = False      # partials, finish: 16-byte packs between each row's edges (rows off the grid)

    def __post_init__(self):
        if (self.prefetch or self.shared_packs) and self.stage != "coop":
            raise ValueError(f"only the coop stage prefetches or holds shared packs, not {self.stage!r}")
        if self.prefetch and self.shared_packs:
            raise ValueError("a prefetching coop kernel holds no shared packs")
        if self.peel and self.stage == "coop":
            raise ValueError("the coop stage does not peel rows")

    @property
    def ftype(self) -> dtypes.FloatType:
        return dtypes.BY_SHORT[self.dtype]

    @property
    def name(self) -> str:
        prefetch = "_pf" if self.prefetch else ""
        shared = f"_s{self.shared_packs}" if self.shared_packs else ""
        peel = "_peel" if self.peel else ""
        return (f"{self.op}_split_{self.stage}_{self.dtype}_{self.ftype.compute}_p{self.pack_size}"
                f"_b{self.block_size}_l{self.loads_in_flight}{shared}{prefetch}{peel}")

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of a coop block: its shared packs of every
        input, or the register chunk it prefetches."""
        packs = self.shared_packs + (self.loads_in_flight if self.prefetch else 0)
        return len(INPUTS[self.op]) * packs * self.block_size * self.pack_size * self.ftype.itemsize

    @property
    def threads_per_block(self) -> int:
        return self.block_size

    @property
    def partial_size(self) -> int:
        """Workspace values per chunk: (max, sum) forward, the sum backward
        (split_partial_size in kernels/softmax_split.cuh)."""
        return 1 if self.op.endswith("_backward") else 2

    def template_args(self) -> dict:
        ftype = self.ftype
        return {**super().template_args(), "inputs": INPUTS[self.op],
                "backward": self.op.endswith("_backward"),
                "algorithm": "kLogSoftmax" if self.op.startswith("log_") else "kSoftmax",
                "storage_type": ftype.c_type, "compute_type": ftype.compute_c_type}


@dataclass(frozen=True)
class SplitPlan:
    """Two launches over the same grid: partials, then finish."""
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

    def explain(self) -> dict:
        spec = self.finish
        return {"op": spec.op, "impl": "split", "pack_size": spec.pack_size,
                "splits": self.splits, "chunk_cols": self.chunk_cols,
                "block": list(self.block), "grid": list(self.grid), "smem_bytes": 0,
                "kernel": spec.name, "partials_kernel": self.partials.name, "cooperative": False}


@dataclass(frozen=True)
class CoopPlan:
    """One cooperative launch: slots of `splits` blocks, a row per slot at a time."""
    spec: SoftmaxSplitSpec
    splits: int
    chunk_cols: int
    slots: int
    block: tuple
    grid: tuple             # slots * splits blocks, all resident

    @property
    def smem_bytes(self) -> int:
        return self.spec.shared_bytes

    def explain(self) -> dict:
        spec = self.spec
        return {"op": spec.op, "impl": "split", "pack_size": spec.pack_size,
                "splits": self.splits, "chunk_cols": self.chunk_cols, "slots": self.slots,
                "packs_per_thread": spec.loads_in_flight, "shared_packs": spec.shared_packs,
                "prefetch": spec.prefetch,
                "block": list(self.block), "grid": list(self.grid), "smem_bytes": self.smem_bytes,
                "kernel": spec.name, "cooperative": True}


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _check(op, rows, cols):
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")


def coop_candidate(op: str, rows: int, cols: int, dtype: str, target: Target, align: int,
                   bytes_per_thread: int) -> Optional[CoopPlan]:
    """The CoopPlan with threads holding `bytes_per_thread` bytes of each
    input in registers (or, where that takes more than one round, a longer
    chunk partly in shared memory, or prefetching), or None when it cannot be
    (plan()'s rule 3)."""
    tuned = profile_for(target.facts)
    facts = target.facts
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack_size = vector_pack_size(cols, itemsize, align)
    pack_bytes = pack_size * itemsize
    num_inputs = len(INPUTS[op])
    packs_per_thread = max(1, bytes_per_thread // pack_bytes)
    if pack_bytes < tuned.COOP_MIN_PACK_BYTES or packs_per_thread * num_inputs > tuned.COOP_MAX_CACHED_PACKS:
        return None

    def resident_blocks(spec: SoftmaxSplitSpec) -> int:
        return facts.sm_count * target.max_active_blocks(spec, COOP_BLOCK_SIZE, spec.shared_bytes, opt_in=True)

    def candidate(register_packs: int, shared_packs: int = 0, prefetch: bool = False) -> Optional[CoopPlan]:
        chunk_cols = COOP_BLOCK_SIZE * (register_packs + shared_packs) * pack_size
        splits = -(-cols // chunk_cols)
        if splits < 2 or rows * splits > MAX_GRID_X:
            return None
        spec = SoftmaxSplitSpec(op, "coop", dtype, pack_size, COOP_BLOCK_SIZE, register_packs,
                                prefetch=prefetch, shared_packs=shared_packs)
        if (prefetch or shared_packs) and target.resources(spec)["local_bytes"] > 0:
            return None
        resident = resident_blocks(spec)
        if splits > resident:
            return None
        slots = min(rows, resident // splits)
        return CoopPlan(spec, splits, chunk_cols, slots, (COOP_BLOCK_SIZE, 1, 1), (slots * splits, 1, 1))

    plain = candidate(packs_per_thread)
    if plain is None or plain.slots >= rows:
        return plain
    kind = (itemsize, num_inputs)
    if kind in tuned.COOP_SHARED:
        # one round: a chunk for each of the plain kernel's resident blocks
        blocks_a_row = resident_blocks(plain.spec) // rows
        chunk_packs = -(-(cols // pack_size) // max(1, blocks_a_row))
        register_packs = min(packs_per_thread, max(1, tuned.COOP_SHARED[kind] // pack_bytes))
        shared_packs = -(-chunk_packs // COOP_BLOCK_SIZE) - register_packs
        if blocks_a_row >= 2 and 0 < shared_packs * num_inputs <= tuned.COOP_MAX_SHARED_PACKS:
            one_round = candidate(register_packs, shared_packs)
            if one_round is not None and one_round.slots >= rows:
                return one_round
    if kind in tuned.COOP_PREFETCH and rows < tuned.COOP_PREFETCH_MAX_ROWS_PER_SM * facts.sm_count:
        prefetching = candidate(packs_per_thread, prefetch=True)
        if prefetching is not None and plain.slots <= prefetching.slots < rows:
            return prefetching
    return plain


@functools.lru_cache(maxsize=4096)
def coop_plan(op: str, rows: int, cols: int, dtype: str, target: Target,
              align: int = 16) -> Optional[CoopPlan]:
    """The one-launch cooperative plan (rule 3 of plan()) for a
    row that is split, or None when a row's chunks cannot all be resident."""
    tuned = profile_for(target.facts)
    _check(op, rows, cols)
    preferred = tuned.COOP_BYTES_PER_THREAD[(dtypes.BY_SHORT[dtype].itemsize, len(INPUTS[op]))]
    for doubling in range(tuned.COOP_DOUBLINGS + 1):
        candidate = coop_candidate(op, rows, cols, dtype, target, align, preferred << doubling)
        if candidate is not None:
            return candidate
    return None


def plan(op: str, rows: int, cols: int, dtype: str, target: Target, align: int = 16, same_phase: bool = True):
    """The split-row plan (CoopPlan or SplitPlan) for `rows` x `cols` of dtype
    (short name) on `target`, or None when the ordinary row paths should run.

    `align` is the largest power of two (<= 16) dividing every operand's
    address and row stride in bytes; `same_phase` says every row of every
    operand starts at the same offset from a 16-byte boundary (two launches
    then peel rows off the 16-byte grid). The rule (its thresholds tuned on
    an H200 with scripts/tune_long_rows.py):
    1. A row is split when it is long and either few rows exist (rows <
       SPLIT_MAX_ROWS_PER_SM x SMs and at least SPLIT_MIN_ROW_BYTES of each
       input) or it is longer than the ordinary paths keep on chip (at least
       COOP_MIN_ROW_BYTES of all inputs together, and no rung of the async row
       path's ladder holds it, in one block or a thread-block cluster, with or
       without register tails: softmax_rows.AUTO_ASYNC_LADDERS); otherwise -> None.
    2. pack = the largest 16-byte-or-smaller vector dividing cols that every
       operand's address and row stride allow (row_packs.vector_pack_size); the
       two launches peel rows off the 16-byte grid whose operands share each
       row's phase (odd cols), 16-byte packs between single-element edges.
    3. coop (rows whose operands share each row's phase: packs of at least
       COOP_MIN_PEELABLE_PACK_BYTES, else the two launches first): blocks of
       COOP_BLOCK_SIZE threads holding packs_per_thread packs of
       each input, COOP_BYTES_PER_THREAD bytes of it (doubled while a row's
       chunks outnumber the resident blocks; at most COOP_MAX_CACHED_PACKS packs
       of all inputs together; packs of at least COOP_MIN_PACK_BYTES):
       resident = occupancy x SMs, splits = ceil(cols / chunk_cols) (2 ..
       resident), slots = min(rows, resident // splits), grid = slots x splits.
       Where slots take more than one row each, blocks of the dtypes and ops in
       COOP_SHARED take longer chunks, enough for resident // rows blocks a row,
       holding the table's bytes of each input a thread in registers and the
       rest (shared_packs, at most COOP_MAX_SHARED_PACKS of all inputs) in shared
       memory, if every row is then resident at once (one round) and the kernel
       needs no local memory. Otherwise, where slots take more than one row each
       and rows are few (fewer than COOP_PREFETCH_MAX_ROWS_PER_SM x SMs: the
       slots move in step), blocks of the dtypes and ops in COOP_PREFETCH
       prefetch the slot's next row into shared memory while they finish a row
       (prefetch), unless that kernel's registers or shared memory leave fewer
       slots resident or it spills.
    4. otherwise two launches: blocks of SPLIT_BLOCK_SIZE threads; resident =
       the partials kernel's occupancy x SMs; splits = enough chunks for
       SPLIT_WAVES full waves (ceil(SPLIT_WAVES x resident / rows)), fewer where a
       chunk would be shorter than SPLIT_MIN_CHUNK_BYTES (per input); chunk_cols
       = the row shared evenly among them, rounded up to SPLIT_CHUNK_GRANULE_BYTES;
       splits then = the chunks of that size covering the row. Fewer than 2
       chunks per row, or many rows: the ordinary path -> None.
    """
    tuned = profile_for(target.facts)
    _check(op, rows, cols)
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    few_long_rows = (rows < tuned.SPLIT_MAX_ROWS_PER_SM * target.facts.sm_count
                     and cols * itemsize >= tuned.SPLIT_MIN_ROW_BYTES)
    if not few_long_rows:
        if cols * itemsize * len(INPUTS[op]) < tuned.COOP_MIN_ROW_BYTES:
            return None
        if softmax_rows.plan(op, rows, cols, dtype, "auto", target, align, same_phase).spec.impl == "block_async":
            return None   # one block (a register tail) or a cluster keeps the row on chip
    if same_phase and vector_pack_size(cols, itemsize, align) * itemsize < tuned.COOP_MIN_PEELABLE_PACK_BYTES:
        return two_launch_plan(op, rows, cols, dtype, target, align, same_phase) or \
            coop_plan(op, rows, cols, dtype, target, align)
    return coop_plan(op, rows, cols, dtype, target, align) or \
        two_launch_plan(op, rows, cols, dtype, target, align, same_phase)


@functools.lru_cache(maxsize=4096)
def two_launch_plan(op: str, rows: int, cols: int, dtype: str, target: Target,
                    align: int = 16, same_phase: bool = True) -> Optional[SplitPlan]:
    """The two-launch split plan (rule 4 of plan()), or None."""
    tuned = profile_for(target.facts)
    _check(op, rows, cols)
    facts = target.facts
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    if rows >= tuned.SPLIT_MAX_ROWS_PER_SM * facts.sm_count or cols * itemsize < tuned.SPLIT_MIN_ROW_BYTES:
        return None
    pack_size, peel = peeled_pack(vector_pack_size(cols, itemsize, align), itemsize, same_phase)
    pack_bytes = pack_size * itemsize
    num_packs = cols // pack_size
    loads_in_flight = min(tuned.SPLIT_MAX_LOADS_IN_FLIGHT, max(1, tuned.SPLIT_BYTES_IN_FLIGHT // pack_bytes))
    partials, finish = (SoftmaxSplitSpec(op, stage, dtype, pack_size, tuned.SPLIT_BLOCK_SIZE,
                                         loads_in_flight, peel=peel) for stage in TWO_LAUNCH_STAGES)
    resident = facts.sm_count * target.max_active_blocks(partials, tuned.SPLIT_BLOCK_SIZE, 0, opt_in=False)
    splits = min(-(-tuned.SPLIT_WAVES * resident // rows), num_packs * pack_bytes // tuned.SPLIT_MIN_CHUNK_BYTES)
    if splits < 2:
        return None
    granule = max(1, tuned.SPLIT_CHUNK_GRANULE_BYTES // pack_bytes)
    chunk_packs = _round_up(-(-num_packs // splits), granule)
    splits = -(-num_packs // chunk_packs)
    return SplitPlan(partials, finish, splits, chunk_packs * pack_size,
                     (tuned.SPLIT_BLOCK_SIZE, 1, 1), (rows * splits, 1, 1))


# -- launch ------------------------------------------------------------------

_launches = LaunchCache()


def _launch_config(op, rows, cols, dtype, align, same_phase, device_id):
    """(plan, its functions) for a live GPU, or None; memoised."""
    def make():
        chosen = plan(op, rows, cols, dtype, Target.live(device_id), align, same_phase)
        return None if chosen is None else (chosen, functions_of(chosen, device_id))

    return _launches.get((op, rows, cols, dtype, align, same_phase, device_id), make)


def functions_of(chosen, device_id: int) -> tuple:
    """The compiled functions of a CoopPlan or SplitPlan, in launch order."""
    if isinstance(chosen, CoopPlan):
        return (live_function(chosen.spec, device_id, chosen.smem_bytes),)
    return tuple(live_function(spec, device_id) for spec in (chosen.partials, chosen.finish))


# Coop launches' arrival / departure counters per (device, stream): zero
# between launches (each launch leaves them zero), grown on demand. Launches
# on one stream run one after another, so they can share them.
_counters: dict = {}


def _coop_counters(slots: int, device_id: int, stream_ptr: int):
    import cupy

    key = (device_id, stream_ptr)
    counters = _counters.get(key)
    if counters is None or counters.size < 2 * slots:
        counters = cupy.zeros(max(2 * slots, 1024), numpy.uint32)
        _counters[key] = counters
    return counters


def run(op: str, inputs, output, rows: int, cols: int, align: int, same_phase: bool) -> bool:
    """Runs `op` by the split-row kernels when the planner prefers them.

    `inputs` (the op's arrays, softmax_rows.INPUTS) and `output` are
    rowwise.Operand objects of one float dtype on one GPU, laid out as `rows`
    rows of `cols` contiguous elements; the output may be one of the inputs
    (same address and row stride). `align` and `same_phase` are theirs, as
    plan() takes them (arrays.alignment, arrays.same_phase). Returns False,
    having launched nothing, when the ordinary row paths should run."""
    first = inputs[0].array
    config = _launch_config(op, rows, cols, dtypes.BY_DTYPE[first.dtype].short, align, same_phase, first.device.id)
    if config is None:
        return False
    launch(*config, inputs, output, rows, cols)
    return True


def launch(chosen, functions, inputs, output, rows: int, cols: int) -> None:
    """Launches plan `chosen` (CoopPlan or SplitPlan) with its compiled
    `functions` (live_function of its specs, in order) on row operands as run() takes them."""
    import cupy

    first = inputs[0].array
    compute_dtype = dtypes.DTYPE_OF_SHORT[dtypes.BY_DTYPE[first.dtype].compute]
    operands = (*inputs, output)
    strides = tuple(numpy.int64(o.row_stride) for o in operands)
    scalars = (numpy.int64(cols), numpy.int64(chosen.splits), numpy.int64(chosen.chunk_cols))
    if isinstance(chosen, CoopPlan):
        workspace = cupy.empty(chosen.slots * 2 * chosen.splits * chosen.spec.partial_size, compute_dtype)
        counters = _coop_counters(chosen.slots, first.device.id, cupy.cuda.get_current_stream().ptr)
        functions[0](chosen.grid, chosen.block,
                     (*(o.array for o in operands), workspace, counters, numpy.int64(rows), *scalars,
                      *strides), shared_mem=chosen.smem_bytes, enable_cooperative_groups=True)
        return
    partials_function, finish_function = functions
    workspace = cupy.empty(rows * chosen.splits * chosen.spec.partial_size, compute_dtype)
    partials_function(chosen.grid, chosen.block,
                      (*(o.array for o in inputs), workspace, *scalars, *strides[:-1]))
    finish_function(chosen.grid, chosen.block, (*(o.array for o in operands), workspace, *scalars, *strides))
