"""The floating types cupyops computes in, and how each is spelled in names and in C."""
from __future__ import annotations

from dataclasses import dataclass

import numpy

try:  # bfloat16 arrays are ml_dtypes.bfloat16, which CuPy 14 understands
    import ml_dtypes
    BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None


@dataclass(frozen=True)
class FloatType:
    short: str      # in kernel names: f16, bf16, f32, f64
    c_type: str     # storage type in device code
    itemsize: int
    compute: str    # short name of the type arithmetic happens in

    @property
    def compute_c_type(self) -> str:
        return BY_SHORT[self.compute].c_type


_TYPES = [
    (numpy.dtype(numpy.float16), FloatType("f16", "cupyops::half_t", 2, "f32")),
    (BFLOAT16, FloatType("bf16", "cupyops::bfloat16_t", 2, "f32")),
    (numpy.dtype(numpy.float32), FloatType("f32", "float", 4, "f32")),
    (numpy.dtype(numpy.float64), FloatType("f64", "double", 8, "f64")),
]
BY_DTYPE = {dtype: ftype for dtype, ftype in _TYPES if dtype is not None}
BY_SHORT = {ftype.short: ftype for ftype in BY_DTYPE.values()}
DTYPE_OF_SHORT = {ftype.short: dtype for dtype, ftype in BY_DTYPE.items()}
NAMES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def parse_dtype(name: str) -> numpy.dtype:
    """'float16' / 'f16' / 'bfloat16' / ... -> the NumPy dtype."""
    short = NAMES.get(name, name)
    if short not in DTYPE_OF_SHORT:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {', '.join(NAMES)}")
    return DTYPE_OF_SHORT[short]


def float_type(dtype) -> FloatType:
    try:
        return BY_DTYPE[numpy.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"unsupported dtype {dtype}; cupyops computes in "
                        "float16, bfloat16, float32 and float64") from None


def result_dtype(dtype: numpy.dtype) -> numpy.dtype:
    """The floating type SciPy's softmax returns for an input dtype (integers -> float64)."""
    dtype = numpy.dtype(dtype)
    if dtype in BY_DTYPE:
        return dtype
    if dtype.kind in "iu":
        return numpy.dtype(numpy.float64)
    if dtype.kind == "b":
        raise TypeError("boolean input is not supported (NumPy cannot subtract booleans)")
    if dtype.kind == "c":
        raise TypeError(f"complex input ({dtype}) is not supported")
    raise TypeError(f"unsupported dtype {dtype}; cupyops computes in "
                    "float16, bfloat16, float32 and float64")
