"""Whole calls of the public functions memoised: a repeated call on arrays of
one layout costs a key, a dict lookup, its allocations and its launches.

The slow path (argument checks and conversions, the row layout, alignment
and phase, the plan, the compiled function, the scalar arguments cast for the
kernel) runs once for a key and leaves a ready call. A key holds everything
the slow path decides from: the op with its flags and policy, and for each
array its shape, strides, dtype, address modulo 16 (the alignment and phase
the plans depend on: arrays.alignment, arrays.same_phase) and GPU. Only
cupy.ndarray arguments (or None) with the first on the current GPU take the
fast path; anything else goes the slow way, which converts, checks and
explains. Since a ready call is remembered only once the slow path has
accepted its arguments, a key found implies they pass every check. An output
that overlaps an input other than by holding its very elements goes the slow
way too (`writable`; the slow path computes into a fresh array and copies it
into the output, `delivered`).

The hit path creates no Python object besides the key and the kernel's
argument tuple: cupy is bound once (`cupy_module`), ready launches are
slotted objects calling the compiled function positionally, outputs are
allocated by `empty` (cupy.ndarray) with a shape and dtype worked out on the
slow path, and workspaces by `alloc` (a bare block of the pool).

Small outputs are recycled (`recycling`): `empty_on` (and `empty`, for the
current GPU and stream) keeps the last two arrays of at most RECYCLE_BYTES it
made for each shape, dtype, GPU and stream, and hands one out again once
nothing but this cache refers to it (its caller dropped it). That is what
CuPy's pool does with the memory of a dropped array -- it serves the next
allocation on the same stream -- without the pool's allocation and free; the
array is its own, C-contiguous, of the shape asked for.
"""
from __future__ import annotations

import sys
import weakref

from .launch import LaunchCache

_cupy = None
# cupy.ndarray and the cupy.cuda.runtime module (its getDevice read at each call, so a
# stand-in's patch of it holds), bound with cupy for the hit paths' keys.
ndarray = None
runtime = None
# empty_on(shape, dtype, device_id, stream_ptr): an array as cupy.empty makes it on that GPU
# for that stream, made by cupy.ndarray (cupy.empty's own Python frame spared) or recycled
# (`recycling`); empty(shape, dtype): the same on the current GPU and stream. Bound with cupy
# (a stand-in may replace them).
empty_on = None
empty = None
# stream_ptr(): the address of the current stream (CuPy's get_current_stream().ptr), bound with cupy.
stream_ptr = None
# alloc(nbytes): a raw block of CuPy's pool (cupy.cuda.alloc, a MemoryPointer) for a
# workspace no array need wrap; bound with cupy (a stand-in may replace it).
alloc = None
# may_share_memory(a, b): whether two arrays' extents overlap, CuPy's bounds test
# called directly (cupy.may_share_memory's Python frame spared); bound with cupy.
may_share_memory = None


def cupy_module():
    """The cupy module, imported on first use (cupyops imports without a GPU
    stack); the hit paths read the global `_cupy` first."""
    global _cupy, ndarray, runtime, empty_on, empty, stream_ptr, alloc, may_share_memory
    if _cupy is None:
        import cupy
        _cupy = cupy
        ndarray, runtime = cupy.ndarray, cupy.cuda.runtime
        if stream_ptr is None:
            stream_ptr = getattr(cupy.cuda.stream, "get_current_stream_ptr",
                                 lambda: cupy.cuda.get_current_stream().ptr)
        if empty_on is None:
            empty_on = recycling(cupy.ndarray)
        if empty is None:
            empty = _on_current(empty_on, runtime.getDevice, stream_ptr)
        if alloc is None:
            alloc = cupy.cuda.alloc
        if may_share_memory is None:
            from cupy._core import _memory_range
            may_share_memory = getattr(_memory_range, "may_share_bounds", cupy.may_share_memory)
    return _cupy


RECYCLE_BYTES = 1 << 18      # outputs no larger are kept for reuse, two per key
RECYCLE_KEYS = 64            # (shape, dtype, GPU, stream) keys kept; past them, start over
_recycled: dict = {}         # key -> [older, newer] arrays (None: no array yet)


def _unshared_count() -> int:
    """sys.getrefcount of an object that a list and one local name alone refer to, read
    as the recycler reads it."""
    kept = [object()]
    held = kept[0]
    return sys.getrefcount(held)


def recycling(make):
    """empty_on(shape, dtype, device_id, stream_ptr) for the hit paths: an array the
    last calls made (by `make(shape, dtype)`) for that GPU and stream that nothing else
    refers to any more, else a new one, kept when small. A held array is told by its
    reference count: the caller's name, a view, an export, a thread checking it at the
    same moment each add one; a weak reference or a changed shape refuse it too.
    Without the GIL (free-threaded Python) the counts are not exact: no recycling there."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return lambda shape, dtype, device_id, stream_ptr: make(shape, dtype)
    kept, getrefcount, weak_references = _recycled, sys.getrefcount, weakref.getweakrefcount
    unshared = _unshared_count()

    def empty_on(shape, dtype, device_id, stream_ptr):
        key = (shape, dtype, device_id, stream_ptr)
        arrays = kept.get(key)
        if arrays is not None:   # the newer slot, then the older (written out: no frame on the hit path)
            held = arrays[1]
            if getrefcount(held) == unshared and not weak_references(held) and held.shape == shape and \
                    held._c_contiguous:
                return held
            held = arrays[0]
            if getrefcount(held) == unshared and not weak_references(held) and held.shape == shape and \
                    held._c_contiguous:
                return held
        array = make(shape, dtype)
        if array.nbytes <= RECYCLE_BYTES:
            if arrays is not None:
                arrays[0], arrays[1] = arrays[1], array
            else:
                if len(kept) >= RECYCLE_KEYS:
                    kept.clear()
                kept[key] = [None, array]
        return array
    return empty_on


def _on_current(empty_on, device, stream):
    """empty(shape, dtype): empty_on for the current GPU (`device()`) and stream (`stream()`)."""
    def empty(shape, dtype):
        return empty_on(shape, dtype, device(), stream())
    return empty


def release_kept_outputs() -> None:
    """Drops the small outputs cupyops keeps for reuse, so that CuPy's pool gets their
    memory back (for `cupy.get_default_memory_pool().free_all_blocks()`, say). No
    NumPy / torch equivalent: torch's caching allocator keeps freed blocks alike."""
    _recycled.clear()


class ReadyLaunch:
    """One kernel launch, ready: the compiled function, grid, block and
    dynamic shared memory; calling it with the argument tuple launches."""
    __slots__ = ("function", "grid", "block", "smem")

    def __init__(self, function, grid: tuple, block: tuple, smem: int):
        self.function, self.grid, self.block, self.smem = function, grid, block, smem

    def __call__(self, args: tuple) -> None:
        self.function(self.grid, self.block, args, self.smem)


# Ready calls per call key (call_key): LaunchCache.find and .remember take a key
# None or unhashable as a miss. One kind of memo, so that a family may keep its
# calls beside its launches (fused_softmax) and every memo empties the same way.
CallCache = LaunchCache


def call_key(flags: tuple, arrays: tuple):
    """The key of a call: `flags` (op, policy and the arguments besides
    arrays, hashable) followed by each array's layout, flat: shape, strides
    (True for a C-contiguous array: the row layout of its shape, whatever the
    strides of its axes of size 1), dtype, address % 16 and GPU of each
    cupy.ndarray, None for None. None when an array is neither, or the first
    is not a cupy.ndarray on the current GPU."""
    if _cupy is None:
        cupy_module()
    first = arrays[0]
    if type(first) is not ndarray or first.data.device_id != runtime.getDevice():
        return None
    key = [flags]
    for array in arrays:
        if array is None:
            key.append(None)
        elif type(array) is ndarray:
            memory = array.data
            key += array.shape, array._c_contiguous or array.strides, array.dtype, memory.ptr & 15, memory.device_id
        else:
            return None
    return tuple(key)


def writable(out, inputs: tuple, in_place: bool = True) -> bool:
    """Whether a call may write `out` (None: a fresh array) directly: it overlaps
    none of `inputs` (None entries ignored), or, with `in_place`, overlaps one
    only by holding its very elements (x = f(x): the same array, or one of its
    shape, dtype and strides at its address)."""
    if out is None:
        return True
    if may_share_memory is None:
        cupy_module()
    for array in inputs:
        if array is not None and (array is not out or not in_place) and may_share_memory(out, array) and \
                not (in_place and same_elements(out, array)):
            return False
    return True


def same_elements(a, b) -> bool:
    """Whether two arrays are views of the very same elements, in the same order."""
    return a.data.ptr == b.data.ptr and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype


def delivered(result, out):
    """`result`, copied into `out` first when one was given and is another array: the
    end of a call that computed into a fresh array where it could not write `out`."""
    if out is None or out is result:
        return result
    out[...] = result
    return out


def run_on(stream, replay, *args):
    """replay(*args) with `stream` (None: the current one) current."""
    if stream is None:
        return replay(*args)
    with stream:
        return replay(*args)
