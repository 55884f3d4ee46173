"""Row-wise softmax / log_softmax, forward and backward, with rows split across
blocks (cupyops/ops/softmax_split.py, kernels/softmax_split.cuh).

CPU: kernel names, rendering, the planner's rule (golden plans for the H100
profile worked from the rule in the module docstring, the cases it leaves to
the ordinary paths, invariants over many shapes) and NVRTC compiles of the
three kernels (partials, finish, coop) of every op and dtype for sm_80 and sm_90.
GPU (marked gpu): softmax_split.run on rowwise.Operand objects, once with the
cooperative kernel and once with the two launches, against float64 NumPy
references for long rows (odd, misaligned, row-strided), NaN / +-inf rows,
poisoned outputs, in-place outputs and repeatability; rows up to 2**24
columns through the public functions.
"""
from __future__ import annotations

import math

import numpy
import pytest
from conftest import TOLERANCES, assert_close, patch_tuning

from cupyops import arrays, dtypes, jit
from cupyops.dtypes import BFLOAT16
from cupyops.launch import LaunchCache, Target
from cupyops.ops import softmax_rows as sm
from cupyops.ops import softmax_split as ss
from cupyops.ops.row_packs import vector_pack_size
from cupyops.ops.softmax_split import SoftmaxSplitSpec, plan
from cupyops.profile import profile_for

H100 = Target.profile("h100")
TUNE = profile_for(H100.facts)   # the tuning values the H100 plans read
TARGETS = {"sm_80": Target.profile("a100"), "sm_90": H100}
A100 = TARGETS["sm_80"]
OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")
DTYPES = ("f16", "bf16", "f32", "f64")
ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}


_PLANNERS = (ss.coop_plan, ss.two_launch_plan)


def clear_plan_caches():
    for planner in _PLANNERS:
        planner.cache_clear()


@pytest.fixture(params=["coop", "two_launch"])
def split_kind(request, monkeypatch):
    """Each GPU test runs with both split kernels: the cooperative one (the
    planner's first choice) and the two launches (coop_plan disabled)."""
    clear_plan_caches()
    monkeypatch.setattr(ss, "_launches", LaunchCache())
    if request.param == "two_launch":
        monkeypatch.setattr(ss, "coop_plan", lambda *args, **kwargs: None)
    yield request.param
    clear_plan_caches()


@pytest.fixture
def split_everywhere(monkeypatch):
    """Splits short rows too (small minimum row and chunk, coop blocks of a
    warp holding 8 bytes a thread, or more where needed), so small shapes reach every edge of the
    kernels; fresh plan and launch caches."""
    patch_tuning(monkeypatch, "SPLIT_MIN_ROW_BYTES", 0)
    patch_tuning(monkeypatch, "SPLIT_MIN_CHUNK_BYTES", 256)
    monkeypatch.setattr(ss, "COOP_BLOCK_SIZE", 32)
    patch_tuning(monkeypatch, "COOP_BYTES_PER_THREAD", dict.fromkeys(TUNE.COOP_BYTES_PER_THREAD, 8))
    monkeypatch.setattr(ss, "_launches", LaunchCache())
    clear_plan_caches()
    yield
    clear_plan_caches()


# -- names and rendering --------------------------------------------------------------

@pytest.mark.parametrize("spec, name", [
    (SoftmaxSplitSpec("softmax", "partials", "f16", 8, 512, 4), "softmax_split_partials_f16_f32_p8_b512_l4"),
    (SoftmaxSplitSpec("log_softmax", "finish", "bf16", 1, 512, 8),
     "log_softmax_split_finish_bf16_f32_p1_b512_l8"),
    (SoftmaxSplitSpec("softmax_backward", "finish", "f64", 2, 256, 4),
     "softmax_backward_split_finish_f64_f64_p2_b256_l4"),
    (SoftmaxSplitSpec("softmax", "coop", "f16", 8, 512, 4), "softmax_split_coop_f16_f32_p8_b512_l4"),
    (SoftmaxSplitSpec("log_softmax", "coop", "f32", 4, 256, 8, prefetch=True),
     "log_softmax_split_coop_f32_f32_p4_b256_l8_pf"),
    (SoftmaxSplitSpec("softmax", "coop", "f32", 4, 256, 5, shared_packs=11),
     "softmax_split_coop_f32_f32_p4_b256_l5_s11"),
])
def test_golden_names(spec, name):
    assert spec.name == name
    assert spec.threads_per_block == spec.block_size


@pytest.mark.parametrize("op", OPS)
def test_render_names_the_kernel_and_fingerprint(op):
    inputs = ("dy", "y") if op.endswith("_backward") else ("x",)
    for stage in ss.STAGES:
        spec = SoftmaxSplitSpec(op, stage, "f16", 8, 512, 4)
        source = jit.render(spec)
        assert f'extern "C" __global__ void __launch_bounds__(512)\n{spec.name}(' in source
        assert jit.headers_fingerprint() in source
        assert f"softmax_split_{stage}<" in source
        assert all(f"long long {name}_row_stride" in source for name in inputs)
        # the finish kernel writes the output and reads the partials; the
        # partials kernel writes them; coop writes both and counts arrivals
        assert ("cupyops::half_t* out, const float* partials" in source) == (stage == "finish")
        assert ("cupyops::half_t* out, float* partials, unsigned* counters, long long rows"
                in source) == (stage == "coop")
        assert ("const cupyops::half_t* x, float* partials" in source) == (
            stage == "partials" and inputs == ("x",))
        assert "{%" not in source and "{{ " not in source


@pytest.mark.parametrize("stage", ["partials", "finish"])
@pytest.mark.parametrize("fields", [{"prefetch": True}, {"shared_packs": 4}])
def test_only_coop_prefetches_or_holds_shared_packs(stage, fields):
    with pytest.raises(ValueError, match="only the coop stage prefetches or holds shared packs"):
        SoftmaxSplitSpec("softmax", stage, "f32", 4, 512, 4, **fields)


def test_prefetching_coop_holds_no_shared_packs():
    with pytest.raises(ValueError, match="holds no shared packs"):
        SoftmaxSplitSpec("softmax", "coop", "f32", 4, 256, 4, prefetch=True, shared_packs=4)


@pytest.mark.parametrize("prefetch, shared_packs", [(False, 0), (True, 0), (False, 11)])
def test_render_coop_prefetch_and_shared_packs(prefetch, shared_packs):
    spec = SoftmaxSplitSpec("softmax", "coop", "f32", 4, 256, 5, prefetch=prefetch, shared_packs=shared_packs)
    source = jit.render(spec)
    assert (f"4, 5,\n                     {shared_packs}, 256, {'true' if prefetch else 'false'}>(loads, store, "
            "partials, counters, rows,") in source
    # dynamic shared memory: the shared packs, or the prefetched register chunk, of every input
    assert spec.shared_bytes == (shared_packs + 5 * prefetch) * 256 * 16


# -- the planner ----------------------------------------------------------------------

# Two launches, worked from rule 4 for the H100 profile (132 SMs x 2048 threads):
# (op, rows, cols, dtype, align, same_phase) -> (pack_size, loads_in_flight, splits, chunk_cols).
# Blocks of 512 threads of the partials kernel per SM, by its registers
# (NVRTC for sm_90): 3 for f16 forward with 16-byte packs (39 registers), 2
# for f32 softmax_backward (52), 4 for the others here (32 or fewer).
PLAN_GOLDEN = [
    # the brief's shape: 2 waves x 396 / 8 rows = 99 chunks of 131072 / 99 =
    # 1324 packs, rounded up to 1328 (128 bytes): 10624 columns, 792 blocks
    (("softmax", 8, 2**20, "f16", 16, True), (8, 4, 99, 10624)),
    # one row of 600 KB, operands at different phases: scalar loads; at most
    # 600002 // 16384 = 36 chunks; 300001 / 36 = 8334 -> 8384 columns
    # (64-element granules)
    (("softmax", 1, 300001, "f16", 16, False), (1, 8, 36, 8384)),
    # the same row at one phase in every operand: peeled, 16-byte packs (3
    # partials blocks an SM, 39 registers): 2 x 396 chunks, capped at 36 of
    # 37500 / 36 -> 1042 packs -> 1048 (8-pack granules) = 8384 columns
    (("softmax", 1, 300001, "f16", 16, True), (8, 4, 36, 8384)),
    # 2 x 264 / 3 = 176 chunks (under 4 MB // 16 KB = 256): 262144 / 176 =
    # 1490 packs -> 1496 (8-pack granules) = 5984 columns
    (("softmax_backward", 3, 2**20, "f32", 16, True), (4, 4, 176, 5984)),
    # odd columns at different phases: scalar loads; 2 x 528 / 8 = 132 chunks
    # of 7944 columns -> 7968; peeled: 262145 / 132 -> 1986 packs -> 1992 =
    # 7968 columns
    (("log_softmax", 8, 2**20 + 7, "f32", 16, False), (1, 8, 132, 7968)),
    (("log_softmax", 8, 2**20 + 7, "f32", 16, True), (4, 4, 132, 7968)),
    # 131 rows (one fewer than the SMs) of 128 KB: 2 x 396 / 131 -> 7 chunks of
    # 1171 packs -> 1176 = 9408 columns
    (("softmax", 131, 65536, "f16", 16, True), (8, 4, 7, 9408)),
    # pointers only 4-byte aligned, at different phases: 2-element packs of
    # f16; 2 x 528 / 8 = 132 chunks, capped at 2 MB // 16 KB = 128 of 8192 columns
    (("log_softmax_backward", 8, 2**20, "f16", 4, False), (2, 8, 128, 8192)),
]


@pytest.mark.parametrize("args, expected", PLAN_GOLDEN, ids=[str(g[0]) for g in PLAN_GOLDEN])
def test_two_launch_plan_golden(args, expected):
    op, rows, cols, dtype, align, same_phase = args
    p = ss.two_launch_plan(op, rows, cols, dtype, H100, align, same_phase)
    assert p is not None
    assert (p.finish.pack_size, p.finish.loads_in_flight, p.splits, p.chunk_cols) == expected
    assert p.grid == (rows * p.splits, 1, 1) and p.block == (TUNE.SPLIT_BLOCK_SIZE, 1, 1)
    peel = expected[0] * ITEMSIZE[dtype] == 16 and cols % expected[0] != 0
    assert p.partials == SoftmaxSplitSpec(op, "partials", dtype, *expected[:1], TUNE.SPLIT_BLOCK_SIZE,
                                          expected[1], peel=peel)
    assert p.finish == SoftmaxSplitSpec(op, "finish", dtype, *expected[:1], TUNE.SPLIT_BLOCK_SIZE,
                                        expected[1], peel=peel)


@pytest.mark.parametrize("shape, ops", [
    ((49152, 4096), OPS),                         # the seeds' shape: rows fill the GPU
    ((8, 32768), OPS),                            # 64 KB rows: cached on chip by the ordinary paths
    ((1, 65535), ("softmax", "log_softmax")),     # just under 128 KB of f16
    ((16384, 65535), ("softmax", "log_softmax")),  # many rows under COOP_MIN_ROW_BYTES
])
def test_ordinary_path_chosen(shape, ops):
    for op in ops:
        assert plan(op, *shape, "f16", H100) is None


@pytest.mark.parametrize("op, rows, cols", [
    ("softmax", 4096, 2**21),            # many rows of 4 MB: past 8 blocks with tails
    ("softmax", 132, 2**20),             # rows = SMs
    ("softmax_backward", 4096, 2**20),   # 2 x 2 MB of inputs per row
    ("softmax", 8, 2**20),
])
def test_long_rows_take_coop(op, rows, cols):
    p = plan(op, rows, cols, "f16", H100)
    assert isinstance(p, ss.CoopPlan) and p.spec.stage == "coop"


def test_rows_one_block_or_a_cluster_holds_are_not_split():
    """Many rows the async row path holds are not split: forward rows of 256
    KB and backward rows of 2 x 128 KB in one block with a register tail
    (on sm_80 where its tail fits as well),
    forward rows of up to 1 MB and backward rows of 2 x 512 KB in
    thread-block clusters with register tails (sm_90+). Longer rows,
    clusters' rows on sm_80, and few rows still are split."""
    for op, dtype, cols in (("softmax", "f32", 65536), ("log_softmax", "f16", 131072),
                            ("softmax_backward", "f16", 65536), ("log_softmax_backward", "f32", 32768)):
        assert plan(op, 4096, cols, dtype, H100) is None
        held_on_a100 = sm.plan(op, 4096, cols, dtype, "auto", A100).spec.impl == "block_async"
        assert (plan(op, 4096, cols, dtype, A100) is None) == held_on_a100
        assert isinstance(plan(op, 64, cols, dtype, H100), ss.CoopPlan)
    for op, dtype, cols in (("softmax", "f32", 131072), ("log_softmax", "f16", 262144), ("softmax", "f32", 262144),
                            ("softmax_backward", "f32", 65536), ("log_softmax_backward", "f16", 262144)):
        assert plan(op, 4096, cols, dtype, H100) is None
        assert isinstance(plan(op, 4096, cols, dtype, A100), ss.CoopPlan)
        assert isinstance(plan(op, 64, cols, dtype, H100), ss.CoopPlan)
    assert isinstance(plan("softmax_backward", 4096, 2**20, "f16", H100), ss.CoopPlan)


def test_rows_need_two_chunks(split_everywhere, monkeypatch):
    """A row of less than two minimum chunks (two launches) or of one coop
    chunk (COOP_BLOCK_SIZE threads x COOP_BYTES_PER_THREAD) is not split."""
    patch_tuning(monkeypatch, "SPLIT_MIN_CHUNK_BYTES", 16 * 1024)
    assert ss.two_launch_plan("softmax", 8, 16383, "f16", H100) is None
    assert ss.two_launch_plan("softmax", 8, 16384, "f16", H100).splits == 2
    patch_tuning(monkeypatch, "COOP_BYTES_PER_THREAD", {(2, 1): 16})  # 32 threads x 8 f16: 256 columns
    patch_tuning(monkeypatch, "COOP_DOUBLINGS", 0)
    assert ss.coop_plan("softmax", 8, 256, "f16", H100) is None
    assert ss.coop_plan("softmax", 8, 264, "f16", H100).splits == 2


# Coop, worked from rule 3 for the H100 profile: 256-thread blocks whose
# threads hold 128 bytes (f16: 8 packs of 8, 58 registers; f32: 8 packs of 4,
# 58 registers; NVRTC for sm_90), 4 blocks an SM by registers: 528 resident.
# f16: 2**20 / (256 x 64) = 64 splits, 528 // 64 = 8 slots: one round. f32:
# 2**20 / (256 x 32) = 128 splits, 4 slots for 8 rows, two rounds; so one
# round of 528 // 8 = 66 blocks a row, chunks of ceil(2**20 / 4 / 66 / 256) =
# 16 packs a thread: 80 bytes (5 packs) in registers, 11 packs in shared
# memory (256 x 11 x 16 = 45056 bytes a block, 58 registers, still 4 blocks
# an SM), 2**20 / (256 x 16 x 4) = 64 splits, 8 slots. f32 16 rows need more
# than one round either way: the plain plan, its next row prefetched
# (256 x 8 x 16 bytes of shared memory, 64 registers).
@pytest.mark.parametrize("dtype, rows, expected", [
    ("f16", 8, {"pack_size": 8, "splits": 64, "chunk_cols": 16384, "slots": 8, "packs_per_thread": 8,
                "shared_packs": 0, "prefetch": False, "grid": [512, 1, 1], "smem_bytes": 0,
                "kernel": "softmax_split_coop_f16_f32_p8_b256_l8"}),
    ("f32", 8, {"pack_size": 4, "splits": 64, "chunk_cols": 16384, "slots": 8, "packs_per_thread": 5,
                "shared_packs": 11, "prefetch": False, "grid": [512, 1, 1], "smem_bytes": 45056,
                "kernel": "softmax_split_coop_f32_f32_p4_b256_l5_s11"}),
    ("f32", 16, {"pack_size": 4, "splits": 128, "chunk_cols": 8192, "slots": 4, "packs_per_thread": 8,
                 "shared_packs": 0, "prefetch": True, "grid": [512, 1, 1], "smem_bytes": 32768,
                 "kernel": "softmax_split_coop_f32_f32_p4_b256_l8_pf"}),
])
def test_coop_explain(dtype, rows, expected):
    info = plan("softmax", rows, 2**20, dtype, H100).explain()
    assert info == {"op": "softmax", "impl": "split", "block": [256, 1, 1], "cooperative": True, **expected}


@pytest.mark.parametrize("op, rows, dtype", [("softmax", 3, "f32"), ("softmax", 200, "f32"),
                                             ("softmax_backward", 8, "f32"), ("softmax", 8, "f16")])
def test_coop_prefetch_only_for_several_rounds_of_few_rows(op, rows, dtype):
    """One round (rows <= slots), many rows (slots drift apart), backward
    and 16-bit (not in COOP_PREFETCH): no prefetch."""
    p = ss.coop_plan(op, rows, 2**20, dtype, H100)
    assert isinstance(p, ss.CoopPlan) and not p.spec.prefetch and p.smem_bytes == 0


def test_two_launch_explain():
    info = ss.two_launch_plan("softmax", 8, 2**20, "f16", H100).explain()
    assert info == {"op": "softmax", "impl": "split", "pack_size": 8, "splits": 99,
                    "chunk_cols": 10624, "block": [512, 1, 1], "grid": [792, 1, 1],
                    "smem_bytes": 0, "kernel": "softmax_split_finish_f16_f32_p8_b512_l4",
                    "partials_kernel": "softmax_split_partials_f16_f32_p8_b512_l4", "cooperative": False}


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown op"):
        plan("layer_norm", 2, 2**20, "f32", H100)
    with pytest.raises(ValueError, match="positive"):
        plan("softmax", 0, 2**20, "f32", H100)


SHAPE_SWEEP = [(rows, cols) for rows in (1, 2, 3, 8, 31, 100, 131)
               for cols in (65536, 65537, 100000, 300001, 2**20, 2**20 + 7, 3 * 2**20 + 1, 2**24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("align", (16, 8, 4, 2))
def test_plan_invariants(dtype, align):
    itemsize = ITEMSIZE[dtype]
    if align < itemsize:
        pytest.skip("an array is always aligned to its itemsize")
    for rows, cols in SHAPE_SWEEP:
        for op in ("softmax", "softmax_backward"):
            p = plan(op, rows, cols, dtype, H100, align)
            row_bytes = cols * itemsize
            if row_bytes < TUNE.SPLIT_MIN_ROW_BYTES and row_bytes * len(ss.INPUTS[op]) < TUNE.COOP_MIN_ROW_BYTES:
                assert p is None
                continue
            assert p is not None, (op, rows, cols)
            pack = p.spec.pack_size
            pack_bytes = pack * itemsize
            if p.spec.peel:   # rows off the 16-byte grid: 16-byte packs between each row's edges
                assert isinstance(p, ss.SplitPlan) and pack_bytes == 16 and vector_pack_size(
                    cols, itemsize, align) * itemsize < 16
            else:
                assert cols % pack == 0 and pack_bytes <= min(16, align)
            assert p.chunk_cols % pack == 0
            packed = cols // pack * pack   # the most columns of whole packs a row holds
            assert (p.splits - 1) * p.chunk_cols < packed <= p.splits * p.chunk_cols and p.splits >= 2
            if isinstance(p, ss.CoopPlan):
                check_coop_plan(p, op, rows, cols, dtype, align)
            else:   # coop takes no such rows, or packs too narrow where the rows are peeled
                assert p.spec.peel or ss.coop_plan(op, rows, cols, dtype, H100, align) is None
                if ss.coop_plan(op, rows, cols, dtype, H100, align) is not None:
                    assert vector_pack_size(cols, itemsize, align) * itemsize < TUNE.COOP_MIN_PEELABLE_PACK_BYTES
                check_two_launch_plan(p, rows, cols, itemsize)


def check_coop_plan(p, op, rows, cols, dtype, align):
    """Every block resident; the chunks cover the rows; the table's bytes, doubled only when needed."""
    spec = p.spec
    assert spec.stage == "coop" and spec.block_size == ss.COOP_BLOCK_SIZE
    assert p.chunk_cols == ss.COOP_BLOCK_SIZE * (spec.loads_in_flight + spec.shared_packs) * spec.pack_size
    resident = H100.facts.sm_count * H100.max_active_blocks(spec, ss.COOP_BLOCK_SIZE, p.smem_bytes, True)
    assert p.slots == min(rows, resident // p.splits) >= 1
    assert H100.resources(spec)["local_bytes"] == 0   # the table's bytes fit the registers
    assert p.grid == (p.slots * p.splits, 1, 1) and p.grid[0] <= resident
    itemsize = ITEMSIZE[dtype]
    inputs = len(ss.INPUTS[op])
    pack_bytes = spec.pack_size * itemsize
    preferred = TUNE.COOP_BYTES_PER_THREAD[(itemsize, len(ss.INPUTS[op]))]
    if spec.prefetch:   # few rows, more than one round, a prefetching dtype: a chunk of every input
        assert (itemsize, inputs) in TUNE.COOP_PREFETCH and p.slots < rows < H100.facts.sm_count
        assert p.smem_bytes == inputs * spec.loads_in_flight * ss.COOP_BLOCK_SIZE * pack_bytes
    elif spec.shared_packs:   # one round, where the table's bytes in registers alone take more
        assert (itemsize, inputs) in TUNE.COOP_SHARED and p.slots == rows
        plain = SoftmaxSplitSpec(op, "coop", dtype, spec.pack_size, ss.COOP_BLOCK_SIZE,
                                 max(1, preferred // pack_bytes))
        plain_resident = H100.facts.sm_count * H100.max_active_blocks(plain, ss.COOP_BLOCK_SIZE, 0, True)
        assert rows * math.ceil(cols / (ss.COOP_BLOCK_SIZE * plain.loads_in_flight * spec.pack_size)) > \
            plain_resident
        assert spec.loads_in_flight == max(1, TUNE.COOP_SHARED[(itemsize, inputs)] // pack_bytes)
        assert 0 < spec.shared_packs * inputs <= TUNE.COOP_MAX_SHARED_PACKS
        assert p.smem_bytes == inputs * spec.shared_packs * ss.COOP_BLOCK_SIZE * pack_bytes
        return
    else:
        assert p.smem_bytes == 0
    held = spec.loads_in_flight * spec.pack_size * itemsize
    assert held in [max(preferred << d, spec.pack_size * itemsize) for d in range(TUNE.COOP_DOUBLINGS + 1)]
    if held > max(preferred, spec.pack_size * itemsize):
        assert ss.coop_candidate(op, rows, cols, dtype, H100, align, held // 2) is None


def check_two_launch_plan(p, rows, cols, itemsize):
    pack = p.finish.pack_size
    pack_bytes = pack * itemsize
    assert p.partials.pack_size == pack and p.partials.stage == "partials"
    assert p.finish.loads_in_flight * pack_bytes <= max(TUNE.SPLIT_BYTES_IN_FLIGHT, pack_bytes)
    # whole granules, at least the minimum chunk
    assert (p.chunk_cols * itemsize) % min(TUNE.SPLIT_CHUNK_GRANULE_BYTES, pack_bytes) == 0
    assert p.chunk_cols * itemsize >= TUNE.SPLIT_MIN_CHUNK_BYTES
    # as many chunks as SPLIT_WAVES waves need, fewer where the minimum
    # chunk limits them, less at most what rounding to granules takes
    resident = H100.facts.sm_count * H100.max_active_blocks(p.partials, TUNE.SPLIT_BLOCK_SIZE, 0, False)
    wanted = math.ceil(TUNE.SPLIT_WAVES * resident / rows)
    even = min(wanted, cols * itemsize // TUNE.SPLIT_MIN_CHUNK_BYTES)
    granule_cols = max(pack, TUNE.SPLIT_CHUNK_GRANULE_BYTES // itemsize)
    assert p.chunk_cols < cols / even + pack + granule_cols
    assert p.splits <= even
    assert p.grid == (rows * p.splits, 1, 1)


# Short rows for the GPU tests under split_everywhere: chunks ending inside a
# block's sweep, last chunks shorter, a few chunks a row (2 for 16-bit (1, 300)),
# odd cols, packs of every size.
SMALL_SHAPES = [(2, 1000), (5, 4097), (1, 300), (3, 333), (7, 2048), (2, 8192 + 8)]


def test_lifted_thresholds_split_small_rows(split_everywhere):
    """The fixture the small GPU shapes use: short rows split too, by both kernels."""
    p = ss.two_launch_plan("softmax", 2, 1000, "f16", H100)
    assert (p.finish.pack_size, p.splits, p.chunk_cols) == (8, 6, 192)
    assert plan("softmax", 1, 64, "f32", H100) is None        # 256 bytes: one chunk
    for dtype in DTYPES:
        plans = [ss.two_launch_plan(op, *shape, dtype, H100) for op in OPS for shape in SMALL_SHAPES]
        assert all(p is not None for p in plans) and min(p.splits for p in plans) <= 7
        # coop: every shape with packs of COOP_MIN_PACK_BYTES or more
        wide = [shape for shape in SMALL_SHAPES
                if vector_pack_size(shape[1], ITEMSIZE[dtype], 16) * ITEMSIZE[dtype] >= TUNE.COOP_MIN_PACK_BYTES]
        assert len(wide) >= 4
        plans = [ss.coop_plan(op, *shape, dtype, H100) for op in OPS for shape in wide]
        assert all(p is not None for p in plans) and min(p.splits for p in plans) <= 7


# -- NVRTC compiles -------------------------------------------------------------------

# Aligned rows (16-byte packs) and odd ones (scalar loads).
COMPILE_SHAPES = [(8, 2**20), (8, 2**20 + 7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_instantiations_compile(arch, dtype):
    target = TARGETS[arch]
    specs = set()
    for op in OPS:
        for rows, cols in COMPILE_SHAPES:
            for same_phase in (True, False):   # odd rows peeled, or at different phases
                split = ss.two_launch_plan(op, rows, cols, dtype, target, 16, same_phase)
                specs.update((split.partials, split.finish))
            coop = ss.coop_plan(op, rows, cols, dtype, target)
            # aligned rows: coop, but for f64, whose 8 MB rows outnumber an A100's resident blocks
            assert coop is not None or cols % 2 or (dtype, arch) == ("f64", "sm_80")
            if coop is not None:
                specs.add(coop.spec)
        # twice the rows: more than one round however held (float32 forward prefetching)
        coop = ss.coop_plan(op, 16, 2**20, dtype, target)
        if coop is not None:
            specs.add(coop.spec)
    assert len(specs) >= len(OPS) * (len(COMPILE_SHAPES) * 2 + ((dtype, arch) != ("f64", "sm_80")))
    assert {spec.pack_size for spec in specs} == {1, 16 // ITEMSIZE[dtype]}
    problems = []
    for spec in sorted(specs, key=lambda s: s.name):
        report = jit.compile_cubin(spec, arch)       # raises jit.CompileError on failure
        assert report.cubin_bytes > 0 and report.smem_bytes > 0   # the block reductions' partials
        # f64 is exempt from the spill check: libdevice's double exp / log are
        # calls that spill around the call (as in test_compile.py)
        spills = report.spill_bytes if dtype != "f64" else 0
        if spills or report.registers * spec.threads_per_block > 65536:
            problems.append(f"{spec.name}: {report.registers} registers, "
                            f"{report.spill_bytes} spill bytes")
    assert not problems, "\n".join(problems)


# -- GPU ------------------------------------------------------------------------------

NUMPY_DTYPES = {"f16": numpy.dtype(numpy.float16), "bf16": BFLOAT16,
                "f32": numpy.dtype(numpy.float32), "f64": numpy.dtype(numpy.float64)}
FORWARD = {"softmax_backward": "softmax", "log_softmax_backward": "log_softmax"}


def forward_reference(op, x):
    """scipy.special.softmax / log_softmax over the last axis in float64, step for step."""
    x = numpy.asarray(x, dtype=numpy.float64)
    x_max = numpy.amax(x, axis=-1, keepdims=True)
    with numpy.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if op == "softmax":
            shifted = numpy.exp(x - x_max)
            return shifted / numpy.sum(shifted, axis=-1, keepdims=True)
        tmp = x - numpy.where(numpy.isfinite(x_max), x_max, 0.0)
        return tmp - numpy.log(numpy.sum(numpy.exp(tmp), axis=-1, keepdims=True))


def backward_reference(op, dy, y):
    dy, y = numpy.asarray(dy, dtype=numpy.float64), numpy.asarray(y, dtype=numpy.float64)
    if op == "softmax_backward":
        return (dy - numpy.sum(dy * y, axis=-1, keepdims=True)) * y
    return dy - numpy.exp(y) * numpy.sum(dy, axis=-1, keepdims=True)


def host_inputs(rng, op, shape, dtype):
    """The op's inputs as host arrays of `dtype`: x, or dy and a genuine forward output y."""
    x = rng.standard_normal(shape) * 4.0
    if op in FORWARD:
        y = forward_reference(FORWARD[op], x).astype(dtype)
        return [rng.standard_normal(shape).astype(dtype), y]
    return [x.astype(dtype)]


def reference(op, host):
    return forward_reference(op, host[0]) if op not in FORWARD else backward_reference(op, *host)


def check(op, actual, expected, dtype):
    """Forward against the dtype's tolerance (and softmax rows summing to 1);
    backward with the absolute tolerance scaled by the largest gradient (dx
    cancels: dy - sum(dy * y) can be near 0)."""
    actual = numpy.asarray(actual, dtype=numpy.float64)
    if op.endswith("_backward"):
        rtol = TOLERANCES[numpy.dtype(dtype)]["rtol"]
        scale = float(numpy.max(numpy.abs(expected)))
        numpy.testing.assert_allclose(actual, expected, rtol=rtol, atol=4 * rtol * scale)
        return
    assert_close(actual, expected, dtype)
    if op == "softmax" and numpy.isfinite(expected).all():
        numpy.testing.assert_allclose(actual.sum(axis=-1), 1.0, rtol=10 * TOLERANCES[numpy.dtype(dtype)]["rtol"])


def operand(array):
    from cupyops.rowwise import Operand

    return Operand(array, array.strides[0] // array.itemsize)


def poisoned(shape, dtype):
    import cupy

    return cupy.asarray(numpy.full(shape, numpy.nan, dtype=dtype))


def poisoned_like(array):
    return poisoned(array.shape, array.dtype)


def run_split(op, inputs, out, kind=None):
    """Runs the split kernels (of `kind`: "coop" or "two_launch", when given)
    and checks the coop counters are left zero."""
    from cupyops import arrays

    rows, cols = inputs[0].shape
    operands = [operand(a) for a in (*inputs, out)]
    align = arrays.alignment(*(v for o in operands for v in (o.byte_address, o.byte_row_stride)))
    same_phase = arrays.same_phase(*operands)
    if kind is not None:
        chosen = plan(op, rows, cols, dtypes.BY_DTYPE[out.dtype].short, Target.live(out.device.id), align,
                      same_phase)
        assert isinstance(chosen, ss.CoopPlan if kind == "coop" else ss.SplitPlan), chosen
    assert ss.run(op, operands[:-1], operands[-1], rows, cols, align, same_phase), "no split plan"
    assert all(int(counters.max()) == 0 for counters in ss._counters.values())
    return out


def run_plan(chosen, inputs, out):
    """Launches the split plan `chosen` on row operands (whatever their phases)
    and checks the coop counters are left zero."""
    rows, cols = inputs[0].shape
    ss.launch(chosen, ss.functions_of(chosen, out.device.id), [operand(a) for a in inputs], operand(out),
              rows, cols)
    assert all(int(counters.max()) == 0 for counters in ss._counters.values())
    return out


GPU_SHAPES = [(1, 300001), (3, 2**20), (8, 2**20 + 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_long_rows(op, dtype, rng, split_kind):
    import cupy

    for shape in GPU_SHAPES:
        host = host_inputs(rng, op, shape, NUMPY_DTYPES[dtype])
        inputs = [cupy.asarray(a) for a in host]
        out = run_split(op, inputs, poisoned_like(inputs[0]), split_kind if shape[1] % 2 == 0 else None)
        check(op, out.get(), reference(op, host), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("f16", "f32"))
@pytest.mark.parametrize("op", OPS)
def test_coop_rounds(op, dtype, rng):
    """More rows than slots: each slot takes several rows in turn (both
    halves of the partials, the counters counting past one row)."""
    import cupy

    shape = (300, 2**17)
    host = host_inputs(rng, op, shape, NUMPY_DTYPES[dtype])
    inputs = [cupy.asarray(a) for a in host]
    device_id = inputs[0].device.id
    chosen = ss.coop_plan(op, *shape, dtype, Target.live(device_id))   # forward: clusters planned
    assert isinstance(chosen, ss.CoopPlan) and chosen.slots < shape[0] // 2
    out = poisoned_like(inputs[0])
    ss.launch(chosen, ss.functions_of(chosen, device_id), [operand(a) for a in inputs], operand(out),
              *shape)
    assert all(int(counters.max()) == 0 for counters in ss._counters.values())
    check(op, out.get(), reference(op, host), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("f16", "f32"))
@pytest.mark.parametrize("op", OPS)
def test_rows_of_2_to_the_24(op, dtype, rng):
    """The longest rows the issue names, through the public functions."""
    import cupy

    import cupyops

    shape = (2, 2**24) if dtype == "f16" else (1, 2**24)
    host = host_inputs(rng, op, shape, NUMPY_DTYPES[dtype])
    inputs = [cupy.asarray(a) for a in host]
    out = getattr(cupyops, op)(*inputs, axis=-1)
    if op == "softmax":   # no sum-to-1 check: 2**24 float16 outputs of ~6e-8 are subnormal
        assert_close(out.get(), reference(op, host), NUMPY_DTYPES[dtype])
    else:
        check(op, out.get(), reference(op, host), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_small_shapes_every_edge(op, dtype, rng, split_everywhere, split_kind):
    """Short rows split into chunks shorter than a block's sweep (SMALL_SHAPES)."""
    import cupy

    for shape in SMALL_SHAPES:
        host = host_inputs(rng, op, shape, NUMPY_DTYPES[dtype])
        inputs = [cupy.asarray(a) for a in host]
        # coop packs of contiguous rows (one phase in every operand): at least COOP_MIN_PEELABLE_PACK_BYTES
        wide = vector_pack_size(shape[1], ITEMSIZE[dtype], 16) * ITEMSIZE[dtype] >= TUNE.COOP_MIN_PEELABLE_PACK_BYTES
        out = run_split(op, inputs, poisoned_like(inputs[0]), split_kind if wide else "two_launch")
        check(op, out.get(), reference(op, host), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_strided_and_misaligned_rows(op, dtype, rng):
    """Rows of every operand spaced apart by their own strides; inputs one
    element off the 16-byte grid (scalar loads), the output aligned."""
    import cupy

    rows, cols = 4, 2**18 + 64
    host = host_inputs(rng, op, (rows, cols), NUMPY_DTYPES[dtype])
    inputs = []
    for a in host:
        base = numpy.zeros((rows, cols + 9), a.dtype)
        base[:, 1:cols + 1] = a
        inputs.append(cupy.asarray(base)[:, 1:cols + 1])
    out_base = poisoned((rows, cols + 32), host[0].dtype)
    out = out_base[:, :cols]
    p = plan(op, rows, cols, dtype, Target.live(inputs[0].device.id), ITEMSIZE[dtype], same_phase=False)
    assert p is not None and p.spec.pack_size == 1
    run_split(op, inputs, out)
    check(op, out.get(), reference(op, host), NUMPY_DTYPES[dtype])
    assert numpy.isnan(out_base[:, cols:].get().astype(numpy.float64)).all()   # nothing past the rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ("softmax", "log_softmax"))
def test_nan_and_inf_rows(op, dtype, rng, split_kind):
    """NaN / +-inf rows end as in scipy.special, wherever in the row (which chunk) they sit."""
    import cupy

    cols = 2**19 + 8
    host = (rng.standard_normal((10, cols)) * 4.0)
    host[0, 12345] = numpy.nan              # NaN: the whole row NaN
    host[1, cols - 1] = numpy.inf           # +inf in the last chunk
    host[2, 0] = numpy.inf                  # +inf in the first chunk ...
    host[2, 300000] = -numpy.inf            # ... and -inf elsewhere
    host[3] = -numpy.inf                    # every element -inf
    host[4, : cols // 2] = -numpy.inf       # the first chunks all -inf
    host[5, ::7] = -numpy.inf               # -inf scattered
    host[6, 100] = numpy.inf                # +inf and NaN
    host[6, 200000] = numpy.nan
    host[7, 5] = numpy.inf                  # +inf twice
    host[7, cols - 5] = numpy.inf
    host[8, cols // 2:] = -numpy.inf        # the last chunks all -inf
    host = host.astype(NUMPY_DTYPES[dtype])
    x = cupy.asarray(host)
    out = run_split(op, [x], poisoned_like(x), split_kind)
    assert_close(out.get(), forward_reference(op, host), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_peeled_two_launch_rows(op, dtype, rng):
    """Odd rows (each at its own phase, every operand at the same one) in two
    launches peeled: 16-byte packs between single-element edges, which the
    row's first chunk takes; NaN and +-inf at rows' first and last elements,
    into a poisoned output and in place."""
    import cupy

    rows, cols = 11, 2**17 + 3
    host = host_inputs(rng, op, (rows, cols), NUMPY_DTYPES[dtype])
    if op not in FORWARD:
        values = host[0].astype(numpy.float64)
        values[1, 0], values[2, -1], values[3, 0], values[3, -1] = numpy.inf, numpy.nan, -numpy.inf, numpy.inf
        host = [values.astype(NUMPY_DTYPES[dtype])]
    expected = reference(op, host)
    device_id = cupy.cuda.runtime.getDevice()
    chosen = ss.two_launch_plan(op, rows, cols, dtype, Target.live(device_id))
    assert chosen.spec.peel and chosen.spec.pack_size * ITEMSIZE[dtype] == 16, chosen.spec.name
    for position in (None, *range(len(host))):
        inputs = [cupy.asarray(a) for a in host]
        out = poisoned_like(inputs[0]) if position is None else inputs[position]
        ss.launch(chosen, ss.functions_of(chosen, device_id), [operand(a) for a in inputs], operand(out),
                  rows, cols)
        actual = out.get()
        if op in FORWARD:
            check(op, actual, expected, NUMPY_DTYPES[dtype])
        else:
            assert_close(actual, expected, NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_in_place(op, dtype, rng, split_kind):
    """out = x forward; out = dy and out = y backward."""
    import cupy

    shape = (8, 2**20 + 8)
    host = host_inputs(rng, op, shape, NUMPY_DTYPES[dtype])
    expected = reference(op, host)
    for position in range(len(host)):
        inputs = [cupy.asarray(a) for a in host]
        run_split(op, inputs, inputs[position], split_kind)
        check(op, inputs[position].get(), expected, NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_coop_prefetch(op, in_place, rng):
    """float32 rows in several rounds a slot, each next row prefetched into
    shared memory: 16-byte packs with a short last chunk, and 4-byte packs."""
    import cupy

    for shape in [(16, 2**20 + 4), (8, 2**20 + 7)]:
        host = host_inputs(rng, op, shape, numpy.float32)
        x = cupy.asarray(host[0])
        # 4-byte packs: coop where the operands' rows are at different phases (else peeled two launches)
        chosen = plan(op, *shape, "f32", Target.live(x.device.id), 16 if shape[1] % 4 == 0 else 4,
                      same_phase=shape[1] % 4 == 0)
        assert isinstance(chosen, ss.CoopPlan) and chosen.spec.prefetch and chosen.slots < shape[0]
        out = run_plan(chosen, [x], x if in_place else poisoned_like(x))
        check(op, out.get(), reference(op, host), numpy.float32)


# (dtype, shape) whose rows take one round with chunks held partly in
# shared memory: 16-byte packs whose last chunk ends in a thread's first
# register pack (2**20 + 4 and 2**20 + 8 columns) or among the threads'
# shared packs (63 x 16384 + 7180 columns), 4-byte float32 packs
# (2**20 + 7 columns) and 8-byte bfloat16 packs (2**20 + 4).
SHARED_PACK_CASES = {
    "forward": [("f32", (8, 2**20 + 4)), ("f32", (8, 63 * 16384 + 7180)), ("f16", (16, 2**20 + 8)),
                ("f32", (3, 2**20 + 7))],
    "backward": [("f16", (8, 2**20 + 8)), ("f32", (4, 63 * 16384 + 7180)), ("bf16", (8, 2**20 + 4))],
}


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_coop_shared_packs(op, in_place, rng):
    """Rows in one round, each thread's chunk held partly in shared memory
    (SHARED_PACK_CASES); in place: out = x forward, out = y backward."""
    import cupy

    for dtype, shape in SHARED_PACK_CASES["backward" if op in FORWARD else "forward"]:
        host = host_inputs(rng, op, shape, NUMPY_DTYPES[dtype])
        inputs = [cupy.asarray(a) for a in host]
        align = arrays.alignment(*(value for a in inputs for value in (a.data.ptr, a.strides[0])))
        # 4-byte packs: coop where the operands' rows are at different phases (else peeled two launches)
        chosen = plan(op, *shape, dtype, Target.live(inputs[0].device.id), align, same_phase=shape[1] % 2 == 0)
        assert isinstance(chosen, ss.CoopPlan) and chosen.spec.shared_packs > 0 and chosen.slots == shape[0]
        out = run_plan(chosen, inputs, inputs[-1] if in_place else poisoned_like(inputs[0]))
        check(op, out.get(), reference(op, host), NUMPY_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_repeatable(op, rng, split_kind):
    """The partials are combined in a fixed order: the same result bit for bit."""
    import cupy

    host = host_inputs(rng, op, (3, 2**20), numpy.float32)
    inputs = [cupy.asarray(a) for a in host]
    first = run_split(op, inputs, poisoned_like(inputs[0]), split_kind)
    second = run_split(op, inputs, poisoned_like(inputs[0]), split_kind)
    assert cupy.array_equal(first, second)

