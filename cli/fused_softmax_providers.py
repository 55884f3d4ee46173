"""What `cupyops bench fused_softmax[_backward]` times: cupyops (auto and the oneflow
policy) and the same expression in torch eager and torch.compile."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy

from cupyops.ops import fused_softmax as fs


@dataclass(frozen=True)
class Case:
    op: str                   # fused_softmax or fused_softmax_backward
    shape: tuple
    dtype: numpy.dtype
    mask_shape: Optional[tuple]
    bias_shape: Optional[tuple]
    bias_dtype: numpy.dtype
    causal: bool
    diagonal: int
    dropout: float
    return_lse: bool = False  # the forward also writes each row's log-sum-exp

    def bytes_moved(self) -> int:
        """x and y (backward: dy, x and dx), plus mask and bias once each at their own size, and
        the float32 lse (backward: read; forward: written where return_lse)."""
        arrays = 3 if self.op == "fused_softmax_backward" else 2
        moved = arrays * math.prod(self.shape) * self.dtype.itemsize
        if self.mask_shape:
            moved += math.prod(self.mask_shape)
        if self.bias_shape:
            moved += math.prod(self.bias_shape) * self.bias_dtype.itemsize
        if self.op == "fused_softmax_backward" or self.return_lse:
            moved += math.prod(self.shape[:-1]) * 4   # lse
        return moved


def _operands(case: Case):
    import cupy

    generator = cupy.random.default_rng(0)
    x = generator.standard_normal(case.shape, dtype=numpy.float32).astype(case.dtype)
    mask = generator.random(case.mask_shape) < 0.9 if case.mask_shape else None
    bias = generator.standard_normal(case.bias_shape, dtype=numpy.float32).astype(case.bias_dtype) \
        if case.bias_shape else None
    return x, mask, bias


def _ours(case: Case, x, mask, bias, policy: str):
    import cupy

    args = dict(scale=0.125, bias=bias, mask=mask, causal=case.causal, diagonal=case.diagonal,
                dropout=case.dropout, seed=1, policy=policy)
    if case.op == "fused_softmax":
        return lambda: fs.fused_softmax(x, return_lse=case.return_lse, **args)
    _, lse = fs.fused_softmax(x, return_lse=True, **args)
    dy = cupy.ones_like(x)
    return lambda: fs.fused_softmax_backward(dy, x, lse, **args)


def _torch(case: Case, x, mask, bias, compiled: bool):
    try:
        import torch
    except ImportError:
        return None
    tx, tmask, tbias = (None if a is None else torch.from_dlpack(a) for a in (x, mask, bias))   # bfloat16 too
    sq, sk = case.shape[-2], case.shape[-1]
    causal = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(case.diagonal) if case.causal else None

    def expression(scores):
        z = scores * 0.125
        if tbias is not None:
            z = z + tbias
        if tmask is not None:
            z = z.masked_fill(~tmask, float("-inf"))
        if causal is not None:
            z = z.masked_fill(~causal, float("-inf"))
        y = torch.nn.functional.dropout(torch.softmax(z.float(), -1), case.dropout).to(scores.dtype)
        return (y, torch.logsumexp(z.float(), -1)) if case.return_lse else y

    if compiled and case.op != "fused_softmax":
        # the timed backward runs again on one graph (retain_graph), which buffers donated to the
        # compiled backward forbid
        import torch._functorch.config as functorch_config
        functorch_config.donated_buffer = False
    function = torch.compile(expression) if compiled else expression
    if case.op == "fused_softmax":
        return lambda: function(tx)
    leaf = tx.detach().requires_grad_(True)
    y = function(leaf)
    dy = torch.ones_like(y)
    return lambda: torch.autograd.grad(y, leaf, dy, retain_graph=True)


def make(case: Case, baselines: list) -> dict:
    """{provider: callable}, "cupyops" first; baselines that cannot run here are left out."""
    x, mask, bias = _operands(case)
    providers = {"cupyops": _ours(case, x, mask, bias, "auto")}
    if "oneflow" in baselines:
        providers["oneflow"] = _ours(case, x, mask, bias, "oneflow")
    for name, compiled in (("torch", False), ("torch_compile", True)):
        if name in baselines:
            found = _torch(case, x, mask, bias, compiled)
            if found is not None:
                providers[name] = found
    return providers
