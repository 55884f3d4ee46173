"""layer_norm and rms_norm, forward and backward: plan -> launch -> public functions.

Statistics (kernels/welford.cuh), the same in both policies: paths that hold
the row in registers sum it for the mean, then sum the squared deviations
from that mean; the streaming paths take each pack's (count, mean, m2) and
join them by Chan's combine. All of it on x - K with K the row's first
value (float32 statistics of the raw values lose a std of 1e-2 under a mean
of 1e4). RMSNorm sums squares. policy="oneflow" runs OneFlow's dispatch
(norm_paths), "auto" the measured planners (norm_forward, norm_backward),
or the stored winner where `cupyops tune` measured the shape
(norm_candidates, norm_grad_candidates).
dweight / dbias are reduced in the compute type to [parts, cols] partial sums
summed by a second kernel in a fixed order: the same inputs give
bit-identical gradients on every run.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy

from .. import arrays, callcache, dtypes, rowwise
from ..callcache import CallCache, call_key, run_on, writable
from ..launch import Target
from . import norm_args, norm_backward, norm_candidates, norm_grad_candidates
from .norm_launch import (BackwardLaunch, ForwardLaunch, backward_launch, forward_launch, run_backward,
                          run_forward)
from .norm_spec import FORWARD_OPS, OPS, NormGradPlan, NormPlan, check_block_covers, shifted_copy_elements

# -- plan --------------------------------------------------------------------

def plan(op: str, rows: int, cols: int, dtype: str, policy: str, target: Target, align: int = 16, *,
         weight: bool = True, bias: bool = True, residual: bool = False,
         param_grad: bool = True, same_phase: bool = True):
    """The launch plan of `op` for `rows` x `cols` of dtype (short name) on `target`.

    Forward ops take weight / bias / residual flags; backward ops take weight
    (dy is multiplied by it) and param_grad (dweight / dbias wanted). `align`
    is the largest power of two (<= 16) dividing every operand's address and
    row stride in bytes; `same_phase` says every row of every row operand
    starts at the same offset from a 16-byte boundary (auto then peels rows
    that allow no 16-byte pack: the forward, and the backward with fused
    dweight / dbias). The flags are keyword-only: passed by position,
    param_grad once landed in `bias` and the backward planned fused partials
    that were never allocated. Under auto a plan is the stored winner where
    `cupyops tune OP` measured the shape (norm_candidates,
    norm_grad_candidates: the user's table on a live GPU, then the one
    shipped for the target's profile; explain()'s "source": "tuned" or
    "shipped"), else the rules'."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    arrays.check_policy(policy)
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
    if policy == "auto":
        if op in FORWARD_OPS:
            tuned = norm_candidates.tuned_plan(op, rows, cols, dtype, target, align, same_phase, weight=weight,
                                               bias=bias and op == "layer_norm", residual=residual)
        else:
            tuned = norm_grad_candidates.tuned_plan(op, rows, cols, dtype, target, align, same_phase,
                                                    weight=weight, param_grad=param_grad)
        if tuned is not None:
            return tuned
    return _rule_plan(op, rows, cols, dtype, policy, target, align, weight, bias, residual, param_grad, same_phase)


@functools.lru_cache(maxsize=4096)
def _rule_plan(op, rows, cols, dtype, policy, target, align, weight, bias, residual, param_grad, same_phase):
    """plan()'s rules: OneFlow's dispatch (norm_paths) or auto's measured
    planners (norm_forward, norm_backward)."""
    family = op.replace("_backward", "")
    if op not in FORWARD_OPS:
        return norm_backward.plan(family, rows, cols, dtype, policy, target, align, weight, param_grad, same_phase)
    fields = dict(op=op, dtype=dtype, weight=weight, bias=bias and family == "layer_norm", residual=residual)
    return NormPlan(norm_candidates.rule_launch(fields, rows, cols, policy, target, align, same_phase))


# -- launch ------------------------------------------------------------------

def launch_forward(chosen: NormPlan, device_id: int, rows: int, cols: int, x, y, eps: float, *,
                   residual=None, h=None, weight=None, bias=None, mean=None, rstd=None) -> ForwardLaunch:
    """Runs a forward plan: x, y and residual are rowwise.Operands, h (stored
    when residual is given) a contiguous [rows, cols] array, weight / bias
    contiguous [cols], mean / rstd [rows] in the compute type (None: not
    stored). Returns the ready launch it ran."""
    check_block_covers(chosen.main.spec, cols)
    launch = forward_launch(chosen, device_id, rows, cols, dtypes.float_type(x.array.dtype), eps, x.row_stride,
                            0 if residual is None else residual.row_stride, y.row_stride)
    run_forward(launch, x.array, None if residual is None else residual.array, weight, bias, y.array, h, mean, rstd)
    return launch


def launch_backward(chosen: NormGradPlan, device_id: int, rows: int, cols: int, dy, x, dx, rstd, *,
                    mean=None, weight=None, dweight=None, dbias=None) -> BackwardLaunch:
    """Runs a backward plan: dy, x and dx are rowwise.Operands, rstd / mean
    (None for RMSNorm) [rows] in the compute type, weight contiguous [cols];
    dweight / dbias [cols] are written when given (the plan must then reduce
    them). Allocates the workspace of the gradients wanted; the kernels skip
    a null one. Returns the ready launch it ran."""
    check_block_covers(chosen.main.spec, cols)
    phases = chosen.weight_phases
    phase_stride = 0 if phases is None else shifted_copy_elements(phases.spec.pack_size, cols)
    launch = backward_launch(chosen, device_id, rows, cols, dy.row_stride, x.row_stride, dx.row_stride,
                             phase_stride)
    run_backward(launch, dy.array, x.array, dx.array, rstd, mean, weight, dweight, dbias)
    return launch


# Whole calls memoised (callcache): one launch on the caller's arrays.
_calls = CallCache()


def _remember(key, launched: list, caller: tuple, result, outputs) -> None:
    """Remembers (the ready launch, `outputs`: what a call allocates) under
    `key` when rowwise.run made one launch, writing `result` and reading the
    memory of the caller's arrays (cupy.ndarray or None, as the key says)
    rather than copies."""
    if key is None or len(launched) != 1:
        return
    read, written, ready = launched[0]
    if written is result and all(a is b or (a is not None and b is not None and a.data.ptr == b.data.ptr)
                                 for a, b in zip(read, caller)):
        _calls.remember(key, (ready, outputs))


# -- forward -------------------------------------------------------------------

class ForwardOutputs(NamedTuple):
    """What a forward call allocates and returns: y (and h, with a residual)
    of x's shape and dtype; mean (LayerNorm) and rstd of the statistics'
    shape and dtype where return_stats asks for them."""
    shape: tuple
    dtype: object
    residual: bool
    stats_shape: tuple
    stats_dtype: object
    mean: bool
    rstd: bool

    def allocate(self, empty) -> tuple:
        """(h, mean, rstd) by empty(shape, dtype), None where not stored."""
        return (empty(self.shape, self.dtype) if self.residual else None,
                empty(self.stats_shape, self.stats_dtype) if self.mean else None,
                empty(self.stats_shape, self.stats_dtype) if self.rstd else None)

    def result(self, y, h, mean, rstd):
        """What the public function returns: y, then h, then the statistics."""
        if not (self.residual or self.rstd):
            return y
        result = (y,) if h is None else (y, h)
        if self.rstd:
            result += (rstd,) if mean is None else (mean, rstd)
        return result


def _replay_forward(call, x, weight, bias, residual, out):
    launch, outputs = call
    empty = callcache.empty
    y = empty(outputs.shape, outputs.dtype) if out is None else out
    if not (outputs.residual or outputs.rstd):   # y alone
        run_forward(launch, x, residual, weight, bias, y, None, None, None)
        return y
    h, mean, rstd = outputs.allocate(empty)
    run_forward(launch, x, residual, weight, bias, y, h, mean, rstd)
    return outputs.result(y, h, mean, rstd)


def _forward(op, x, weight, bias, axis, eps, residual, return_stats, out, policy, stream):
    key = call_key((op, policy, axis, eps, return_stats), (x, weight, bias, residual, out))
    call = _calls.find(key)
    if call is not None and (out is None or writable(out, (x, residual)) and
                             writable(out, (weight, bias), in_place=False)):
        if stream is None:
            return _replay_forward(call, x, weight, bias, residual, out)
        return run_on(stream, _replay_forward, call, x, weight, bias, residual, out)

    import cupy

    caller = (x, residual, weight, bias)
    x = norm_args.float_input(x)
    arrays.check_policy(policy)
    eps = norm_args.check_eps(eps)
    ftype = dtypes.float_type(x.dtype)
    num_axes = norm_args.normalized_axes(x, axis)
    normalized_shape = x.shape[x.ndim - num_axes:]
    device_id = x.device.id
    weight = norm_args.check_like(weight, "weight", normalized_shape, x.dtype, device_id)
    bias = norm_args.check_like(bias, "bias", normalized_shape, x.dtype, device_id)
    residual = norm_args.check_like(residual, "residual", x.shape, x.dtype, device_id)
    out = arrays.check_out(out, x.shape, x.dtype, device_id)
    return_stats = bool(return_stats)
    outputs = ForwardOutputs(x.shape, x.dtype, residual is not None, x.shape[:x.ndim - num_axes],
                              norm_args.stats_dtype(x.dtype), return_stats and op == "layer_norm", return_stats)
    launched = []

    with arrays.on_device(x, stream):
        weight = None if weight is None else cupy.ascontiguousarray(weight)
        bias = None if bias is None else cupy.ascontiguousarray(bias)
        h, mean, rstd = outputs.allocate(cupy.empty)

        def launch(operands, output, rows, cols):
            x_op = operands[0]
            res_op = operands[1] if residual is not None else None
            pointers = [x_op.byte_address, x_op.byte_row_stride, output.byte_address, output.byte_row_stride]
            if res_op is not None:
                pointers += [res_op.byte_address, res_op.byte_row_stride, h.data.ptr, cols * x.itemsize]
            pointers += [vector.data.ptr for vector in (weight, bias) if vector is not None]
            align = arrays.alignment(*pointers)
            row_operands = [x_op, output] + ([] if res_op is None else [res_op, rowwise.Operand(h, cols)])
            chosen = plan(op, rows, cols, ftype.short, policy, Target.live(device_id), align,
                          weight=weight is not None, bias=bias is not None,
                          residual=residual is not None, same_phase=arrays.same_phase(*row_operands))
            ready = launch_forward(chosen, device_id, rows, cols, x_op, output, eps, residual=res_op, h=h,
                                   weight=weight, bias=bias, mean=mean, rstd=rstd)
            launched.append(((x_op.array, None if res_op is None else res_op.array, weight, bias), output.array,
                             ready))

        if x.size == 0:
            y = out if out is not None else cupy.empty(x.shape, x.dtype)
            for stat in (mean, rstd):
                if stat is not None:
                    stat.fill(numpy.nan)
        else:
            inputs = [x] if residual is None else [x, residual]
            y = rowwise.run(inputs, tuple(range(x.ndim - num_axes, x.ndim)), out, x.dtype, launch,
                            shared=(weight, bias))
    _remember(key, launched, caller, y, outputs)
    return outputs.result(y, h, mean, rstd)


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False,
               out=None, policy: str = "auto", stream=None):
    """Layer normalisation of `x` over the trailing `axis` (an int or a tuple).

    Equivalent to ``torch.nn.functional.layer_norm(x, x.shape[axes], weight,
    bias, eps)``: ``(x - mean) / sqrt(var + eps) * weight + bias`` with the
    biased variance, statistics and affine in float32 for 16-bit inputs.
    weight / bias are shaped like the normalised axes. With `residual`,
    ``h = x + residual`` is normalised in the same kernel and returned as
    ``(y, h)``; with `return_stats` the per-row ``mean`` and ``rstd`` (compute
    type: float32, or float64 for float64 input) are appended."""
    return _forward("layer_norm", x, weight, bias, axis, eps, residual, return_stats, out, policy, stream)


def rms_norm(x, weight=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False, out=None,
             policy: str = "auto", stream=None):
    """RMS normalisation of `x` over the trailing `axis`: ``x * rsqrt(mean(x**2) + eps) * weight``.

    Equivalent to ``torch.nn.functional.rms_norm(x, x.shape[axes], weight, eps)``.
    `residual` and `return_stats` as for :func:`layer_norm` (the statistic
    appended is ``rstd`` alone)."""
    return _forward("rms_norm", x, weight, None, axis, eps, residual, return_stats, out, policy, stream)


def remembered_forward(op: str, x, weight, bias, axis, eps, residual, return_stats):
    """The call of `op` (layer_norm / rms_norm, auto policy, no out) on arrays of these
    arrays' layout as remembered: (ForwardLaunch, ForwardOutputs), or None. A caller holding
    arrays of that layout that are not CuPy's (cupyops.torch) replays it on their addresses
    through norm_launch.run_forward_at, with outputs of ForwardOutputs' shapes and dtypes."""
    return _calls.find(call_key((op, "auto", axis, eps, return_stats), (x, weight, bias, residual, None)))


# -- backward ------------------------------------------------------------------

class BackwardOutputs(NamedTuple):
    """What a backward call allocates: dx of x's shape and dtype, dweight
    and dbias (LayerNorm) of the weight's shape where wanted."""
    shape: tuple
    dtype: object
    grads_shape: tuple
    weight_grad: bool
    bias_grad: bool
    centered: bool          # LayerNorm: dbias returned (None unless wanted)

    def allocate(self, allocate) -> tuple:
        """(dx, dweight, dbias) by allocate(shape, dtype); None where not wanted."""
        return (allocate(self.shape, self.dtype),
                allocate(self.grads_shape, self.dtype) if self.weight_grad else None,
                allocate(self.grads_shape, self.dtype) if self.bias_grad else None)


def _replay_backward(call, dy, x, mean, rstd, weight):
    launch, outputs = call
    dx, dweight, dbias = outputs.allocate(callcache.empty)
    run_backward(launch, dy, x, dx, rstd, mean, weight, dweight, dbias)
    return (dx, dweight, dbias) if outputs.centered else (dx, dweight)


def _backward(op, dy, x, mean, rstd, weight, axis, need_weight_grad, need_bias_grad, policy, stream):
    key = call_key((op, policy, axis, need_weight_grad, need_bias_grad), (x, dy, mean, rstd, weight))
    call = _calls.find(key)
    if call is not None:
        if stream is None:
            return _replay_backward(call, dy, x, mean, rstd, weight)
        return run_on(stream, _replay_backward, call, dy, x, mean, rstd, weight)

    import cupy

    caller = (dy, x, mean, rstd, weight)
    x = norm_args.float_input(x)
    arrays.check_policy(policy)
    device_id = x.device.id
    dy = norm_args.check_like(dy, "dy", x.shape, x.dtype, device_id)
    if dy is None:
        raise TypeError("dy must be a GPU array")
    ftype = dtypes.float_type(x.dtype)
    num_axes = norm_args.normalized_axes(x, axis)
    normalized_shape = x.shape[x.ndim - num_axes:]
    weight = norm_args.check_like(weight, "weight", normalized_shape, x.dtype, device_id)
    stats_dtype = norm_args.stats_dtype(x.dtype)
    cols = math.prod(normalized_shape)
    rows = x.size // cols if cols else 0
    centered = op == "layer_norm_backward"
    outputs = BackwardOutputs(x.shape, x.dtype, normalized_shape, bool(need_weight_grad),
                               bool(need_bias_grad) and centered, centered)
    param_grad = outputs.weight_grad or outputs.bias_grad
    launched = []

    with arrays.on_device(x, stream):
        mean = norm_args.check_stat(mean, "mean", rows, stats_dtype, device_id) if centered else None
        rstd = norm_args.check_stat(rstd, "rstd", rows, stats_dtype, device_id)
        weight = None if weight is None else cupy.ascontiguousarray(weight)
        # the finish kernel writes every element of dweight / dbias; no rows: all zeros
        dx, dweight, dbias = outputs.allocate(cupy.empty if x.size else cupy.zeros)

        def launch(operands, output, rows, cols):
            dy_op, x_op = operands
            pointers = [op_.byte_address for op_ in (dy_op, x_op, output)]
            pointers += [op_.byte_row_stride for op_ in (dy_op, x_op, output)]
            if weight is not None:
                pointers.append(weight.data.ptr)
            chosen = plan(op, rows, cols, ftype.short, policy, Target.live(device_id),
                          arrays.alignment(*pointers), weight=weight is not None, param_grad=param_grad,
                          same_phase=arrays.same_phase(dy_op, x_op, output))
            _check_grad_plan(chosen, param_grad)
            ready = launch_backward(chosen, device_id, rows, cols, dy_op, x_op, output, rstd, mean=mean,
                                    weight=weight, dweight=dweight, dbias=dbias)
            launched.append(((dy_op.array, x_op.array, mean, rstd, weight), output.array, ready))

        if x.size:
            rowwise.run([dy, x], tuple(range(x.ndim - num_axes, x.ndim)), dx, x.dtype, launch)
    _remember(key, launched, caller, dx, outputs)
    return (dx, dweight, dbias) if centered else (dx, dweight)


def _check_grad_plan(chosen: NormGradPlan, param_grad: bool) -> None:
    """A backward plan writes partial sums exactly when they were asked for
    (and so allocated): no kernel may be handed a null workspace to fill."""
    writes_parts = chosen.main.spec.fuse_param_grad or chosen.param_grad is not None
    if writes_parts != param_grad or (chosen.finish is not None) != param_grad:
        raise AssertionError(f"backward plan {chosen.explain()} does not match param_grad={param_grad}")
    if param_grad and chosen.num_parts < 1:
        raise AssertionError(f"backward plan {chosen.explain()} has no workspace rows")


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, axis=-1, need_weight_grad=True,
                        need_bias_grad=True, policy: str = "auto", stream=None):
    """Gradients of :func:`layer_norm`: ``(dx, dweight, dbias)``.

    `mean` and `rstd` are the statistics of the forward pass (return_stats=True;
    with a residual, `x` is h). Equivalent to torch autograd through
    ``torch.nn.functional.layer_norm``. dweight / dbias (None unless wanted)
    are reduced in float32 (float64 for float64) in a fixed order:
    bit-identical on every run."""
    return _backward("layer_norm_backward", dy, x, mean, rstd, weight, axis, need_weight_grad,
                     need_bias_grad, policy, stream)


def rms_norm_backward(dy, x, rstd, weight=None, *, axis=-1, need_weight_grad=True, policy: str = "auto",
                      stream=None):
    """Gradients of :func:`rms_norm`: ``(dx, dweight)``.

    Equivalent to torch autograd through ``torch.nn.functional.rms_norm``;
    dweight as for :func:`layer_norm_backward`."""
    return _backward("rms_norm_backward", dy, x, None, rstd, weight, axis, need_weight_grad, False,
                     policy, stream)


def remembered_backward(op: str, dy, x, mean, rstd, weight, axis, need_weight_grad, need_bias_grad):
    """remembered_forward for layer_norm_backward / rms_norm_backward: (BackwardLaunch,
    BackwardOutputs) or None, replayed through norm_launch.run_backward_at."""
    return _calls.find(call_key((op, "auto", axis, need_weight_grad, need_bias_grad), (x, dy, mean, rstd, weight)))
