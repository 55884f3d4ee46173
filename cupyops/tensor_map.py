"""Tensor maps for the bulk tensor copy engine (TMA, compute capability 9.0+):
the 128-byte descriptors kernels take as ``const __grid_constant__`` parameters
(kernels/tma.cuh), encoded by the CUDA driver's cuTensorMapEncodeTiled and
cuTensorMapEncodeIm2col, called through ctypes (CuPy does not wrap them).

Each encoder returns a one-element structured array, which CuPy passes to a
kernel by value like any struct parameter. Dimensions and strides are given
innermost first, in elements and bytes, as the driver takes them."""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy

MAP_DTYPE = numpy.dtype([("opaque", "<u8", (16,))])   # CUtensorMap: 128 bytes, 64-byte aligned
UINT8 = 0                     # CU_TENSOR_MAP_DATA_TYPE_UINT8
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}   # swizzle span in bytes -> CU_TENSOR_MAP_SWIZZLE_*
L2_PROMOTION_128B = 2         # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
MAX_BOX = 256                 # elements of a box along one dimension, pixels of an im2col column
# Drivers up to 13.1 encode maps of tensors below 128 KB with a flag that must be
# cleared (bit 21 of the second word), as CUTLASS does.
SMALL_TENSOR_BYTES = 1 << 17
SMALL_TENSOR_FIXED_AFTER = 13010
SMALL_TENSOR_FLAG = 1 << 21


@dataclass(frozen=True)
class Tensor:
    """A uint8 tensor of `dims` (innermost first) with byte `strides` for dims 1..
    (dim 0's is the element size)."""
    dims: tuple
    strides: tuple

    @property
    def tensor_bytes(self) -> int:
        """Bytes from the first element to one past the last."""
        return self.dims[0] + sum((d - 1) * s for d, s in zip(self.dims[1:], self.strides))


@dataclass(frozen=True)
class Im2colLayout(Tensor):
    """The arguments of cuTensorMapEncodeIm2col besides the address: the tensor
    (channels innermost, then the spatial dims, then the outermost); the box corners
    of the spatial dims; channels and pixels a copy moves; each dim's traversal stride."""
    lower_corner: tuple
    upper_corner: tuple
    channels: int
    pixels: int
    element_strides: tuple
    swizzle: int              # bytes


@dataclass(frozen=True)
class TiledLayout(Tensor):
    """The arguments of cuTensorMapEncodeTiled besides the address: the tensor, the box."""
    box: tuple
    swizzle: int              # bytes


@functools.lru_cache(maxsize=1)
def _driver():
    library = ctypes.CDLL("libcuda.so.1")
    u64p, i32p, u32p = (ctypes.POINTER(t) for t in (ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint32))
    library.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    library.cuTensorMapEncodeIm2col.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, i32p, i32p,
        ctypes.c_uint32, ctypes.c_uint32, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    version = ctypes.c_int(0)
    library.cuDriverGetVersion(ctypes.byref(version))
    return library, version.value


def _array(ctype, values):
    return (ctype * len(values))(*values)


def _finish(raw: ctypes.Array, result: int, what: str, tensor_bytes: int, driver_version: int) -> numpy.ndarray:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")
    words = numpy.frombuffer(bytes(raw), dtype="<u8")[:16].copy()
    if driver_version <= SMALL_TENSOR_FIXED_AFTER and tensor_bytes < SMALL_TENSOR_BYTES:
        words[1] &= ~numpy.uint64(SMALL_TENSOR_FLAG)
    record = numpy.zeros(1, dtype=MAP_DTYPE)
    record["opaque"][0] = words
    return record


def _aligned_buffer():
    """A 64-byte aligned, 128-byte ctypes buffer (the driver requires the alignment)."""
    raw = (ctypes.c_uint8 * 192)()
    skip = -ctypes.addressof(raw) % 64
    return raw, ctypes.addressof(raw) + skip, skip


def encode_tiled(address: int, layout: TiledLayout) -> numpy.ndarray:
    """A tiled tensor map of uint8 `layout` at device `address`."""
    library, version = _driver()
    raw, pointer, skip = _aligned_buffer()
    rank = len(layout.dims)
    result = library.cuTensorMapEncodeTiled(
        pointer, UINT8, rank, address, _array(ctypes.c_uint64, layout.dims),
        _array(ctypes.c_uint64, layout.strides), _array(ctypes.c_uint32, layout.box),
        _array(ctypes.c_uint32, (1,) * rank), 0, SWIZZLES[layout.swizzle], L2_PROMOTION_128B, 0)
    return _finish((ctypes.c_uint8 * 128).from_buffer(raw, skip), result, "cuTensorMapEncodeTiled",
                   layout.tensor_bytes, version)


def encode_im2col(address: int, layout: Im2colLayout) -> numpy.ndarray:
    """An im2col tensor map of uint8 `layout` at device `address`."""
    library, version = _driver()
    raw, pointer, skip = _aligned_buffer()
    result = library.cuTensorMapEncodeIm2col(
        pointer, UINT8, len(layout.dims), address, _array(ctypes.c_uint64, layout.dims),
        _array(ctypes.c_uint64, layout.strides), _array(ctypes.c_int32, layout.lower_corner),
        _array(ctypes.c_int32, layout.upper_corner), layout.channels, layout.pixels,
        _array(ctypes.c_uint32, layout.element_strides), 0, SWIZZLES[layout.swizzle], L2_PROMOTION_128B, 0)
    return _finish((ctypes.c_uint8 * 128).from_buffer(raw, skip), result, "cuTensorMapEncodeIm2col",
                   layout.tensor_bytes, version)
