"""Fused attention softmax, forward and backward: plan -> launch -> public functions.

fused_softmax(x) = dropout(softmax(x * scale + bias, masked positions -inf)).
The softmax paths of kernels/softmax.cuh run unchanged through the LOAD and
STORE functors of kernels/fused_softmax.cuh; the rules' plan is softmax's
(cupyops.ops.softmax.plan) with the cp.async path (and the split rows it
leads to) swapped for registers, shared memory filled through the LOAD, or
re-reading the row, and caches of the storage type for caches of the compute
type (a score x * scale + bias, rounded back to 16 bits, would lose what the
fusion keeps). The tuner also offers the cp.async path, which caches the
inputs' packs as they are and applies the fusion as it reads them back (its
winners ship in the tuned tables). The dropout mask is
Philox4x32-10 of each element's linear index (kernels/philox.cuh): the
backward regenerates it from (seed, offset) and recomputes the
probabilities from x and the row's log-sum-exp, which the forward's STORE
writes as the row finishes, so nothing else is stored or read again.
Where a bias is broadcast along x's outermost dim (an (H, S, S) bias over
(B, H, S, S) scores), the kernels may take the B entries' rows in turn, so
each bias row is read from memory once (interleave_rule, the tuner's orders).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import numpy

from .. import arrays, callcache, dtypes, jit, philox
from ..callcache import call_key, delivered, run_on, writable
from ..launch import KernelLaunch, LaunchCache, Target, get_num_blocks, live_function
from ..packed import POINTER, PackedLaunch, address
from ..profile import profile_for
from . import row_candidates, softmax_candidates, softmax_rows as softmax
from .fused_softmax_operands import WIDE_ROWS, Fusion, Operands, division_magics, prepare, row_order

STAGES = ("forward", "backward")
SOFTMAX_OP = {"forward": "softmax", "backward": "softmax_backward"}
TUNED_OPS = {stage: f"fused_softmax_{stage}" for stage in SOFTMAX_OP}   # the tuning table's ops
MASK_BLOCK_SIZE = 256


@dataclass(frozen=True)
class FusedSoftmaxSpec(jit.KernelSpec):
    """A softmax path (`path`, a SoftmaxSpec) with the fusion's operands: bias of
    type bias_dtype ("" none), a bool mask, the causal rule, dropout. The forward
    also writes each row's log-sum-exp where the call asks for it. wide: rows, or
    bias or mask elements, from 2**31 on (WIDE_ROWS), whose broadcast indices divide
    rather than multiply and take 64-bit offsets. interleaved: Fusion.entries' rows
    taken in turn (kernels/fused_softmax.cuh's RowOrder). bias_vectors, mask_words:
    the bias's packs are aligned vectors, the mask's aligned words (aligned_packs).
    grouped_dropout: each pack is a whole group of eight of the dropout mask
    (grouped_variant)."""
    template = "fused_softmax.cu.j2"

    stage: str
    dtype: str
    path: softmax.SoftmaxSpec
    bias_dtype: str = ""
    mask: bool = False
    causal: bool = False
    dropout: bool = False
    wide: bool = False
    interleaved: bool = False
    bias_vectors: bool = False
    mask_words: bool = False
    grouped_dropout: bool = False

    @property
    def fusion(self) -> str:
        parts = ["scale", f"bias{self.bias_dtype}{'v' if self.bias_vectors else ''}" if self.bias_dtype else "",
                 ("maskw" if self.mask_words else "mask") if self.mask else "", "causal" if self.causal else "",
                 ("drop8" if self.grouped_dropout else "drop") if self.dropout else ""]
        return "_".join(part for part in parts if part)

    @property
    def name(self) -> str:
        return (f"fused_{self.path.name}_{self.fusion}{'_wide' if self.wide else ''}"
                f"{'_interleaved' if self.interleaved else ''}")

    @property
    def threads_per_block(self) -> int:
        return self.path.threads_per_block

    @property
    def folded_outputs(self) -> bool:
        """Whether the forward writes its rows' outputs folded (kernels/softmax.cuh's
        FoldedNaturalExp: an FFMA and an EX2 an element): the cp.async rows, 16-bit outputs
        (the fold moves an output by under 2e-5 of itself)."""
        return self.stage == "forward" and self.path.impl == "block_async" and self.dtype in ("f16", "bf16")

    def __getattr__(self, field):   # the path's fields (explain's op, impl, pack_size, ...)
        if field.startswith("__"):
            raise AttributeError(field)
        path = self.__dict__.get("path")
        if path is None:
            raise AttributeError(field)
        return getattr(path, field)

    def with_path(self, path: softmax.SoftmaxSpec) -> "FusedSoftmaxSpec":
        """This kernel on another path; its aligned packs kept where the packs are the same."""
        same_packs = (path.pack_size, path.peel) == (self.path.pack_size, self.path.peel)
        return replace(self, path=path, bias_vectors=self.bias_vectors and same_packs,
                       mask_words=self.mask_words and same_packs)

    def explain_extra(self) -> dict:
        return {**self.path.explain_extra(), "stage": self.stage, "fusion": self.fusion,
                "folded_outputs": self.folded_outputs,
                "storage_cache": self.path.storage_cache, "interleaved": self.interleaved}

    def template_args(self) -> dict:
        ftype = dtypes.BY_SHORT[self.dtype]
        return {**self.path.template_args(), "stage": self.stage, "storage_type": ftype.c_type,
                "compute_type": ftype.compute_c_type, "mask": self.mask, "causal": self.causal,
                "dropout": self.dropout, "wide": self.wide, "interleaved": self.interleaved,
                "bias_vectors": self.bias_vectors, "mask_words": self.mask_words,
                "grouped_dropout": self.grouped_dropout, "folded_outputs": self.folded_outputs,
                "bias_type": dtypes.BY_SHORT[self.bias_dtype].c_type if self.bias_dtype else ""}


@dataclass(frozen=True)
class DropoutMaskSpec(jit.KernelSpec):
    template = "dropout_mask.cu.j2"

    @property
    def name(self) -> str:
        return f"dropout_mask_b{MASK_BLOCK_SIZE}"

    @property
    def threads_per_block(self) -> int:
        return MASK_BLOCK_SIZE


# -- plan --------------------------------------------------------------------

def _compute_path(spec: softmax.SoftmaxSpec) -> softmax.SoftmaxSpec:
    return replace(spec, storage_cache=False) if spec.storage_cache else spec


def _long_row_plan(op, dtype, rows, cols, pack_size, same_phase, target, regs=True) -> KernelLaunch:
    """Rows softmax would cache by cp.async or split: registers (where `regs`),
    else shared memory in the compute type (filled through the LOAD), else re-read."""
    in_registers = softmax.regs_plan(op, dtype, rows, cols, pack_size, same_phase, target) if regs else None
    if in_registers is not None:
        return in_registers
    ftype = dtypes.BY_SHORT[dtype]
    cache_pack, peel = softmax.peeled_pack(pack_size, ftype.itemsize, same_phase)
    cached = softmax.SUM_INPUTS[op]
    cache_bytes = cached * cols * dtypes.BY_SHORT[ftype.compute].itemsize
    tuned = profile_for(target.facts)
    spec = softmax.SoftmaxSpec(op, "block_smem", dtype, cache_pack, block_size=tuned.FUSED_SHARED_BLOCK_SIZE, peel=peel)
    if target.max_active_blocks(spec, spec.block_size, cache_bytes, True):
        return softmax.block_plan(spec, rows, cache_bytes, target)
    return softmax.uncached_plan(op, dtype, rows, cache_pack, True, target, peel)


def _with_compute_cache(chosen: KernelLaunch, op, dtype, rows, cols, target) -> KernelLaunch:
    """A shared-memory plan caching the compute type: its bytes, or the uncached path past them."""
    spec = _compute_path(chosen.spec)
    if spec.impl != "block_smem" or spec == chosen.spec:
        return replace(chosen, spec=spec)
    compute_itemsize = dtypes.BY_SHORT[spec.ftype.compute].itemsize
    cache_bytes = (spec.cached_inputs or len(spec.inputs)) * cols * compute_itemsize
    if target.max_active_blocks(spec, spec.block_size, cache_bytes, True):
        return softmax.block_plan(spec, rows, cache_bytes, target)
    return softmax.uncached_plan(op, dtype, rows, spec.pack_size, True, target, spec.peel)


def plan(stage: str, rows: int, cols: int, dtype: str, policy: str, target: Target, fusion: Fusion,
         align: int = 16, same_phase: bool = True) -> KernelLaunch:
    """One stage's launch ("forward", "backward"): auto's tuned winner, else the rules'."""
    if policy == "auto" and stage in SOFTMAX_OP:
        found = row_candidates.stored_winner(TUNED_OPS[stage],
                                             tuning_key(dtype, rows, cols, fusion, align, same_phase), target)
        if found is not None and not row_candidates.is_rule(found):
            chosen = fused_launch(stage, dtype, rows, cols, target, fusion, found)
            return row_candidates.tuned_launch(chosen, found["source"])
    return rule_plan(stage, rows, cols, dtype, policy, target, fusion, align, same_phase)


def tuning_key(dtype: str, rows: int, cols: int, fusion: Fusion, align: int = 16, same_phase: bool = True) -> str:
    """The tuning table's key of a stage's shape: softmax's, and what the kernel fuses."""
    return (f"{softmax_candidates.shape_key(dtype, rows, cols, align, same_phase)}|bias={fusion.bias_dtype or 0}"
            f"|mask={int(fusion.mask)}|causal={int(fusion.causal)}|dropout={int(fusion.dropout)}"
            f"{f'|entries={fusion.entries}' if fusion.entries > 1 else ''}")


def fused_launch(stage, dtype, rows, cols, target, fusion, description: dict) -> KernelLaunch:
    """A table's description as the fused kernel: a policy's rule plan, or a softmax row plan
    taking its rows in order or (description["interleaved"]) Fusion.entries' in turn."""
    if description["label"] in ("auto", "oneflow"):
        return rule_plan(stage, rows, cols, dtype, description["label"], target, fusion)
    path = softmax_candidates.Candidate.from_description(description, rows, target).launch
    chosen = _with_compute_cache(path, SOFTMAX_OP[stage], dtype, rows, cols, target)
    interleaved = description.get("interleaved", False) and fusion.entries > 1
    fused = replace(chosen, spec=FusedSoftmaxSpec(stage, dtype, chosen.spec,
                                                   **_spec_fields(rows, fusion, interleaved, chosen.spec)))
    return _in_order_if_spilling(fused, target)


def aligned_packs(path: softmax.SoftmaxSpec, fusion: Fusion) -> dict:
    """FusedSoftmaxSpec's bias_vectors and mask_words: whether the path's packs (at multiples
    of the pack: not peeled) of the bias are vectors on their own boundary (the bias aligned
    to a pack, up to 16 bytes), and those of the mask whole words on theirs (packs of a
    multiple of 4 columns, the mask aligned to a pack)."""
    pack, whole = path.pack_size, path.pack_size > 1 and not path.peel
    bias_bytes = min(16, pack * dtypes.BY_SHORT[fusion.bias_dtype].itemsize) if fusion.bias_dtype else 0
    return {"bias_vectors": bool(fusion.bias_dtype) and whole and fusion.bias_align >= bias_bytes,
            "mask_words": fusion.mask and whole and pack % 4 == 0 and fusion.mask_align >= pack}


def grouped_variant(spec: FusedSoftmaxSpec, target: Target):
    """`spec` taking each dropout pack as one whole group of eight of the mask (Philox's four
    words compared half by half, kernels/philox.cuh's GroupedDropoutMask), where its packs
    allow it (8 elements at multiples of 8: not peeled, rows of a multiple of 8) and it does
    not spill on `target`; a call runs it when its offset is a multiple of 8 as well. None
    elsewhere."""
    if not (spec.dropout and spec.path.pack_size == 8 and not spec.path.peel):
        return None
    variant = replace(spec, grouped_dropout=True)
    return None if spills(variant, target) else variant


def _spec_fields(rows: int, fusion: Fusion, interleaved: bool, path: softmax.SoftmaxSpec) -> dict:
    """FusedSoftmaxSpec's fields beside the path for a call's rows and fusion."""
    return dict(bias_dtype=fusion.bias_dtype, mask=fusion.mask, causal=fusion.causal, dropout=fusion.dropout,
                wide=rows >= WIDE_ROWS or fusion.wide_operands, interleaved=interleaved,
                **aligned_packs(path, fusion))


def interleave_rule(rows: int, cols: int, dtype: str, fusion: Fusion, target: Target) -> bool:
    """Whether the rules take Fusion.entries' rows in turn: where one entry's rows (x read, y
    written and its bias) overflow half the L2, in order the bias leaves L2 before the next
    entry reads it; in turn, the rows reading one bias row run together and read it once."""
    if fusion.entries == 1 or not fusion.bias_dtype:
        return False
    itemsize, bias_itemsize = dtypes.BY_SHORT[dtype].itemsize, dtypes.BY_SHORT[fusion.bias_dtype].itemsize
    entry_bytes = rows // fusion.entries * cols * (2 * itemsize + bias_itemsize)
    return entry_bytes > target.facts.l2_bytes // 2


def rule_plan(stage: str, rows: int, cols: int, dtype: str, policy: str, target: Target, fusion: Fusion,
              align: int = 16, same_phase: bool = True) -> KernelLaunch:
    """The launch of one stage by the rules: softmax's plan of the rows, read through the LOAD."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    op = SOFTMAX_OP[stage]
    chosen = softmax.plan(op, rows, cols, dtype, policy, target, align, same_phase)
    if chosen.spec.impl == "block_async":
        chosen = _long_row_plan(op, dtype, rows, cols, chosen.spec.pack_size, same_phase, target)
    chosen = _with_compute_cache(chosen, op, dtype, rows, cols, target)
    interleaved = policy == "auto" and interleave_rule(rows, cols, dtype, fusion, target)   # OneFlow's: in order
    fused = replace(chosen, spec=FusedSoftmaxSpec(stage, dtype, chosen.spec,
                                                   **_spec_fields(rows, fusion, interleaved, chosen.spec)))
    return _in_order_if_spilling(_without_spills(fused, op, rows, cols, target), target)


def spills(spec, target: Target) -> bool:
    """Whether `spec` takes more spilled and stack bytes on `target` than its profile
    allows a fused kernel (FUSED_MAX_LOCAL_BYTES)."""
    tuned = profile_for(target.facts)
    return target.resources(spec)["local_bytes"] > tuned.FUSED_MAX_LOCAL_BYTES


def _in_order_if_spilling(chosen: KernelLaunch, target) -> KernelLaunch:
    """An interleaved kernel that spills (RowOrder holds registers): the same kernel taking its
    rows in order."""
    if not chosen.spec.interleaved or not spills(chosen.spec, target):
        return chosen
    return replace(chosen, spec=replace(chosen.spec, interleaved=False))


def _without_spills(chosen: KernelLaunch, op, rows, cols, target) -> KernelLaunch:
    """A fused kernel that spills (the LOAD and STORE hold more live values than
    softmax's): a block bound to several blocks an SM without that bound; a
    register-cached row in wider blocks holding fewer packs a thread, else cached in
    shared memory."""
    spec = chosen.spec
    if not spills(spec, target):
        return chosen
    path = spec.path
    if path.min_blocks:
        return replace(chosen, spec=spec.with_path(replace(path, min_blocks=0)))
    if path.impl != "block_regs":
        return chosen
    num_packs = cols // path.pack_size   # as softmax's register plan counts them
    for block_size in softmax.AUTO_BLOCK_REGS_SIZES:
        packs_per_thread = -(-num_packs // block_size)
        if block_size <= path.block_size or packs_per_thread >= path.packs_per_thread:
            continue
        wider = spec.with_path(replace(path, block_size=block_size, packs_per_thread=packs_per_thread,
                                       rows_per_block=1))      # a row a block once wider than a warp
        if not spills(wider, target):
            return softmax.block_plan(wider, rows, 0, target)
    pack_size = 1 if path.peel else path.pack_size   # a peeled row's packs are its 16-byte ones again
    shared = _long_row_plan(op, path.dtype, rows, cols, pack_size, path.peel, target, regs=False)
    shared = _with_compute_cache(shared, op, path.dtype, rows, cols, target)
    return replace(shared, spec=spec.with_path(shared.spec))


# -- launch ------------------------------------------------------------------

# Stage launches, whole calls (call_key) and dropout-mask launches, memoised side by side.
_launches = LaunchCache()
ROUND_KEYS = f"{philox.round_keys(0).nbytes}s"   # the RoundKeys argument, packed per launch


class _RoundKeys:
    """The kernels' RoundKeys argument of a seed (philox.round_key_bytes). Kept for the last
    MOST seeds."""
    MOST = 64

    def __init__(self):
        self.found = {}

    def __call__(self, seed: int) -> bytes:
        found = self.found.get(seed)
        if found is None:
            if len(self.found) >= self.MOST:
                self.found.clear()
            found = self.found[seed] = philox.round_key_bytes(seed)
        return found


_round_keys = _RoundKeys()


class StageLaunch:
    """One stage's kernel ready for a call's layout (packed.PackedLaunch): its `pointers`
    array addresses, then the scalar arguments before the dropout's, then the round keys,
    offset and threshold: those of the call for a kernel with dropout (`threshold`), else
    seed 0's, 0 and 0 (the call's seed and offset must still be numbers); grouped: the
    launch of its grouped_variant (None where there is none), run for offsets that are
    multiples of 8."""
    __slots__ = ("launch", "grouped", "dropout")

    def __init__(self, function, grid, block, smem, pointers: int, scalars: tuple, threshold, grouped=None):
        self.dropout = threshold is not None
        counters = (ROUND_KEYS, "Q", threshold) if self.dropout else \
            (philox.round_keys(0), numpy.uint64(0), numpy.uint32(0))
        args = (POINTER,) * pointers + scalars + counters
        self.launch = PackedLaunch(function, grid, block, smem, args)
        self.grouped = None if grouped is None else PackedLaunch(grouped, grid, block, smem, args)

    def run(self, pointers: tuple, seed, offset) -> None:
        """Launches on `pointers`, the addresses of x, dy, bias, mask, out, lse: those the stage
        reads and writes, lse 0 for a forward not returning it."""
        if not self.dropout:
            self.launch(pointers)
            return
        offset = offset % 2 ** 64
        launch = self.grouped if self.grouped is not None and offset % 8 == 0 else self.launch
        launch((*pointers, _round_keys(seed % 2 ** 64), offset))


def stage_launch(stage: str, operands: Operands, policy: str, out, dy=None, chosen=None) -> StageLaunch:
    """`stage`'s launch writing `out`: the planner's, or `chosen` (the tuner's); its run takes
    (*stage_inputs(...), out, lse)."""
    x = operands.x
    device_id = x.device.id
    dtype = dtypes.BY_DTYPE[x.dtype].short
    arrays_used = [a for a in (x, dy, out) if a is not None]
    align = arrays.alignment(*(a.data.ptr for a in arrays_used), operands.cols * x.itemsize)
    same_phase = len({a.data.ptr % 16 for a in arrays_used}) == 1
    key = (stage, policy, operands.rows, operands.cols, dtype, operands.fusion, align, same_phase, device_id)

    def functions(chosen) -> tuple:   # the plan, its function and its grouped variant's (or None)
        grouped = grouped_variant(chosen.spec, Target.live(device_id))
        return (chosen, live_function(chosen.spec, device_id, chosen.smem_bytes),
                None if grouped is None else live_function(grouped, device_id, chosen.smem_bytes))

    def make():
        return functions(plan(stage, operands.rows, operands.cols, dtype, policy, Target.live(device_id),
                              operands.fusion, align, same_phase))

    chosen, function, grouped = _launches.get(key, make) if chosen is None else functions(chosen)
    keep_scale = 1.0 / (1.0 - operands.dropout)
    compute = dtypes.DTYPE_OF_SHORT[dtypes.BY_SHORT[dtype].compute].type   # the kernel's C
    outer, inner, order_magic = row_order(operands.rows, operands.fusion.entries)
    scalars = (numpy.int64(operands.rows), numpy.int64(operands.cols), compute(operands.scale),
               compute(keep_scale), *(numpy.int64(v) for v in operands.geometry),
               *(numpy.uint64(m) for m in division_magics(operands.rows, operands.geometry)),
               numpy.int64(outer), numpy.int64(inner), numpy.uint64(order_magic))
    threshold = numpy.uint32(philox.dropout_threshold(operands.dropout)) if chosen.spec.dropout else None
    pointers = len(stage_inputs(x, dy if stage == "backward" else None, operands)) + 2   # and out, lse
    return StageLaunch(function, chosen.grid, chosen.block, chosen.smem_bytes, pointers, scalars, threshold, grouped)


def stage_inputs(x, dy, operands: Operands) -> list:
    """What every stage reads, in the kernels' order: x, dy (backward), bias, mask (given)."""
    return [a for a in (x, dy, operands.bias, operands.mask) if a is not None]


class _ReadyCall:
    """A memoised call: its stage (forward or backward), the output's shape and dtype, which
    of (x, dy, bias, mask) the stage reads, and whether a forward returns the lse."""
    __slots__ = ("main", "return_lse", "shape", "dtype", "take")

    def __init__(self, main: StageLaunch, return_lse: bool, shape, dtype, read: tuple):
        self.main, self.return_lse, self.shape, self.dtype = main, return_lse, shape, dtype
        positions = tuple(k for k, a in enumerate(read) if a is not None)
        self.take = (lambda arrays: arrays[:1]) if positions == (0,) else operator.itemgetter(*positions)

    def run(self, read: tuple, out, lse, seed, offset):
        """The call on `read` = (x, dy, bias, mask), writing `out` (None: a fresh array) and
        reading `lse` (backward): the result, with the new lse where the forward returns it."""
        empty = callcache.empty
        y = empty(self.shape, self.dtype) if out is None else out
        inputs = self.take(read)
        if lse is not None or not self.return_lse:
            self.main.run((*map(address, inputs), y.data.ptr, 0 if lse is None else lse.data.ptr), seed, offset)
            return y
        lse = empty(self.shape[:-1], numpy.float32)
        self.main.run((*map(address, inputs), y.data.ptr, lse.data.ptr), seed, offset)
        return y, lse

    def run_at(self, read: tuple, y: int, lse: int, seed, offset) -> None:
        """run on addresses: read = (x, dy, bias, mask) (0 where absent), y's, and lse's (0
        for a forward not returning it), for arrays of the call's layout not CuPy's."""
        self.main.run((*self.take(read), y, lse), seed, offset)


def _remember(key, operands: Operands, caller: tuple, read: tuple, written, out, main,
              return_lse: bool = False) -> None:
    """Remembers the call under `key` where it was its stages alone on the caller's arrays:
    reduced axis last (no dropout of its own, no moved result), every array read the
    caller's (`caller` and `read`: x, dy, lse, bias, mask, None where absent), out (if given)
    written by the kernel."""
    x = operands.x
    if key is None or operands.axis != x.ndim - 1 or (out is not None and written is not out):
        return
    if all((a is None) == (b is None) and (a is None or a.data.ptr == b.data.ptr) for a, b in zip(caller, read)):
        ready = _ReadyCall(main, return_lse, x.shape, x.dtype, (read[0], read[1], read[3], read[4]))
        _launches.remember(key, ready)


def _restore_axis(result, axis: int):
    import cupy

    return result if axis == result.ndim - 1 else cupy.moveaxis(result, -1, axis)


def _separate_dropout(operands: Operands) -> bool:
    return operands.dropout > 0 and not operands.fusion.dropout


def _apply_dropout(a, p: float, seed: int, offset: int):
    """a * dropout_mask(a.shape, p, seed, offset) / (1 - p), in a's compute type."""
    compute = dtypes.DTYPE_OF_SHORT[dtypes.BY_DTYPE[a.dtype].compute]
    keep = dropout_mask(a.shape, p, seed, offset).astype(compute) * compute.type(1.0 / (1.0 - p))
    return (a.astype(compute) * keep).astype(a.dtype)


def _writable_out(out, x, operands: Operands, *inputs):
    """`out` checked against the caller's x (TypeError / ValueError), and itself where the
    kernel can write it (reduced axis last, C-contiguous, overlapping no input, dropout in
    the kernel), else a new array that callcache.delivered copies into `out`."""
    import cupy

    if out is not None:
        arrays.check_out(out, _restore_axis(x, operands.axis).shape, x.dtype, x.device.id)
    if out is None or operands.axis != x.ndim - 1 or _separate_dropout(operands) or \
            not out.flags.c_contiguous or not writable(out, inputs, in_place=False):
        return cupy.empty(x.shape, x.dtype)
    return out


# -- public functions --------------------------------------------------------
# A repeated call on arrays of one layout replays its stages (callcache): seed and offset
# are its only arguments read anew, the memo key holding the rest.

def fused_softmax(x, *, scale=1.0, bias=None, mask=None, causal=False, diagonal=0, dropout=0.0, seed=0,
                  offset=0, axis=-1, return_lse=False, out=None, policy: str = "auto", stream=None):
    """dropout(softmax(x * scale + bias, masked -inf)) over `axis`, in one pass over memory.

    torch: ``F.dropout(torch.softmax((x * scale + bias).masked_fill(~mask, -inf), -1), p)``
    with causal adding ``masked_fill(~torch.tril(ones(Sq, Sk), diagonal), -inf)`` (row: the
    second-to-last axis; diagonal = Sk - Sq aligns bottom-right). bias (any float dtype) and
    mask (bool) broadcast to x NumPy-style and are read in their own shape. Every masked
    position gives 0, so a row with no kept position gives zeros (torch: NaN). Dropout keeps
    an element iff dropout_mask(x.shape, dropout, seed, offset) does, scaling it by
    1 / (1 - dropout); a dropped element is 0, in a row of NaN too (torch: NaN).
    return_lse: also the float32 log-sum-exp of each row (-inf where no position is kept),
    what fused_softmax_backward needs, written by the same kernel.
    """
    key = call_key(("forward", policy, scale, causal, diagonal, dropout, axis, return_lse), (x, bias, mask, out))
    call = _launches.find(key)
    if call is not None and writable(out, (x, bias, mask), in_place=False):
        read = (x, None, bias, mask)
        return call.run(read, out, None, seed, offset) if stream is None else \
            run_on(stream, call.run, read, out, None, seed, offset)

    arrays.check_policy(policy)
    import cupy

    with arrays.on_device(arrays.as_cupy(x, "x"), stream):
        operands = prepare(x, scale=scale, bias=bias, mask=mask, causal=causal, diagonal=diagonal,
                           dropout=dropout, axis=axis)
        caller, x = (x, None, None, bias, mask), operands.x
        y = _writable_out(out, x, operands, x, operands.bias, operands.mask)
        lse = cupy.empty(x.shape[:-1], numpy.float32) if return_lse else None
        if x.size:
            main = stage_launch("forward", operands, policy, y)
            main.run((*map(address, stage_inputs(x, None, operands)), y.data.ptr, 0 if lse is None else lse.data.ptr),
                     seed, offset)
            _remember(key, operands, caller, (x, None, None, operands.bias, operands.mask), y, out, main,
                      return_lse)
        y = _restore_axis(y, operands.axis)
        if _separate_dropout(operands):
            y = _apply_dropout(y, operands.dropout, seed, offset)
        y = delivered(y, out)
    return (y, lse) if return_lse else y


def remembered_call(x, dy, lse, bias, mask, scale, causal, diagonal, dropout, axis, return_lse=False):
    """The call of fused_softmax (dy None) or fused_softmax_backward on arrays of these
    arrays' layout (auto policy, no out) as remembered, replayed through its run_at; or None."""
    if dy is None:
        return _launches.find(call_key(("forward", "auto", scale, causal, diagonal, dropout, axis, return_lse),
                                       (x, bias, mask, None)))
    return _launches.find(call_key(("backward", "auto", scale, causal, diagonal, dropout, axis),
                                   (x, dy, lse, bias, mask, None)))


def fused_softmax_backward(dy, x, lse, *, scale=1.0, bias=None, mask=None, causal=False, diagonal=0,
                           dropout=0.0, seed=0, offset=0, axis=-1, out=None, policy: str = "auto",
                           stream=None):
    """dx, the gradient of fused_softmax w.r.t. x, from dy, x and the forward's lse.

    Recomputes p = exp(x * scale + bias - lse) (0 where masked) and the dropout mask from
    (seed, offset); pass the forward's arguments. torch: ``torch.autograd.grad(y, x, dy)``
    of the forward's expression. The gradient w.r.t. bias is dx / scale summed over the axes
    bias was broadcast along: bias_gradient(dx, bias.shape, scale).
    """
    key = call_key(("backward", policy, scale, causal, diagonal, dropout, axis),
                   (x, dy, lse, bias, mask, out))
    call = _launches.find(key)
    if call is not None and writable(out, (x, dy, lse, bias, mask), in_place=False):
        read = (x, dy, bias, mask)
        return call.run(read, out, lse, seed, offset) if stream is None else \
            run_on(stream, call.run, read, out, lse, seed, offset)

    arrays.check_policy(policy)
    import cupy

    with arrays.on_device(arrays.as_cupy(x, "x"), stream):
        operands = prepare(x, scale=scale, bias=bias, mask=mask, causal=causal, diagonal=diagonal,
                           dropout=dropout, axis=axis)
        caller, x = (x, dy, lse, bias, mask), operands.x
        dy = arrays.as_cupy(dy, "dy")
        if dy.shape != _restore_axis(x, operands.axis).shape or dy.dtype != x.dtype:
            raise ValueError(f"dy must match x ({x.dtype} {x.shape}), got {dy.dtype} {dy.shape}")
        if _separate_dropout(operands):
            dy = _apply_dropout(dy, operands.dropout, seed, offset)
        dy = cupy.ascontiguousarray(cupy.moveaxis(dy, operands.axis, -1))
        lse = arrays.as_cupy(lse, "lse")
        if lse.shape != x.shape[:-1]:
            raise ValueError(f"lse must have shape {x.shape[:-1]} (x's without the reduced axis), got {lse.shape}")
        lse = cupy.ascontiguousarray(lse, dtype=numpy.float32)
        dx = _writable_out(out, x, operands, x, dy, lse, operands.bias, operands.mask)
        if x.size:
            main = stage_launch("backward", operands, policy, dx, dy)
            main.run((*map(address, stage_inputs(x, dy, operands)), dx.data.ptr, lse.data.ptr), seed, offset)
            _remember(key, operands, caller, (x, dy, lse, operands.bias, operands.mask), dx, out, main)
        return delivered(_restore_axis(dx, operands.axis), out)


def bias_gradient(dx, bias_shape: tuple, scale=1.0):
    """d(loss)/d(bias) from fused_softmax_backward's dx: dx / scale summed over the axes bias
    was broadcast along (numpy: ``(dx / scale).sum(axes).reshape(bias_shape)``)."""
    bias_shape = tuple(bias_shape)
    lead = dx.ndim - len(bias_shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, size in enumerate(bias_shape)
                                      if size == 1 and dx.shape[lead + i] != 1)
    accumulate = numpy.float64 if dx.dtype == numpy.float64 else numpy.float32
    return (dx.sum(axis=axes, dtype=accumulate) / accumulate(scale)).astype(dx.dtype).reshape(bias_shape)


def _mask_launch(size: int, threshold: int, device_id: int) -> StageLaunch:
    """The dropout-mask kernel ready for `size` elements on GPU `device_id` (memoised)."""
    key = ("dropout_mask", size, threshold, device_id)
    found = _launches.peek(key)
    if found is None:
        grid = get_num_blocks(Target.live(device_id).facts, MASK_BLOCK_SIZE, -(-size // MASK_BLOCK_SIZE))
        found = StageLaunch(live_function(DropoutMaskSpec(), device_id), (grid,), (MASK_BLOCK_SIZE,), 0, 1,
                            (numpy.int64(size),), numpy.uint32(threshold))
        _launches.put(key, found)
    return found


def dropout_mask(shape, p, seed, offset=0):
    """The boolean keep mask (cupy) of an array of `shape` that fused_softmax applies
    (cupyops.philox.keep_mask_reference on the host; torch: none, its masks depend on the launch)."""
    threshold = philox.dropout_threshold(p)
    keep = (callcache.empty or callcache.cupy_module().ndarray)(tuple(shape), numpy.bool_)
    if keep.size:
        _mask_launch(keep.size, threshold, keep.data.device_id).run((keep.data.ptr,), seed, offset)
    return keep
