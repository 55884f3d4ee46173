"""Argument checks of layer_norm / rms_norm and their backward: a clear
exception naming the problem, and the arrays the kernels read."""
from __future__ import annotations

import math

import numpy

from .. import arrays, dtypes


def normalized_axes(x, axis) -> int:
    """Number of trailing axes `axis` names (ValueError if they are not trailing)."""
    axes = arrays.normalize_axes(axis, x.ndim)
    if axes != tuple(range(x.ndim - len(axes), x.ndim)):
        raise ValueError(f"axis {axis!r} must name trailing axes of the {x.ndim}-d input "
                         "(as torch's normalized_shape); move the axes last first")
    if not axes:
        raise ValueError("axis names no axis")
    return len(axes)


def check_like(value, name: str, shape: tuple, dtype, device_id: int):
    """A GPU array of exactly `shape`, `dtype` and device, else a named error."""
    if value is None:
        return None
    value = arrays.as_cupy(value, name)
    if value.dtype != dtype:
        raise TypeError(f"{name} has dtype {value.dtype}, expected {numpy.dtype(dtype)} (the input's)")
    if value.shape != tuple(shape):
        raise ValueError(f"{name} has shape {value.shape}, expected {tuple(shape)}")
    if value.device.id != device_id:
        raise ValueError(f"{name} is on GPU {value.device.id}, the input on GPU {device_id}")
    return value


def check_eps(eps) -> float:
    eps = float(eps)
    if not eps > 0 or math.isinf(eps):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    return eps


def float_input(x, name: str = "x"):
    x = arrays.as_cupy(x, name)
    dtypes.float_type(x.dtype)   # TypeError for anything but float16/bfloat16/float32/float64
    return x


def stats_dtype(dtype) -> numpy.dtype:
    """The dtype of mean / rstd: the compute type of `dtype`."""
    return dtypes.DTYPE_OF_SHORT[dtypes.float_type(dtype).compute]


def check_stat(value, name: str, rows: int, dtype, device_id: int):
    """mean / rstd as the kernels read them: contiguous [rows] of `dtype`
    (a view of `value` where it already is, else a copy)."""
    import cupy

    value = arrays.as_cupy(value, name)
    if value.dtype.kind != "f":
        raise TypeError(f"{name} has dtype {value.dtype}, expected floating point")
    if value.size != rows:
        raise ValueError(f"{name} has {value.size} elements, expected one per row ({rows})")
    if value.device.id != device_id:
        raise ValueError(f"{name} is on GPU {value.device.id}, the input on GPU {device_id}")
    return cupy.ascontiguousarray(value.reshape(rows), dtype=dtype)
