"""LayerNorm / RMSNorm plans (norm.plan) made ready to run on rows of one
layout: the compiled functions, grids and blocks, and the scalar arguments
cast for the kernels, so a repeated call only allocates and launches."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy

from .. import callcache, dtypes
from ..callcache import ReadyLaunch
from ..launch import KernelLaunch, live_function
from ..packed import POINTER, PackedLaunch

_ready_launches: dict = {}


def ready(launch: KernelLaunch, device_id: int) -> ReadyLaunch:
    """`launch` with its compiled function on GPU `device_id` (memoised)."""
    key = (launch, device_id)
    found = _ready_launches.get(key)
    if found is None:
        function = live_function(launch.spec, device_id, launch.smem_bytes)
        found = _ready_launches[key] = ReadyLaunch(function, launch.grid, launch.block, launch.smem_bytes)
    return found


def _int64s(*values) -> tuple:
    return tuple(map(numpy.int64, values))


def _packed(launch: ReadyLaunch, args: tuple) -> PackedLaunch:
    return PackedLaunch(launch.function, launch.grid, launch.block, launch.smem, args)


class ForwardLaunch(NamedTuple):
    """A forward plan ready for rows of one layout: its kernel with the scalar
    arguments packed (the eight array addresses change from call to call)."""
    main: PackedLaunch


class BackwardLaunch(NamedTuple):
    """A backward plan ready for rows of one layout, each kernel with its scalar
    arguments packed: the kernel writing the weight's phase copies (or None) and
    their elements; the dx kernel and the column reduction (steps: launch, writes
    dx, writes partials); the finish kernel (or None); the elements of one
    gradient's partial sums (parts x cols)."""
    weight_phases: Optional[PackedLaunch]
    phase_copies: int
    steps: tuple
    finish: Optional[PackedLaunch]
    parts_elements: int


def forward_launch(chosen, device_id: int, rows: int, cols: int, ftype: dtypes.FloatType, eps: float,
                   x_stride: int, residual_stride: int, y_stride: int) -> ForwardLaunch:
    """A NormPlan ready for rows of these strides (in elements)."""
    eps = numpy.float64(eps) if ftype.compute == "f64" else numpy.float32(eps)
    scalars = (*_int64s(rows, cols, x_stride, residual_stride, y_stride, cols), eps)
    return ForwardLaunch(_packed(ready(chosen.main, device_id), (POINTER,) * 8 + scalars))


def run_forward(launch: ForwardLaunch, x, residual, weight, bias, y, h, mean, rstd) -> None:
    """Runs a ready forward plan; None for an array not read or not stored."""
    launch.main((x.data.ptr, 0 if residual is None else residual.data.ptr, 0 if weight is None else weight.data.ptr,
                 0 if bias is None else bias.data.ptr, y.data.ptr, 0 if h is None else h.data.ptr,
                 0 if mean is None else mean.data.ptr, 0 if rstd is None else rstd.data.ptr))


def backward_launch(chosen, device_id: int, rows: int, cols: int, dy_stride: int, x_stride: int, dx_stride: int,
                    phase_stride: int) -> BackwardLaunch:
    """A NormGradPlan ready for rows of these strides (in elements);
    `phase_stride`: the elements between the weight's phase copies (0 without them)."""
    phases = chosen.weight_phases
    pack_size = 0 if phases is None else phases.spec.pack_size
    scalars = _int64s(rows, cols, dy_stride, x_stride, dx_stride, chosen.rows_per_chunk, phase_stride)
    steps = tuple((_packed(ready(step, device_id), (POINTER,) * 8 + scalars), step is chosen.main,
                   step.spec.fuse_param_grad or step is not chosen.main)
                  for step in (chosen.main, chosen.param_grad) if step is not None)
    weight_phases = None if phases is None else _packed(
        ready(phases, device_id), (POINTER, numpy.int64(cols), POINTER, numpy.int64(phase_stride)))
    finish = None if chosen.finish is None else _packed(
        ready(chosen.finish, device_id), (POINTER, POINTER, *_int64s(chosen.num_parts, cols), POINTER, POINTER))
    return BackwardLaunch(weight_phases, pack_size * phase_stride, steps, finish, chosen.num_parts * cols)


def run_backward(launch: BackwardLaunch, dy, x, dx, rstd, mean, weight, dweight, dbias) -> None:
    """Runs a ready backward plan: dy, x, dx as the kernels read them, rstd /
    mean (None for RMSNorm) [rows] in the compute type, weight contiguous
    [cols]; dweight / dbias (None unless wanted) [cols]. The weight's phase
    copies and the partial sums of the gradients wanted take one workspace
    each: raw blocks of CuPy's pool (no array around them), freed on return
    once their kernels are queued, as CuPy frees a temporary array."""
    alloc = callcache.alloc or callcache.cupy_module().cuda.alloc
    if launch.weight_phases is not None:
        copies = alloc(launch.phase_copies * weight.itemsize)
        launch.weight_phases((weight.data.ptr, copies.ptr))
        weight = copies.ptr
    else:
        weight = 0 if weight is None else weight.data.ptr
    weight_parts = bias_parts = 0
    if dweight is not None or dbias is not None:
        both = dweight is not None and dbias is not None
        half = launch.parts_elements * rstd.itemsize
        parts = alloc(2 * half if both else half)
        weight_parts = parts.ptr if dweight is not None else 0
        bias_parts = (parts.ptr + half if both else parts.ptr) if dbias is not None else 0
    mean = 0 if mean is None else mean.data.ptr
    for step, writes_dx, writes_parts in launch.steps:
        step((dy.data.ptr, x.data.ptr, weight, mean, rstd.data.ptr, dx.data.ptr if writes_dx else 0,
              weight_parts if writes_parts else 0, bias_parts if writes_parts else 0))
    finish = launch.finish
    if finish is not None:
        finish((weight_parts, bias_parts, 0 if dweight is None else dweight.data.ptr,
                0 if dbias is None else dbias.data.ptr))
