"""LayerNorm / RMSNorm plans (norm.plan) made ready to run on rows of one
layout: the compiled functions, grids and blocks, and the scalar arguments
cast for the kernels, so a repeated call only allocates and launches."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy

from .. import callcache, dtypes
from ..callcache import ReadyLaunch
from ..launch import KernelLaunch, live_function

_NULL = numpy.uint64(0)
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


class ForwardLaunch(NamedTuple):
    """A forward plan ready for rows of one layout: its kernel and scalar arguments."""
    main: ReadyLaunch
    scalars: tuple


class BackwardLaunch(NamedTuple):
    """A backward plan ready for rows of one layout: the kernel writing the
    weight's phase copies (or None), their elements and its scalar
    arguments; the dx kernel and the column reduction (steps: launch, writes
    dx, writes partials) and their scalar arguments; the finish kernel (or
    None) and its; the elements of one gradient's partial sums (parts x cols)."""
    weight_phases: Optional[ReadyLaunch]
    phase_copies: int
    phases_scalars: tuple
    steps: tuple
    scalars: tuple
    finish: Optional[ReadyLaunch]
    finish_scalars: tuple
    parts_elements: int


def forward_launch(chosen, device_id: int, rows: int, cols: int, ftype: dtypes.FloatType, eps: float,
                   x_stride: int, residual_stride: int, y_stride: int) -> ForwardLaunch:
    """A NormPlan ready for rows of these strides (in elements)."""
    eps = numpy.float64(eps) if ftype.compute == "f64" else numpy.float32(eps)
    return ForwardLaunch(ready(chosen.main, device_id),
                         (*_int64s(rows, cols, x_stride, residual_stride, y_stride, cols), eps))


def run_forward(launch: ForwardLaunch, x, residual, weight, bias, y, h, mean, rstd) -> None:
    """Runs a ready forward plan; None for an array not read or not stored."""
    main = launch.main
    main.function(main.grid, main.block,
                  (x, _NULL if residual is None else residual, _NULL if weight is None else weight,
                   _NULL if bias is None else bias, y, _NULL if h is None else h, _NULL if mean is None else mean,
                   _NULL if rstd is None else rstd, *launch.scalars), main.smem)


def backward_launch(chosen, device_id: int, rows: int, cols: int, dy_stride: int, x_stride: int, dx_stride: int,
                    phase_stride: int) -> BackwardLaunch:
    """A NormGradPlan ready for rows of these strides (in elements);
    `phase_stride`: the elements between the weight's phase copies (0 without them)."""
    phases = chosen.weight_phases
    pack_size = 0 if phases is None else phases.spec.pack_size
    steps = tuple((ready(step, device_id), step is chosen.main, step.spec.fuse_param_grad or step is not chosen.main)
                  for step in (chosen.main, chosen.param_grad) if step is not None)
    return BackwardLaunch(
        None if phases is None else ready(phases, device_id), pack_size * phase_stride,
        _int64s(cols, phase_stride), steps,
        _int64s(rows, cols, dy_stride, x_stride, dx_stride, chosen.rows_per_chunk, phase_stride),
        None if chosen.finish is None else ready(chosen.finish, device_id), _int64s(chosen.num_parts, cols),
        chosen.num_parts * cols)


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
        weight_copies = numpy.uint64(copies.ptr)
        launch.weight_phases((weight, launch.phases_scalars[0], weight_copies, launch.phases_scalars[1]))
        weight = weight_copies
    weight_parts = bias_parts = _NULL
    if dweight is not None or dbias is not None:
        both = dweight is not None and dbias is not None
        half = launch.parts_elements * rstd.itemsize
        parts = alloc(2 * half if both else half)
        weight_parts = numpy.uint64(parts.ptr) if dweight is not None else _NULL
        bias_parts = numpy.uint64(parts.ptr + half if both else parts.ptr) if dbias is not None else _NULL
    weight = _NULL if weight is None else weight
    mean = _NULL if mean is None else mean
    scalars = launch.scalars
    for step, writes_dx, writes_parts in launch.steps:
        step.function(step.grid, step.block,
                      (dy, x, weight, mean, rstd, dx if writes_dx else _NULL, weight_parts if writes_parts else _NULL,
                       bias_parts if writes_parts else _NULL, *scalars), step.smem)
    finish = launch.finish
    if finish is not None:
        finish.function(finish.grid, finish.block,
                        (weight_parts, bias_parts, *launch.finish_scalars, _NULL if dweight is None else dweight,
                         _NULL if dbias is None else dbias), finish.smem)
