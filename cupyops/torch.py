"""cupyops for torch tensors: autograd functions and drop-in modules.

`import cupyops.torch` (torch needed; `import cupyops` never imports it)
registers the ops as torch.library custom ops in the "cupyops" namespace
(torch.ops.cupyops.*), each with a fake implementation for torch.compile
and its backward through cupyops' own backward kernels (or torch formulas
for the elementwise ops), so `torch.compile(model, fullgraph=True)` captures
a model using them without a graph break. Eager calls skip torch's
dispatcher: where an input needs a gradient they run a torch.autograd.Function
of their own, which keeps what only its backward reads (the norms' mean and
rstd, the fused softmax's lse) on its context instead of returning them as
outputs; where none does, the bare computation. The same kernels, outputs
and gradients either way. The ops run on torch's current stream of the
tensors' GPU and read torch's memory in place. From the second call of a
layout every op launches cupyops' remembered kernels on the tensors'
addresses (where cupyops remembers one), its outputs allocated by torch
(torch_replay); other calls return outputs through DLPack, without
copies. CPU
tensors take torch's own ops (but for the dropout ops, whose keep masks are
cupyops' own).

Functions: softmax, log_softmax, layer_norm, rms_norm (with an optional
residual added first), fused_softmax, bias_gelu, bias_silu, swiglu, geglu,
bias_dropout_add (each where cupyops has the op). Modules: LayerNorm,
RMSNorm (drop-in for torch.nn.LayerNorm / torch.nn.RMSNorm: the same
arguments, parameters and state_dict keys) and FusedSoftmax.
"""
from typing import Optional, Sequence, Union

import torch
from torch.autograd.function import once_differentiable

import cupyops
from cupyops import torch_replay
from cupyops.torch_bridge import CustomOp, check_float, needs_grad, nothing, output_grad, stats_dtype
from cupyops.torch_elementwise import bias_dropout_add_op, bias_gelu_op, bias_silu_op, geglu_op, swiglu_op

_ShapeLike = Union[int, Sequence[int], torch.Size]


# -- softmax, log_softmax --------------------------------------------------------------------

_SOFTMAX = {False: ("softmax", "softmax_backward"), True: ("log_softmax", "log_softmax_backward")}   # log -> ops


def _softmax_op(name: str, log: bool) -> CustomOp:
    """cupyops::name, differentiable through cupyops::name_backward."""
    backward_op = CustomOp(f"{name}_backward", "(Tensor grad, Tensor y, int dim) -> Tensor",
                           lambda grad, y, dim: _softmax_grad(grad, y, dim, log),
                           lambda grad, y, dim: torch.empty_like(y, memory_format=torch.contiguous_format))

    def setup_context(ctx, inputs, output):
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    def gradient(ctx, grad):
        y, = ctx.saved_tensors
        return backward_op(output_grad(grad, y), y, ctx.dim), None

    return CustomOp(name, "(Tensor x, int dim) -> Tensor", lambda x, dim: _softmax_plain(x, dim, log),
                    lambda x, dim: torch.empty_like(x, memory_format=torch.contiguous_format)
                    ).differentiable(setup_context, gradient)


def _softmax_plain(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return torch_replay.softmax_op(_SOFTMAX[log][0], (x,), dim)


def _softmax_grad(grad: torch.Tensor, y: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """dx of softmax (log: log_softmax) from its output y, by cupyops' backward kernel."""
    return torch_replay.softmax_op(_SOFTMAX[log][1], (grad, y), dim)


class _Softmax(torch.autograd.Function):
    """softmax (log: log_softmax) of x along dim; backward by cupyops' kernel from y."""

    @staticmethod
    def forward(ctx, x, dim, log):
        y = _softmax_plain(x, dim, log)
        ctx.dim, ctx.log = dim, log
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, = ctx.saved_tensors
        return _softmax_grad(grad, y, ctx.dim, ctx.log), None, None


_SOFTMAX_OPS = {False: _softmax_op("softmax", False), True: _softmax_op("log_softmax", True)}


def _softmax_call(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    check_float(x)
    if torch.compiler.is_compiling():
        return _SOFTMAX_OPS[log](x, dim)
    return _Softmax.apply(x, dim, log) if needs_grad(x) else _softmax_plain(x, dim, log)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.softmax(x, dim)`` by cupyops.softmax (backward: cupyops.softmax_backward)."""
    return torch.softmax(x, dim) if not x.is_cuda else _softmax_call(x, dim, False)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.log_softmax(x, dim)`` by cupyops.log_softmax (backward: cupyops.log_softmax_backward)."""
    return torch.log_softmax(x, dim) if not x.is_cuda else _softmax_call(x, dim, True)


# -- layer_norm, rms_norm --------------------------------------------------------------------
# Custom ops: forward (y, h, [mean,] rstd), h = x + residual, empty without a residual;
# backward (dx, dweight, [dbias]), empty where not wanted.

def _norm_forward(centered: bool, x, weight, bias, residual, ndim: int, eps: float):
    y, h, mean, rstd = torch_replay.norm_forward(centered, x, weight, bias, residual, ndim, eps, True)
    return (y, nothing(x) if h is None else h, *((mean, rstd) if centered else (rstd,)))


def _norm_forward_fake(centered: bool, x, residual, ndim: int):
    stats = [x.new_empty(x.shape[:x.dim() - ndim], dtype=stats_dtype(x.dtype)) for _ in range(1 + centered)]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return (y, nothing(x) if residual is None else torch.empty_like(y), *stats)


def _norm_backward(centered: bool, grad, x, mean, rstd, weight, ndim: int, need_weight_grad: bool,
                   need_bias_grad: bool):
    dx, dweight, dbias = torch_replay.norm_backward(centered, grad, x, mean, rstd, weight, ndim, need_weight_grad,
                                                    need_bias_grad)
    grads = (dx, dweight, dbias) if centered else (dx, dweight)
    return tuple(nothing(x) if g is None else g for g in grads)


def _norm_backward_fake(centered: bool, x, ndim: int, need_weight_grad: bool, need_bias_grad: bool):
    def grad(wanted: bool):
        return x.new_empty(x.shape[x.dim() - ndim:]) if wanted else nothing(x)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return (dx, grad(need_weight_grad), grad(need_bias_grad)) if centered else (dx, grad(need_weight_grad))


_layer_norm_backward = CustomOp(
    "layer_norm_backward", "(Tensor grad, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, int ndim, "
                           "bool need_weight_grad, bool need_bias_grad) -> (Tensor, Tensor, Tensor)",
    lambda grad, x, mean, rstd, weight, ndim, need_w, need_b: _norm_backward(True, grad, x, mean, rstd, weight,
                                                                             ndim, need_w, need_b),
    lambda grad, x, mean, rstd, weight, ndim, need_w, need_b: _norm_backward_fake(True, x, ndim, need_w, need_b))
_rms_norm_backward = CustomOp(
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


def _layer_norm_gradient(ctx, grad_y, grad_h, grad_mean, grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_weight_grad = weight is not None and ctx.needs_input_grad[1]
    need_bias_grad = ctx.needs_input_grad[2]
    dx, dweight, dbias = _layer_norm_backward(output_grad(grad_y, x), x, mean, rstd, weight, ctx.ndim,
                                              need_weight_grad, need_bias_grad)
    if ctx.residual and grad_h is not None:
        dx = dx + grad_h
    return (dx, dweight if need_weight_grad else None, dbias if need_bias_grad else None,
            dx if ctx.residual else None, None, None)


def _rms_norm_gradient(ctx, grad_y, grad_h, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_weight_grad = weight is not None and ctx.needs_input_grad[1]
    dx, dweight = _rms_norm_backward(output_grad(grad_y, x), x, rstd, weight, ctx.ndim, need_weight_grad)
    if ctx.residual and grad_h is not None:
        dx = dx + grad_h
    return dx, dweight if need_weight_grad else None, dx if ctx.residual else None, None, None


_layer_norm = CustomOp(
    "layer_norm", "(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, int ndim, float eps) "
                  "-> (Tensor, Tensor, Tensor, Tensor)",
    lambda x, weight, bias, residual, ndim, eps: _norm_forward(True, x, weight, bias, residual, ndim, eps),
    lambda x, weight, bias, residual, ndim, eps: _norm_forward_fake(True, x, residual, ndim)
).differentiable(_norm_setup, _layer_norm_gradient)
_rms_norm = CustomOp(
    "rms_norm", "(Tensor x, Tensor? weight, Tensor? residual, int ndim, float eps) -> (Tensor, Tensor, Tensor)",
    lambda x, weight, residual, ndim, eps: _norm_forward(False, x, weight, None, residual, ndim, eps),
    lambda x, weight, residual, ndim, eps: _norm_forward_fake(False, x, residual, ndim)
).differentiable(_norm_setup, _rms_norm_gradient)


def _norm_plain(centered: bool, x, weight, bias, residual, ndim: int, eps: float):
    y, h, _, _ = torch_replay.norm_forward(centered, x, weight, bias, residual, ndim, eps, False)
    return y if residual is None else (y, h)


class _Norm(torch.autograd.Function):
    """layer_norm (centered) / rms_norm of x (+ residual) over its last ndim axes: y, or (y, h)
    with a residual. The statistics stay on ctx for the backward, not outputs."""

    @staticmethod
    def forward(ctx, centered, x, weight, bias, residual, ndim, eps):
        y, h, ctx.mean, ctx.rstd = torch_replay.norm_forward(centered, x, weight, bias, residual, ndim, eps, True)
        ctx.centered, ctx.ndim, ctx.residual = centered, ndim, residual is not None
        if residual is None:
            ctx.save_for_backward(x, weight)
            return y
        ctx.save_for_backward(h, weight)
        return y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_h=None):
        x, weight = ctx.saved_tensors
        need_weight_grad = weight is not None and ctx.needs_input_grad[2]
        need_bias_grad = ctx.centered and ctx.needs_input_grad[3]
        dx, dweight, dbias = torch_replay.norm_backward(ctx.centered, grad_y, x, ctx.mean, ctx.rstd, weight, ctx.ndim,
                                                        need_weight_grad, need_bias_grad)
        if grad_h is not None:
            dx = dx + grad_h
        return None, dx, dweight, dbias, dx if ctx.residual else None, None, None


def _norm_call(centered: bool, x, weight, bias, residual, ndim: int, eps: float):
    """y, or (y, h) with a residual, by the custom op, the Function or the bare computation."""
    check_float(x)
    if torch.compiler.is_compiling():
        outputs = (_layer_norm(x, weight, bias, residual, ndim, eps) if centered else
                   _rms_norm(x, weight, residual, ndim, eps))
        return outputs[0] if residual is None else (outputs[0], outputs[1])
    if needs_grad(x, weight, bias, residual):
        return _Norm.apply(centered, x, weight, bias, residual, ndim, eps)
    return _norm_plain(centered, x, weight, bias, residual, ndim, eps)


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
    return _norm_call(True, x, _like(weight, x), _like(bias, x), residual, _normalized_ndim(x, normalized_shape),
                      float(eps))


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
    return _norm_call(False, x, _like(weight, x), None, residual, _normalized_ndim(x, normalized_shape), float(eps))


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` (same arguments, parameters, state_dict) computed by cupyops."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` (same arguments, parameters, state_dict) computed by cupyops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


# -- elementwise ------------------------------------------------------------------------------

def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``torch.nn.functional.gelu(x + bias, approximate=approximate)`` in one cupyops kernel."""
    if not x.is_cuda:
        return torch.nn.functional.gelu(x + bias, approximate=approximate)
    return bias_gelu_op(x, bias, approximate)


def bias_silu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.silu(x + bias)`` in one cupyops kernel."""
    return torch.nn.functional.silu(x + bias) if not x.is_cuda else bias_silu_op(x, bias)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.silu(a) * b`` in one cupyops kernel."""
    return torch.nn.functional.silu(a) * b if not a.is_cuda else swiglu_op(a, b)


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``torch.nn.functional.gelu(a, approximate=approximate) * b`` in one cupyops kernel."""
    if not a.is_cuda:
        return torch.nn.functional.gelu(a, approximate=approximate) * b
    return geglu_op(a, b, approximate)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float, seed: int,
                     offset: int = 0) -> torch.Tensor:
    """``residual + torch.nn.functional.dropout(x + bias, p)`` in one cupyops kernel, the keep
    mask a function of (output shape, p, seed, offset) (cupyops.bias_dropout_add)."""
    return bias_dropout_add_op(x, bias, residual, float(p), int(seed), int(offset))


# -- fused softmax ----------------------------------------------------------------------------

_FUSED_SCALARS = "float scale, bool causal, int diagonal, float dropout, int dim"


def _fused_dbias(dx: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """dbias: dx / scale summed over bias's broadcast axes."""
    return (dx.float() / scale).sum_to_size(bias.shape).to(bias.dtype)


def _fused_softmax_op() -> CustomOp:
    """cupyops::fused_softmax -> (y, lse: empty unless need_lse), differentiable in x and bias
    through cupyops::fused_softmax_backward. rng: [seed, offset] (int64, on the CPU)."""
    def forward(x, bias, mask, rng, scale, causal, diagonal, dropout, dim, need_lse):
        seed, offset = rng.tolist()
        y, lse = torch_replay.fused_forward(x, bias, mask, (scale, causal, diagonal, dropout, dim), seed, offset,
                                            need_lse)
        return y, nothing(x) if lse is None else lse

    def forward_fake(x, bias, mask, rng, scale, causal, diagonal, dropout, dim, need_lse):
        rows = list(x.shape)
        del rows[dim]
        lse = x.new_empty(rows, dtype=torch.float32) if need_lse else nothing(x)
        return torch.empty_like(x, memory_format=torch.contiguous_format), lse

    def backward(grad, x, lse, bias, mask, rng, scale, causal, diagonal, dropout, dim):
        seed, offset = rng.tolist()
        return torch_replay.fused_backward(grad, x, lse, bias, mask, (scale, causal, diagonal, dropout, dim), seed,
                                           offset)

    backward_op = CustomOp("fused_softmax_backward",
                           "(Tensor grad, Tensor x, Tensor lse, Tensor? bias, Tensor? mask, "
                           f"Tensor rng, {_FUSED_SCALARS}) -> Tensor", backward,
                           lambda grad, x, *args: torch.empty_like(x, memory_format=torch.contiguous_format))

    def setup_context(ctx, inputs, output):
        x, bias, mask, rng, *scalars = inputs
        ctx.scalars = scalars[:-1]   # need_lse is the forward's alone
        ctx.save_for_backward(x, output[1], bias, mask, rng)

    def gradient(ctx, grad_y, grad_lse):
        x, lse, bias, mask, rng = ctx.saved_tensors
        dx = backward_op(output_grad(grad_y, x), x, lse, bias, mask, rng, *ctx.scalars)
        dbias = _fused_dbias(dx, bias, ctx.scalars[0]) if bias is not None and ctx.needs_input_grad[1] else None
        return dx, dbias, *(None for _ in range(8))

    return CustomOp("fused_softmax", f"(Tensor x, Tensor? bias, Tensor? mask, Tensor rng, {_FUSED_SCALARS}, "
                                     "bool need_lse) -> (Tensor, Tensor)", forward, forward_fake
                    ).differentiable(setup_context, gradient)


class _FusedSoftmax(torch.autograd.Function):
    """fused_softmax of x (bias, mask, the scalars (scale, causal, diagonal, dropout, dim) and
    seed and offset ints as cupyops.fused_softmax's); the lse stays on ctx, not an output, read
    by the backward."""

    @staticmethod
    def forward(ctx, x, bias, mask, scalars, seed, offset):
        y, ctx.lse = torch_replay.fused_forward(x, bias, mask, scalars, seed, offset, True)
        ctx.scalars, ctx.rng = scalars, (seed, offset)
        ctx.save_for_backward(x, bias, mask)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, bias, mask = ctx.saved_tensors
        dx = torch_replay.fused_backward(grad, x, ctx.lse, bias, mask, ctx.scalars, *ctx.rng)
        dbias = _fused_dbias(dx, bias, ctx.scalars[0]) if bias is not None and ctx.needs_input_grad[1] else None
        return dx, dbias, None, None, None, None


def _fused_softmax_call(x, bias, mask, scale, causal, diagonal, dropout, dim, rng) -> torch.Tensor:
    """fused_softmax by the custom op, the Function or the bare computation; rng: (seed,
    offset), or an int64 CPU tensor of the two (the custom op's form)."""
    check_float(x)
    scale, causal, diagonal, dropout, dim = float(scale), bool(causal), int(diagonal), float(dropout), int(dim)
    if torch.compiler.is_compiling():
        if not isinstance(rng, torch.Tensor):
            rng = torch.tensor(rng, dtype=torch.int64)
        need_lse = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        return _fused_softmax(x, bias, mask, rng, scale, causal, diagonal, dropout, dim, need_lse)[0]
    seed, offset = rng.tolist() if isinstance(rng, torch.Tensor) else map(int, rng)
    scalars = (scale, causal, diagonal, dropout, dim)
    if needs_grad(x, bias):
        return _FusedSoftmax.apply(x, bias, mask, scalars, seed, offset)
    return torch_replay.fused_forward(x, bias, mask, scalars, seed, offset, False)[0]


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
        return _fused_softmax_call(x, bias, mask, scale, causal, diagonal, dropout, dim, (seed, offset))

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
            rng = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64) if p else (0, 0)
            return _fused_softmax_call(x, bias, mask, self.scale, self.causal, self.diagonal, p, self.dim, rng)

        def extra_repr(self) -> str:
            return (f"dim={self.dim}, scale={self.scale}, causal={self.causal}, diagonal={self.diagonal}, "
                    f"dropout={self.dropout}")
