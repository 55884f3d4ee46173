"""Times the softmax paths the fused attention softmax can run through, against each other,
at the issue's score shapes, to choose the fused planner's rules.

Scores (B, H, S, S) with B * H chosen so that x holds about 256 MiB. Bytes counted: forward
x read and y written; backward dy and x read, dx written (the row's log-sum-exp left out); mask
and bias once each at their own size.
Candidates: the auto and oneflow plans, then every path of softmax's candidate generator that reads
through the LOAD (warp, registers in the compute type, shared memory in the compute type,
uncached), each run through the public function with its plan put in place of the
planner's, and checked against the auto plan's output before it is timed.
Usage (in scripts/): python tune_fused_softmax.py [--seq 128,1024,4096] [--variants scale,causal,dropout,mask,bias]
[--stages forward,backward] [--dtypes float16]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import cupy

import cupyops
from cupyops import dtypes
from cupyops.launch import LaunchCache
from cupyops.ops import fused_softmax as fs
from cupyops.ops.softmax_candidates import candidates
from tuning import Tuning

VARIANTS = {"scale": {}, "causal": {"causal": True}, "dropout": {"dropout": 0.1, "seed": 7},
            "mask": {"mask": "padding"}, "bias": {"bias": "position"}}


def operands(variant, shape, dtype, generator) -> dict:
    """The variant's keyword arguments: a padding mask (B, 1, 1, S) or a position bias (H, S, S) made here."""
    options = dict(VARIANTS[variant])
    batch, heads, seq, _ = shape
    if "mask" in options:
        options["mask"] = generator.random((batch, 1, 1, seq)) < 0.9
    if "bias" in options:
        options["bias"] = generator.standard_normal((heads, seq, seq), dtype=cupy.float32).astype(dtype)
    return options
FUSED_IMPLS = ("warp", "block_regs", "block_smem", "block_uncached")


def fused_candidates(stage, short, rows, cols, target, fusion, dropout):
    """(label, KernelLaunch) of each path the fused stage can take, the planner's first."""
    op = fs.SOFTMAX_OP[stage]
    found = [(policy, fs.plan(stage, rows, cols, short, policy, target, fusion)) for policy in ("auto", "oneflow")]
    for candidate in candidates(op, short, rows, cols, target):
        label, spec = candidate.label, candidate.launch.spec
        if label in ("auto", "oneflow") or spec.impl not in FUSED_IMPLS or \
                (spec.impl == "block_regs" and spec.storage_cache):
            continue
        chosen = fs._with_compute_cache(candidate.launch, op, short, rows, cols, target)
        found.append((label, replace(chosen, spec=fs.FusedSoftmaxSpec(
            stage, short, chosen.spec, dropout=dropout, bias_dtype=fusion.bias_dtype, mask=fusion.mask,
            causal=fusion.causal))))
    unique = {}
    for label, launch in found:
        unique.setdefault((launch.spec.name, launch.grid), (label, launch))
    return list(unique.values())


def time_shape(tuning, short, dtype, seq, variants, stages, mib):
    """Prints every candidate's time at scores (B, 16, seq, seq) of about `mib` MiB."""
    heads = 16
    batch = max(1, (mib << 20) // (heads * seq * seq * dtype.itemsize))
    shape = (batch, heads, seq, seq)
    generator = cupy.random.default_rng(0)
    x = (generator.standard_normal(shape, dtype=cupy.float32) * 3).astype(dtype)
    dy = generator.standard_normal(shape, dtype=cupy.float32).astype(dtype)
    out = cupy.empty_like(x)
    rows = x.size // seq
    planner = fs.plan
    for variant in variants:
        options = dict(scale=0.125, **operands(variant, shape, dtype, generator))
        dropout = bool(options.get("dropout"))
        extra = sum(options[name].nbytes for name in ("mask", "bias") if name in options)
        fusion = fs.Fusion(short if "bias" in options else "", "mask" in options, bool(options.get("causal")),
                           dropout)
        y, lse = cupyops.fused_softmax(x, return_lse=True, **options)
        for stage in stages:
            if stage == "forward":
                expect = y[:1]
                call = lambda: cupyops.fused_softmax(x, out=out, **options)  # noqa: E731
                num_bytes = 2 * x.nbytes + extra
            else:
                expect = cupyops.fused_softmax_backward(dy, x, lse, **options)[:1]
                call = lambda: cupyops.fused_softmax_backward(dy, x, lse, out=out, **options)  # noqa: E731
                num_bytes = 3 * x.nbytes + extra
            for label, chosen in fused_candidates(stage, short, rows, seq, tuning.target, fusion, dropout):
                fs.plan = lambda stage_, *rest, c=chosen, s=stage: c if stage_ == s else planner(stage_, *rest)
                fs._launches = LaunchCache()
                try:
                    median_us, gbs, fraction, error = tuning.measure(
                        call, out, lambda result: float(cupy.abs(result[:1].astype(cupy.float32) -
                                                                 expect.astype(cupy.float32)).max()), num_bytes)
                except Exception as failure:  # noqa: BLE001 - a candidate that cannot run: say why, go on
                    print(f"{stage:<8} {variant:<7} S={seq:<5} {label:<18} failed: {failure}"[:200], flush=True)
                    continue
                finally:
                    fs.plan = planner
                    fs._launches = LaunchCache()
                print(f"{stage:<8} {variant:<7} {short:<4} S={seq:<5} {label:<18} {median_us:>9.1f} us "
                      f"{gbs:>6.0f} GB/s {fraction:>6.1%}  err={error:.1e} {chosen.spec.name}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", default="128,1024,4096")
    parser.add_argument("--variants", default="scale,causal,dropout")
    parser.add_argument("--stages", default="forward,backward")
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    tuning = Tuning(budget_s=0.15)
    for dtype_name in args.dtypes.split(","):
        dtype = dtypes.parse_dtype(dtype_name)
        for seq in map(int, args.seq.split(",")):
            time_shape(tuning, dtypes.float_type(dtype).short, dtype, seq, args.variants.split(","),
                       args.stages.split(","), args.mib)
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
