"""The fused attention softmax's candidate plans and their measured tuning on the live GPU
(`cupyops tune fused_softmax`), as softmax's (softmax_candidates, softmax_tune).

A stage's candidates: the policies' plans by the rules (fused_softmax.rule_plan), then every
row plan of softmax's generator that reads through the LOAD (warp, register blocks holding the
compute type, shared memory, re-reading the row), each read through the fused kernel
(fused_softmax.fused_launch), and where a bias lets the rows of several entries run in turn
(Fusion.entries), each also taking them so. A register block whose fused kernel holds fewer
blocks an SM than its softmax path's kernel is also timed under a __launch_bounds__ of more
blocks, the most that costs no local memory (bounded). Each is run once on a NaN-filled
output and checked against the oneflow policy's result on its first rows (its own plan, the
same dropout mask), then timed
with the L2 flushed; the fastest is kept in the tuning table (cupyops.tune) under the op
fused_softmax.TUNED_OPS[stage] and fused_softmax.tuning_key, which fused_softmax.plan reads under
policy="auto"."""
from __future__ import annotations

import math
from typing import Optional

from .. import dtypes, tune
from ..launch import Target
from . import fused_softmax as fs
from .row_candidates import TIMER_BUDGET_S, Tuned, recording_errors
from .softmax_candidates import candidates as row_plans

# softmax's paths that read a row through a LOAD functor (the fused kernels' inputs); the
# asynchronous one caches the inputs' packs as they are and fuses as it reads them back
FUSED_IMPLS = ("warp", "block_regs", "block_smem", "block_uncached", "block_async")
CHECKED_ROWS = 64
# the largest difference from the oneflow policy's result a candidate may show
TOLERANCE = {"f16": 4e-3, "bf16": 3e-2, "f32": 1e-5, "f64": 1e-9}


def candidates(stage: str, dtype: str, rows: int, cols: int, target: Target, fusion: fs.Fusion,
               align: int = 16, same_phase: bool = True) -> list:
    """(description, KernelLaunch) of each plan worth timing, each launch once, the policies' first."""
    found = [({"label": policy}, fs.rule_plan(stage, rows, cols, dtype, policy, target, fusion, align, same_phase))
             for policy in ("auto", "oneflow")]
    for candidate in row_plans(fs.SOFTMAX_OP[stage], dtype, rows, cols, target, align, same_phase):
        spec = candidate.launch.spec
        if candidate.label in ("auto", "oneflow") or spec.impl not in FUSED_IMPLS or \
                (spec.impl == "block_regs" and spec.storage_cache) or \
                (spec.impl == "block_async" and spec.cluster_size > 1):
            continue
        orders = [candidate.describe()]
        if fusion.entries > 1:
            orders.append({**orders[0], "label": f"{orders[0]['label']} interleaved", "interleaved": True})
        for description in orders:
            launch = fs.fused_launch(stage, dtype, rows, cols, target, fusion, description)
            found.append((description, launch))
            found += bounded(stage, dtype, rows, cols, target, fusion, description, launch)
    unique = {}
    for description, launch in found:
        unique.setdefault(launch, (description, launch))
    return list(unique.values())


def bounded(stage, dtype, rows, cols, target: Target, fusion: fs.Fusion, description: dict, launch) -> list:
    """[(description, launch)] of a register block under a __launch_bounds__ of more blocks an SM,
    where its fused kernel (the LOAD and STORE hold more live values than softmax's) holds fewer
    than its softmax path's kernel: the most blocks, of that many, halfway and one more, that
    cost no local memory; [] where there is none."""
    spec = launch.spec
    if spec.path.impl != "block_regs" or spec.path.min_blocks:
        return []
    threads = spec.threads_per_block
    fused_blocks = target.max_active_blocks(spec, threads, launch.smem_bytes, True)
    path_blocks = target.max_active_blocks(spec.path, threads, launch.smem_bytes, True)
    if path_blocks <= max(fused_blocks, 1):
        return []
    for blocks in sorted({path_blocks, (path_blocks + fused_blocks + 1) // 2, fused_blocks + 1}, reverse=True):
        bound = {**description, "label": f"{description['label']} mb{blocks}",
                 "spec": {**description["spec"], "min_blocks": blocks}}
        chosen = fs.fused_launch(stage, dtype, rows, cols, target, fusion, bound)
        if not fs.spills(chosen.spec, target):
            return [(bound, chosen)]
    return []


def sample_operands(shape: tuple, dtype: str, mask_shape: Optional[tuple], bias_shape: Optional[tuple],
                    bias_dtype: Optional[str] = None):
    """Scores x ~ 3 N(0, 1) and dy ~ N(0, 1) in dtype, a bool mask keeping 90 % and a bias
    ~ N(0, 1) in bias_dtype (default dtype), each where its shape is given."""
    import cupy

    generator = cupy.random.default_rng(0)

    def normal(dims, short, scale=1.0):
        return (generator.standard_normal(dims, dtype=cupy.float32) * scale).astype(dtypes.DTYPE_OF_SHORT[short])

    mask = None if mask_shape is None else generator.random(mask_shape) < 0.9
    bias = None if bias_shape is None else normal(bias_shape, bias_dtype or dtype)
    return normal(shape, dtype, 3.0), normal(shape, dtype), mask, bias


def moved_bytes(stage: str, shape: tuple, dtype: str, mask_shape=None, bias_shape=None, bias_dtype=None) -> int:
    """Bytes a stage moves: x (and dy) read, the result written, mask and bias once each."""
    scores = (2 if stage == "forward" else 3) * math.prod(shape) * dtypes.BY_SHORT[dtype].itemsize
    mask = 0 if mask_shape is None else math.prod(mask_shape)
    bias = 0 if bias_shape is None else math.prod(bias_shape) * dtypes.BY_SHORT[bias_dtype or dtype].itemsize
    return scores + mask + bias


def tune_shape(stage: str, shape: tuple, dtype: str, device_id: int, *, mask_shape=None, bias_shape=None,
               bias_dtype=None, causal: bool = False, diagonal: int = 0, dropout: float = 0.0,
               table: Optional[tune.TuningTable] = None) -> Tuned:
    """Times every candidate of `stage` on scores of `shape` (the reduced axis last; dtype and
    bias_dtype short names) on GPU `device_id`, keeping the winner in `table` (default:
    tune.default_table())."""
    import cupy

    from ..bench import Timer

    target = Target.live(device_id)
    errors: dict = {}
    with cupy.cuda.Device(device_id):
        x, dy, mask, bias = sample_operands(shape, dtype, mask_shape, bias_shape, bias_dtype)
        options = dict(scale=0.125, bias=bias, mask=mask, causal=causal, diagonal=diagonal, dropout=dropout)
        operands = fs.prepare(x, axis=-1, **options)
        fusion, rows, cols = operands.fusion, operands.rows, operands.cols
        x = operands.x
        y, lse = fs.fused_softmax(x, return_lse=True, policy="oneflow", seed=7, **options)
        expect = y if stage == "forward" else fs.fused_softmax_backward(dy, x, lse, policy="oneflow", seed=7,
                                                                         **options)
        expect = expect.reshape(rows, cols)[:CHECKED_ROWS].astype(cupy.float64)
        allowed = TOLERANCE[dtype] * max(1.0, float(cupy.abs(expect).max()))
        out = cupy.empty_like(x)
        # the backward reads lse; the forward writes it, as a training forward does
        pointers = tuple(a.data.ptr for a in (*fs.stage_inputs(x, None if stage == "forward" else dy, operands), out, lse))
        timer = Timer(budget_s=TIMER_BUDGET_S)

        def time_us(description: dict) -> float:
            launch = launches[description["label"]]
            main = fs.stage_launch(stage, operands, "auto", out, dy, chosen=launch)
            out.fill(float("nan"))
            main.run(pointers, 7, 0)
            error = float(cupy.abs(out.reshape(rows, cols)[:CHECKED_ROWS].astype(cupy.float64) - expect).max())
            if not error <= allowed:   # NaN too: rows left unwritten
                raise ValueError(f"error {error:.1e} against the oneflow policy (allowed {allowed:.1e})")
            return timer.time(lambda: main.run(pointers, 7, 0)).median_us

        found = candidates(stage, dtype, rows, cols, target, fusion)
        launches = {description["label"]: launch for description, launch in found}
        key = fs.tuning_key(dtype, rows, cols, fusion)
        result = tune.tune(table or tune.default_table(), tune.DeviceKey.live(device_id), fs.TUNED_OPS[stage], key,
                           [d for d, _ in found], recording_errors(errors, time_us))
    return Tuned(result, errors, key)
