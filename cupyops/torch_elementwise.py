"""The named elementwise ops of cupyops.torch: each a cupyops.fuse function called on
tensors (replayed on their addresses from the second call of a layout, cupyops.torch_replay),
its registered custom op for torch.compile, and an autograd Function for eager calls."""
import torch
from torch.autograd.function import once_differentiable

import cupyops
from cupyops import fx, torch_replay
from cupyops.ops.activations import named_function
from cupyops.torch_bridge import CustomOp, needs_grad


def launch(function, *args):
    """`function` (a cupyops.fuse function) of args (tensors, the first one a tensor, and
    numbers) on torch's current stream: its output, or the tuple of its outputs."""
    outputs = torch_replay.elementwise(function, args)
    return outputs if len(outputs) > 1 else outputs[0]


def sum_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """grad summed over the axes `like` was broadcast along, in like's dtype."""
    return grad.sum_to_size(like.shape).to(like.dtype)


def elementwise_fake(*operands):
    """The empty result of an elementwise op: the operands' broadcast shape, promoted dtype."""
    shape = torch.broadcast_shapes(*(t.shape for t in operands))
    dtype = operands[0].dtype
    for t in operands[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return operands[0].new_empty(shape, dtype=dtype)


def _call_custom(op: CustomOp, *args):
    return op.custom(*args)


def _call_eager(op: CustomOp, *args):
    return op.implementation(*args)


class ElementwiseOp:
    """A named elementwise op of `saved` tensor operands (and scalars after them): computed by
    the cupyops.fuse function function(*scalars) returns with the kernel scalars it takes
    after the operands, differentiated by gradient(call, grad, *operands, *scalars) -> a
    gradient per operand, where call(op, *args) runs a backward CustomOp (its custom op under
    torch.compile, its implementation eagerly). `op` is the registered custom op."""

    def __init__(self, name: str, schema: str, function, gradient, saved: int):
        self.function, self.gradient, self.saved = function, gradient, saved
        self.op = CustomOp(name, schema, self.plain, lambda *args: elementwise_fake(*args[:saved]))

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:saved])
            ctx.scalars = inputs[saved:]

        self.op.differentiable(setup_context, lambda ctx, grad: self.backward(_call_custom, ctx, grad))

    def plain(self, *args) -> torch.Tensor:
        function, scalars = self.function(*args[self.saved:])
        return launch(function, *args[:self.saved], *scalars)

    def backward(self, call, ctx, grad) -> tuple:
        """The gradient of each operand (summed to its shape) and None for each scalar."""
        operands = ctx.saved_tensors
        if grad is None:
            return (None,) * (len(operands) + len(ctx.scalars))
        grads = self.gradient(call, grad, *operands, *ctx.scalars)
        return (*(sum_to(g, t) for g, t in zip(grads, operands)), *(None for _ in ctx.scalars))

    def __call__(self, *args) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.op(*args)
        if needs_grad(*args[:self.saved]):
            return _ElementwiseFunction.apply(self, *args)
        return self.plain(*args)


class _ElementwiseFunction(torch.autograd.Function):
    """An ElementwiseOp (the first argument) of its operands and scalars, eagerly."""

    @staticmethod
    def forward(ctx, op, *args):
        ctx.op, ctx.scalars = op, args[op.saved:]
        ctx.save_for_backward(*args[:op.saved])
        return op.plain(*args)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return None, *ctx.op.backward(_call_eager, ctx, grad)


# -- the named ops ----------------------------------------------------------------------------

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
_bias_silu_dz = cupyops.fuse(lambda g, x, bias: g * _silu_derivative(x + bias))
_swiglu_dadb = cupyops.fuse(lambda g, a, b: (g * b * _silu_derivative(a), g * a * fx.sigmoid(a)))
_silu_backward = CustomOp(
    "silu_backward", "(Tensor grad, Tensor x, Tensor bias) -> Tensor",
    lambda grad, x, bias: launch(_bias_silu_dz, grad, x, bias),
    lambda grad, x, bias: elementwise_fake(grad, x, bias))
_swiglu_backward = CustomOp(
    "swiglu_backward", "(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)",
    lambda grad, a, b: launch(_swiglu_dadb, grad, a, b),
    lambda grad, a, b: (elementwise_fake(grad, a, b), elementwise_fake(grad, a, b)))


def _silu_gradient(call, grad, x, bias):
    dz = call(_silu_backward, grad, x, bias)
    return dz, dz


def _swiglu_gradient(call, grad, a, b):
    return call(_swiglu_backward, grad, a, b)


# dropout(g) with the mask of g's shape: the gradient of bias_dropout_add's x + bias
_dropout = cupyops.fuse(lambda g, p, seed, offset: fx.dropout(g, p, seed, offset))
_dropout_gradient_op = CustomOp(
    "dropout_gradient", "(Tensor grad, float p, int seed, int offset) -> Tensor",
    lambda grad, p, seed, offset: launch(_dropout, grad, p, seed, offset),
    lambda grad, p, seed, offset: torch.empty_like(grad, memory_format=torch.contiguous_format))


def _bias_dropout_add_gradient(call, grad, x, bias, residual, p, seed, offset):
    dz = call(_dropout_gradient_op, grad, p, seed, offset)
    return dz, dz, grad


def _named(op: str):
    """An ElementwiseOp's function for cupyops' named op `op`: its fused function (of the
    approximation given, for the GELU ones), no kernel scalars."""
    return lambda *approximate: (named_function(op, *approximate), ())


bias_gelu_op = ElementwiseOp("bias_gelu", "(Tensor x, Tensor bias, str approximate) -> Tensor",
                             _named("bias_gelu"), _gelu_gradient, 2)
bias_silu_op = ElementwiseOp("bias_silu", "(Tensor x, Tensor bias) -> Tensor", _named("bias_silu"),
                             _silu_gradient, 2)
swiglu_op = ElementwiseOp("swiglu", "(Tensor a, Tensor b) -> Tensor", _named("swiglu"), _swiglu_gradient, 2)
geglu_op = ElementwiseOp("geglu", "(Tensor a, Tensor b, str approximate) -> Tensor", _named("geglu"),
                         _geglu_gradient, 2)
bias_dropout_add_op = ElementwiseOp(
    "bias_dropout_add", "(Tensor x, Tensor bias, Tensor residual, float p, int seed, int offset) -> Tensor",
    lambda p, seed, offset: (named_function("bias_dropout_add"), (fx.check_dropout_p(p), int(seed), int(offset))),
    _bias_dropout_add_gradient, 3)
