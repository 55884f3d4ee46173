"""Expression trees of fused elementwise kernels, and the namespace they are written in.

`cupyops.fuse(fn)` calls `fn` on symbolic operands (`Node`s); `cupyops.elementwise(expr, ...)`
parses `expr` with `ast` against the same names. Either way the result is one tree whose
nodes carry their NumPy dtype, worked out as NumPy 2 promotes (Python scalars are weak:
`float16_array + 2.5` stays float16, as do bfloat16 arrays). Arithmetic happens in the
compute type of each node (float32 for 16-bit floats).

The functions below are the whole vocabulary; any other name is refused:

    exp, log, tanh, sigmoid, erf, rsqrt, gelu, gelu_tanh, silu, relu, abs,
    maximum, minimum, where, cast, dropout

with `+ - * / **`, unary `-`, and the comparisons `< <= > >= == !=`.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import Optional

import numpy

from .dtypes import BFLOAT16

BOOL = numpy.dtype(numpy.bool_)
FLOAT64 = numpy.dtype(numpy.float64)
INT64 = numpy.dtype(numpy.int64)
# dtypes an operand may have: the floats cupyops computes in, integers and bool
SUPPORTED_KINDS = "biuf"


def supported(dtype) -> bool:
    """Whether an operand of dtype can be computed: bool, integers, float16 / bfloat16 /
    float32 / float64."""
    dtype = numpy.dtype(dtype)
    return (dtype.kind in SUPPORTED_KINDS and dtype.itemsize <= 8) or dtype == BFLOAT16

# name -> arity of the functions of one to three operands (dropout's scalars
# p, seed and offset count as operands).
FLOAT_FUNCTIONS = ("exp", "log", "tanh", "sigmoid", "erf", "rsqrt", "gelu", "gelu_tanh", "silu")
FUNCTIONS = {**{name: 1 for name in FLOAT_FUNCTIONS}, "relu": 1, "abs": 1, "maximum": 2,
             "minimum": 2, "where": 3, "cast": 2, "dropout": 4}
BINARY_OPERATORS = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/", "power": "**",
                    "less": "<", "less_equal": "<=", "greater": ">", "greater_equal": ">=",
                    "equal": "==", "not_equal": "!="}
COMPARISONS = ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")


def _empty(dtype):
    return numpy.empty(0, dtype)


def _ufunc_dtype(ufunc, *dtypes) -> numpy.dtype:
    """The dtype NumPy's ufunc gives for arrays of these dtypes (ml_dtypes knows bfloat16)."""
    return ufunc(*(_empty(d) for d in dtypes)).dtype


@dataclass(frozen=True)
class Type:
    """A node's dtype; `weak` for Python scalars, which take the array's type (NEP 50)."""
    dtype: numpy.dtype
    weak: bool = False


def promote(a: Type, b: Type, ufunc=numpy.add) -> Type:
    """NumPy 2's promotion of two operands of `ufunc`, with bfloat16 treated as float16 is."""
    if a.weak and b.weak:
        return Type(numpy.result_type(a.dtype, b.dtype), weak=True)
    if a.weak or b.weak:
        weak, strong = (a, b) if a.weak else (b, a)
        if weak.dtype.kind == "f" and strong.dtype.kind in "biu":
            return Type(FLOAT64)
        if weak.dtype.kind == "i" and strong.dtype.kind == "b":
            return Type(INT64)
        return strong if ufunc is not numpy.true_divide or strong.dtype.kind == "f" \
            else Type(_ufunc_dtype(ufunc, strong.dtype, strong.dtype))
    return Type(_ufunc_dtype(ufunc, a.dtype, b.dtype))


def _float_type(a: Type) -> Type:
    """The type of a float function of `a` (NumPy's exp: int8 -> float16, int32 -> float64)."""
    if a.weak:
        return Type(FLOAT64, weak=True)
    return Type(_ufunc_dtype(numpy.exp, a.dtype))


class Node:
    """One value of an expression: an operand, a constant, or an operation on nodes.

    Python's operators on nodes build new nodes, so a traced function written with
    `+`, `*`, `<`, ... and the functions of this module builds the tree. Nodes compare
    with `==` symbolically: use `key` to compare trees."""

    __slots__ = ("op", "args", "type", "value")
    __hash__ = None

    def __init__(self, op: str, args: tuple, type_: Type, value=None):
        self.op, self.args, self.type, self.value = op, args, type_, value

    @property
    def dtype(self) -> numpy.dtype:
        return self.type.dtype

    @property
    def key(self) -> tuple:
        """The tree as nested tuples: equal keys, equal kernels."""
        return (self.op, str(self.type.dtype), self.type.weak, self.value, tuple(a.key for a in self.args))

    def canonical(self) -> str:
        """The expression as text, e.g. `sigmoid(add(in0, in1))`."""
        if self.op == "operand":
            return f"in{self.value}"
        if self.op == "constant":
            return repr(self.value)
        if self.op == "cast":
            return f"cast({self.args[0].canonical()}, {self.dtype.name})"
        return f"{self.op}({', '.join(a.canonical() for a in self.args)})"

    def __repr__(self) -> str:
        return f"<fx.Node {self.canonical()}: {self.dtype}{' (weak)' if self.type.weak else ''}>"

    def __bool__(self):
        raise TypeError("a traced value has no truth value: use cupyops.where(cond, a, b) "
                        "instead of `if`, `and`, `or`")

    # arithmetic
    def __add__(self, other): return binary("add", self, other)
    def __radd__(self, other): return binary("add", other, self)
    def __sub__(self, other): return binary("subtract", self, other)
    def __rsub__(self, other): return binary("subtract", other, self)
    def __mul__(self, other): return binary("multiply", self, other)
    def __rmul__(self, other): return binary("multiply", other, self)
    def __truediv__(self, other): return binary("divide", self, other)
    def __rtruediv__(self, other): return binary("divide", other, self)
    def __pow__(self, other): return binary("power", self, other)
    def __rpow__(self, other): return binary("power", other, self)
    def __neg__(self): return negative(self)
    def __pos__(self): return self
    def __abs__(self): return abs_(self)

    # comparisons
    def __lt__(self, other): return binary("less", self, other)
    def __le__(self, other): return binary("less_equal", self, other)
    def __gt__(self, other): return binary("greater", self, other)
    def __ge__(self, other): return binary("greater_equal", self, other)
    def __eq__(self, other): return binary("equal", self, other)
    def __ne__(self, other): return binary("not_equal", self, other)


def operand(index: int, dtype, weak: bool = False) -> Node:
    """The index-th operand of a kernel: an array of `dtype`, or a scalar argument."""
    dtype = numpy.dtype(dtype)
    if not supported(dtype):
        raise TypeError(f"operand {index} has dtype {dtype}; elementwise kernels take bool, "
                        "integer and float16 / bfloat16 / float32 / float64 operands")
    return Node("operand", (), Type(dtype, weak), index)


def as_node(value) -> Node:
    """A node for a traced value or a Python number (a constant of the kernel)."""
    if isinstance(value, Node):
        return value
    if isinstance(value, (bool, numpy.bool_)):
        return Node("constant", (), Type(BOOL, weak=True), bool(value))
    if isinstance(value, (int, numpy.integer)):
        return Node("constant", (), Type(INT64, weak=True), int(value))
    if isinstance(value, (float, numpy.floating)):
        return Node("constant", (), Type(FLOAT64, weak=True), float(value))
    raise TypeError(f"{type(value).__name__} value {value!r} cannot be used in an elementwise "
                    "expression: operands are GPU arrays and Python numbers")


_UFUNCS = {"add": numpy.add, "subtract": numpy.subtract, "multiply": numpy.multiply,
           "divide": numpy.true_divide, "power": numpy.power, "maximum": numpy.maximum,
           "minimum": numpy.minimum}


def binary(op: str, a, b) -> Node:
    a, b = as_node(a), as_node(b)
    if op in COMPARISONS:
        return Node(op, (a, b), Type(BOOL))
    type_ = promote(a.type, b.type, _UFUNCS[op])
    if op == "subtract" and type_.dtype == BOOL:
        raise TypeError("subtracting booleans is not supported (as in NumPy): use where()")
    if op == "power" and type_.dtype.kind in "biu":
        raise TypeError("** of integers is not supported: cast an operand to a float type first")
    return Node(op, (a, b), type_)


def negative(x) -> Node:
    x = as_node(x)
    if x.dtype == BOOL:
        raise TypeError("negating a boolean is not supported (as in NumPy): use where()")
    return Node("negative", (x,), x.type)


def _float_function(name: str):
    def function(x) -> Node:
        x = as_node(x)
        return Node(name, (x,), _float_type(x.type))
    function.__name__ = function.__qualname__ = name
    return function


exp, log, tanh, sigmoid, erf, rsqrt, gelu, gelu_tanh, silu = (
    _float_function(name) for name in FLOAT_FUNCTIONS)
exp.__doc__ = "e ** x (numpy.exp)."
log.__doc__ = "Natural logarithm (numpy.log)."
tanh.__doc__ = "Hyperbolic tangent (numpy.tanh)."
sigmoid.__doc__ = "1 / (1 + exp(-x)) (torch.sigmoid, scipy.special.expit)."
erf.__doc__ = "Error function (scipy.special.erf, torch.erf)."
rsqrt.__doc__ = "1 / sqrt(x) (torch.rsqrt)."
gelu.__doc__ = "x * (1 + erf(x / sqrt(2))) / 2 (torch.nn.functional.gelu)."
gelu_tanh.__doc__ = ("x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x**3))) / 2 "
                     "(torch.nn.functional.gelu(x, approximate='tanh')).")
silu.__doc__ = "x * sigmoid(x) (torch.nn.functional.silu)."


def relu(x) -> Node:
    """max(x, 0), NaN kept (torch.relu)."""
    x = as_node(x)
    return Node("relu", (x,), x.type)


def abs_(x) -> Node:
    """|x| (numpy.abs)."""
    x = as_node(x)
    return Node("abs", (x,), x.type)


def maximum(a, b) -> Node:
    """Larger of a and b, NaN if either is NaN (numpy.maximum)."""
    return binary("maximum", a, b)


def minimum(a, b) -> Node:
    """Smaller of a and b, NaN if either is NaN (numpy.minimum)."""
    return binary("minimum", a, b)


def where(condition, a, b) -> Node:
    """a where condition is true (non-zero), else b (numpy.where)."""
    condition, a, b = as_node(condition), as_node(a), as_node(b)
    return Node("where", (condition, a, b), promote(a.type, b.type))


def cast(x, dtype) -> Node:
    """x converted to dtype, rounded as NumPy's astype rounds (x.astype(dtype))."""
    x = as_node(x)
    from .dtypes import parse_dtype

    try:
        dtype = parse_dtype(dtype) if isinstance(dtype, str) and dtype in ("bfloat16", "bf16") \
            else numpy.dtype(dtype)
    except TypeError:
        raise TypeError(f"cast: {dtype!r} is not a dtype") from None
    if not supported(dtype):
        raise TypeError(f"cast: dtype {dtype} is not supported")
    return Node("cast", (x,), Type(dtype), dtype.name)


def dropout(x, p, seed, offset=0) -> Node:
    """x / (1 - p) where the kernel keeps the element, else 0: keep iff the Philox4x32-10
    16-bit half of the element's linear index (in the output) plus `offset`, keyed by `seed`,
    is at least round(p * 2**16) (cupyops.philox); the mask is
    `cupyops.dropout_mask(shape, p, seed, offset)`.
    p, seed and offset are scalars (Python numbers or scalar arguments)."""
    x = as_node(x)
    scalars = [as_node(v) for v in (p, seed, offset)]
    for name, node in zip(("p", "seed", "offset"), scalars):
        if not is_scalar(node):
            raise ValueError(f"dropout: {name} must be a Python number or a scalar argument, "
                             "not an array or an expression")
    if scalars[1].dtype.kind not in "iu" or scalars[2].dtype.kind not in "iu":
        raise TypeError("dropout: seed and offset must be integers")
    if scalars[0].op == "constant":
        check_dropout_p(scalars[0].value)
    return Node("dropout", (x, *scalars), _float_type(x.type) if x.dtype.kind in "biu" else x.type)


def check_dropout_p(p) -> float:
    """p as a float, a ValueError unless 0 <= p < 1."""
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
    return p


def is_scalar(node: Node) -> bool:
    """Whether node is a constant or a scalar argument (the same for every element)."""
    return node.op == "constant" or (node.op == "operand" and node.type.weak)


NAMESPACE = {"exp": exp, "log": log, "tanh": tanh, "sigmoid": sigmoid, "erf": erf, "rsqrt": rsqrt,
             "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu, "relu": relu, "abs": abs_,
             "maximum": maximum, "minimum": minimum, "where": where, "cast": cast, "dropout": dropout}
assert set(NAMESPACE) == set(FUNCTIONS)


# -- the string front end -----------------------------------------------------------------

_AST_BINARY = {ast.Add: "add", ast.Sub: "subtract", ast.Mult: "multiply", ast.Div: "divide",
               ast.Pow: "power"}
_AST_COMPARE = {ast.Lt: "less", ast.LtE: "less_equal", ast.Gt: "greater", ast.GtE: "greater_equal",
                ast.Eq: "equal", ast.NotEq: "not_equal"}


def _refuse(node: ast.AST, what: Optional[str] = None):
    text = what or f"{type(node).__name__} ({ast.unparse(node)!r})"
    return ValueError(f"unsupported syntax in elementwise expression: {text}; allowed are operand "
                      f"names, numbers, + - * / **, unary -, comparisons and "
                      f"{', '.join(sorted(FUNCTIONS))}")


@functools.lru_cache(maxsize=1024)
def parse(expr: str) -> tuple:
    """`expr` checked against the whitelist: (ast tree, operand names in order of first use)."""
    if not isinstance(expr, str):
        raise TypeError(f"expr must be a string, got {type(expr).__name__}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"elementwise expression {expr!r} is not valid Python: {error.msg}") from None
    names = []

    def check(node, top=False):
        if isinstance(node, ast.Tuple) and top:
            for item in node.elts:
                check(item)
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _AST_BINARY:
                raise _refuse(node, f"operator {type(node.op).__name__}")
            check(node.left), check(node.right)
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.USub, ast.UAdd)):
                raise _refuse(node, f"operator {type(node.op).__name__}")
            check(node.operand)
        elif isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in _AST_COMPARE:
                raise _refuse(node, "chained or unknown comparison")
            check(node.left), check(node.comparators[0])
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
                name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
                raise ValueError(f"unknown function {name!r} in elementwise expression; known: "
                                 f"{', '.join(sorted(FUNCTIONS))}")
            if node.keywords:
                raise _refuse(node, f"keyword arguments to {node.func.id}()")
            for i, arg in enumerate(node.args):
                if node.func.id == "cast" and i == 1 and isinstance(arg, ast.Constant) \
                        and isinstance(arg.value, str):
                    continue
                check(arg)
        elif isinstance(node, ast.Name):
            if node.id in FUNCTIONS:
                raise _refuse(node, f"function {node.id!r} used without a call")
            if node.id not in names:
                names.append(node.id)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, (complex, str, bytes)) or node.value is None or node.value is ...:
                raise _refuse(node, f"constant {node.value!r}")
        else:
            raise _refuse(node)

    check(tree.body, top=True)
    return tree, tuple(names)


def build(tree: ast.Expression, values: dict):
    """The expression `tree` (from parse) evaluated over `values` (name -> Node): a Node, or a
    tuple of Nodes for a tuple expression."""
    def walk(node):
        if isinstance(node, ast.Tuple):
            return tuple(walk(item) for item in node.elts)
        if isinstance(node, ast.BinOp):
            return binary(_AST_BINARY[type(node.op)], walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp):
            value = walk(node.operand)
            return negative(value) if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.Compare):
            return binary(_AST_COMPARE[type(node.ops[0])], walk(node.left), walk(node.comparators[0]))
        if isinstance(node, ast.Call):
            args = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else walk(a)
                    for a in node.args]
            return call(node.func.id, args)
        if isinstance(node, ast.Name):
            return values[node.id]
        return as_node(node.value)
    return walk(tree.body)


def call(name: str, args: list) -> Node:
    """NAMESPACE[name](*args) with its arity checked (a ValueError naming the function)."""
    arity = FUNCTIONS[name]
    low = 3 if name == "dropout" else arity
    if not low <= len(args) <= arity:
        expected = f"{low} or {arity}" if low != arity else str(arity)
        raise ValueError(f"{name}() takes {expected} arguments, got {len(args)}")
    return NAMESPACE[name](*args)



def nodes(roots: tuple):
    """Every node of the trees, each once (shared subtrees too), parents before children."""
    seen, stack = set(), list(reversed(roots))
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            yield node
            stack.extend(reversed(node.args))


def evaluate(roots: tuple, operands: list, functions: dict, convert=None) -> tuple:
    """The roots' values over `operands` (values of operand 0, 1, ...) computed by another
    library: functions maps each op name (add, exp, where, cast, dropout, ...) to a callable of
    the node's argument values (cast's second is the dtype); convert(node, value), if given,
    post-processes each node's value. Shared subtrees are computed once."""
    memo = {}

    def walk(node):
        key = node.key
        if key not in memo:
            if node.op == "operand":
                value = operands[node.value]
            elif node.op == "constant":
                value = node.value
            else:
                args = [walk(a) for a in node.args]
                value = functions[node.op](*args, node.dtype) if node.op == "cast" else functions[node.op](*args)
            memo[key] = value if convert is None else convert(node, value)
        return memo[key]
    return tuple(walk(root) for root in roots)
