"""Fused elementwise kernels from expressions: plan -> launch -> public functions.

An expression tree (cupyops.fx) becomes one kernel in which each thread reads its packs
of every operand, runs the whole chain in registers and writes each output once.
Operands broadcast NumPy-style; each is read at the output's linear index in the cheapest
way its layout allows (`OPERAND_ACCESS`): the output's own layout, a block repeated over
the leading axes (a per-column bias), one value per run of elements (a per-row value), one
element, or through its strides.

policy="oneflow" launches as OneFlow's elementwise.cuh does: pack = the smallest
16 / itemsize (at most 8) over the operands, 1 if any pointer is off that pack's
alignment, 256 threads, GetNumBlocks with 32 waves, the tail in the same launch.
policy="auto" reads misaligned operands element by element without narrowing the others,
and launches as measured fastest for its estimated arithmetic per byte (`launch_candidates`
lists what it chooses among; the device profile's `ELEMENTWISE_AUTO_LAUNCH` the winners: for
rows of least estimated instructions per byte moved (OP_COST), a launch of block, bytes of each
operand a thread has in flight and waves). A grid that covers every pack runs no loop and asks
for every thread an SM holds (`__launch_bounds__`), unless that would spill.
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy

from .. import arrays, fx
from ..callcache import cupy_module
from ..launch import MAX_GRID_X, LaunchCache, Target, fast_divisor, get_num_blocks, live_function
from ..profile import profile_for
from .elementwise_kernel import C_TYPES, ElementwiseSpec, OperandSpec, fast_math, generate
from .elementwise_launch import MAX_PACK_BYTES, PYTHON_SCALARS, Launcher, getter, signature

ONEFLOW_BLOCK = 256
ONEFLOW_MAX_PACK = 8            # OneFlow's kMaxPackSize
# Estimated float32 instructions per element of each op (others: 1); double costs twice.
OP_COST = {"exp": 8, "log": 10, "tanh": 14, "sigmoid": 16, "erf": 24, "rsqrt": 4, "gelu": 28,
           "gelu_tanh": 20, "silu": 17, "power": 20, "divide": 8, "dropout": 30}


# -- layout: how each operand is read at the output's linear index ----------------------------

def merged_axes(shape: tuple, operand_strides: list) -> tuple:
    """The output's axes merged where every operand steps through them as one axis:
    (sizes, [strides of each operand]), strides in elements, 0 where broadcast."""
    sizes, strides = [], [[] for _ in operand_strides]
    for axis, size in enumerate(shape):
        if size == 1:
            continue
        step = [s[axis] for s in operand_strides]
        if sizes and all(prev[-1] == now * size for prev, now in zip(strides, step)):
            sizes[-1] *= size
            for prev, now in zip(strides, step):
                prev[-1] = now
            continue
        sizes.append(size)
        for prev, now in zip(strides, step):
            prev.append(now)
    return sizes, strides


def classify(sizes: list, strides: list) -> tuple:
    """(access, inner, axes) of one operand over the merged axes."""
    contiguous = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
    if all(s == 0 for s in strides):
        return "scalar", 1, 0
    if strides == contiguous:
        return "linear", 1, 0
    for t in range(1, len(sizes)):
        inner = math.prod(sizes[t:])
        if all(s == 0 for s in strides[:t]) and strides[t:] == contiguous[t:]:
            return "inner", inner, 0
        if all(s == 0 for s in strides[t:]) and \
                strides[:t] == [math.prod(sizes[k + 1:t]) for k in range(t)]:
            return "outer", inner, 0
    return "strided", 1, len(sizes)


def launch_candidates() -> list:
    """(block, bytes of each operand in flight a thread, waves) launches auto chooses among:
    waves None covers the array in one pass, else a grid of that many rounds of resident
    blocks walks it."""
    return [(block, in_flight, waves) for block in (128, 256, 512) for in_flight in (16, 32)
            for waves in (None, 4, 8, 16, 32)]


def compute_per_byte(roots: tuple, streamed_itemsizes: list) -> float:
    """Estimated instructions per byte of the operands read and outputs written per element."""
    cost = sum(OP_COST.get(node.op, 1) * (2 if node.dtype == fx.FLOAT64 else 1)
               for node in fx.nodes(roots) if node.op not in ("operand", "constant"))
    return cost / max(1, sum(streamed_itemsizes))


def launch_geometry(launch: tuple, packs: int, pack_bytes: int, facts) -> tuple:
    """(block, packs_per_thread, grid) of a launch (block, bytes_in_flight, waves) over `packs`."""
    block, in_flight, waves = launch
    per_thread = max(1, in_flight // pack_bytes)
    grid = max(1, -(-packs // (block * per_thread)))
    if waves is not None:
        grid = min(grid, waves * facts.sm_count * (facts.max_threads_per_sm // block))
    return block, per_thread, min(grid, MAX_GRID_X)


# -- plan ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArrayInfo:
    """What planning needs of an array operand or output."""
    dtype: numpy.dtype
    shape: tuple
    strides: tuple           # in elements
    misalignment: int        # byte address % 16

    @classmethod
    def of(cls, array) -> "ArrayInfo":
        return cls(array.dtype, array.shape, tuple(s // array.itemsize for s in array.strides),
                   array.data.ptr % MAX_PACK_BYTES)

    @classmethod
    def contiguous(cls, dtype, shape) -> "ArrayInfo":
        shape = tuple(shape)
        return cls(numpy.dtype(dtype), shape, tuple(math.prod(shape[k + 1:]) for k in range(len(shape))), 0)


@dataclass(frozen=True)
class ElementwisePlan:
    spec: ElementwiseSpec
    grid: int
    block: int
    size: int                # elements of each output
    shape: tuple             # the outputs' shape
    out_dtypes: tuple
    arrays: tuple            # argument position of each array operand
    params: tuple            # the operands' integer kernel parameters, after the size
    scalars: tuple           # (argument position, numpy type) of each scalar argument
    dropout_p: tuple         # argument positions of scalar dropout probabilities

    def explain(self) -> dict:
        spec = self.spec
        return {"op": "elementwise", "expression": spec.expression, "shape": list(self.shape),
                "operands": [f"{o.dtype} {o.access}{'' if o.vector else ' (element loads)'}"
                             for o in spec.operands],
                "outputs": [dtype for dtype, _ in spec.outputs], "pack_size": spec.pack_size,
                "packs_per_thread": spec.packs_per_thread, "index_type": spec.index_type,
                "loop": "none (one pass)" if spec.one_pass else "grid-stride",
                "min_blocks_per_sm": spec.min_blocks or None,
                "math": "fast (16-bit outputs)" if spec.fast_math else "exact",
                "block": [self.block, 1, 1], "grid": [self.grid, 1, 1], "smem_bytes": 0,
                "kernel": spec.name}


def _used_operands(roots: tuple) -> list:
    return sorted({node.value for node in fx.nodes(roots) if node.op == "operand"})


def _dropout_probabilities(roots: tuple) -> tuple:
    """Argument positions of the scalar arguments that are a dropout's p (checked every call)."""
    return tuple(sorted({node.args[1].value for node in fx.nodes(roots)
                         if node.op == "dropout" and node.args[1].op == "operand"}))


def _scalar_argument(kind) -> tuple:
    """(C type, numpy type) a scalar argument is passed as: Python bool / int / float as bool /
    long long / double, a NumPy scalar as its own type (16-bit floats as float)."""
    dtype = numpy.dtype({bool: numpy.bool_, int: numpy.int64, float: numpy.float64}.get(kind, kind))
    if dtype.kind == "f" and dtype.itemsize == 2:
        return "float", numpy.float32
    return C_TYPES[dtype.name][1], dtype.type


def _vector_access(info: ArrayInfo, access: str, inner: int, pack_size: int) -> bool:
    """Whether an operand's pack is one access: 16-byte loads of the output's layout or of a
    repeated block on the pack's alignment, one load for a run of elements a pack divides."""
    aligned = info.misalignment % (pack_size * info.dtype.itemsize) == 0
    if access == "linear":
        return aligned
    if access == "inner":
        return aligned and inner % pack_size == 0
    if access == "outer":
        return inner % pack_size == 0
    return True


def make_plan(roots: tuple, args: tuple, outs: tuple, names: tuple, policy: str, target: Target,
              launch: Optional[tuple] = None) -> ElementwisePlan:
    """The launch of the kernel computing `roots` over `args` (ArrayInfo of arrays, Python or
    NumPy scalar types of scalars) into outputs `outs` (ArrayInfo or None each). launch: one of
    launch_candidates in place of auto's choice from the profile's ELEMENTWISE_AUTO_LAUNCH."""
    used = _used_operands(roots)
    array_positions = [i for i in used if isinstance(args[i], ArrayInfo)]
    try:
        shape = numpy.broadcast_shapes(*(args[i].shape for i in array_positions))
    except ValueError:
        described = ", ".join(f"{names[i]} {args[i].shape}" for i in array_positions)
        raise ValueError(f"operands cannot be broadcast together: {described}") from None
    size = math.prod(shape)
    out_dtypes = tuple(numpy.dtype(root.dtype) for root in roots)
    for k, (out, dtype) in enumerate(zip(outs, out_dtypes)):
        if out is not None and (out.shape != shape or out.dtype != dtype):
            raise ValueError(f"out{'' if len(outs) == 1 else f'[{k}]'} has shape {out.shape} and dtype "
                             f"{out.dtype}, expected {shape} and {dtype}")

    infos = [args[i] for i in array_positions]
    sizes, strides = merged_axes(shape, [broadcast_strides_of(info, len(shape)) for info in infos])
    layouts = [classify(sizes, s) for s in strides]
    out_infos = [out or ArrayInfo.contiguous(dtype, shape) for out, dtype in zip(outs, out_dtypes)]
    itemsizes = [info.dtype.itemsize for info in infos + out_infos]
    pack_size = min(min(MAX_PACK_BYTES // s, ONEFLOW_MAX_PACK) for s in itemsizes)
    if policy == "oneflow":   # one misaligned pointer: pack 1 for every operand
        pointers = [(info, access) for info, (access, _, _) in zip(infos, layouts)
                    if access in ("linear", "inner")] + [(out, "linear") for out in out_infos]
        if any(not _vector_access(info, access, pack_size, pack_size) for info, access in pointers):
            pack_size = 1
    operands = tuple(OperandSpec(info.dtype.name, access, _vector_access(info, access, inner, pack_size), axes)
                     for info, (access, inner, axes) in zip(infos, layouts))
    out_vectors = tuple(_vector_access(out, "linear", 1, pack_size) for out in out_infos)

    scalar_positions = [i for i in used if not isinstance(args[i], ArrayInfo)]
    scalar_types = [_scalar_argument(args[i]) for i in scalar_positions]
    arguments = {i: f"in{k}" for k, i in enumerate(array_positions)}
    arguments.update({i: f"s{k}" for k, i in enumerate(scalar_positions)})
    body, dropouts = generate(roots, arguments)

    packs = size // pack_size
    if policy == "oneflow":
        block, per_thread = ONEFLOW_BLOCK, 1
        grid = get_num_blocks(target.facts, block, -(-packs // block))
    else:
        if launch is None:
            streamed = [info.dtype.itemsize for info, (access, _, _) in zip(infos, layouts)
                        if access in ("linear", "strided")] + [out.dtype.itemsize for out in out_infos]
            intensity = compute_per_byte(roots, streamed)
            tuned = profile_for(target.facts)
            launch = [row_launch for least, row_launch in tuned.ELEMENTWISE_AUTO_LAUNCH if intensity >= least][-1]
        block, per_thread, grid = launch_geometry(launch, packs, pack_size * max(itemsizes), target.facts)
    # auto: a grid that covers every pack runs no loop and asks for every thread an SM holds
    one_pass = policy != "oneflow" and grid * block * per_thread >= packs
    # 32-bit indices where every element offset, and the loop's last pack index plus its step, fit
    extents = [sum(abs(s) * (n - 1) for n, s in zip(sizes, st)) + 1 for st in strides]
    index_type = "int" if max([size, *extents, packs + grid * block * per_thread]) < 2**31 else "long long"
    spec = ElementwiseSpec(
        expression=", ".join(root.canonical() for root in roots), body=body, operands=operands,
        scalars=tuple(c for c, _ in scalar_types), outputs=tuple(zip((d.name for d in out_dtypes), out_vectors)),
        dropouts=dropouts, pack_size=pack_size, packs_per_thread=per_thread, block_size=block,
        index_type=index_type, fast_math=fast_math(out_dtypes), one_pass=one_pass,
        min_blocks=target.facts.max_threads_per_sm // block if one_pass else 0)
    if spec.min_blocks and target.resources(spec)["local_bytes"]:   # not at the cost of a spill
        spec = replace(spec, min_blocks=0)
    params = []
    for (access, inner, axes), st in zip(layouts, strides):
        if access == "strided":
            params += [*sizes, *st]
        elif access in ("inner", "outer"):
            params += (inner, *fast_divisor(inner)) if index_type == "int" else (inner, 0, 0)
    return ElementwisePlan(spec, grid, block, size, shape, out_dtypes, tuple(array_positions),
                           tuple(numpy.int64(v) for v in params),
                           tuple((i, t) for i, (_, t) in zip(scalar_positions, scalar_types)),
                           _dropout_probabilities(roots))


def broadcast_strides_of(info: ArrayInfo, ndim: int) -> list:
    """info's strides in elements over ndim output axes, 0 where it broadcasts."""
    pad = ndim - len(info.shape)
    return [0] * pad + [0 if n == 1 else s for n, s in zip(info.shape, info.strides)]


# -- launch and public functions ----------------------------------------------------------------

def operand_kind(value, name: str):
    """ArrayInfo of a GPU array, the type of a Python number, the dtype of a NumPy scalar;
    TypeError for anything else."""
    import cupy

    if isinstance(value, cupy.ndarray):
        if not fx.supported(value.dtype):
            raise TypeError(f"{name} has dtype {value.dtype}; elementwise kernels take bool, integer "
                            "and float16 / bfloat16 / float32 / float64 arrays")
        return ArrayInfo.of(value)
    if type(value) in PYTHON_SCALARS:
        return type(value)
    if isinstance(value, numpy.generic) and fx.supported(value.dtype):
        return value.dtype
    if isinstance(value, (complex, numpy.generic)):
        raise TypeError(f"{name} ({type(value).__name__}) is complex or of an unsupported dtype")
    raise TypeError(f"{name} ({type(value).__name__}) is neither a GPU array nor a Python number")


class FusedFunction:
    """A function of arrays and numbers compiled into one elementwise kernel per signature
    (operand dtypes, shapes, strides, alignment, device): see `fuse`. Traces are memoised per
    operand kinds, launchers per signature: a repeated call builds its key and launches."""

    def __init__(self, trace: Callable, names: Optional[tuple] = None, label: str = "function"):
        self._trace_fn, self._names, self._label = trace, names, label
        # {name: value} -> the operands in order (KeyError for a missing one), where named
        self.named_operands = None if names is None else getter(names)
        self._traces: dict = {}
        self._launchers = LaunchCache()
        self._lock = threading.Lock()

    def _names_for(self, count: int) -> tuple:
        return self._names or tuple(f"argument {i}" for i in range(count))

    def trace(self, kinds: tuple) -> tuple:
        """The output nodes for operands of these kinds (ArrayInfo, Python number types, dtypes)."""
        key = tuple(k.dtype if isinstance(k, ArrayInfo) else k for k in kinds)
        roots = self._traces.get(key)
        if roots is None:
            nodes = [fx.operand(i, k.dtype) if isinstance(k, ArrayInfo) else
                     fx.operand(i, {bool: fx.BOOL, int: fx.INT64, float: fx.FLOAT64}[k], weak=True)
                     if isinstance(k, type) else fx.operand(i, k) for i, k in enumerate(kinds)]
            result = self._trace_fn(*nodes)
            roots = tuple(fx.as_node(r) for r in (result if isinstance(result, tuple) else (result,)))
            if not roots:
                raise ValueError(f"{self._label} returned no output")
            self._traces[key] = roots
        return roots

    def plan(self, args: tuple, out=None, policy: str = "auto", target: Optional[Target] = None,
             launch: Optional[tuple] = None) -> ElementwisePlan:
        """The launch plan for these operands (arrays or ArrayInfo, numbers): no kernel runs.
        launch: (block, packs_per_thread, waves) in place of auto's rule."""
        names = self._names_for(len(args))
        kinds = tuple(a if isinstance(a, (ArrayInfo, numpy.dtype)) or (isinstance(a, type) and a in PYTHON_SCALARS)
                      else operand_kind(a, name) for a, name in zip(args, names))
        roots = self.trace(kinds)
        outs = self._out_infos(out, len(roots))
        if target is None:
            target = Target.live(cupy_module().cuda.runtime.getDevice())
        return make_plan(roots, kinds, outs, names, arrays.check_policy(policy), target, launch)

    @staticmethod
    def _out_infos(out, count: int) -> tuple:
        if out is None:
            return (None,) * count
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != count:
            raise ValueError(f"out has {len(outs)} arrays for {count} outputs")
        return tuple(o if isinstance(o, ArrayInfo) else ArrayInfo.of(o) for o in outs)

    def __call__(self, *args, out=None, policy: str = "auto", stream=None):
        launcher = self._launchers.peek(signature(args, out, policy))
        if launcher is None:
            return self._call_new(args, out, policy, stream)
        return launcher.run(args, out, stream)

    def call(self, args: tuple, out=None, policy: str = "auto", stream=None):
        """self(*args, out=out, policy=policy, stream=stream), its arguments passed as they are
        (the named ops' and cupyops.elementwise's way in)."""
        launcher = self._launchers.peek(signature(args, out, policy))
        if launcher is None:
            return self._call_new(args, out, policy, stream)
        return launcher.run(args, out, stream)

    def _call_new(self, args: tuple, out, policy: str, stream):
        """A call no launcher serves yet: another library's GPU arrays among the operands (a CuPy
        view of each, then the call), or a new signature (its launcher prepared, then run)."""
        key = signature(args, out, policy)
        if key is None:
            ndarray = cupy_module().ndarray
            return self.call(tuple(b if type(b) is ndarray or isinstance(b, (*PYTHON_SCALARS, numpy.generic))
                                   else arrays.as_cupy(b, name) for b, name in zip(args, self._names_for(len(args)))),
                             out, policy, stream)
        return self._prepare(key, args, out, policy).run(args, out, stream)

    def remembered(self, args: tuple, policy: str = "auto") -> Optional[Launcher]:
        """The launcher a call on these operands (CuPy arrays and numbers, no out) took on the
        current GPU, or None (no such call, or nothing launched): a caller holding arrays of
        those layouts that are not CuPy's (cupyops.torch) replays it through its launch_at."""
        launcher = self._launchers.peek(signature(args, None, policy))
        return launcher if launcher and launcher.launch and launcher.device is None else None

    def _prepare(self, key: tuple, args: tuple, out, policy: str) -> Launcher:
        """The launcher of a new signature, on the GPU of the array operands (the current one
        where there are none): ValueError naming an operand or output on another GPU."""
        cupy = cupy_module()
        names = self._names_for(len(args))
        outs = () if out is None else out if isinstance(out, tuple) else (out,)
        placed = [(name, a) for name, a in zip(names, args) if isinstance(a, cupy.ndarray)]
        placed += [("out", o) for o in outs]
        device_id = placed[0][1].device.id if placed else key[1]
        for name, a in placed:
            if a.device.id != device_id:
                raise ValueError(f"{name} is on GPU {a.device.id}, {placed[0][0]} on GPU {device_id}")
        current = device_id == key[1]
        with self._lock, contextlib.nullcontext() if current else cupy.cuda.Device(device_id):
            plan = self.plan(args, out, policy, Target.live(device_id))
            launcher = Launcher(plan, live_function(plan.spec, device_id), args, out,
                                 None if current else device_id)
            self._launchers.put(key, launcher)
        return launcher


def fuse(fn: Callable = None):
    """Decorator: `fn` (a function of arrays and numbers written with + - * / **, comparisons
    and cupyops.fx's functions) becomes one fused kernel per operand signature.

    The result is called like fn, with keyword-only `out=` (an array, or a tuple for a
    function returning a tuple), `policy=` ("auto" or "oneflow") and `stream=`. Operands
    broadcast and promote as in NumPy (16-bit floats computed in float32). Equivalent of
    `cupy.fuse(fn)`, or `torch.compile` of an elementwise function."""
    if fn is None:
        return fuse
    wrapped = FusedFunction(fn, label=getattr(fn, "__name__", "function"))
    wrapped.__name__ = getattr(fn, "__name__", "fused")
    wrapped.__doc__ = fn.__doc__
    return wrapped


_expressions: dict = {}


def compiled_expression(expr: str) -> FusedFunction:
    """The FusedFunction of a string expression; its operands are the names in order of first use."""
    found = _expressions.get(expr)
    if found is None:
        tree, names = fx.parse(expr)
        found = FusedFunction(lambda *nodes: fx.build(tree, dict(zip(names, nodes))), names, repr(expr))
        if len(_expressions) > 1024:
            _expressions.clear()
        _expressions[expr] = found
    return found


def elementwise(expr: str, *, out=None, policy: str = "auto", stream=None, **operands):
    """Evaluates `expr` (e.g. "gelu_tanh(x + bias)") over the named operands in one kernel.

    Names are operands or cupyops.fx's functions; numbers are constants; `a, b` gives two
    outputs. Nothing is eval-ed: the text is parsed with `ast` and any other syntax or name
    raises ValueError. Equivalent of `numexpr.evaluate(expr)` on GPU arrays, or of
    `cupy.ElementwiseKernel` written in Python syntax."""
    function = _expressions.get(expr) or compiled_expression(expr)
    names = function._names
    try:
        values = function.named_operands(operands)
    except KeyError:
        missing = [name for name in names if name not in operands]
        raise ValueError(f"elementwise expression {expr!r} uses {', '.join(map(repr, missing))}, "
                         "which no operand gives") from None
    if len(operands) != len(names):
        unused = [name for name in operands if name not in names]
        raise ValueError(f"operand(s) {', '.join(map(repr, unused))} not used by {expr!r}")
    return function.call(values, out, policy, stream)
