"""What the command line knows of each op: how to plan it, what bytes it
moves, and the providers a benchmark compares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cupyops.ops import softmax as softmax_ops


@dataclass(frozen=True)
class OpEntry:
    plan: Callable          # (rows, cols, dtype_short, policy, target) -> plan with .spec, .explain()
    arrays_moved: int       # rows * cols arrays read or written once (softmax forward: x and y)
    providers: Callable     # (rows, cols, numpy dtype) -> {name: callable}


def _softmax_providers(op: str):
    def providers(rows, cols, dtype):
        import cupy

        x = cupy.random.default_rng().standard_normal((rows, cols), dtype=cupy.float32).astype(dtype)
        y = cupy.empty_like(x)
        ours = getattr(softmax_ops, op)
        found = {
            "cupyops": lambda: ours(x, axis=-1, out=y),
            "oneflow": lambda: ours(x, axis=-1, out=y, policy="oneflow"),
        }
        try:
            import cupyx.scipy.special as special

            found["cupyx"] = lambda: getattr(special, op)(x, axis=-1)
        except (ImportError, AttributeError):
            pass
        try:
            import torch

            tensor = torch.from_dlpack(x)
            torch_op = torch.softmax if op == "softmax" else torch.log_softmax
            found["torch"] = lambda: torch_op(tensor, dim=-1)
        except ImportError:
            pass
        return found
    return providers


def _softmax_entry(op: str) -> OpEntry:
    return OpEntry(
        plan=lambda rows, cols, dtype, policy, target: softmax_ops.plan(op, rows, cols, dtype, policy, target),
        arrays_moved=2,
        providers=_softmax_providers(op),
    )


OPS = {op: _softmax_entry(op) for op in softmax_ops.OPS}
