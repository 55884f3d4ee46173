"""Repeated cupyops.torch calls replayed on torch tensors.

A call of a layout (shapes, strides, dtypes, 16-byte phases, GPU) that cupyops remembers
from an earlier call of the same layout launches the remembered kernels on the tensors'
addresses, its outputs allocated by torch: no CuPy views, no CuPy-level key, no DLPack. The
first call of a layout takes cupyops' own path and looks up what it remembered. Softmax
and log_softmax (along the last axis), the norms, the fused softmax (forward and backward)
and the fused elementwise functions are replayed so.
"""
from __future__ import annotations

import torch

import cupyops
from cupyops.ops import fused_softmax, norm, norm_launch, softmax
from cupyops.torch_bridge import LAST_AXES, NUMPY_DTYPES, to_cupy, to_torch

_TORCH_DTYPES = {numpy_dtype: torch_dtype for torch_dtype, numpy_dtype in NUMPY_DTYPES.items()}
_MAX_REPLAYS = 1024
# key -> a replay, or False where cupyops remembered no call of that layout
_forwards: dict = {}
_backwards: dict = {}
_fused: dict = {}
_elementwise: dict = {}
_softmax: dict = {}


def layout(tensor) -> tuple:
    """What a remembered call depends on of a tensor: shape, strides (True where it is
    contiguous), dtype, address mod 16, GPU; None for None."""
    if tensor is None:
        return None
    return tensor.shape, tensor.is_contiguous() or tensor.stride(), tensor.dtype, tensor.data_ptr() & 15, \
        tensor.get_device()


def _address(tensor) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _keep(replays: dict, key, replay) -> None:
    if len(replays) >= _MAX_REPLAYS:
        replays.clear()
    replays[key] = replay


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


def norm_forward(key: tuple, x, weight, bias, residual):
    """(y, h, mean, rstd) by the replay kept under `key` (norm_forward_key), None where
    not produced, on CuPy's current stream; None where no replay is kept (False: cupyops
    remembered none)."""
    replay = _forwards.get(key)
    return replay(x, weight, bias, residual) if replay else replay


def norm_forward_key(centered: bool, x, weight, bias, residual, ndim: int, eps: float, stats: bool) -> tuple:
    return centered, ndim, eps, stats, layout(x), layout(weight), layout(bias), layout(residual)


def remember_norm_forward(key: tuple, centered: bool, x, weight, bias, residual, ndim: int, eps: float,
                          stats: bool) -> None:
    """Keeps under `key` the replay of the norm forward cupyops remembered for these tensors
    (just called with these arguments), or False."""
    found = norm.remembered_forward("layer_norm" if centered else "rms_norm", to_cupy(x), to_cupy(weight),
                                    to_cupy(bias), LAST_AXES[ndim], eps, to_cupy(residual), stats)
    _keep(_forwards, key, False if found is None else _NormForward(*found))


def norm_backward(key: tuple, grad, x, mean, rstd, weight):
    """(dx, dweight, dbias) by the replay kept under `key` (norm_backward_key), None where
    not wanted; None (or False) where no replay is kept, as norm_forward."""
    replay = _backwards.get(key)
    return replay(grad, x, mean, rstd, weight) if replay else replay


def norm_backward_key(centered: bool, grad, x, mean, rstd, weight, ndim: int, need_weight_grad: bool,
                      need_bias_grad: bool) -> tuple:
    return (centered, ndim, need_weight_grad, need_bias_grad, layout(grad), layout(x), layout(mean), layout(rstd),
            layout(weight))


def remember_norm_backward(key: tuple, centered: bool, grad, x, mean, rstd, weight, ndim: int,
                           need_weight_grad: bool, need_bias_grad: bool) -> None:
    """remember_norm_forward for the backward."""
    found = norm.remembered_backward("layer_norm_backward" if centered else "rms_norm_backward", to_cupy(grad),
                                     to_cupy(x), to_cupy(mean), to_cupy(rstd), to_cupy(weight), LAST_AXES[ndim],
                                     need_weight_grad, need_bias_grad)
    _keep(_backwards, key, False if found is None else _NormBackward(*found))


def fused_key(x, dy, lse, bias, mask, scalars: tuple, need_lse: bool) -> tuple:
    """The key of a fused softmax forward (dy and lse None) or backward: scalars (scale,
    causal, diagonal, dropout, dim) and the tensors' layouts."""
    return scalars, need_lse, layout(x), layout(dy), layout(lse), layout(bias), layout(mask)


def fused_forward(key: tuple, x, bias, mask, seed: int, offset: int):
    """(y, lse) by the replay kept under `key` (fused_key), lse None unless the call returns
    it; None (or False) where no replay is kept, as norm_forward."""
    ready = _fused.get(key)
    if not ready:
        return ready
    y = x.new_empty(ready.shape)
    lse = x.new_empty(ready.shape[:-1], dtype=torch.float32) if ready.return_lse else None
    ready.run_at((x.data_ptr(), 0, _address(bias), _address(mask)), y.data_ptr(), _address(lse), seed, offset)
    return y, lse


def fused_backward(key: tuple, grad, x, lse, bias, mask, seed: int, offset: int):
    """(dx,) by the replay kept under `key`; None (or False) where no replay is kept."""
    ready = _fused.get(key)
    if not ready:
        return ready
    dx = x.new_empty(ready.shape)
    ready.run_at((x.data_ptr(), grad.data_ptr(), _address(bias), _address(mask)), dx.data_ptr(), lse.data_ptr(),
                 seed, offset)
    return (dx,)


def remember_fused(key: tuple, x, dy, lse, bias, mask, scalars: tuple, need_lse: bool) -> None:
    """remember_norm_forward for the fused softmax's forward (dy and lse None) and backward."""
    found = fused_softmax.remembered_call(to_cupy(x), to_cupy(dy), to_cupy(lse), to_cupy(bias), to_cupy(mask),
                                          *scalars, need_lse)
    _keep(_fused, key, False if found is None else found)



def elementwise(function, args: tuple) -> tuple:
    """The outputs of `function` (a cupyops.fuse function) of args (tensors and numbers) as
    torch tensors, on CuPy's current stream: replayed on the tensors where the function
    remembers a launcher of their layouts, else through CuPy views."""
    key = (function, *(layout(a) if isinstance(a, torch.Tensor) else type(a) for a in args))
    launcher = _elementwise.get(key)
    if launcher:
        like = args[0]
        outputs = tuple(like.new_empty(shape, dtype=_TORCH_DTYPES[dtype]) for shape, dtype in launcher.outputs)
        launcher.launch_at(tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args),
                           tuple(output.data_ptr() for output in outputs))
        return outputs
    operands = tuple(to_cupy(a) if isinstance(a, torch.Tensor) else a for a in args)
    result = function.call(operands)
    if launcher is None:
        _keep(_elementwise, key, function.remembered(operands) or False)
    return tuple(map(to_torch, result)) if isinstance(result, tuple) else (to_torch(result),)


def softmax_op(op: str, tensors: tuple, dim: int):
    """cupyops' `op` (softmax, log_softmax or their backward) of tensors (x, or dy and y) along
    dim as a torch tensor, on CuPy's current stream: replayed on the tensors where cupyops
    remembers a call of their layouts, else through CuPy views."""
    key = (op, dim, *map(layout, tensors))
    ready = _softmax.get(key)
    if ready:
        result = tensors[0].new_empty(ready.shape, dtype=_TORCH_DTYPES[ready.dtype])
        ready.run_at(tuple(t.data_ptr() for t in tensors), result.data_ptr())
        return result
    operands = tuple(map(to_cupy, tensors))
    result = getattr(cupyops, op)(*operands, axis=dim)
    if ready is None:
        _keep(_softmax, key, softmax.remembered_call(op, operands, dim) or False)
    return to_torch(result)
