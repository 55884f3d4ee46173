"""CPU tests of the LayerNorm / RMSNorm planner, names, rendering and NVRTC compiles."""
from __future__ import annotations

import concurrent.futures
from dataclasses import replace

import pytest

from cupyops import dtypes, jit
from cupyops.device import ARCH_PROFILES
from cupyops.launch import Target
from cupyops.ops import norm, norm_backward, norm_forward, norm_paths, norm_spec
from cupyops.profile import profile_for

H100 = Target.profile("h100")
TUNE = profile_for(H100.facts)   # the tuning values the H100 plans read
ROWS = 49152
SWEEP_COLS = (32, 64, 128, 256, 512, 1000, 1024, 1536, 2048, 3000, 4096, 8192, 12345, 16384, 20000, 32768,
              65536)
SWEEP_DTYPES = ("f16", "bf16", "f32")


# -- OneFlow's warp ladder -------------------------------------------------------

@pytest.mark.parametrize("cols, pack, expected", [
    # pack 1: groups of 4 .. 32 lanes, then (max, min) rungs at width 32
    (1, 1, (1, 0, 4, 2)), (4, 1, (1, 0, 4, 2)), (5, 1, (1, 0, 8, 2)), (17, 1, (1, 0, 32, 2)),
    (32, 1, (1, 0, 32, 2)), (33, 1, (2, 1, 32, 1)), (64, 1, (2, 1, 32, 1)), (65, 1, (4, 2, 32, 1)),
    (129, 1, (8, 4, 32, 1)), (257, 1, (12, 8, 32, 1)), (385, 1, (16, 12, 32, 1)),
    (1023, 1, (32, 28, 32, 1)),
    # pack 2: no (2, 1) rung
    (2, 2, (2, 0, 4, 2)), (8, 2, (2, 0, 4, 2)), (10, 2, (2, 0, 8, 2)), (64, 2, (2, 0, 32, 2)),
    (66, 2, (4, 2, 32, 1)), (128, 2, (4, 2, 32, 1)), (1000, 2, (32, 28, 32, 1)), (1024, 2, (32, 28, 32, 1)),
])
def test_oneflow_warp_ladder(cols, pack, expected):
    assert norm_paths.oneflow_warp_ladder(cols, 4, pack) == expected


def test_oneflow_ladder_two_rows_only_for_even_rows():
    assert norm_paths.oneflow_warp_ladder(16, 7, 1)[3] == 1
    assert norm_paths.oneflow_warp_ladder(16, 8, 1)[3] == 2
    assert norm_paths.oneflow_warp_ladder(1025, 8, 1) is None


@pytest.mark.parametrize("op", norm.FORWARD_OPS)
def test_oneflow_paths(op):
    warp = norm.plan(op, ROWS, 1024, "f16", "oneflow", H100).spec
    assert (warp.impl, warp.pack_size, warp.cols_per_thread, warp.padding) == ("warp", 2, 32, False)
    assert warp.min_cols_per_thread == 32          # no padding: min = max
    padded = norm.plan(op, ROWS, 1000, "f16", "oneflow", H100).spec
    assert (padded.cols_per_thread, padded.min_cols_per_thread, padded.padding) == (32, 28, True)
    odd = norm.plan(op, ROWS, 999, "f16", "oneflow", H100).spec
    assert odd.pack_size == 1
    smem = norm.plan(op, ROWS, 1025, "f16", "oneflow", H100)
    assert smem.spec.impl == "block_smem" and smem.spec.pack_size == 1
    assert smem.main.smem_bytes == 1025 * 4         # cached in float, OneFlow's layout size
    assert norm.plan(op, ROWS, 4096, "f32", "oneflow", H100).spec.pack_size == 4
    assert norm.plan(op, ROWS, 4098, "f32", "oneflow", H100).spec.pack_size == 2
    assert norm.plan(op, ROWS, 64, "f64", "oneflow", H100).spec.impl == "block_uncached"
    huge = norm.plan(op, 64, 300_000, "f32", "oneflow", H100).spec
    assert (huge.impl, huge.block_size) == ("block_uncached", 1024)


def test_oneflow_layer_norm_opts_in_and_rms_norm_does_not():
    # 16384 float columns: 64 KB of shared memory, above the 48 KB default
    assert norm.plan("layer_norm", ROWS, 16384, "f16", "oneflow", H100).spec.impl == "block_smem"
    assert norm.plan("rms_norm", ROWS, 16384, "f16", "oneflow", H100).spec.impl == "block_uncached"


def test_oneflow_layer_norm_block_size_with_few_rows():
    many = norm.plan("layer_norm", ROWS, 3000, "f16", "oneflow", H100).spec.block_size
    few = norm.plan("layer_norm", 8, 3000, "f16", "oneflow", H100).spec.block_size
    assert many == 128 and few == 1024


def test_oneflow_warp_grid_uses_occupancy():
    chosen = norm.plan("layer_norm", ROWS, 1024, "f16", "oneflow", H100)
    assert chosen.main.block == (32, 4, 1)
    assert chosen.main.grid == (ROWS // 4, 1, 1)
    small = norm.plan("layer_norm", 10, 16, "f16", "oneflow", H100)
    assert small.main.block == (8, 16, 1) and small.main.grid == (1, 1, 1)


def test_auto_forward_warp_blocks_hold_two_warps():
    """auto's forward warp path with groups of a whole warp launches 64-thread
    blocks, compiled for 18 of them an SM (launch bounds 64, 18: 56 registers
    a thread, without weight and bias to hold); narrower groups, OneFlow's
    and the backward's keep 128."""
    for op, cols, dtype in (("layer_norm", 768, "f32"), ("rms_norm", 256, "f16"), ("layer_norm", 128, "f32")):
        launch = norm.plan(op, ROWS, cols, dtype, "auto", H100, weight=False, bias=False).main
        spec = launch.spec
        assert spec.impl == "warp" and spec.threads_per_block == 64 and spec.name.endswith("_b64")
        assert launch.block == (32, 2, 1)
        assert launch.grid == (-(-ROWS // (2 * spec.rows_per_access)), 1, 1)
        assert spec.min_blocks_per_sm == 18
        assert "__launch_bounds__(64, 18)" in jit.render(spec)
    narrow = norm.plan("rms_norm", ROWS, 32, "f32", "auto", H100).main
    assert narrow.spec.thread_group_width == 8 and narrow.block == (8, 16, 1)
    assert "_b" not in narrow.spec.name.split("nopad")[1]
    oneflow = norm.plan("layer_norm", ROWS, 1024, "f32", "oneflow", H100).main
    assert oneflow.block == (32, 4, 1) and "_b" not in oneflow.spec.name.split("nopad")[1]
    backward = norm.plan("layer_norm_backward", ROWS, 1024, "f32", "oneflow", H100).main
    assert backward.spec.impl == "warp" and backward.block == (32, 4, 1)


def test_oneflow_backward_reduces_params_apart():
    chosen = norm.plan("layer_norm_backward", ROWS, 1024, "f16", "oneflow", H100)
    assert chosen.main.spec.impl == "warp" and not chosen.main.spec.fuse_param_grad
    assert chosen.param_grad.spec.name == "layer_norm_param_grad_f16_f32"
    assert chosen.num_parts == chosen.param_grad.grid[1]
    smem = norm.plan("layer_norm_backward", ROWS, 2048, "f16", "oneflow", H100)
    assert smem.main.spec.impl == "block_smem" and smem.main.smem_bytes == 2 * 2048 * 4


# -- auto -----------------------------------------------------------------------

def test_auto_uses_16_byte_packs_and_falls_back_on_alignment():
    assert norm.plan("layer_norm", ROWS, 1024, "f16", "auto", H100).spec.pack_size == 8
    assert norm.plan("layer_norm", ROWS, 1024, "f32", "auto", H100).spec.pack_size == 4
    # the warp path where the operands' phases differ (else the rows peel: 16-byte packs)
    assert norm.plan("layer_norm", ROWS, 1024, "f16", "auto", H100, align=4, same_phase=False).spec.pack_size == 2
    assert norm.plan("layer_norm", ROWS, 1001, "f16", "auto", H100, same_phase=False).spec.pack_size == 1
    assert norm.plan("layer_norm", ROWS, 1001, "f16", "auto", H100).spec.pack_size == 8


@pytest.mark.parametrize("rows", [7, 8])
def test_auto_two_rows_per_access_for_any_row_count(rows):
    spec = norm.plan("rms_norm", rows, 16, "f16", "auto", H100).spec
    assert (spec.impl, spec.rows_per_access, spec.thread_group_width) == ("warp", 2, 2)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_auto_float32_rows_from_1024_cols_take_register_blocks(op):
    """AUTO_REGS_FROM_COLS: float32 rows of 1024 cols skip the warp path;
    AUTO_BLOCK_REGS_LADDER: 64 threads while a thread holds at most 5 packs."""
    assert norm.plan(op, ROWS, 1000, "f32", "auto", H100).spec.impl == "warp"
    for cols, block_size, packs in ((1024, 64, 4), (1280, 64, 5), (1536, 128, 3), (2048, 128, 4)):
        spec = norm.plan(op, ROWS, cols, "f32", "auto", H100).spec
        assert (spec.impl, spec.block_size, spec.packs_per_thread) == ("block_regs", block_size, packs)


def test_auto_paths():
    assert norm.plan("layer_norm", ROWS, 1024, "f16", "auto", H100).spec.impl == "warp"
    assert norm.plan("layer_norm", ROWS, 2048, "f16", "auto", H100).spec.impl == "block_regs"
    assert norm.plan("layer_norm", ROWS, 32768, "f16", "auto", H100).spec.impl == "block_async"
    assert norm.plan("layer_norm", ROWS, 32768, "f32", "auto", H100).spec.impl == "block_regs"
    big = norm.plan("layer_norm", 64, 65536, "f16", "auto", H100)
    assert (big.spec.impl, big.spec.tail_packs, big.main.smem_bytes) == ("block_async", 8, 65536 * 2 - 512 * 8 * 16)
    # off the 16-byte grid: no cp.async
    assert norm.plan("layer_norm", 64, 65536, "f16", "auto", H100, align=8).spec.impl == "block_smem"
    assert norm.plan("layer_norm", 64, 300_000, "f32", "auto", H100).spec.impl == "block_uncached"


@pytest.mark.parametrize("profile", ["h100", "h200", "a100"])
def test_auto_async_rows(profile):
    """Rows cached by cp.async: from AUTO_ASYNC_FIRST's cols, its first rung
    that holds the row ("whole": all of it in the register tail; "largest":
    the largest tail); where the register paths hold no row, the first rung
    of AUTO_ASYNC_LADDER with its largest tail; a block a row, shared memory
    for the packs outside the tail (of x and the residual)."""
    target = Target.profile(profile)

    def async_plan(op, cols, dtype, **flags):
        launch = norm.plan(op, ROWS, cols, dtype, "auto", target, **flags).main
        spec = launch.spec
        assert launch.grid == (ROWS, 1, 1) and launch.block == (spec.block_size, 1, 1)
        return spec.impl, spec.block_size, spec.tail_packs, launch.smem_bytes

    # whole rows in registers: 256 x 8 packs, then 512 x 8 (6 packs at 24576 cols)
    for op, dtype in (("layer_norm", "f16"), ("layer_norm", "bf16")):
        assert async_plan(op, 16384, dtype) == ("block_async", 256, 8, 0)
        assert async_plan(op, 24576, dtype) == ("block_async", 512, 6, 0)
        assert async_plan(op, 32768, dtype) == ("block_async", 512, 8, 0)
        # 2500 packs: no whole rows; 12288 cols: below AUTO_ASYNC_FIRST
        for cols in (12288, 20000):
            assert norm.plan(op, ROWS, cols, dtype, "auto", target).spec.impl == "block_regs"
        # RMSNorm: the largest tail, 512 x 4 of the 2500 packs, 452 in shared memory
        assert async_plan("rms_norm", 20000, dtype) == ("block_async", 512, 4, 452 * 16)
        # the largest tail up to 8 packs that does not spill (float16: 7 on sm_90)
        impl, block_size, tail_packs, smem = async_plan("rms_norm", 32768, dtype)
        assert (impl, block_size) == ("block_async", 512) and smem == (4096 - 512 * tail_packs) * 16
        spilling = [norm_spec.NormSpec(op="rms_norm", impl="block_async", dtype=dtype, pack_size=8, block_size=512,
                                  tail_packs=tail, weight=True) for tail in range(tail_packs + 1, 9)]
        assert all(target.resources(spec)["local_bytes"] for spec in spilling)
        assert norm.plan("rms_norm", ROWS, 16384, dtype, "auto", target).spec.impl != "block_async"
    assert async_plan("layer_norm", 8192, "f32") == ("block_async", 512, 4, 0)
    assert async_plan("layer_norm", 16384, "f32") == ("block_async", 512, 8, 0)
    assert norm.plan("layer_norm", ROWS, 4096, "f32", "auto", target).spec.impl == "block_regs"
    assert norm.plan("rms_norm", ROWS, 16384, "f32", "auto", target).spec.impl == "block_regs"
    # a register row that would spill (x and the residual held) takes another rung or path
    for cols in (16384, 32768):
        spec = norm.plan("layer_norm", ROWS, cols, "f16", "auto", target, residual=True).spec
        assert spec.impl == "block_regs" or (spec.impl, spec.tail_packs * spec.block_size * 8) == ("block_async", cols)
        assert not target.resources(spec)["local_bytes"], spec.name
    # rows no register path holds: the ladder, the tail's packs outside shared memory
    assert async_plan("layer_norm", 65536, "f16") == ("block_async", 512, 8, (8192 - 4096) * 16)
    assert async_plan("rms_norm", 65536, "f32") == ("block_async", 1024, 8, (16384 - 8192) * 16)
    impl, block_size, tail_packs, smem = async_plan("layer_norm", 65536, "f16", residual=True)
    assert impl == "block_async" and smem == 2 * (8192 - block_size * tail_packs) * 16
    assert smem <= target.facts.smem_per_block_optin


@pytest.mark.parametrize("op", norm.FORWARD_OPS)
def test_auto_peels_rows_off_the_16_byte_grid(op):
    """Odd cols: 16-byte packs between each row's peeled edges when every row
    operand has the same phase, weight and bias realigned in registers (no
    shared memory, a row a block); element by element otherwise."""
    f16 = norm.plan(op, ROWS, 12345, "f16", "auto", H100, align=2).main
    assert (f16.spec.impl, f16.spec.pack_size, f16.spec.peel) == ("block_regs", 8, True)
    f32 = norm.plan(op, ROWS, 12345, "f32", "auto", H100, align=4).main
    assert (f32.spec.impl, f32.spec.pack_size, f32.spec.peel) == ("block_regs", 4, True)
    for launch in (f16, f32):
        assert launch.smem_bytes == 0 and launch.grid[0] == min(ROWS, launch.grid[0])
    # 16-bit rows held as loaded, 256 x 6 packs (LayerNorm: AUTO_PACKED_RUNG_BYTES,
    # RMSNorm: AUTO_PEELED_PACKED_LADDER) and 57 single elements past them; float32
    # in float, 512 x 6 (7 packs a thread would hold every pack)
    assert (f16.spec.block_size, f16.spec.packs_per_thread, f16.spec.packed) == (256, 6, True)
    assert (f32.spec.block_size, f32.spec.packs_per_thread, f32.spec.packed) == (512, 6, False)
    for launch in (f16, f32):
        spec = launch.spec
        assert 0 < 12345 - spec.block_size * spec.packs_per_thread * spec.pack_size <= spec.block_size
        norm_spec.check_block_covers(spec, 12345)
        with pytest.raises(ValueError, match="too few packs"):
            norm_spec.check_block_covers(replace(spec, packs_per_thread=5), 12345)
    # LayerNorm 16-bit peeled rows take a packed rung below 128 threads
    # (AUTO_PEELED_PACKED_FROM_BLOCK) only where every row fills every pack:
    # 3595 cols 64 x 7 packs (448, the fewest a row has), 3590 cols (447) 128 x 4
    # in float; on the grid 64 x 7
    full = norm.plan(op, ROWS, 3595, "f16", "auto", H100, align=2).spec
    mid = norm.plan(op, ROWS, 3590, "f16", "auto", H100, align=2).spec
    assert (mid.block_size, mid.packs_per_thread, mid.peel) == (128, 4, True)
    assert mid.packed == (op == "rms_norm")
    on_grid = norm.plan(op, ROWS, 3584, "f16", "auto", H100).spec
    if op == "layer_norm":
        assert (full.block_size, full.packs_per_thread, full.packed, full.full_packs) == (64, 7, True, 7)
        assert (on_grid.block_size, on_grid.packs_per_thread, on_grid.packed) == (64, 7, True)
    else:
        assert (full.block_size, full.packs_per_thread, full.packed) == (128, 4, True)
    assert f16.spec.name.endswith("_peel_packed_full6_affine" if op == "layer_norm" else "_peel_packed_full6_weight")
    # 2049 cols: two warps of four packs a thread in float (AUTO_PEELED_SMALL_*)
    short = norm.plan(op, ROWS, 2049, "f16", "auto", H100, align=2).spec
    assert (short.block_size, short.packs_per_thread, short.peel, short.packed) == (64, 4, True, False)
    unpeeled = norm.plan(op, ROWS, 12345, "f16", "auto", H100, align=2, same_phase=False).spec
    assert (unpeeled.pack_size, unpeeled.peel) == (1, False)
    aligned = norm.plan(op, ROWS, 12352, "f16", "auto", H100).spec
    assert (aligned.pack_size, aligned.peel) == (8, False)
    assert not norm.plan(op, ROWS, 12345, "f16", "oneflow", H100, align=2).spec.peel


@pytest.mark.parametrize("op", norm.FORWARD_OPS)
def test_auto_peels_short_rows_before_the_warp_path(op):
    """Forward rows off the 16-byte grid from AUTO_PEELED_SMALL_MIN_COLS cols
    take the softmax's rule before the warp path: a peeled register block of
    one warp a row, two rows a block, while a thread holds at most four
    16-byte packs (and one single element past them), else two warps; in
    float, the packs every row fills unchecked. Shorter rows, operands at
    different phases, rows on the grid and the backward keep their paths."""
    flags = "_affine" if op == "layer_norm" else "_weight"
    f16 = norm.plan(op, ROWS, 1023, "f16", "auto", H100, align=2).main
    assert f16.spec.name == f"{op}_block_regs_f16_f32_p8_k4_b32x2_peel_full3{flags}"
    assert (f16.block, f16.grid, f16.smem_bytes) == ((32, 2, 1), (ROWS // 2, 1, 1), 0)
    assert f16.spec.min_blocks_per_sm * 64 >= norm_spec.MIN_RESIDENT_THREADS["forward"]
    # 1056 cols: 4 packs and an element a lane at the last head; 1057: two warps
    assert norm.plan(op, ROWS, 1055, "bf16", "auto", H100, align=2).spec.block_size == 32
    assert norm.plan(op, ROWS, 1057, "bf16", "auto", H100, align=2).spec.block_size == 64
    f32 = norm.plan(op, 9, 1023, "f32", "auto", H100, align=4, residual=True).main
    assert f32.spec.name == f"{op}_block_regs_f32_f32_p4_k4_b64_peel_full3{flags}_residual"
    assert (f32.block, f32.grid) == ((64, 1, 1), (9, 1, 1))
    odd = norm.plan(op, 9, 255, "f64", "auto", H100, align=8).main
    assert odd.spec.name.startswith(f"{op}_block_regs_f64_f64_p2_k4_b32x2_peel") and odd.grid == (5, 1, 1)
    assert norm.plan(op, ROWS, 253, "f16", "auto", H100, align=2).spec.impl == "warp"
    assert norm.plan(op, ROWS, 1023, "f16", "auto", H100, align=2, same_phase=False).spec.impl == "warp"
    assert norm.plan(op, ROWS, 1016, "f16", "auto", H100).spec.impl == "warp"
    assert norm.plan(op, ROWS, 1023, "f16", "oneflow", H100, align=2).spec.impl == "warp"
    assert norm.plan(op + "_backward", ROWS, 1023, "f16", "auto", H100, align=2).spec.rows_per_block == 1


def test_auto_fits_block_sizes_to_peeled_layer_norm_16_bit_rows():
    """LayerNorm 16-bit peeled rows take AUTO_PEELED_FULL_PACKS' packs a
    thread as loaded (6, then 7, then 5) at the fewest whole warps, from 64
    (fitted_block_size), that hold the row with one element a thread past the
    packs, where every row fills them all; elsewhere the ladder. RMSNorm and
    float32 keep their ladders. Blocks not a power of two are compiled for
    as many resident threads as the others (min_blocks_per_sm rounds up)."""
    cases = {16385: (288, 7), 20001: (416, 6), 3891: (96, 5), 2567: (64, 5), 12345: (256, 6), 32767: (576, 7)}
    for cols, (block_size, packs) in cases.items():
        for dtype in ("f16", "bf16"):
            spec = norm.plan("layer_norm", ROWS, cols, dtype, "auto", H100, align=2).spec
            assert (spec.block_size, spec.packs_per_thread, spec.packed, spec.full_packs) == (
                block_size, packs, True, packs), spec.name
            assert spec.name.endswith(f"_k{packs}_b{block_size}_peel_packed_full{packs}_affine"), spec.name
            assert spec.min_blocks_per_sm * block_size >= norm_spec.MIN_RESIDENT_THREADS["forward"]
            assert (spec.min_blocks_per_sm - 1) * block_size < norm_spec.MIN_RESIDENT_THREADS["forward"]
    assert norm_forward.fitted_block_size(16385, 8, 7) == 288 and norm_forward.fitted_block_size(100, 8, 7) == 64
    # 16385 cols at 6 packs: 352 threads would hold 2112 packs, more than the 2047 of a row at its last head
    assert norm_spec.full_packs_per_thread(16385, norm_forward.fitted_block_size(16385, 8, 6), 8, True) == 5
    # no fitted block fills every pack: the ladder
    assert norm.plan("layer_norm", ROWS, 5001, "f16", "auto", H100, align=2).spec.block_size == 128
    assert norm.plan("rms_norm", ROWS, 16385, "f16", "auto", H100, align=2).spec.block_size == 256
    assert norm.plan("layer_norm", ROWS, 16385, "f32", "auto", H100, align=4).spec.block_size == 512


@pytest.mark.parametrize("op", norm.FORWARD_OPS)
def test_auto_peeled_rows_leave_full_packs_unchecked(op):
    """Peeled forward rows leave unchecked (full_packs) the packs of each
    thread that every row fills at every phase (the fewest packs a row
    holds, at its last head, pack_size - 1): all of them from block_size x
    packs_per_thread x pack_size + pack_size - 1 cols, one fewer a col
    shorter; rows held as loaded only when all are full; rows on the grid
    check every pack. check_block_covers refuses a hand-built spec that
    leaves more unchecked than the rows fill."""
    for dtype, align, pack in (("f16", 2, 8), ("bf16", 2, 8), ("f32", 4, 4)):
        spec = norm.plan(op, ROWS, 12345, dtype, "auto", H100, align=align).spec
        fewest = spec.block_size * spec.packs_per_thread * pack + pack - 1
        assert spec.full_packs == spec.packs_per_thread and fewest <= 12345, spec.name
        edge = norm.plan(op, ROWS, fewest, dtype, "auto", H100, align=align).spec
        assert edge.full_packs == edge.packs_per_thread and edge.name.count("_full") == 1, edge.name
        assert norm_spec.full_packs_per_thread(fewest, edge.block_size, pack, True) == edge.packs_per_thread
        assert norm_spec.full_packs_per_thread(fewest - 1, edge.block_size, pack, True) == edge.packs_per_thread - 1
        norm_spec.check_block_covers(edge, fewest)
        with pytest.raises(ValueError, match="unchecked"):
            norm_spec.check_block_covers(edge, fewest - 1)
        norm_spec.check_block_covers(replace(edge, full_packs=edge.packs_per_thread - 1), fewest - 1)
        with pytest.raises(ValueError, match="unchecked"):
            longest = edge.block_size * (edge.packs_per_thread * pack + 1)   # the most cols it covers
            norm_spec.check_block_covers(replace(edge, full_packs=edge.packs_per_thread + 1), longest)
    # 3590 cols at 128 x 4: 447 packs at the last head, 3 full a thread
    few = norm.plan(op, ROWS, 3590, "f16", "auto", H100, align=2).spec
    assert (few.block_size, few.packs_per_thread) == (128, 4)
    assert few.full_packs == (0 if few.packed else 3), few.name
    assert few.name.endswith(("_peel_packed_weight", "_peel_full3_affine")), few.name
    f32 = norm.plan(op, ROWS, 20001, "f32", "auto", H100, align=4).spec
    assert (f32.block_size, f32.packs_per_thread, f32.full_packs) == (1024, 5, 4)
    assert norm.plan(op, ROWS, 12288, "f16", "auto", H100, residual=True).spec.full_packs == 0
    assert norm.plan(op, ROWS, 10000, "f16", "auto", H100).spec.full_packs == 0


@pytest.mark.parametrize("cols, block_size, packs_per_thread, packed", [
    (2048, 64, 4, False), (8192, 256, 4, False), (12288, 256, 6, True), (16384, 512, 4, False),
    (24576, 512, 6, True), (32768, 1024, 4, False)])
def test_auto_layer_norm_16_bit_rows_held_as_loaded(cols, block_size, packs_per_thread, packed):
    """16-bit LayerNorm rows: four packs a thread in float, else up to seven
    held as loaded at the same block size (AUTO_PACKED_RUNG_BYTES) before
    doubling the block. With a residual: without one, rows from 16384 cols
    (float32 8192) are cached by cp.async (test_auto_async_rows)."""
    for dtype in ("f16", "bf16"):
        spec = norm.plan("layer_norm", ROWS, cols, dtype, "auto", H100, residual=True).spec
        assert (spec.impl, spec.block_size, spec.packs_per_thread, spec.packed) == (
            "block_regs", block_size, packs_per_thread, packed), spec.name
    f32 = norm.plan("layer_norm", ROWS, 12288, "f32", "auto", H100, residual=True).spec
    rms = norm.plan("rms_norm", ROWS, 12288, "f16", "auto", H100).spec
    assert not f32.packed and not rms.packed


@pytest.mark.parametrize("pack_size", [4, 8])
@pytest.mark.parametrize("block_size", [64, 256, 512, 1024])
def test_peeled_rows_leave_at_most_a_single_element_a_thread(block_size, pack_size):
    """Peeled register blocks hold the fewest packs a thread that leave at
    most block_size single elements outside the packs, whatever the row's
    head (BlockRowColumns); unpeeled ones hold every pack of the row."""
    for cols in list(range(1, 3 * block_size * pack_size, 7)) + [12345, 12543, 32767]:
        peeled = norm_spec.block_packs_per_thread(cols, block_size, pack_size, True)
        for head in range(pack_size):
            packs = min(max(0, cols - head) // pack_size, block_size * peeled)
            assert cols - packs * pack_size <= block_size, (cols, head)
        if peeled > 1:
            fewer = block_size * (peeled - 1) * pack_size
            assert cols - fewer > block_size, cols
        whole = norm_spec.block_packs_per_thread(cols, block_size, pack_size, False)
        assert whole * block_size >= cols // pack_size and (whole - 1) * block_size < max(1, cols // pack_size)


def test_auto_peeled_backward_holds_as_many_packs_as_aligned_rows():
    """LayerNorm f16 backward, 12345 cols: 512 x 3 packs as at 12288 cols (its
    partials, 96 KiB, leave two blocks an SM), the 57 columns past the packs
    single elements; the weight read from its phase copies in global memory,
    a copy in shared memory not fitting beside the partials at two blocks an
    SM. RMSNorm (half the partials) copies it to shared memory."""
    backward = norm.plan("layer_norm_backward", ROWS, 12345, "f16", "auto", H100, align=2).main
    aligned = norm.plan("layer_norm_backward", ROWS, 12288, "f16", "auto", H100).main
    assert (backward.spec.block_size, backward.spec.packs_per_thread, backward.spec.peel) == (512, 3, True)
    assert (aligned.spec.block_size, aligned.spec.packs_per_thread, aligned.spec.smem_partials) == (512, 3, True)
    assert backward.smem_bytes == aligned.smem_bytes == 2 * 3 * 512 * 8 * 4
    chosen = norm.plan("layer_norm_backward", ROWS, 12345, "f16", "auto", H100, align=2)
    assert backward.spec.weight_source == "phase_copies"
    assert chosen.launches[0] is chosen.weight_phases and chosen.weight_phases.grid[1] == 8
    rms = norm.plan("rms_norm_backward", ROWS, 12345, "f16", "auto", H100, align=2)
    assert rms.spec.weight_source == "shared_copy" and rms.weight_phases is None
    assert rms.main.smem_bytes == 3 * 512 * 8 * 4 + norm_backward.weight_copy_bytes(rms.spec, 12345)


def test_float32_layer_norm_backward_reads_phase_copies_from_1024_threads():
    """LayerNorm f32 peeled rows at 1024 threads read the weight's phase
    copies although its shared copy fits (AUTO_GRAD_PHASE_COPIES_FROM_BLOCK);
    at 512 threads the shared copy."""
    wide = norm.plan("layer_norm_backward", ROWS, 12345, "f32", "auto", H100, align=4)
    assert (wide.spec.block_size, wide.spec.packs_per_thread, wide.spec.weight_source) == (1024, 3, "phase_copies")
    assert wide.main.smem_bytes == 2 * 3 * 1024 * 4 * 4
    assert wide.weight_phases.grid[1] == 4 and wide.launches[:2] == (wide.weight_phases, wide.main)
    copied = replace(wide.spec, weight_source="shared_copy")
    assert H100.max_active_blocks(copied, 1024, norm_backward.grad_smem_bytes(copied, 12345), True) == 1
    narrow = norm.plan("layer_norm_backward", ROWS, 4097, "f32", "auto", H100, align=4)
    assert (narrow.spec.block_size, narrow.spec.weight_source) == (512, "shared_copy")
    assert narrow.weight_phases is None


def test_launch_refuses_blocks_that_miss_columns():
    """Peeled register blocks (forward and backward) take up to block_size
    single elements past their packs; every other register block must hold
    every pack of the row."""
    backward = norm_spec.NormSpec(op="layer_norm_grad", impl="block_regs", dtype="f16", pack_size=8, block_size=512,
                             packs_per_thread=2, peel=True, fuse_param_grad=True)
    with pytest.raises(ValueError, match="too few packs"):
        norm_spec.check_block_covers(backward, 12345)
    norm_spec.check_block_covers(replace(backward, packs_per_thread=3), 12345)
    forward = norm_spec.NormSpec(op="layer_norm", impl="block_regs", dtype="f16", pack_size=8, block_size=256,
                            packs_per_thread=5, peel=True, packed=True)
    with pytest.raises(ValueError, match="too few packs"):
        norm_spec.check_block_covers(forward, 12345)
    norm_spec.check_block_covers(replace(forward, packs_per_thread=6), 12345)      # 57 single elements
    norm_spec.check_block_covers(replace(forward, packs_per_thread=6), 12544)      # 256 (a head of 0 to 7)
    with pytest.raises(ValueError, match="too few packs"):
        norm_spec.check_block_covers(replace(forward, packs_per_thread=6), 12545)
    on_grid = replace(forward, packs_per_thread=6, peel=False)
    norm_spec.check_block_covers(on_grid, 12288)
    with pytest.raises(ValueError, match="too few packs"):
        norm_spec.check_block_covers(on_grid, 12296)


def test_auto_backward_fuses_param_grads_in_registers():
    chosen = norm.plan("layer_norm_backward", ROWS, 512, "f16", "auto", H100)
    assert chosen.main.spec.impl == "warp" and chosen.main.spec.fuse_param_grad
    assert chosen.param_grad is None and chosen.num_parts == chosen.main.grid[0]
    assert chosen.main.smem_bytes == 2 * 4 * 4 * 512        # 2 sums x float x 4 groups x cols
    regs = norm.plan("layer_norm_backward", ROWS, 4096, "f16", "auto", H100)
    assert regs.main.spec.impl == "block_regs" and regs.main.spec.fuse_param_grad
    # one wave of resident blocks, one workspace row each
    active = H100.max_active_blocks(regs.main.spec, regs.main.spec.block_size, 0, False)
    assert regs.num_parts == regs.main.grid[0] == active * H100.facts.sm_count
    # rows off the 16-byte grid peeled, on a grid that is a multiple of their
    # phase period (16 bytes of elements); shared memory holds partials alone
    for cols, dtype, pack in ((4097, "f16", 8), (12345, "f16", 8), (12345, "f32", 4)):
        peeled = norm.plan("layer_norm_backward", ROWS, cols, dtype, "auto", H100, align=2).main
        assert (peeled.spec.pack_size, peeled.spec.peel, peeled.spec.fuse_param_grad) == (pack, True, True)
        assert peeled.grid[0] % pack == 0
        assert peeled.smem_bytes == norm_backward.grad_smem_bytes(peeled.spec, cols)
        not_peeled = norm.plan("layer_norm_backward", ROWS, cols, dtype, "auto", H100, align=2, same_phase=False)
        assert not not_peeled.main.spec.peel
    unfused = norm.plan("layer_norm_backward", ROWS, 65536, "f16", "auto", H100)
    assert not unfused.main.spec.fuse_param_grad and unfused.param_grad is not None
    dx_only = norm.plan("rms_norm_backward", ROWS, 512, "f16", "auto", H100, param_grad=False)
    assert dx_only.finish is None and not dx_only.main.spec.fuse_param_grad


@pytest.mark.parametrize("policy", ["auto", "oneflow"])
def test_one_finish_launch_for_every_param_grad(policy):
    for family, grads in (("layer_norm", 2), ("rms_norm", 1)):
        chosen = norm.plan(f"{family}_backward", ROWS, 3000, "f16", policy, H100)
        assert chosen.finish.grid == (-(-3000 // 32), grads, 1)
        source = jit.render(chosen.finish.spec)
        assert "blockIdx.y == 1" in source and "dbias" in source


@pytest.mark.parametrize("policy", ["auto", "oneflow"])
@pytest.mark.parametrize("op", norm_spec.BACKWARD_OPS)
def test_backward_writes_partials_only_when_wanted(op, policy):
    """Without dweight / dbias no workspace is allocated: the plan must then
    launch neither a fused kernel nor the column reduction (they would write
    through a null pointer), and _check_grad_plan says so before any launch."""
    for rows in (1, 7, ROWS):
        for cols in (1, 3, 300, 512, 1024, 4096, 20000, 65536):
            for dtype in ("f16", "f32", "f64"):
                for weight in (False, True):
                    dx_only = norm.plan(op, rows, cols, dtype, policy, H100, weight=weight, param_grad=False)
                    assert not dx_only.main.spec.fuse_param_grad
                    assert dx_only.param_grad is None and dx_only.finish is None
                    assert dx_only.launches == (dx_only.main,)
                    norm._check_grad_plan(dx_only, False)
                    full = norm.plan(op, rows, cols, dtype, policy, H100, weight=weight, param_grad=True)
                    assert full.main.spec.fuse_param_grad or full.param_grad is not None
                    assert full.finish is not None and full.num_parts >= 1
                    norm._check_grad_plan(full, True)
                    with pytest.raises(AssertionError):
                        norm._check_grad_plan(full, False)
                    with pytest.raises(AssertionError):
                        norm._check_grad_plan(dx_only, True)


def test_plan_flags_are_keyword_only():
    """plan(..., align, weight, param_grad) by position once put param_grad in `bias`."""
    with pytest.raises(TypeError):
        norm.plan("layer_norm_backward", ROWS, 300, "f32", "auto", H100, 16, False, False)


# -- names and rendering ----------------------------------------------------------

def test_auto_smem_first_for_rms_norm_bf16_long_rows():
    for cols in (16384, 19992):
        cached = norm.plan("rms_norm", ROWS, cols, "bf16", "auto", H100).spec
        assert (cached.impl, cached.block_size, cached.packed_cache) == ("block_smem", 512, True)
        assert norm.plan("rms_norm", ROWS, cols, "f16", "auto", H100).spec.impl == "block_regs"
    # from 20000 cols rows cached by cp.async come first
    for cols in (20000, 32768, 65536):
        assert norm.plan("rms_norm", ROWS, cols, "bf16", "auto", H100).spec.impl == "block_async"
    assert norm.plan("rms_norm", ROWS, 8192, "bf16", "auto", H100).spec.impl == "block_regs"
    # rows off the 16-byte grid keep the peeled register path
    assert norm.plan("rms_norm", ROWS, 16385, "bf16", "auto", H100, align=2).spec.peel


def test_auto_register_block_before_warp_for_rms_norm_16_bit_1024_with_a_residual():
    """AUTO_RESIDUAL_REGS_FROM_COLS: with a residual, RMSNorm 16-bit rows of
    1024 cols take a register block of 64 x 2 packs; without one, the warp path."""
    for dtype in ("f16", "bf16"):
        spec = norm.plan("rms_norm", ROWS, 1024, dtype, "auto", H100, residual=True).spec
        assert (spec.impl, spec.block_size, spec.packs_per_thread) == ("block_regs", 64, 2)
        assert norm.plan("rms_norm", ROWS, 1024, dtype, "auto", H100).spec.impl == "warp"
        assert norm.plan("rms_norm", ROWS, 1000, dtype, "auto", H100, residual=True).spec.impl == "warp"
        assert norm.plan("layer_norm", ROWS, 1024, dtype, "auto", H100, residual=True).spec.impl == "warp"
        # no 16-byte pack: the warp path
        assert norm.plan("rms_norm", ROWS, 1024, dtype, "auto", H100, align=2, same_phase=False,
                         residual=True).spec.impl == "warp"


HELD_AFFINE_COLS = (32, 64, 96, 200, 256, 384, 512, 640, 768, 1000, 1024)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("op", norm.FORWARD_OPS)
def test_auto_forward_warp_lanes_hold_weight_and_bias(op, dtype):
    """AUTO_HELD_AFFINE_*: auto's forward warp launches with a weight or
    bias, no residual and at least AUTO_HELD_AFFINE_FROM_COLS cols hold them
    under the first launch bounds without local memory: the kernel's own,
    then AUTO_HELD_AFFINE_RESIDENT_THREADS while resident threads x a lane's
    bytes of row reach AUTO_HELD_AFFINE_MIN_BYTES_IN_FLIGHT; else (and
    without weight and bias, with a residual, under OneFlow's policy) they
    read them at each store, under the kernel's own bounds."""
    itemsize = dtypes.BY_SHORT[dtype].itemsize
    for cols in HELD_AFFINE_COLS:
        launch = norm.plan(op, ROWS, cols, dtype, "auto", H100).main
        spec = launch.spec
        if spec.impl != "warp":
            continue
        unheld = replace(spec, hold_affine=False, min_blocks=0)
        lane_bytes = spec.cols_per_thread * spec.rows_per_access * itemsize
        bounds = [0] + [resident // spec.threads_per_block
                        for resident in TUNE.AUTO_HELD_AFFINE_RESIDENT_THREADS
                        if resident < unheld.resident_threads and resident * lane_bytes >= TUNE.AUTO_HELD_AFFINE_MIN_BYTES_IN_FLIGHT]
        fits = [bound for bound in bounds
                if not H100.resources(replace(unheld, hold_affine=True, min_blocks=bound))["local_bytes"]]
        if cols < TUNE.AUTO_HELD_AFFINE_FROM_COLS or not fits:
            assert spec == unheld, spec.name
            continue
        assert spec == replace(unheld, hold_affine=True, min_blocks=fits[0]), spec.name
        assert spec.name.endswith(("_held_affine" if op == "layer_norm" else "_held_weight"))
        # a group of lanes a row (or two): the whole grid, as without holding
        assert launch.grid[0] == -(-(-(-ROWS // spec.rows_per_access)) // launch.block[1])
        for flags in ({"weight": False, "bias": False}, {"residual": True}):
            other = norm.plan(op, ROWS, cols, dtype, "auto", H100, **flags).spec
            assert not other.hold_affine and other.min_blocks == 0, other.name
        assert not norm.plan(op, ROWS, cols, dtype, "oneflow", H100).spec.hold_affine


def test_auto_held_weight_and_bias_launch_bounds():
    """Which bounds the rule gives on sm_90: LayerNorm 16-bit 1024 cols 768
    threads (12 blocks of 64); 1000 cols (padded) would need 512 threads,
    under 48 KB of rows loading, so it reads them at the store."""
    assert norm.plan("layer_norm", ROWS, 1024, "f16", "auto", H100).spec.name == (
        "layer_norm_warp_f16_f32_p8_c32_g32_r1_nopad_b64_mb12_held_affine")
    assert norm.plan("layer_norm", ROWS, 512, "bf16", "auto", H100).spec.name == (
        "layer_norm_warp_bf16_f32_p8_c16_g32_r1_nopad_b64_held_affine")
    assert not norm.plan("layer_norm", ROWS, 1000, "f16", "auto", H100).spec.hold_affine
    assert not norm.plan("rms_norm", ROWS, 32, "f32", "auto", H100).spec.hold_affine


def test_auto_backward_fits_16_bit_blocks_to_the_row():
    """16-bit backward rows with fused partials take the fewest whole warps
    (at least 64) that hold the row at their rung's packs a thread, where
    that compiles without local memory and stays resident; else the rung's
    power-of-two block. float32 keeps the power-of-two blocks."""
    assert TUNE.AUTO_GRAD_FITTED_ITEMSIZES == (2,) and norm_backward.AUTO_GRAD_FITTED_MIN_BLOCK == 64
    for op in norm_spec.BACKWARD_OPS:
        for cols, block_size in ((1536, 96), (3000, 192), (5000, 320), (6000, 384), (4096, 256), (1024, 64)):
            spec = norm.plan(op, ROWS, cols, "bf16", "auto", H100).spec
            assert (spec.block_size, spec.packs_per_thread, spec.fuse_param_grad) == (block_size, 2, True), spec.name
            assert spec.min_blocks_per_sm * block_size >= norm_spec.MIN_RESIDENT_THREADS[
                "backward_smem_partials" if spec.smem_partials else "backward"]
        # 20000 cols: 864 threads of three packs spill under bounds of two blocks an SM: one
        long = norm.plan(op, ROWS, 20000, "f16", "auto", H100).spec
        assert (long.block_size, long.packs_per_thread, long.fuse_param_grad) == (864, 3, True), long.name
        assert (long.min_blocks, long.min_blocks_per_sm) == (1, 1) and long.name.endswith(
            "_k3_b864_mb1_cached_weight_pgradsmem"), long.name
        report = jit.compile_cubin(long, "sm_90")
        assert report.spill_bytes == 0 and report.registers > 65536 // (2 * 864), long.name
        assert norm.plan(op, ROWS, 3000, "f32", "auto", H100).spec.block_size == 512
    assert norm_backward.fitted_grad_block_size(3000, 8, 2) == 192
    assert norm_backward.fitted_grad_block_size(3080, 8, 2) == 224
    assert norm_backward.fitted_grad_block_size(100, 8, 2) == 64
    # rounded down only where rounding up spills: LayerNorm f16 6912 cols at 448
    # threads, two blocks an SM (three spill); RMSNorm keeps three (no spill)
    ln, rms = (norm.plan(op, ROWS, 6912, "f16", "auto", H100).spec for op in norm_spec.BACKWARD_OPS)
    assert (ln.block_size, ln.min_blocks_per_sm, ln.min_blocks) == (448, 2, 2), ln.name
    assert (rms.block_size, rms.min_blocks_per_sm, rms.min_blocks) == (448, 3, 0), rms.name
    rounded_up = replace(ln, min_blocks=0)
    assert rounded_up.min_blocks_per_sm == 3 and jit.compile_cubin(rounded_up, "sm_90").spill_bytes > 0
    # peeled rows keep the rung's block: 3001 cols at 256 x 2 packs
    peeled = norm.plan("layer_norm_backward", ROWS, 3001, "f16", "auto", H100, align=2).spec
    assert (peeled.peel, peeled.block_size, peeled.packs_per_thread) == (True, 256, 2), peeled.name


CLUSTER_PLANS = (   # op, dtype, cols: the kernel sharing each row between the two blocks of a cluster
    ("layer_norm_backward", "f16", 32768, "layer_norm_grad_block_regs_f16_f32_p8_k2_b1024_c2_cached_weight_pgradsmem"),
    ("layer_norm_backward", "bf16", 40000, "layer_norm_grad_block_regs_bf16_f32_p8_k3_b864_c2_mb1_cached_weight_pgradsmem"),
    ("layer_norm_backward", "f32", 32768, "layer_norm_grad_block_regs_f32_f32_p4_k4_b1024_c2_cached_weight_pgradsmem"),
    ("layer_norm_backward", "f32", 20000, "layer_norm_grad_block_regs_f32_f32_p4_k3_b1024_c2_cached_weight_pgradsmem"),
    ("rms_norm_backward", "f16", 32768, "rms_norm_grad_block_regs_f16_f32_p8_k4_b512_c2_cached_weight_pgradsmem"),
    ("rms_norm_backward", "f32", 24576, "rms_norm_grad_block_regs_f32_f32_p4_k3_b1024_c2_cached_weight_pgradsmem"),
    ("layer_norm_backward", "f64", 8192, "layer_norm_grad_block_regs_f64_f64_p2_k2_b1024_c2_cached_weight_pgradsmem"),
)


@pytest.mark.parametrize("op, dtype, cols, name", CLUSTER_PLANS)
def test_auto_backward_shares_long_rows_in_clusters_of_two(op, dtype, cols, name):
    """Rows on the 16-byte grid that no rung of one block holds share a
    thread-block cluster of two on sm_90: each block a rung's span of the
    row (half of it in whole packs, the last block at least one pack), one
    resident wave of clusters, a workspace row a cluster (the finish kernel
    sums num_parts rows). Clusters of four measured a second wave (30 of 33
    resident on an H200) and are not planned."""
    assert TUNE.AUTO_GRAD_CLUSTER_SIZES == (2,)
    chosen = norm.plan(op, ROWS, cols, dtype, "auto", H100)
    main = chosen.main
    assert main.spec.name == name and main.spec.fuse_param_grad and chosen.param_grad is None
    assert norm_spec.cluster_shares_rows(main.spec, cols)
    norm_spec.check_block_covers(main.spec, cols)
    active = H100.max_active_blocks(main.spec, main.spec.block_size, main.smem_bytes, True)
    assert main.grid[0] == active * H100.facts.sm_count and chosen.num_parts * 2 == main.grid[0]
    assert main.smem_bytes == norm_backward.grad_smem_bytes(main.spec, cols)
    # a cluster a row where rows are fewer than the resident clusters
    few = norm.plan(op, 3, cols, dtype, "auto", H100)
    assert (few.main.spec, few.main.grid[0], few.num_parts) == (main.spec, 6, 3)
    # sm_80 has no clusters; rows off the 16-byte grid keep their kernels
    assert norm.plan(op, ROWS, cols, dtype, "auto", Target.profile("a100")).main.spec.cluster_size == 1
    assert norm.plan(op, ROWS, cols + 1, dtype, "auto", H100, align=2).main.spec.cluster_size == 1
    assert "_c2_" in name and jit.render(main.spec).count("__cluster_dims__(2, 1, 1)") == 1


def test_auto_backward_takes_one_block_where_a_rung_holds_the_row():
    """A cluster is the last resort: rows one block holds keep it (H200, %
    of copy, one block against a cluster of two: RMSNorm f16 16384 cols 95.1
    / 83.3, f32 12288 98.4 / 92.3, LayerNorm f32 16384 97.3 / 84.6)."""
    for op, dtype, cols in (("layer_norm_backward", "f16", 24576), ("rms_norm_backward", "f16", 24576),
                            ("layer_norm_backward", "f32", 16384), ("rms_norm_backward", "f32", 16384),
                            ("layer_norm_backward", "f64", 4096)):
        spec = norm.plan(op, ROWS, cols, dtype, "auto", H100).main.spec
        assert spec.cluster_size == 1 and spec.impl == "block_regs" and spec.fuse_param_grad, spec.name
    # no fused partials wanted: the dx kernels without clusters
    assert norm.plan("layer_norm_backward", ROWS, 32768, "f16", "auto", H100,
                     param_grad=False).main.spec.cluster_size == 1


LONG_ROW_PLANS = (   # op, dtype, cols: rows no held rung holds, read twice, partial sums in shared memory
    ("layer_norm_backward", "f32", 40000, "layer_norm_grad_block_regs_f32_f32_p4_k5_b1024_c2_reread_weight_pgradsmem"),
    ("layer_norm_backward", "f32", 57344, "layer_norm_grad_block_regs_f32_f32_p4_k7_b1024_c2_reread_weight_pgradsmem"),
    ("rms_norm_backward", "bf16", 98304, "rms_norm_grad_block_regs_bf16_f32_p8_k6_b1024_c2_reread_weight_pgradsmem"),
    ("rms_norm_backward", "f64", 16384, "rms_norm_grad_block_regs_f64_f64_p2_k4_b1024_c2_reread_weight_pgradsmem"),
    ("layer_norm_backward", "f32", 20001,
     "layer_norm_grad_block_regs_f32_f32_p4_k5_b1024_peel_reread_wphases_weight_pgradsmem"),
    ("rms_norm_backward", "f16", 49151, "rms_norm_grad_block_regs_f16_f32_p8_k6_b1024_peel_reread_wphases_weight_pgradsmem"),
)


@pytest.mark.parametrize("op, dtype, cols, name", LONG_ROW_PLANS)
def test_auto_backward_reads_long_rows_twice(op, dtype, cols, name):
    """Rows that no held rung holds, in one block or a cluster, are read
    twice with their partial sums in shared memory (one value a column and
    gradient): in a cluster of two first where the row is on the 16-byte
    grid (RMSNorm f64 16384 cols fits one block of 8 packs a thread but
    takes the pair), peeled rows in one block; compiled without spills."""
    chosen = norm.plan(op, ROWS, cols, dtype, "auto", H100)
    spec = chosen.main.spec
    assert spec.name == name and chosen.param_grad is None
    assert (spec.cached, spec.smem_partials, spec.fuse_param_grad) == (False, True, True)
    grads = norm_backward.PARAM_GRADS[norm_spec.family_of(spec.op)]
    compute_itemsize = 8 if dtype == "f64" else 4
    partials = grads * spec.block_size * spec.packs_per_thread * spec.pack_size * compute_itemsize
    assert chosen.main.smem_bytes - partials in (0, norm_backward.weight_copy_bytes(spec, cols))
    assert partials >= grads * cols // spec.cluster_size * compute_itemsize
    norm_spec.check_block_covers(spec, cols)
    assert jit.compile_cubin(spec, "sm_90").spill_bytes == 0


def test_auto_backward_long_rows_past_the_rungs_keep_the_column_reduction():
    """Without clusters (sm_80) rows on the 16-byte grid are read twice in
    one block; rows whose partial sums leave no block resident even in a
    pair (LayerNorm float32 65536 cols: 256 KiB a block), and unpeeled rows
    off the 16-byte grid (LayerNorm f16 28001 cols, 1-element packs: 27.3 %
    of copy against 29.6), keep the dx kernel and the column reduction."""
    a100 = norm.plan("rms_norm_backward", ROWS, 16384, "f64", "auto", Target.profile("a100")).main.spec
    assert (a100.cluster_size, a100.cached, a100.packs_per_thread) == (1, False, 8), a100.name
    for op, dtype, cols, kwargs in (("layer_norm_backward", "f32", 65536, {}),
                                    ("layer_norm_backward", "f16", 28001, {"same_phase": False}),
                                    ("layer_norm_backward", "f16", 28001, {})):
        chosen = norm.plan(op, ROWS, cols, dtype, "auto", H100, **kwargs)
        assert chosen.param_grad is not None and not chosen.main.spec.fuse_param_grad, chosen.main.spec.name


def test_cluster_spec_must_leave_each_block_a_part_of_the_row():
    spec = norm.plan("layer_norm_backward", ROWS, 32768, "f16", "auto", H100).main.spec
    for wrong in ({"impl": "block_uncached"}, {"op": "layer_norm"}, {"peel": True}):
        with pytest.raises(ValueError, match="cluster"):
            replace(spec, **wrong)
    assert (spec.block_size, spec.packs_per_thread, spec.cluster_size) == (1024, 2, 2)
    norm_spec.check_block_covers(spec, 32768 - 8)       # the last block one pack short
    norm_spec.check_block_covers(spec, 16384 + 8)       # the last block one pack
    for cols in (16384, 32768 + 8, 32768 - 4):      # nothing left / too long / not whole packs
        assert not norm_spec.cluster_shares_rows(spec, cols)
        with pytest.raises(ValueError, match="cluster"):
            norm_spec.check_block_covers(spec, cols)


def test_auto_backward_keeps_partial_sums_in_shared_memory():
    """From 2048 cols the fused partial sums sit in shared memory, a float32
    value per column and gradient, leaving 64 registers a thread: two
    512-thread blocks an SM at 8192 cols. RMSNorm (one gradient) holds 64
    bytes a thread at 16384 cols, LayerNorm 32."""
    for op, grads in (("layer_norm_backward", 2), ("rms_norm_backward", 1)):
        launch = norm.plan(op, ROWS, 8192, "f16", "auto", H100).main
        spec = launch.spec
        assert (spec.block_size, spec.packs_per_thread, spec.cached, spec.smem_partials) == (512, 2, True, True)
        assert launch.smem_bytes == grads * 8192 * 4
        assert spec.min_blocks_per_sm == 2
        assert H100.max_active_blocks(spec, 512, launch.smem_bytes, True) == 2
        assert launch.grid[0] == 2 * H100.facts.sm_count
    wide = {op: norm.plan(op, ROWS, 16384, "f16", "auto", H100).main.spec
            for op in ("layer_norm_backward", "rms_norm_backward")}
    assert (wide["layer_norm_backward"].block_size, wide["layer_norm_backward"].packs_per_thread) == (1024, 2)
    assert (wide["rms_norm_backward"].block_size, wide["rms_norm_backward"].packs_per_thread) == (512, 4)


def test_auto_backward_loads_two_rows_of_short_16_bit_rows():
    """16-bit rows of 513-1024 cols: 64 threads, two 16-byte packs of each
    input a thread, two rows loaded before one block reduction; the dx-only
    kernel too. Peeled rows (1023 cols, fused partials) the same; float32
    and longer rows a row at a time."""
    for op in ("layer_norm_backward", "rms_norm_backward"):
        for dtype in ("f16", "bf16"):
            for cols, align, param_grad in ((1024, 16, True), (1024, 16, False), (1000, 16, True), (1023, 2, True)):
                spec = norm.plan(op, ROWS, cols, dtype, "auto", H100, align=align, param_grad=param_grad).spec
                assert (spec.impl, spec.block_size, spec.pack_size, spec.packs_per_thread) == (
                    "block_regs", 64, 8, 2), spec.name
                assert (spec.rows_per_access, spec.cached, spec.peel, spec.fuse_param_grad) == (
                    2, True, cols == 1023, param_grad), spec.name
            assert norm.plan(op, ROWS, 2048, dtype, "auto", H100).spec.rows_per_access == 1
            assert norm.plan(op, ROWS, 512, dtype, "auto", H100).spec.impl == "warp"
        assert norm.plan(op, ROWS, 1024, "f32", "auto", H100).spec.rows_per_access == 1
    assert (norm.plan("layer_norm_backward", ROWS, 1024, "f16", "auto", H100).spec.name
            == "layer_norm_grad_block_regs_f16_f32_p8_k2_b64_cached_r2_weight_pgrad")


def test_golden_names():
    spec = norm_spec.NormSpec("layer_norm", "warp", "f16", pack_size=8, cols_per_thread=32,
                         min_cols_per_thread=32, thread_group_width=32, weight=True, bias=True,
                         residual=True)
    assert spec.name == "layer_norm_warp_f16_f32_p8_c32_g32_r1_nopad_affine_residual"
    assert (norm.plan("layer_norm", ROWS, 1000, "f16", "oneflow", H100).spec.name
            == "layer_norm_warp_f16_f32_p2_c32m28_g32_r1_pad_affine")
    assert (norm.plan("rms_norm", ROWS, 2048, "bf16", "auto", H100).spec.name
            == "rms_norm_block_regs_bf16_f32_p8_k4_b64_weight")
    assert (norm.plan("layer_norm_backward", ROWS, 4096, "f32", "auto", H100).spec.name
            == "layer_norm_grad_block_regs_f32_f32_p4_k2_b512_cached_weight_pgradsmem")
    assert (norm.plan("layer_norm", ROWS, 1024, "f32", "auto", H100, weight=False, bias=False).spec.name
            == "layer_norm_block_regs_f32_f32_p4_k4_b64")
    assert (norm.plan("layer_norm", ROWS, 32768, "bf16", "auto", H100, residual=False).spec.name
            == "layer_norm_block_async_bf16_f32_p8_b512_t8_affine")
    assert (norm.plan("rms_norm", 64, 65536, "f16", "auto", H100, residual=True).spec.name
            == "rms_norm_block_async_f16_f32_p8_b1024_t4_weight_residual")


def test_rendering_is_strict_and_names_the_kernel():
    spec = norm.plan("layer_norm", ROWS, 3000, "f16", "auto", H100, residual=True).spec
    source = jit.render(spec)
    assert f"{spec.name}(" in source and "NormInput<T, C, true>" in source
    assert "SquareSumState" in jit.render(norm.plan("rms_norm", ROWS, 3000, "f16", "auto", H100).spec)


def test_bad_plan_arguments():
    with pytest.raises(ValueError):
        norm.plan("group_norm", 1, 1, "f16", "auto", H100)
    with pytest.raises(ValueError):
        norm.plan("layer_norm", 0, 1, "f16", "auto", H100)
    with pytest.raises(ValueError):
        norm.plan("layer_norm", 1, 1, "f16", "fast", H100)


# -- every kernel of the default sweep compiles; register paths do not spill -------

def _compile_sweep(job) -> list:
    """Plans (compiling for occupancy where OneFlow's rules need it) and
    compiles every kernel one op and policy needs across the sweep."""
    arch, op, policy = job
    target = Target.profile(ARCH_PROFILES[arch])
    # forward: with and without residual, and rows at different phases (not peeled)
    variants = ([{"residual": False}, {"residual": True}, {"same_phase": False}] if op in norm.FORWARD_OPS
                else [{}])
    specs = set()
    for dtype in SWEEP_DTYPES:
        for cols in SWEEP_COLS:
            for extra in variants:
                chosen = norm.plan(op, ROWS, cols, dtype, policy, target, **extra)
                specs.update(launch.spec for launch in chosen.launches)
    return [(spec.name, spec.impl, jit.compile_cubin(spec, arch).spill_bytes) for spec in specs]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_peeled_kernels_compile_for_every_dtype(arch):
    """The peeled register path (its float64 instantiation is outside the sweep),
    and its one- and two-warp blocks of short rows."""
    target = Target.profile(ARCH_PROFILES[arch])
    for dtype, cols in (("f16", 4097), ("bf16", 12345), ("f32", 12345), ("f64", 4097),
                        ("f16", 1023), ("bf16", 1057), ("f32", 1023), ("f64", 255)):
        for op in norm.FORWARD_OPS:
            for residual in (False, True):
                spec = norm.plan(op, ROWS, cols, dtype, "auto", target, align=2, residual=residual).spec
                assert spec.peel and spec.pack_size * {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}[dtype] == 16
                report = jit.compile_cubin(spec, arch)
                assert report.spill_bytes == 0, f"{spec.name}: {report.spill_bytes} spill bytes on {arch}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_sweep_compiles_without_spills(arch):
    jobs = [(arch, op, policy) for op in norm.OPS for policy in ("auto", "oneflow")]
    with concurrent.futures.ProcessPoolExecutor(max_workers=2) as pool:
        compiled = {name: (impl, spill) for results in pool.map(_compile_sweep, jobs)
                    for name, impl, spill in results}
    spilled = [name for name, (impl, spill) in compiled.items()
               if impl in ("warp", "block_regs", "block_async") and spill]
    assert not spilled, f"register paths spill on {arch}: {spilled}"
