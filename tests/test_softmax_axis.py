"""softmax / log_softmax and their backward over a non-last axis without a
transpose copy (cupyops/ops/softmax_axis.py, kernels/softmax_axis.cuh).

CPU: kernel names, rendering, the planner's rule (golden plans for the H100
and A100 profiles worked from the rule in the module docstring, and invariants
over many shapes), and NVRTC compiles of the instantiations for sm_80 and sm_90
(thread-block clusters: sm_90 only).
GPU (marked gpu): every non-last axis of 3-D and 4-D arrays, the cached, the
online and the cluster kernel (2, 4 and 8 blocks), against float64 references
of SciPy's formulas (and of the gradients' formulas), with NaN / +-inf slices,
poisoned outputs, in-place output, odd shapes and more tiles than clusters.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy
import pytest
from conftest import assert_close, patch_tuning
from test_softmax_backward_gpu import check as check_gradient
from test_softmax_backward_gpu import make_inputs, reference as gradient_reference

from cupyops import device, jit
from cupyops.dtypes import BFLOAT16
from cupyops.launch import LaunchCache, Target
from cupyops.ops import softmax_axis as sa
from cupyops.ops.softmax_axis import SoftmaxAxisSpec, plan
from cupyops.profile import profile_for

H100 = Target.profile("h100")
TUNE = profile_for(H100.facts)   # the tuning values the H100 plans read
A100 = Target.profile("a100")
TARGETS = {"sm_80": A100, "sm_90": H100}
OPS = ("softmax", "log_softmax")
BACKWARD_OPS = ("softmax_backward", "log_softmax_backward")
ALL_OPS = OPS + BACKWARD_OPS
NUM_INPUTS = {"softmax": 1, "log_softmax": 1, "softmax_backward": 2, "log_softmax_backward": 2}
DTYPES = ("f16", "bf16", "f32", "f64")
ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
CLUSTER_SIZES = sa.AXIS_CLUSTER_SIZES   # as planned (tests force one at a time)


@pytest.fixture
def axis_everywhere(monkeypatch):
    """The axis kernel for every shape: no rows-path thresholds (small inner,
    few uncached tiles), fresh plan and launch caches."""
    patch_tuning(monkeypatch, "AXIS_MIN_INNER", 1)
    patch_tuning(monkeypatch, "AXIS_MIN_TILES_PER_SM", 0)
    monkeypatch.setattr(sa, "_launches", LaunchCache())
    sa.plan.cache_clear()
    yield
    sa.plan.cache_clear()


@pytest.fixture(params=["cached", "online"])
def cache(request, monkeypatch, axis_everywhere):
    """The axis kernel for every shape, each tile cached in shared memory where
    it fits ("cached") or every tile read twice ("online")."""
    if request.param == "online":
        monkeypatch.setattr(sa, "AXIS_CACHE_MAX_BYTES", 0)
    return request.param


def force_clusters(monkeypatch, size: int) -> None:
    """Every 32-byte tile whose share fits the cache shared by a cluster of
    `size` blocks (on sm_90+): no block caches alone, no share fits the
    cluster budget, and backward never reads twice instead (rule 3d), so
    rule 3 falls to its last choice."""
    monkeypatch.setattr(sa, "AXIS_CLUSTER_SIZES", (size,))
    monkeypatch.setattr(sa, "AXIS_CLUSTER_BLOCK_BYTES", 0)
    patch_tuning(monkeypatch, "AXIS_ALONE_MAX_BYTES", 0)
    monkeypatch.setattr(sa, "AXIS_TWICE_MIN_TILES_PER_SM", math.inf)
    sa.plan.cache_clear()


# -- names and rendering --------------------------------------------------------------

@pytest.mark.parametrize("spec, name", [
    (SoftmaxAxisSpec("softmax", "f16", 8, 2, 512, 0, True), "softmax_axis_f16_f32_p8_b2x512_async_cached"),
    (SoftmaxAxisSpec("log_softmax", "bf16", 1, 16, 64, 8, True),
     "log_softmax_axis_bf16_f32_p1_b16x64_l8_cached"),
    (SoftmaxAxisSpec("softmax", "f64", 2, 2, 256, 4, False), "softmax_axis_f64_f64_p2_b2x256_l4_online"),
    (SoftmaxAxisSpec("softmax_backward", "f16", 8, 2, 256, 2, False),
     "softmax_backward_axis_f16_f32_p8_b2x256_l2_online"),
    (SoftmaxAxisSpec("log_softmax_backward", "f32", 4, 2, 512, 0, True),
     "log_softmax_backward_axis_f32_f32_p4_b2x512_async_cached"),
    (SoftmaxAxisSpec("softmax", "f16", 8, 2, 256, 0, True, cluster_size=2),
     "softmax_axis_f16_f32_p8_b2x256_async_cached_c2"),
    (SoftmaxAxisSpec("softmax", "f32", 4, 2, 128, 0, True, cluster_size=4, min_blocks=3),
     "softmax_axis_f32_f32_p4_b2x128_async_cached_c4_m3"),
    (SoftmaxAxisSpec("log_softmax_backward", "bf16", 1, 16, 32, 8, True, cluster_size=8),
     "log_softmax_backward_axis_bf16_f32_p1_b16x32_l8_cached_c8"),
    (SoftmaxAxisSpec("softmax", "f16", 8, 8, 32, 0, True, cluster_size=8, min_blocks=3, base2_exp=True),
     "softmax_axis_f16_f32_p8_b8x32_async_cached_c8_m3_e2"),
])
def test_golden_names(spec, name):
    assert spec.name == name
    assert spec.threads_per_block == spec.block_x * spec.block_y


def test_render_names_the_kernel_and_fingerprint():
    spec = SoftmaxAxisSpec("log_softmax", "f16", 8, 2, 512, 0, True)
    source = jit.render(spec)
    assert f'extern "C" __global__ void __launch_bounds__(1024)\n{spec.name}(' in source
    assert jit.headers_fingerprint() in source
    assert "cupyops::half_t" in source and "Algorithm::kLogSoftmax" in source
    assert "__cluster_dims__" not in source and "true, 1>(inputs" in source
    assert "{{" not in source and "}}" not in source


@pytest.mark.parametrize("base2", [False, True])
def test_render_exp_form(base2):
    spec = SoftmaxAxisSpec("softmax", "f16", 8, 8, 32, 0, True, base2_exp=base2)
    form = "Base2Exp" if base2 else "NaturalExp<float>"
    assert f"SoftmaxForward<Algorithm::kSoftmax, C, {form}> Op;" in jit.render(spec)


@pytest.mark.parametrize("op, dtype, cached", [("log_softmax", "f16", True), ("softmax", "bf16", True),
                                               ("softmax", "f32", True), ("softmax", "f16", False),
                                               ("softmax_backward", "f16", True)])
def test_base2_terms_only_for_float16_softmax_cached(op, dtype, cached):
    assert not sa.base2_terms(op, dtype, cached)
    with pytest.raises(ValueError, match="base-2 terms"):
        SoftmaxAxisSpec(op, dtype, 8, 8, 32, 0, cached, base2_exp=True)


def test_render_cluster():
    spec = SoftmaxAxisSpec("softmax_backward", "f16", 8, 2, 256, 0, True, cluster_size=4, min_blocks=3)
    source = jit.render(spec)
    assert (f'extern "C" __global__ void __launch_bounds__(512, 3)\n__cluster_dims__(4, 1, 1)\n'
            f'{spec.name}(') in source
    assert "true, 4>(inputs, out, outer, cols, inner);" in source


@pytest.mark.parametrize("op, algorithm", [("softmax_backward", "kSoftmax"),
                                           ("log_softmax_backward", "kLogSoftmax")])
def test_render_backward(op, algorithm):
    spec = SoftmaxAxisSpec(op, "bf16", 8, 2, 256, 2, False)
    source = jit.render(spec)
    assert f'extern "C" __global__ void __launch_bounds__(512)\n{spec.name}(' in source
    assert jit.headers_fingerprint() in source
    assert (f"{spec.name}(const cupyops::bfloat16_t* dy, const cupyops::bfloat16_t* y, "
            "cupyops::bfloat16_t* out,") in source
    assert f"SoftmaxBackward<Algorithm::{algorithm}, C>" in source and "inputs[] = {dy, y};" in source
    assert "{{" not in source and "}}" not in source


# -- the planner ----------------------------------------------------------------------

# Worked from the rule for the H100 profile (sm_90: clusters; 132 SMs x 2048
# threads, 228 KB of shared memory per SM, 1 KB reserved a block): (op, outer,
# cols, inner, dtype, align) -> (kernel, block, grid, dynamic shared memory).
PLAN_GOLDEN = [
    # the target: 16-byte packs, 8 threads x 128 bytes along inner; the 512 KB
    # tile is over a 16-bit forward block's 64 KB alone, so a cluster of 8
    # blocks of 64 KB; 233472 // (65536 + 1024) = 3 resident, so 256 threads
    # (3 x 512 x 64 registers exceed 65536), bound to 3 blocks an SM;
    # 64 x 4 tiles x 8 blocks; float16 softmax over a cached tile: base-2 terms
    (("softmax", 64, 4096, 256, "f16", 16),
     ("softmax_axis_f16_f32_p8_b8x32_async_cached_c8_m3_e2", (8, 32, 1), 2048, 65536)),
    (("log_softmax", 64, 4096, 256, "bf16", 16),
     ("log_softmax_axis_bf16_f32_p8_b8x32_async_cached_c8_m3", (8, 32, 1), 2048, 65536)),
    (("softmax", 64, 4096, 256, "f32", 16),
     ("softmax_axis_f32_f32_p4_b8x32_async_cached_c8_m3", (8, 32, 1), 4096, 65536)),
    (("softmax", 64, 4096, 256, "f64", 16),
     ("softmax_axis_f64_f64_p2_b8x32_async_cached_c8_m3", (8, 32, 1), 8192, 65536)),
    # an input 2 bytes off the 16-byte grid: 2-byte packs, a warp along inner
    # (64 bytes); the 256 KB tile in clusters of 4 blocks of 64 KB, cached
    # through registers (cp.async needs 4 bytes at least)
    (("softmax", 64, 4096, 256, "f16", 2),
     ("softmax_axis_f16_f32_p1_b32x8_l8_cached_c4_m3_e2", (32, 8, 1), 2048, 65536)),
    # 1.6 MB tiles of 32 bytes a row (200 KB a block even in clusters of 8),
    # 128 of them: read twice; 1024 threads get 32 bytes in flight
    (("softmax", 4, 100000, 512, "f16", 16),
     ("softmax_axis_f16_f32_p8_b2x512_l2_online", (2, 512, 1), 128, 0)),
    # 64-element inner: 4 packs (128 bytes) a row; 1 MB tiles in clusters of 8
    # blocks of 64 KB; 4096 tiles x 8 blocks, the grid capped at 32 waves of
    # 256-thread blocks (132 x 8 x 32 = 33792)
    (("softmax", 4096, 8192, 64, "f16", 16),
     ("softmax_axis_f16_f32_p8_b4x64_async_cached_c8_m3_e2", (4, 64, 1), 33792, 65536)),
    # no wide tile fits 8 blocks of 64 KB: the 32-byte tile, 8 x 64 KB
    (("softmax", 16, 16384, 256, "f16", 16),
     ("softmax_axis_f16_f32_p8_b2x128_async_cached_c8_m3_e2", (2, 128, 1), 2048, 65536)),
    # odd inner: 1-element packs; 17 rows take 16 threads, the rest widen the
    # tile; bound to the 2 blocks of 512 threads 64 registers allow
    (("softmax", 2, 17, 1025, "f32", 16),
     ("softmax_axis_f32_f32_p1_b32x16_async_cached_m2", (32, 16, 1), 66, 17 * 32 * 4)),
    # cols = 1: a warp along inner, 32 of them an SM
    (("softmax", 64, 1, 256, "f16", 16),
     ("softmax_axis_f16_f32_p8_b32x1_async_cached_m32_e2", (32, 1, 1), 64, 32 * 16)),
    # 16 packs of 8 bytes (128 bytes) a row, 42 KB alone; 49 tiles: 1024 threads
    (("log_softmax", 7, 333, 97, "f64", 8),
     ("log_softmax_axis_f64_f64_p1_b16x64_async_cached", (16, 64, 1), 49, 333 * 16 * 8)),
    # backward: a tile holds dy and y. The target's 1 MB tile of 128 bytes a
    # row fits no cluster within 64 KB; 64 bytes a row, 8 blocks of 64 KB
    (("softmax_backward", 64, 4096, 256, "f16", 16),
     ("softmax_backward_axis_f16_f32_p8_b4x64_async_cached_c8_m3", (4, 64, 1), 4096, 65536)),
    # half the cols: 512 KB of 128 bytes a row, 8 x 64 KB
    (("log_softmax_backward", 64, 2048, 256, "f16", 16),
     ("log_softmax_backward_axis_f16_f32_p8_b8x32_async_cached_c8_m3", (8, 32, 1), 2048, 65536)),
    (("softmax_backward", 64, 2048, 256, "f32", 16),
     ("softmax_backward_axis_f32_f32_p4_b8x32_async_cached_c8_m3", (8, 32, 1), 4096, 65536)),
    # 2-byte packs, a warp along inner: a 512 KB tile in clusters of 8; 8 rows
    # (the most) of two packs in flight
    (("log_softmax_backward", 64, 4096, 256, "bf16", 2),
     ("log_softmax_backward_axis_bf16_f32_p1_b32x8_l8_cached_c8_m3", (32, 8, 1), 4096, 65536)),
    # a 1 MB tile of 32 bytes a row: no cluster size brings a block under
    # 64 KB; 128 tiles of 64 bytes a row are about one an SM, so they are read
    # twice (rule 3d) by 1024 threads: one row of two packs in flight
    (("softmax_backward", 16, 16384, 256, "f16", 16),
     ("softmax_backward_axis_f16_f32_p8_b4x256_l1_online", (4, 256, 1), 128, 0)),
    # two outer indices leave 32 tiles of 32 bytes a row: 8 blocks of 128 KB
    # fit the cache (one block per SM, 512 threads) rather than read twice
    (("softmax_backward", 2, 16384, 256, "f16", 16),
     ("softmax_backward_axis_f16_f32_p8_b2x256_async_cached_c8", (2, 256, 1), 256, 131072)),
    # 1024 threads get 32 bytes in flight: one row of two packs
    (("softmax_backward", 4, 100000, 512, "f16", 16),
     ("softmax_backward_axis_f16_f32_p8_b2x512_l1_online", (2, 512, 1), 128, 0)),
    (("softmax_backward", 2, 17, 1025, "f32", 16),
     ("softmax_backward_axis_f32_f32_p1_b32x16_async_cached_m2", (32, 16, 1), 66, 2 * 17 * 32 * 4)),
    (("log_softmax_backward", 7, 333, 97, "f64", 8),
     ("log_softmax_backward_axis_f64_f64_p1_b16x64_async_cached", (16, 64, 1), 49, 2 * 333 * 16 * 8)),
]

# The A100 profile (sm_80: no clusters; 108 SMs, 164 KB of shared memory per SM).
PLAN_GOLDEN_A100 = [
    # no tile fits 64 KB alone: the 32-byte tile's 128 KB in one block (one
    # per SM: 512 threads)
    (("softmax", 64, 4096, 256, "f16", 16),
     ("softmax_axis_f16_f32_p8_b2x256_async_cached_e2", (2, 256, 1), 1024, 131072)),
    # 256 KB: over the cache, read twice; 1024 tiles x 256 threads fill 108 SMs
    (("softmax_backward", 64, 4096, 256, "f16", 16),
     ("softmax_backward_axis_f16_f32_p8_b2x128_l2_online", (2, 128, 1), 1024, 0)),
    (("softmax", 16, 16384, 256, "f16", 16),
     ("softmax_axis_f16_f32_p8_b2x512_l2_online", (2, 512, 1), 256, 0)),
]


@pytest.mark.parametrize("target, args, expected",
                         [(H100, *g) for g in PLAN_GOLDEN] + [(A100, *g) for g in PLAN_GOLDEN_A100],
                         ids=[f"h100-{g[0]}" for g in PLAN_GOLDEN] + [f"a100-{g[0]}" for g in PLAN_GOLDEN_A100])
def test_plan_golden(target, args, expected):
    op, outer, cols, inner, dtype, align = args
    p = plan(op, outer, cols, inner, dtype, target, align)
    assert (p.spec.name, p.block, p.grid[0], p.smem_bytes) == expected
    assert p.grid[0] % p.spec.cluster_size == 0


@pytest.mark.parametrize("shape", [(8, 1000, 3), (4096, 64, 31), (1, 50000, 64), (2, 1000000, 32)])
def test_rows_path_chosen(shape):
    """inner < 32, or too few tiles too large to cache: the rows path (None)."""
    for op in ALL_OPS:
        for dtype in DTYPES:
            assert plan(op, *shape, dtype, H100) is None


def test_explain():
    info = plan("softmax", 64, 4096, 256, "f16", H100).explain()
    assert info == {"op": "softmax", "impl": "axis", "outer": 64, "cols": 4096, "inner": 256,
                    "pack_size": 8, "cached": True, "cluster_size": 8, "base2_exp": True,
                    "block": [8, 32, 1], "grid": [2048, 1, 1], "smem_bytes": 65536,
                    "kernel": "softmax_axis_f16_f32_p8_b8x32_async_cached_c8_m3_e2"}
    info = plan("softmax_backward", 64, 4096, 256, "f16", A100).explain()
    assert info == {"op": "softmax_backward", "impl": "axis", "outer": 64, "cols": 4096,
                    "inner": 256, "pack_size": 8, "cached": False, "cluster_size": 1, "base2_exp": False,
                    "block": [2, 128, 1], "grid": [1024, 1, 1], "smem_bytes": 0,
                    "kernel": "softmax_backward_axis_f16_f32_p8_b2x128_l2_online"}


KB = 1024
# (arch, cols, packs of inner, pack bytes, inputs, alone limit) -> (block_x,
# cluster size) (rule 3); 16-byte packs of a 256-element float16 inner
TILE_SHAPE_GOLDEN = [
    (("sm_90", 512, 32, 16, 1, 64 * KB), (8, 1)),       # 128 bytes a row, 64 KB alone
    (("sm_90", 513, 32, 16, 1, 64 * KB), (4, 1)),       # one row over: 64 bytes a row
    (("sm_90", 1024, 32, 16, 1, 128 * KB), (8, 1)),     # 128 KB alone where allowed
    (("sm_90", 1024, 32, 16, 1, 64 * KB), (4, 1)),
    (("sm_90", 1025, 32, 16, 1, 64 * KB), (8, 4)),      # 2 x 513 rows are over 64 KB: 4 x 257
    (("sm_90", 4096, 32, 16, 1, 64 * KB), (8, 8)),      # the target: 8 x 64 KB
    (("sm_90", 4096, 32, 16, 2, 128 * KB), (4, 8)),     # its backward: 64 bytes a row, 8 x 64 KB
    (("sm_90", 16384, 32, 16, 1, 64 * KB), (2, 8)),     # the 32-byte tile, 8 x 64 KB
    (("sm_90", 16384, 32, 16, 2, 128 * KB), (2, 8)),    # 8 x 128 KB fit the cache
    (("sm_90", 16384, 32, 16, 2, 128 * KB, 4), (4, 1)),  # rule 3d: no full shares, read twice 64 B a row
    (("sm_90", 32769, 32, 16, 1, 128 * KB), (2, 1)),    # 8 x 4097 rows are over it: read twice
    (("sm_90", 100, 2, 16, 1, 64 * KB), (2, 1)),        # inner of 2 packs
    (("sm_90", 4096, 256, 2, 1, 64 * KB), (32, 4)),     # 2-byte packs: a warp along inner
    (("sm_80", 4096, 32, 16, 1, 64 * KB), (2, 1)),      # no clusters before sm_90
    (("sm_100", 4096, 32, 16, 1, 64 * KB), (8, 8)),     # newer archs too
]


@pytest.mark.parametrize("args, expected", TILE_SHAPE_GOLDEN, ids=[str(g[0]) for g in TILE_SHAPE_GOLDEN])
def test_tile_shape(args, expected):
    assert sa.tile_shape(*args) == expected


def test_backward_long_cols_read_twice_in_wide_tiles():
    """Rule 3d (sm_90+): backward tiles past the 64 KB cluster shares are
    read twice, in the widest tiles of which there are about as many as SMs,
    instead of 128 KB shares in 8-block clusters; forward keeps the clusters,
    and so do arrays of too few tiles and archs without clusters."""
    h200 = Target.profile("h200")
    for (outer, cols, inner), dtype, row_bytes in (((16, 16384, 256), "f16", 64), ((8, 16384, 512), "f32", 128),
                                                   ((64, 32768, 256), "f16", 128)):
        spec = plan("softmax_backward", outer, cols, inner, dtype, h200).spec
        assert not spec.cached and spec.cluster_size == 1, spec.name
        assert spec.block_x * spec.pack_size * ITEMSIZE[dtype] == row_bytes, spec.name
        assert spec.block_x * spec.block_y == sa.AXIS_MAX_BLOCK_THREADS, spec.name
    assert sa.twice_tile_width(16, 32, 16, 132) == 4 and sa.twice_tile_width(4, 32, 16, 132) is None
    assert plan("softmax", 16, 16384, 256, "f16", h200).spec.cluster_size == 8
    assert plan("softmax_backward", 2, 16384, 256, "f16", h200).spec.cluster_size == 8
    assert plan("softmax_backward", 16, 16384, 256, "f16", A100).spec.block_x == 2


@pytest.mark.parametrize("profile", ["h100", "h200"])
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_clusters_leave_several_blocks_per_sm(profile, op, dtype):
    """The target shape on Hopper: 8-block clusters of 64 KB shares (128 bytes
    a row forward, 64 backward) whose blocks reside 3 to an SM, so one's loads
    overlap another's writes."""
    target = Target.profile(profile)
    p = plan(op, 64, 4096, 256, dtype, target)
    row_bytes = 128 // NUM_INPUTS[op]
    assert p.spec.cached and p.spec.cluster_size == 8 and p.spec.min_blocks == 3
    assert p.spec.block_x * p.spec.pack_size * ITEMSIZE[dtype] == row_bytes
    assert p.smem_bytes == 4096 // 8 * NUM_INPUTS[op] * row_bytes == 64 * KB
    assert target.max_active_blocks(p.spec, p.spec.threads_per_block, p.smem_bytes, opt_in=True) == 3
    assert jit.compile_cubin(p.spec, "sm_90").spill_bytes == 0


@pytest.mark.parametrize("profile", ["h100", "h200"])
@pytest.mark.parametrize("outer,inner", [(1, 256), (8, 512), (1, 4096)])
def test_short_cols_tiles_fit_static_shared_memory(profile, outer, inner):
    """32 cols of a 16-bit tile: 32 x 32 threads would need 66 KB of static reduction buffers."""
    target = Target.profile(profile)
    for dtype in ("f16", "bf16"):
        chosen = sa.plan("softmax", outer, 32, inner, dtype, target)
        block_x, block_y, _ = chosen.block
        assert sa.static_smem_bytes(block_x, block_y, chosen.spec.pack_size, 4) <= sa.STATIC_SMEM_BYTES
        report = jit.compile_cubin(chosen.spec, target.facts.arch)
        assert report.registers > 0


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown op"):
        plan("softmax_grad", 2, 3, 64, "f32", H100)
    with pytest.raises(ValueError, match="positive"):
        plan("softmax", 2, 0, 64, "f32", H100)


SHAPE_SWEEP = [(outer, cols, inner) for outer in (1, 3, 64, 4096) for cols in (1, 2, 17, 1000, 4096, 50000)
               for inner in (32, 33, 64, 100, 256, 1025, 4096)]


@pytest.mark.parametrize("op", ("softmax", "softmax_backward", "log_softmax_backward"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("align", (16, 8, 4, 2))
@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_plan_invariants(arch, op, dtype, align):
    itemsize = ITEMSIZE[dtype]
    if align < itemsize:
        pytest.skip("an array is always aligned to its itemsize")
    target = TARGETS[arch]
    facts = target.facts
    for outer, cols, inner in SHAPE_SWEEP:
        p = plan(op, outer, cols, inner, dtype, target, align)
        if p is None:
            continue
        spec = p.spec
        cluster = spec.cluster_size
        pack_bytes = spec.pack_size * itemsize
        threads = spec.block_x * spec.block_y
        assert inner % spec.pack_size == 0 and pack_bytes <= min(16, align)
        for size in (spec.pack_size, spec.block_x, spec.block_y):
            assert size & (size - 1) == 0
        assert threads % 32 == 0 and threads <= sa.AXIS_MAX_BLOCK_THREADS
        assert spec.block_x <= sa.AXIS_MAX_BLOCK_X
        # a block caches its rows of a tile (all of them, or its share in a
        # cluster), a pack of every input per row
        block_rows = math.ceil(cols / cluster)
        row_bytes = NUM_INPUTS[op] * spec.block_x * pack_bytes
        block_bytes = block_rows * row_bytes
        # block_y never exceeds a block's rows, except to keep whole warps
        assert spec.block_y <= block_rows or threads == 32
        tiles = outer * math.ceil(inner // spec.pack_size / spec.block_x)
        assert cluster <= p.grid[0] <= tiles * cluster and p.grid[0] % cluster == 0
        assert p.block == (spec.block_x, spec.block_y, 1)
        assert spec.base2_exp == (op == "softmax" and dtype == "f16" and spec.cached)
        # the tile of rule 3 (block_x widened only where cols leave threads
        # over; backward tiles read twice on sm_90 the widest of about one an
        # SM, rule 3d); clusters on sm_90 only, for tiles over a block's limit
        # alone; only cached
        alone = (TUNE.AXIS_ALONE_MAX_BYTES_16BIT_FORWARD if itemsize == 2 and op in OPS
                 else TUNE.AXIS_ALONE_MAX_BYTES)
        twice_width = (sa.twice_tile_width(outer, inner // spec.pack_size, pack_bytes, facts.sm_count)
                       if op not in OPS and arch == "sm_90" else None)
        planned_x, planned_cluster = sa.tile_shape(arch, cols, inner // spec.pack_size, pack_bytes,
                                                   NUM_INPUTS[op], alone, twice_width)
        assert cluster == planned_cluster and spec.block_x >= planned_x
        assert spec.block_x == planned_x or spec.block_y >= 1 << (block_rows.bit_length() - 1)
        assert cluster in (1, *sa.AXIS_CLUSTER_SIZES) and (f"_c{cluster}" in spec.name) == (cluster > 1)
        if cluster > 1:
            assert arch == "sm_90" and spec.cached and cols * planned_x * NUM_INPUTS[op] * pack_bytes > alone
        if spec.block_x * pack_bytes < 64 and spec.block_x < min(inner // spec.pack_size, sa.AXIS_MAX_BLOCK_X):
            assert spec.block_x * pack_bytes == sa.AXIS_NARROW_ROW_BYTES   # the narrow tile: no wide one fits
        # a cached kernel is bound to the blocks that fit an SM at the planned registers
        assert spec.min_blocks == (sa.resident_blocks(facts, block_bytes, threads, sa.AXIS_THREAD_REGISTERS)
                                   if spec.cached else 1)
        assert spec.min_blocks * threads * sa.AXIS_THREAD_REGISTERS <= facts.regs_per_sm
        # cached exactly when a block's rows fit (every tile that fits launches on these profiles)
        assert spec.cached == (block_bytes <= sa.AXIS_CACHE_MAX_BYTES)
        if spec.cached:
            assert p.smem_bytes == block_bytes
            assert (spec.loads_in_flight == 0) == (pack_bytes >= sa.AXIS_ASYNC_MIN_PACK_BYTES)
        else:
            assert p.smem_bytes == 0 and spec.loads_in_flight >= 1
            assert tiles >= TUNE.AXIS_MIN_TILES_PER_SM * facts.sm_count
        if spec.loads_in_flight > 1:   # rows of a pack of every input, within the bytes in flight
            in_flight = next(size for most, size in sa.AXIS_BYTES_IN_FLIGHT if threads <= most)
            assert spec.loads_in_flight * NUM_INPUTS[op] * pack_bytes <= in_flight
        # few blocks: a block's rows are split among more threads (up to
        # 1024); blocks caching only while fewer than the SMs
        few = (tiles * cluster < facts.sm_count if spec.cached
               else tiles * threads < facts.sm_count * facts.max_threads_per_sm)
        if few and threads < 1024:
            assert spec.block_y == 1 << (block_rows.bit_length() - 1) or threads == 32
        if spec.cached and not few:
            assert threads <= TUNE.AXIS_CACHED_MAX_BLOCK_THREADS


def test_lifted_thresholds_give_axis_plans(axis_everywhere):
    """The fixture the GPU tests use: every shape gets an axis plan."""
    for shape in [(8, 1000, 3), (1, 50000, 64), (5, 7, 1), (1, 1, 1)]:
        for op in ("softmax", "softmax_backward"):
            assert plan(op, *shape, "f32", H100) is not None


# -- NVRTC compiles -------------------------------------------------------------------

# The brief's shapes and one of each planner branch: the online kernel with
# 256 threads, cols = 1, short cols widening the tile, odd inner; on sm_90
# clusters of 2, 4 and 8 blocks.
COMPILE_SHAPES = [(64, 4096, 256), (8, 1000, 3), (2, 17, 1025), (1, 50000, 64),
                  (4096, 8192, 64), (64, 1, 256), (16, 3, 4096), (7, 333, 97), (16, 16384, 256)]
MISALIGNED_SHAPE = (64, 4096, 256)     # also planned with the pointers only itemsize-aligned

# (shape, axis) the GPU tests run through clusters of every size (force_clusters).
CLUSTER_CASES = [
    ((3, 37, 48), 1),       # 37 rows: a multiple of no cluster size, nor of block_y
    ((4, 3, 40), 1),        # fewer rows than blocks: some blocks hold none
    ((2, 5, 33), 1),        # odd inner: 1-element packs
    ((3, 64, 2, 48), 0),    # 3 rows of a wide inner
    ((2, 2000, 96), 1),     # long slices: several rows for each row of threads
]


def axis_view(shape, axis) -> tuple:
    """(outer, cols, inner) of `shape` reduced over `axis`."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def _instantiations(arch: str, dtype: str, monkeypatch) -> set:
    """Every kernel the shapes plan to, cached where possible and online, and
    on sm_90 the GPU tests' forced clusters."""
    target = TARGETS[arch]
    specs = set()
    for max_bytes in (0, sa.AXIS_CACHE_MAX_BYTES):     # cached last: the forced clusters need it
        monkeypatch.setattr(sa, "AXIS_CACHE_MAX_BYTES", max_bytes)
        sa.plan.cache_clear()
        for op in ALL_OPS:
            for shape in COMPILE_SHAPES:
                specs.add(plan(op, *shape, dtype, target).spec)
            specs.add(plan(op, *MISALIGNED_SHAPE, dtype, target, ITEMSIZE[dtype]).spec)
    if arch == "sm_90":   # each case with one of the sizes (the GPU tests compile the rest)
        for (shape, axis), size in zip(CLUSTER_CASES, itertools.cycle(CLUSTER_SIZES)):
            force_clusters(monkeypatch, size)
            specs.update(plan(op, *axis_view(shape, axis), dtype, target).spec for op in ALL_OPS)
    return specs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_instantiations_compile(arch, dtype, axis_everywhere, monkeypatch):
    specs = _instantiations(arch, dtype, monkeypatch)
    for op in ALL_OPS:
        assert {spec.cached for spec in specs if spec.op == op} == {True, False}
        clusters = {spec.cluster_size for spec in specs if spec.op == op}
        assert clusters == ({1, *CLUSTER_SIZES} if arch == "sm_90" else {1})
    problems = []
    for spec in sorted(specs, key=lambda s: s.name):
        report = jit.compile_cubin(spec, arch)       # raises jit.CompileError on failure
        assert report.cubin_bytes > 0
        # f64 is exempt from the spill check: libdevice's double exp / log are
        # calls that spill around the call (as in test_compile.py)
        spills = report.spill_bytes if dtype != "f64" else 0
        if spills or report.registers * spec.threads_per_block > 65536:
            problems.append(f"{spec.name}: {report.registers} registers, "
                            f"{report.spill_bytes} spill bytes")
        if spec.block_y > 1:
            assert report.smem_bytes > 0             # the column reductions' partials
    assert not problems, "\n".join(problems)


# -- GPU ------------------------------------------------------------------------------

NUMPY_DTYPES = {"f16": numpy.dtype(numpy.float16), "bf16": BFLOAT16,
                "f32": numpy.dtype(numpy.float32), "f64": numpy.dtype(numpy.float64)}


def reference(op, x, axis):
    """scipy.special.softmax / log_softmax in float64, step for step."""
    x = numpy.asarray(x, dtype=numpy.float64)
    x_max = numpy.amax(x, axis=axis, keepdims=True)
    with numpy.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if op == "softmax":
            shifted = numpy.exp(x - x_max)
            return shifted / numpy.sum(shifted, axis=axis, keepdims=True)
        tmp = x - numpy.where(numpy.isfinite(x_max), x_max, 0.0)
        return tmp - numpy.log(numpy.sum(numpy.exp(tmp), axis=axis, keepdims=True))


def random_input(rng, shape, dtype):
    """(device array, float64 values of the rounded input)."""
    import cupy

    host = (rng.standard_normal(shape) * 4.0).astype(dtype)
    return cupy.asarray(host), host.astype(numpy.float64)


def poisoned(shape, dtype):
    import cupy

    return cupy.asarray(numpy.full(shape, numpy.nan, dtype=dtype))


def run_checked(op, x, axis, out=None):
    result = sa.run(op, x, axis, out)
    assert result is not None, "the axis kernel did not apply"
    return result


GPU_SHAPES = [(3, 17, 64), (2, 5, 33), (4, 1, 40), (1, 300, 1), (6, 7, 1025), (2, 3, 4, 5),
              (3, 64, 2, 48), (2, 2000, 96), (5, 4, 3, 2, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_every_axis(op, dtype, cache, rng):
    for shape in GPU_SHAPES:
        x, exact = random_input(rng, shape, NUMPY_DTYPES[dtype])
        for axis in range(len(shape) - 1):
            y = run_checked(op, x, axis)
            assert y.shape == shape and y.dtype == x.dtype and y.flags.c_contiguous
            assert_close(y.get(), reference(op, exact, axis), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_public_functions_every_axis(op, dtype, rng):
    """Through cupyops.softmax / log_softmax (the axis kernel once wired in)."""
    import cupyops

    function = getattr(cupyops, op)
    for shape in [(4, 33, 64), (3, 5, 7, 40), (64, 300, 256), (1, 32, 256), (8, 32, 4096)]:
        x, exact = random_input(rng, shape, NUMPY_DTYPES[dtype])
        for axis in range(-len(shape), len(shape)):
            assert_close(function(x, axis=axis).get(), reference(op, exact, axis), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_nan_and_inf_slices(op, dtype, cache, rng):
    check_nan_and_inf_slices(op, dtype, rng)


def check_nan_and_inf_slices(op, dtype, rng):
    """Slices of a (3, 37, 48) array over axis 1 holding NaN and +-inf, each
    against the float64 reference; the last four in the rows a cached forward
    tile's second fill stage holds (rows 32-36 with 32 rows of threads), after
    a first stage of finite values or of -inf."""
    import cupy

    outer, cols, inner = 3, 37, 48
    host = (rng.standard_normal((outer, cols, inner)) * 4.0).astype(NUMPY_DTYPES[dtype])
    special = [
        lambda s: s.__setitem__(slice(None), -numpy.inf),              # all -inf
        lambda s: s.__setitem__(slice(None), numpy.inf),               # all +inf
        lambda s: s.__setitem__(5, numpy.inf),                         # one +inf
        lambda s: s.__setitem__(slice(3, 5), numpy.inf),               # two +inf
        lambda s: s.__setitem__(30, numpy.nan),                        # one NaN
        lambda s: s.__setitem__(0, -numpy.inf),                        # one -inf
        lambda s: s.__setitem__(slice(0, 36), -numpy.inf),             # one finite left
        lambda s: (s.__setitem__(1, numpy.inf), s.__setitem__(2, -numpy.inf)),
        lambda s: (s.__setitem__(1, numpy.nan), s.__setitem__(2, numpy.inf)),
        lambda s: (s.__setitem__(slice(0, 19), -numpy.inf), s.__setitem__(30, numpy.inf)),
        lambda s: s.__setitem__(33, numpy.inf),                        # +inf in the second stage
        lambda s: s.__setitem__(34, numpy.nan),                        # NaN in the second stage
        lambda s: s.__setitem__(36, 60.0),                             # the max in the second stage
        lambda s: (s.__setitem__(slice(0, 32), -numpy.inf), s.__setitem__(32, 1.0)),
    ]
    for k, make in enumerate(special):
        make(host[k % outer, :, 5 * k % inner])   # slices of several threads and tiles, every pack position
    exact = host.astype(numpy.float64)
    y = run_checked(op, cupy.asarray(host), 1)
    assert_close(y.get(), reference(op, exact, 1), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
def test_float16_softmax_base2_terms(rng, axis_everywhere):
    """float16 softmax over a cached tile sums base-2 terms: slices far from
    zero (offsets up to 5e4, spread 400, where m log2(e) is rounded to 2^-7 and
    every term and rescale must share that rounding), in a block alone and in
    a cluster; log_softmax (natural terms) beside it."""
    import cupy

    target = Target.live(cupy.cuda.Device().id)
    for shape in [(3, 300, 64), (8, 4096, 256)]:
        chosen = plan("softmax", *shape, "f16", target)
        assert chosen.spec.base2_exp
        if shape[1] == 4096:
            assert (chosen.spec.cluster_size > 1) == has_clusters(target)
        offsets = rng.choice([-5e4, -2e4, 0.0, 2e4, 5e4], size=(shape[0], 1, shape[2]))
        host = (offsets + 400.0 * rng.standard_normal(shape)).astype(numpy.float16)
        for op in OPS:
            y = run_checked(op, cupy.asarray(host), 1)
            assert_close(y.get(), reference(op, host.astype(numpy.float64), 1), numpy.float16)


@pytest.mark.gpu
def test_float16_softmax_folded_scale_rounds_within_half_an_ulp(rng, axis_everywhere):
    """float16 softmax over a cached tile writes 2^(x log2(e) - (shift + log2 s))
    where |shift + log2 s| < 256 (kernels/softmax.cuh, RowSoftmax), else
    2^(x log2(e) - shift) / s: either way each output is the float64 result
    rounded to float16, within half an ulp and 2e-5 of itself (a folded shift
    rounded at 2^11 would be off by 2e-4). Slice maxima on both sides of the
    limit (m log2(e) about +-245, +-257, +-260) and far from it, threads of
    both kinds in one tile."""
    import cupy

    shape = (4, 300, 64)
    offsets = rng.choice([0.0, 170.0, -170.0, 178.0, -178.0, 180.0, -180.0, 3000.0, -3000.0],
                         size=(shape[0], 1, shape[2]))
    host = (offsets + 2.0 * rng.standard_normal(shape)).astype(numpy.float16)
    chosen = plan("softmax", *shape, "f16", Target.live(cupy.cuda.Device().id))
    assert chosen.spec.base2_exp and chosen.spec.cached
    y = run_checked("softmax", cupy.asarray(host), 1).get().astype(numpy.float64)
    exact = reference("softmax", host.astype(numpy.float64), 1)
    half_ulp = 0.5 * numpy.spacing(numpy.abs(exact).astype(numpy.float16)).astype(numpy.float64)
    assert numpy.all(numpy.abs(y - exact) <= half_ulp + 2e-5 * numpy.abs(exact))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_out_poisoned_and_in_place(op, dtype, rng, axis_everywhere):
    check_outputs(op, dtype, rng, [((5, 123, 72), 0), ((5, 123, 72), 1)])


def check_outputs(op, dtype, rng, cases):
    """For each (shape, axis): a fresh output, a poisoned `out` and in place (out = x)."""
    numpy_dtype = NUMPY_DTYPES[dtype]
    for shape, axis in cases:
        x, exact = random_input(rng, shape, numpy_dtype)
        expected = reference(op, exact, axis)
        y = run_checked(op, x, axis)
        assert y.shape == shape and y.dtype == x.dtype and y.flags.c_contiguous
        assert_close(y.get(), expected, numpy_dtype)
        out = poisoned(shape, numpy_dtype)
        assert run_checked(op, x, axis, out) is out
        assert_close(out.get(), expected, numpy_dtype)
        assert run_checked(op, x, axis, x) is x
        assert_close(x.get(), expected, numpy_dtype)


def has_clusters(target) -> bool:
    return device.has_clusters(target.facts.arch)


@pytest.mark.gpu
def test_target_shape(rng):
    """(64, 4096, 256) float16 over axis 1 with the default planner: cached
    tile, shared by a cluster on sm_90 and newer."""
    x, exact = random_input(rng, (64, 4096, 256), numpy.float16)
    target = Target.live(x.device.id)
    p = plan("softmax", 64, 4096, 256, "f16", target)
    assert p is not None and p.spec.cached and (p.spec.cluster_size > 1) == has_clusters(target)
    for op in OPS:
        assert_close(run_checked(op, x, 1).get(), reference(op, exact, 1), numpy.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_misaligned_input(dtype, rng, axis_everywhere):
    """A C-contiguous view one element off the 16-byte grid: narrower packs."""
    import cupy

    numpy_dtype = NUMPY_DTYPES[dtype]
    shape = (4, 300, 64)
    host = (rng.standard_normal(math.prod(shape) + 1) * 4.0).astype(numpy_dtype)
    x = cupy.asarray(host)[1:].reshape(shape)
    assert x.flags.c_contiguous and x.data.ptr % 16
    for op in OPS:
        y = run_checked(op, x, 1)
        assert_close(y.get(), reference(op, host[1:].reshape(shape).astype(numpy.float64), 1),
                     numpy_dtype)


@pytest.mark.gpu
def test_not_applicable_returns_none(rng, axis_everywhere):
    import cupy

    x, _ = random_input(rng, (4, 6, 64), numpy.float32)
    assert sa.run("softmax", x, 2, None) is None                       # last axis
    assert sa.run("softmax", x.transpose(1, 0, 2), 1, None) is None    # not C-contiguous
    out = cupy.empty((4, 6, 64), numpy.float32)
    assert sa.run("softmax", x, 1, out.transpose(1, 0, 2).copy().transpose(1, 0, 2)) is None
    big = cupy.zeros(4 * 6 * 64 + 64, numpy.float32)
    overlapping_in = big[:4 * 6 * 64].reshape(4, 6, 64)
    overlapping_out = big[64:].reshape(4, 6, 64)
    poison = overlapping_out.copy()
    assert sa.run("softmax", overlapping_in, 1, overlapping_out) is None
    assert bool((overlapping_out == poison).all())                     # nothing written


# -- GPU: backward --------------------------------------------------------------------

def gradient_inputs(rng, op, shape, dtype, axis):
    """(dy, y) on the device and on the host: y a softmax / log_softmax of random data."""
    import cupy

    dy, y = make_inputs(rng, op, shape, NUMPY_DTYPES[dtype], axis)
    return cupy.asarray(dy), cupy.asarray(y), dy, y


def run_backward_checked(op, dy, y, axis, out=None):
    result = sa.run_backward(op, dy, y, axis, out)
    assert result is not None, "the axis kernel did not apply"
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_backward_every_axis(op, dtype, cache, rng):
    check_backward_outputs(op, dtype, rng, [(shape, axis) for shape in GPU_SHAPES
                                            for axis in range(len(shape) - 1)])


def check_backward_outputs(op, dtype, rng, cases):
    """For each (shape, axis): a fresh output, a poisoned `out` and in place (out = dy)."""
    for shape, axis in cases:
        dy, y, dy_host, y_host = gradient_inputs(rng, op, shape, dtype, axis)
        expected = gradient_reference(op, dy_host, y_host, axis)
        dx = run_backward_checked(op, dy, y, axis)
        assert dx.shape == shape and dx.dtype == dy.dtype and dx.flags.c_contiguous
        check_gradient(dx.get(), expected, NUMPY_DTYPES[dtype])
        out = poisoned(shape, NUMPY_DTYPES[dtype])
        assert run_backward_checked(op, dy, y, axis, out) is out
        check_gradient(out.get(), expected, NUMPY_DTYPES[dtype])
        assert run_backward_checked(op, dy, y, axis, dy) is dy
        check_gradient(dy.get(), expected, NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_backward_public_functions(op, dtype, rng, axis_everywhere, monkeypatch):
    """Through cupyops.softmax_backward / log_softmax_backward: every non-last
    axis takes the axis kernel (the rows path is made to fail); in place, out = y."""
    import cupyops
    from cupyops import rowwise

    def rows_path(*args, **kwargs):
        raise AssertionError("the rows path ran instead of the axis kernel")

    monkeypatch.setattr(rowwise, "run", rows_path)
    function = getattr(cupyops, op)
    for shape in [(4, 33, 64), (3, 5, 7, 40), (64, 300, 256)]:
        for axis in [*range(len(shape) - 1), *range(-len(shape), -1)]:
            dy, y, dy_host, y_host = gradient_inputs(rng, op, shape, dtype, axis)
            expected = gradient_reference(op, dy_host, y_host, axis)
            check_gradient(function(dy, y, axis=axis).get(), expected, NUMPY_DTYPES[dtype])
            assert function(dy, y, axis=axis, out=y) is y
            check_gradient(y.get(), expected, NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_backward_target_shape(op, rng):
    """(64, 4096, 256) float16 over axis 1 with the default planner (shared by
    a cluster on sm_90 and newer, else read twice), and half its cols
    (cached)."""
    for shape, cached_alone in [((64, 4096, 256), False), ((64, 2048, 256), True)]:
        dy, y, dy_host, y_host = gradient_inputs(rng, op, shape, "f16", 1)
        target = Target.live(dy.device.id)
        p = plan(op, *shape, "f16", target)
        assert p is not None and (p.spec.cluster_size > 1) == has_clusters(target)
        assert p.spec.cached == (cached_alone or has_clusters(target))
        check_gradient(run_backward_checked(op, dy, y, 1).get(),
                       gradient_reference(op, dy_host, y_host, 1), numpy.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_backward_misaligned_input(dtype, rng, axis_everywhere):
    """dy one element off the 16-byte grid, y on it: packs narrow for both."""
    import cupy

    shape = (4, 300, 64)
    for op in BACKWARD_OPS:
        _, y, dy_host, y_host = gradient_inputs(rng, op, shape, dtype, 1)
        padded = cupy.empty(math.prod(shape) + 1, NUMPY_DTYPES[dtype])
        dy = padded[1:].reshape(shape)
        dy[...] = cupy.asarray(dy_host)
        assert dy.flags.c_contiguous and dy.data.ptr % 16
        check_gradient(run_backward_checked(op, dy, y, 1).get(),
                       gradient_reference(op, dy_host, y_host, 1), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
def test_backward_not_applicable_returns_none(rng, axis_everywhere):
    import cupy

    dy, y, _, _ = gradient_inputs(rng, "softmax_backward", (4, 6, 64), "f32", 1)
    assert sa.run_backward("softmax_backward", dy, y, 2, None) is None            # last axis
    strided = y.transpose(1, 0, 2).copy().transpose(1, 0, 2)
    assert sa.run_backward("softmax_backward", dy, strided, 1, None) is None      # y not C-contiguous
    big = cupy.zeros(4 * 6 * 64 + 64, numpy.float32)
    overlapping_y = big[:4 * 6 * 64].reshape(4, 6, 64)
    overlapping_out = big[64:].reshape(4, 6, 64)
    poison = overlapping_out.copy()
    assert sa.run_backward("softmax_backward", dy, overlapping_y, 1, overlapping_out) is None
    assert bool((overlapping_out == poison).all())                                # nothing written


# -- GPU: thread-block clusters -------------------------------------------------------

@dataclass
class ClusterRun:
    size: int
    launched: list      # the spec of every kernel the axis path launched


@pytest.fixture(params=CLUSTER_SIZES)
def cluster(request, monkeypatch, axis_everywhere):
    """Every tile shared by a cluster of request.param blocks (sm_90 and newer),
    each launch of the axis path recorded."""
    import cupy

    target = Target.live(cupy.cuda.runtime.getDevice())
    if not has_clusters(target):
        pytest.skip(f"thread-block clusters need sm_90 or newer, not {target.facts.arch}")
    force_clusters(monkeypatch, request.param)
    run = ClusterRun(request.param, [])
    live_function = sa.live_function

    def recorded_function(spec, device_id, dynamic_smem=0):
        function = live_function(spec, device_id, dynamic_smem)

        def launch(*args, **kwargs):
            run.launched.append(spec)
            return function(*args, **kwargs)
        return launch

    monkeypatch.setattr(sa, "live_function", recorded_function)
    return run


def assert_cluster_kernels_ran(run: ClusterRun):
    assert run.launched and {spec.cluster_size for spec in run.launched} == {run.size}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_cluster_forward(op, dtype, cluster, rng):
    check_outputs(op, dtype, rng, CLUSTER_CASES)
    check_nan_and_inf_slices(op, dtype, rng)
    assert_cluster_kernels_ran(cluster)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_cluster_backward(op, dtype, cluster, rng):
    check_backward_outputs(op, dtype, rng, CLUSTER_CASES)
    assert_cluster_kernels_ran(cluster)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ALL_OPS)
def test_cluster_walks_more_tiles_than_clusters(op, cluster, rng):
    """One cluster for all the tiles of a (2, 2000, 96) float32 array: its
    blocks walk them together, the published totals alternating buffers."""
    shape, axis = (2, 2000, 96), 1
    if op in OPS:
        x, exact = random_input(rng, shape, numpy.float32)
        inputs, expected, check = (x,), reference(op, exact, axis), assert_close
    else:
        dy, y, dy_host, y_host = gradient_inputs(rng, op, shape, "f32", axis)
        inputs, expected, check = (dy, y), gradient_reference(op, dy_host, y_host, axis), check_gradient
    device_id = inputs[0].device.id
    outer, cols, inner = axis_view(shape, axis)
    p = plan(op, outer, cols, inner, "f32", Target.live(device_id))
    tiles = outer * math.ceil(inner // p.spec.pack_size / p.spec.block_x)
    assert p.spec.cluster_size == cluster.size and tiles >= 4
    out = poisoned(shape, numpy.float32)
    function = sa.live_function(p.spec, device_id, p.smem_bytes)
    function((cluster.size, 1, 1), p.block,
             (*inputs, out, numpy.int64(outer), numpy.int64(cols), numpy.int64(inner)), shared_mem=p.smem_bytes)
    check(out.get(), expected, numpy.float32)
    assert_cluster_kernels_ran(cluster)
