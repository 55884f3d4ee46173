"""The launches the norm planners build on, shared by the forward and the
backward kernels: the warp path's ladders, a block a row in registers, in
shared memory or uncached, and OneFlow's own dispatch (policy="oneflow")."""
from __future__ import annotations

from typing import Optional

from .. import dtypes
from ..launch import BLOCK_SIZE_LADDER, KernelLaunch, Target, choose_block_size, get_num_blocks
from .norm_spec import NormSpec, block_packs_per_thread, ceil_div, full_packs_per_thread


UNCACHED_BLOCK_SIZE = 1024
ONEFLOW_WARP_MAX_COLS = 1024

# OneFlow's warp ladder: group widths of the narrow stage, then the
# (max_cols_per_thread, min_cols_per_thread) rungs at width 32.
ONEFLOW_GROUP_WIDTHS = (4, 8, 16, 32)
ONEFLOW_COLS_PER_THREAD = ((2, 1), (4, 2), (8, 4), (12, 8), (16, 12), (20, 16), (24, 20),
                           (28, 24), (32, 28))
# OneFlow's smem path per op: (opt in beyond 48 KB, block-size rule).
ONEFLOW_SMEM_RULE = {"layer_norm": (True, "same_occupancy"), "rms_norm": (False, "max_occupancy")}

AUTO_GROUP_WIDTHS = (1, 2, 4, 8, 16, 32)
# auto: the warp path while a lane holds at most this many bytes of compute
# values per row (the backward pass holds dy and xhat and partial sums).
AUTO_WARP_MAX_BYTES_PER_LANE = {"forward": 128, "backward": 64}


def oneflow_warp_ladder(cols: int, rows: int, pack_size: int):
    """OneFlow's (max_cols_per_thread, min_cols_per_thread, width, rows_per_access)."""
    for width in ONEFLOW_GROUP_WIDTHS:
        if cols <= width * pack_size:
            return pack_size, 0, width, 2 if rows % 2 == 0 else 1
    for max_cols, min_cols in ONEFLOW_COLS_PER_THREAD:
        if max_cols % pack_size == 0 and min_cols % pack_size == 0 and cols <= max_cols * 32:
            return max_cols, min_cols, 32, 1
    return None


def warp_max_cols_per_thread(direction: str, compute_itemsize: int, pack_size: int) -> int:
    """auto's most columns a warp lane holds ("forward" or "backward"):
    AUTO_WARP_MAX_BYTES_PER_LANE of compute values, at least a pack."""
    return max(AUTO_WARP_MAX_BYTES_PER_LANE[direction] // compute_itemsize, pack_size)


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


def oneflow_grid(target: Target, spec: NormSpec, block_threads: int, smem: int, opt_in: bool,
                  max_blocks: int) -> int:
    """OneFlow's layer_norm GetNumBlocks: sm_count * active blocks per SM * 32 waves."""
    active = target.max_active_blocks(spec, block_threads, smem, opt_in)
    return max(1, min(max_blocks, target.facts.sm_count * active * 32))


def warp_launch(spec_fields: dict, rows: int, cols: int, pack_size: int, ladder, target: Target,
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
        needed = ceil_div(rows // rows_per_access, groups_per_block)
        grid = oneflow_grid(target, spec, spec.threads_per_block, smem, False, needed)
    else:
        needed = ceil_div(ceil_div(rows, rows_per_access), groups_per_block)
        grid = get_num_blocks(target.facts, spec.threads_per_block, needed)
    return KernelLaunch(spec, (width, groups_per_block, 1), (grid, 1, 1), smem)


def block_launch(spec: NormSpec, rows: int, smem: int, target: Target, policy: str,
                  opt_in: bool) -> KernelLaunch:
    if policy == "oneflow":
        grid = oneflow_grid(target, spec, spec.block_size, smem, opt_in, rows)
    else:
        grid = get_num_blocks(target.facts, spec.threads_per_block,
                              ceil_div(rows, spec.rows_per_access * spec.rows_per_block))
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


def smem_launch(spec_fields, rows, cols, pack_size, smem, target, policy, opt_in, rule,
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
    return block_launch(spec_of(block_size), rows, smem, target, policy, opt_in)


def uncached_launch(spec_fields, rows, pack_size, target, policy) -> KernelLaunch:
    spec = NormSpec(impl="block_uncached", pack_size=pack_size, block_size=UNCACHED_BLOCK_SIZE,
                    **spec_fields)
    return block_launch(spec, rows, 0, target, policy, False)


def _oneflow_block_pack(cols: int, itemsize: int, align: int) -> int:
    """OneFlow's block paths: pack 4, 2 or 1, the largest dividing cols (and the alignment)."""
    for pack in (4, 2):
        if cols % pack == 0 and pack * itemsize <= align:
            return pack
    return 1


def oneflow_launch(family, spec_fields, rows, cols, align, target, smem_arrays) -> KernelLaunch:
    """OneFlow's layer_norm.cuh / rms_norm.cuh dispatch of a forward kernel,
    or a backward dx kernel (smem_arrays: the rows a block caches, 1 or 2);
    the kernels are ours (OneFlow runs Welford's update per value; the
    results agree within rounding):
    - float64: uncached, always.
    - cols <= 1024: warp path. pack 2 if cols is even (and the pointers
      allow it), else 1. Ladder: cols <= g * pack for g in 4, 8, 16, 32 ->
      cols_per_thread = pack, width g, two rows per access when rows is
      even; then cols <= max * 32 for (max, min) in (2, 1) [pack 1 only],
      (4, 2), (8, 4), (12, 8), ..., (32, 28) -> width 32,
      max_cols_per_thread = max; the first min / pack packs of a lane are
      read without a bounds check (min_cols_per_thread = max when cols ==
      max * 32, i.e. no padding). Grid: GetNumBlocks with OneFlow's
      occupancy form, sm_count * active * 32.
    - otherwise block_smem with smem_arrays * cols * sizeof(compute) bytes
      when it can launch; pack 4, 2 or 1 (largest dividing cols). LayerNorm
      opts in beyond 48 KB and takes the first of 1024, 512, 256 with the
      occupancy of 128 (or any occupancy when rows <= SM count), else 128;
      RMSNorm does not opt in and takes the block size of highest occupancy
      (larger on ties).
    - else block_uncached with 1024 threads.
    OneFlow reduces dweight / dbias by a separate column-reduction kernel."""
    ftype = dtypes.BY_SHORT[spec_fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    block_pack = _oneflow_block_pack(cols, ftype.itemsize, align)
    if ftype.short != "f64":
        if cols <= ONEFLOW_WARP_MAX_COLS:
            pack = 2 if cols % 2 == 0 and align >= 2 * ftype.itemsize else 1
            ladder = oneflow_warp_ladder(cols, rows, pack)
            return warp_launch(spec_fields, rows, cols, pack, ladder, target, "oneflow")
        opt_in, rule = ONEFLOW_SMEM_RULE[family]
        launch = smem_launch(spec_fields, rows, cols, block_pack, smem_arrays * cols * compute_itemsize,
                              target, "oneflow", opt_in, rule)
        if launch is not None:
            return launch
    return uncached_launch(spec_fields, rows, block_pack, target, "oneflow")


def uses_local_memory(spec: NormSpec, target: Target) -> bool:
    """Whether the kernel spills (or keeps a stack) when compiled for the target."""
    return target.resources(spec)["local_bytes"] > 0


def first_register_rung(fields, rows, cols, target, direction, rungs, regs_pack, peel) -> Optional[KernelLaunch]:
    """The register block launch of the first of `rungs` (as norm_forward._auto_registers
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
            if not (spill_checked and uses_local_memory(spec, target)):
                return block_launch(spec, rows, 0, target, "auto", False)
    return None
