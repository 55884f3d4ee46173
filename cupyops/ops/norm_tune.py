"""Measured tuning of LayerNorm / RMSNorm forward on the live GPU (`cupyops
tune layer_norm` / `rms_norm`): every candidate of a shape (norm_candidates)
run once on a NaN-filled output and checked against a float64 reference on
its first rows (a fast wrong kernel cannot win), then timed with the L2
flushed; the fastest is kept in the tuning table (cupyops.tune) under the
shape's key. The calls carry a weight (and a bias for LayerNorm), as a
training step makes them, and a residual where asked.

The arrays are contiguous and fresh, so the key's alignment is what their
row length allows and their rows share one phase."""
from __future__ import annotations

from typing import Optional

from .. import arrays, dtypes, rowwise, tune
from ..launch import Target
from .norm import launch_forward
from .norm_candidates import Candidate, candidates, shape_key
from .norm_launch import run_forward
from .norm_spec import NormPlan
from .row_candidates import TIMER_BUDGET_S, Tuned, recording_errors

CHECKED_ROWS = 64
EPS = 1e-5
# The largest error a candidate may show against the float64 reference, over
# the reference's largest magnitude: a few roundings of the type.
TOLERANCE = {"f16": 4e-3, "bf16": 3e-2, "f32": 1e-4, "f64": 1e-9}


def sample_inputs(op: str, dtype: str, rows: int, cols: int, residual: bool) -> dict:
    """x ~ 0.5 + 2 N(0, 1), weight ~ 1 + 0.2 N(0, 1), bias (LayerNorm) ~
    0.2 N(0, 1) and the residual (where asked) ~ N(0, 1), in the storage type."""
    import cupy

    storage = dtypes.DTYPE_OF_SHORT[dtype]
    generator = cupy.random.default_rng(0)

    def normal(shape, loc=0.0, scale=1.0):
        return (loc + scale * generator.standard_normal(shape, dtype=cupy.float32)).astype(storage)

    return {"x": normal((rows, cols), 0.5, 2.0), "weight": normal((cols,), 1.0, 0.2),
            "bias": normal((cols,), 0.0, 0.2) if op == "layer_norm" else None,
            "residual": normal((rows, cols)) if residual else None}


def reference(op: str, x, weight, bias=None, residual=None):
    """y of the op in float64 (h = x + residual normalised where given)."""
    import cupy

    h = x.astype(cupy.float64) + (0 if residual is None else residual.astype(cupy.float64))
    if op == "layer_norm":
        h = h - h.mean(axis=-1, keepdims=True)
    y = h / cupy.sqrt((h * h).mean(axis=-1, keepdims=True) + EPS) * weight.astype(cupy.float64)
    return y if bias is None else y + bias.astype(cupy.float64)


def check_close(name: str, got, expected, dtype: str) -> None:
    """Refuses `got` (an output, or its first rows) unless it is within
    TOLERANCE of the float64 reference `expected`, over its largest
    magnitude; NaN too (elements left unwritten)."""
    import cupy

    error = float(cupy.abs(got.astype(cupy.float64) - expected).max())
    allowed = TOLERANCE[dtype] * float(cupy.abs(expected).max())
    if not error <= allowed:
        raise ValueError(f"{name} error {error:.1e} against the float64 reference (allowed {allowed:.1e})")


def moved_bytes(dtype: str, rows: int, cols: int, residual: bool) -> int:
    """Bytes a call moves: x read and y written (and the residual read, h written)."""
    return (4 if residual else 2) * rows * cols * dtypes.BY_SHORT[dtype].itemsize


def tune_shape(op: str, dtype: str, rows: int, cols: int, device_id: int, residual: bool = False,
               table: Optional[tune.TuningTable] = None) -> Tuned:
    """Times every candidate of `rows` x `cols` of dtype (short name) on GPU
    `device_id` and keeps the winner in `table` (default: tune.default_table())."""
    import cupy

    from ..bench import Timer

    target = Target.live(device_id)
    align = arrays.alignment(cols * dtypes.BY_SHORT[dtype].itemsize)
    flags = dict(weight=True, bias=op == "layer_norm", residual=residual)
    key = shape_key(dtype, rows, cols, align, True, **flags)
    errors = {}
    with cupy.cuda.Device(device_id):
        inputs = sample_inputs(op, dtype, rows, cols, residual)
        x, weight, bias, res = inputs["x"], inputs["weight"], inputs["bias"], inputs["residual"]
        expect = reference(op, x[:CHECKED_ROWS], weight, bias, None if res is None else res[:CHECKED_ROWS])
        y = cupy.empty_like(x)
        h = cupy.empty_like(x) if residual else None
        x_op, y_op = rowwise.Operand(x, cols), rowwise.Operand(y, cols)
        res_op = None if res is None else rowwise.Operand(res, cols)
        timer = Timer(budget_s=TIMER_BUDGET_S)

        def time_us(description: dict) -> float:
            chosen = NormPlan(Candidate.from_description(description, rows, target).launch)
            y.fill(float("nan"))
            ready = launch_forward(chosen, device_id, rows, cols, x_op, y_op, EPS, residual=res_op, h=h,
                                   weight=weight, bias=bias)
            check_close("y", y[:CHECKED_ROWS], expect, dtype)
            return timer.time(lambda: run_forward(ready, x, res, weight, bias, y, h, None, None)).median_us

        found = [c.describe() for c in candidates(op, dtype, rows, cols, target, align, True, **flags)]
        result = tune.tune(table or tune.default_table(), tune.DeviceKey.live(device_id), op, key, found,
                           recording_errors(errors, time_us))
    return Tuned(result, errors, key)
