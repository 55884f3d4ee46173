"""`cupyops bench dask`: layer_norm and softmax over a Dask array of CuPy chunks made on
the workers of a local cluster, one worker per GPU (cupyops.dask_cluster), on 1 and 2 GPUs,
against the plain single-array op over the bytes one GPU holds. Needs the `dask` extra.

Bytes counted: x read and y written (2 * x.nbytes), times the ops a run chains. A Dask run:
x persisted on the workers first, an even run of its row blocks on each; then, repeated,
y = op(x) (with --chain N, y = op(op(...op(x))), N ops each reading the last one's output, so
that the persist and the synchronisation are paid once for N ops' bytes) persisted,
waited for and every worker's GPU synchronised, timed by the client's clock from the persist
to the last GPU idle (the graph of y built and optimised before: Dask fuses the chain's ops of
a block into one task); the median, the first run (compiles,
memory pools) left out. Between runs, outside the timed region, y's futures are released
and the scheduler and workers are waited on until none holds y's keys: the next run's graph
has the same keys (a key resubmitted while the scheduler still cancels or releases it comes
back cancelled), and its blocks reuse the memory the last run's gave back. The timed region
holds the persist call (the client sends the optimised graph), the tasks, and one
`client.run` round trip for the GPU synchronisation.
The floor: the same graph over an array of as many blocks of FLOOR_ROWS rows, timed alike:
what a run costs the cluster (the graph sent and scheduled, the tasks' reports, the GPU
synchronisation) without the bytes; a run over x takes at least that plus its kernels.
Nothing moves to the client. The plain op: one array of the bytes each GPU holds in the
Dask run, on a worker, timed by CUDA events; the median.

Each measurement (a cluster, the plain op, a Dask point) that fails is reported with its
error and the others go on; the command then exits with status 1. Every result is printed
(stderr) and, with --json, written as soon as it is measured.
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import time
from typing import Callable

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


FLOOR_ROWS = 16          # rows a block of the floor's array: the run's cost without the kernels' bytes
RUN_TIMEOUT_S = 300      # one Dask run (a GPU's 16 GiB takes well under a second)
FORGET_TIMEOUT_S = 60    # the scheduler forgetting released keys


def _known_tasks(keys, dask_scheduler=None) -> int:
    """On the scheduler: how many of `keys` it still holds."""
    return sum(key in dask_scheduler.tasks for key in keys)


def _held_keys(keys, dask_worker=None) -> int:
    """On a worker: how many of `keys` it still holds data of."""
    return sum(key in dask_worker.data for key in keys)


def _release(client, futures, wait: bool = True) -> None:
    """Releases `futures` and (`wait`) waits until the scheduler has forgotten their keys and no
    worker holds their data any more, so that a graph of the same keys (the same op over the same
    x) is submitted anew, and its blocks are allocated from memory the last run's gave back to
    the workers' pools (the scheduler forgets a key before its worker drops the block)."""
    keys = [future.key for future in futures]
    for future in futures:
        future.release()
    if not wait:
        return
    deadline = time.monotonic() + FORGET_TIMEOUT_S
    while client.run_on_scheduler(_known_tasks, keys) or any(client.run(_held_keys, keys).values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster still holds keys of released futures after {FORGET_TIMEOUT_S} s")
        time.sleep(0.005)


def _wait(futures) -> None:
    """Waits for `futures`; the error of the first that failed raised."""
    import distributed

    distributed.wait(futures, timeout=RUN_TIMEOUT_S)
    for future in futures:
        if future.status == "error":
            future.result()       # raises the task's error


def _persist_seconds(client, graph) -> float:
    """Seconds from persisting `graph` until its blocks are computed and every GPU is idle; its
    futures released before returning (and, after a success, forgotten by the scheduler)."""
    import distributed

    from cupyops.dask_cluster import synchronize_workers

    began = time.perf_counter()
    futures = distributed.futures_of(client.persist(graph, optimize_graph=False))
    try:
        _wait(futures)
        synchronize_workers(client)
        seconds = time.perf_counter() - began
    except BaseException:
        _release(client, futures, wait=False)     # the error is what to report
        raise
    _release(client, futures)
    return seconds


def _chained(op: str, x, weight, bias, chain: int):
    """op applied `chain` times through cupyops.dask, each to the last one's output."""
    import cupyops.dask as cd

    for _ in range(chain):
        x = _apply(op, cd, x, weight, bias)
    return x


def _dask_seconds(client, op: str, x, weight, bias, reps: int, chain: int) -> float:
    import dask

    samples = [_persist_seconds(client, *dask.optimize(_chained(op, x, weight, bias, chain)))
               for _ in range(reps + 1)]
    return statistics.median(samples[1:])


def _free_pools():
    """On a worker: CuPy's pool gives its cached blocks back (between sizes of blocks)."""
    import cupy

    try:
        cupy.get_default_memory_pool().free_all_blocks()
    except cupy.cuda.runtime.CUDARuntimeError:   # no usable GPU: the measurements there say why
        pass


def _error_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


class _Results:
    """The results of `measure`, each entry reported (report(result, line)) as it is added."""

    def __init__(self, result: dict, report: Callable):
        self.result, self.report = result, report

    def add(self, kind: str, entry: dict, line: str) -> None:
        self.result[kind].append(entry)
        self.report(self.result, line)

    def failed(self, error: BaseException, **where) -> None:
        described = ", ".join(f"{key} {value}" for key, value in where.items())
        self.add("errors", dict(where, error=_error_text(error)), f"FAILED ({described}): {_error_text(error)}")


def measure(ops: list, gib: float, cols: int, chunk_mibs: list, gpu_counts: list, dtype, reps: int,
            report: Callable = lambda result, line: None, chain: int = 1) -> dict:
    """Every (op, GPUs, chunk size) point: median seconds and GB/s; the plain op per GPU count.
    A cluster, plain op or point that fails is in result["errors"] and the others go on;
    report(result, line) after each entry."""
    rows = int(gib * GIB) // (cols * dtype.itemsize)
    num_bytes = 2 * rows * cols * dtype.itemsize * chain
    result = {"dtype": dtype.name, "rows": rows, "cols": cols, "chain": chain, "bytes": num_bytes, "clusters": {},
              "points": [],
              "plain": [], "errors": []}
    results = _Results(result, report)
    for gpus in gpu_counts:
        try:
            _measure_cluster(results, gpus, ops, rows, cols, chunk_mibs, dtype, reps)
        except Exception as error:  # noqa: BLE001 - reported, and the next cluster measured
            results.failed(error, gpus=gpus, stage="cluster")
    return result


def _measure_cluster(results: _Results, gpus: int, ops: list, rows: int, cols: int, chunk_mibs: list, dtype,
                     reps: int) -> None:
    """The points of one local cluster of `gpus` workers into `results`."""
    import distributed

    from cupyops.dask_cluster import local_cluster, persist_spread, random_normal

    num_bytes = results.result["bytes"]
    cluster, started = local_cluster(gpus)
    with cluster, distributed.Client(cluster) as client:
        results.result["clusters"][gpus] = started
        results.report(results.result, f"{gpus} GPU(s): {started}")
        worker = next(iter(client.scheduler_info()["workers"]))
        for op in ops:
            try:
                seconds = client.submit(_plain_seconds, op, rows // gpus, cols, dtype.name, reps, workers=[worker],
                                        pure=False).result()
            except Exception as error:  # noqa: BLE001
                results.failed(error, gpus=gpus, op=op, stage="plain")
                continue
            results.add("plain", {"op": op, "gpus": gpus, "rows": rows // gpus, "seconds": seconds,
                                  "gbs": num_bytes / results.result["chain"] / gpus / seconds / 1e9},
                        f"plain {op}, {rows // gpus} rows on one GPU: {seconds * 1e3:.1f} ms")
        client.run(_free_pools)
        weight, bias = client.persist([random_normal((cols,), -1, dtype, seed=s) for s in (1, 2)])
        params = distributed.futures_of([weight, bias])
        for chunk_mib in chunk_mibs:
            chunk_rows = max(1, chunk_mib * 2 ** 20 // (cols * dtype.itemsize))
            x = random_normal((rows, cols), (chunk_rows, cols), dtype)
            blocks = x.numblocks[0]
            tiny = random_normal((blocks * FLOOR_ROWS, cols), (FLOOR_ROWS, cols), dtype)
            futures = []
            try:
                x, tiny = persist_spread(client, x), persist_spread(client, tiny)
                futures = distributed.futures_of([x, tiny])
                _wait(futures)
                for op in ops:
                    try:
                        chain = results.result["chain"]
                        seconds = _dask_seconds(client, op, x, weight, bias, reps, chain)
                        floor = _dask_seconds(client, op, tiny, weight, bias, reps, chain)
                    except Exception as error:  # noqa: BLE001
                        results.failed(error, gpus=gpus, op=op, chunk_mib=chunk_mib, stage="dask")
                        continue
                    results.add("points", {"op": op, "gpus": gpus, "chunk_mib": chunk_mib, "blocks": blocks,
                                           "seconds": seconds, "gbs": num_bytes / seconds / 1e9,
                                           "floor_seconds": floor},
                                f"{op} on {gpus} GPU(s), {blocks} chunks of {chunk_mib} MiB: "
                                f"{seconds * 1e3:.1f} ms, {num_bytes / seconds / 1e9:.0f} GB/s; "
                                f"the same graph over blocks of {FLOOR_ROWS} rows: {floor * 1e3:.1f} ms")
            except Exception as error:  # noqa: BLE001 - x not made: the next chunk size
                results.failed(error, gpus=gpus, chunk_mib=chunk_mib, stage="x")
            x = tiny = None
            _release(client, futures)
            client.run(_free_pools)
        _release(client, params, wait=False)


def format_table(result: dict) -> str:
    plain = {(p["op"], p["gpus"]): p["gbs"] for p in result["plain"]}
    one_gpu = {(p["op"], p["chunk_mib"]): p["gbs"] for p in result["points"] if p["gpus"] == 1}
    nan = float("nan")
    chain = result.get("chain", 1)
    ops = f"{chain} chained ops" if chain > 1 else "one op"
    lines = [f"{result['dtype']} {result['rows']} x {result['cols']}, {result['bytes'] / 1e9:.1f} GB moved "
             f"(x read + y written, {ops} a run); clusters: {result['clusters']}",
             f"{'op':<11} {'gpus':>4} {'chunk MiB':>9} {'blocks':>6} {'ms':>9} {'floor ms':>9} {'GB/s':>8} "
             f"{'GB/s/GPU':>9} {'x 1 GPU':>8} {'x plain':>8}"]
    for p in result["points"]:
        per_gpu = p["gbs"] / p["gpus"]
        scaling = p["gbs"] / one_gpu.get((p["op"], p["chunk_mib"]), nan)
        lines.append(f"{p['op']:<11} {p['gpus']:>4} {p['chunk_mib']:>9} {p['blocks']:>6} {p['seconds'] * 1e3:>9.1f} "
                     f"{p.get('floor_seconds', nan) * 1e3:>9.1f} {p['gbs']:>8.0f} {per_gpu:>9.0f} {scaling:>8.2f} "
                     f"{per_gpu / plain.get((p['op'], p['gpus']), nan):>8.2f}")
    for p in result["plain"]:
        lines.append(f"plain {p['op']} on one GPU, {p['rows']} rows: {p['seconds'] * 1e3:.1f} ms, {p['gbs']:.0f} GB/s")
    for e in result.get("errors", []):
        where = ", ".join(f"{key} {value}" for key, value in e.items() if key != "error")
        lines.append(f"FAILED ({where}): {e['error']}")
    return "\n".join(lines)


@bench.command(name="dask")
@click.option("--op", "ops", default=",".join(OPS), show_default=True, help=f"Comma-separated, of {', '.join(OPS)}.")
@click.option("--gib", default=16.0, show_default=True, help="Size of the input array, all GPUs together.")
@click.option("--cols", default=8192, show_default=True, help="Row length (the reduced axis).")
@click.option("--chunk-mib", default="256,1024", show_default=True, help="Comma-separated chunk sizes (MiB).")
@click.option("--gpus", default="1,2", show_default=True, help="Comma-separated numbers of workers, one GPU each.")
@click.option("--reps", default=7, show_default=True, help="Timed runs of each point (after one more, untimed).")
@click.option("--chain", default=1, show_default=True, type=click.IntRange(min=1),
              help="Ops a timed run chains, each over the last one's output (the persist and the GPU "
                   "synchronisation paid once for all).")
@dtype_option
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results as JSON.")
def dask_command(ops, gib, cols, chunk_mib, gpus, reps, chain, dtype, json_path):
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

    def report(result: dict, line: str) -> None:
        click.echo(line, err=True)
        if json_path:
            _write_json(result, json_path)

    result = measure(names, gib, cols, int_list(chunk_mib), counts, dtypes.parse_dtype(dtype), reps, report, chain)
    click.echo(format_table(result))
    if json_path:
        _write_json(result, json_path)
    if result["errors"]:
        raise SystemExit(1)


def _write_json(result: dict, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
