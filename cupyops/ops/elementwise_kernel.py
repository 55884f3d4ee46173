"""The CUDA source of a fused elementwise kernel: its spec (the readable name that is the
symbol, the cache key and the benchmark label) and the C statements of its expression."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy

from .. import fx, jit

# dtype name -> (short name, storage C type, compute C type)
C_TYPES = {
    "float16": ("f16", "cupyops::half_t", "float"), "bfloat16": ("bf16", "cupyops::bfloat16_t", "float"),
    "float32": ("f32", "float", "float"), "float64": ("f64", "double", "double"),
    "bool": ("b1", "bool", "bool"),
    "int8": ("i8", "signed char", "signed char"), "uint8": ("u8", "unsigned char", "unsigned char"),
    "int16": ("i16", "short", "short"), "uint16": ("u16", "unsigned short", "unsigned short"),
    "int32": ("i32", "int", "int"), "uint32": ("u32", "unsigned", "unsigned"),
    "int64": ("i64", "long long", "long long"), "uint64": ("u64", "unsigned long long", "unsigned long long"),
}
# How an operand is read, in kernel names: the output's layout (l), a block repeated
# over the leading axes (c), a value per run of elements (r), one element (k), strides (s<D>).
OPERAND_ACCESS = {"linear": "l", "inner": "c", "outer": "r", "scalar": "k", "strided": "s"}
_BINARY_C = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/"}
_COMPARE_C = {"less": "<", "less_equal": "<=", "greater": ">", "greater_equal": ">=",
              "equal": "==", "not_equal": "!="}
_CALLS = {*fx.FLOAT_FUNCTIONS, "relu", "abs", "maximum", "minimum", "power"}
# Functions with a fast form (kernels/elementwise.cuh), taken when every float output is 16-bit.
FAST_FORMS = {"exp", "sigmoid", "silu", "gelu", "gelu_tanh"}
SIXTEEN_BIT_FLOATS = {"float16", "bfloat16"}


def _c(dtype) -> tuple:
    return C_TYPES[numpy.dtype(dtype).name]


def compute_type(type_: fx.Type) -> str:
    """The C type a node's arithmetic happens in (float for 16-bit floats)."""
    return _c(type_.dtype)[2]


# -- spec and source --------------------------------------------------------------------------

@dataclass(frozen=True)
class OperandSpec:
    dtype: str               # numpy dtype name
    access: str              # a key of OPERAND_ACCESS
    vector: bool             # 16-byte loads (linear, inner) / one load a pack (outer)
    axes: int = 0            # merged axes of a strided operand

    @property
    def code(self) -> str:
        code = OPERAND_ACCESS[self.access] + (str(self.axes) if self.access == "strided" else "")
        return code + ("" if self.vector or self.access in ("scalar", "strided") else "e")

    @property
    def params(self) -> tuple:
        """The kernel's integer parameters of this operand, after its pointer."""
        if self.access in ("inner", "outer"):
            return ("inner", "multiplier", "shift")
        if self.access == "strided":
            return tuple(f"size{d}" for d in range(self.axes)) + tuple(f"stride{d}" for d in range(self.axes))
        return ()


@dataclass(frozen=True)
class ElementwiseSpec(jit.KernelSpec):
    template = "elementwise.cu.j2"

    expression: str          # canonical form, e.g. "sigmoid(add(in0, in1))"
    body: tuple              # C statements computing the outputs from in<k>, s<k>, keep<k>, d<k>
    operands: tuple          # OperandSpec of each array operand
    scalars: tuple           # C types of the scalar arguments
    outputs: tuple           # (dtype name, vector store) of each output
    dropouts: tuple          # (p, seed, offset) C expressions of each dropout mask
    pack_size: int
    packs_per_thread: int
    block_size: int
    index_type: str          # "int" or "long long"
    fast_math: bool = False  # the fast forms of FAST_FORMS (every float output 16-bit)
    one_pass: bool = False   # the grid covers every pack: no grid-stride loop (name suffix _1p)
    min_blocks: int = 0      # __launch_bounds__' blocks an SM where set (name suffix _mb<n>)

    @property
    def name(self) -> str:
        digest = hashlib.sha256(f"{self.expression}|{self.operands}|{self.scalars}|{self.outputs}".encode())
        label = self.expression.split("(", 1)[0] if "(" in self.expression else "copy"
        ins = _runs(f"{_c(o.dtype)[0]}{o.code}" for o in self.operands) or "none"
        outs = _runs(_c(dtype)[0] + ("" if vector else "e") for dtype, vector in self.outputs)
        index = "i32" if self.index_type == "int" else "i64"
        return (f"elementwise_{label}_{digest.hexdigest()[:10]}_{ins}_to_{outs}_p{self.pack_size}"
                f"_u{self.packs_per_thread}_t{self.block_size}_{index}{'_1p' if self.one_pass else ''}"
                f"{f'_mb{self.min_blocks}' if self.min_blocks else ''}")

    @property
    def threads_per_block(self) -> int:
        return self.block_size

    def template_args(self) -> dict:
        operands = []
        for k, o in enumerate(self.operands):
            storage, compute = _c(o.dtype)[1:]
            accessor = {"linear": f"LinearOperand<{storage}, P, I, {str(o.vector).lower()}>",
                        "inner": f"InnerOperand<{storage}, P, I, {str(o.vector).lower()}>",
                        "outer": f"OuterOperand<{storage}, P, I, {str(o.vector).lower()}>",
                        "scalar": f"ScalarOperand<{storage}, P, I>",
                        "strided": f"StridedOperand<{storage}, P, I, {o.axes}>"}[o.access]
            if o.access == "strided":
                sizes = ", ".join(f"static_cast<I>(in{k}_size{d})" for d in range(o.axes))
                strides = ", ".join(f"static_cast<I>(in{k}_stride{d})" for d in range(o.axes))
                init = f"{{in{k}, {{{sizes}}}, {{{strides}}}}}"
            elif o.params:
                divider = (f"static_cast<int>(in{k}_inner), static_cast<unsigned>(in{k}_multiplier), "
                           f"static_cast<unsigned>(in{k}_shift)" if self.index_type == "int" else f"in{k}_inner")
                init = f"{{in{k}, {{{divider}}}}}"
            else:
                init = f"{{in{k}}}"
            operands.append({"storage": storage, "compute": compute, "accessor": accessor,
                             "init": init, "params": o.params})
        outputs = [{"storage": _c(dtype)[1], "compute": _c(dtype)[2], "vector": vector}
                   for dtype, vector in self.outputs]
        dropouts = [{"p": p, "seed": seed, "offset": offset} for p, seed, offset in self.dropouts]
        return {"expression": self.expression, "body": self.body, "operands": operands,
                "scalars": self.scalars, "outputs": outputs, "dropouts": dropouts,
                "pack_size": self.pack_size, "packs_per_thread": self.packs_per_thread,
                "block_size": self.block_size, "index_type": self.index_type,
                "fast_math": "true" if self.fast_math else "false", "one_pass": self.one_pass,
                "min_blocks": self.min_blocks}


def _runs(codes) -> str:
    """Codes joined by "_", a run of one code written once with its count: f16_f16_f16 -> f16x3."""
    runs = []
    for code in codes:
        if runs and runs[-1][0] == code:
            runs[-1][1] += 1
        else:
            runs.append([code, 1])
    return "_".join(code if count == 1 else f"{code}x{count}" for code, count in runs)


def _literal(node: fx.Node) -> str:
    value = node.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value}ll" if value >= 0 else f"({value}ll)"
    if math.isnan(value):
        return "fx_nan<double>()"
    if math.isinf(value):
        return "fx_infinity<double>()" if value > 0 else "(-fx_infinity<double>())"
    return f"{value!r}"


class _Program:
    """The C statements of an expression (shared subtrees computed once)."""

    def __init__(self, arguments: dict):
        self.arguments = arguments      # operand index -> "in<k>" or "s<k>"
        self.lines, self.names, self.dropouts = [], {}, []

    def value(self, node: fx.Node) -> str:
        key = node.key
        if key not in self.names:
            self.names[key] = self._emit(node)
        return self.names[key]

    def _emit(self, node: fx.Node) -> str:
        if node.op == "operand":
            return self.arguments[node.value]
        if node.op == "constant":
            return _literal(node)
        ct = compute_type(node.type)
        args = [self.value(a) for a in node.args]
        as_ct = [f"static_cast<{ct}>({a})" for a in args]
        if node.op in _BINARY_C:
            expr = f"static_cast<{ct}>({as_ct[0]} {_BINARY_C[node.op]} {as_ct[1]})"
        elif node.op in _COMPARE_C:
            common = compute_type(fx.promote(node.args[0].type, node.args[1].type))
            expr = f"static_cast<{common}>({args[0]}) {_COMPARE_C[node.op]} static_cast<{common}>({args[1]})"
        elif node.op in _CALLS:
            fast = "<F>" if node.op in FAST_FORMS else ""
            expr = f"fx_{node.op}{fast}({', '.join(as_ct)})"
        elif node.op == "negative":
            expr = f"static_cast<{ct}>(-{as_ct[0]})"
        elif node.op == "where":
            expr = f"static_cast<bool>({args[0]}) ? {as_ct[1]} : {as_ct[2]}"
        elif node.op == "cast":   # 16-bit targets round through their storage type
            storage = _c(node.dtype)[1]
            expr = f"cast<float>(cast<{storage}>(static_cast<float>({args[0]})))" if storage != ct else as_ct[0]
        elif node.op == "dropout":
            mask = tuple(args[1:])
            if mask not in self.dropouts:
                self.dropouts.append(mask)
            k = self.dropouts.index(mask)
            expr = f"keep{k} ? {as_ct[0]} * static_cast<{ct}>(d{k}) : {ct}(0)"   # d<k>: 1 / (1 - p)
        else:  # pragma: no cover - fx builds no other node
            raise AssertionError(node.op)
        name = f"t{len(self.lines)}"
        self.lines.append(f"const {ct} {name} = {expr};")
        return name


def fast_math(out_dtypes) -> bool:
    """Whether a kernel writing these dtypes takes the fast forms: its float outputs all 16-bit
    (their rounding hides a few float32 ulp), none of another kind (a comparison's bool would not)."""
    return all(numpy.dtype(d).name in SIXTEEN_BIT_FLOATS for d in out_dtypes)


def generate(roots: tuple, arguments: dict) -> tuple:
    """(C statements, dropout masks) computing out<k> from the roots' trees; calls of the
    FAST_FORMS functions take the kernel's constant F (fast_math) as their template argument."""
    program = _Program(arguments)
    outputs = [program.value(root) for root in roots]
    lines = program.lines + [f"out{k} = static_cast<{compute_type(root.type)}>({value});"
                             for k, (root, value) in enumerate(zip(roots, outputs))]
    return tuple(lines), tuple(program.dropouts)
