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


def run_forward_at(launch: ForwardLaunch, addresses: tuple) -> None:
    """run_forward on the addresses of x, residual, weight, bias, y, h, mean and rstd (0 for
    an array not read or not stored), for arrays of the plan's layout that are not CuPy's."""
    launch.main(addresses)


def run_backward(launch: BackwardLaunch, dy, x, dx, rstd, mean, weight, dweight, dbias) -> None:
    """Runs a ready backward plan: dy, x, dx as the kernels read them, rstd /
    mean (None for RMSNorm) [rows] in the compute type, weight contiguous
    [cols]; dweight / dbias (None unless wanted) [cols]."""
    run_backward_at(launch, rstd.itemsize, 0 if weight is None else weight.itemsize, dy.data.ptr, x.data.ptr,
                    dx.data.ptr, rstd.data.ptr, 0 if mean is None else mean.data.ptr,
                    0 if weight is None else weight.data.ptr, 0 if dweight is None else dweight.data.ptr,
                    0 if dbias is None else dbias.data.ptr)


def run_backward_at(launch: BackwardLaunch, stats_itemsize: int, weight_itemsize: int, dy: int, x: int, dx: int,
                    rstd: int, mean: int, weight: int, dweight: int, dbias: int) -> None:
    """run_backward on addresses (0 for an array absent or not wanted) and the itemsizes of
    the statistics and the weight. The weight's phase copies and the partial sums of the
    gradients wanted take one workspace each: raw blocks of CuPy's pool (no array around
    them), freed on return once their kernels are queued, as CuPy frees a temporary array."""
    alloc = callcache.alloc or callcache.cupy_module().cuda.alloc
    if launch.weight_phases is not None:
        copies = alloc(launch.phase_copies * weight_itemsize)
        launch.weight_phases((weight, copies.ptr))
        weight = copies.ptr
    weight_parts = bias_parts = 0
    if dweight or dbias:
        both = dweight and dbias
        half = launch.parts_elements * stats_itemsize
        parts = alloc(2 * half if both else half)
        weight_parts = parts.ptr if dweight else 0
        bias_parts = (parts.ptr + half if both else parts.ptr) if dbias else 0
    for step, writes_dx, writes_parts in launch.steps:
        step((dy, x, weight, mean, rstd, dx if writes_dx else 0, weight_parts if writes_parts else 0,
              bias_parts if writes_parts else 0))
    if launch.finish is not None:
        launch.finish((weight_parts, bias_parts, dweight, dbias))
