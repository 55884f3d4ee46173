"""What the command line knows of each op: how to plan it, what bytes it
moves, and the providers a benchmark compares."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from cupyops.ops import softmax as softmax_ops
from cupyops.ops import softmax_axis, softmax_rows, softmax_split


@dataclass(frozen=True)
class OpEntry:
    plan: Callable          # (rows, cols, dtype_short, policy, target) -> plan with .spec, .explain()
    arrays_moved: int       # arrays of the input's size read or written once (softmax forward: x, y)
    providers: Callable     # (shape, axis, numpy dtype) -> {name: callable}, axis reduced
    # (outer, cols, inner, dtype_short, policy, target) -> the plan reducing the middle axis of
    # (outer, cols, inner) in place, or None where the op copies it to rows first; None for
    # ops that reduce only the last axes
    axis_plan: Optional[Callable] = None


def _softmax_providers(op: str):
    def providers(shape, axis, dtype):
        import cupy

        x = cupy.random.default_rng().standard_normal(shape, dtype=cupy.float32).astype(dtype)
        y = cupy.empty_like(x)
        ours = getattr(softmax_ops, op)
        found = {
            "cupyops": lambda: ours(x, axis=axis, out=y),
            "oneflow": lambda: ours(x, axis=axis, out=y, policy="oneflow"),
        }
        try:
            import cupyx.scipy.special as special

            found["cupyx"] = lambda: getattr(special, op)(x, axis=axis)
        except (ImportError, AttributeError):
            pass
        try:
            import torch

            tensor = torch.from_dlpack(x)
            torch_op = torch.softmax if op == "softmax" else torch.log_softmax
            found["torch"] = lambda: torch_op(tensor, dim=axis)
        except ImportError:
            pass
        return found
    return providers


def _softmax_backward_providers(op: str):
    forward = op[: -len("_backward")]

    def providers(shape, axis, dtype):
        import cupy

        rng = cupy.random.default_rng()
        y = getattr(softmax_ops, forward)(rng.standard_normal(shape, dtype=cupy.float32)
                                          .astype(dtype), axis=axis)
        dy = rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)
        dx = cupy.empty_like(dy)
        ours = getattr(softmax_ops, op)
        found = {
            "cupyops": lambda: ours(dy, y, axis=axis, out=dx),
            "oneflow": lambda: ours(dy, y, axis=axis, out=dx, policy="oneflow"),
        }
        try:
            import torch

            tdy, ty = torch.from_dlpack(dy), torch.from_dlpack(y)
            torch_op = (torch._softmax_backward_data if forward == "softmax"
                        else torch._log_softmax_backward_data)
            found["torch"] = lambda: torch_op(tdy, ty, axis, tdy.dtype)
        except (ImportError, AttributeError):
            pass
        return found
    return providers


def _softmax_plan(op, rows, cols, dtype, policy, target):
    """auto splits rows too long and too few to fill the GPU; otherwise the row paths."""
    split = softmax_split.plan(op, rows, cols, dtype, target) if policy == "auto" else None
    return split or softmax_ops.plan(op, rows, cols, dtype, policy, target)


def _softmax_axis_plan(op, outer, cols, inner, dtype, policy, target):
    """auto reduces a non-last axis in place where the axis kernel applies (fresh, aligned arrays)."""
    return softmax_axis.plan(op, outer, cols, inner, dtype, target) if policy == "auto" else None


def _softmax_entry(op: str) -> OpEntry:
    backward = op.endswith("_backward")
    return OpEntry(
        plan=lambda rows, cols, dtype, policy, target: _softmax_plan(op, rows, cols, dtype, policy, target),
        arrays_moved=3 if backward else 2,
        providers=_softmax_backward_providers(op) if backward else _softmax_providers(op),
        axis_plan=lambda outer, cols, inner, dtype, policy, target:
            _softmax_axis_plan(op, outer, cols, inner, dtype, policy, target),
    )


OPS = {op: _softmax_entry(op) for op in softmax_rows.OPS}


# -- LayerNorm / RMSNorm -----------------------------------------------------
# The CuPy composite baseline is listed under "cupyx" (benchmark.BASELINES).

from cupyops.ops import norm as norm_ops  # noqa: E402

NORM_EPS = 1e-5


def _norm_inputs(shape, dtype):
    """x as rows (a contiguous array normalised over its last axis is its rows), weight, bias."""
    import cupy

    rng = cupy.random.default_rng()
    cols = shape[-1]
    x = rng.standard_normal((math.prod(shape) // cols, cols), dtype=cupy.float32).astype(dtype)
    weight = (1 + 0.1 * rng.standard_normal(cols, dtype=cupy.float32)).astype(dtype)
    bias = (0.1 * rng.standard_normal(cols, dtype=cupy.float32)).astype(dtype)
    return x, weight, bias


def _cupy_norm_forward(x, weight, bias, centered):
    """The composite: statistics in float32, one CuPy kernel per step."""
    import cupy

    x32 = x.astype(cupy.float32)
    mean = x32.mean(axis=-1, keepdims=True) if centered else 0
    centred = x32 - mean
    rstd = 1 / cupy.sqrt((centred * centred).mean(axis=-1, keepdims=True) + NORM_EPS)
    y = centred * rstd * weight.astype(cupy.float32)
    if bias is not None:
        y = y + bias.astype(cupy.float32)
    return y.astype(x.dtype), mean, rstd


def _norm_forward_providers(op: str):
    centered = op == "layer_norm"

    def providers(shape, axis, dtype):   # axis: the last (OpEntry.axis_plan is None)
        import cupy

        x, weight, bias = _norm_inputs(shape, dtype)
        cols = shape[-1]
        bias = bias if centered else None
        y = cupy.empty_like(x)
        ours = getattr(norm_ops, op)
        affine = (weight, bias) if centered else (weight,)
        found = {
            "cupyops": lambda: ours(x, *affine, eps=NORM_EPS, out=y),
            "oneflow": lambda: ours(x, *affine, eps=NORM_EPS, out=y, policy="oneflow"),
            "cupyx": lambda: _cupy_norm_forward(x, weight, bias, centered),
        }
        try:
            import torch
            import torch.nn.functional as F

            tx, tw = torch.from_dlpack(x), torch.from_dlpack(weight)
            if centered:
                tb = torch.from_dlpack(bias)
                found["torch"] = lambda: F.layer_norm(tx, (cols,), tw, tb, NORM_EPS)
            elif hasattr(F, "rms_norm"):
                found["torch"] = lambda: F.rms_norm(tx, (cols,), tw, NORM_EPS)
        except ImportError:
            pass
        return found
    return providers


def _norm_backward_providers(op: str):
    centered = op == "layer_norm_backward"
    forward = "layer_norm" if centered else "rms_norm"

    def providers(shape, axis, dtype):   # axis: the last (OpEntry.axis_plan is None)
        import cupy

        x, weight, bias = _norm_inputs(shape, dtype)
        cols = shape[-1]
        dy = cupy.random.default_rng().standard_normal(x.shape, dtype=cupy.float32).astype(dtype)
        affine = (weight, bias) if centered else (weight,)
        stats = getattr(norm_ops, forward)(x, *affine, eps=NORM_EPS, return_stats=True)[1:]
        ours = getattr(norm_ops, op)

        def composite():
            x32, dy32 = x.astype(cupy.float32), dy.astype(cupy.float32)
            rstd = stats[-1][:, None]
            xhat = (x32 - stats[0][:, None]) * rstd if centered else x32 * rstd
            g = dy32 * weight.astype(cupy.float32)
            mean_g = g.mean(axis=-1, keepdims=True) if centered else 0
            dx = rstd * (g - mean_g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
            return dx.astype(dtype), (dy32 * xhat).sum(axis=0), dy32.sum(axis=0)

        found = {
            "cupyops": lambda: ours(dy, x, *stats, weight),
            "oneflow": lambda: ours(dy, x, *stats, weight, policy="oneflow"),
            "cupyx": composite,
        }
        try:
            import torch
            import torch.nn.functional as F

            tx = torch.from_dlpack(x).requires_grad_()
            tw = torch.from_dlpack(weight).requires_grad_()
            tdy = torch.from_dlpack(dy)
            if centered:
                tb = torch.from_dlpack(bias).requires_grad_()
                ty, inputs = F.layer_norm(tx, (cols,), tw, tb, NORM_EPS), (tx, tw, tb)
            elif hasattr(F, "rms_norm"):
                ty, inputs = F.rms_norm(tx, (cols,), tw, NORM_EPS), (tx, tw)
            else:
                raise ImportError("torch without rms_norm")
            found["torch"] = lambda: torch.autograd.grad(ty, inputs, tdy, retain_graph=True)
        except ImportError:
            pass
        return found
    return providers


def _norm_entry(op: str) -> OpEntry:
    forward = op in norm_ops.FORWARD_OPS
    return OpEntry(
        plan=lambda rows, cols, dtype, policy, target: norm_ops.plan(op, rows, cols, dtype, policy, target),
        arrays_moved=2 if forward else 3,
        providers=_norm_forward_providers(op) if forward else _norm_backward_providers(op),
    )


OPS.update({op: _norm_entry(op) for op in norm_ops.OPS})
