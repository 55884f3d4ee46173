"""The candidate plans of LayerNorm / RMSNorm forward and the tuned ones.

candidates() lists the plans worth timing for one shape: register blocks
(block sizes, the fewest warps holding a row at the same packs a thread, rows
held in the compute type or as loaded, peeled rows off the 16-byte grid),
shared-memory rows, rows cached by cp.async with register tails, and the warp
path's ladders (weight and bias read at each store or held), each kept only
where it can launch (row_candidates.can_launch) and the register paths only
without local memory; always policy="auto"'s plan by the rules
(norm_forward.auto_forward, the default rule) and policy="oneflow"'s. A
candidate is described by a JSON dict (row_candidates.Candidate: its spec's
fields, its shared memory and how its grid follows rows, GRIDS), so `cupyops
tune layer_norm` / `rms_norm` keeps the fastest in the tuning table
(cupyops.tune) and norm.plan rebuilds it for any rows of the key.

The table's shape key: dtype, cols, rows rounded up to a power of two, the
operands' alignment and phase, and the weight / bias / residual flags (the
kernel's own), e.g. "f16|cols=1024|rows=65536|align=16|phase=1|weight=1|
bias=1|residual=0"; the op is the table's own key. Only the tune commands
write it: a call never times anything.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from .. import async_row, dtypes
from ..device import WARP_SIZE
from ..launch import MAX_GRID_X, KernelLaunch, Target, get_num_blocks
from . import row_candidates
from .norm_forward import auto_forward, held_affine
from .norm_paths import (auto_warp_ladder, block_launch, oneflow_grid, oneflow_launch, uses_local_memory,
                         warp_launch)
from .norm_spec import NormPlan, NormSpec, block_packs_per_thread, ceil_div
from .row_packs import peeled_pack, vector_pack_size

# register-block variants: (block_size, most bytes of compute values a thread holds)
REGS_VARIANTS = ((64, 128), (128, 64), (256, 64), (512, 64), (1024, 64), (128, 128), (256, 128), (512, 128))
# 16-bit rows held as loaded (packed), at most PACKED_MAX_BYTES a thread
PACKED_BLOCK_SIZES = (64, 128, 256, 512, 1024)
PACKED_MAX_BYTES = 128
# rows of 16-byte packs cached by cp.async: block sizes, register tails
ASYNC_BLOCK_SIZES = (256, 512, 1024)
ASYNC_TAIL_PACKS = (0, 2, 4, 8)
# How a candidate's grid follows rows: "waves" (auto's: enough blocks for the
# waves, get_num_blocks), "per_row" (a block a row), "oneflow" and
# "oneflow_opt_in" (OneFlow's GetNumBlocks by occupancy, shared memory
# within 48 KB or the opt-in limit).
GRIDS = ("waves", "per_row", "oneflow", "oneflow_opt_in")


def launch_for(spec: NormSpec, rows: int, smem: int, grid: str, target: Target) -> KernelLaunch:
    """The launch of `spec` over `rows` with the grid of its kind (GRIDS)."""
    threads = spec.threads_per_block
    if spec.impl == "warp":
        block = (spec.thread_group_width, threads // spec.thread_group_width, 1)
    else:
        block = (spec.block_size, spec.rows_per_block, 1)
    if grid == "waves":
        blocks = get_num_blocks(target.facts, threads, ceil_div(ceil_div(rows, spec.rows_per_access), block[1]))
    elif grid == "per_row":
        blocks = min(rows, MAX_GRID_X)
    elif grid in ("oneflow", "oneflow_opt_in"):
        needed = ceil_div(rows // spec.rows_per_access, block[1]) if spec.impl == "warp" else rows
        blocks = oneflow_grid(target, spec, threads, smem, grid == "oneflow_opt_in", needed)
    else:
        raise ValueError(f"unknown grid {grid!r}; expected one of {GRIDS}")
    return KernelLaunch(spec, block, (blocks, 1, 1), smem)


class Candidate(row_candidates.Candidate):
    """A norm forward plan worth timing (row_candidates.Candidate; grid kinds GRIDS)."""
    spec_type = NormSpec
    launch_for = staticmethod(launch_for)
    grids = GRIDS


def shape_key(dtype: str, rows: int, cols: int, align: int = 16, same_phase: bool = True, *,
              weight: bool = True, bias: bool = True, residual: bool = False) -> str:
    """The tuning table's key of a shape (the module docstring)."""
    return (f"{dtype}|cols={cols}|rows={row_candidates.rows_bucket(rows)}|align={align}|phase={int(same_phase)}"
            f"|weight={int(weight)}|bias={int(bias)}|residual={int(residual)}")


@dataclass(frozen=True)
class TunedNormPlan(row_candidates.FromTable, NormPlan):
    """A forward plan from a tuning table."""


def tuned_plan(op: str, rows: int, cols: int, dtype: str, target: Target, align: int = 16,
               same_phase: bool = True, **flags) -> Optional[TunedNormPlan]:
    """The stored winner for this forward shape (flags: weight, bias, residual,
    as the key takes them) on `target` (row_candidates.stored_winner: the
    user's table, then the shipped one), or None."""
    found = row_candidates.stored_winner(op, shape_key(dtype, rows, cols, align, same_phase, **flags), target)
    if found is None:
        return None
    return TunedNormPlan(Candidate.from_description(found, rows, target).launch, found["source"])


def rule_launch(fields: dict, rows: int, cols: int, policy: str, target: Target, align: int = 16,
                same_phase: bool = True) -> KernelLaunch:
    """The forward launch of a policy's rules (fields: the spec's op, dtype,
    weight, bias and residual)."""
    if policy == "oneflow":
        return oneflow_launch(fields["op"], fields, rows, cols, align, target, 1)
    return auto_forward(fields, rows, cols, align, same_phase, target)


def _fitted_block(num_packs: int, per_thread: int) -> int:
    """The fewest threads, in whole warps, that hold num_packs at per_thread a thread."""
    return -(-num_packs // (per_thread * WARP_SIZE)) * WARP_SIZE


def with_fitted(block_sizes, num_packs: int) -> list:
    """The block sizes, each followed by the fewest threads, in whole warps,
    that hold the row's packs at its packs a thread, where that is fewer."""
    found = []
    for block_size in block_sizes:
        found.append(block_size)
        fitted = _fitted_block(num_packs, -(-num_packs // block_size))
        if fitted < block_size:
            found.append(fitted)
    return found


def _regs_candidates(fields, rows, cols, regs_pack, peel, target):
    ftype = dtypes.BY_SHORT[fields["dtype"]]
    compute_itemsize = dtypes.BY_SHORT[ftype.compute].itemsize
    num_packs = cols // regs_pack
    shapes = [(block_size, False, max_bytes // (regs_pack * compute_itemsize))
              for most, max_bytes in REGS_VARIANTS for block_size in with_fitted((most,), num_packs)]
    if ftype.itemsize == 2:   # held as loaded
        most_packs = PACKED_MAX_BYTES // (regs_pack * ftype.itemsize)
        shapes += [(block_size, True, most_packs) for block_size in with_fitted(PACKED_BLOCK_SIZES, num_packs)]
        # every packs-a-thread count at the fewest whole warps holding the row
        shapes += [(_fitted_block(num_packs, per_thread), True, per_thread) for per_thread in range(1, most_packs + 1)
                   if _fitted_block(num_packs, per_thread) <= max(PACKED_BLOCK_SIZES)]
    for block_size, packed, max_packs in shapes:
        # every pack in the packs, or (peeled) up to block_size elements past them
        for per_thread in sorted({-(-num_packs // block_size),
                                  block_packs_per_thread(cols, block_size, regs_pack, peel)}):
            if per_thread > max_packs or num_packs < block_size // 2:
                continue
            spec = NormSpec(impl="block_regs", pack_size=regs_pack, block_size=block_size,
                            packs_per_thread=per_thread, peel=peel, packed=packed, **fields)
            if not uses_local_memory(spec, target):
                label = f"regs b{block_size} k{per_thread}{' peel' if peel else ''}{' packed' if packed else ''}"
                yield Candidate(label, block_launch(spec, rows, 0, target, "auto", False), "waves")


def _smem_candidates(fields, rows, cols, pack, target):
    smem = cols * dtypes.BY_SHORT[fields["dtype"]].itemsize
    for block_size in (256, 512):
        spec = NormSpec(impl="block_smem", pack_size=pack, block_size=block_size, packed_cache=True, **fields)
        yield Candidate(f"smem b{block_size}", block_launch(spec, rows, smem, target, "auto", True), "waves")


def _async_candidates(fields, rows, cols, pack, target):
    row_bytes = cols * dtypes.BY_SHORT[fields["dtype"]].itemsize
    num_inputs = 2 if fields["residual"] else 1
    for block_size, tail_packs in itertools.product(ASYNC_BLOCK_SIZES, ASYNC_TAIL_PACKS):
        spec = NormSpec(impl="block_async", pack_size=pack, block_size=block_size, tail_packs=tail_packs, **fields)
        smem = async_row.share_bytes(num_inputs, row_bytes, block_size, tail_packs)
        if (tail_packs * block_size > cols // pack or smem > target.facts.smem_per_block_optin
                or uses_local_memory(spec, target)):
            continue
        yield Candidate(f"async b{block_size} t{tail_packs}", launch_for(spec, rows, smem, "per_row", target),
                        "per_row")


def _warp_candidates(fields, rows, cols, pack, target):
    compute_itemsize = dtypes.BY_SHORT[dtypes.BY_SHORT[fields["dtype"]].compute].itemsize
    for max_bytes in (64, 128):
        ladder = auto_warp_ladder(cols, pack, max(max_bytes // compute_itemsize, pack))
        if ladder is not None:
            launch = warp_launch(fields, rows, cols, pack, ladder, target, "auto")
            yield Candidate(f"warp c{ladder[0]} g{ladder[2]}", launch, "waves")
            held = held_affine(launch, cols, target)
            if held is not launch:
                yield Candidate(f"warp c{ladder[0]} g{ladder[2]} held", held, "waves")


def candidates(op: str, dtype: str, rows: int, cols: int, target: Target, align: int = 16,
               same_phase: bool = True, *, weight: bool = True, bias: bool = True,
               residual: bool = False) -> list:
    """The Candidates worth timing for the forward `op` over `rows` x `cols` of
    dtype (short name) on `target`: auto's and oneflow's plans first, then
    each path's variants that can launch, each launch once (its first label).
    Shared-memory and cp.async rows are offered from 4096 cols, the warp path
    to 1024 (other rows are faster in registers)."""
    fields = dict(op=op, dtype=dtype, weight=weight, bias=bias and op == "layer_norm", residual=residual)
    found = [Candidate.rebuilding(policy, rule_launch(fields, rows, cols, policy, target, align, same_phase), rows,
                                  target) for policy in ("auto", "oneflow")]
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack = vector_pack_size(cols, itemsize, align)
    regs_pack, peel = peeled_pack(pack, itemsize, same_phase)   # rows off the 16-byte grid: peel their edges
    variants = list(_regs_candidates(fields, rows, cols, regs_pack, peel, target))
    if cols >= 4096:
        variants += _smem_candidates(fields, rows, cols, pack, target)
        if pack * itemsize == async_row.PACK_BYTES:
            variants += _async_candidates(fields, rows, cols, pack, target)
    if cols <= 1024:
        variants += _warp_candidates(fields, rows, cols, pack, target)
    return row_candidates.first_of_each_launch(
        found + [c for c in variants if row_candidates.can_launch(target, c.launch)])
