"""Times every candidate plan of the fused attention softmax (cupyops.ops.fused_softmax_tune) at
the issue's score shapes and prints each, with its share of the copy ceiling, without keeping
winners (a scratch tuning table); `cupyops tune fused_softmax` keeps them.

Scores (B, 16, S, S) with B chosen so that x holds about 256 MiB. Bytes counted: forward x read
and y written; backward dy and x read, dx written (the row's log-sum-exp left out); mask and
bias once each at their own size. Variants: scale, causal, dropout 0.1, a padding mask
(B, 1, 1, S) and a position bias (16, S, S).
Usage (in scripts/): python tune_fused_softmax.py [--seq 128,1024,4096] [--variants scale,causal,dropout,mask,bias]
[--stages forward,backward] [--dtypes float16]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import cupy

from cupyops import dtypes, tune
from cupyops.ops import fused_softmax_tune as ft
from tuning import Tuning

HEADS = 16


def variant_options(variant: str, batch: int, seq: int) -> dict:
    """tune_shape's keyword arguments of a variant."""
    return {"scale": {}, "causal": {"causal": True}, "dropout": {"dropout": 0.1},
            "mask": {"mask_shape": (batch, 1, 1, seq)}, "bias": {"bias_shape": (HEADS, seq, seq)}}[variant]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", default="128,1024,4096")
    parser.add_argument("--variants", default="scale,causal,dropout")
    parser.add_argument("--stages", default="forward,backward")
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    tuning = Tuning(budget_s=0.15)
    with tempfile.TemporaryDirectory() as scratch:
        table = tune.TuningTable(Path(scratch) / "tuning.json")
        for dtype_name in args.dtypes.split(","):
            short = dtypes.NAMES[dtypes.parse_dtype(dtype_name)]
            for seq in map(int, args.seq.split(",")):
                batch = max(1, (args.mib << 20) // (HEADS * seq * seq * dtypes.BY_SHORT[short].itemsize))
                shape = (batch, HEADS, seq, seq)
                for variant in args.variants.split(","):
                    options = variant_options(variant, batch, seq)
                    for stage in args.stages.split(","):
                        tuned = ft.tune_shape(stage, shape, short, tuning.device_id, table=table, **options)
                        num_bytes = ft.moved_bytes(stage, shape, short, options.get("mask_shape"),
                                                   options.get("bias_shape"))
                        for description, us in tuned.result.timings:
                            label = description["label"]
                            mark = "*" if description is tuned.result.best else " "
                            where = f"{stage:<8} {variant:<7} {short:<4} S={seq:<5} {mark} {label:<20}"
                            if us is None:
                                print(f"{where} failed: {tuned.errors.get(label, '')}"[:200], flush=True)
                                continue
                            gbs = num_bytes / us / 1e3
                            print(f"{where} {us:>9.1f} us {gbs:>6.0f} GB/s {gbs / tuning.copy_gbs:>6.1%}", flush=True)
                cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
