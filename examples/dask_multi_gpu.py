"""layer_norm and softmax with cupyops.dask over a float16 Dask array larger than one GPU
holds comfortably, on a local cluster of one worker per GPU, checked against NumPy.

The cluster is dask-cuda's LocalCUDACluster, or, where dask-cuda is missing or fails to
start, a distributed cluster of one Nanny per GPU with CUDA_VISIBLE_DEVICES set for each
(cupyops.dask_cluster.local_cluster; the first line printed says which). The input is
made on the workers (CuPy's generator, block by block), never on the host; the sample
checked (rows at the start, middle and end) is brought to the host and compared with
float64 NumPy.

By default the input is sized from the workers' GPU memory: x and its two results take
FILL of it all together (on two 80 GB GPUs, x is about 40 GiB and the three arrays about
120 GiB, more than one of the GPUs holds), in 256 MiB chunks of rows of 8192; --gib sets it.

Usage (repository root, GPUs, the dask extra):
    PYTHONPATH=. python examples/dask_multi_gpu.py [--gib G] [--chunk-mib 256] [--cols 8192] [--workers N]
"""
from __future__ import annotations

import argparse
import sys
import time

import dask.array as da
import numpy
from distributed import Client, wait

import cupyops.dask as cd
from cupyops import dask_cluster

RTOL = 2e-3          # float16 results: two roundings of the output
EPS = 1e-5
SAMPLE_ROWS = 256    # checked against NumPy at each of three places
FILL = 0.75          # of the workers' GPU memory, all together, that x and its two results take by default


def _gpu_bytes() -> int:
    """On a worker: its GPU's memory."""
    import cupy

    return cupy.cuda.Device().mem_info[1]


def reference_layer_norm(x, weight, bias):
    x = x.astype(numpy.float64)
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / numpy.sqrt(x.var(-1, keepdims=True) + EPS) * weight + bias


def reference_softmax(x):
    x = x.astype(numpy.float64)
    e = numpy.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def worst_error(actual, expected) -> float:
    """The largest |actual - expected| / (|expected| + mean |expected|): below RTOL passes (the
    mean: float16's subnormals, and outputs near 0 computed from larger terms)."""
    scale = numpy.abs(expected) + numpy.abs(expected).mean()
    return float((numpy.abs(actual.astype(numpy.float64) - expected) / scale).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=None,
                        help=f"input size, all GPUs together (default: x and its two results {FILL:.0%} of the "
                             "workers' GPU memory)")
    parser.add_argument("--chunk-mib", type=int, default=256, help="chunk size")
    parser.add_argument("--cols", type=int, default=8192, help="row length (normalised, softmax axis)")
    parser.add_argument("--workers", type=int, default=None, help="GPUs to use (default: all)")
    args = parser.parse_args()

    dtype = numpy.dtype(numpy.float16)
    chunk_rows = max(1, args.chunk_mib * 2 ** 20 // (args.cols * dtype.itemsize))
    cluster, started = dask_cluster.local_cluster(args.workers or dask_cluster.gpu_count())
    print(f"cluster: {started}, {len(cluster.workers)} worker(s)")
    with cluster, Client(cluster) as client:
        memory = client.run(_gpu_bytes)
        x_bytes = args.gib * 2 ** 30 if args.gib is not None else FILL * sum(memory.values()) / 3
        rows = max(1, int(x_bytes) // (args.cols * dtype.itemsize))
        print(f"GPU memory of the workers: {', '.join(f'{b / 2 ** 30:.0f} GiB' for b in memory.values())}")
        x = dask_cluster.random_normal((rows, args.cols), (chunk_rows, args.cols), dtype, seed=1)
        x = dask_cluster.persist_spread(client, x)     # an even share of the row blocks on each GPU
        weight, bias = client.persist([dask_cluster.random_normal((args.cols,), -1, dtype, seed=s) for s in (2, 3)])
        wait([x, weight, bias])
        print(f"x: {x.shape} {x.dtype}, {x.nbytes / 2 ** 30:.1f} GiB in {x.numblocks[0]} chunks of "
              f"{chunk_rows * args.cols * dtype.itemsize / 2 ** 20:.0f} MiB, on the workers")

        results = {"layer_norm": cd.layer_norm(x, weight, bias, eps=EPS), "softmax": cd.softmax(x, axis=-1)}
        began = time.perf_counter()
        persisted = client.persist(list(results.values()))
        wait(persisted)
        dask_cluster.synchronize_workers(client)
        seconds = time.perf_counter() - began
        print(f"layer_norm and softmax: {seconds:.2f} s ({2 * 2 * x.nbytes / seconds / 1e9:.0f} GB/s of x read and "
              "y written, compiles included)")

        starts = sorted({0, max(0, rows // 2 - SAMPLE_ROWS // 2), max(0, rows - SAMPLE_ROWS)})   # start, middle, end
        sampled = [da.concatenate([dask_cluster.to_host(a[s:s + SAMPLE_ROWS]) for s in starts])
                   for a in (x, *persisted)]
        sample_x, ln, sm, w, b = client.compute(sampled + [dask_cluster.to_host(v) for v in (weight, bias)], sync=True)
        errors = {"layer_norm": worst_error(ln, reference_layer_norm(sample_x, w.astype(numpy.float64),
                                                                     b.astype(numpy.float64))),
                  "softmax": worst_error(sm, reference_softmax(sample_x))}
    failed = [name for name, error in errors.items() if not error < RTOL]
    for name, error in errors.items():
        print(f"{name}: {len(sample_x)} rows from {starts} against float64 NumPy, worst relative error "
              f"{error:.2e} ({'FAILED' if name in failed else 'ok'}, tolerance {RTOL})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
