"""Chunk arithmetic of cupyops.dask, on chunks tuples alone (no Dask, no GPU).

A Dask array's chunks are a tuple, per axis, of the sizes of its chunks along
that axis; a block is one chunk of every axis. A block is a *slab* when its
elements are one contiguous run of the whole array's C-order linear index:
the only kind of block whose Philox counters (the element's linear index plus
`offset`, cupyops.philox) are the single-array op's with one shifted offset.
"""
from __future__ import annotations

import bisect
import itertools
import math


def cupy_meta(dtype, ndim: int):
    """A zero-size cupy.ndarray of `dtype` and `ndim` over no memory: the `meta`
    of a Dask array of CuPy chunks, made without touching a GPU."""
    import cupy
    from cupy.cuda import memory

    nowhere = memory.MemoryPointer(memory.UnownedMemory(0, 0, None, device_id=0), 0)
    return cupy.ndarray((0,) * ndim, dtype, nowhere)


def shape_of(chunks: tuple) -> tuple:
    """The shape of an array of `chunks`."""
    return tuple(sum(sizes) for sizes in chunks)


def chunk_starts(chunks: tuple) -> tuple:
    """Per axis, the index at which each chunk starts."""
    return tuple(tuple(itertools.accumulate(sizes[:-1], initial=0)) for sizes in chunks)


def linear_start(starts: tuple, shape: tuple, block_id: tuple) -> int:
    """The C-order linear index, in the whole array, of block `block_id`'s first element."""
    index, stride = 0, 1
    for axis in reversed(range(len(shape))):
        index += starts[axis][block_id[axis]] * stride
        stride *= shape[axis]
    return index


def is_slab(chunks: tuple) -> bool:
    """Whether every block is a slab: no axis holding a chunk longer than 1
    lies before an axis cut into several chunks."""
    cut = [axis for axis, sizes in enumerate(chunks) if len(sizes) > 1]
    return not cut or all(max(chunks[axis], default=0) <= 1 for axis in range(cut[-1]))


def _slabs_cut_at(chunks: tuple, shape: tuple, axis: int) -> tuple:
    """Slabs cut along `axis` as `chunks` cuts it: earlier axes in chunks of 1, later ones whole."""
    return tuple((1,) * size if a < axis else chunks[a] if a == axis else (size,)
                 for a, size in enumerate(shape))


def slab_chunks(chunks: tuple, whole_axes: tuple = ()) -> tuple:
    """`chunks` where its blocks are slabs, else the slab chunking nearest it in
    block size that keeps `whole_axes` in one chunk: blocks cut along one axis
    as `chunks` cuts it (chunks of 1 before it, whole after it), or one block."""
    if is_slab(chunks):
        return chunks
    shape = shape_of(chunks)
    limit = min((axis for axis in whole_axes if shape[axis] > 1), default=len(shape))
    block = math.prod(max(sizes) for sizes in chunks)
    options = [_slabs_cut_at(chunks, shape, axis) for axis in range(limit) if len(chunks[axis]) > 1]
    if not options:
        return tuple((size,) for size in shape)

    def distance(option):
        return abs(math.log(math.prod(max(sizes) for sizes in option) / block))

    return min(reversed(options), key=distance)   # ties: the deepest cut, the fewest blocks


def moved_bytes(old_chunks: tuple, new_chunks: tuple, itemsize: int) -> int:
    """Bytes a rechunk from old_chunks to new_chunks copies: every element whose
    new block does not lie inside one old block (a block cut out of one is a view)."""
    total = kept = 1
    for old, new in zip(old_chunks, new_chunks):
        boundaries = list(itertools.accumulate(old))
        inside = 0
        for start, size in zip(itertools.accumulate(new[:-1], initial=0), new):
            after_start = boundaries[bisect.bisect_right(boundaries, start)] if size else 0
            inside += size if after_start >= start + size else 0
        total *= sum(old)
        kept *= inside
    return (total - kept) * itemsize


def describe_bytes(num_bytes: int) -> str:
    """e.g. '805306368 bytes (768.0 MiB)'."""
    return f"{num_bytes} bytes ({num_bytes / 2**20:.1f} MiB)"
