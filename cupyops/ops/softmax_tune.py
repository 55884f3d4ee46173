"""Measured tuning of the softmax family's row kernels on the live GPU
(`cupyops tune softmax`): every candidate of a shape (softmax_candidates) run
once on a NaN-filled output and checked against a float64 reference on its
first rows (a fast wrong kernel cannot win), then timed with the L2 flushed;
the fastest is kept in the tuning table (cupyops.tune) under the shape's key.

The arrays are contiguous and fresh, so the key's alignment is what their
row length allows and their rows share one phase."""
from __future__ import annotations

from typing import Optional

import numpy

from .. import arrays, dtypes, tune
from ..callcache import ReadyLaunch
from ..launch import Target, live_function
from .row_candidates import TIMER_BUDGET_S, Tuned
from .softmax_candidates import Candidate, candidates, shape_key
from .softmax_rows import INPUTS
from .softmax_split import plan as split_plan

CHECKED_ROWS = 64
# The largest error a candidate may show against the float64 reference, over
# max(1, the reference's largest magnitude): a few roundings of the type.
TOLERANCE = {"f16": 4e-3, "bf16": 3e-2, "f32": 1e-5, "f64": 1e-9}


def reference(op: str, inputs: list):
    """The op in float64 on CuPy arrays (backward: inputs are dy, y)."""
    import cupy

    values = [a.astype(cupy.float64) for a in inputs]
    if op == "softmax_backward":
        dy, y = values
        return (dy - (dy * y).sum(axis=-1, keepdims=True)) * y
    if op == "log_softmax_backward":
        dy, y = values
        return dy - cupy.exp(y) * dy.sum(axis=-1, keepdims=True)
    shifted = values[0] - values[0].max(axis=-1, keepdims=True)
    if op == "softmax":
        e = cupy.exp(shifted)
        return e / e.sum(axis=-1, keepdims=True)
    return shifted - cupy.log(cupy.exp(shifted).sum(axis=-1, keepdims=True))


def sample_inputs(op: str, dtype: str, rows: int, cols: int) -> list:
    """The op's inputs: x ~ 3 N(0, 1); backward: dy ~ 3 N(0, 1) and y the
    forward's output of such an x (so exp(y) stays in range)."""
    import cupy

    storage = dtypes.DTYPE_OF_SHORT[dtype]
    generator = cupy.random.default_rng(0)
    found = [(generator.standard_normal((rows, cols), dtype=cupy.float32) * 3).astype(storage)
             for _ in INPUTS[op]]
    if op.endswith("_backward"):
        found[1] = reference(op[: -len("_backward")], [found[1]]).astype(storage)
    return found


def moved_bytes(op: str, dtype: str, rows: int, cols: int) -> int:
    """Bytes a call moves: each input read and the output written once."""
    return (len(INPUTS[op]) + 1) * rows * cols * dtypes.BY_SHORT[dtype].itemsize


def tune_shape(op: str, dtype: str, rows: int, cols: int, device_id: int,
               table: Optional[tune.TuningTable] = None) -> Optional[Tuned]:
    """Times every candidate of `rows` x `cols` of dtype (short name) on GPU
    `device_id` and keeps the winner in `table` (default: tune.default_table());
    None where auto splits such rows across blocks (softmax_split: no row plan)."""
    import cupy

    from ..bench import Timer

    target = Target.live(device_id)
    align = arrays.alignment(cols * dtypes.BY_SHORT[dtype].itemsize)
    if split_plan(op, rows, cols, dtype, target, align, True) is not None:
        return None
    key = shape_key(dtype, rows, cols, align, True)
    errors = {}
    with cupy.cuda.Device(device_id):
        inputs = sample_inputs(op, dtype, rows, cols)
        expect = reference(op, [a[:CHECKED_ROWS] for a in inputs])
        allowed = TOLERANCE[dtype] * max(1.0, float(cupy.abs(expect).max()))
        out = cupy.empty_like(inputs[0])
        args = (*inputs, out, numpy.int64(rows), numpy.int64(cols), *[numpy.int64(cols)] * (len(inputs) + 1))
        timer = Timer(budget_s=TIMER_BUDGET_S)

        def time_us(description: dict) -> float:
            try:
                launch = Candidate.from_description(description, rows, target).launch
                ready = ReadyLaunch(live_function(launch.spec, device_id, launch.smem_bytes), launch.grid,
                                    launch.block, launch.smem_bytes)
                out.fill(float("nan"))
                ready(args)
                error = float(cupy.abs(out[:CHECKED_ROWS].astype(cupy.float64) - expect).max())
                if not error <= allowed:   # NaN too: rows left unwritten
                    raise ValueError(f"error {error:.1e} against the float64 reference (allowed {allowed:.1e})")
                return timer.time(lambda: ready(args)).median_us
            except Exception as error:
                errors[description["label"]] = f"{type(error).__name__}: {error}"
                raise

        found = [c.describe() for c in candidates(op, dtype, rows, cols, target, align, True)]
        result = tune.tune(table or tune.default_table(), tune.DeviceKey.live(device_id), op, key, found, time_us)
    return Tuned(result, errors, key)
