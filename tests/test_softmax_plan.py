"""CPU tests of the softmax planner, kernel names and rendering (SPEC §3, §4, §5).

policy="oneflow" is checked against tables written from the text of SPEC §5
(OneFlow's dispatch), not by calling the planner's helpers. policy="auto" is
checked against the rules documented in cupyops/ops/softmax_rows.py (its tunable
thresholds are read from the module constants; the rules are restated here).
Plans whose path depends on occupancy compile their candidate kernels with
NVRTC for the profile's arch: no GPU is needed.
"""
from __future__ import annotations

import re

import jinja2
import jinja2.meta
import pytest

from cupyops import device, jit
from cupyops.launch import BLOCK_SIZE_LADDER, Target, choose_block_size
from cupyops.ops import row_packs
from cupyops.ops import softmax_rows as sm
from cupyops.ops.row_packs import vector_pack_size
from cupyops.ops.softmax_rows import SoftmaxSpec, plan
from cupyops.profile import profile_for

TARGETS = {"h100": Target.profile("h100"), "a100": Target.profile("a100")}
H100 = TARGETS["h100"]
TUNE = profile_for(H100.facts)   # the tuning values the H100 plans read
A100 = TARGETS["a100"]
OPS = ("softmax", "log_softmax")
ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
COMPUTE_ITEMSIZE = {"f16": 4, "bf16": 4, "f32": 4, "f64": 8}
NON_OPT_IN_SMEM = 48 * 1024      # shared memory a block may use without opting in

# SPEC §9's default sweep and its long sweep.
DEFAULT_SWEEP_COLS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                      1000, 1536, 3000, 12345)
LONG_SWEEP_COLS = (65536, 131072, 262144)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def get_num_blocks(facts, block_size: int, max_blocks: int) -> int:
    """SPEC §4: GetNumBlocks(block_size, max_blocks, waves=32)."""
    return max(1, min(max_blocks, facts.sm_count * facts.max_threads_per_sm // block_size * 32))


def occupancy(target: Target, spec: SoftmaxSpec, dynamic_smem: int, opt_in: bool) -> int:
    """Active blocks per SM of `spec` on a profile, by CUDA's rules: the block's
    static + dynamic shared memory must stay within 48 KB unless the kernel opts
    in, and within the device's opt-in limit when it does."""
    report = jit.compile_cubin(spec, target.facts.arch)
    total = report.smem_bytes + dynamic_smem
    if total > (target.facts.smem_per_block_optin if opt_in else NON_OPT_IN_SMEM):
        return 0
    return device.max_active_blocks(target.facts, spec.block_size, report.registers, total,
                                    spec.block_size)


def oneflow_block_size(target, spec_of, dynamic_smem, opt_in=False):
    """SPEC §4: occupancy at 128 first (0: impossible), then the first of 1024, 512,
    256 with the same number of active blocks, else 128."""
    at_128 = occupancy(target, spec_of(128), dynamic_smem, opt_in)
    if at_128 == 0:
        return None
    for block_size in (1024, 512, 256):
        if occupancy(target, spec_of(block_size), dynamic_smem, opt_in) == at_128:
            return block_size
    return 128


# -- OneFlow: the warp path ---------------------------------------------------------

def warp_shape(cols: int, rows: int, pack: int):
    """(pack, cols_per_thread, width, rows_per_access, padding) of the warp path, in
    SPEC §5's words: narrow rows take the smallest power-of-two group of lanes
    holding one pack each (two rows per access when rows is even); wider rows a
    full warp with the fewest packs per lane (one row per access); padded lanes
    when the lanes hold more than the row."""
    packs = ceil_div(cols, pack)
    if packs <= 32:
        width = 1
        while width < packs:
            width *= 2
        return pack, pack, width, 2 if rows % 2 == 0 else 1, cols != pack * width
    cols_per_thread = pack * ceil_div(cols, 32 * pack)
    return pack, cols_per_thread, 32, 1, cols != cols_per_thread * 32


def oneflow_warp_expectation(cols: int, rows: int):
    """OneFlow packs 2 elements when cols is even, else 1 (SPEC §5)."""
    return warp_shape(cols, rows, 2 if cols % 2 == 0 else 1)


# Worked by hand for the H100 profile (132 SMs x 2048 threads): the warp grid is
# GetNumBlocks(128, ceil(ceil(rows / rows_per_access) / (128 / width))), capped at
# 132 * 2048 / 128 * 32 = 67584 blocks.
ONEFLOW_WARP_GOLDEN = [
    # cols, rows, pack, cols/thread, width, rows/access, padding, block, grid
    (1, 49152, 1, 1, 1, 2, False, (1, 128, 1), 192),          # 24576 pairs / 128 groups
    (1, 49151, 1, 1, 1, 1, False, (1, 128, 1), 384),          # ceil(49151 / 128)
    (2, 49152, 2, 2, 1, 2, False, (1, 128, 1), 192),
    (3, 49152, 1, 1, 4, 2, True, (4, 32, 1), 768),            # 24576 / 32
    (5, 7, 1, 1, 8, 1, True, (8, 16, 1), 1),                  # ceil(7 / 16)
    (32, 49152, 2, 2, 16, 2, False, (16, 8, 1), 3072),        # 24576 / 8
    (33, 49151, 1, 2, 32, 1, True, (32, 4, 1), 12288),        # ceil(49151 / 4)
    (64, 49152, 2, 2, 32, 2, False, (32, 4, 1), 6144),
    (66, 49152, 2, 4, 32, 1, True, (32, 4, 1), 12288),
    (1000, 49152, 2, 32, 32, 1, True, (32, 4, 1), 12288),
    (1023, 49151, 1, 32, 32, 1, True, (32, 4, 1), 12288),
    (64, 1_000_001, 2, 2, 32, 1, False, (32, 4, 1), 67584),   # 250001 capped
    (7, 1_000_000, 1, 1, 8, 2, True, (8, 16, 1), 31250),      # 500000 / 16
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "cols, rows, pack, cols_per_thread, width, rows_per_access, padding, block, grid",
    ONEFLOW_WARP_GOLDEN, ids=[f"c{g[0]}-r{g[1]}" for g in ONEFLOW_WARP_GOLDEN])
def test_oneflow_warp_golden(op, cols, rows, pack, cols_per_thread, width, rows_per_access,
                             padding, block, grid):
    p = plan(op, rows, cols, "f16", "oneflow", H100)
    assert (p.spec.impl, p.spec.pack_size, p.spec.cols_per_thread, p.spec.thread_group_width,
            p.spec.rows_per_access, p.spec.padding) == (
        "warp", pack, cols_per_thread, width, rows_per_access, padding)
    assert p.block == block and p.grid == (grid, 1, 1) and p.smem_bytes == 0


@pytest.mark.parametrize("rows", [49152, 49151, 1, 2, 3, 1_000_000, 1_000_001])
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("profile", sorted(TARGETS))
def test_oneflow_warp_table_every_cols(profile, op, dtype, rows):
    """Every cols of the warp range: softmax while cols < 1024, log-softmax cols <= 1024."""
    target = TARGETS[profile]
    last = 1023 if op == "softmax" else 1024
    wrong = []
    for cols in range(1, last + 1):
        pack, cols_per_thread, width, rows_per_access, padding = oneflow_warp_expectation(cols, rows)
        groups = 128 // width
        expected = {
            "op": op, "impl": "warp", "pack_size": pack, "cols_per_thread": cols_per_thread,
            "thread_group_width": width, "rows_per_access": rows_per_access, "padding": padding,
            "block": [width, groups, 1],
            "grid": [get_num_blocks(target.facts, 128,
                                    ceil_div(ceil_div(rows, rows_per_access), groups)), 1, 1],
            "smem_bytes": 0,
        }
        got = plan(op, rows, cols, dtype, "oneflow", target).explain()
        got = {key: got[key] for key in expected}
        if got != expected:
            wrong.append(f"cols={cols}: got {got}, expected {expected}")
    assert not wrong, f"{len(wrong)} of {last} plans differ, e.g.\n" + "\n".join(wrong[:5])


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_oneflow_warp_limits(dtype):
    # forward softmax: warp iff cols < 1024; log-softmax: iff cols <= 1024
    assert plan("softmax", 64, 1023, dtype, "oneflow", H100).spec.impl == "warp"
    assert plan("softmax", 64, 1024, dtype, "oneflow", H100).spec.impl == "block_smem"
    assert plan("log_softmax", 64, 1024, dtype, "oneflow", H100).spec.impl == "warp"
    assert plan("log_softmax", 64, 1025, dtype, "oneflow", H100).spec.impl == "block_smem"


def test_oneflow_pack_needs_alignment():
    # pack 2 of float16 is a 4-byte access: a 2-byte aligned view falls back to pack 1
    assert plan("softmax", 64, 512, "f16", "oneflow", H100, align=2).spec.pack_size == 1
    assert plan("softmax", 64, 512, "f16", "oneflow", H100, align=4).spec.pack_size == 2
    assert plan("softmax", 64, 512, "f32", "oneflow", H100, align=4).spec.pack_size == 1


# -- OneFlow: the block paths -------------------------------------------------------

ONEFLOW_BLOCK_CASES = [
    # cols, expected path. float32 compute: 48 KB hold 12288 columns, less the
    # static shared memory of the block reduction (32 bytes at 128 threads, 256
    # at 1024), which must fit in the same 48 KB.
    (1024, "block_smem"), (1025, "block_smem"), (1026, "block_smem"), (2048, "block_smem"),
    (4096, "block_smem"), (12000, "block_smem"),
    (12280, "block_smem"),          # 128 threads only: 512 need 128 bytes more than 48 KB
    (12288, "block_uncached"),      # 48 KB of cache leave no room for the reduction
    (12289, "block_uncached"), (20000, "block_uncached"), (65536, "block_uncached"),
]


@pytest.mark.parametrize("cols, path", ONEFLOW_BLOCK_CASES)
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("op", OPS)
def test_oneflow_block_paths(op, dtype, cols, path):
    if op == "log_softmax" and cols == 1024:
        pytest.skip("log-softmax keeps the warp path at 1024 columns")
    target, rows = H100, 49152
    p = plan(op, rows, cols, dtype, "oneflow", target)
    pack = 2 if cols % 2 == 0 else 1
    assert p.spec.impl == path
    assert p.spec.pack_size == pack
    if path == "block_smem":
        def spec_of(block_size):
            return SoftmaxSpec(op, "block_smem", dtype, pack, block_size=block_size)
        block_size = oneflow_block_size(target, spec_of, cols * 4)
        assert p.spec == spec_of(block_size)
        assert p.smem_bytes == cols * 4                  # float32 cache, OneFlow's layout
        assert p.spec.name.endswith("_strided")
    else:
        assert p.spec.block_size == 1024 and not p.spec.online and p.smem_bytes == 0
        assert p.spec.name.endswith("_3pass")
    block_size = p.spec.block_size
    assert p.block == (block_size, 1, 1)
    assert p.grid == (get_num_blocks(target.facts, block_size, rows), 1, 1)


@pytest.mark.parametrize("rows, grid", [(3, 3), (49152, 49152), (10**6, 67584)])
def test_oneflow_block_smem_grid(rows, grid):
    # 2048 columns of float32 cache (8 KB) stay at 128 threads; grid =
    # GetNumBlocks(128, rows) = min(rows, 132 * 2048 / 128 * 32 = 67584)
    p = plan("softmax", rows, 2048, "f32", "oneflow", H100)
    assert (p.spec.impl, p.block, p.grid) == ("block_smem", (128, 1, 1), (grid, 1, 1))


def test_oneflow_block_smem_a100():
    target = TARGETS["a100"]
    for cols in (2048, 4096, 12000):
        p = plan("softmax", 49152, cols, "f32", "oneflow", target)
        spec_of = lambda b: SoftmaxSpec("softmax", "block_smem", "f32", 2, block_size=b)  # noqa: E731
        assert p.spec == spec_of(oneflow_block_size(target, spec_of, cols * 4))
        assert p.grid == (get_num_blocks(target.facts, p.spec.block_size, 49152), 1, 1)
    assert plan("softmax", 49152, 12289, "f32", "oneflow", target).spec.impl == "block_uncached"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cols", [1, 2, 3, 33, 1000, 1023, 1024, 1025, 4096, 12345, 300000])
def test_oneflow_float64_is_always_uncached(op, cols):
    for rows, grid in ((3, 3), (49152, 8448)):     # 132 * 2048 / 1024 * 32 = 8448
        p = plan(op, rows, cols, "f64", "oneflow", H100)
        assert (p.spec.impl, p.spec.block_size, p.spec.online) == ("block_uncached", 1024, False)
        assert p.spec.pack_size == (2 if cols % 2 == 0 else 1)
        assert p.block == (1024, 1, 1) and p.grid == (grid, 1, 1) and p.smem_bytes == 0


class FakeTarget:
    """Occupancy by block size, recording what choose_block_size asks."""

    def __init__(self, active: dict):
        self.active, self.asked = active, []

    def max_active_blocks(self, spec, block_size, dynamic_smem, opt_in):
        self.asked.append((spec, block_size, dynamic_smem, opt_in))
        return self.active.get(block_size, 0)


@pytest.mark.parametrize("active, expected", [
    ({128: 0, 256: 8, 512: 4, 1024: 2}, None),      # cannot launch at 128: path impossible
    ({128: 4, 256: 4, 512: 4, 1024: 2}, 512),       # first of 1024, 512, 256 matching 128
    ({128: 2, 256: 2, 512: 2, 1024: 2}, 1024),
    ({128: 4, 256: 4, 512: 2, 1024: 1}, 256),
    ({128: 12, 256: 8, 512: 4, 1024: 2}, 128),      # none matches: 128
    ({128: 3, 256: 4, 512: 4, 1024: 4}, 128),       # more than at 128 is not "equal"
], ids=["impossible", "512", "1024", "256", "fallback-128", "more-is-not-equal"])
def test_choose_block_size_rule(active, expected):
    target = FakeTarget(active)
    assert BLOCK_SIZE_LADDER == (1024, 512, 256)
    assert choose_block_size(target, lambda b: f"spec{b}", 4096, False) == expected
    assert target.asked[0] == ("spec128", 128, 4096, False)
    assert all(spec == f"spec{b}" and smem == 4096 and not opt_in
               for spec, b, smem, opt_in in target.asked)


def test_profile_occupancy_counts_static_shared_memory_at_48k():
    spec = SoftmaxSpec("softmax", "block_smem", "f32", 2, block_size=128)
    static = jit.compile_cubin(spec, "sm_90").smem_bytes
    assert static > 0
    # 48 KB - static fits without opt-in: 233472 // round_up(49152 + 1024, 128) = 4
    assert H100.max_active_blocks(spec, 128, NON_OPT_IN_SMEM - static, False) == 4
    assert H100.max_active_blocks(spec, 128, NON_OPT_IN_SMEM + 4, False) == 0
    assert H100.max_active_blocks(spec, 128, H100.facts.smem_per_block_optin + 1, True) == 0


def test_profile_occupancy_48k_dynamic_plus_static_needs_opt_in():
    spec = SoftmaxSpec("softmax", "block_smem", "f32", 2, block_size=128)
    assert H100.max_active_blocks(spec, 128, NON_OPT_IN_SMEM, False) == 0


# -- auto ---------------------------------------------------------------------------

@pytest.mark.parametrize("cols, itemsize, align, pack", [
    (1024, 2, 16, 8), (1000, 2, 16, 8), (1004, 2, 16, 4), (1002, 2, 16, 2), (1001, 2, 16, 1),
    (12, 2, 16, 4), (1024, 4, 16, 4), (1022, 4, 16, 2), (1023, 4, 16, 1), (1024, 8, 16, 2),
    (1023, 8, 16, 1),
    # views off the 16-byte grid: the alignment caps the pack
    (1024, 2, 8, 4), (1024, 2, 4, 2), (1024, 2, 2, 1), (1024, 4, 8, 2), (1024, 4, 4, 1),
    (1024, 8, 8, 1), (1000, 2, 4, 2), (1001, 2, 8, 1),
])
def test_vector_pack_size(cols, itemsize, align, pack):
    assert vector_pack_size(cols, itemsize, align) == pack


def auto_pack(cols: int, dtype: str, align: int = 16) -> int:
    """The largest power of two p with p * itemsize <= min(16, align) dividing cols."""
    for pack in (16, 8, 4, 2):
        if pack * ITEMSIZE[dtype] <= min(16, align) and cols % pack == 0:
            return pack
    return 1


def auto_expectation(op, dtype, rows, cols, target, align=16, same_phase=True) -> dict:
    """What policy="auto" must choose, path by path in order (rules of ops/softmax_rows.py)."""
    facts = target.facts
    tuned = profile_for(facts)
    itemsize, compute = ITEMSIZE[dtype], COMPUTE_ITEMSIZE[dtype]
    pack = auto_pack(cols, dtype, align)
    # 1. rows off the 16-byte grid (input and output the same way) of at least
    # AUTO_PEELED_SMALL_MIN_COLS: a peeled register block of 32 threads (two
    # rows a block, a warp each), else 64, the first giving a thread at most
    # AUTO_PEELED_SMALL_MAX_PACKS 16-byte packs; 16-bit rows held as loaded
    vec = 16 // itemsize
    if pack < vec and same_phase and cols >= tuned.AUTO_PEELED_SMALL_MIN_COLS:
        for block_size, rows_per_block in ((32, row_packs.AUTO_PEELED_SMALL_WARP_ROWS), (64, 1)):
            per_thread = ceil_div(cols // vec, block_size)
            if per_thread <= tuned.AUTO_PEELED_SMALL_MAX_PACKS:
                spec = SoftmaxSpec(op, "block_regs", dtype, vec, block_size=block_size,
                                   packs_per_thread=per_thread, rows_per_block=rows_per_block, peel=True,
                                   storage_cache=itemsize == 2)
                assert occupancy(target, spec, 0, False) * block_size * rows_per_block >= 384
                return {"impl": "block_regs", "spec": spec, "smem_bytes": 0,
                        "grid": get_num_blocks(facts, block_size * rows_per_block, ceil_div(rows, rows_per_block))}
    # 2. warp: while a lane holds at most 128 bytes of compute values; rows of
    # at most 8 odd cols (16-bit, float32) in the narrowest group whose lanes
    # hold at most 5 elements (forward) or 4 (backward)
    if pack == 1 and cols <= 8 and itemsize in (2, 4):
        most = 4 if op.endswith("_backward") else 5
        width = next(w for w in (1, 2, 4, 8) if ceil_div(cols, w) <= most)
        return {"impl": "warp", "pack_size": pack, "narrow": (ceil_div(cols, width), width)}
    if cols <= 32 * pack or pack * ceil_div(cols, 32 * pack) * compute <= tuned.AUTO_WARP_MAX_BYTES_PER_LANE:
        return {"impl": "warp", "pack_size": pack}
    # 3. cp.async into shared memory (16-byte packs only), the maximum and sum in
    # one pass: the first rung (cluster, threads, most tail packs, blocks an SM)
    # of the type's ladder that holds the row, each block of the cluster (sm_90+)
    # holding a part of the row, its last packs (the largest tail up to `most`
    # that does not spill) in registers, the rest in shared memory. Rows of 24 KB
    # and more try it before the register path.
    def async_plan():
        if pack * itemsize != 16:
            return None
        row_packs = cols // pack
        room = facts.smem_per_block_optin // 16          # packs a block's shared memory holds
        for cluster, block, most, min_blocks in tuned.AUTO_ASYNC_LADDERS[1, itemsize]:
            if cluster > 1 and not device.has_clusters(facts.arch):
                continue
            fewest = max(1, ceil_div(row_packs - cluster * room, cluster * block))
            tails = range(min(most, row_packs // (cluster * block)), fewest - 1, -1) if most else [0]
            for tail in tails:
                share = ceil_div(row_packs - cluster * tail * block, cluster) * 16
                if share > facts.smem_per_block_optin:
                    continue
                spec = SoftmaxSpec(op, "block_async", dtype, pack, block_size=block, stages=1, online=True,
                                   cluster_size=cluster, tail_packs=tail)
                report = jit.compile_cubin(spec, facts.arch)
                if tail and report.spill_bytes + report.stack_bytes:
                    continue
                if occupancy(target, spec, share, True) >= min_blocks:
                    return {"impl": "block_async", "spec": spec, "smem_bytes": share, "grid": rows * cluster}
        return None

    if cols * itemsize >= 24 * 1024 and async_plan() is not None:
        return async_plan()
    # 4. register block: 16-byte packs (peeling the row's edges when the row is
    # off the 16-byte grid the same way for input and output), the smallest block
    # giving a thread at most MAX_PACKS packs (PEELED_MAX_PACKS when peeled; by
    # itemsize and inputs) within MAX_BYTES a block, with MIN_RESIDENT threads of
    # it an SM; 16-bit rows held as loaded
    peel = pack * itemsize < 16 and same_phase
    regs_pack = 16 // itemsize if peel else pack
    key = (itemsize, 2 if op.endswith("_backward") else 1)
    max_packs = (tuned.AUTO_PEELED_MAX_PACKS.get(key, 8) if peel else tuned.AUTO_BLOCK_REGS_MAX_PACKS.get(key, 4))
    packs = cols // regs_pack
    largest = tuned.AUTO_BLOCK_REGS_LARGEST.get(op, sm.AUTO_BLOCK_REGS_SIZES[-1])
    for block_size in [size for size in sm.AUTO_BLOCK_REGS_SIZES if size <= largest]:
        per_thread = ceil_div(packs, block_size)
        if (per_thread <= max_packs
                and per_thread * regs_pack * compute * block_size <= tuned.AUTO_BLOCK_REGS_MAX_BYTES):
            spec = SoftmaxSpec(op, "block_regs", dtype, regs_pack, block_size=block_size,
                               packs_per_thread=per_thread, peel=peel, storage_cache=itemsize == 2)
            if occupancy(target, spec, 0, False) * block_size >= tuned.AUTO_BLOCK_REGS_MIN_RESIDENT:
                return {"impl": "block_regs", "spec": spec, "smem_bytes": 0,
                        "grid": get_num_blocks(facts, block_size, rows)}
    # then cp.async for the shorter rows the register path leaves
    if async_plan() is not None:
        return async_plan()
    row_bytes = cols * itemsize
    # 5. shared memory filled through registers, the input's own type cached,
    # 1024 threads but for 16-bit rows (and float64: 256); rows off the 16-byte
    # grid at one phase in every operand peel their edges and cache 16-byte
    # packs, 512 threads (float64: 256)
    if peel:
        block_size = 256 if itemsize == 8 else 512
    else:
        block_size = 256 if itemsize in (2, 8) else 1024
    spec = SoftmaxSpec(op, "block_smem", dtype, regs_pack, block_size=block_size, storage_cache=True, peel=peel)
    if occupancy(target, spec, row_bytes, True):
        return {"impl": "block_smem", "spec": spec, "smem_bytes": row_bytes,
                "grid": get_num_blocks(facts, spec.block_size, rows)}
    # 6. two passes over global memory, online max and sum, 1024 threads (peeled
    # as in 5: 512)
    block_size = 512 if peel else 1024
    spec = SoftmaxSpec(op, "block_uncached", dtype, regs_pack, block_size=block_size, online=True, peel=peel)
    return {"impl": "block_uncached", "spec": spec, "smem_bytes": 0,
            "grid": get_num_blocks(facts, block_size, rows)}


def _optin_cols(target, dtype):
    """Columns around the largest row the profile's opt-in shared memory holds."""
    limit = target.facts.smem_per_block_optin // ITEMSIZE[dtype]
    step = 16 // ITEMSIZE[dtype]
    return [limit - 32 * step, limit - 8 * step, limit, limit + step, limit + 1]


AUTO_BOUNDARY_COLS = (1, 2, 3, 5, 6, 7, 9, 31, 33, 253, 255, 257, 511, 512, 513, 521, 1023, 1025, 1029, 1031, 1033, 2049,
                      2057, 4097, 8193, 16385, 16392, 32769)


@pytest.mark.parametrize("rows", [49152, 49151])
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("profile", sorted(TARGETS))
def test_auto_rules(profile, dtype, rows):
    target = TARGETS[profile]
    cols_list = sorted(set(DEFAULT_SWEEP_COLS + LONG_SWEEP_COLS + AUTO_BOUNDARY_COLS)
                       | set(_optin_cols(target, dtype)))
    wrong = []
    for op in OPS:
        for cols in cols_list:
            p = plan(op, rows, cols, dtype, "auto", target)
            expected = auto_expectation(op, dtype, rows, cols, target)
            if expected["impl"] == "warp":
                pack = expected["pack_size"]
                _, cols_per_thread, width, rows_per_access, padding = warp_shape(cols, rows, pack)
                if "narrow" in expected:
                    cols_per_thread, width = expected["narrow"]
                    padding = cols != cols_per_thread * width
                # auto takes one row per access for 16-bit types
                rows_per_access = profile_for(target.facts).AUTO_WARP_ROWS_PER_ACCESS.get(ITEMSIZE[dtype], rows_per_access)
                ok = (p.spec == SoftmaxSpec(op, "warp", dtype, pack, cols_per_thread=cols_per_thread,
                                            thread_group_width=width, rows_per_access=rows_per_access,
                                            padding=padding)
                      and p.block == (width, 128 // width, 1) and p.smem_bytes == 0
                      and p.grid == (get_num_blocks(target.facts, 128, ceil_div(
                          ceil_div(rows, rows_per_access), 128 // width)), 1, 1))
            else:
                spec = expected["spec"]
                ok = (p.spec == spec and p.block == (spec.block_size, spec.rows_per_block, 1)
                      and p.grid == (expected["grid"], 1, 1) and p.smem_bytes == expected["smem_bytes"])
            if not ok:
                wrong.append(f"{op} cols={cols}: got {p}, expected {expected}")
    assert not wrong, f"{len(wrong)} plans differ:\n" + "\n".join(wrong[:5])


def test_auto_peels_short_rows_off_the_16_byte_grid():
    """Rows off the 16-byte grid from AUTO_PEELED_SMALL_MIN_COLS cols take a
    peeled register block before the warp path: one warp a row, two rows a
    block, while a thread holds at most four 16-byte packs; then two warps a
    row; then the register ladder. Shorter rows, operands at different
    phases and rows on the grid keep their paths."""
    rows = 49152
    assert (TUNE.AUTO_PEELED_SMALL_BLOCKS, TUNE.AUTO_PEELED_SMALL_MAX_PACKS, row_packs.AUTO_PEELED_SMALL_WARP_ROWS,
            TUNE.AUTO_PEELED_SMALL_MIN_COLS) == ((32, 64), 4, 2, 255)
    f16 = plan("softmax", rows, 1023, "f16", "auto", H100, align=2)
    assert f16.spec.name == "softmax_block_regs_f16_f32_p8_k4_b32x2_peel_packed"
    assert (f16.block, f16.grid, f16.smem_bytes) == ((32, 2, 1), (rows // 2, 1, 1), 0)
    assert f16.spec.threads_per_block == 64
    # 1031 cols: 128 packs, four a lane; 1033: 129, three a thread of two warps
    assert plan("softmax", rows, 1031, "bf16", "auto", H100, align=2).spec.block_size == 32
    wide = plan("log_softmax", rows, 1033, "bf16", "auto", H100, align=2)
    assert wide.spec.name == "log_softmax_block_regs_bf16_f32_p8_k3_b64_peel_packed"
    assert wide.block == (64, 1, 1)
    f32 = plan("softmax_backward", rows, 1023, "f32", "auto", H100, align=4)
    assert f32.spec.name == "softmax_backward_block_regs_f32_f32_p4_k4_b64_peel" and f32.block == (64, 1, 1)
    few = plan("log_softmax", 7, 255, "f64", "auto", H100, align=8)
    assert few.spec.name == "log_softmax_block_regs_f64_f64_p2_k4_b32x2_peel"
    assert (few.block, few.grid) == ((32, 2, 1), (4, 1, 1))     # the last block's second warp has no row
    # past two warps of four packs: the register ladder (128 threads, up to eight packs)
    assert plan("softmax", rows, 2057, "f16", "auto", H100, align=2).spec.name.endswith("_k3_b128_peel_packed")
    assert plan("softmax", rows, 253, "f16", "auto", H100, align=2).spec.impl == "warp"
    assert plan("softmax", rows, 1023, "f16", "auto", H100, align=2, same_phase=False).spec.impl == "warp"
    assert plan("softmax", rows, 1016, "f16", "auto", H100).spec.impl == "warp"
    assert plan("softmax", rows, 1023, "f16", "oneflow", H100, align=2).spec.impl == "warp"


@pytest.mark.parametrize("dtype, last_warp", [("f16", 1024), ("bf16", 1024), ("f32", 1024),
                                              ("f64", 512)])
def test_auto_warp_holds_at_most_128_bytes_per_lane(dtype, last_warp):
    # 128 bytes of float32 are 32 values a lane (1024 a warp), of float64 16 (512).
    # Odd rows whose operands share a phase peel (test_auto_peels_short_rows_off_the_16_byte_grid)
    for cols in (last_warp - 1, last_warp):
        p = plan("log_softmax", 64, cols, dtype, "auto", H100, same_phase=cols % 2 == 0).spec
        assert p.impl == "warp" and p.cols_per_thread * COMPUTE_ITEMSIZE[dtype] <= 128
    assert plan("log_softmax", 64, last_warp + 1, dtype, "auto", H100).spec.impl != "warp"
    assert plan("log_softmax", 64, 2 * last_warp + 512, dtype, "auto", H100).spec.impl == "block_regs"
    assert plan("softmax", 64, last_warp, dtype, "auto", H100).spec.impl == "warp"


@pytest.mark.parametrize("dtype, cols, pack", [("f16", 1024, 8), ("bf16", 1000, 8), ("f16", 1004, 4),
                                               ("f32", 1024, 4), ("f32", 1022, 2), ("f64", 256, 2),
                                               ("f16", 1001, 1)])
def test_auto_warp_uses_16_byte_packs(dtype, cols, pack):
    # rows off the 16-byte grid with operands at different phases (else they peel)
    chosen = plan("log_softmax", 64, cols, dtype, "auto", H100, same_phase=pack * ITEMSIZE[dtype] == 16).spec
    assert (chosen.impl, chosen.pack_size) == ("warp", pack)


def test_auto_alignment_and_phase():
    # a float16 row at a 2-byte offset, output at another phase: no vector pack on the warp path ...
    assert plan("softmax", 64, 1024, "f16", "auto", H100, align=2, same_phase=False).spec.pack_size == 1
    assert plan("softmax", 64, 1024, "f16", "auto", H100, align=4, same_phase=False).spec.pack_size == 2
    assert plan("softmax", 64, 1024, "f16", "auto", H100, align=8, same_phase=False).spec.pack_size == 4
    # ... at the same phase, a peeled register block of one warp a row (16-byte packs)
    assert plan("softmax", 64, 1024, "f16", "auto", H100, align=2).spec.name.endswith("_p8_k4_b32x2_peel_packed")
    # ... while the register block path peels the row's edges and keeps 16-byte
    # packs when input and output are off the grid by the same amount
    peeled = plan("softmax", 64, 4096, "f16", "auto", H100, align=2, same_phase=True).spec
    assert (peeled.impl, peeled.pack_size, peeled.peel) == ("block_regs", 8, True)
    plain = plan("softmax", 64, 4096, "f16", "auto", H100, align=2, same_phase=False).spec
    assert (plain.impl, plain.pack_size, plain.peel) == ("block_regs", 1, False)
    aligned = plan("softmax", 64, 4096, "f16", "auto", H100).spec
    assert (aligned.pack_size, aligned.peel) == (8, False)
    # beyond the register path, only 16-byte packs take cp.async
    assert plan("softmax", 64, 65536, "f16", "auto", H100).spec.impl == "block_async"
    assert plan("softmax", 64, 65536, "f16", "auto", H100, align=8).spec.impl != "block_async"


def test_auto_peels_rows_past_the_register_path():
    """Rows off the 16-byte grid past the register path (odd cols: each row at
    its own phase) keep 16-byte packs between their peeled edges where every
    operand shares each row's phase: cached in shared memory, or read again."""
    # 16-bit backward: 1024 threads bound to two blocks an SM where two rows fit
    both = plan("softmax_backward", 49152, 20001, "f16", "auto", H100)
    assert both.spec.name == "softmax_backward_block_smem_f16_f32_p8_b1024_packed_peel_mb2"
    assert both.smem_bytes == 2 * 20001 * 2 and both.block == (1024, 1, 1)
    assert H100.max_active_blocks(both.spec, 1024, both.smem_bytes, True) == 2
    one = plan("softmax_backward", 16384, 30001, "bf16", "auto", H100)     # one row fits
    assert one.spec.name == "softmax_backward_block_smem_bf16_f32_p8_b1024_packed_peel"
    # log-softmax backward caches dy alone (its sum's input) and reads y with the outputs
    dy_only = plan("log_softmax_backward", 16384, 30001, "bf16", "auto", H100)
    assert dy_only.spec.name == "log_softmax_backward_block_smem_bf16_f32_p8_b1024_packed_peel_cached1_mb2"
    assert dy_only.smem_bytes == 30001 * 2
    narrow = plan("log_softmax_backward", 459, 18246, "f32", "auto", H100, same_phase=False)
    assert (narrow.spec.name, narrow.smem_bytes) == (
        "log_softmax_backward_block_smem_f32_f32_p2_b1024_packed_cached1", 18246 * 4)
    assert plan("softmax", 49152, 40001, "f32", "auto", H100).spec.name == \
        "softmax_block_smem_f32_f32_p4_b512_packed_peel"
    assert plan("softmax", 287, 116863, "f16", "auto", H100).spec.name == \
        "softmax_block_uncached_f16_f32_p8_b512_online_peel"
    assert plan("softmax_backward", 287, 116863, "f32", "auto", H100).spec.name == \
        "softmax_backward_block_uncached_f32_f32_p4_b512_2pass_peel"
    # operands at different phases keep the packs the row's alignment allows
    narrow = plan("softmax_backward", 49152, 20001, "f16", "auto", H100, same_phase=False).spec
    assert (narrow.impl, narrow.pack_size, narrow.peel) == ("block_smem", 1, False)
    # OneFlow's plans do not peel, and cache every input
    oneflow = plan("log_softmax_backward", 49152, 3001, "f16", "oneflow", H100)
    assert (oneflow.spec.impl, oneflow.spec.peel, oneflow.smem_bytes) == ("block_smem", False, 2 * 3001 * 4)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("profile", sorted(TARGETS))
def test_auto_plans_fit_the_device(profile, dtype):
    """Every auto plan of the sweeps: at most 1024 threads, the whole row held by
    the path that caches it, static + dynamic shared memory within the opt-in limit."""
    target = TARGETS[profile]
    facts = target.facts
    for op in OPS:
        for cols in DEFAULT_SWEEP_COLS + LONG_SWEEP_COLS + tuple(_optin_cols(target, dtype)):
            p = plan(op, 49152, cols, dtype, "auto", target)
            spec = p.spec
            threads = p.block[0] * p.block[1] * p.block[2]
            assert threads == spec.threads_per_block <= 1024, spec.name
            static = jit.compile_cubin(spec, facts.arch).smem_bytes
            assert static + p.smem_bytes <= facts.smem_per_block_optin, spec.name
            if spec.impl == "warp":
                assert spec.cols_per_thread * spec.thread_group_width >= cols
            elif spec.impl == "block_regs":
                assert spec.packs_per_thread * spec.block_size * spec.pack_size >= cols - 2 * spec.pack_size
                assert spec.packs_per_thread * spec.block_size >= cols // spec.pack_size
            elif spec.impl == "block_async":
                inputs = len(spec.inputs)
                # each block of the cluster holds its tail of every input in registers
                tail_bytes = inputs * spec.cluster_size * spec.tail_packs * spec.block_size * 16
                assert p.smem_bytes * spec.cluster_size + tail_bytes >= inputs * cols * ITEMSIZE[dtype]
                assert tail_bytes <= inputs * cols * ITEMSIZE[dtype]
                assert p.grid[0] == 49152 * spec.cluster_size
                assert target.max_active_blocks(spec, spec.block_size, p.smem_bytes, True) > 0
            elif spec.impl == "block_smem":
                assert p.smem_bytes >= cols * ITEMSIZE[dtype]
                assert target.max_active_blocks(spec, spec.block_size, p.smem_bytes, True) > 0
            else:
                assert spec.online and p.smem_bytes == 0


def test_auto_paths_in_order_along_the_sweep():
    order = ["warp", "block_regs", "block_async", "block_uncached"]
    seen = [plan("softmax", 49152, cols, "f16", "auto", H100).spec.impl
            for cols in (256, 1024, 2048, 16384, 32768, 65536, 131072, 262144)]
    assert seen == ["warp", "warp", "block_regs", "block_async", "block_async", "block_async",
                    "block_async", "block_async"]     # 131072: a register tail; 262144: clusters
    assert sorted(seen, key=order.index) == seen
    no_clusters = [plan("softmax", 49152, cols, "f16", "auto", A100).spec for cols in (131072, 262144)]
    assert [(spec.impl, spec.tail_packs) for spec in no_clusters] == [("block_async", 8), ("block_uncached", 0)]


@pytest.mark.parametrize("op, dtype, cols, block, tail, cluster", [
    ("softmax", "f64", 16384, 512, 0, 1), ("softmax", "f16", 32768, 512, 0, 1),   # 128 / 64 KB: one block
    # 16-bit, 128 KB: half in registers, two blocks an SM
    ("softmax", "f16", 65536, 512, 8, 1), ("log_softmax", "bf16", 65536, 512, 8, 1),
    ("softmax", "f32", 58112, 1024, 8, 1),    # 227 KB, the opt-in limit: the reduction's too
    ("softmax", "f32", 65536, 1024, 8, 1), ("log_softmax", "f32", 65540, 1024, 8, 1),   # 256 KB
    ("softmax", "f16", 131072, 1024, 8, 1),
    ("softmax", "f64", 32768, 1024, 3, 1),                           # f64: 4 packs would spill
    ("softmax", "f32", 131072, 1024, 8, 2), ("softmax", "f32", 262144, 1024, 8, 4),  # clusters
    ("softmax", "f16", 262144, 512, 7, 4),        # 8 packs leave one block an SM, not two
    ("softmax_backward", "f32", 32768, 256, 4, 1), ("softmax_backward", "f16", 65536, 1024, 4, 1),
    ("log_softmax_backward", "bf16", 58104, 256, 0, 1),             # 2 x 113.5 KB: one block
    ("softmax_backward", "f32", 36864, 1024, 4, 1),                 # 2 x 144 KB
    ("softmax_backward", "f32", 65536, 256, 8, 4), ("log_softmax_backward", "f16", 262144, 256, 8, 8),
    ("softmax_backward", "f32", 262144, 512, 8, 8),                 # 2 x 1 MB: one block an SM
    ("softmax", "f32", 1 << 20, None, 0, 0), ("softmax_backward", "f32", 524288, None, 0, 0),
])
def test_auto_long_rows_in_one_block_or_a_cluster(op, dtype, cols, block, tail, cluster):
    """Long rows take the first rung of their ladder that holds them (a block,
    then clusters, sm_90+), with the largest register tail of the rung that
    does not spill and leaves its blocks resident; None: no async plan."""
    p = plan(op, 49152, cols, dtype, "auto", H100)
    if block is None:
        assert p.spec.impl != "block_async", p.spec.name
        return
    inputs = 2 if op.endswith("_backward") else 1
    share = ceil_div(cols * ITEMSIZE[dtype] // 16 - cluster * tail * block, cluster) * 16 * inputs   # whole packs
    assert (p.spec.impl, p.spec.block_size, p.spec.tail_packs, p.spec.cluster_size, p.spec.stages,
            p.smem_bytes) == ("block_async", block, tail, cluster, 1, share)
    assert p.grid == (49152 * cluster, 1, 1) and p.block == (block, 1, 1)
    if cluster > 1:
        assert plan(op, 49152, cols, dtype, "auto", A100).spec.cluster_size == 1


def test_bad_plan_arguments():
    with pytest.raises(ValueError, match="op"):
        plan("softmin", 4, 4, "f32", "auto", H100)
    with pytest.raises(ValueError, match="policy"):
        plan("softmax", 4, 4, "f32", "fast", H100)
    with pytest.raises(ValueError):
        plan("softmax", 0, 4, "f32", "auto", H100)
    with pytest.raises(ValueError):
        plan("softmax", 4, 0, "f32", "oneflow", H100)


# -- names and rendering ------------------------------------------------------------

GOLDEN_NAMES = [
    (SoftmaxSpec("softmax", "warp", "f16", 2, cols_per_thread=2, thread_group_width=32,
                 rows_per_access=1, padding=False), "softmax_warp_f16_f32_p2_c2_g32_r1_nopad"),
    (SoftmaxSpec("log_softmax", "warp", "bf16", 8, cols_per_thread=32, thread_group_width=32,
                 rows_per_access=1, padding=True), "log_softmax_warp_bf16_f32_p8_c32_g32_r1_pad"),
    (SoftmaxSpec("softmax", "warp", "f64", 1, cols_per_thread=1, thread_group_width=4,
                 rows_per_access=2, padding=True), "softmax_warp_f64_f64_p1_c1_g4_r2_pad"),
    (SoftmaxSpec("log_softmax", "block_regs", "bf16", 8, block_size=256, packs_per_thread=4),
     "log_softmax_block_regs_bf16_f32_p8_k4_b256"),
    (SoftmaxSpec("softmax", "block_regs", "f16", 8, block_size=512, packs_per_thread=3, peel=True),
     "softmax_block_regs_f16_f32_p8_k3_b512_peel"),
    (SoftmaxSpec("softmax", "block_async", "f16", 8, block_size=512, stages=1),
     "softmax_block_async_f16_f32_p8_b512_s1"),
    (SoftmaxSpec("log_softmax", "block_async", "f32", 4, block_size=512, stages=1, online=True,
                 cluster_size=4), "log_softmax_block_async_f32_f32_p4_b512_s1_online_c4"),
    (SoftmaxSpec("softmax", "block_smem", "f32", 2, block_size=512),
     "softmax_block_smem_f32_f32_p2_b512_strided"),
    (SoftmaxSpec("log_softmax", "block_smem", "f64", 1, block_size=256, storage_cache=True),
     "log_softmax_block_smem_f64_f64_p1_b256_packed"),
    (SoftmaxSpec("softmax", "block_uncached", "f32", 1, block_size=1024),
     "softmax_block_uncached_f32_f32_p1_b1024_3pass"),
    (SoftmaxSpec("log_softmax", "block_uncached", "f16", 8, block_size=1024, online=True),
     "log_softmax_block_uncached_f16_f32_p8_b1024_online"),    (SoftmaxSpec("softmax_backward", "block_async", "f32", 4, block_size=256, stages=1, tail_packs=4),
     "softmax_backward_block_async_f32_f32_p4_b256_s1_t4"),
]
GOLDEN_IDS = [name for _, name in GOLDEN_NAMES]


@pytest.mark.parametrize("spec, name", GOLDEN_NAMES, ids=GOLDEN_IDS)
def test_golden_names(spec, name):
    assert spec.name == name


def test_plans_carry_the_documented_names():
    # SPEC §3's example shape: float16, 16-byte packs, a warp per row
    assert plan("softmax", 49152, 1024, "f16", "auto", H100).spec.name == \
        "softmax_warp_f16_f32_p8_c32_g32_r1_nopad"
    assert plan("softmax", 49152, 1000, "f16", "oneflow", H100).spec.name == \
        "softmax_warp_f16_f32_p2_c32_g32_r1_pad"
    assert plan("log_softmax", 49152, 20000, "f32", "oneflow", H100).spec.name == \
        "log_softmax_block_uncached_f32_f32_p2_b1024_3pass"


def _sweep_specs(target) -> set:
    specs = set()
    for op in OPS:
        for dtype in ITEMSIZE:
            for policy in ("auto", "oneflow"):
                for cols in DEFAULT_SWEEP_COLS + LONG_SWEEP_COLS + (1, 3, 33, 1023, 1025, 12289):
                    for rows in (49152, 49151):
                        specs.add(plan(op, rows, cols, dtype, policy, target).spec)
    return specs


def test_names_are_unique_across_the_sweep():
    specs = _sweep_specs(H100)
    # with the shared-memory candidates OneFlow's rule compiles
    for spec in list(specs):
        if spec.impl == "block_smem" and not spec.storage_cache:
            specs.update(SoftmaxSpec(spec.op, "block_smem", spec.dtype, spec.pack_size, block_size=b)
                         for b in (128, 256, 512, 1024))
    names = {}
    for spec in specs:
        assert names.setdefault(spec.name, spec) == spec, f"{spec.name} names two kernels"
    assert len(names) == len(specs) > 100
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in names)


RENDER_SPECS = [spec for spec, _ in GOLDEN_NAMES]


@pytest.mark.parametrize("spec", RENDER_SPECS, ids=GOLDEN_IDS)
def test_render_names_the_kernel_and_fingerprints_the_headers(spec):
    source = jit.render(spec)
    symbol = re.search(r'extern "C" __global__ void __launch_bounds__\((\d+)\)'
                       r'(?: __cluster_dims__\((\d+), 1, 1\))?\s*(\w+)\(', source)
    assert symbol, source[:400]
    assert symbol.group(3) == spec.name
    assert int(symbol.group(1)) == spec.threads_per_block
    assert int(symbol.group(2) or 1) == getattr(spec, "cluster_size", 1)
    assert jit.headers_fingerprint() in source
    assert jit.render(spec) == source          # deterministic: CuPy's cache key is the source


def test_headers_fingerprint_follows_the_headers(tmp_path, monkeypatch):
    headers = {path.name: path.read_bytes() for path in jit.resource_dir("kernels").glob("*.cuh")}
    assert "softmax.cuh" in headers
    copies = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        for header, text in headers.items():
            (folder / header).write_bytes(text)
        copies.append(folder)
    folder = copies[0]
    monkeypatch.setattr(jit, "resource_dir", lambda name: folder)
    fingerprint = jit.headers_fingerprint.__wrapped__      # bypass the memo
    first = fingerprint()
    folder = copies[1]
    assert fingerprint() == first                           # same headers, same fingerprint
    with open(folder / "softmax.cuh", "a") as handle:
        handle.write("// edited\n")
    assert fingerprint() != first


class _WithoutKey:
    """A spec whose template arguments lack one key (a misspelled variable)."""

    def __init__(self, spec, key):
        self.spec, self.key = spec, key
        self.template = spec.template
        self.name = spec.name
        self.threads_per_block = spec.threads_per_block

    def template_args(self):
        args = self.spec.template_args()
        del args[self.key]
        return args


@pytest.mark.parametrize("spec, key", [
    (RENDER_SPECS[0], "compute_type"), (RENDER_SPECS[0], "storage_type"),
    (RENDER_SPECS[0], "padding"), (RENDER_SPECS[1], "cols_per_thread"),
    (RENDER_SPECS[3], "packs_per_thread"), (RENDER_SPECS[4], "peel"), (RENDER_SPECS[5], "stages"),
    (RENDER_SPECS[7], "cache_type"), (RENDER_SPECS[9], "online"), (RENDER_SPECS[9], "impl"),
    (RENDER_SPECS[11], "tail_packs"),
], ids=lambda v: v if isinstance(v, str) else v.name)
def test_render_is_strict(spec, key):
    assert jit._environment().undefined is jinja2.StrictUndefined
    jit.render(spec)                                   # complete arguments render
    with pytest.raises(jinja2.UndefinedError):
        jit.render(_WithoutKey(spec, key))


def test_template_variables_are_all_supplied():
    environment = jit._environment()
    source = environment.loader.get_source(environment, SoftmaxSpec.template)[0]
    used = jinja2.meta.find_undeclared_variables(environment.parse(source))
    supplied = {"name", "fingerprint", "threads_per_block"}
    for spec in RENDER_SPECS:
        supplied |= set(spec.template_args())
    assert used <= supplied, f"the template uses {sorted(used - supplied)}, never supplied"
