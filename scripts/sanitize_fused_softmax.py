"""Runs every path of the fused attention softmax once on small shapes, for
compute-sanitizer (memcheck, racecheck): the warp, register, shared-memory and
uncached paths (rows of 1 to 2^17 columns, aligned and peeled), bias, mask,
causal (rows whose passes stop at their last kept column, rows with none kept;
both stages), dropout, the log-sum-exp, the backward, both policies, rows in
order and interleaved (forced: at these sizes the L2 would keep them in order),
another axis, out= and dropout_mask; then one asynchronous candidate of each
variant the tuner offers for both stages (the shipped tables, not the rules,
take that path), with and without the causal rule. Prints the plans taken and
"all paths ran" at the end.

Usage: sanitize_fused_softmax.py [all|paths|async]: the planner's paths, the
asynchronous candidates, or both (the default)."""
from __future__ import annotations

import sys

import cupy

import cupyops
from cupyops.launch import LaunchCache, Target
from cupyops.ops import fused_softmax as fs

COLS = (1, 7, 128, 255, 1000, 1024, 4096, 12345, 16384, 40000, 2 ** 17)


def force_interleaved_rows():
    """From now on a bias broadcast along x's outermost dim interleaves its entries' rows
    whatever the L2, with every launch planned afresh."""
    fs.interleave_rule = lambda rows, cols, dtype, fusion, target: fusion.entries > 1
    fs._launches = LaunchCache()


def main(part: str):
    if part not in ("all", "paths", "async"):
        raise SystemExit(f"usage: sanitize_fused_softmax.py [all|paths|async], not {part!r}")
    target = Target.live(cupy.cuda.runtime.getDevice())
    seen = set()
    if part in ("all", "paths"):
        run_paths(target, seen, interleaved=False)
        force_interleaved_rows()
        run_paths(target, seen, interleaved=True)
    if part in ("all", "async"):
        run_async_candidates(target, seen)
    cupyops.fused_softmax(x_view(), axis=1, dropout=0.2, seed=1)     # another axis, a view
    cupyops.dropout_mask((1000, 33), 0.3, seed=5, offset=7)
    cupy.cuda.Device().synchronize()
    print("\n".join(sorted(seen)))
    print("all paths ran")


def x_view():
    return cupy.ones((2, 12, 40), cupy.float16)[:, :, 1:]


def run_paths(target, seen: set, interleaved: bool):
    rng = cupy.random.default_rng(0)
    for cols in COLS:
        rows = 4 if cols > 16384 else 24
        for dtype in (cupy.float16, cupy.float32):
            x = rng.standard_normal((2, rows // 2, cols), dtype=cupy.float32).astype(dtype)
            bias = rng.standard_normal((rows // 2, cols), dtype=cupy.float32).astype(dtype)
            mask = rng.random((2, 1, cols)) < 0.8
            for policy in ("auto", "oneflow"):
                # float16: packs of 8 starting Philox groups (grouped_variant); float32: packs straddling them
                args = dict(scale=0.5, bias=bias, mask=mask, causal=True, diagonal=cols - rows // 2, dropout=0.1,
                            seed=3, offset=0 if dtype == cupy.float16 else 5, policy=policy)
                y, lse = cupyops.fused_softmax(x, return_lse=True, **args)
                cupyops.fused_softmax_backward(cupy.ones_like(y), x, lse, **args)
                written = cupy.empty_like(x)      # out= written in place by the stage itself
                cupyops.fused_softmax(x, out=written, **args)
                cupyops.fused_softmax_backward(cupy.ones_like(y), x, lse, out=written, **args)
                cupyops.fused_softmax(x, policy=policy)
                for diagonal in (0, -(cols // 2) - 1):   # rows stopping their passes early (RowEnd), none kept
                    for dropout in (0.0, 0.1):
                        causal = dict(scale=0.5, causal=True, diagonal=diagonal, dropout=dropout, seed=3,
                                      policy=policy)
                        y, lse = cupyops.fused_softmax(x, return_lse=True, **causal)
                        cupyops.fused_softmax_backward(cupy.ones_like(y), x, lse, **causal)
                call = {key: value for key, value in args.items() if key not in ("seed", "offset", "policy")}
                fusion = fs.prepare(x, axis=-1, **call).fusion
                for stage in ("forward", "backward"):
                    chosen = fs.plan(stage, x.size // cols, cols, "f16" if dtype == cupy.float16 else "f32", policy,
                                     target, fusion)
                    grouped = fs.grouped_variant(chosen.spec, target)
                    seen.add(grouped.name if grouped is not None and args["offset"] % 8 == 0 else chosen.spec.name)


def run_async_candidates(target, seen: set):
    """One block_async candidate of each variant the tuner offers for both stages (stages of
    the pipeline, online or not, its grid, rows in order or interleaved; any block size)
    on the bias, mask and dropout of run_paths, with and without the causal rule."""
    from cupyops.ops import fused_softmax_tune as tuner

    rng = cupy.random.default_rng(1)
    for cols, dtype, short in ((2048, cupy.float32, "f32"), (16384, cupy.float16, "f16")):
        rows = 4 if cols > 8192 else 24
        x = rng.standard_normal((2, rows // 2, cols), dtype=cupy.float32).astype(dtype)
        bias = rng.standard_normal((rows // 2, cols), dtype=cupy.float32).astype(dtype)
        mask = rng.random((2, 1, cols)) < 0.8
        for causal, diagonal in ((False, 0), (True, 0), (True, -1)):   # causal: rows ending early, one with none kept
            call = dict(bias=bias, mask=mask, scale=0.5, causal=causal, diagonal=diagonal, dropout=0.1)
            operands = fs.prepare(x, axis=-1, **call)
            _, lse = cupyops.fused_softmax(x, return_lse=True, seed=3, **call)
            for stage, dy in (("forward", None), ("backward", cupy.ones_like(x))):
                variants = set()
                for description, launch in tuner.candidates(stage, short, operands.rows, cols, target,
                                                            operands.fusion):
                    path = launch.spec.path
                    if path.impl != "block_async":
                        continue
                    variant = (path.stages, path.online, description["grid"], launch.spec.interleaved)
                    if variant in variants:
                        continue
                    variants.add(variant)
                    out = cupy.empty_like(x)
                    main = fs.stage_launch(stage, operands, "auto", out, dy=dy, chosen=launch)
                    for offset in (0, 5):     # whole groups of eight, and packs straddling them
                        main.run(tuple(a.data.ptr for a in (*fs.stage_inputs(x, dy, operands), out, lse)), 3, offset)
                    seen.add(launch.spec.name)

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
