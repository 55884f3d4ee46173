"""A local Dask cluster of one worker per GPU, and data made on its workers: where
examples/dask_multi_gpu.py and `cupyops bench dask` start. Needs the `dask` extra.

local_cluster starts dask-cuda's LocalCUDACluster; where dask-cuda is missing or
cannot start, a distributed.SpecCluster (what distributed.LocalCluster is built on)
of one Nanny per GPU, each worker seeing its GPU alone through CUDA_VISIBLE_DEVICES,
as LocalCUDACluster does. Either way a worker holds one GPU and one thread, and
imports cupyops.dask_graph as it starts (its serializers keep bfloat16 when blocks
move between workers); on a cluster started otherwise, register_serializers(client)
does that on its workers.
"""
from __future__ import annotations

import os

import numpy

from cupyops.dask_chunks import chunk_starts, cupy_meta


def gpu_count() -> int:
    """GPUs this process may use (0 where CUDA is not usable)."""
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


def local_cluster(n_workers: int, **options):
    """(cluster, what started it) for n_workers workers, each on its own GPU (spilling to the
    host off: a worker holds what its GPU holds). options: more arguments of the cluster."""
    available = gpu_count()
    if not 1 <= n_workers <= available:
        raise ValueError(f"n_workers must be 1 .. {available} (the GPUs here), got {n_workers}")
    options = dict(options, preload=[*_as_list(options.get("preload")), SERIALIZERS_MODULE])
    try:
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(n_workers=n_workers, threads_per_worker=1, device_memory_limit=0, **options)
        return cluster, "dask_cuda.LocalCUDACluster"
    except Exception as error:  # missing, or it failed to start: the same layout by hand
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
    return _spec_cluster(n_workers, **options), f"distributed.SpecCluster, CUDA_VISIBLE_DEVICES a worker ({reason})"


def _as_list(value) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _spec_cluster(n_workers: int, preload=(), **options):
    from distributed import Nanny, Scheduler, SpecCluster

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(gpu_count())]
    workers = {i: {"cls": Nanny, "options": {"nthreads": 1, "preload": list(preload), "env": {
        "CUDA_VISIBLE_DEVICES": ",".join(devices[i:] + devices[:i])}}} for i in range(n_workers)}
    return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
                       **options)


SERIALIZERS_MODULE = "cupyops.dask_graph"   # imported, it wraps distributed's CuPy serializers (bfloat16)


try:
    from distributed.diagnostics.plugin import WorkerPlugin as _WorkerPlugin
except ImportError:  # pragma: no cover - the extra is missing
    _WorkerPlugin = object


class SerializersPlugin(_WorkerPlugin):
    """A worker plugin installing cupyops.dask_graph's serializers on the worker (unpickling it
    imports this module; setup imports cupyops.dask_graph)."""

    def setup(self, worker=None):
        import importlib

        importlib.import_module(SERIALIZERS_MODULE).register_serializers()


def register_serializers(client) -> None:
    """Installs the serializers of CuPy arrays that keep bfloat16 (cupyops.dask_graph) on every
    worker of `client`'s cluster, present and future, and here: needed on a cluster not started
    by local_cluster, where blocks of bfloat16 move between workers (they would arrive as void)."""
    import importlib

    importlib.import_module(SERIALIZERS_MODULE).register_serializers()
    client.register_plugin(SerializersPlugin(), name="cupyops-serializers")


def _normal_block(seed: int, dtype, block_id=None, block_info=None):
    import cupy

    location = block_info[None]
    index = int(numpy.ravel_multi_index(block_id, location["num-chunks"]))
    generator = cupy.random.default_rng(seed * 1_000_003 + index)
    return generator.standard_normal(location["chunk-shape"], dtype=numpy.float32).astype(dtype)


def random_normal(shape: tuple, chunks, dtype, seed: int = 0):
    """A Dask array of CuPy chunks of standard normal values, each block made on the worker that
    holds it (cupy.random.default_rng of seed and the block's index), never on the host."""
    import dask.array as da
    from dask.array.core import normalize_chunks

    dtype = numpy.dtype(dtype)
    chunks = normalize_chunks(chunks, tuple(shape), dtype=dtype)
    return da.map_blocks(_normal_block, seed, dtype, chunks=chunks, dtype=dtype, meta=cupy_meta(dtype, len(shape)))


def persist_spread(client, x):
    """x persisted with its blocks along axis 0 split into one contiguous run per worker, the runs
    as even as the blocks allow (the scheduler alone may give one worker more).

    The runs are persisted apart and then their concatenation is persisted too, so that each block
    of the result is a key held in memory: left as `da.concatenate(parts)`, every graph built on
    the result would carry the concatenation's layer, one more task a block (it only renames the
    block, but each task costs the scheduler and the worker as much as a kernel's), run again on
    every compute. Each renaming task runs where its block is (its only dependency): nothing
    moves, nothing is copied."""
    import dask.array as da
    import distributed

    workers = sorted(client.scheduler_info()["workers"])
    bounds = numpy.linspace(0, x.numblocks[0], len(workers) + 1).round().astype(int)
    starts = (*chunk_starts(x.chunks)[0], x.shape[0])
    parts = [client.persist(x[starts[first]:starts[last]], workers=[worker])
             for worker, first, last in zip(workers, bounds[:-1], bounds[1:]) if last > first]
    if len(parts) == 1:
        return parts[0]
    spread = client.persist(da.concatenate(parts))
    distributed.wait(spread)           # the parts' keys may go only once the renaming tasks have run
    del parts
    return spread


def synchronize_workers(client) -> None:
    """Waits until every worker's GPU has finished the work queued on it (a task returns once
    its kernels are queued)."""
    client.run(_synchronize)


def _synchronize():
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


def to_host(array):
    """`array` (CuPy chunks) as a Dask array of NumPy chunks: each block copied to the host
    where it is, so that computing it moves no GPU array to the client."""
    import cupy

    return array.map_blocks(cupy.asnumpy, meta=numpy.empty((0,) * array.ndim, array.dtype))
