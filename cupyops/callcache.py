"""Whole calls of the public functions memoised: a repeated call on arrays of
one layout costs a key, a dict lookup, its allocations and its launches.

The slow path (argument checks and conversions, the row layout, alignment
and phase, the plan, the compiled function, the scalar arguments cast for the
kernel) runs once for a key and leaves a ready call. A key holds everything
the slow path decides from: the op with its flags and policy, and for each
array its shape, strides, dtype, address modulo 16 (the alignment and phase
the plans depend on: arrays.alignment, arrays.same_phase) and GPU. Only
cupy.ndarray arguments (or None) on the current GPU take the fast path;
anything else goes the slow way, which converts, checks and explains. An
output that overlaps an input other than by being it goes the slow way too
(rowwise.run computes into a fresh array and copies).
"""
from __future__ import annotations

from typing import NamedTuple

from .launch import LaunchCache


class ReadyLaunch(NamedTuple):
    """One kernel launch, ready: the compiled function, grid, block and
    dynamic shared memory."""
    function: object
    grid: tuple
    block: tuple
    smem: int

    def __call__(self, args: tuple) -> None:
        self.function(self.grid, self.block, args, shared_mem=self.smem)


class CallCache(LaunchCache):
    """Ready calls per call key (call_key); a key None never matches."""

    def find(self, key):
        """The ready call of `key`, or None."""
        if key is None:
            return None
        try:
            return self._entries.get(key)
        except TypeError:   # an unhashable argument: the slow path explains it
            return None

    def remember(self, key, call) -> None:
        if key is not None:
            try:
                self.put(key, call)
            except TypeError:
                pass


def call_key(flags: tuple, arrays: tuple):
    """The key of a call: `flags` (op, policy and the arguments besides
    arrays, hashable) and each array's layout (None for None); None when an
    array is neither None nor a cupy.ndarray or the first is not on the
    current GPU."""
    import cupy

    layouts = []
    for array in arrays:
        if array is None:
            layouts.append(None)
        elif type(array) is cupy.ndarray:
            memory = array.data
            layouts.append((array.shape, array.strides, array.dtype, memory.ptr & 15, memory.device_id))
        else:
            return None
    if layouts[0][4] != cupy.cuda.runtime.getDevice():
        return None
    return flags, tuple(layouts)


def writable(out, inputs: tuple) -> bool:
    """Whether a ready call may write `out` (None: a fresh array) directly:
    it is one of `inputs` (None entries ignored) or overlaps none of them."""
    if out is None:
        return True
    import cupy

    for array in inputs:
        if array is not None and array is not out and cupy.may_share_memory(out, array):
            return False
    return True


def run_on(stream, replay, *args):
    """replay(*args) with `stream` (None: the current one) current."""
    if stream is None:
        return replay(*args)
    with stream:
        return replay(*args)
