"""What `cupyops bench elementwise` times: cupyops (both policies) and the same expression in
torch eager, torch.compile, cupy.ElementwiseKernel and cupy.fuse."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy

from cupyops import fx, jit
from cupyops.ops import elementwise as ew


def _torch_functions(torch) -> dict:
    F = torch.nn.functional
    dtypes = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
              "bfloat16": torch.bfloat16, "bool": torch.bool, "int32": torch.int32, "int64": torch.int64}
    return {
        "add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.true_divide,
        "power": torch.pow, "less": torch.lt, "less_equal": torch.le, "greater": torch.gt,
        "greater_equal": torch.ge, "equal": torch.eq, "not_equal": torch.ne, "negative": torch.neg,
        "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf,
        "rsqrt": torch.rsqrt, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu, "relu": torch.relu, "abs": torch.abs, "maximum": torch.maximum,
        "minimum": torch.minimum, "where": torch.where, "cast": lambda x, dtype: x.to(dtypes[dtype.name]),
        "dropout": lambda x, p, seed, offset: F.dropout(x, p),
    }


def _cupy_functions(cupy) -> dict:
    from cupyx.scipy.special import erf

    def sigmoid(x):
        return 1 / (1 + cupy.exp(-x))
    return {
        "add": cupy.add, "subtract": cupy.subtract, "multiply": cupy.multiply, "divide": cupy.true_divide,
        "power": cupy.power, "less": cupy.less, "less_equal": cupy.less_equal, "greater": cupy.greater,
        "greater_equal": cupy.greater_equal, "equal": cupy.equal, "not_equal": cupy.not_equal,
        "negative": cupy.negative, "exp": cupy.exp, "log": cupy.log, "tanh": cupy.tanh, "sigmoid": sigmoid,
        "erf": erf, "rsqrt": lambda x: 1 / cupy.sqrt(x), "gelu": lambda x: 0.5 * x * (1 + erf(x * 0.7071067811865476)),
        "gelu_tanh": lambda x: 0.5 * x * (1 + cupy.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))),
        "silu": lambda x: x * sigmoid(x), "relu": lambda x: cupy.maximum(x, 0), "abs": cupy.abs,
        "maximum": cupy.maximum, "minimum": cupy.minimum, "where": cupy.where,
        "cast": lambda x, dtype: x.astype(dtype),
    }


def _headers_inline() -> str:
    """kernels/common.cuh and elementwise.cuh as one preamble (ElementwiseKernel takes no -I)."""
    text = "".join((jit.resource_dir("kernels") / name).read_text() for name in ("common.cuh", "elementwise.cuh"))
    return re.sub(r"^#(pragma once|include .*)$", "", text, flags=re.M) + "\nusing namespace cupyops;\n"


def _cupy_kernel(cupy, plan: ew.ElementwisePlan):
    """cupy.ElementwiseKernel running the plan's C statements (operands converted to float)."""
    spec = plan.spec
    if spec.dropouts or spec.scalars:
        return None
    ins = ", ".join(f"{o.dtype} a{k}" for k, o in enumerate(spec.operands))
    outs = ", ".join(f"{dtype} o{k}" for k, (dtype, _) in enumerate(spec.outputs))
    compute = [ew.C_TYPES[o.dtype][2] for o in spec.operands]
    out_compute = [ew.C_TYPES[dtype][2] for dtype, _ in spec.outputs]
    body = f"constexpr bool F = {str(spec.fast_math).lower()};\n"
    body += "".join(f"{c} in{k} = ({c})a{k};\n" for k, c in enumerate(compute))
    body += "".join(f"{c} out{k};\n" for k, c in enumerate(out_compute))
    body += "\n".join(spec.body) + "\n"
    body += "".join(f"o{k} = out{k};\n" for k in range(len(out_compute)))
    return cupy.ElementwiseKernel(ins, outs, body, "cupyops_baseline", preamble=_headers_inline())


@dataclass
class Point:
    text: str            # the expression
    named: object        # the named op's name, or None
    operands: dict       # name -> (shape, numpy dtype)
    shape: tuple         # the outputs' shape

    def inputs(self):
        import cupy

        rng = cupy.random.default_rng()
        arrays = {}
        for name, (shape, dtype) in self.operands.items():
            values = rng.standard_normal(shape, dtype=cupy.float32)
            arrays[name] = values > 0 if dtype == numpy.bool_ else values.astype(dtype)
        return arrays

    def bytes_moved(self, out_dtypes) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.operands.values()) + \
            sum(math.prod(self.shape) * numpy.dtype(d).itemsize for d in out_dtypes)

    def providers(self) -> dict:
        import cupy

        from .elementwise import named_call

        arrays = self.inputs()
        if self.named:      # the function the named op calls, on its arguments in its order
            function, arguments = named_call(self.named)
            values = list(arguments(arrays))
        else:
            function, values = ew.compiled_expression(self.text), list(arrays.values())
        roots = function.trace(tuple(ew.operand_kind(a, f"argument {k}") for k, a in enumerate(values)))
        found = {"cupyops": lambda: function.call(tuple(values)),
                 "oneflow": lambda: function.call(tuple(values), None, "oneflow")}
        candidates = {}
        try:
            import torch

            tensors = [torch.from_dlpack(a) if isinstance(a, cupy.ndarray) else a for a in values]
            torch_fns = _torch_functions(torch)

            def eager(*xs):
                result = fx.evaluate(roots, list(xs), torch_fns)
                return result[0] if len(result) == 1 else result
            compiled = torch.compile(eager)
            candidates["torch"] = lambda: eager(*tensors)
            candidates["torch_compile"] = lambda: compiled(*tensors)
        except ImportError:
            pass
        cupy_fns = _cupy_functions(cupy)
        if "dropout" not in self.text:
            def cupyops_baseline(*xs):      # cupy.fuse names its kernel after the function
                result = fx.evaluate(roots, list(xs), cupy_fns)
                return result[0] if len(result) == 1 else result
            fused = cupy.fuse(cupyops_baseline)
            candidates["cupy_fuse"] = lambda: fused(*values)
        plan = function.plan(tuple(values))
        kernel = _cupy_kernel(cupy, plan)
        if kernel is not None:
            candidates["cupy_kernel"] = lambda: kernel(*values)
        for name, fn in candidates.items():      # a baseline that cannot run this case is left out
            try:
                fn()
                found[name] = fn
            except Exception:  # noqa: BLE001 - the library's own error, reported as "missing"
                pass
        return found
