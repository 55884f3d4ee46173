"""The candidate plans of the softmax family's row kernels (softmax,
log_softmax and their backward, the reduced axis last) and the tuned ones.

candidates() lists the plans worth timing for one shape: the warp path's
packs and ladders, register blocks, cp.async blocks (persistent or a block a
row), shared-memory and uncached rows (peeled where rows are off the 16-byte
grid), each kept only where it can launch (shared memory within the opt-in
limit, at least one block an SM by Target.max_active_blocks: registers and
threads), and always policy="auto"'s plan by today's rules (the default rule,
softmax_rows.plan) and policy="oneflow"'s. A candidate is described by a
small JSON dict (its spec's fields, its shared memory and how its grid
follows rows), so `cupyops tune softmax` keeps the fastest in the tuning
table (cupyops.tune) and softmax.plan rebuilds it for any rows of the key.

The table's shape key: dtype, cols, the operands' alignment and whether
their rows share one phase (what makes a plan valid), and rows rounded up to
a power of two (past a few waves rows change the grid, not the best plan),
e.g. "f16|cols=1024|rows=65536|align=16|phase=1"; the op is the table's own
key. Only `cupyops tune softmax` writes it: a call never times anything.
"""
from __future__ import annotations

from typing import Optional

from .. import dtypes
from ..launch import KernelLaunch, Target
from . import row_candidates
from .row_packs import peeled_pack, vector_pack_size
from .softmax_rows import (INPUTS, SUM_INPUTS, SoftmaxSpec, async_share_bytes, block_plan, per_row_plan, plan,
                           warp_ladder, warp_plan, warp_spec_plan)

# A thread holds at most this many bytes of compute values a row (64 of its
# registers, a quarter of the most it may have) on the warp and register paths.
MAX_HELD_BYTES = 256
BLOCK_SIZES = (128, 256, 512, 1024)
# Register blocks also of two warps: more packs a thread, fewer threads sharing a row's reductions.
REGS_BLOCK_SIZES = (64, *BLOCK_SIZES)
# How a candidate's grid follows rows: "waves" (enough blocks for the waves,
# get_num_blocks), "resident" (as many as fit the SMs at once, each walking
# rows), "per_row" (a block, or a cluster, a row).
GRIDS = ("waves", "resident", "per_row")


def launch_for(spec: SoftmaxSpec, rows: int, smem: int, grid: str, target: Target) -> KernelLaunch:
    """The launch of `spec` over `rows` with the grid of its kind (GRIDS)."""
    if grid == "per_row":
        return per_row_plan(spec, rows, smem)
    if grid == "resident":
        active = target.max_active_blocks(spec, spec.block_size, smem, True)
        return KernelLaunch(spec, (spec.block_size, 1, 1), (min(rows, active * target.facts.sm_count), 1, 1), smem)
    if grid != "waves":
        raise ValueError(f"unknown grid {grid!r}; expected one of {GRIDS}")
    return warp_spec_plan(spec, rows, target) if spec.impl == "warp" else block_plan(spec, rows, smem, target)


class Candidate(row_candidates.Candidate):
    """A softmax plan worth timing (row_candidates.Candidate; grid kinds GRIDS)."""
    spec_type = SoftmaxSpec
    launch_for = staticmethod(launch_for)


def shape_key(dtype: str, rows: int, cols: int, align: int = 16, same_phase: bool = True) -> str:
    """The tuning table's key of a shape (the module docstring)."""
    return f"{dtype}|cols={cols}|rows={row_candidates.rows_bucket(rows)}|align={align}|phase={int(same_phase)}"


def tuned_plan(op: str, rows: int, cols: int, dtype: str, target: Target, align: int = 16,
               same_phase: bool = True) -> Optional[row_candidates.TunedLaunch]:
    """The stored winner for this shape on `target` (row_candidates.stored_winner:
    the user's table, then the shipped one), or None."""
    found = row_candidates.stored_winner(op, shape_key(dtype, rows, cols, align, same_phase), target)
    if found is None:
        return None
    return row_candidates.tuned_launch(Candidate.from_description(found, rows, target).launch, found["source"])


def _rule_candidate(policy: str, chosen: KernelLaunch) -> Candidate:
    """A policy's plan as a candidate (its async blocks take a row each)."""
    return Candidate(policy, chosen, "per_row" if chosen.spec.impl == "block_async" else "waves")


def _warp_candidates(op, dtype, rows, cols, pack, target):
    num_inputs = len(INPUTS[op])
    for warp_pack in sorted({pack, 2, 4} & {p for p in (2, 4, 8) if p <= pack}):
        for max_cols_per_thread in (16, 32, 64):
            ladder = warp_ladder(cols, rows, warp_pack, max_cols_per_thread)
            if ladder is None or ladder[0] * num_inputs * 4 > MAX_HELD_BYTES:
                continue
            for rows_per_access in (1, 2):
                warp = warp_plan(op, dtype, rows, cols, warp_pack, (ladder[0], ladder[1], rows_per_access), target)
                yield Candidate(f"warp p{warp_pack} c{ladder[0]} g{ladder[1]} r{rows_per_access}", warp, "waves")


def _regs_candidates(op, dtype, rows, cols, regs_pack, peel, target):
    itemsize, num_inputs = dtypes.BY_SHORT[dtype].itemsize, len(INPUTS[op])
    num_packs = cols // regs_pack
    for block in REGS_BLOCK_SIZES:
        per_thread = -(-num_packs // block)
        if per_thread * regs_pack * 4 * num_inputs <= MAX_HELD_BYTES and num_packs >= block // 2:
            for storage_cache in ((False, True) if itemsize == 2 else (False,)):
                spec = SoftmaxSpec(op, "block_regs", dtype, regs_pack, block_size=block,
                                   packs_per_thread=per_thread, peel=peel, storage_cache=storage_cache)
                yield Candidate(f"regs b{block} k{per_thread}{' packed' if storage_cache else ''}",
                                block_plan(spec, rows, 0, target), "waves")


def _async_candidates(op, dtype, rows, cols, pack, target):
    num_inputs = len(INPUTS[op])
    for stages in (1, 2):
        for block in BLOCK_SIZES:
            for online in ((False, True) if num_inputs == 1 else (False,)):
                spec = SoftmaxSpec(op, "block_async", dtype, pack, block_size=block, stages=stages, online=online)
                smem = stages * async_share_bytes(spec, cols)
                if cols // pack < block or smem > target.facts.smem_per_block_optin:
                    continue
                label = f"async b{block} s{stages}{' online' if online else ''}"
                yield Candidate(label, launch_for(spec, rows, smem, "resident", target), "resident")
                if stages == 1:
                    yield Candidate(f"{label} per-row", per_row_plan(spec, rows, smem), "per_row")


def _smem_candidates(op, dtype, rows, cols, layouts, target):
    """Shared memory caching every input, or those the sum reads."""
    itemsize, num_inputs = dtypes.BY_SHORT[dtype].itemsize, len(INPUTS[op])
    for cached in sorted({num_inputs, SUM_INPUTS[op]}):
        smem = cached * cols * itemsize
        for cache_pack, peeled in layouts:
            for block, min_blocks in ((256, 0), (512, 0), (1024, 0), (1024, 2)):
                spec = SoftmaxSpec(op, "block_smem", dtype, cache_pack, block_size=block, storage_cache=True,
                                   peel=peeled, min_blocks=min_blocks,
                                   cached_inputs=cached if cached < num_inputs else 0)
                if min_blocks and target.max_active_blocks(spec, block, smem, True) < min_blocks:
                    continue
                label = (f"smem b{block}{' peel' if peeled else ''}{f' mb{min_blocks}' if min_blocks else ''}"
                         f"{f' c{cached}' if cached < num_inputs else ''}")
                yield Candidate(label, block_plan(spec, rows, smem, target), "waves")


def _uncached_candidates(op, dtype, rows, layouts, target):
    num_inputs = len(INPUTS[op])
    for cache_pack, peeled in layouts:
        for online in ((True, False) if num_inputs == 1 else (False,)):
            for block in ((256, 512, 1024) if peeled else (1024,)):
                spec = SoftmaxSpec(op, "block_uncached", dtype, cache_pack, block_size=block, online=online,
                                   peel=peeled)
                label = f"uncached b{block} {'online' if online else 'passes'}{' peel' if peeled else ''}"
                yield Candidate(label, block_plan(spec, rows, 0, target), "waves")


def candidates(op: str, dtype: str, rows: int, cols: int, target: Target, align: int = 16,
               same_phase: bool = True) -> list:
    """The Candidates worth timing for `rows` x `cols` of dtype (short name) on
    `target`: auto's and oneflow's plans first, then each path's variants that
    can launch, each launch once (its first label). Paths wanting long rows
    are offered from these cols: cp.async 2048, shared memory 8192, uncached
    32768 (shorter rows are faster in registers)."""
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack = vector_pack_size(cols, itemsize, align)
    regs_pack, peel = peeled_pack(pack, itemsize, same_phase)   # rows off the 16-byte grid: peel their edges
    # the row's own packs, and peeled (16-byte packs between the edges)
    layouts = ((pack, False),) + (((regs_pack, True),) if peel else ())
    found = [_rule_candidate(policy, plan(op, rows, cols, dtype, policy, target, align, same_phase))
             for policy in ("auto", "oneflow")]
    variants = [*_warp_candidates(op, dtype, rows, cols, pack, target),
                *_regs_candidates(op, dtype, rows, cols, regs_pack, peel, target)]
    if pack * itemsize == 16 and cols >= 2048:
        variants += _async_candidates(op, dtype, rows, cols, pack, target)
    if cols >= 8192:
        variants += _smem_candidates(op, dtype, rows, cols, layouts, target)
    if cols >= 32768:
        variants += _uncached_candidates(op, dtype, rows, layouts, target)
    return row_candidates.first_of_each_launch(
        found + [c for c in variants if row_candidates.can_launch(target, c.launch)])
