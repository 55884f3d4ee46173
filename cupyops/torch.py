"""cupyops for torch tensors: autograd functions and drop-in modules.

`import cupyops.torch` (torch needed; `import cupyops` never imports it)
registers the ops as torch.library custom ops in the "cupyops" namespace
(torch.ops.cupyops.*), each with a fake implementation for torch.compile
and its backward through cupyops' own backward kernels (or torch formulas
for the elementwise ops), so `torch.compile(model, fullgraph=True)` captures
a model using them without a graph break. Eager calls skip torch's
dispatcher: they run the same implementation directly, through a
torch.autograd.Function where an input needs a gradient (the same kernels,
outputs and gradients). The ops run on torch's current stream of the
tensors' GPU, read torch's memory in place and return their outputs
through DLPack, without copies; outputs are torch tensors. CPU
tensors take torch's own ops (but for the dropout ops, whose keep masks are
cupyops' own).

Functions: softmax, log_softmax, layer_norm, rms_norm (with an optional
residual added first), fused_softmax, bias_gelu, bias_silu, swiglu, geglu,
bias_dropout_add (each where cupyops has the op). Modules: LayerNorm,
RMSNorm (drop-in for torch.nn.LayerNorm / torch.nn.RMSNorm: the same
arguments, parameters and state_dict keys) and FusedSoftmax.
"""
import contextlib
import functools
from typing import Optional, Sequence, Union

import cupy
import numpy
import torch
from torch.autograd.function import once_differentiable

import cupyops
from cupyops import fx
from cupyops.dtypes import BFLOAT16

_ShapeLike = Union[int, Sequence[int], torch.Size]

# -- torch <-> cupy --------------------------------------------------------------------------

_NUMPY_DTYPES = {torch.float16: numpy.dtype(numpy.float16), torch.bfloat16: BFLOAT16,
                 torch.float32: numpy.dtype(numpy.float32), torch.float64: numpy.dtype(numpy.float64),
                 torch.bool: numpy.dtype(numpy.bool_), torch.int8: numpy.dtype(numpy.int8),
                 torch.uint8: numpy.dtype(numpy.uint8), torch.int16: numpy.dtype(numpy.int16),
                 torch.int32: numpy.dtype(numpy.int32), torch.int64: numpy.dtype(numpy.int64)}
_INT16 = numpy.dtype(numpy.int16)
_MAX_VIEWS = 1024
_views: dict = {}     # (pointer, dtype, shape, strides, GPU) -> a CuPy view of that memory
_streams: dict = {}   # (GPU, torch's raw stream pointer) -> cupy.cuda.ExternalStream


def _to_cupy(tensor: Optional[torch.Tensor]):
    """A CuPy view of a CUDA tensor's memory, built from its pointer, shape and strides: no copy
    and, unlike DLPack, no per-call stream handshake. Views are kept by layout and owned by
    nobody (the caller's tensor keeps the memory alive for the call; a view outliving its
    tensor is never read, since ops return only memory they allocated)."""
    if tensor is None:
        return None
    key = (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(), tensor.get_device())
    view = _views.get(key)
    if view is None:
        dtype = _NUMPY_DTYPES.get(tensor.dtype)
        if dtype is None or not tensor.is_cuda:
            raise TypeError(f"cupyops takes CUDA tensors of {', '.join(map(str, _NUMPY_DTYPES))}, "
                            f"got {tensor.dtype} on {tensor.device}")
        pointer, _, shape, strides, device = key
        extent = 1 + sum((n - 1) * step for n, step in zip(shape, strides)) if all(shape) else 0
        memory = cupy.cuda.UnownedMemory(pointer, extent * dtype.itemsize, None, device)
        view = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0),
                            tuple(step * dtype.itemsize for step in strides))
        if len(_views) >= _MAX_VIEWS:
            _views.clear()
        _views[key] = view
    return view


def _to_torch(array) -> Optional[torch.Tensor]:
    """A torch tensor of a CuPy array's memory (contiguous, as the fake implementations say),
    through DLPack without a stream handshake: producer and consumer share torch's stream."""
    if array is None:
        return None
    if array.dtype == BFLOAT16:
        return torch._C._from_dlpack(array.view(_INT16).__dlpack__(stream=-1)).view(torch.bfloat16).contiguous()
    return torch._C._from_dlpack(array.__dlpack__(stream=-1)).contiguous()


def _stream(index: int):
    """torch's current stream of GPU `index` as a CuPy stream, wrapped once per stream (the
    raw pointer read as torch.compile's generated code reads it)."""
    pointer = torch._C._cuda_getCurrentRawStream(index)
    stream = _streams.get((index, pointer))
    if stream is None:
        stream = _streams[index, pointer] = cupy.cuda.ExternalStream(pointer, index)
    return stream


def _run(device: torch.device, compute):
    """compute() (cupy arrays, None or a tuple of them) with cupy's current
    device and stream those torch uses for `device`, as torch tensors."""
    index = device.index
    on_device = contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == index else cupy.cuda.Device(index)
    with on_device, _stream(index):
        result = compute()
    return tuple(map(_to_torch, result)) if isinstance(result, tuple) else _to_torch(result)


def _nothing(x: torch.Tensor) -> torch.Tensor:
    """The empty tensor standing for an output an op does not produce."""
    return x.new_empty(0)


def _output_grad(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """An output's gradient in like's dtype: zeros where autograd passes None (an unused output)."""
    return torch.zeros_like(like) if grad is None else grad.to(like.dtype)


class _Op:
    """cupyops::name, reached two ways. While torch.compile traces, the registered custom op
    (with its fake implementation, and its gradient calling the backward custom ops). In
    eager mode the implementation itself, without the dispatcher's per-call Python, through
    a torch.autograd.Function where an input needs a gradient, whose backward calls the
    backward ops' implementations: the same kernels, outputs and gradients either way."""

    def __init__(self, name: str, schema: str, implementation, fake):
        self.name, self.implementation, self.function = name, implementation, None
        self.custom = torch.library.custom_op(f"cupyops::{name}", implementation, mutates_args=(), schema=schema)
        self.custom.register_fake(fake)

    def differentiable(self, setup_context, gradient) -> "_Op":
        """Both ways differentiable. setup_context(ctx, inputs, output) saves what
        gradient(call, ctx, *output gradients) reads; it returns a gradient per input, running
        a backward _Op as call(op, *args) (the custom op traced, the implementation eager)."""
        self.custom.register_autograd(functools.partial(gradient, _call_custom), setup_context=setup_context)

        def eager_forward(ctx, *inputs):   # ctx first: Function.apply then binds no signature per call
            output = self.implementation(*inputs)
            ctx.set_materialize_grads(False)   # unused outputs' gradients stay None, not zeros
            setup_context(ctx, inputs, output)
            return output

        members = {"forward": staticmethod(eager_forward),
                   "backward": staticmethod(once_differentiable(functools.partial(gradient, _call_eager)))}
        self.function = type(f"cupyops_{self.name}", (torch.autograd.Function,), members)
        return self

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.custom(*args)
        if self.function is not None and torch.is_grad_enabled():
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.requires_grad:
                    return self.function.apply(*args)
        return self.implementation(*args)


def _call_custom(op: _Op, *args):
    return op.custom(*args)


def _call_eager(op: _Op, *args):
    return op.implementation(*args)


def _check_float(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"cupyops takes floating-point tensors, got {x.dtype}")


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- softmax, log_softmax --------------------------------------------------------------------

def _softmax_op(name: str):
    """cupyops::name and cupyops::name_backward, the first differentiable through the second."""
    forward, backward = getattr(cupyops, name), getattr(cupyops, f"{name}_backward")
    forward_op = _Op(name, "(Tensor x, int dim) -> Tensor",
                     lambda x, dim: _run(x.device, lambda: forward(_to_cupy(x), axis=dim)),
                     lambda x, dim: torch.empty_like(x, memory_format=torch.contiguous_format))
    backward_op = _Op(f"{name}_backward", "(Tensor grad, Tensor y, int dim) -> Tensor",
                      lambda grad, y, dim: _run(y.device, lambda: backward(_to_cupy(grad), _to_cupy(y), axis=dim)),
                      lambda grad, y, dim: torch.empty_like(y, memory_format=torch.contiguous_format))

    def setup_context(ctx, inputs, output):
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    def gradient(call, ctx, grad):
        y, = ctx.saved_tensors
        return call(backward_op, _output_grad(grad, y), y, ctx.dim), None

    return forward_op.differentiable(setup_context, gradient)


_softmax = _softmax_op("softmax")
_log_softmax = _softmax_op("log_softmax")


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.softmax(x, dim)`` by cupyops.softmax (backward: cupyops.softmax_backward)."""
    if not x.is_cuda:
        return torch.softmax(x, dim)
    _check_float(x)
    return _softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.log_softmax(x, dim)`` by cupyops.log_softmax (backward: cupyops.log_softmax_backward)."""
    if not x.is_cuda:
        return torch.log_softmax(x, dim)
    _check_float(x)
    return _log_softmax(x, dim)


# -- layer_norm, rms_norm --------------------------------------------------------------------
# Forward ops return (y, h, [mean,] rstd): h = x + residual, empty without a
# residual; backward ops (dx, dweight, [dbias]), empty where not wanted.

def _norm_forward(centered: bool, x, weight, bias, residual, ndim: int, eps: float):
    def compute():
        function = cupyops.layer_norm if centered else cupyops.rms_norm
        affine = (_to_cupy(weight), _to_cupy(bias)) if centered else (_to_cupy(weight),)
        return function(_to_cupy(x), *affine, axis=tuple(range(-ndim, 0)), eps=eps, residual=_to_cupy(residual),
                        return_stats=True)

    outputs = _run(x.device, compute)
    return (outputs[0], _nothing(x), *outputs[1:]) if residual is None else outputs


def _norm_forward_fake(centered: bool, x, residual, ndim: int):
    stats = [x.new_empty(x.shape[:x.dim() - ndim], dtype=_stats_dtype(x.dtype)) for _ in range(1 + centered)]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return (y, _nothing(x) if residual is None else torch.empty_like(y), *stats)


def _norm_backward(centered: bool, grad, x, mean, rstd, weight, ndim: int, need_weight_grad: bool,
                   need_bias_grad: bool):
    def compute():
        axes = tuple(range(-ndim, 0))
        if centered:
            return cupyops.layer_norm_backward(_to_cupy(grad), _to_cupy(x), _to_cupy(mean), _to_cupy(rstd),
                                               _to_cupy(weight), axis=axes, need_weight_grad=need_weight_grad,
                                               need_bias_grad=need_bias_grad)
        return cupyops.rms_norm_backward(_to_cupy(grad), _to_cupy(x), _to_cupy(rstd), _to_cupy(weight), axis=axes,
                                         need_weight_grad=need_weight_grad)

    return tuple(_nothing(x) if g is None else g for g in _run(x.device, compute))


def _norm_backward_fake(centered: bool, x, ndim: int, need_weight_grad: bool, need_bias_grad: bool):
    def grad(wanted: bool):
        return x.new_empty(x.shape[x.dim() - ndim:]) if wanted else _nothing(x)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return (dx, grad(need_weight_grad), grad(need_bias_grad)) if centered else (dx, grad(need_weight_grad))


_layer_norm = _Op(
    "layer_norm", "(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, int ndim, float eps) "
                  "-> (Tensor, Tensor, Tensor, Tensor)",
    lambda x, weight, bias, residual, ndim, eps: _norm_forward(True, x, weight, bias, residual, ndim, eps),
    lambda x, weight, bias, residual, ndim, eps: _norm_forward_fake(True, x, residual, ndim))
_rms_norm = _Op(
    "rms_norm", "(Tensor x, Tensor? weight, Tensor? residual, int ndim, float eps) -> (Tensor, Tensor, Tensor)",
    lambda x, weight, residual, ndim, eps: _norm_forward(False, x, weight, None, residual, ndim, eps),
    lambda x, weight, residual, ndim, eps: _norm_forward_fake(False, x, residual, ndim))
_layer_norm_backward = _Op(
    "layer_norm_backward", "(Tensor grad, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, int ndim, "
                           "bool need_weight_grad, bool need_bias_grad) -> (Tensor, Tensor, Tensor)",
    lambda grad, x, mean, rstd, weight, ndim, need_w, need_b: _norm_backward(True, grad, x, mean, rstd, weight,
                                                                             ndim, need_w, need_b),
    lambda grad, x, mean, rstd, weight, ndim, need_w, need_b: _norm_backward_fake(True, x, ndim, need_w, need_b))
_rms_norm_backward = _Op(
    "rms_norm_backward", "(Tensor grad, Tensor x, Tensor rstd, Tensor? weight, int ndim, bool need_weight_grad) "
                         "-> (Tensor, Tensor)",
    lambda grad, x, rstd, weight, ndim, need_w: _norm_backward(False, grad, x, None, rstd, weight, ndim, need_w,
                                                               False),
    lambda grad, x, rstd, weight, ndim, need_w: _norm_backward_fake(False, x, ndim, need_w, False))


def _norm_setup(ctx, inputs, output):
    """Saves what the backward reads: the normalised input (h with a residual), weight and the statistics."""
    x, weight, *_, residual, ndim, eps = inputs
    ctx.ndim, ctx.residual = ndim, residual is not None
    ctx.save_for_backward(output[1] if ctx.residual else x, weight, *output[2:])


def _layer_norm_gradient(call, ctx, grad_y, grad_h, grad_mean, grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_weight_grad = weight is not None and ctx.needs_input_grad[1]
    need_bias_grad = ctx.needs_input_grad[2]
    dx, dweight, dbias = call(_layer_norm_backward, _output_grad(grad_y, x), x, mean, rstd, weight, ctx.ndim,
                              need_weight_grad, need_bias_grad)
    if ctx.residual and grad_h is not None:
        dx = dx + grad_h
    return (dx, dweight if need_weight_grad else None, dbias if need_bias_grad else None,
            dx if ctx.residual else None, None, None)


def _rms_norm_gradient(call, ctx, grad_y, grad_h, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_weight_grad = weight is not None and ctx.needs_input_grad[1]
    dx, dweight = call(_rms_norm_backward, _output_grad(grad_y, x), x, rstd, weight, ctx.ndim, need_weight_grad)
    if ctx.residual and grad_h is not None:
        dx = dx + grad_h
    return dx, dweight if need_weight_grad else None, dx if ctx.residual else None, None, None


_layer_norm.differentiable(_norm_setup, _layer_norm_gradient)
_rms_norm.differentiable(_norm_setup, _rms_norm_gradient)


def _normalized_ndim(x: torch.Tensor, normalized_shape: _ShapeLike) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(x.shape[x.dim() - len(shape):]) != shape or len(shape) > x.dim():
        raise ValueError(f"normalized_shape {list(shape)} is not the trailing shape of the input {list(x.shape)}")
    return len(shape)


def _like(value: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
    """weight / bias in x's dtype (cupyops reads them so; autograd casts their gradients back)."""
    return value if value is None or value.dtype == x.dtype else value.to(x.dtype)


def layer_norm(x: torch.Tensor, normalized_shape: _ShapeLike, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, residual: Optional[torch.Tensor] = None):
    """``torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)`` by cupyops.layer_norm.

    With `residual`, ``h = x + residual`` is normalised in the same kernel
    and ``(y, h)`` returned. Backward: cupyops.layer_norm_backward (dweight /
    dbias only where wanted)."""
    if not x.is_cuda:
        h = x if residual is None else x + residual
        y = torch.nn.functional.layer_norm(h, normalized_shape, weight, bias, eps)
        return y if residual is None else (y, h)
    _check_float(x)
    outputs = _layer_norm(x, _like(weight, x), _like(bias, x), residual, _normalized_ndim(x, normalized_shape),
                          float(eps))
    return outputs[0] if residual is None else (outputs[0], outputs[1])


def rms_norm(x: torch.Tensor, normalized_shape: _ShapeLike, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None, residual: Optional[torch.Tensor] = None):
    """``torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)`` by cupyops.rms_norm.

    eps None: ``torch.finfo(x.dtype).eps``, as torch. `residual` as for
    :func:`layer_norm`. Backward: cupyops.rms_norm_backward."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    if not x.is_cuda:
        h = x if residual is None else x + residual
        y = torch.nn.functional.rms_norm(h, normalized_shape, weight, eps)
        return y if residual is None else (y, h)
    _check_float(x)
    outputs = _rms_norm(x, _like(weight, x), residual, _normalized_ndim(x, normalized_shape), float(eps))
    return outputs[0] if residual is None else (outputs[0], outputs[1])


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` (same arguments, parameters, state_dict) computed by cupyops."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` (same arguments, parameters, state_dict) computed by cupyops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


# -- elementwise ------------------------------------------------------------------------------

def _sum_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """grad summed over the axes `like` was broadcast along, in like's dtype."""
    return grad.sum_to_size(like.shape).to(like.dtype)


def _elementwise_fake(*operands):
    shape = torch.broadcast_shapes(*(t.shape for t in operands))
    dtype = operands[0].dtype
    for t in operands[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return operands[0].new_empty(shape, dtype=dtype)


def _elementwise_op(name: str, schema: str, compute, gradient, saved: int):
    """cupyops::name of `saved` tensor operands (and scalars after them),
    computed by compute(*cupy operands, *scalars), differentiated by
    gradient(call, grad, *operands, *scalars) -> a gradient per operand (call: as _Op.differentiable's)."""
    op = _Op(name, schema,
             lambda *args: _run(args[0].device, lambda: compute(*map(_to_cupy, args[:saved]), *args[saved:])),
             lambda *args: _elementwise_fake(*args[:saved]))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:saved])
        ctx.scalars = inputs[saved:]

    def backward(call, ctx, grad):
        operands = ctx.saved_tensors
        if grad is None:
            return (None,) * (len(operands) + len(ctx.scalars))
        grads = gradient(call, grad, *operands, *ctx.scalars)
        return (*(_sum_to(g, t) for g, t in zip(grads, operands)), *(None for _ in ctx.scalars))

    return op.differentiable(setup_context, backward)


def _gelu_gradient(call, grad, x, bias, approximate):
    dz = torch.ops.aten.gelu_backward(grad, x + bias, approximate=approximate)
    return dz, dz


def _geglu_gradient(call, grad, a, b, approximate):
    return (torch.ops.aten.gelu_backward(grad * b, a.to(grad.dtype), approximate=approximate),
            grad * torch.nn.functional.gelu(a.to(grad.dtype), approximate=approximate))


def _silu_derivative(a):
    """d silu(a) / da = sigmoid(a) * (1 + a * (1 - sigmoid(a)))."""
    s = fx.sigmoid(a)
    return s * (1 + a * (1 - s))


# The silu gradients, each one cupyops kernel: bias_silu's dz (x + bias's), swiglu's (da, db)
_silu_backward = _Op(
    "silu_backward", "(Tensor grad, Tensor x, Tensor bias) -> Tensor",
    lambda grad, x, bias: _run(grad.device, lambda: _bias_silu_dz(_to_cupy(grad), _to_cupy(x), _to_cupy(bias))),
    lambda grad, x, bias: _elementwise_fake(grad, x, bias))
_swiglu_backward = _Op(
    "swiglu_backward", "(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)",
    lambda grad, a, b: _run(grad.device, lambda: _swiglu_dadb(_to_cupy(grad), _to_cupy(a), _to_cupy(b))),
    lambda grad, a, b: (_elementwise_fake(grad, a, b), _elementwise_fake(grad, a, b)))
_bias_silu_dz = cupyops.fuse(lambda g, x, bias: g * _silu_derivative(x + bias))
_swiglu_dadb = cupyops.fuse(lambda g, a, b: (g * b * _silu_derivative(a), g * a * fx.sigmoid(a)))


def _silu_gradient(call, grad, x, bias):
    dz = call(_silu_backward, grad, x, bias)
    return dz, dz


def _swiglu_gradient(call, grad, a, b):
    return call(_swiglu_backward, grad, a, b)


# dropout(g) with the mask of g's shape: the gradient of bias_dropout_add's x + bias
_dropout = cupyops.fuse(lambda g, p, seed, offset: fx.dropout(g, p, seed, offset))
_dropout_gradient_op = _Op(
    "dropout_gradient", "(Tensor grad, float p, int seed, int offset) -> Tensor",
    lambda grad, p, seed, offset: _run(grad.device, lambda: _dropout(_to_cupy(grad), p, seed, offset)),
    lambda grad, p, seed, offset: torch.empty_like(grad, memory_format=torch.contiguous_format))


def _bias_dropout_add_gradient(call, grad, x, bias, residual, p, seed, offset):
    dz = call(_dropout_gradient_op, grad, p, seed, offset)
    return dz, dz, grad


_bias_gelu = _elementwise_op("bias_gelu", "(Tensor x, Tensor bias, str approximate) -> Tensor",
                             lambda x, bias, approximate: cupyops.bias_gelu(x, bias, approximate), _gelu_gradient, 2)
_bias_silu = _elementwise_op("bias_silu", "(Tensor x, Tensor bias) -> Tensor", cupyops.bias_silu, _silu_gradient, 2)
_swiglu = _elementwise_op("swiglu", "(Tensor a, Tensor b) -> Tensor", cupyops.swiglu, _swiglu_gradient, 2)
_geglu = _elementwise_op("geglu", "(Tensor a, Tensor b, str approximate) -> Tensor",
                         lambda a, b, approximate: cupyops.geglu(a, b, approximate), _geglu_gradient, 2)
_bias_dropout_add = _elementwise_op(
    "bias_dropout_add", "(Tensor x, Tensor bias, Tensor residual, float p, int seed, int offset) -> Tensor",
    cupyops.bias_dropout_add, _bias_dropout_add_gradient, 3)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``torch.nn.functional.gelu(x + bias, approximate=approximate)`` in one cupyops kernel."""
    if not x.is_cuda:
        return torch.nn.functional.gelu(x + bias, approximate=approximate)
    return _bias_gelu(x, bias, approximate)


def bias_silu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.silu(x + bias)`` in one cupyops kernel."""
    return torch.nn.functional.silu(x + bias) if not x.is_cuda else _bias_silu(x, bias)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.silu(a) * b`` in one cupyops kernel."""
    return torch.nn.functional.silu(a) * b if not a.is_cuda else _swiglu(a, b)


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``torch.nn.functional.gelu(a, approximate=approximate) * b`` in one cupyops kernel."""
    if not a.is_cuda:
        return torch.nn.functional.gelu(a, approximate=approximate) * b
    return _geglu(a, b, approximate)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float, seed: int,
                     offset: int = 0) -> torch.Tensor:
    """``residual + torch.nn.functional.dropout(x + bias, p)`` in one cupyops kernel, the keep
    mask a function of (output shape, p, seed, offset) (cupyops.bias_dropout_add)."""
    return _bias_dropout_add(x, bias, residual, float(p), int(seed), int(offset))


# -- fused softmax ----------------------------------------------------------------------------

_FUSED_SCALARS = "float scale, bool causal, int diagonal, float dropout, int dim"


def _fused_softmax_op():
    """cupyops::fused_softmax -> (y, lse: empty unless need_lse), differentiable in x and bias
    through cupyops::fused_softmax_backward. rng: [seed, offset] (int64, on the CPU)."""
    def forward(x, bias, mask, rng, scale, causal, diagonal, dropout, dim, need_lse):
        seed, offset = rng.tolist()

        def compute():
            result = cupyops.fused_softmax(_to_cupy(x), scale=scale, bias=_to_cupy(bias), mask=_to_cupy(mask),
                                           causal=causal, diagonal=diagonal, dropout=dropout, seed=seed,
                                           offset=offset, axis=dim, return_lse=need_lse)
            return result if need_lse else (result, None)

        y, lse = _run(x.device, compute)
        return y, _nothing(x) if lse is None else lse

    def forward_fake(x, bias, mask, rng, scale, causal, diagonal, dropout, dim, need_lse):
        rows = list(x.shape)
        del rows[dim]
        lse = x.new_empty(rows, dtype=torch.float32) if need_lse else _nothing(x)
        return torch.empty_like(x, memory_format=torch.contiguous_format), lse

    def backward(grad, x, lse, bias, mask, rng, scale, causal, diagonal, dropout, dim):
        seed, offset = rng.tolist()
        return _run(x.device, lambda: cupyops.fused_softmax_backward(
            _to_cupy(grad), _to_cupy(x), _to_cupy(lse), scale=scale, bias=_to_cupy(bias), mask=_to_cupy(mask),
            causal=causal, diagonal=diagonal, dropout=dropout, seed=seed, offset=offset, axis=dim))

    forward_op = _Op("fused_softmax", f"(Tensor x, Tensor? bias, Tensor? mask, Tensor rng, {_FUSED_SCALARS}, "
                                      "bool need_lse) -> (Tensor, Tensor)", forward, forward_fake)
    backward_op = _Op("fused_softmax_backward", "(Tensor grad, Tensor x, Tensor lse, Tensor? bias, Tensor? mask, "
                                                f"Tensor rng, {_FUSED_SCALARS}) -> Tensor", backward,
                      lambda grad, x, *args: torch.empty_like(x, memory_format=torch.contiguous_format))

    def setup_context(ctx, inputs, output):
        x, bias, mask, rng, *scalars = inputs
        ctx.scalars = scalars[:-1]   # need_lse is the forward's alone
        ctx.save_for_backward(x, output[1], bias, mask, rng)

    def gradient(call, ctx, grad_y, grad_lse):
        x, lse, bias, mask, rng = ctx.saved_tensors
        dx = call(backward_op, _output_grad(grad_y, x), x, lse, bias, mask, rng, *ctx.scalars)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:   # dx / scale summed over bias's broadcast axes
            dbias = (dx.float() / ctx.scalars[0]).sum_to_size(bias.shape).to(bias.dtype)
        return dx, dbias, *(None for _ in range(8))

    return forward_op.differentiable(setup_context, gradient)


def _fused_softmax_call(x, bias, mask, rng, scale, causal, diagonal, dropout, dim) -> torch.Tensor:
    _check_float(x)
    need_lse = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    return _fused_softmax(x, bias, mask, rng, float(scale), bool(causal), int(diagonal), float(dropout), int(dim),
                          need_lse)[0]


if hasattr(cupyops, "fused_softmax") and hasattr(cupyops, "fused_softmax_backward"):
    _fused_softmax = _fused_softmax_op()

    def fused_softmax(x: torch.Tensor, *, scale: float = 1.0, bias: Optional[torch.Tensor] = None,
                      mask: Optional[torch.Tensor] = None, causal: bool = False, diagonal: int = 0,
                      dropout: float = 0.0, seed: int = 0, offset: int = 0, dim: int = -1) -> torch.Tensor:
        """dropout(softmax(x * scale + bias, masked -inf), dim) by cupyops.fused_softmax: torch's
        ``F.dropout(torch.softmax((x * scale + bias).masked_fill(~mask, -inf), dim), dropout)``
        (causal: also masked above the `diagonal`-th diagonal), the keep mask a function of
        (x.shape, dropout, seed, offset). Differentiable in x and bias (dbias: dx / scale
        summed over bias's broadcast axes)."""
        rng = torch.tensor([seed, offset], dtype=torch.int64)
        return _fused_softmax_call(x, bias, mask, rng, scale, causal, diagonal, dropout, dim)

    class FusedSoftmax(torch.nn.Module):
        """Attention probabilities: :func:`fused_softmax` of scores with an optional bias and
        mask given to forward; dropout in training with a fresh seed each call (torch's CPU
        generator), none in eval, as ``torch.nn.Dropout(p)(torch.softmax(...))``."""

        def __init__(self, dim: int = -1, scale: float = 1.0, causal: bool = False, diagonal: int = 0,
                     dropout: float = 0.0):
            super().__init__()
            self.dim, self.scale, self.causal, self.diagonal, self.dropout = dim, scale, causal, diagonal, dropout

        def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    mask: Optional[torch.Tensor] = None) -> torch.Tensor:
            p = self.dropout if self.training else 0.0
            rng = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64) if p else torch.zeros(2, dtype=torch.int64)
            return _fused_softmax_call(x, bias, mask, rng, self.scale, self.causal, self.diagonal, p, self.dim)

        def extra_repr(self) -> str:
            return (f"dim={self.dim}, scale={self.scale}, causal={self.causal}, diagonal={self.diagonal}, "
                    f"dropout={self.dropout}")
