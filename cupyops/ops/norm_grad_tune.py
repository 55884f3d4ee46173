"""Measured tuning of LayerNorm / RMSNorm backward on the live GPU (`cupyops
tune layer_norm_backward` / `rms_norm_backward`): every candidate of a shape
(norm_grad_candidates) run once on NaN-filled outputs and checked against a
float64 reference (dx on its first rows, dweight / dbias over all rows: a
fast wrong kernel cannot win), then timed with the L2 flushed; the fastest
is kept in the tuning table (cupyops.tune) under the shape's key. The calls
carry a weight, as a training step makes them, and want dweight (and dbias
for LayerNorm) unless param_grad is off.

The arrays are contiguous and fresh, so the key's alignment is what their
row length allows and their rows share one phase."""
from __future__ import annotations

from typing import Optional

from .. import arrays, dtypes, rowwise, tune
from ..launch import Target
from . import norm_args
from .norm import launch_backward
from .norm_grad_candidates import Candidate, candidates, shape_key
from .norm_launch import run_backward
from .norm_tune import CHECKED_ROWS, EPS, check_close, sample_inputs
from .row_candidates import TIMER_BUDGET_S, Tuned, recording_errors

# rows the float64 statistics and sums are taken over at once
CHUNK_ROWS = 4096


def sample_grad_inputs(op: str, dtype: str, rows: int, cols: int) -> dict:
    """x and weight as the forward's tuner samples them (norm_tune), dy ~
    N(0, 1) in the storage type, and x's mean (LayerNorm) and rstd in the
    compute type, taken in float64."""
    import cupy

    family = op.removesuffix("_backward")
    inputs = sample_inputs(family, dtype, rows, cols, False)
    x = inputs["x"]
    generator = cupy.random.default_rng(1)
    dy = generator.standard_normal((rows, cols), dtype=cupy.float32).astype(x.dtype)
    means, rstds = [], []
    for first in range(0, rows, CHUNK_ROWS):
        chunk = x[first:first + CHUNK_ROWS].astype(cupy.float64)
        mean = chunk.mean(axis=1) if family == "layer_norm" else cupy.zeros(len(chunk))
        rstds.append(1 / cupy.sqrt(((chunk - mean[:, None]) ** 2).mean(axis=1) + EPS))
        means.append(mean)
    stats = norm_args.stats_dtype(x.dtype)
    return {"dy": dy, "x": x, "weight": inputs["weight"], "rstd": cupy.concatenate(rstds).astype(stats),
            "mean": cupy.concatenate(means).astype(stats) if family == "layer_norm" else None}


def grad_reference(op: str, dy, x, mean, rstd, weight, param_grad: bool) -> dict:
    """In float64, from the statistics given (mean None for RMSNorm): dx of
    the first CHECKED_ROWS rows and, with param_grad, dweight (and dbias for
    LayerNorm) over all rows."""
    import cupy

    centered = mean is not None
    rstd = rstd.astype(cupy.float64)
    mean = mean.astype(cupy.float64) if centered else cupy.zeros_like(rstd)
    dweight = cupy.zeros(x.shape[1])
    dbias = cupy.zeros(x.shape[1])
    for first in range(0, x.shape[0], CHUNK_ROWS):
        rows = slice(first, first + CHUNK_ROWS)
        xhat = (x[rows].astype(cupy.float64) - mean[rows, None]) * rstd[rows, None]
        dweight += (dy[rows].astype(cupy.float64) * xhat).sum(axis=0)
        dbias += dy[rows].astype(cupy.float64).sum(axis=0)
    head = slice(0, CHECKED_ROWS)
    xhat = (x[head].astype(cupy.float64) - mean[head, None]) * rstd[head, None]
    g = dy[head].astype(cupy.float64) * weight.astype(cupy.float64)
    mean_g = g.mean(axis=1, keepdims=True) if centered else 0
    expected = {"dx": rstd[head, None] * (g - mean_g - xhat * (g * xhat).mean(axis=1, keepdims=True))}
    if param_grad:
        expected["dweight"] = dweight
        if centered:
            expected["dbias"] = dbias
    return expected


def moved_bytes(dtype: str, rows: int, cols: int) -> int:
    """Bytes a call moves: dy and x read, dx written (the weight, the
    statistics and dweight / dbias not counted)."""
    return 3 * rows * cols * dtypes.BY_SHORT[dtype].itemsize


def tune_shape(op: str, dtype: str, rows: int, cols: int, device_id: int, param_grad: bool = True,
               table: Optional[tune.TuningTable] = None) -> Tuned:
    """Times every candidate backward plan of `rows` x `cols` of dtype (short
    name) on GPU `device_id` (param_grad: dweight / dbias wanted) and keeps
    the winner in `table` (default: tune.default_table())."""
    import cupy

    from ..bench import Timer

    target = Target.live(device_id)
    align = arrays.alignment(cols * dtypes.BY_SHORT[dtype].itemsize)
    key = shape_key(dtype, rows, cols, align, True, weight=True, param_grad=param_grad)
    errors = {}
    with cupy.cuda.Device(device_id):
        inputs = sample_grad_inputs(op, dtype, rows, cols)
        dy, x, weight, mean, rstd = (inputs[name] for name in ("dy", "x", "weight", "mean", "rstd"))
        expected = grad_reference(op, dy, x, mean, rstd, weight, param_grad)
        outputs = {name: cupy.empty(x.shape if name == "dx" else weight.shape, x.dtype) for name in expected}
        dweight, dbias = outputs.get("dweight"), outputs.get("dbias")
        dy_op, x_op, dx_op = (rowwise.Operand(array, cols) for array in (dy, x, outputs["dx"]))
        timer = Timer(budget_s=TIMER_BUDGET_S)

        def time_us(description: dict) -> float:
            chosen = Candidate.from_description(description, rows, target).plan(rows, cols, param_grad, target)
            for output in outputs.values():
                output.fill(float("nan"))
            ready = launch_backward(chosen, device_id, rows, cols, dy_op, x_op, dx_op, rstd, mean=mean,
                                    weight=weight, dweight=dweight, dbias=dbias)
            for name, expect in expected.items():
                check_close(name, outputs[name][:CHECKED_ROWS] if name == "dx" else outputs[name], expect, dtype)
            return timer.time(lambda: run_backward(ready, dy, x, outputs["dx"], rstd, mean, weight, dweight,
                                                   dbias)).median_us

        found = [c.describe() for c in candidates(op, dtype, rows, cols, target, align, True, weight=True,
                                                  param_grad=param_grad)]
        result = tune.tune(table or tune.default_table(), tune.DeviceKey.live(device_id), op, key, found,
                           recording_errors(errors, time_us))
    return Tuned(result, errors, key)
