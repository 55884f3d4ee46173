"""The graphs of cupyops.dask: argument checks, the chunk rules (axes in one chunk,
aligned operands, slabs for dropout) and one task a block calling a single-array op on
the block's GPU, with its counters moved to the block (BlockShift) and its several
results split into Dask arrays (map_outputs). And the serializers of CuPy arrays that
keep bfloat16 when a block moves between Dask workers (register_serializers, run when
this module is imported: on the client, and on the workers of
dask_cluster.local_cluster, which import it first)."""
from __future__ import annotations

import contextlib
import importlib.util
import operator
import pickle
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import dask.array as da
import numpy
from dask.array.core import PerformanceWarning, unify_chunks
from dask.base import tokenize
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph

from cupyops.dask_chunks import (chunk_starts, cupy_meta, describe_bytes, linear_start, moved_bytes,
                                 shape_of, slab_chunks)


# -- arguments -----------------------------------------------------------------------------------

def cupy_chunks(x, name: str):
    """x, a Dask array of CuPy chunks; TypeError naming `name` otherwise."""
    import cupy

    if not isinstance(x, da.Array):
        raise TypeError(f"{name} must be a Dask array of CuPy chunks (dask.array.Array), got {type(x).__name__}")
    meta = x._meta
    if not isinstance(meta, cupy.ndarray):
        kind = f"{type(meta).__module__}.{type(meta).__name__}"
        raise TypeError(f"{name} is a Dask array of {kind} chunks; cupyops.dask runs on CuPy chunks: "
                        f"{name}.map_blocks(cupy.asarray) moves them to the GPU")
    return x


def operand(value, name: str):
    """An array operand as a Dask array of CuPy chunks (a CuPy array becomes one chunk); None stays None."""
    import cupy

    if value is None or isinstance(value, da.Array):
        return value if value is None else cupy_chunks(value, name)
    if isinstance(value, cupy.ndarray):
        return da.from_array(value, chunks=value.shape, asarray=False, name=False)
    raise TypeError(f"{name} must be a Dask array of CuPy chunks or a CuPy array, got {type(value).__name__}")


def check_like(value, name: str, shape: tuple, dtype=None):
    """value (a Dask array or None) of exactly `shape` (and `dtype`), else an error naming it."""
    if value is not None:
        if dtype is not None and value.dtype != dtype:
            raise TypeError(f"{name} has dtype {value.dtype}, expected {numpy.dtype(dtype)} (the input's)")
        if value.shape != tuple(shape):
            raise ValueError(f"{name} has shape {value.shape}, expected {tuple(shape)}")
    return value


def check_broadcast(value, name: str, shape: tuple):
    """value (a Dask array or None) that broadcasts to exactly `shape`, else ValueError naming it."""
    if value is not None:
        try:
            broadcast = numpy.broadcast_shapes(value.shape, shape)
        except ValueError:
            broadcast = None
        if broadcast != tuple(shape):
            raise ValueError(f"{name} of shape {value.shape} does not broadcast to x's shape {tuple(shape)}")
    return value


# -- chunks --------------------------------------------------------------------------------------

def warn_moved(op: str, name: str, old_chunks: tuple, new_chunks: tuple, itemsize: int, why: str) -> None:
    """A PerformanceWarning, at the caller's line, where the rechunk copies any bytes."""
    moved = moved_bytes(old_chunks, new_chunks, itemsize)
    if moved:
        frame, level = sys._getframe(), 1   # level 1: this function; then up to the caller of cupyops.dask
        while frame is not None and frame.f_globals.get("__name__") in ("cupyops.dask", __name__):
            frame, level = frame.f_back, level + 1
        warnings.warn(f"cupyops.dask.{op}: rechunking {name} {why} moves {describe_bytes(moved)}",
                      PerformanceWarning, stacklevel=level)


def whole(x, axes, name: str, op: str):
    """x (or None) with each of `axes` in one chunk; a PerformanceWarning says how many bytes
    that moves."""
    if x is None:
        return None
    cut = tuple(axis for axis in axes if x.numblocks[axis] > 1)
    if not cut:
        return x
    merged = x.rechunk({axis: -1 for axis in cut})
    warn_moved(op, name, x.chunks, merged.chunks, x.dtype.itemsize,
               f"so that axis {cut[0] if len(cut) == 1 else cut} lies in one chunk")
    return merged


def whole_right(value, axes: tuple, ndim: int, name: str, op: str):
    """whole for an operand broadcast against `ndim` axes: x's `axes` mapped onto its own."""
    if value is None:
        return None
    lead = ndim - value.ndim
    return whole(value, [axis - lead for axis in axes if axis >= lead], name, op)


def aligned(values: list):
    """values with their Dask arrays' chunks unified, broadcast from the right as
    NumPy aligns axes; and the chunks of the broadcast result."""
    positions = [i for i, v in enumerate(values) if isinstance(v, da.Array)]
    ndim = max(values[i].ndim for i in positions)
    letters = "".join(chr(ord("a") + axis) for axis in range(ndim))
    pairs = [item for i in positions for item in (values[i], letters[ndim - values[i].ndim:])]
    chunkss, unified = unify_chunks(*pairs)
    values = list(values)
    for i, array in zip(positions, unified):
        values[i] = array
    return values, tuple(chunkss[letter] for letter in letters)


def as_slabs(values: list, names: tuple, slabs: tuple, op: str) -> list:
    """values rechunked so that the blocks of their broadcast result are `slabs`, a chunking
    from dask_chunks.slab_chunks; a PerformanceWarning for each one whose bytes move."""
    ndim = len(slabs)
    rechunked = []
    for i, value in enumerate(values):
        if isinstance(value, da.Array):
            lead = ndim - value.ndim
            target = tuple(sizes if value.shape[axis] == 1 else slabs[lead + axis]
                           for axis, sizes in enumerate(value.chunks))
            warn_moved(op, names[i] or f"argument {i}", value.chunks, target, value.dtype.itemsize,
                       "into blocks that are contiguous runs of the whole array (dropout's counters)")
            value = value.rechunk(target)
        rechunked.append(value)
    return rechunked


# -- blocks --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockShift:
    """Scalar operands that count from the whole array's first element, moved to
    each block's: those at `linear` by the block's linear start (dropout's
    offset), those at `rows` by its start along axis -2 (causal's diagonal).
    starts, shape: the result's (dask_chunks.chunk_starts, shape_of)."""
    starts: tuple
    shape: tuple
    linear: tuple = ()
    rows: tuple = ()

    @classmethod
    def of(cls, chunks: tuple, linear: tuple = (), rows: tuple = ()) -> "BlockShift":
        """The shift of the blocks of a result of `chunks`."""
        return cls(chunk_starts(chunks), shape_of(chunks), linear, rows)

    def apply(self, values: tuple, block_id: tuple) -> list:
        values = list(values)
        for i in self.linear:
            values[i] += linear_start(self.starts, self.shape, block_id)
        for i in self.rows:
            values[i] += self.starts[-2][block_id[-2]]
        return values


@dataclass(frozen=True)
class BlockCall:
    """op(**{name: block}, **kwargs) on the GPU of the block's first CuPy array, every other CuPy
    operand copied there if elsewhere (positional where the name is None); `shift` moves counters
    to the block."""
    op: Callable
    names: tuple
    kwargs: dict = field(default_factory=dict)
    shift: Optional[BlockShift] = None

    def __call__(self, *values, block_id=None):
        if self.shift is not None:
            values = self.shift.apply(values, block_id)
        with on_device_of(values):
            values = on_one_device(values)
            positional = [v for name, v in zip(self.names, values) if name is None]
            named = {name: v for name, v in zip(self.names, values) if name is not None}
            return self.op(*positional, **named, **self.kwargs)


def _block_device(values):
    """The GPU of the first CuPy array among `values` (the op's first array operand: x, dy, a), or None."""
    import cupy

    return next((v.device for v in values if isinstance(v, cupy.ndarray)), None)


def on_device_of(values):
    """Context making the GPU of the first CuPy array among `values` current (nothing where there
    is none): a block's op runs where the block is, whatever GPU the worker thread has current."""
    device = _block_device(values)
    return device if device is not None else contextlib.nullcontext()


def on_one_device(values) -> list:
    """values with every CuPy array that is not on the GPU of the first one copied there (within
    on_device_of(values)): an operand shared by blocks on several GPUs of one process (a weight,
    a filter, a bias given as one CuPy array) follows each block. With one GPU a worker, as on
    dask-cuda, nothing is copied."""
    import cupy

    device = _block_device(values)
    return [v.copy() if isinstance(v, cupy.ndarray) and v.device != device else v for v in values]


@dataclass(frozen=True)
class Output:
    """One result of a block call: its dtype, the input axes it drops, and its chunks
    where they differ from the blocks' (same number of blocks)."""
    dtype: numpy.dtype
    dropped: tuple = ()
    chunks: Optional[tuple] = None


def map_outputs(call: BlockCall, values: list, outputs: list, token: str):
    """A tuple of Dask arrays, one per output: call over the blocks of `values` (Dask arrays
    with aligned chunks, broadcast from the right, and other values passed as they are)."""
    ndim = max(v.ndim for v in values if isinstance(v, da.Array))
    first = outputs[0] if len(outputs) == 1 else Output(outputs[0].dtype)   # else: blocks of tuples
    blocks = da.map_blocks(call, *values, dtype=first.dtype, chunks=first.chunks, meta=cupy_meta(first.dtype, ndim),
                           token=token)
    if len(outputs) == 1:
        return (blocks,)
    return tuple(take(blocks, i, output, token) for i, output in enumerate(outputs))


def take(blocks, i: int, output: Output, token: str):
    """Result i of every block of `blocks` (blocks of tuples), without the output's dropped
    axes (each one chunk), as a Dask array of output's chunks."""
    name = f"{token}-{i}-{tokenize(blocks.name, i)}"
    graph = {(name, *(b for axis, b in enumerate(key[1:]) if axis not in output.dropped)): (operator.getitem, key, i)
             for key in flatten(blocks.__dask_keys__())}
    chunks = output.chunks or tuple(c for axis, c in enumerate(blocks.chunks) if axis not in output.dropped)
    return da.Array(HighLevelGraph.from_collections(name, graph, dependencies=[blocks]), name, chunks=chunks,
                    meta=cupy_meta(output.dtype, len(chunks)))


def run(op: Callable, names: tuple, values: list, outputs: list, token: str, kwargs: dict,
        shift_for: Optional[Callable] = None, slabs_whole: Optional[tuple] = None) -> tuple:
    """Aligns `values`, rechunks them into slabs where `slabs_whole` is given (the axes to keep
    whole), and maps op over the blocks; shift_for(chunks) gives the BlockShift, if any."""
    blocks, chunks = aligned(values)
    if slabs_whole is not None and slab_chunks(chunks, slabs_whole) != chunks:
        chunks = slab_chunks(chunks, slabs_whole)
        blocks = as_slabs(values, names, chunks, token)
    shift = shift_for(chunks) if shift_for is not None else None
    return map_outputs(BlockCall(op, names, kwargs, shift), blocks, outputs, token)


# -- serialization -------------------------------------------------------------------------------
# distributed sends a CuPy array between workers as its bytes and a header holding the dtype as
# the array's __cuda_array_interface__ typestr, dtype.str: for ml_dtypes' bfloat16 that is '<V2',
# so the block arrives as void (|V2) and neither cupyops nor a concatenation in Dask's own tasks
# (a rechunk) takes it. The wrappers below add the dtype itself (pickled) to the header where its
# typestr loses it, and view the array back to it when it arrives. Both ends need them: they are
# installed when this module is imported, in the client and in every worker of
# dask_cluster.local_cluster (which imports it as the worker starts); for another cluster,
# dask_cluster.register_serializers(client) installs them on its workers.

DTYPE_HEADER = "cupyops-dtype"


def carrying_dtype(dumps: Callable) -> Callable:
    """A serializer wrapping `dumps` (distributed's, x -> (header, frames)) that also writes x's
    dtype into the header where dtype.str does not name it (bfloat16 and other ml_dtypes)."""
    if getattr(dumps, "carries_dtype", False):
        return dumps

    def serialize(x):
        header, frames = dumps(x)
        if numpy.dtype(x.dtype.str) != x.dtype:
            header = dict(header, **{DTYPE_HEADER: pickle.dumps(x.dtype)})
        return header, frames

    serialize.carries_dtype = True
    return serialize


def restoring_dtype(loads: Callable) -> Callable:
    """A deserializer wrapping `loads` (distributed's, (header, frames) -> x) that views x back
    to the dtype carrying_dtype wrote into the header, if any."""
    if getattr(loads, "carries_dtype", False):
        return loads

    def deserialize(header, frames):
        x = loads(header, frames)
        if DTYPE_HEADER in header:
            dtype = pickle.loads(header[DTYPE_HEADER])
            if x.dtype != dtype:
                x = x.view(dtype)
        return x

    deserialize.carries_dtype = True
    return deserialize


def wrap_serializers(cls, families) -> None:
    """The (serialize, deserialize) dispatchers of each family (dask.utils.Dispatch) hold, for
    `cls`, their functions for it wrapped by carrying_dtype and restoring_dtype (once)."""
    for dumps, loads in families:
        dumps.register(cls, carrying_dtype(dumps.dispatch(cls)))
        loads.register(cls, restoring_dtype(loads.dispatch(cls)))


def register_serializers() -> bool:
    """Wraps distributed's serializers of cupy.ndarray ("cuda" and "dask" families) in this
    process so that they keep bfloat16; whether they are (not where distributed, or its CuPy
    serializers, which need rmm or numba, cannot be imported: arrays are then pickled, which
    keeps the dtype)."""
    if importlib.util.find_spec("distributed") is None:
        return False
    try:
        import cupy
        import distributed.protocol.cupy  # noqa: F401 - registers distributed's own first, wrapped below
        from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
        from distributed.protocol.serialize import dask_deserialize, dask_serialize
    except Exception:  # noqa: BLE001 - ImportError, or a failure of CuPy's optional modules
        return False
    wrap_serializers(cupy.ndarray, ((cuda_serialize, cuda_deserialize), (dask_serialize, dask_deserialize)))
    return True


register_serializers()
