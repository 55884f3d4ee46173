"""The candidate plans of LayerNorm / RMSNorm backward and the tuned ones.

candidates() lists the dx kernels worth timing for one shape, each in the
backward plan around it (norm_backward.grad_plan: the finish kernel after
fused dweight / dbias partials, else the column reduction where dweight /
dbias are wanted): register blocks (block sizes and the fewest warps holding
the row at the same packs a thread, dy and x held as loaded or read again,
rows loaded together, partial sums in registers or shared memory, peeled
rows off the 16-byte grid reading the weight from a shared copy or its phase
copies, rows shared by a cluster of two blocks on sm_90 and newer), the warp
path with and without fused partials, shared-memory and uncached rows; each
kept only where it can launch (row_candidates.can_launch) and the register
paths only without local memory; always policy="auto"'s plan by the rules
(norm_backward.plan, the default rule) and policy="oneflow"'s, and with
param_grad auto's dx kernel before a column reduction. A candidate is
described by its dx kernel (row_candidates.Candidate: its spec's fields, its
shared memory and how its grid follows rows, GRIDS), which with the key's
cols and param_grad rebuilds the plan for any rows of the key.

The table's shape key: dtype, cols, rows rounded up to a power of two, the
operands' alignment and phase, the weight flag (dy is multiplied by it) and
whether dweight / dbias are wanted, e.g. "f16|cols=1024|rows=65536|align=16|
phase=1|weight=1|param_grad=1"; the op (layer_norm_backward or
rms_norm_backward) is the table's own key. Only `cupyops tune
layer_norm_backward` / `rms_norm_backward` write it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from .. import dtypes
from ..device import has_clusters
from ..launch import KernelLaunch, Target
from . import norm_candidates, row_candidates
from .norm_backward import auto_backward_dx, grad_holding, grad_plan, grad_smem_bytes, resident_launch
from .norm_backward import plan as rule_plan
from .norm_paths import auto_warp_ladder, block_launch, uses_local_memory, warp_launch
from .norm_spec import NormGradPlan, NormSpec, block_packs_per_thread, ceil_div, cluster_shares_rows
from .row_packs import peeled_pack, vector_pack_size

# register blocks: block sizes (each also at the fewest whole warps holding
# the row at its packs a thread), the most bytes of each input a thread holds
# as stored: kept in registers ("cached") or loaded again ("reread")
BLOCK_SIZES = (64, 128, 256, 512, 1024)
MOST_HELD_BYTES = {"cached": 64, "reread": 128}
# (holding, partial sums, rows loaded together); partials only where fused
HOLDINGS = (("cached", "regs", 1), ("cached", "regs", 2), ("cached", "smem", 1), ("cached", "smem", 2),
            ("reread", "regs", 1), ("reread", "smem", 1))
# blocks of a cluster sharing a row (only clusters of two are all resident at once: norm_backward)
CLUSTER_SIZE = 2
# the warp path: the most bytes of compute values a lane holds of a row
WARP_MOST_BYTES = 128
# shared-memory and uncached rows, from past the warp path's 1024 cols
SMEM_BLOCK_SIZES = (256, 512, 1024)
UNCACHED_BLOCK_SIZES = (512, 1024)
# How a candidate's dx kernel's grid follows rows: the forward's kinds
# (norm_candidates.GRIDS) alone, "resident" with fused partials (one resident
# wave, norm_backward.resident_launch).
GRIDS = norm_candidates.GRIDS + ("resident",)


def launch_for(spec: NormSpec, rows: int, smem: int, grid: str, target: Target) -> KernelLaunch:
    """The dx kernel's launch of `spec` over `rows` with the grid of its kind (GRIDS)."""
    if grid == "resident":
        return resident_launch(spec, rows, smem, target)
    return norm_candidates.launch_for(spec, rows, smem, grid, target)


class Candidate(row_candidates.Candidate):
    """A backward dx kernel worth timing (row_candidates.Candidate; grid kinds
    GRIDS); plan() puts it in its backward plan."""
    spec_type = NormSpec
    launch_for = staticmethod(launch_for)
    grids = norm_candidates.GRIDS

    @classmethod
    def rebuilding(cls, label: str, launch: KernelLaunch, rows: int, target: Target) -> "Candidate":
        """As row_candidates.Candidate's; fused partials take the "resident" grid
        (another kind whose grid matches at these rows may not at others)."""
        if launch.spec.fuse_param_grad:
            return cls(label, launch, "resident")
        return super().rebuilding(label, launch, rows, target)

    def plan(self, rows: int, cols: int, param_grad: bool, target: Target) -> NormGradPlan:
        """The backward plan around this dx kernel (norm_backward.grad_plan)."""
        return grad_plan(self.launch, rows, cols, param_grad, target)


def shape_key(dtype: str, rows: int, cols: int, align: int = 16, same_phase: bool = True, *,
              weight: bool = True, param_grad: bool = True) -> str:
    """The tuning table's key of a backward shape (the module docstring)."""
    return (f"{dtype}|cols={cols}|rows={row_candidates.rows_bucket(rows)}|align={align}|phase={int(same_phase)}"
            f"|weight={int(weight)}|param_grad={int(param_grad)}")


@dataclass(frozen=True)
class TunedNormGradPlan(row_candidates.FromTable, NormGradPlan):
    """A backward plan from a tuning table."""


def tuned_plan(op: str, rows: int, cols: int, dtype: str, target: Target, align: int = 16,
               same_phase: bool = True, *, weight: bool = True,
               param_grad: bool = True) -> Optional[TunedNormGradPlan]:
    """The stored winner for this backward shape (flags as the key takes
    them) on `target` (row_candidates.stored_winner: the user's table, then
    the shipped one), rebuilt for `rows`, or None."""
    key = shape_key(dtype, rows, cols, align, same_phase, weight=weight, param_grad=param_grad)
    found = row_candidates.stored_winner(op, key, target)
    if found is None:
        return None
    chosen = Candidate.from_description(found, rows, target).plan(rows, cols, param_grad, target)
    return TunedNormGradPlan(**vars(chosen), source=found["source"])


def _register_spec(fields, cols, pack_size, peel, cluster_size, block_size, holding, weight_source):
    """A register block dx kernel holding its span of a row (all of it, or a
    cluster_size-th in whole packs), or None where it holds too much a thread
    (MOST_HELD_BYTES) or its threads outnumber the row's packs twice over."""
    num_packs = cols // pack_size
    span_cols = cols if cluster_size == 1 else ceil_div(num_packs, cluster_size) * pack_size
    per_thread = block_packs_per_thread(span_cols, block_size, pack_size, peel)
    held, partials, rows_per_access = holding
    itemsize = dtypes.BY_SHORT[fields["dtype"]].itemsize
    if per_thread * pack_size * itemsize > MOST_HELD_BYTES[held] or span_cols // pack_size < block_size // 2:
        return None
    spec = NormSpec(impl="block_regs", pack_size=pack_size, block_size=block_size, packs_per_thread=per_thread,
                    peel=peel, cluster_size=cluster_size, weight_source=weight_source,
                    **grad_holding(held, partials, rows_per_access), **fields)
    return None if cluster_size > 1 and not cluster_shares_rows(spec, cols) else spec


def _register_candidates(fields, rows, cols, pack, peel_pack, target):
    """Register blocks: fused partials (param_grad) over one resident wave,
    else the dx kernel alone over enough waves; peeled rows (peel_pack) and
    clusters only with fused partials."""
    fused = fields["fuse_param_grad"]
    shapes = [(pack, False, 1)]
    if fused and peel_pack:
        shapes.append((peel_pack, True, 1))
    if fused and pack * dtypes.BY_SHORT[fields["dtype"]].itemsize == 16 and has_clusters(target.facts.arch):
        shapes.append((pack, False, CLUSTER_SIZE))
    holdings = [h for h in HOLDINGS if fused or h[1] == "regs"]
    for pack_size, peel, cluster_size in shapes:
        sources = ("shared_copy", "phase_copies") if peel and fields["weight"] else ("direct",)
        span_packs = ceil_div(cols // pack_size, cluster_size)
        for block_size, holding, source in itertools.product(
                norm_candidates.with_fitted(BLOCK_SIZES, span_packs), holdings, sources):
            spec = _register_spec(fields, cols, pack_size, peel, cluster_size, block_size, holding, source)
            if spec is None or uses_local_memory(spec, target):
                continue
            held, partials, rows_per_access = holding
            label = (f"regs b{block_size} k{spec.packs_per_thread} {held}"
                     f"{f' r{rows_per_access}' * (rows_per_access > 1)}{f' {partials}' * fused}{' peel' * peel}"
                     f"{f' c{cluster_size}' * (cluster_size > 1)}{f' {source}' * peel}")
            if fused:
                yield Candidate(label, resident_launch(spec, rows, grad_smem_bytes(spec, cols), target), "resident")
            else:
                yield Candidate(label, block_launch(spec, rows, 0, target, "auto", False), "waves")


def _warp_candidates(fields, rows, cols, pack, target):
    """The warp path's ladder, its partials (fused) meeting in shared memory."""
    compute_itemsize = dtypes.BY_SHORT[dtypes.BY_SHORT[fields["dtype"]].compute].itemsize
    ladder = auto_warp_ladder(cols, pack, max(WARP_MOST_BYTES // compute_itemsize, pack))
    if ladder is None:
        return
    label = f"warp c{ladder[0]} g{ladder[2]}"
    if fields["fuse_param_grad"]:
        launch = warp_launch(fields, rows, cols, pack, ladder, target, "auto", smem_per_group_col=2 * compute_itemsize)
        launch, label = resident_launch(launch.spec, rows, launch.smem_bytes, target), f"{label} fused"
    else:
        launch = warp_launch(fields, rows, cols, pack, ladder, target, "auto")
    if not uses_local_memory(launch.spec, target):
        yield Candidate(label, launch, "resident" if fields["fuse_param_grad"] else "waves")


def _streaming_candidates(fields, rows, cols, pack, target):
    """Rows cached in shared memory (dy and x in the compute type), or read twice."""
    smem = 2 * cols * dtypes.BY_SHORT[dtypes.BY_SHORT[fields["dtype"]].compute].itemsize
    for block_size in SMEM_BLOCK_SIZES:
        spec = NormSpec(impl="block_smem", pack_size=pack, block_size=block_size, **fields)
        yield Candidate(f"smem b{block_size}", block_launch(spec, rows, smem, target, "auto", True), "waves")
    for block_size in UNCACHED_BLOCK_SIZES:
        spec = NormSpec(impl="block_uncached", pack_size=pack, block_size=block_size, **fields)
        yield Candidate(f"uncached b{block_size}", block_launch(spec, rows, 0, target, "auto", False), "waves")


def candidates(op: str, dtype: str, rows: int, cols: int, target: Target, align: int = 16,
               same_phase: bool = True, *, weight: bool = True, param_grad: bool = True) -> list:
    """The Candidates (dx kernels; Candidate.plan gives the backward plan)
    worth timing for the backward `op` over `rows` x `cols` of dtype (short
    name) on `target`: auto's and oneflow's plans first (and with param_grad
    auto's dx kernel before a column reduction), then each path's variants
    that can launch, each dx kernel once (its first label). param_grad:
    dweight / dbias wanted (fused variants where so, the dx kernel alone
    else). Shared-memory and uncached rows are offered past 1024 cols, the
    warp path to it."""
    family = op.removesuffix("_backward")
    rules = [(policy, rule_plan(family, rows, cols, dtype, policy, target, align, weight, param_grad, same_phase).main)
             for policy in ("auto", "oneflow")]
    fields = dict(op=f"{family}_grad", dtype=dtype, weight=weight)
    if param_grad:
        rules.append(("auto dx", auto_backward_dx(fields, rows, cols, align, target)))
    found = [Candidate.rebuilding(label, launch, rows, target) for label, launch in rules]
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    pack = vector_pack_size(cols, itemsize, align)
    peel_pack, peel = peeled_pack(pack, itemsize, same_phase)
    variants = []
    for fused in sorted({False, param_grad}):
        variants += _register_candidates({**fields, "fuse_param_grad": fused}, rows, cols, pack,
                                         peel_pack if peel else 0, target)
        if cols <= 1024:
            variants += _warp_candidates({**fields, "fuse_param_grad": fused}, rows, cols, pack, target)
    if cols > 1024:
        variants += _streaming_candidates(fields, rows, cols, pack, target)
    return row_candidates.first_of_each_launch(
        found + [c for c in variants if row_candidates.can_launch(target, c.launch)])
