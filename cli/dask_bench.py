"""`cupyops bench dask`: layer_norm and softmax over a Dask array of CuPy chunks made on
the workers of a local cluster, one worker per GPU (cupyops.dask_cluster), on 1 and 2 GPUs,
against the plain single-array op over the bytes one GPU holds. Needs the `dask` extra.

Bytes counted: x read and y written (2 * x.nbytes). A Dask run: x persisted on the
workers first, an even run of its row blocks on each; then, repeated, y = op(x).persist(),
wait(y) and every worker's GPU synchronised, timed by the client's clock from the persist
to the last GPU idle (the graph of y built before); the median, the first run (compiles,
memory pools) left out.
Nothing moves to the client. The plain op: one array of the bytes each GPU holds in the
Dask run, on a worker, timed by CUDA events; the median.
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import time

import click

from cupyops import dtypes

from .common import bench, dtype_option, int_list

OPS = ("layer_norm", "softmax")
GIB = 2 ** 30


def _apply(op: str, library, x, weight, bias):
    """op through `library` (cupyops or cupyops.dask): layer_norm with weight and bias, softmax over rows."""
    return library.layer_norm(x, weight, bias) if op == "layer_norm" else library.softmax(x, axis=-1)


def _plain_seconds(op: str, rows: int, cols: int, dtype_name: str, reps: int) -> float:
    """On a worker: the median time of the single-array op over rows x cols (CUDA events)."""
    import cupy
    import numpy

    import cupyops

    dtype = dtypes.parse_dtype(dtype_name)
    generator = cupy.random.default_rng(1)
    x = cupy.empty((rows, cols), dtype)
    step = max(1, GIB // (cols * 4))   # filled a float32 GiB at a time
    for start in range(0, rows, step):
        x[start:start + step] = generator.standard_normal((min(step, rows - start), cols), numpy.float32)
    weight, bias = (generator.standard_normal(cols, numpy.float32).astype(dtype) for _ in range(2))
    _apply(op, cupyops, x, weight, bias)
    began, ended = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(reps):
        began.record()
        y = _apply(op, cupyops, x, weight, bias)
        ended.record()
        ended.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(began, ended) / 1e3)
        del y
    del x
    cupy.get_default_memory_pool().free_all_blocks()
    return statistics.median(samples)


def _dask_seconds(client, op: str, x, weight, bias, reps: int) -> float:
    import distributed

    import cupyops.dask as cd
    from cupyops.dask_cluster import synchronize_workers

    samples = []
    for _ in range(reps + 1):
        y = _apply(op, cd, x, weight, bias)
        began = time.perf_counter()
        y = y.persist()
        distributed.wait(y)
        synchronize_workers(client)
        samples.append(time.perf_counter() - began)
        client.cancel(y)
        del y
    return statistics.median(samples[1:])


def _free_pools():
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


def measure(ops: list, gib: float, cols: int, chunk_mibs: list, gpu_counts: list, dtype, reps: int) -> dict:
    """Every (op, GPUs, chunk size) point: median seconds and GB/s; the plain op per GPU count."""
    import distributed

    from cupyops.dask_cluster import local_cluster, persist_spread, random_normal

    rows = int(gib * GIB) // (cols * dtype.itemsize)
    num_bytes = 2 * rows * cols * dtype.itemsize
    result = {"dtype": dtype.name, "rows": rows, "cols": cols, "bytes": num_bytes, "clusters": {}, "points": [],
              "plain": []}
    for gpus in gpu_counts:
        cluster, started = local_cluster(gpus)
        with cluster, distributed.Client(cluster) as client:
            result["clusters"][gpus] = started
            worker = next(iter(client.scheduler_info()["workers"]))
            for op in ops:
                seconds = client.submit(_plain_seconds, op, rows // gpus, cols, dtype.name, reps, workers=[worker],
                                        pure=False).result()
                result["plain"].append({"op": op, "gpus": gpus, "rows": rows // gpus, "seconds": seconds,
                                        "gbs": num_bytes / gpus / seconds / 1e9})
            client.run(_free_pools)
            weight, bias = (random_normal((cols,), -1, dtype, seed=s).persist() for s in (1, 2))
            for chunk_mib in chunk_mibs:
                chunk_rows = max(1, chunk_mib * 2 ** 20 // (cols * dtype.itemsize))
                x = persist_spread(client, random_normal((rows, cols), (chunk_rows, cols), dtype))
                distributed.wait(x)
                for op in ops:
                    seconds = _dask_seconds(client, op, x, weight, bias, reps)
                    result["points"].append({"op": op, "gpus": gpus, "chunk_mib": chunk_mib,
                                             "blocks": x.numblocks[0], "seconds": seconds,
                                             "gbs": num_bytes / seconds / 1e9})
                client.cancel(x)
                del x
    return result


def format_table(result: dict) -> str:
    plain = {(p["op"], p["gpus"]): p["gbs"] for p in result["plain"]}
    one_gpu = {(p["op"], p["chunk_mib"]): p["gbs"] for p in result["points"] if p["gpus"] == 1}
    lines = [f"{result['dtype']} {result['rows']} x {result['cols']}, {result['bytes'] / 1e9:.1f} GB moved "
             f"(x read + y written); clusters: {result['clusters']}",
             f"{'op':<11} {'gpus':>4} {'chunk MiB':>9} {'blocks':>6} {'ms':>9} {'GB/s':>8} {'GB/s/GPU':>9} "
             f"{'x 1 GPU':>8} {'x plain':>8}"]
    for p in result["points"]:
        per_gpu = p["gbs"] / p["gpus"]
        scaling = p["gbs"] / one_gpu[p["op"], p["chunk_mib"]] if (p["op"], p["chunk_mib"]) in one_gpu else float("nan")
        lines.append(f"{p['op']:<11} {p['gpus']:>4} {p['chunk_mib']:>9} {p['blocks']:>6} {p['seconds'] * 1e3:>9.1f} "
                     f"{p['gbs']:>8.0f} {per_gpu:>9.0f} {scaling:>8.2f} {per_gpu / plain[p['op'], p['gpus']]:>8.2f}")
    for p in result["plain"]:
        lines.append(f"plain {p['op']} on one GPU, {p['rows']} rows: {p['seconds'] * 1e3:.1f} ms, {p['gbs']:.0f} GB/s")
    return "\n".join(lines)


@bench.command(name="dask")
@click.option("--op", "ops", default=",".join(OPS), show_default=True, help=f"Comma-separated, of {', '.join(OPS)}.")
@click.option("--gib", default=16.0, show_default=True, help="Size of the input array, all GPUs together.")
@click.option("--cols", default=8192, show_default=True, help="Row length (the reduced axis).")
@click.option("--chunk-mib", default="256,1024", show_default=True, help="Comma-separated chunk sizes (MiB).")
@click.option("--gpus", default="1,2", show_default=True, help="Comma-separated numbers of workers, one GPU each.")
@click.option("--reps", default=7, show_default=True, help="Timed runs of each point (after one more, untimed).")
@dtype_option
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results as JSON.")
def dask_command(ops, gib, cols, chunk_mib, gpus, reps, dtype, json_path):
    """Throughput of cupyops.dask layer_norm and softmax on 1 and 2 GPUs (a local cluster, one
    worker per GPU) against the plain single-array op over the bytes each GPU holds."""
    if importlib.util.find_spec("distributed") is None:
        raise click.ClickException("bench dask needs the dask extra: pip install 'cupyops[dask]'")
    from cupyops.dask_cluster import gpu_count

    names = [name.strip() for name in ops.split(",") if name.strip()]
    unknown = sorted(set(names) - set(OPS))
    if unknown or not names:
        raise click.BadParameter(f"unknown op(s) {unknown}; known: {', '.join(OPS)}", param_hint="--op")
    counts = int_list(gpus)
    available = gpu_count()
    if not counts or min(counts) < 1 or max(counts) > available:
        raise click.BadParameter(f"--gpus {gpus!r}: this machine has {available} GPU(s)", param_hint="--gpus")
    result = measure(names, gib, cols, int_list(chunk_mib), counts, dtypes.parse_dtype(dtype), reps)
    click.echo(format_table(result))
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(result, handle, indent=1)
