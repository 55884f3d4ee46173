"""Kernel launches with their arguments laid out once (PackedLaunch).

CuPy's Function call converts every argument on every launch: an object for
each, a numpy view for each scalar, a record for each array. On a small array
that costs more than the launch itself. A PackedLaunch lays a kernel's
arguments out once in a host buffer, the constant ones written there for
good, so that a launch packs only the arguments that change (array
addresses, a dropout offset) with one struct.pack_into and hands the buffer
to the driver (CuPy's driver.launchKernel) on the current stream. The driver
copies the arguments when the launch is queued; a lock keeps two threads
from packing one buffer at once.
"""
from __future__ import annotations

import operator
import struct
import threading

import numpy

POINTER = "Q"     # an argument that changes from launch to launch: an address, 0 for none
SLOT_BYTES = 8    # every argument starts on a multiple of 8 bytes of the buffer
RECORD_ALIGNMENT = 64
CUDA_ERROR_INVALID_CONTEXT = 201
address = operator.attrgetter("data.ptr")   # a cupy.ndarray's POINTER value

# launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra) and
# current_stream() (an object with .ptr): CuPy's, bound with the first PackedLaunch
# (a stand-in may replace them first).
launch_kernel = None
current_stream = None
_driver_error = None


def _bind() -> None:
    global launch_kernel, current_stream, _driver_error
    import cupy
    from cupy_backends.cuda.api import driver

    if launch_kernel is None:
        launch_kernel = driver.launchKernel
    if current_stream is None:
        current_stream = cupy.cuda.get_current_stream
    _driver_error = driver.CUDADriverError


def constant_bytes(value) -> bytes:
    """A constant argument's bytes as CuPy passes it: None a null pointer, a numpy
    scalar its bytes, a host numpy array its bytes (a record passed by value), a
    Python bool, int or float as bool, int64 or float64."""
    if value is None:
        return bytes(SLOT_BYTES)
    if isinstance(value, (numpy.generic, numpy.ndarray)):
        return value.tobytes()
    for kind, as_numpy in ((bool, numpy.bool_), (int, numpy.int64), (float, numpy.float64)):
        if isinstance(value, kind):
            return as_numpy(value).tobytes()
    raise TypeError(f"a kernel argument of type {type(value).__name__} cannot be packed")


# struct formats of scalar arguments by NumPy (kind, itemsize)
_FORMATS = {("b", 1): "?", ("f", 2): "e", ("f", 4): "f", ("f", 8): "d", ("i", 1): "b", ("i", 2): "h",
            ("i", 4): "i", ("i", 8): "q", ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q"}


# the NumPy type of each scalar format (a changing argument as CuPy would be given it)
NUMPY_TYPES = {fmt: numpy.bool_ if kind == "b" else numpy.dtype(f"{kind}{size}").type
               for (kind, size), fmt in _FORMATS.items()}


def format_of(scalar_type) -> str:
    """The struct format of a changing scalar argument of NumPy type `scalar_type`."""
    dtype = numpy.dtype(scalar_type)
    found = _FORMATS.get((dtype.kind, dtype.itemsize))
    if found is None:
        raise TypeError(f"a kernel argument of type {dtype} cannot be packed")
    return found


def _alignment(nbytes: int) -> int:
    """Where an argument of `nbytes` starts in the buffer: records of 64 bytes or more (a
    tensor map) on 64, the rest on 8."""
    return RECORD_ALIGNMENT if nbytes >= RECORD_ALIGNMENT else SLOT_BYTES


class PackedLaunch:
    """One kernel launch (compiled function, grid, block, dynamic shared memory) with
    its arguments `args` in the kernel's order: a struct format string (POINTER, "I",
    "80s", ...) for each argument that changes from launch to launch, the value
    itself for each constant one. Calling it with the changing values, in order,
    launches on the current stream."""
    __slots__ = ("function", "grid", "block", "smem", "args", "head", "buffer", "params", "pack", "lock")

    def __init__(self, function, grid: tuple, block: tuple, smem: int, args: tuple):
        if launch_kernel is None or current_stream is None or _driver_error is None:
            _bind()
        self.function, self.grid, self.block, self.smem, self.args = function, grid, block, smem, args
        dims = tuple(max(1, d) for d in (*(tuple(grid) + (1, 1))[:3], *(tuple(block) + (1, 1))[:3]))
        # launch_kernel's arguments before the stream: the function, grid, block, shared memory
        self.head = (function.ptr, *dims, smem)
        data = {k: constant_bytes(arg) for k, arg in enumerate(args) if not isinstance(arg, str)}
        sizes = [struct.calcsize("=" + arg) if isinstance(arg, str) else len(data[k]) for k, arg in enumerate(args)]
        # the changing values first (one struct format, padded to each one's place), then the
        # constants, then the driver's array of the arguments' addresses
        offsets, layout, end = {}, "=", 0
        for changing in (True, False):
            for k, arg in enumerate(args):
                if isinstance(arg, str) == changing:
                    at = -(-end // _alignment(sizes[k])) * _alignment(sizes[k])
                    if changing:
                        layout += "x" * (at - end) + arg
                    offsets[k], end = at, at + sizes[k]
        values_bytes = -(-end // SLOT_BYTES) * SLOT_BYTES
        total = values_bytes + SLOT_BYTES * len(args)
        storage = numpy.zeros(total + RECORD_ALIGNMENT, dtype=numpy.uint8)
        skip = -storage.ctypes.data % RECORD_ALIGNMENT
        self.buffer = storage[skip:skip + total]
        base = self.buffer.ctypes.data
        for k, constant in data.items():
            self.buffer[offsets[k]:offsets[k] + len(constant)] = numpy.frombuffer(constant, dtype=numpy.uint8)
        addresses = numpy.array([base + offsets[k] for k in range(len(args))], dtype=numpy.uint64)
        self.buffer[values_bytes:] = addresses.view(numpy.uint8)
        self.buffer = memoryview(self.buffer)   # (struct packs into a memoryview a little faster)
        self.params = base + values_bytes
        self.pack = struct.Struct(layout).pack_into
        self.lock = threading.Lock()

    def __call__(self, values: tuple, stream=None) -> None:
        """Launches with the changing arguments `values` on `stream` (None: the current one)."""
        self.launch_on(values, (current_stream() if stream is None else stream).ptr)

    def launch_on(self, values: tuple, stream_ptr: int) -> None:
        """Launches with the changing arguments `values` on the stream at address `stream_ptr`
        (for a caller that has it already)."""
        lock = self.lock
        lock.acquire()      # (acquire and release cost less than a with block)
        try:
            self.pack(self.buffer, 0, *values)
            launch_kernel(*self.head, stream_ptr, self.params, 0)
        except _driver_error as error:   # a thread with no context yet: make CUDA's current
            if error.status != CUDA_ERROR_INVALID_CONTEXT:
                raise
            import cupy

            cupy.cuda.runtime.free(0)
            launch_kernel(*self.head, stream_ptr, self.params, 0)
        finally:
            lock.release()

    def arguments(self, values: tuple) -> tuple:
        """The kernel's arguments of a launch with `values`: `args` with each changing one's value."""
        changing = iter(values)
        return tuple(next(changing) if isinstance(arg, str) else arg for arg in self.args)
