"""Runs every conv2d_int8 kernel once on small shapes, for compute-sanitizer
(memcheck, racecheck): python scripts/sanitize_conv.py [NAME_PART], the kernels
launched directly narrowed to those whose name holds NAME_PART where given.

Every configuration the generator can produce (both policies' kernels, and on
sm_90 every wgmma configuration and the shape's halo tiles, one of them also taking
a filter row a stage, the persistent warp-specialised ones also on two blocks) on a
shape with tails in GEMM_M, GEMM_N and GEMM_K, and the halo tiles of a 2 x 3 filter
(stages whose rows are not whole runs of 8 slots) and the kernels taking the pixels as rows
of four on a 1x1 filter (their only shape), with and without split-K (the
reduction kernel), then the public function through each policy with every
out_dtype and the whole epilogue (bias, z, per-channel alpha, ReLU), and a
1x7 filter with padding only at the sides. Prints each kernel's name."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import cupy
import numpy

os.environ.setdefault("CUPYOPS_AUTOTUNE", "0")

import cupyops  # noqa: E402
from cupyops.launch import Target  # noqa: E402
from cupyops.ops import conv2d_int8 as conv  # noqa: E402
from cupyops.ops import conv_plan  # noqa: E402
from cupyops.ops.conv_layout import ConvGeometry  # noqa: E402


def operands(rng, g: ConvGeometry) -> tuple:
    """Random int8 NCHW32 input and packed filter of g."""
    return (rng.integers(-128, 128, (g.n, g.c // 32, g.h, g.w, 32), dtype=numpy.int8),
            rng.integers(-128, 128, (g.k, g.c // 32, g.r, g.s, 32), dtype=numpy.int8))


def run_kernels(g: ConvGeometry, specs: list, x, w) -> None:
    """Each spec on g's operands x and w, whole and split along GEMM_K in two; the persistent
    kernels also on two blocks, each then walking many tiles and reusing its stages."""
    resident = conv._resident_blocks
    for spec in specs:
        for blocks in (None, 2) if spec.tma else (None,):
            conv._resident_blocks = resident if blocks is None else lambda spec, device_id: blocks
            for splits in (1, 2):
                steps = conv_plan.split_steps(g, spec)
                per_split = -(-steps // splits)
                chosen = conv_plan.ConvPlan(spec, g, -(-steps // per_split), per_split, "sanitize", "auto")
                y = cupy.empty(g.output_shape, numpy.int8)
                conv.launch(chosen, x, w, y, None, None, None, conv.Epilogue(alpha=1e-4))
                cupy.cuda.Device().synchronize()
                print(f"{spec.name} splits {chosen.splits} blocks {blocks or 'resident'}", flush=True)
    conv._resident_blocks = resident


def main() -> None:
    rng = cupy.random.default_rng(1)
    arch = Target.live(cupy.cuda.runtime.getDevice()).facts.arch
    g = ConvGeometry(2, 96, 9, 7, 160, 3, 3, (1, 1), (1, 1))
    x, w = operands(rng, g)
    part = sys.argv[1] if len(sys.argv) > 1 else ""
    specs = conv_plan.all_specs(arch, (g,))   # with g's halo tiles on sm_90, and one with a filter row a stage
    if arch == conv_plan.WGMMA_ARCH:
        halo = conv_plan.halo_configs(g, Target.live(cupy.cuda.runtime.getDevice()).facts.smem_per_block_optin)
        specs.append(conv_plan.spec_for(replace(halo[0], halo_filter_rows=1), "auto", arch))
    run_kernels(g, [s for s in specs if part in s.name and s.tma != "rows"], x, w)
    if arch == conv_plan.WGMMA_ARCH:   # a 2 x 3 filter: stages of 5 rows of 12 slots, not whole runs of 8 slots
        two_rows = ConvGeometry(1, 32, 5, 10, 32, 2, 3, (1, 1), (0, 1))
        run_kernels(two_rows, [s for s in conv_plan.all_specs(arch, (two_rows,)) if "halo" in s.name and
                               part in s.name], *operands(rng, two_rows))
        one_by_one = ConvGeometry(2, 96, 8, 28, 160, 1, 1, (1, 1), (0, 0))   # pixels as rows of four
        run_kernels(one_by_one, [s for s in specs if s.tma == "rows" and part in s.name], *operands(rng, one_by_one))
    bias = rng.standard_normal(g.k, dtype=numpy.float32)
    alpha = cupy.full(g.k, 1e-4, numpy.float32)
    z = rng.integers(-128, 128, g.output_shape, dtype=numpy.int8)
    for policy in conv.POLICIES:
        for out_dtype in ("int8", "float16", "float32"):
            cupyops.conv2d_int8(x, w, bias, z, padding=1, alpha=alpha, gamma=0.5, relu=True,
                                out_dtype=out_dtype, policy=policy)
        cupyops.conv2d_int8(x, w, padding=1, out_dtype="int32", policy=policy)
        wide = rng.integers(-128, 128, (32, g.c // 32, 1, 7, 32), dtype=numpy.int8)
        cupyops.conv2d_int8(x, wide, padding=(0, 3), policy=policy)
        cupy.cuda.Device().synchronize()
        print(f"public conv2d_int8 policy={policy}: every out_dtype, epilogue, 1x7", flush=True)
    small = ConvGeometry(1, 256, 7, 7, 256, 3, 3, (1, 1), (1, 1))   # auto splits GEMM_K
    xs = rng.integers(-128, 128, (1, 8, 7, 7, 32), dtype=numpy.int8)
    ws = rng.integers(-128, 128, (256, 8, 3, 3, 32), dtype=numpy.int8)
    cupyops.conv2d_int8(xs, ws, rng.standard_normal(256, dtype=numpy.float32), padding=1)
    cupy.cuda.Device().synchronize()
    print(f"split-K plan: {conv.live_plan(small, 'auto', cupy.cuda.runtime.getDevice()).explain()['split_k']} splits")
    print("all paths ran")


if __name__ == "__main__":
    main()
