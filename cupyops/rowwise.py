"""Running a row-wise kernel on arrays of any shape, axis and strides.

A row-wise kernel sees each input and the output as `rows` rows of `cols`
contiguous elements, each operand with its own row stride. When the reduced
axes are the trailing ones and the arrays already have that layout, the
kernel reads and writes them in place; otherwise the inputs are copied to a
contiguous layout with the reduced axes last and the result moved back.
"""
from __future__ import annotations

from dataclasses import dataclass

from .arrays import row_layout


@dataclass(frozen=True)
class Operand:
    array: object        # cupy.ndarray
    row_stride: int      # in elements

    @property
    def byte_address(self) -> int:
        return self.array.data.ptr

    @property
    def byte_row_stride(self) -> int:
        return self.row_stride * self.array.itemsize


def run(inputs: list, axes: tuple, out, result_dtype, launch):
    """Calls launch(input_operands, output_operand, rows, cols) once and returns the result.

    `out` (already validated for shape, dtype and device) is written when given.
    """
    import cupy

    shape = inputs[0].shape
    ndim = len(shape)
    num_reduced = len(axes)
    trailing = axes == tuple(range(ndim - num_reduced, ndim))
    layouts = [row_layout(a, num_reduced) for a in inputs] if trailing else [None]

    if all(layout is not None for layout in layouts):
        rows, cols = layouts[0][:2]
        operands = [Operand(a, layout[2]) for a, layout in zip(inputs, layouts)]
        target = out
        if out is not None:
            layout = row_layout(out, num_reduced)
            overlap_ok = all(out.data.ptr == a.data.ptr and out.strides == a.strides for a in inputs
                           if cupy.may_share_memory(out, a))
            if layout is None or layout[2] < cols or not overlap_ok:
                target = None   # compute into a fresh array, then copy into out
        if target is None:
            target = cupy.empty(shape, result_dtype)
            layout = (rows, cols, cols)
        launch(operands, Operand(target, layout[2]), rows, cols)
        if out is not None and target is not out:
            out[...] = target
            return out
        return target

    # Reduced axes moved last in a contiguous copy; the result moved back.
    kept = [i for i in range(ndim) if i not in axes]
    order = kept + list(axes)
    moved = [cupy.ascontiguousarray(a.transpose(order)) for a in inputs]
    rows = 1
    for i in kept:
        rows *= shape[i]
    cols = moved[0].size // rows if rows else 0
    moved_out = cupy.empty(moved[0].shape, result_dtype)
    launch([Operand(a, cols) for a in moved], Operand(moved_out, cols), rows, cols)
    inverse = [order.index(i) for i in range(ndim)]
    result = out if out is not None else cupy.empty(shape, result_dtype)
    result[...] = moved_out.transpose(inverse)
    return result
