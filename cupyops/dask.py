"""cupyops on Dask arrays of CuPy chunks: each op runs block by block, on the
GPU of the block, and Dask schedules the blocks (dask-cuda's LocalCUDACluster,
one worker per GPU, or any Dask cluster). Needs the `dask` extra.

Every function only builds a graph: its results' dtype, chunks and meta (a
zero-size CuPy array made without touching a GPU) are known at once, nothing
runs until Dask computes. Arguments are checked as the graph is built
(TypeError for a Dask array of NumPy chunks, naming the argument).

- Row-wise ops (softmax family, norms, fused_softmax) map over blocks when
  each reduced axis lies in one chunk; where it does not, that axis is
  rechunked into one and a dask PerformanceWarning says how many bytes move.
- Elementwise ops broadcast and align chunks as Dask's elementwise operations
  do (dask.array.core.unify_chunks).
- Dropout (fused_softmax, bias_dropout_add, fx.dropout in fuse / elementwise)
  keeps the single-array op's mask: an element's Philox counter is its linear
  index in the whole array plus `offset`, so each block runs with `offset`
  plus its first element's index. That holds only for blocks that are one
  contiguous run of the whole array (cupyops.dask_chunks.slab_chunks); other
  chunkings are rechunked into such slabs first (with the same warning where
  bytes move).
- Norm backward: dweight / dbias partials of each block (the single-array
  op's, in x's dtype) summed over the blocks in the compute type in a fixed
  tree (dask.array.reduction): bit-identical run to run.
- conv2d_int8: the batch is split; every other axis is one chunk.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy

import cupyops
from cupyops import arrays, dtypes, fx, philox
from cupyops.dask_chunks import cupy_meta
from cupyops.ops import activations, conv_layout, norm_args
from cupyops.ops.conv2d_int8 import POLICIES as CONV_POLICIES
from cupyops.ops.elementwise import ArrayInfo, compiled_expression

try:
    import dask.array as da
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("cupyops.dask needs Dask: pip install 'cupyops[dask]'") from error

from cupyops.dask_graph import (BlockCall, BlockShift, Output, aligned, check_broadcast, check_like,  # noqa: E402
                                cupy_chunks, map_outputs, on_device_of, operand, run, whole, whole_right)

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm", "rms_norm",
           "layer_norm_backward", "rms_norm_backward", "fused_softmax", "fused_softmax_backward", "fuse",
           "elementwise", "bias_gelu", "bias_silu", "swiglu", "geglu", "bias_dropout_add", "conv2d_int8"]


# -- softmax family --------------------------------------------------------------------------------

def _softmax_forward(name: str, x, axis, policy: str):
    """cupyops.<name> (softmax, log_softmax) over the blocks of x."""
    x = cupy_chunks(x, "x")
    result_dtype = dtypes.result_dtype(x.dtype)
    arrays.check_policy(policy)
    x = whole(x, arrays.normalize_axes(axis, x.ndim), "x", name)
    return run(getattr(cupyops, name), ("x",), [x], [Output(result_dtype)], name, dict(axis=axis, policy=policy))[0]


def _softmax_backward(name: str, dy, y, axis, policy: str):
    """cupyops.<name> (softmax_backward, log_softmax_backward) over the blocks of dy and y."""
    dy, y = cupy_chunks(dy, "dy"), cupy_chunks(y, "y")
    dtypes.float_type(dy.dtype)
    arrays.check_policy(policy)
    if (dy.shape, dy.dtype) != (y.shape, y.dtype):
        raise ValueError(f"dy ({dy.shape}, {dy.dtype}) and y ({y.shape}, {y.dtype}) must have the same shape "
                         "and dtype")
    if dy.ndim == 0:
        raise ValueError("softmax gradients need at least one dimension")
    axes = arrays.normalize_axes(axis, dy.ndim)
    values = [whole(dy, axes, "dy", name), whole(y, axes, "y", name)]
    return run(getattr(cupyops, name), ("dy", "y"), values, [Output(dy.dtype)], name,
               dict(axis=axis, policy=policy))[0]


def softmax(x, axis=None, *, policy: str = "auto"):
    """cupyops.softmax over a Dask array of CuPy chunks (scipy.special.softmax(x, axis)):
    blocks mapped where each reduced axis lies in one chunk, else rechunked (with a warning)."""
    return _softmax_forward("softmax", x, axis, policy)


def log_softmax(x, axis=None, *, policy: str = "auto"):
    """cupyops.log_softmax over a Dask array of CuPy chunks (scipy.special.log_softmax(x, axis))."""
    return _softmax_forward("log_softmax", x, axis, policy)


def softmax_backward(dy, y, axis=-1, *, policy: str = "auto"):
    """cupyops.softmax_backward over Dask arrays: dx = (dy - sum(dy * y, axis)) * y."""
    return _softmax_backward("softmax_backward", dy, y, axis, policy)


def log_softmax_backward(dy, y, axis=-1, *, policy: str = "auto"):
    """cupyops.log_softmax_backward over Dask arrays: dx = dy - exp(y) * sum(dy, axis)."""
    return _softmax_backward("log_softmax_backward", dy, y, axis, policy)


# -- norms -----------------------------------------------------------------------------------------

def _norm_forward(name: str, x, weight, bias, axis, eps, residual, return_stats: bool, policy: str):
    """cupyops.<name> (layer_norm, rms_norm: no bias, rstd alone) over the blocks of x."""
    x = cupy_chunks(x, "x")
    dtypes.float_type(x.dtype)
    arrays.check_policy(policy)
    eps = norm_args.check_eps(eps)
    num_axes = norm_args.normalized_axes(x, axis)
    axes = tuple(range(x.ndim - num_axes, x.ndim))
    normalized_shape = x.shape[x.ndim - num_axes:]
    centered = name == "layer_norm"
    weight, bias = (whole_right(check_like(operand(v, n), n, normalized_shape, x.dtype), axes, x.ndim, n, name)
                    for v, n in ((weight, "weight"), (bias, "bias")))
    residual = whole(check_like(operand(residual, "residual"), "residual", x.shape, x.dtype), axes, "residual",
                     name)
    outputs = [Output(x.dtype)] + ([Output(x.dtype)] if residual is not None else [])
    if return_stats:
        outputs += [Output(norm_args.stats_dtype(x.dtype), dropped=axes)] * (2 if centered else 1)
    values = [whole(x, axes, "x", name), weight, residual] + ([bias] if centered else [])
    names = ("x", "weight", "residual") + (("bias",) if centered else ())
    results = run(getattr(cupyops, name), names, values, outputs, name,
                  dict(axis=axis, eps=eps, return_stats=bool(return_stats), policy=policy))
    return results[0] if len(results) == 1 else results


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False,
               policy: str = "auto"):
    """cupyops.layer_norm over a Dask array of CuPy chunks (torch.nn.functional.layer_norm over the
    trailing `axis`): y, (y, h) with a residual, and mean, rstd appended with return_stats.
    weight / bias: CuPy arrays or Dask arrays of the normalised shape; residual like x."""
    return _norm_forward("layer_norm", x, weight, bias, axis, eps, residual, return_stats, policy)


def rms_norm(x, weight=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False, policy: str = "auto"):
    """cupyops.rms_norm over a Dask array of CuPy chunks (torch.nn.functional.rms_norm); outputs as
    for layer_norm, rstd alone appended with return_stats."""
    return _norm_forward("rms_norm", x, weight, None, axis, eps, residual, return_stats, policy)


@dataclass(frozen=True)
class _NormGradients:
    """A norm backward on one block: dx, and each parameter gradient asked for
    as that block's partial, shaped (1,) * lead + normalised shape."""
    op: Callable
    lead: int

    def __call__(self, *args, **kwargs):
        dx, *grads = self.op(*args, **kwargs)
        partials = tuple(g.reshape((1,) * self.lead + g.shape) for g in grads if g is not None)
        return (dx, *partials) if partials else dx


def _cast(partial, axis, keepdims, to):
    with on_device_of([partial]):
        return partial.astype(to)


def _flat(blocks) -> list:
    """The blocks of dask.array.reduction's nested lists (no concatenation), in block order."""
    return [b for item in blocks for b in _flat(item)] if isinstance(blocks, list) else [blocks]


def _sum(partials, axis, keepdims, result=None):
    """partials (a nested list, each of the compute type) added one after the other, in block
    order, on the first one's GPU (others copied there); without the summed axes unless
    keepdims; cast to `result` where given."""
    import cupy

    first, *rest = _flat(partials)
    with on_device_of([first]):
        total = first.copy()
        for partial in rest:
            total += partial.copy() if isinstance(partial, cupy.ndarray) and partial.device != total.device else partial
        total = total if keepdims else total.reshape(total.shape[len(axis):])
        return total if result is None else total.astype(result)


def _ordered_sum(partials, num_lead: int, compute_dtype, dtype):
    """partials (a block per row block, shaped (1,) * num_lead + the normalised shape) summed
    over their leading axes in `compute_dtype`, in block order within each group of a fixed
    tree (dask.array.reduction, the blocks not concatenated), then cast to `dtype`. (No
    function here takes `dtype`, which dask.array.reduction would set to the result's.)"""
    if not num_lead:
        return partials
    return da.reduction(partials, functools.partial(_cast, to=compute_dtype), functools.partial(_sum, result=dtype),
                        combine=_sum, axis=tuple(range(num_lead)), dtype=dtype,
                        meta=cupy_meta(dtype, partials.ndim - num_lead), concatenate=False)


def _norm_backward(name: str, dy, x, mean, rstd, weight, axis, need_weight_grad: bool,
                   need_bias_grad: bool, policy: str):
    """cupyops.<name> (layer_norm_backward, rms_norm_backward: no mean, no dbias) over the blocks."""
    x, dy = cupy_chunks(x, "x"), cupy_chunks(dy, "dy")
    dtypes.float_type(x.dtype)
    arrays.check_policy(policy)
    check_like(dy, "dy", x.shape, x.dtype)
    num_axes = norm_args.normalized_axes(x, axis)
    lead = x.ndim - num_axes
    axes = tuple(range(lead, x.ndim))
    centered = name == "layer_norm_backward"
    weight = whole_right(check_like(operand(weight, "weight"), "weight", x.shape[lead:], x.dtype), axes, x.ndim,
                         "weight", name)
    stats = []
    for value, stat in ((mean, "mean"), (rstd, "rstd")) if centered else ((rstd, "rstd"),):
        value = check_like(operand(value, stat), stat, x.shape[:lead])
        if value is None:
            raise TypeError(f"{stat} must be the forward's statistic (return_stats=True), got None")
        stats.append(value[(Ellipsis,) + (None,) * num_axes])   # broadcast along the normalised axes
    wanted = [bool(need_weight_grad)] + ([bool(need_bias_grad)] if centered else [])
    values, chunks = aligned([whole(dy, axes, "dy", name), whole(x, axes, "x", name), *stats, weight])
    partial_chunks = tuple((1,) * len(sizes) for sizes in chunks[:lead]) + chunks[lead:]
    outputs = [Output(x.dtype)] + [Output(x.dtype, chunks=partial_chunks) for w in wanted if w]
    flags = dict(need_weight_grad=wanted[0], **({"need_bias_grad": wanted[1]} if centered else {}))
    names = ("dy", "x", *(["mean"] if centered else []), "rstd", "weight")
    call = BlockCall(_NormGradients(getattr(cupyops, name), lead), names, dict(axis=axis, policy=policy, **flags))
    dx, *partials = map_outputs(call, values, outputs, name)
    compute_dtype = norm_args.stats_dtype(x.dtype)
    grads = iter(_ordered_sum(p, lead, compute_dtype, x.dtype) for p in partials)
    return (dx, *(next(grads) if w else None for w in wanted))


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, axis=-1, need_weight_grad=True,
                        need_bias_grad=True, policy: str = "auto"):
    """cupyops.layer_norm_backward over Dask arrays: (dx, dweight, dbias). dweight / dbias: each
    block's partial (the single-array op's, in x's dtype) summed in float32 (float64 for float64)
    in a fixed order, bit-identical on every run; mean / rstd as layer_norm(return_stats=True)."""
    return _norm_backward("layer_norm_backward", dy, x, mean, rstd, weight, axis, need_weight_grad,
                          need_bias_grad, policy)


def rms_norm_backward(dy, x, rstd, weight=None, *, axis=-1, need_weight_grad=True, policy: str = "auto"):
    """cupyops.rms_norm_backward over Dask arrays: (dx, dweight), dweight as for layer_norm_backward."""
    return _norm_backward("rms_norm_backward", dy, x, None, rstd, weight, axis, need_weight_grad, False, policy)


# -- fused softmax ---------------------------------------------------------------------------------

def _fused_operands(x, bias, mask, causal, dropout, axis):
    """Checked arguments of fused_softmax: (x, bias, mask, dropout p, the reduced axis)."""
    x = cupy_chunks(x, "x")
    dtypes.float_type(x.dtype)
    if x.ndim == 0:
        raise ValueError("x must have at least one axis")
    (axis,) = arrays.normalize_axes(axis, x.ndim)
    if causal and (axis != x.ndim - 1 or x.ndim < 2):
        raise ValueError("causal needs x of at least 2 axes reduced over its last (axis=-1)")
    p = philox.check_dropout(dropout, "dropout")
    bias = check_broadcast(operand(bias, "bias"), "bias", x.shape)
    mask = check_broadcast(operand(mask, "mask"), "mask", x.shape)
    if bias is not None and bias.dtype not in dtypes.BY_DTYPE:
        raise TypeError(f"bias must have a float dtype, got {bias.dtype}")
    if mask is not None and mask.dtype != numpy.bool_:
        raise TypeError(f"mask must have bool, got {mask.dtype}")
    return x, bias, mask, p, axis


def _fused_call(op: Callable, token: str, names: tuple, values: list, outputs: list, *, scale, causal, diagonal,
                p, seed, offset, axis, policy, **flags):
    """op over blocks of `values` (followed by the scalar operands diagonal and offset), each
    block shifted: diagonal by its first row (causal), offset by its first element (dropout)."""
    arrays.check_policy(policy)
    ndim = values[0].ndim
    values = [whole_right(v, (axis,), ndim, name, token) for v, name in zip(values, names)]
    scalars = [int(diagonal), int(offset)]
    count = len(values)
    shift = functools.partial(BlockShift.of, linear=(count + 1,) if p else (), rows=(count,) if causal else ())
    kwargs = dict(scale=float(scale), causal=bool(causal), dropout=p, seed=int(seed), axis=axis, policy=policy,
                  **flags)
    return run(op, (*names, "diagonal", "offset"), values + scalars, outputs, token, kwargs,
               shift_for=shift, slabs_whole=(axis,) if p else None)


def fused_softmax(x, *, scale=1.0, bias=None, mask=None, causal=False, diagonal=0, dropout=0.0, seed=0,
                  offset=0, axis=-1, return_lse=False, policy: str = "auto"):
    """cupyops.fused_softmax over a Dask array of CuPy chunks: dropout(softmax(x * scale + bias,
    masked -inf)) with the single-array op's mask (blocks rechunked into slabs for dropout).
    bias / mask: Dask or CuPy arrays broadcasting to x. return_lse: also the float32 lse."""
    x, bias, mask, p, axis = _fused_operands(x, bias, mask, causal, dropout, axis)
    outputs = [Output(x.dtype)] + ([Output(numpy.dtype(numpy.float32), dropped=(axis,))] if return_lse else [])
    results = _fused_call(cupyops.fused_softmax, "fused_softmax", ("x", "bias", "mask"), [x, bias, mask], outputs,
                          scale=scale, causal=causal, diagonal=diagonal, p=p, seed=seed, offset=offset, axis=axis,
                          policy=policy, return_lse=bool(return_lse))
    return results if return_lse else results[0]


def _fused_softmax_backward_block(dy, x, lse, axis, **kwargs):
    """cupyops.fused_softmax_backward on one block, lse given with the reduced axis kept (size 1)."""
    return cupyops.fused_softmax_backward(dy, x, lse.reshape(lse.shape[:axis] + lse.shape[axis + 1:]),
                                          axis=axis, **kwargs)


def fused_softmax_backward(dy, x, lse, *, scale=1.0, bias=None, mask=None, causal=False, diagonal=0,
                           dropout=0.0, seed=0, offset=0, axis=-1, policy: str = "auto"):
    """cupyops.fused_softmax_backward over Dask arrays: dx from dy, x and the forward's lse
    (fused_softmax(..., return_lse=True)); pass the forward's arguments."""
    x, bias, mask, p, axis = _fused_operands(x, bias, mask, causal, dropout, axis)
    dy = check_like(cupy_chunks(dy, "dy"), "dy", x.shape, x.dtype)
    lse = check_like(operand(lse, "lse"), "lse", x.shape[:axis] + x.shape[axis + 1:])
    if lse is None:
        raise TypeError("lse must be the forward's log-sum-exp (return_lse=True), got None")
    return _fused_call(_fused_softmax_backward_block, "fused_softmax_backward", ("dy", "x", "lse", "bias", "mask"),
                       [dy, x, da.expand_dims(lse, axis), bias, mask], [Output(x.dtype)], scale=scale,
                       causal=causal, diagonal=diagonal, p=p, seed=seed, offset=offset, axis=axis,
                       policy=policy)[0]


# -- fused elementwise -----------------------------------------------------------------------------

def _trace_kind(value, name: str):
    """What a fused function is traced with for an operand: ArrayInfo of a Dask array, the
    type of a Python number, the dtype of a NumPy scalar."""
    if isinstance(value, da.Array):
        if not fx.supported(value.dtype):
            raise TypeError(f"{name} has dtype {value.dtype}; elementwise kernels take bool, integer and "
                            "float16 / bfloat16 / float32 / float64 arrays")
        return ArrayInfo.contiguous(value.dtype, value.shape)
    if type(value) in (bool, int, float):
        return type(value)
    if isinstance(value, numpy.generic) and fx.supported(value.dtype):
        return value.dtype
    raise TypeError(f"{name} ({type(value).__name__}) is neither a Dask array of CuPy chunks nor a Python or "
                    "NumPy number")


def _dropout_shift(positions: tuple, constant_offset: bool, chunks: tuple) -> BlockShift:
    if constant_offset and any(len(sizes) > 1 for sizes in chunks):
        raise ValueError("fx.dropout with a constant offset over several blocks: pass the offset as an "
                         "argument, so that each block's counters start at its first element")
    return BlockShift.of(chunks, linear=positions)


def _elementwise(op: Callable, traced, names: tuple, values: list, kwargs: dict, token: str):
    """op over the blocks of `values` (operands in the order `traced`, a FusedFunction, numbers them),
    one result per output of the traced expression; dropout's offsets moved to each block."""
    import cupy

    labels = [name or f"argument {i}" for i, name in enumerate(names)]
    values = [operand(v, label) if isinstance(v, (da.Array, cupy.ndarray)) else v
              for v, label in zip(values, labels)]
    kinds = tuple(_trace_kind(v, label) for v, label in zip(values, labels))
    shapes = [(label, v.shape) for v, label in zip(values, labels) if isinstance(v, da.Array)]
    if not shapes:
        raise TypeError(f"{token} needs at least one Dask array operand")
    try:
        numpy.broadcast_shapes(*(shape for _, shape in shapes))
    except ValueError:
        described = ", ".join(f"{label} {shape}" for label, shape in shapes)
        raise ValueError(f"operands cannot be broadcast together: {described}") from None
    roots = traced.trace(kinds)
    offsets = [node.args[3] for node in fx.nodes(roots) if node.op == "dropout"]
    positions = tuple(sorted({node.value for node in offsets if node.op == "operand"}))
    shift = functools.partial(_dropout_shift, positions, any(node.op != "operand" for node in offsets))
    outputs = [Output(numpy.dtype(root.dtype)) for root in roots]
    results = run(op, names, values, outputs, token, kwargs, shift_for=shift if offsets else None,
                  slabs_whole=() if offsets else None)
    return results[0] if len(results) == 1 else results


def _named(name: str, expression: str, operands: dict, **kwargs):
    """The named fused op cupyops.<name> over Dask arrays; `expression` is it in cupyops.elementwise's
    syntax, with the op's argument names (traced for the output dtype and dropout's offset)."""
    arrays.check_policy(kwargs["policy"])
    names = fx.parse(expression)[1]
    return _elementwise(getattr(cupyops, name), compiled_expression(expression), names,
                        [operands[n] for n in names], kwargs, name)


def _check_approximate(approximate: str) -> str:
    if approximate not in activations.APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {activations.APPROXIMATIONS}, got {approximate!r}")
    return approximate


def elementwise(expr: str, *, policy: str = "auto", **operands):
    """cupyops.elementwise over Dask arrays (and numbers): `expr` evaluated block by block on
    chunks aligned and broadcast as Dask's elementwise operations do; `a, b` gives two arrays."""
    arrays.check_policy(policy)
    names = fx.parse(expr)[1]
    missing = [name for name in names if name not in operands]
    unused = [name for name in operands if name not in names]
    if missing or unused:
        raise ValueError(f"elementwise expression {expr!r}: no operand for {missing}, unused operands {unused}")
    return _elementwise(functools.partial(cupyops.elementwise, expr), compiled_expression(expr), names,
                        [operands[n] for n in names], dict(policy=policy), "elementwise")


class _Fused:
    """cupyops.fuse(fn), traced where it is made; pickled as fn alone (a FusedFunction holds a
    lock and compiled kernels), so a Dask worker fuses it again."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.fused = cupyops.fuse(fn)

    def __reduce__(self):
        return _Fused, (self.fn,)

    def __call__(self, *args, **kwargs):
        return self.fused(*args, **kwargs)


def fuse(fn: Callable = None):
    """cupyops.fuse for Dask arrays: the decorated function takes Dask arrays of CuPy chunks and
    numbers and returns Dask arrays, one fused kernel a block. fx.dropout's offset must be an
    argument (each block's counters start at its first element)."""
    if fn is None:
        return fuse
    fused = _Fused(fn)
    token = getattr(fn, "__name__", "fused")

    @functools.wraps(fn)
    def call(*args, policy: str = "auto"):
        arrays.check_policy(policy)
        return _elementwise(fused, fused.fused, (None,) * len(args), list(args), dict(policy=policy), token)

    return call


def bias_gelu(x, bias, approximate: str = "none", *, policy: str = "auto"):
    """cupyops.bias_gelu over Dask arrays: torch.nn.functional.gelu(x + bias, approximate)."""
    return _named("bias_gelu", "gelu(x + bias)", dict(x=x, bias=bias),
                  approximate=_check_approximate(approximate), policy=policy)


def bias_silu(x, bias, *, policy: str = "auto"):
    """cupyops.bias_silu over Dask arrays: torch.nn.functional.silu(x + bias)."""
    return _named("bias_silu", "silu(x + bias)", dict(x=x, bias=bias), policy=policy)


def swiglu(a, b, *, policy: str = "auto"):
    """cupyops.swiglu over Dask arrays: torch.nn.functional.silu(a) * b."""
    return _named("swiglu", "silu(a) * b", dict(a=a, b=b), policy=policy)


def geglu(a, b, approximate: str = "none", *, policy: str = "auto"):
    """cupyops.geglu over Dask arrays: torch.nn.functional.gelu(a, approximate) * b."""
    return _named("geglu", "gelu(a) * b", dict(a=a, b=b), approximate=_check_approximate(approximate),
                  policy=policy)


def bias_dropout_add(x, bias, residual, p: float, seed: int, offset: int = 0, *, policy: str = "auto"):
    """cupyops.bias_dropout_add over Dask arrays: residual + dropout(x + bias), the mask
    cupyops.dropout_mask(shape, p, seed, offset) of the whole output (blocks rechunked into slabs)."""
    fx.check_dropout_p(p)
    return _named("bias_dropout_add", "residual + dropout(x + bias, p, seed, offset)",
                  dict(x=x, bias=bias, residual=residual, p=float(p), seed=int(seed), offset=int(offset)),
                  policy=policy)


# -- int8 convolution ------------------------------------------------------------------------------

def _int8_nchw32(value, name: str):
    if value.dtype != numpy.int8:
        raise TypeError(f"{name} must be int8, got {value.dtype}")
    if value.ndim != 5 or value.shape[4] != conv_layout.INTERLEAVE:
        raise ValueError(f"{name} has shape {value.shape}; expected int8 NCHW32 (., C/32, ., ., 32)")
    return value


def _only_block(value):
    """The one block of an operand that blockwise passes as a list (nested, one level an axis
    that is not the output's, each of one chunk)."""
    while isinstance(value, list):
        (value,) = value
    return value


@dataclass(frozen=True)
class _OneBlockEach:
    """call on the blocks, the operands that blockwise gives as lists of one block unwrapped.
    (blockwise's concatenate=True would join those lists with cupy.concatenate in Dask's task,
    copying even one block, onto the thread's current GPU rather than the block's.)"""
    call: Callable

    def __call__(self, *values):
        return self.call(*(_only_block(v) for v in values))


def conv2d_int8(x, w, bias=None, z=None, *, stride=1, padding=0, dilation=1, alpha=1.0, beta=1.0, gamma=0.0,
                relu=False, out_dtype="int8", policy="auto"):
    """cupyops.conv2d_int8 over a Dask array of NCHW32 CuPy chunks split along the batch (every
    other axis rechunked into one chunk): torch.nn.functional.conv2d scaled by alpha, plus
    beta * bias and gamma * z, then ReLU. w, bias, alpha (a vector) and z: Dask or CuPy arrays."""
    if policy not in CONV_POLICIES:
        raise ValueError(f"policy must be one of {CONV_POLICIES}, got {policy!r}")
    if out_dtype not in conv_layout.OUT_KINDS:
        raise ValueError(f"out_dtype must be one of {tuple(conv_layout.OUT_KINDS)}, got {out_dtype!r}")
    x = _int8_nchw32(cupy_chunks(x, "x"), "x")
    w = _int8_nchw32(operand(w, "w"), "w")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has {w.shape[1] * 32} input channels, x {x.shape[1] * 32}")
    geometry = conv_layout.ConvGeometry(x.shape[0], x.shape[1] * 32, x.shape[2], x.shape[3], w.shape[0], w.shape[2],
                                        w.shape[3], conv_layout.pair(stride, "stride"),
                                        conv_layout.pair(padding, "padding"), conv_layout.pair(dilation, "dilation"))
    geometry.check()
    inner = (1, 2, 3, 4)
    x = whole(x, inner, "x", "conv2d_int8")
    w = whole(w, range(5), "w", "conv2d_int8")
    vector = numpy.ndim(alpha) > 0 or isinstance(alpha, da.Array) or hasattr(alpha, "__cuda_array_interface__")
    vectors = [whole(check_like(operand(v, n), n, (geometry.k,)), (0,), n, "conv2d_int8")
               for v, n in ((bias, "bias"), (alpha if vector else None, "alpha"))]
    z = whole(check_like(operand(z, "z"), "z", geometry.output_shape, numpy.int8), inner, "z", "conv2d_int8")
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, beta=beta, gamma=gamma, relu=relu,
                  out_dtype=out_dtype, policy=policy, **({} if vector else {"alpha": alpha}))
    call = BlockCall(cupyops.conv2d_int8, ("x", "w", "bias", "z") + (("alpha",) if vector else ()), kwargs)
    # x "abcde": a the batch; the output's b, c, d are K/32, OH, OW; w, bias, alpha and z one block each,
    # given along their other axes (f, g, h, p, q, r) as nested lists of that one block, unwrapped on the
    # block's GPU (where BlockCall copies any operand on another GPU of the process).
    pairs = [(x, "abcde"), (w, "fbghe"), (vectors[0], "f"), (z, "apqre")] + ([(vectors[1], "f")] if vector else [])
    return da.blockwise(_OneBlockEach(call), "abcde", *(item for value, index in pairs
                                                        for item in (value, index if value is not None else None)),
                        adjust_chunks={"b": geometry.k // 32, "c": geometry.oh, "d": geometry.ow},
                        dtype=numpy.dtype(out_dtype), meta=cupy_meta(numpy.dtype(out_dtype), 5), concatenate=False,
                        token="conv2d_int8")
