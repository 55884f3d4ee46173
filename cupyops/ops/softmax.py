"""softmax and log_softmax, forward and backward, along any axes: plan ->
launch -> public functions.

A call runs one of three kernel families: rows held by a warp or a block
(softmax_rows; under auto a stored winner where `cupyops tune softmax`
measured the shape: the user's table, then the one shipped for the device's
profile, softmax_candidates), rows split
across several blocks (softmax_split, auto, for a few long rows or rows too
long for one block), or a non-last axis reduced in place (softmax_axis,
auto). Other layouts are copied to rows (rowwise).
"""
from __future__ import annotations

import numpy

from .. import arrays, callcache, dtypes, rowwise
from ..callcache import CallCache, ReadyLaunch, call_key, run_on, writable
from ..launch import KernelLaunch, LaunchCache, Target, live_function
from ..packed import POINTER, PackedLaunch, address
from . import softmax_axis, softmax_candidates, softmax_rows, softmax_split

# -- plan --------------------------------------------------------------------


def plan(op: str, rows: int, cols: int, dtype: str, policy: str, target: Target, align: int = 16,
         same_phase: bool = True) -> KernelLaunch:
    """The row kernel's plan for `rows` x `cols` of dtype (short name) on
    `target`: under policy="auto" the stored winner for the shape where the
    user's table for the live GPU or the table shipped for the target's
    profile has one (explain()'s "source": "tuned" or "shipped"), else the
    rule's (softmax_rows.plan; arguments as there)."""
    if policy == "auto":
        tuned = softmax_candidates.tuned_plan(op, rows, cols, dtype, target, align, same_phase)
        if tuned is not None:
            return tuned
    return softmax_rows.plan(op, rows, cols, dtype, policy, target, align, same_phase)


# -- launch ------------------------------------------------------------------

_launches = LaunchCache()


def _launch(op, policy, inputs, output, rows, cols):
    """Runs op on row operands; returns (ReadyLaunch, scalar arguments) when it
    was one row kernel, None when the split path ran."""
    operands = (*inputs, output)
    align = arrays.alignment(*(value for o in operands for value in (o.byte_address, o.byte_row_stride)))
    same_phase = arrays.same_phase(*operands)
    if policy == "auto":
        if softmax_split.run(op, inputs, output, rows, cols, align, same_phase):
            return None
    first = inputs[0].array
    device_id = first.device.id
    ftype = dtypes.BY_DTYPE[first.dtype]
    key = (op, policy, rows, cols, ftype.short, align, same_phase, device_id)

    def make():
        chosen = plan(op, rows, cols, ftype.short, policy, Target.live(device_id), align, same_phase)
        return ReadyLaunch(live_function(chosen.spec, device_id, chosen.smem_bytes), chosen.grid, chosen.block,
                           chosen.smem_bytes)

    ready = _launches.get(key, make)
    scalars = (numpy.int64(rows), numpy.int64(cols), *(numpy.int64(o.row_stride) for o in operands))
    ready((*(o.array for o in operands), *scalars))
    return ready, scalars


# Whole calls memoised (callcache): one row kernel on the caller's arrays.
_calls = CallCache()


class _ReadyCall:
    """A memoised call: its row kernel ready with the scalar arguments cast for it
    (packed.PackedLaunch: the addresses of the inputs and the output change), and
    the shape and dtype of a fresh output."""
    __slots__ = ("launch", "shape", "dtype")

    def __init__(self, launch: ReadyLaunch, scalars: tuple, inputs: int, shape: tuple, dtype):
        self.launch = PackedLaunch(launch.function, launch.grid, launch.block, launch.smem,
                                   (POINTER,) * (inputs + 1) + scalars)
        self.shape, self.dtype = shape, dtype

    def run(self, inputs: tuple, out):
        """Launches on `inputs` into `out` (None: a fresh array); returns the result."""
        result = callcache.empty(self.shape, self.dtype) if out is None else out
        self.launch((*map(address, inputs), result.data.ptr))
        return result

    def run_at(self, inputs: tuple, out: int) -> None:
        """run on addresses (the inputs' and an output's of `shape` and `dtype`), for
        arrays of the call's layout that are not CuPy's."""
        self.launch((*inputs, out))


def remembered_call(op: str, inputs: tuple, axis):
    """The call of `op` (auto policy, no out) on arrays of these arrays' layout (x, or dy and
    y) as remembered, replayed through its run_at; or None."""
    return _calls.find(call_key((op, "auto", axis), (*inputs, None)))


def _run_rows(op, policy, inputs: list, axes, out, result_dtype, key):
    """rowwise.run of op, remembering the call under `key` when it was one
    row kernel on `inputs` writing the result."""
    launches = []

    def launch(row_inputs, output, rows, cols):
        launches.append((tuple(o.array for o in row_inputs), output.array,
                         _launch(op, policy, row_inputs, output, rows, cols)))

    result = rowwise.run(inputs, axes, out, result_dtype, launch)
    if len(launches) == 1:
        read, written, call = launches[0]
        if call is not None and written is result and all(a is b for a, b in zip(read, inputs)):
            _calls.remember(key, _ReadyCall(*call, len(read), result.shape, result.dtype))
    return result


def _forward(op, x, axis, out, policy, stream):
    key = call_key((op, policy, axis), (x, out))
    call = _calls.find(key)
    if call is not None and (out is None or writable(out, (x,))):
        return call.run((x,), out) if stream is None else run_on(stream, call.run, (x,), out)

    import cupy

    caller_x = x
    x = arrays.as_cupy(x)
    arrays.check_policy(policy)
    result_dtype = dtypes.result_dtype(x.dtype)
    if x.dtype != result_dtype:
        x = x.astype(result_dtype)
    shape = x.shape
    if x.ndim == 0:   # SciPy treats a scalar as one row of one element
        x = x.reshape(1)
    if x is not caller_x:
        key = None   # the kernel reads a converted copy or view
    axes = arrays.normalize_axes(axis, x.ndim)
    out = arrays.check_out(out, shape, result_dtype, x.device.id)
    if x.size == 0:
        return out if out is not None else cupy.empty(shape, result_dtype)
    target = out if out is None or out.shape == x.shape else out.reshape(x.shape)
    with arrays.on_device(x, stream):
        result = None
        if policy == "auto" and len(axes) == 1 and axes[0] != x.ndim - 1:
            result = softmax_axis.run(op, x, axes[0], target)
        if result is None:
            result = _run_rows(op, policy, [x], axes, target, result_dtype, key)
    if out is not None:
        result = out
    elif result.shape != shape:
        result = result.reshape(shape)
    return result


def _backward(op, dy, y, axis, out, policy, stream):
    key = call_key((op, policy, axis), (dy, y, out))
    call = _calls.find(key)
    if call is not None and (out is None or writable(out, (dy, y))):
        return call.run((dy, y), out) if stream is None else run_on(stream, call.run, (dy, y), out)

    import cupy

    dy, y = arrays.as_cupy(dy, "dy"), arrays.as_cupy(y, "y")
    arrays.check_policy(policy)
    dtypes.float_type(dy.dtype)
    if (dy.shape, dy.dtype) != (y.shape, y.dtype):
        raise ValueError(f"dy ({dy.shape}, {dy.dtype}) and y ({y.shape}, {y.dtype}) must have "
                         "the same shape and dtype")
    if dy.device.id != y.device.id:
        raise ValueError(f"dy is on GPU {dy.device.id}, y on GPU {y.device.id}")
    if dy.ndim == 0:
        raise ValueError("softmax gradients need at least one dimension")
    axes = arrays.normalize_axes(axis, dy.ndim)
    out = arrays.check_out(out, dy.shape, dy.dtype, dy.device.id)
    if dy.size == 0:
        return out if out is not None else cupy.empty(dy.shape, dy.dtype)
    with arrays.on_device(dy, stream):
        if policy == "auto" and len(axes) == 1 and axes[0] != dy.ndim - 1:
            result = softmax_axis.run_backward(op, dy, y, axes[0], out)
            if result is not None:
                return result
        return _run_rows(op, policy, [dy, y], axes, out, dy.dtype, key)


def softmax(x, axis=None, *, out=None, policy: str = "auto", stream=None):
    """Softmax of `x` along `axis` (None: all axes; an int; or a tuple).

    Equivalent to ``scipy.special.softmax(x, axis)`` and, for one axis,
    ``torch.softmax(x, dim=axis)``. Integer input is promoted to float64 as
    SciPy does. `x` is any GPU array (CuPy, or DLPack / CUDA array interface,
    e.g. a torch tensor, without a copy); the result is a CuPy array."""
    return _forward("softmax", x, axis, out, policy, stream)


def log_softmax(x, axis=None, *, out=None, policy: str = "auto", stream=None):
    """Logarithm of the softmax of `x` along `axis`, computed stably.

    Equivalent to ``scipy.special.log_softmax(x, axis)`` and, for one axis,
    ``torch.log_softmax(x, dim=axis)``; arguments as for :func:`softmax`."""
    return _forward("log_softmax", x, axis, out, policy, stream)


def softmax_backward(dy, y, axis=-1, *, out=None, policy: str = "auto", stream=None):
    """Gradient of softmax: ``dx = (dy - sum(dy * y, axis, keepdims=True)) * y``.

    `y` is the forward result ``softmax(x, axis)`` and `dy` the gradient of the
    loss with respect to it; the same as torch's
    ``torch._softmax_backward_data(dy, y, axis, dy.dtype)``. Float dtypes only;
    `axis` as for :func:`softmax`."""
    return _backward("softmax_backward", dy, y, axis, out, policy, stream)


def log_softmax_backward(dy, y, axis=-1, *, out=None, policy: str = "auto", stream=None):
    """Gradient of log_softmax: ``dx = dy - exp(y) * sum(dy, axis, keepdims=True)``.

    `y` is the forward result ``log_softmax(x, axis)``; the same as torch's
    ``torch._log_softmax_backward_data(dy, y, axis, dy.dtype)``."""
    return _backward("log_softmax_backward", dy, y, axis, out, policy, stream)
