"""NCHW32 layouts, the packed filter, convolution geometry and the kernel
parameter block (with the host-computed tap table) of the int8 implicit-GEMM
convolution, and the checks of a call's arrays. Layout helpers work on NumPy
and CuPy arrays alike."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy

from .. import arrays
from ..launch import fast_divisor

INTERLEAVE = 32          # channels a group of NCHW32 holds
STEP_CHUNKS = 2          # 32-channel chunks of GEMM_K a pipeline stage holds (64 bytes)
MAX_TAPS = 128           # FH * FW the parameter block's tap table holds (kernels/conv_int8.cuh)

# kernels/conv_int8.cuh, ConvParams, in order.
_INT_FIELDS = ("n", "c32", "h", "w", "k32", "oh", "ow", "stride_h", "stride_w", "pad_h", "pad_w",
               "gemm_m", "gemm_n", "taps", "k_steps", "steps_per_split", "splits")
_EPILOGUE_FIELDS = ([(name, "<i4") for name in ("out_kind", "bias_kind", "relu", "has_z", "alpha_per_channel")]
                    + [(name, "<f4") for name in ("alpha", "beta", "gamma")])   # ConvEpilogue
PARAMS_DTYPE = numpy.dtype(
    [(name, "<i4") for name in _INT_FIELDS] + [("ohw_multiplier", "<u4"), ("ohw_shift", "<i4")]
    + _EPILOGUE_FIELDS + [(name, "<i4", (MAX_TAPS,)) for name in ("tap_offset", "tap_dh", "tap_dw")])
OUT_KINDS = {"int8": 0, "float16": 1, "float32": 2, "int32": 3}
BIAS_KINDS = {None: 0, "float32": 1, "int32": 2}


def _module(array):
    """numpy or cupy, whichever holds `array`."""
    if isinstance(array, numpy.ndarray):
        return numpy
    import cupy

    return cupy


def pair(value, name: str) -> tuple:
    """An int or a pair of ints -> (height, width)."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    try:
        items = tuple(operator.index(v) for v in items)
    except TypeError:
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if len(items) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return items


def to_nchw32(x_nchw):
    """(N, C, H, W) -> (N, ceil(C/32), H, W, 32), C padded with zeros to a multiple of 32.

    The layout the int8 convolution reads and writes (MegEngine's NCHW32);
    torch has no equivalent (``torch.channels_last`` groups all channels)."""
    xp = _module(x_nchw)
    if x_nchw.ndim != 4:
        raise ValueError(f"to_nchw32 takes an (N, C, H, W) array, got shape {x_nchw.shape}")
    n, c, h, w = x_nchw.shape
    groups = -(-c // INTERLEAVE)
    padded = xp.zeros((n, groups * INTERLEAVE, h, w), dtype=x_nchw.dtype)
    padded[:, :c] = x_nchw
    return xp.ascontiguousarray(padded.reshape(n, groups, INTERLEAVE, h, w).transpose(0, 1, 3, 4, 2))


def from_nchw32(y, channels=None):
    """(N, C/32, H, W, 32) -> (N, C, H, W), keeping the first `channels` channels (default all)."""
    xp = _module(y)
    if y.ndim != 5 or y.shape[4] != INTERLEAVE:
        raise ValueError(f"from_nchw32 takes an (N, C/32, H, W, 32) array, got shape {y.shape}")
    n, groups, h, w, _ = y.shape
    total = groups * INTERLEAVE
    channels = total if channels is None else operator.index(channels)
    if not 0 < channels <= total:
        raise ValueError(f"channels must be in 1 .. {total}, got {channels}")
    return xp.ascontiguousarray(y.transpose(0, 1, 4, 2, 3).reshape(n, total, h, w)[:, :channels])


def pack_conv_filter(w_kcrs):
    """int8 (K, C, R, S) -> the convolution's filter layout (K, ceil(C/32), R, S, 32).

    C is padded with zeros like :func:`to_nchw32` pads the input; K must be a
    multiple of 32 (the output is NCHW32). Each output channel's row is then
    GEMM_K = C * R * S contiguous bytes in the order the kernel accumulates:
    channel group, filter row, filter column, 32 channels."""
    xp = _module(w_kcrs)
    if w_kcrs.ndim != 4:
        raise ValueError(f"pack_conv_filter takes a (K, C, R, S) array, got shape {w_kcrs.shape}")
    if w_kcrs.dtype != numpy.int8:
        raise TypeError(f"pack_conv_filter takes int8 weights, got {w_kcrs.dtype}")
    k, c, r, s = w_kcrs.shape
    if k % INTERLEAVE:
        raise ValueError(f"the filter has K = {k} output channels, not a multiple of 32: pad them "
                         "(outputs are NCHW32, see to_nchw32)")
    groups = -(-c // INTERLEAVE)
    padded = xp.zeros((k, groups * INTERLEAVE, r, s), dtype=numpy.int8)
    padded[:, :c] = w_kcrs
    return xp.ascontiguousarray(padded.reshape(k, groups, INTERLEAVE, r, s).transpose(0, 1, 3, 4, 2))


@dataclass(frozen=True)
class ConvGeometry:
    """One convolution's sizes: input (n, c, h, w), filter (k, c, r, s), stride, padding, dilation."""
    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    stride: tuple = (1, 1)
    padding: tuple = (0, 0)
    dilation: tuple = (1, 1)

    @property
    def oh(self) -> int:
        return (self.h + 2 * self.padding[0] - self.dilation[0] * (self.r - 1) - 1) // self.stride[0] + 1

    @property
    def ow(self) -> int:
        return (self.w + 2 * self.padding[1] - self.dilation[1] * (self.s - 1) - 1) // self.stride[1] + 1

    @property
    def gemm(self) -> tuple:
        """(GEMM_M, GEMM_N, GEMM_K) = (K, N * OH * OW, C * R * S)."""
        return self.k, self.n * self.oh * self.ow, self.c * self.r * self.s

    @property
    def k_steps(self) -> int:
        """64-byte steps of GEMM_K (the last one half full when the chunks are odd)."""
        return -(-(self.c // INTERLEAVE) * self.r * self.s // STEP_CHUNKS)

    @property
    def output_shape(self) -> tuple:
        return (self.n, self.k // INTERLEAVE, self.oh, self.ow, INTERLEAVE)

    @property
    def ops(self) -> int:
        """Multiply-adds counted twice: 2 * GEMM_M * GEMM_N * GEMM_K."""
        m, n, k = self.gemm
        return 2 * m * n * k

    def key(self) -> str:
        """The shape as a tuner key: input, filter, stride, padding, dilation."""
        return (f"n{self.n}c{self.c}h{self.h}w{self.w}_k{self.k}r{self.r}s{self.s}_st{self.stride[0]}x"
                f"{self.stride[1]}_pad{self.padding[0]}x{self.padding[1]}_dil{self.dilation[0]}x{self.dilation[1]}")

    def check(self) -> None:
        """ValueError where the kernel cannot run this convolution."""
        if self.c % INTERLEAVE or self.k % INTERLEAVE:
            raise ValueError(f"C = {self.c} and K = {self.k} must be multiples of 32: pad them with "
                             "to_nchw32 / pack_conv_filter")
        if min(self.stride) < 1 or min(self.dilation) < 1 or min(self.padding) < 0:
            raise ValueError(f"stride {self.stride} and dilation {self.dilation} must be positive, "
                             f"padding {self.padding} not negative")
        if self.oh < 1 or self.ow < 1:
            raise ValueError(f"w: the {self.r}x{self.s} filter (dilation {self.dilation}) does not fit "
                             f"the {self.h}x{self.w} input padded by {self.padding}")
        if self.r * self.s > MAX_TAPS:
            raise ValueError(f"w: a {self.r}x{self.s} filter has more than {MAX_TAPS} taps")
        if self.c * self.h * self.w >= 2**31 or self.c * self.r * self.s >= 2**31:
            raise ValueError("x: one image (C * H * W) and w: one filter (C * R * S) must each hold "
                             "fewer than 2**31 elements")


def tap_table(geometry: ConvGeometry) -> tuple:
    """Per filter tap (fh, fw), fh-major: the byte offset of its input pixel from
    the output pixel's origin (ih0, iw0) in one channel group, and (fh * dh, fw * dw)."""
    dh, dw = geometry.dilation
    fh, fw = numpy.divmod(numpy.arange(geometry.r * geometry.s), geometry.s)
    rows, cols = fh * dh, fw * dw
    return (rows * geometry.w + cols) * INTERLEAVE, rows, cols


def kernel_params(geometry: ConvGeometry, *, splits: int = 1, steps_per_split: int = 0,
                  out_dtype: str = "int8", bias_kind=None, relu: bool = False, has_z: bool = False,
                  alpha_per_channel: bool = False, alpha: float = 1.0, beta: float = 1.0,
                  gamma: float = 0.0) -> numpy.ndarray:
    """The kernel's ConvParams as a one-element structured array (passed by value)."""
    params = numpy.zeros(1, dtype=PARAMS_DTYPE)
    record = params[0]
    g = geometry
    values = dict(n=g.n, c32=g.c // INTERLEAVE, h=g.h, w=g.w, k32=g.k // INTERLEAVE, oh=g.oh, ow=g.ow,
                  stride_h=g.stride[0], stride_w=g.stride[1], pad_h=g.padding[0], pad_w=g.padding[1],
                  gemm_m=g.k, gemm_n=g.gemm[1], taps=g.r * g.s, k_steps=g.k_steps,
                  steps_per_split=steps_per_split or g.k_steps, splits=splits,
                  out_kind=OUT_KINDS[out_dtype], bias_kind=BIAS_KINDS[bias_kind], relu=int(relu),
                  has_z=int(has_z), alpha_per_channel=int(alpha_per_channel),
                  alpha=alpha, beta=beta, gamma=gamma)
    ohw = g.oh * g.ow
    if ohw > 1:   # the epilogue's pixel -> (image, rest) by a multiply (kernels/common.cuh, fast_quotient)
        values["ohw_multiplier"], values["ohw_shift"] = fast_divisor(ohw)
    for name, value in values.items():
        record[name] = value
    offsets, rows, cols = tap_table(g)
    taps = g.r * g.s
    record["tap_offset"][:taps] = offsets
    record["tap_dh"][:taps] = rows
    record["tap_dw"][:taps] = cols
    return params


# -- a call's arrays ------------------------------------------------------------

def nchw32_operand(array, name: str, hint: str):
    """A contiguous, 16-byte aligned int8 (., ., ., ., 32) CuPy array (copied where it is not)."""
    array = arrays.as_cupy(array, name)
    if array.dtype != numpy.int8:
        raise TypeError(f"{name} must be int8, got {array.dtype}")
    if array.ndim != 5 or array.shape[4] != INTERLEAVE:
        raise ValueError(f"{name} has shape {array.shape}; {hint}")
    if not array.flags.c_contiguous or array.data.ptr % 16:
        array = array.copy()   # C-contiguous, freshly allocated: aligned
    return array


def channel_vector(value, name: str, k: int, dtypes_: tuple, device_id: int):
    """A contiguous (K,) CuPy vector of one of `dtypes_`, on `device_id`."""
    import cupy

    value = arrays.as_cupy(value, name)
    if value.dtype not in dtypes_:
        raise TypeError(f"{name} must be {' or '.join(str(numpy.dtype(d)) for d in dtypes_)}, got {value.dtype}")
    if value.shape != (k,):
        raise ValueError(f"{name} has shape {value.shape}, expected ({k},): one value per output channel")
    if value.device.id != device_id:
        raise ValueError(f"{name} is on GPU {value.device.id}, x on GPU {device_id}")
    return cupy.ascontiguousarray(value)


def check_out(out, shape: tuple, dtype, device_id: int):
    """`out` checked for the call (arrays.check_out), C-contiguous and 16-byte aligned; or None."""
    out = arrays.check_out(out, shape, dtype, device_id)
    if out is not None and (not out.flags.c_contiguous or out.data.ptr % 16):
        raise ValueError("out must be C-contiguous and 16-byte aligned")
    return out
