"""Running a row-wise kernel on arrays of any shape, axis and strides.

A row-wise kernel sees each input and the output as `rows` rows of `cols`
contiguous elements, each operand with its own row stride. When the reduced
axes are the trailing ones and the arrays already have that layout, the
kernel reads and writes them in place; otherwise the inputs are copied to a
contiguous layout with the reduced axes last and the result moved back.
An output the kernel cannot write in place (another layout, or overlapping
what the kernel reads other than by holding an input's very elements) gets
the result through a fresh array.
"""
from __future__ import annotations

from dataclasses import dataclass

from .arrays import row_layout
from .callcache import delivered, writable


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


def run(inputs: list, axes: tuple, out, result_dtype, launch, shared: tuple = ()):
    """Calls launch(input_operands, output_operand, rows, cols) once and returns the result.

    `out` (already validated for shape, dtype and device) is written when given.
    `shared`: arrays every row reads besides its own (a weight, a bias; None
    entries ignored), which an `out` written directly must not overlap.
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
            if layout is None or layout[2] < cols or not writable(out, inputs) or \
                    not writable(out, shared, in_place=False):
                target = None   # compute into a fresh array, then copy into out
        if target is None:
            target = cupy.empty(shape, result_dtype)
            layout = (rows, cols, cols)
        launch(operands, Operand(target, layout[2]), rows, cols)
        return delivered(target, out)

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
