"""A fused softmax call's operands as its kernels read them: what the call fuses
(Fusion), x with the reduced axis last, bias and mask in their own broadcast
shape, and the kernels' geometry arguments (leading dims merged, strides, the
magic numbers of a row's divisions, the order the rows are taken in)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy

from .. import arrays, dtypes, philox
from ..launch import fast_divisor

MAX_LEADING_DIMS = 3          # x's leading dims the kernels decompose a row into (after merging)
# rows (or bias / mask elements) from which a row's index no longer divides by kernels/common.cuh's
# fast_quotient (or an operand's offsets need 64 bits)
WIDE_ROWS = 2 ** 31


@dataclass(frozen=True)
class Fusion:
    """What a call fuses, as its kernels are instantiated for it; entries: those of
    x's outermost leading dim whose rows the kernels may take in turn (bias_entries;
    1: none); bias_align, mask_align: the bytes (a power of two up to 16) dividing
    the operand's address and leading strides where its column stride is 1 (0: no
    such operand, or one broadcast along the columns); wide_operands: a bias or mask
    of WIDE_ROWS elements or more."""
    bias_dtype: str = ""
    mask: bool = False
    causal: bool = False
    dropout: bool = False
    entries: int = 1
    bias_align: int = 0
    mask_align: int = 0
    wide_operands: bool = False


@dataclass
class Operands:
    """A call's arrays with x's reduced axis last and contiguous, and the
    broadcast geometry the kernels read bias and mask through."""
    x: object
    bias: object
    mask: object
    fusion: Fusion
    scale: float
    dropout: float
    diagonal: int
    axis: int                 # x's reduced axis in the caller's layout
    geometry: tuple = ()      # the kernels' size / stride / causal arguments

    @property
    def rows(self) -> int:
        return self.x.size // self.cols

    @property
    def cols(self) -> int:
        return self.x.shape[-1]


def _broadcast_operand(value, name: str, x, kinds: str, last_axis: int):
    """value as a contiguous CuPy array in its own shape (x's rank, the reduced axis last)."""
    import cupy

    if value is None:
        return None
    value = arrays.as_cupy(value, name)
    floating = value.dtype in dtypes.BY_DTYPE     # bfloat16's kind is "V"
    if (kinds == "f" and not floating) or (kinds != "f" and value.dtype.kind not in kinds):
        wanted = "bool" if kinds == "b" else "a float dtype"
        raise TypeError(f"{name} must have {wanted}, got {value.dtype}")
    if value.device.id != x.device.id:
        raise ValueError(f"{name} is on GPU {value.device.id}, x on GPU {x.device.id}")
    try:
        shape = numpy.broadcast_shapes(value.shape, x.shape)
    except ValueError:
        shape = None
    if shape != x.shape:
        raise ValueError(f"{name} of shape {value.shape} does not broadcast to x's shape {x.shape}")
    value = value.reshape((1,) * (x.ndim - value.ndim) + value.shape)
    return cupy.ascontiguousarray(cupy.moveaxis(value, last_axis, -1))


def broadcast_strides(shape: tuple, x_shape: tuple) -> tuple:
    """Element strides of a C-contiguous array of `shape` (x's rank) broadcast to x_shape."""
    strides, step = [], 1
    for size, target in zip(reversed(shape), reversed(x_shape)):
        strides.append(step if size == target else 0)
        step *= size
    return tuple(reversed(strides))


def geometry(x_shape: tuple, bias_shape, mask_shape, causal_rows: int, diagonal: int):
    """The kernels' (size0..2, bias strides 0..2 + column, mask strides 0..2 + column,
    causal_rows, diagonal) for contiguous operands of these shapes (x's rank; None: absent):
    x's leading dims merged where every operand allows, outermost padded with 1.
    None where more than MAX_LEADING_DIMS remain."""
    present = [shape for shape in (bias_shape, mask_shape) if shape is not None]
    strides = [broadcast_strides(shape, x_shape) for shape in present]
    merged = []
    for d, size in enumerate(x_shape[:-1]):
        if size == 1:
            continue
        dim_strides = [s[d] for s in strides]
        if merged and all(outer == inner * size for outer, inner in zip(merged[-1][1], dim_strides)):
            merged[-1] = (merged[-1][0] * size, dim_strides)
        else:
            merged.append((size, dim_strides))
    if len(merged) > MAX_LEADING_DIMS:
        return None
    merged = [(1, [0] * len(present))] * (MAX_LEADING_DIMS - len(merged)) + merged
    per_operand, index = [], 0
    for shape in (bias_shape, mask_shape):
        if shape is None:
            per_operand += [0] * (MAX_LEADING_DIMS + 1)
        else:
            per_operand += [dim[1][index] for dim in merged] + [strides[index][-1]]
            index += 1
    return (*(dim[0] for dim in merged), *per_operand, causal_rows, diagonal)


def _magic(divisor: int, rows: int) -> int:
    """The kernels' magic number for dividing a row index by `divisor`: multiplier << 32 |
    shift; 0 for a divisor of 1 (the kernels take the row itself) and where rows reach
    WIDE_ROWS (the kernels then divide)."""
    multiplier, shift = fast_divisor(divisor) if divisor > 1 and rows < WIDE_ROWS else (0, 0)
    return multiplier << 32 | shift


def division_magics(rows: int, layout: tuple) -> tuple:
    """The magic numbers of a row's divisions by size1, size2 and causal_rows of `layout`
    (geometry's tuple)."""
    return tuple(_magic(d, rows) for d in (layout[1], layout[2], layout[-2]))


def bias_entries(layout: tuple) -> int:
    """The entries of x's outermost leading dim (of `layout`, geometry's tuple) where a bias is
    broadcast along that dim and varies along the inner ones, each entry reading the same bias
    (an (H, S, S) bias over (B, H, S, S) scores: B); 1 for any other layout. Taken in order,
    rows read such a bias once an entry; RowOrder (kernels/fused_softmax.cuh) can take the
    entries' rows in turn instead."""
    sizes, bias_strides = layout[:MAX_LEADING_DIMS], layout[MAX_LEADING_DIMS:2 * MAX_LEADING_DIMS]
    outer = next((d for d, size in enumerate(sizes) if size > 1), None)
    if outer is None or bias_strides[outer] != 0 or not any(bias_strides[outer + 1:]):
        return 1
    return sizes[outer]


def operand_alignments(layout: tuple, bias_address, bias_itemsize: int, mask_address) -> tuple:
    """Fusion's (bias_align, mask_align) of contiguous operands in their own shape at these
    addresses (None: absent), read through `layout` (geometry's tuple)."""
    def align(address, itemsize, strides):
        if address is None or strides[-1] != 1:
            return 0
        return arrays.alignment(address, *(stride * itemsize for stride in strides[:-1]))

    per_operand = MAX_LEADING_DIMS + 1
    bias_strides = layout[MAX_LEADING_DIMS:MAX_LEADING_DIMS + per_operand]
    mask_strides = layout[MAX_LEADING_DIMS + per_operand:MAX_LEADING_DIMS + 2 * per_operand]
    return align(bias_address, bias_itemsize, bias_strides), align(mask_address, 1, mask_strides)


def row_order(rows: int, entries: int) -> tuple:
    """RowOrder's arguments (outer, inner, magic) for rows interleaving `entries` entries."""
    return entries, rows // entries, _magic(entries, rows)


def prepare(x, *, scale, bias, mask, causal, diagonal, dropout, axis) -> Operands:
    """Checks a call's arguments (TypeError / ValueError naming the argument) and lays them out."""
    import cupy

    x = arrays.as_cupy(x, "x")
    ftype = dtypes.float_type(x.dtype)
    if x.ndim == 0:
        raise ValueError("x must have at least one axis")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    dropout = philox.check_dropout(dropout, "dropout")
    (axis,) = arrays.normalize_axes(axis, x.ndim)
    if causal and (axis != x.ndim - 1 or x.ndim < 2):
        raise ValueError("causal needs x of at least 2 axes reduced over its last (axis=-1)")
    bias = _broadcast_operand(bias, "bias", x, "f", axis)
    mask = _broadcast_operand(mask, "mask", x, "b", axis)
    if bias is not None and (ftype.compute == "f64" and bias.itemsize == 2):
        bias = bias.astype(numpy.float64)   # 16-bit bias converts in float32 kernels only
    x = cupy.ascontiguousarray(cupy.moveaxis(x, axis, -1))
    # Dropout's counter is the element's index in x: the kernels apply it where
    # that is theirs (the reduced axis last); other axes take it as a separate pass.
    fusion = Fusion(bias_dtype=dtypes.BY_DTYPE[bias.dtype].short if bias is not None else "",
                    mask=mask is not None, causal=bool(causal), dropout=dropout > 0 and axis == x.ndim - 1)
    causal_rows = x.shape[-2] if causal else 1
    layout = geometry(x.shape, *(None if v is None else v.shape for v in (bias, mask)), causal_rows, int(diagonal))
    if layout is None:   # more leading dims than the kernels decompose: read them expanded
        bias, mask = (None if v is None else cupy.ascontiguousarray(cupy.broadcast_to(v, x.shape))
                      for v in (bias, mask))
        layout = geometry(x.shape, *(None if v is None else v.shape for v in (bias, mask)), causal_rows,
                          int(diagonal))
    fusion = with_layout(fusion, layout, *((None, 0, 0) if bias is None else (bias.data.ptr, bias.itemsize, bias.size)),
                         *((None, 0) if mask is None else (mask.data.ptr, mask.size)))
    return Operands(x, bias, mask, fusion, scale, dropout, int(diagonal), axis, layout)


def with_layout(fusion: Fusion, layout: tuple, bias_address, bias_itemsize: int, bias_size: int, mask_address,
                mask_size: int) -> Fusion:
    """`fusion` with what the layout (geometry's tuple) and the operands (contiguous in their
    own shape, at these addresses; None: absent) decide: entries, bias_align, mask_align and
    wide_operands."""
    bias_align, mask_align = operand_alignments(layout, bias_address, bias_itemsize, mask_address)
    wide = any(address is not None and size >= WIDE_ROWS
               for address, size in ((bias_address, bias_size), (mask_address, mask_size)))
    return replace(fusion, entries=bias_entries(layout), bias_align=bias_align, mask_align=mask_align,
                   wide_operands=wide)
