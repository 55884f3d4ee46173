"""The LayerNorm / RMSNorm kernels (kernels/norm.cuh): their instantiations
(NormSpec), the plans made of them (NormPlan forward, NormGradPlan backward)
and the geometry of a row held by a register block, which a plan must cover."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from .. import dtypes, jit
from ..device import WARP_SIZE
from ..launch import KernelLaunch

FORWARD_OPS = ("layer_norm", "rms_norm")
BACKWARD_OPS = ("layer_norm_backward", "rms_norm_backward")
OPS = FORWARD_OPS + BACKWARD_OPS

WARP_BLOCK_THREADS = 128             # OneFlow's, and the backward's
# auto, forward, warp path with groups of a whole warp: blocks of two warps
# (the same kernel, but for its launch bounds: MIN_RESIDENT_THREADS). H200,
# rows 49152, % of copy against blocks of 128 threads, five interleaved
# rounds, bitwise the same output (both bound to 1024 threads an SM):
# LayerNorm 1024 cols f16 88.3 / 87.4 (another run 89.5 / 88.0), bf16 89.8 /
# 88.5, f32 93.1 / 92.7; 512 cols f16 77.2 / 76.4, f32 90.5 / 88.7; RMSNorm
# f32 512 cols 91.1 / 89.1; 128 .. 256 cols within -0.5 .. +1.6. Groups of 4
# or 8 lanes (32 cols) lost: RMSNorm f32 37.0 / 40.4, f16 23.8 / 24.5.
# Blocks of one warp: LayerNorm f16 1024 cols 89.2, 512 cols 66.8.
AUTO_FORWARD_WARP_BLOCK_THREADS = 64
PARAM_GRAD_BLOCK = (32, 32)          # kParamGradRows in kernels/norm.cuh
# Threads per SM each kernel is compiled to leave room for (the second
# argument of __launch_bounds__): 64 registers a thread forward, 128 backward
# (dy, x and partial sums live in registers), 64 backward with the partial
# sums in shared memory (the registers hold rows in flight). auto's two-warp
# forward warp blocks: 18 an SM, 56 registers a thread, no spills (every
# instantiation up to 1024 cols). H200, rows 49152, five interleaved rounds
# against 16 blocks, bitwise the same output, % of copy: LayerNorm f16 512
# cols 78.9 / 77.0, bf16 78.5 / 76.4; 256 cols f16 61.5 / 60.3, bf16 61.1 /
# 60.4; f16 1024 cols with a residual (4 arrays counted) 90.9 / 89.3; the
# other LayerNorm and RMSNorm cols 128 .. 1024 within -0.3 .. +0.2.
MIN_RESIDENT_THREADS = {"forward": 1024, "forward_two_warp": 1152, "backward": 512,
                        "backward_smem_partials": 1024}
# Where a backward register block reads the weight (kernels/norm.cuh,
# WEIGHT_*): name -> (device constant, kernel name suffix). Peeled rows read
# a copy (fused_grad_launch picks it), rows on the 16-byte grid the weight.
WEIGHT_SOURCES = {"direct": ("WEIGHT_DIRECT", ""), "shared_copy": ("WEIGHT_SHARED_COPY", "_wcopy"),
                  "phase_copies": ("WEIGHT_PHASE_COPIES", "_wphases")}
WEIGHT_PHASES_BLOCK = 256


def family_of(op: str) -> str:
    """The norm family of a kernel op: "layer_norm_grad" -> "layer_norm"."""
    return op.removesuffix("_grad")


def _affine_suffix(weight: bool, bias: bool) -> str:
    return {(True, True): "_affine", (True, False): "_weight", (False, True): "_bias"}.get((weight, bias), "")


@dataclass(frozen=True)
class NormSpec(jit.KernelSpec):
    """One norm kernel. op: layer_norm / rms_norm (forward), layer_norm_grad /
    rms_norm_grad (dx), layer_norm_param_grad / rms_norm_param_grad (column
    partial sums) or norm_param_grad_finish."""

    op: str
    impl: str
    dtype: str                       # short name of the storage type
    pack_size: int = 1
    cols_per_thread: int = 0         # warp: max_cols_per_thread
    min_cols_per_thread: int = 0     # warp: packs below it need no bounds check
    thread_group_width: int = 0      # warp
    rows_per_access: int = 1         # warp; backward block_regs, cached: rows loaded together
    padding: bool = False            # warp
    hold_affine: bool = False        # forward warp: lanes read their columns' weight / bias once, before their rows
    block_size: int = 0              # block paths; warp: threads a block (0: WARP_BLOCK_THREADS)
    packs_per_thread: int = 0        # block_regs
    rows_per_block: int = 1          # forward block_regs of 32 threads: rows a block, a warp each
    packed_cache: bool = False       # forward block_smem: cache the storage type
    peel: bool = False               # block_regs: rows start off the 16-byte grid
    packed: bool = False             # forward block_regs: the row held as loaded (storage type)
    full_packs: int = 0              # forward block_regs: a thread's first packs, which every row fills (unchecked)
    tail_packs: int = 0              # forward block_async: packs a thread holds in registers
    cached: bool = True              # backward block_regs: dy / x kept in registers as loaded
    smem_partials: bool = False      # backward block_regs, fused: dweight / dbias partials in shared memory
    weight_source: str = "direct"    # backward block_regs, peeled: where the weight is read (WEIGHT_SOURCES)
    weight: bool = False
    bias: bool = False
    residual: bool = False
    fuse_param_grad: bool = False    # backward: dweight / dbias partials in the dx kernel
    cluster_size: int = 1            # backward block_regs, fused: blocks of a thread-block cluster sharing a row
    min_blocks: int = 0              # __launch_bounds__' blocks an SM where not MIN_RESIDENT_THREADS rounded up

    def __post_init__(self):
        if self.cluster_size > 1 and not (self.op in ("layer_norm_grad", "rms_norm_grad")
                                          and self.impl == "block_regs" and not self.peel):
            raise ValueError(f"only the backward register block shares rows on the 16-byte grid in a cluster, "
                             f"not {self.op} {self.impl}{' peeled' if self.peel else ''}")

    @property
    def ftype(self) -> dtypes.FloatType:
        return dtypes.BY_SHORT[self.dtype]

    @property
    def centered(self) -> bool:
        return self.op.startswith("layer_norm")

    @property
    def template(self) -> str:
        return "norm.cu.j2" if self.op in FORWARD_OPS else "norm_grad.cu.j2"

    @property
    def name(self) -> str:
        types = f"{self.dtype}_{self.ftype.compute}"
        if self.impl in ("param_grad", "param_grad_finish"):
            return f"{self.op}_{types}"
        if self.impl == "weight_phases":
            return f"{self.op}_{self.dtype}_p{self.pack_size}"
        head = f"{self.op}_{self.impl}_{types}_p{self.pack_size}"
        if self.impl == "warp":
            cols = f"c{self.cols_per_thread}"
            if self.min_cols_per_thread != self.cols_per_thread:
                cols += f"m{self.min_cols_per_thread}"
            pad = "pad" if self.padding else "nopad"
            path = f"_{cols}_g{self.thread_group_width}_r{self.rows_per_access}_{pad}"
            path += f"_b{self.block_size}" if self.block_size else ""
            path += f"_mb{self.min_blocks}" if self.min_blocks else ""
            path += "_held" if self.hold_affine else ""
        elif self.impl == "block_regs":
            path = f"_k{self.packs_per_thread}_b{self.block_size}"
            path += f"x{self.rows_per_block}" if self.rows_per_block > 1 else ""
            path += f"_c{self.cluster_size}" if self.cluster_size > 1 else ""
            path += f"_mb{self.min_blocks}" if self.min_blocks else ""
            path += "_peel" if self.peel else ""
            path += "_packed" if self.packed else ""
            path += f"_full{self.full_packs}" if self.full_packs else ""
            if self.op not in FORWARD_OPS:
                path += "_cached" if self.cached else "_reread"
                path += f"_r{self.rows_per_access}" if self.rows_per_access > 1 else ""
                path += WEIGHT_SOURCES[self.weight_source][1]
        elif self.impl == "block_async":
            path = f"_b{self.block_size}" + (f"_t{self.tail_packs}" if self.tail_packs else "")
        elif self.impl == "block_smem" and self.op in FORWARD_OPS:
            path = f"_b{self.block_size}_cache{self.cache_ftype.short}"
        else:
            path = f"_b{self.block_size}"
        flags = _affine_suffix(self.weight, self.bias)
        flags += "_residual" if self.residual else ""
        flags += ("_pgradsmem" if self.smem_partials else "_pgrad") if self.fuse_param_grad else ""
        return head + path + flags

    @property
    def elements_past_packs(self) -> bool:
        """A peeled register block: up to block_size single elements past a
        row's packs (block_packs_per_thread)."""
        return self.peel

    @property
    def cache_ftype(self) -> dtypes.FloatType:
        return self.ftype if self.packed_cache else dtypes.BY_SHORT[self.ftype.compute]

    @property
    def threads_per_block(self) -> int:
        if self.impl == "warp":
            return self.block_size or WARP_BLOCK_THREADS
        if self.impl in ("param_grad", "param_grad_finish"):
            return PARAM_GRAD_BLOCK[0] * PARAM_GRAD_BLOCK[1]
        if self.impl == "weight_phases":
            return WEIGHT_PHASES_BLOCK
        return self.block_size * self.rows_per_block

    @property
    def resident_threads(self) -> int:
        """The threads an SM this kind of kernel is compiled to leave room
        for (MIN_RESIDENT_THREADS)."""
        if self.op in FORWARD_OPS:
            two_warp = self.impl == "warp" and self.block_size == AUTO_FORWARD_WARP_BLOCK_THREADS
            kind = "forward_two_warp" if two_warp else "forward"
        else:
            kind = "backward_smem_partials" if self.smem_partials else "backward"
        return MIN_RESIDENT_THREADS[kind]

    @property
    def min_blocks_per_sm(self) -> int:
        """__launch_bounds__' second argument: resident_threads in whole
        blocks, rounded up, so ptxas neither spills to reach full occupancy
        nor spends registers past it; or min_blocks where set (a fitted
        backward block rounding down, first_grad_rung)."""
        return self.min_blocks or ceil_div(self.resident_threads, self.threads_per_block)

    def explain_extra(self) -> dict:
        return {"min_cols_per_thread": self.min_cols_per_thread}

    def template_args(self) -> dict:
        return {**super().template_args(), "storage_type": self.ftype.c_type,
                "compute_type": self.ftype.compute_c_type, "cache_type": self.cache_ftype.c_type,
                "centered": self.centered, "min_blocks_per_sm": self.min_blocks_per_sm,
                "weight_source_constant": WEIGHT_SOURCES[self.weight_source][0]}


@dataclass(frozen=True)
class NormPlan:
    """Forward: one kernel."""
    main: KernelLaunch

    @property
    def spec(self) -> NormSpec:
        return self.main.spec

    @property
    def launches(self) -> tuple:
        return (self.main,)

    def explain(self) -> dict:
        return self.main.explain()


@dataclass(frozen=True)
class NormGradPlan:
    """Backward: the weight's phase copies when the dx kernel reads them, the
    dx kernel (partials fused or not), the column reduction when not fused,
    and the kernel that sums the [parts, cols] partials."""
    main: KernelLaunch
    param_grad: Optional[KernelLaunch]
    finish: Optional[KernelLaunch]
    num_parts: int                 # workspace rows of partial sums
    rows_per_chunk: int            # rows per workspace row of the column reduction
    weight_phases: Optional[KernelLaunch] = None

    @property
    def spec(self) -> NormSpec:
        return self.main.spec

    @property
    def launches(self) -> tuple:
        return tuple(k for k in (self.weight_phases, self.main, self.param_grad, self.finish) if k is not None)

    def explain(self) -> dict:
        info = self.main.explain()
        if self.finish is not None:
            info["param_grad"] = "fused" if self.param_grad is None else self.param_grad.spec.name
            info["workspace_rows"] = self.num_parts
            info["finish_kernel"] = self.finish.spec.name
        if self.weight_phases is not None:
            info["weight_phases_kernel"] = self.weight_phases.spec.name
        return info



# -- the rows a register block holds ------------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_packs_per_thread(cols: int, block_size: int, pack_size: int, elements_past_packs: bool) -> int:
    """Packs of pack_size a thread of a register block holds of a row: enough
    for every pack of the row, or, where the kernel takes single elements
    past the packs (peeled rows: BlockRowColumns in kernels/norm.cuh), the
    fewest that leave at most block_size of them:
    cols <= block_size * (packs * pack_size + 1)."""
    if elements_past_packs:
        return max(1, ceil_div(cols - block_size, block_size * pack_size))
    return ceil_div(cols // pack_size, block_size)


def fewest_warps(items: int, items_per_thread: int, least: int) -> int:
    """The fewest threads, in whole warps and at least `least`, holding
    `items` at items_per_thread a thread."""
    return max(least, WARP_SIZE * ceil_div(items, WARP_SIZE * items_per_thread))


def full_packs_per_thread(cols: int, block_size: int, pack_size: int, peel: bool) -> int:
    """How many packs of each thread of a register block every row of `cols`
    fills (a peeled row at any phase: up to pack_size - 1 elements before its
    first pack)."""
    fewest_packs = (cols - (pack_size - 1)) // pack_size if peel else cols // pack_size
    return fewest_packs // block_size


def cluster_shares_rows(spec: NormSpec, cols: int) -> bool:
    """Whether the blocks of a backward register kernel's cluster, each
    owning a span of block_size x packs_per_thread packs (BlockRowColumns in
    kernels/norm.cuh), together cover a row of `cols` (whole packs) and each
    own a part of it."""
    span_packs = spec.block_size * spec.packs_per_thread
    num_packs, whole = divmod(cols, spec.pack_size)
    return whole == 0 and (spec.cluster_size - 1) * span_packs < num_packs <= spec.cluster_size * span_packs


@functools.lru_cache(maxsize=4096)
def check_block_covers(spec: NormSpec, cols: int) -> None:
    """Refuses a register block plan whose threads would not reach every
    column of a row, or that leaves packs unchecked (full_packs) which a row
    may not fill (a hand-built spec; the planner's never do)."""
    if spec.impl != "block_regs":
        return
    if spec.cluster_size > 1:
        if not cluster_shares_rows(spec, cols):
            raise ValueError(f"{spec.name} does not leave each block of its cluster a part of rows of "
                             f"{cols} columns")
    elif spec.packs_per_thread < block_packs_per_thread(cols, spec.block_size, spec.pack_size,
                                                        spec.elements_past_packs):
        raise ValueError(f"{spec.name} holds too few packs a thread for rows of {cols} columns")
    if spec.full_packs > min(spec.packs_per_thread,
                             full_packs_per_thread(cols, spec.block_size, spec.pack_size, spec.peel)):
        raise ValueError(f"{spec.name} leaves {spec.full_packs} packs a thread unchecked, "
                         f"but rows of {cols} columns fill fewer")


def shifted_copy_elements(pack_size: int, cols: int) -> int:
    """Elements of a copy of the weight that starts up to pack_size - 1
    elements in (kernels/norm.cuh: shifted_copy_start), on whole packs: the
    shared copy's size and the stride of the phase copies."""
    return (cols + 2 * pack_size - 2) // pack_size * pack_size
