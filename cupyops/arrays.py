"""Input checking and row layouts shared by the public functions."""
from __future__ import annotations

import contextlib
import math
import operator

import numpy
from numpy.exceptions import AxisError

POLICIES = ("auto", "oneflow")


def as_cupy(x, name: str = "x"):
    """A CuPy view of a GPU array (CuPy, or anything with DLPack / __cuda_array_interface__)."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, (numpy.ndarray, numpy.generic, int, float, complex, list, tuple)):
        raise TypeError(f"{name} is a host value ({type(x).__name__}); cupyops works on GPU "
                        f"arrays: pass cupy.asarray({name})")
    if hasattr(x, "__dlpack__"):
        try:
            return cupy.from_dlpack(x)
        except Exception as error:  # e.g. a tensor on the CPU
            if not hasattr(x, "__cuda_array_interface__"):
                raise TypeError(f"{name} ({type(x).__name__}) is not a GPU array: {error}") from None
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(f"{name} ({type(x).__name__}) is not a GPU array: expected a cupy.ndarray or "
                    "an object with __dlpack__ or __cuda_array_interface__")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


def normalize_axes(axis, ndim: int) -> tuple:
    """axis None / int / tuple -> sorted tuple of non-negative axes, as NumPy checks them."""
    if axis is None:
        return tuple(range(ndim))
    items = axis if isinstance(axis, tuple) else (axis,)
    axes = []
    for item in items:
        try:
            index = operator.index(item)
        except TypeError:
            raise TypeError(f"axis must be an integer or a tuple of integers, got {item!r}") from None
        if not -ndim <= index < ndim:
            raise AxisError(index, ndim)
        axes.append(index % ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"duplicate value in axis: {axis!r}")
    return tuple(sorted(axes))


def row_layout(array, num_trailing: int):
    """(rows, cols, row_stride) when `array` is rows of `cols` contiguous elements
    (the last `num_trailing` axes) spaced `row_stride` elements apart; else None."""
    itemsize = array.itemsize
    shape, strides = array.shape, array.strides
    if any(stride % itemsize for stride in strides):
        return None
    lead = len(shape) - num_trailing
    cols = math.prod(shape[lead:])
    expected = itemsize
    for size, stride in zip(reversed(shape[lead:]), reversed(strides[lead:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    rows = math.prod(shape[:lead])
    row_stride, step = None, None
    for size, stride in zip(reversed(shape[:lead]), reversed(strides[:lead])):
        if size == 1:
            continue
        if row_stride is None:
            if stride < 0:
                return None
            row_stride, step = stride, stride * size
        elif stride != step:
            return None
        else:
            step *= size
    return rows, cols, (cols * itemsize if row_stride is None else row_stride) // itemsize


def alignment(*pointers_and_strides: int) -> int:
    """Largest power of two up to 16 dividing every byte address / byte stride given."""
    align = 16
    for value in pointers_and_strides:
        while value % align:
            align //= 2
    return align


def same_phase(*operands) -> bool:
    """Whether every row of every operand (rowwise.Operand) starts at the same
    offset from a 16-byte boundary."""
    first = operands[0]
    return all(op.byte_address % 16 == first.byte_address % 16 and
               op.byte_row_stride % 16 == first.byte_row_stride % 16 for op in operands)


def check_out(out, shape: tuple, dtype, device_id: int, name: str = "out"):
    """Validates a user-supplied output array; returns it (or None)."""
    if out is None:
        return None
    import cupy

    if not isinstance(out, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape):
        raise ValueError(f"{name} has shape {out.shape}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name} has dtype {out.dtype}, expected {numpy.dtype(dtype)}")
    if out.device.id != device_id:
        raise ValueError(f"{name} is on GPU {out.device.id}, the input on GPU {device_id}")
    return out


def on_device(x, stream=None):
    """Context that makes x's GPU current and, when given, `stream` the current stream."""
    import cupy

    if stream is None and x.device.id == cupy.cuda.runtime.getDevice():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(x.device)
    if stream is not None:
        stack.enter_context(stream)
    return stack
