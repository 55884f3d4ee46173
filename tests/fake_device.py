"""A GPU stand-in for the public functions' host path on the CPU: cupy arrays
over fake device memory, kernels recorded rather than run, plans made for
the H100 profile (occupancy from NVRTC compiles). Only paths that launch the
ops' own kernels work: no CuPy kernel (fill, copy, astype) can run. Covers
the row-wise ops, fused softmax and dropout_mask, cupyops.fuse /
cupyops.elementwise and the named elementwise ops."""
from __future__ import annotations

import itertools

import numpy
import pytest

cupy = pytest.importorskip("cupy")

from cupyops import callcache, launch, packed, rowwise  # noqa: E402
from cupyops.callcache import CallCache  # noqa: E402
from cupyops.launch import LaunchCache, Target  # noqa: E402
from cupyops.ops import activations, elementwise, fused_softmax  # noqa: E402
from cupyops.ops import norm, norm_launch, softmax, softmax_axis, softmax_split  # noqa: E402

ALLOCATION_BYTES = 512   # CuPy's pool rounds allocations up to this


class Launch:
    """A launch recorded; packed: made by a packed.PackedLaunch (else by a CuPy Function call)."""

    def __init__(self, name, grid, block, smem, args, packed=False):
        self.name, self.grid, self.block, self.smem, self.args = name, grid, block, smem, args
        self.packed = packed


class FakeFunction:
    ptr = 0

    def __init__(self, spec, launches: list):
        self.name, self._launches = spec.name, launches

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self._launches.append(Launch(self.name, grid, block, shared_mem, args))


class FakeDevice:
    """Installs the stand-in on `monkeypatch` with every memo of the call
    paths fresh (the memos hold fake functions only while it is installed)."""

    def __init__(self, monkeypatch):
        from cupy.cuda import memory

        self._memory = memory
        self._addresses = itertools.count(1 << 24, 1 << 24)
        self.launches: list = []
        self.slow_calls = 0
        self.arrays: dict = {}      # address -> the array made there first
        monkeypatch.setattr(packed.PackedLaunch, "__call__",
                            lambda launch, values, stream=None: self.packed_launch(launch, values))
        monkeypatch.setattr(packed.PackedLaunch, "launch_on",
                            lambda launch, values, stream_ptr: self.packed_launch(launch, values))
        target = Target.profile("h100")
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
        monkeypatch.setattr(cupy, "empty", self.empty)
        callcache.cupy_module()     # binds callcache.empty first: undone, the patch restores cupy's
        monkeypatch.setattr(callcache, "empty", self.empty)
        monkeypatch.setattr(callcache, "empty_on", lambda shape, dtype, device_id, stream_ptr: self.empty(shape, dtype))
        monkeypatch.setattr(callcache, "stream_ptr", lambda: 0)
        monkeypatch.setattr(callcache, "alloc", self.alloc)
        monkeypatch.setattr(launch, "_live_target", lambda device_id: target)
        for module in (softmax, softmax_axis, softmax_split, norm_launch, elementwise, fused_softmax):
            monkeypatch.setattr(module, "live_function",
                                lambda spec, device_id, smem=0: FakeFunction(spec, self.launches))
        for module, name in ((softmax, "_calls"), (norm, "_calls")):
            monkeypatch.setattr(module, name, CallCache())
        for module in (softmax, softmax_axis, softmax_split, fused_softmax):
            monkeypatch.setattr(module, "_launches", LaunchCache())
        monkeypatch.setattr(norm_launch, "_ready_launches", {})
        monkeypatch.setattr(elementwise, "_expressions", {})
        for function in vars(activations).values():
            if isinstance(function, elementwise.FusedFunction):
                monkeypatch.setattr(function, "_launchers", LaunchCache())
        run = rowwise.run

        def counted_run(*args, **options):
            self.slow_calls += 1
            return run(*args, **options)

        monkeypatch.setattr(rowwise, "run", counted_run)

    def array(self, shape, dtype, offset_bytes: int = 0, strides=None):
        """An uninitialised array `offset_bytes` past an allocation's start."""
        dtype = numpy.dtype(dtype)
        size = max(1, int(numpy.prod(shape))) * dtype.itemsize * (2 if strides else 1) + offset_bytes
        owned = self._memory.UnownedMemory(next(self._addresses), size, None, device_id=0)
        made = cupy.ndarray(shape, dtype, self._memory.MemoryPointer(owned, offset_bytes), strides=strides)
        self.arrays.setdefault(made.data.ptr, made)
        return made

    def packed_argument(self, fmt, value):
        """A packed launch's argument as CuPy would be given it: an address of an array made
        here as that array, a scalar as its NumPy type; constants and records as they are."""
        if not isinstance(fmt, str):    # a constant
            return value
        if fmt == packed.POINTER:
            return self.arrays.get(value, numpy.uint64(value))
        return packed.NUMPY_TYPES[fmt](value) if fmt in packed.NUMPY_TYPES else value

    def packed_launch(self, launch, values: tuple) -> None:
        """Records a packed.PackedLaunch as a launch of its function's arguments."""
        args = tuple(self.packed_argument(fmt, value) for fmt, value in zip(launch.args, launch.arguments(values)))
        self.launches.append(Launch(launch.function.name, launch.grid, launch.block, launch.smem, args, True))

    def alloc(self, nbytes: int):
        """A block of `nbytes`, as cupy.cuda.alloc gives it."""
        return self._memory.MemoryPointer(self._memory.UnownedMemory(next(self._addresses), nbytes, None,
                                                                     device_id=0), 0)

    def empty(self, shape, dtype=float, order="C"):
        return self.array(tuple(shape) if isinstance(shape, (tuple, list)) else (shape,), dtype)
