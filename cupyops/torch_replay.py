"""cupyops.torch's ops on tensors, replayed from the second call of a layout.

The first call of a layout (shapes, strides, dtypes, 16-byte phases, GPU) runs cupyops on
CuPy views of the tensors and returns its outputs through DLPack, then looks up what
cupyops remembered of that call. From the second call of the layout the remembered kernels
run on the tensors' addresses, their outputs allocated by torch: no CuPy views, no CuPy-level
key, no DLPack. Softmax and log_softmax (along the last axis), the norms, the fused softmax
(forward and backward) and the fused elementwise functions are replayed so; a layout
cupyops remembered nothing for keeps the first path. Every function here runs on its
tensors' GPU and torch's current stream there (torch_bridge.context, entered once a call).
"""
from __future__ import annotations

import torch

import cupyops
from cupyops.ops import fused_softmax, norm, norm_launch, softmax
from cupyops.torch_bridge import LAST_AXES, NUMPY_DTYPES, context, to_cupy, to_torch

_TORCH_DTYPES = {numpy_dtype: torch_dtype for torch_dtype, numpy_dtype in NUMPY_DTYPES.items()}
_MAX_REPLAYS = 1024


class _Replays:
    """Replays kept by a call's key: each a callable on the call's tensors, or False where
    cupyops remembered no call of that layout."""

    def __init__(self):
        self._kept: dict = {}

    def run(self, key, args: tuple, first, remembered, tensor):
        """The kept replay of `key` on args; else first() (cupyops' own path) and, the first
        time, keeps what remembered() gives (a replay, or None). Either runs in `tensor`'s
        context (its GPU, torch's current stream there)."""
        with context(tensor):
            kept = self._kept.get(key)
            if kept:
                return kept(*args)
            result = first()
            if kept is None:
                if len(self._kept) >= _MAX_REPLAYS:
                    self._kept.clear()
                self._kept[key] = remembered() or False
            return result


_norm_forwards, _norm_backwards, _fused, _elementwise, _softmax = (_Replays() for _ in range(5))


def layout(tensor) -> tuple:
    """What a remembered call depends on of a tensor: shape, strides (True where it is
    contiguous), dtype, address mod 16, GPU; None for None."""
    if tensor is None:
        return None
    return tensor.shape, tensor.is_contiguous() or tensor.stride(), tensor.dtype, tensor.data_ptr() & 15, \
        tensor.get_device()


def _address(tensor) -> int:
    return 0 if tensor is None else tensor.data_ptr()


class _NormForward:
    """A remembered norm forward: its ready launch, the shape of y (and h) and the
    statistics' shape and torch dtype, which of h, mean and rstd it writes."""
    __slots__ = ("launch", "shape", "residual", "stats_shape", "stats_dtype", "mean", "rstd")

    def __init__(self, launch, outputs: norm.ForwardOutputs):
        self.launch, self.shape, self.residual = launch, outputs.shape, outputs.residual
        self.stats_shape, self.stats_dtype = outputs.stats_shape, _TORCH_DTYPES[outputs.stats_dtype]
        self.mean, self.rstd = outputs.mean, outputs.rstd

    def __call__(self, x, weight, bias, residual) -> tuple:
        y = x.new_empty(self.shape)
        h = x.new_empty(self.shape) if self.residual else None
        mean = x.new_empty(self.stats_shape, dtype=self.stats_dtype) if self.mean else None
        rstd = x.new_empty(self.stats_shape, dtype=self.stats_dtype) if self.rstd else None
        norm_launch.run_forward_at(self.launch, (x.data_ptr(), _address(residual), _address(weight), _address(bias),
                                                 y.data_ptr(), _address(h), _address(mean), _address(rstd)))
        return y, h, mean, rstd


class _NormBackward:
    """A remembered norm backward: its ready launch, the gradients' shape, which it writes."""
    __slots__ = ("launch", "grads_shape", "weight_grad", "bias_grad")

    def __init__(self, launch, outputs: norm.BackwardOutputs):
        self.launch, self.grads_shape = launch, outputs.grads_shape
        self.weight_grad, self.bias_grad = outputs.weight_grad, outputs.bias_grad

    def __call__(self, grad, x, mean, rstd, weight) -> tuple:
        dx = x.new_empty(x.shape)
        dweight = x.new_empty(self.grads_shape) if self.weight_grad else None
        dbias = x.new_empty(self.grads_shape) if self.bias_grad else None
        norm_launch.run_backward_at(self.launch, rstd.element_size(), 0 if weight is None else weight.element_size(),
                                    grad.data_ptr(), x.data_ptr(), dx.data_ptr(), rstd.data_ptr(), _address(mean),
                                    _address(weight), _address(dweight), _address(dbias))
        return dx, dweight, dbias


class _Ready:
    """A replay of what cupyops remembered of a call (`ready`), run on tensors when called."""
    __slots__ = ("ready",)

    def __init__(self, ready):
        self.ready = ready


class _FusedForward(_Ready):
    """A remembered fused softmax forward: (y, lse) of x, bias and mask, lse None unless the
    call returns it."""
    __slots__ = ()

    def __call__(self, x, bias, mask, seed: int, offset: int) -> tuple:
        ready = self.ready
        y = x.new_empty(ready.shape)
        lse = x.new_empty(ready.shape[:-1], dtype=torch.float32) if ready.return_lse else None
        ready.run_at((x.data_ptr(), 0, _address(bias), _address(mask)), y.data_ptr(), _address(lse), seed, offset)
        return y, lse


class _FusedBackward(_Ready):
    """A remembered fused softmax backward: dx of grad, x, lse, bias and mask."""
    __slots__ = ()

    def __call__(self, grad, x, lse, bias, mask, seed: int, offset: int) -> torch.Tensor:
        dx = x.new_empty(self.ready.shape)
        self.ready.run_at((x.data_ptr(), grad.data_ptr(), _address(bias), _address(mask)), dx.data_ptr(),
                          lse.data_ptr(), seed, offset)
        return dx


class _ElementwiseReplay(_Ready):
    """A cupyops.fuse function's remembered launcher: its outputs of tensors and numbers."""
    __slots__ = ()

    def __call__(self, *args) -> tuple:
        outputs = tuple(args[0].new_empty(shape, dtype=_TORCH_DTYPES[dtype]) for shape, dtype in self.ready.outputs)
        self.ready.launch_at(tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args),
                             tuple(output.data_ptr() for output in outputs))
        return outputs


class _SoftmaxReplay(_Ready):
    """A remembered softmax op: its result of x (or dy and y)."""
    __slots__ = ()

    def __call__(self, *tensors) -> torch.Tensor:
        ready = self.ready
        result = tensors[0].new_empty(ready.shape, dtype=_TORCH_DTYPES[ready.dtype])
        ready.run_at(tuple(t.data_ptr() for t in tensors), result.data_ptr())
        return result


def norm_forward(centered: bool, x, weight, bias, residual, ndim: int, eps: float, stats: bool) -> tuple:
    """cupyops.layer_norm (centered) / rms_norm of the tensors over their last ndim axes: (y,
    h, mean, rstd), None where not produced (h without a residual, the statistics unless
    `stats`, mean for rms_norm)."""
    op = "layer_norm" if centered else "rms_norm"
    axes = LAST_AXES[ndim]

    def first():
        affine = (to_cupy(weight), to_cupy(bias)) if centered else (to_cupy(weight),)
        result = getattr(cupyops, op)(to_cupy(x), *affine, axis=axes, eps=eps, residual=to_cupy(residual),
                                      return_stats=stats)
        result = tuple(map(to_torch, result)) if isinstance(result, tuple) else (to_torch(result),)
        h = result[1] if residual is not None else None
        statistics = result[1 + (residual is not None):]
        return (result[0], h, *((statistics[0] if centered else None, statistics[-1]) if stats else (None, None)))

    def remembered():
        found = norm.remembered_forward(op, to_cupy(x), to_cupy(weight), to_cupy(bias), axes, eps, to_cupy(residual),
                                        stats)
        return found and _NormForward(*found)

    key = (centered, ndim, eps, stats, layout(x), layout(weight), layout(bias), layout(residual))
    return _norm_forwards.run(key, (x, weight, bias, residual), first, remembered, x)


def norm_backward(centered: bool, grad, x, mean, rstd, weight, ndim: int, need_weight_grad: bool,
                  need_bias_grad: bool) -> tuple:
    """cupyops' norm backward of the tensors: (dx, dweight, dbias), None where not wanted."""
    op = "layer_norm_backward" if centered else "rms_norm_backward"
    axes = LAST_AXES[ndim]

    def first():
        if centered:
            grads = cupyops.layer_norm_backward(to_cupy(grad), to_cupy(x), to_cupy(mean), to_cupy(rstd),
                                                to_cupy(weight), axis=axes, need_weight_grad=need_weight_grad,
                                                need_bias_grad=need_bias_grad)
        else:
            grads = (*cupyops.rms_norm_backward(to_cupy(grad), to_cupy(x), to_cupy(rstd), to_cupy(weight), axis=axes,
                                                need_weight_grad=need_weight_grad), None)
        return tuple(map(to_torch, grads))

    def remembered():
        found = norm.remembered_backward(op, to_cupy(grad), to_cupy(x), to_cupy(mean), to_cupy(rstd),
                                         to_cupy(weight), axes, need_weight_grad, need_bias_grad)
        return found and _NormBackward(*found)

    key = (centered, ndim, need_weight_grad, need_bias_grad, layout(grad), layout(x), layout(mean), layout(rstd),
           layout(weight))
    return _norm_backwards.run(key, (grad, x, mean, rstd, weight), first, remembered, x)


def fused_forward(x, bias, mask, scalars: tuple, seed: int, offset: int, need_lse: bool) -> tuple:
    """cupyops.fused_softmax of the tensors, scalars (scale, causal, diagonal, dropout, dim):
    (y, lse), lse None unless need_lse."""
    scale, causal, diagonal, dropout, dim = scalars

    def first():
        result = cupyops.fused_softmax(to_cupy(x), scale=scale, bias=to_cupy(bias), mask=to_cupy(mask),
                                       causal=causal, diagonal=diagonal, dropout=dropout, seed=seed, offset=offset,
                                       axis=dim, return_lse=need_lse)
        return (to_torch(result[0]), to_torch(result[1])) if need_lse else (to_torch(result), None)

    def remembered():
        found = fused_softmax.remembered_call(to_cupy(x), None, None, to_cupy(bias), to_cupy(mask), *scalars,
                                              need_lse)
        return found and _FusedForward(found)

    key = (scalars, need_lse, layout(x), None, None, layout(bias), layout(mask))
    return _fused.run(key, (x, bias, mask, seed, offset), first, remembered, x)


def fused_backward(grad, x, lse, bias, mask, scalars: tuple, seed: int, offset: int) -> torch.Tensor:
    """cupyops.fused_softmax_backward's dx of the tensors, scalars as fused_forward's."""
    scale, causal, diagonal, dropout, dim = scalars

    def first():
        return to_torch(cupyops.fused_softmax_backward(
            to_cupy(grad), to_cupy(x), to_cupy(lse), scale=scale, bias=to_cupy(bias), mask=to_cupy(mask),
            causal=causal, diagonal=diagonal, dropout=dropout, seed=seed, offset=offset, axis=dim))

    def remembered():
        found = fused_softmax.remembered_call(to_cupy(x), to_cupy(grad), to_cupy(lse), to_cupy(bias), to_cupy(mask),
                                              *scalars)
        return found and _FusedBackward(found)

    key = (scalars, False, layout(x), layout(grad), layout(lse), layout(bias), layout(mask))
    return _fused.run(key, (grad, x, lse, bias, mask, seed, offset), first, remembered, x)


def elementwise(function, args: tuple) -> tuple:
    """The outputs of `function` (a cupyops.fuse function) of args (tensors and numbers) as
    torch tensors."""
    def operands():
        return tuple(to_cupy(a) if isinstance(a, torch.Tensor) else a for a in args)

    def first():
        result = function.call(operands())
        return tuple(map(to_torch, result)) if isinstance(result, tuple) else (to_torch(result),)

    def remembered():
        found = function.remembered(operands())
        return found and _ElementwiseReplay(found)

    key = (function, *(layout(a) if isinstance(a, torch.Tensor) else type(a) for a in args))
    return _elementwise.run(key, args, first, remembered, args[0])


def softmax_op(op: str, tensors: tuple, dim: int) -> torch.Tensor:
    """cupyops' `op` (softmax, log_softmax or their backward) of tensors (x, or dy and y)
    along dim as a torch tensor."""
    def first():
        return to_torch(getattr(cupyops, op)(*map(to_cupy, tensors), axis=dim))

    def remembered():
        found = softmax.remembered_call(op, tuple(map(to_cupy, tensors)), dim)
        return found and _SoftmaxReplay(found)

    return _softmax.run((op, dim, *map(layout, tensors)), tensors, first, remembered, tensors[-1])
