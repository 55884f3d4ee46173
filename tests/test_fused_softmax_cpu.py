"""CPU tests of the fused attention softmax: its float64 reference, the broadcast
geometry the kernels read bias and mask through, the planner (softmax's paths
with the raw-storage ones swapped out) and an NVRTC compile of every
instantiation the plans produce for a sweep of shapes, for sm_80 and sm_90."""
from __future__ import annotations

import collections
from dataclasses import replace
import itertools

import numpy
import pytest

from cupyops import jit
from cupyops.launch import Target
from cupyops.ops import fused_softmax as fs, fused_softmax_operands as fo
from cupyops.ops import softmax_rows as sm

import fused_softmax_reference as ref
from test_launch import fast_quotient

TARGETS = {"sm_90": Target.profile("h100"), "sm_80": Target.profile("a100")}


# -- reference -----------------------------------------------------------------

def test_reference_matches_the_unfused_expression(rng):
    x, bias = rng.standard_normal((2, 3, 4, 6)), rng.standard_normal((3, 4, 6))
    mask = rng.random((2, 1, 1, 6)) < 0.7
    mask[..., 0] = True
    y, lse = ref.forward(x, 0.5, bias, mask)
    z = numpy.where(mask, x * 0.5 + bias, -numpy.inf)
    expected = numpy.exp(z - z.max(-1, keepdims=True))
    numpy.testing.assert_allclose(y, expected / expected.sum(-1, keepdims=True))
    numpy.testing.assert_allclose(lse, numpy.log(numpy.exp(z).sum(-1)))


def test_reference_causal_is_torch_tril():
    dropped = ref.masked_positions((3, 5), causal=True, diagonal=2)
    numpy.testing.assert_array_equal(~dropped, numpy.tril(numpy.ones((3, 5), bool), 2))
    numpy.testing.assert_array_equal(~ref.masked_positions((4, 2), causal=True, diagonal=-1),
                                     numpy.tril(numpy.ones((4, 2), bool), -1))


def test_reference_fully_masked_rows_are_zero():
    x = numpy.ones((2, 4))
    mask = numpy.array([[False] * 4, [True, False, True, False]])
    y, lse = ref.forward(x, mask=mask)
    numpy.testing.assert_array_equal(y[0], 0)
    assert lse[0] == -numpy.inf
    numpy.testing.assert_allclose(y[1], [0.5, 0, 0.5, 0])
    numpy.testing.assert_array_equal(ref.backward(numpy.ones((2, 4)), x, mask=mask)[0], 0)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_reference_backward_by_finite_differences(rng, dropout):
    x, bias, dy = rng.standard_normal((3, 5)), rng.standard_normal((5,)), rng.standard_normal((3, 5))
    args = dict(scale=0.7, bias=bias, causal=True, diagonal=1, dropout=dropout, seed=5, offset=2)
    dx = ref.backward(dy, x, **args)
    step = 1e-6
    for index in itertools.product(range(3), range(5)):
        up, down = x.copy(), x.copy()
        up[index] += step
        down[index] -= step
        numeric = ((ref.forward(up, **args)[0] - ref.forward(down, **args)[0]) * dy).sum() / (2 * step)
        assert abs(numeric - dx[index]) < 1e-6


# -- broadcast geometry ----------------------------------------------------------

def device_divmod(n: int, d: int, magic: int) -> tuple:
    """kernels/common.cuh's divmod: the row itself for d = 1, fast_quotient by the magic number's
    multiplier and shift, or (magic 0) by dividing."""
    if d == 1:
        return n, 0
    if magic == 0:
        return n // d, n % d
    quotient = fast_quotient(n, magic >> 32, magic & 63)
    return quotient, n - quotient * d


def offsets_by_geometry(x_shape, layout):
    """Each row's (bias, mask) offset the way BroadcastRow::locate works it out."""
    sizes, bias_strides, mask_strides = layout[0:3], layout[3:6], layout[7:10]
    rows = int(numpy.prod(x_shape[:-1]))
    _, size1_magic, size2_magic = (0, *fo.division_magics(rows, layout)[:2])
    out = []
    for row in range(rows):
        rest, index2 = device_divmod(row, sizes[2], size2_magic)
        index0, index1 = device_divmod(rest, sizes[1], size1_magic)
        out.append([sum(i * s for i, s in zip((index0, index1, index2), strides))
                    for strides in (bias_strides, mask_strides)])
    return numpy.array(out)


@pytest.mark.parametrize("stage", fs.STAGES)
def test_rows_from_2_31_take_a_kernel_that_divides(stage):
    target = Target.profile("h100")
    fusion = fs.Fusion("f16", True, True, False)
    narrow, wide = (fs.plan(stage, rows, 8, "f16", "auto", target, fusion) for rows in (fs.WIDE_ROWS - 1, fs.WIDE_ROWS))
    assert not narrow.spec.wide and wide.spec.wide
    assert wide.spec.name == narrow.spec.name + "_wide"
    assert jit.compile_cubin(wide.spec, "sm_90").spill_bytes == 0


def test_division_magics_fall_back_to_dividing_past_31_bit_rows():
    layout = fo.geometry((8, 16, 1024, 1024), (1, 16, 1024, 1024), (8, 1, 1, 1024), 1024, 0)
    assert layout[1:3] == (8, 16 * 1024) and all(fo.division_magics(8 * 16 * 1024, layout))   # causal_rows 1024
    assert fo.division_magics(2 ** 31, layout) == (0, 0, 0)
    size1, size2, causal = fo.division_magics(16, fo.geometry((16, 5), None, None, 1, 0))   # sizes (1, 1, 16)
    assert size1 == causal == 0 and size2 != 0      # a divisor of 1: the row itself


def data_rows(rows: int, entries: int) -> list:
    """kernels/fused_softmax.cuh's RowOrder, with row_order's arguments: the data row of each count i."""
    outer, inner, magic = fo.row_order(rows, entries)
    if entries == 1:
        return list(range(rows))
    return [device_divmod(i, outer, magic)[1] * inner + device_divmod(i, outer, magic)[0] for i in range(rows)]


@pytest.mark.parametrize("x_shape, bias_shape, entries, interleaved", [
    ((16, 32, 512, 512), (32, 512, 512), 16, True),      # one batch entry's rows overflow half the L2
    ((64, 128, 128, 128), (128, 128, 128), 64, False),   # they fit: the bias stays in L2 in order
    ((16, 32, 512, 512), (512,), 1, False),              # a bias the same for every row
    ((16, 32, 512, 512), (16, 1, 512, 512), 1, False),   # broadcast along an inner dim only
    ((1, 32, 2048, 2048), (32, 2048, 2048), 1, False),   # one entry: nothing to interleave
    ((16, 32, 512, 512), (1, 512, 512), 16 * 32, False)])  # (B, H) merged: an entry is 512 rows
def test_rows_interleave_where_the_bias_would_leave_l2(x_shape, bias_shape, entries, interleaved):
    padded = (1,) * (len(x_shape) - len(bias_shape)) + bias_shape
    assert fo.bias_entries(fo.geometry(x_shape, padded, None, 1, 0)) == entries
    rows, cols = int(numpy.prod(x_shape[:-1])), x_shape[-1]
    fusion = fs.Fusion("f16", entries=entries)
    assert fs.interleave_rule(rows, cols, "f16", fusion, Target.profile("h100")) == interleaved
    for policy, expected in (("auto", interleaved), ("oneflow", False)):
        assert fs.rule_plan("forward", rows, cols, "f16", policy, Target.profile("h100"), fusion).spec.interleaved \
            == expected


@pytest.mark.parametrize("rows, entries", [(12, 1), (12, 3), (12, 4), (7 * 5, 7), (2 * 1024, 2)])
def test_row_order_visits_every_row_once_entries_innermost(rows, entries):
    order = data_rows(rows, entries)
    assert sorted(order) == list(range(rows))
    inner = rows // entries
    assert order[:entries] == [k * inner for k in range(entries)]   # row 0 of each entry first


@pytest.mark.parametrize("stage", fs.STAGES)
def test_tuned_candidates_take_both_row_orders(stage):
    """Where a bias lets rows interleave, the tuner times each row plan in both orders, but for
    an interleaved kernel that spills (it then runs the rows in order: one candidate); a
    stored description's "interleaved" picks the order back."""
    import dataclasses

    from cupyops.ops import fused_softmax_tune

    target, fusion = Target.profile("h100"), fs.Fusion("f16", True, True, True, entries=16)
    for cols in (160, 4096):
        found = fused_softmax_tune.candidates(stage, "f16", 16 * 64, cols, target, fusion)
        by_label = {description["label"]: launch for description, launch in found}
        in_order = [label for label in by_label if label not in ("auto", "oneflow") and "interleaved" not in label
                    and " mb" not in label]      # the row plans, unbounded (bounded ones are paired too)
        unpaired = [label for label in in_order if label + " interleaved" not in by_label]
        assert all(fs.spills(dataclasses.replace(by_label[label].spec, interleaved=True), target)
                   for label in unpaired), unpaired
        in_order = [label for label in in_order if label not in unpaired]
        assert in_order
        for in_order, interleaved in ((label, label + " interleaved") for label in in_order):
            assert by_label[interleaved].spec.name == by_label[in_order].spec.name + "_interleaved"
            assert jit.compile_cubin(by_label[interleaved].spec, "sm_90").spill_bytes <= MAX_SPILL_BYTES
        description = next(d for d, _ in found if d.get("interleaved"))
        assert fs.fused_launch(stage, "f16", 16 * 64, cols, target, fusion, description).spec.interleaved
    without_entries = fs.Fusion("f16", True, True, True)
    assert fs.tuning_key("f16", 1024, 512, fusion) != fs.tuning_key("f16", 1024, 512, without_entries)


def test_aligned_packs_need_aligned_operands_and_whole_packs():
    """A bias is read as vectors and a mask as words only where the operand's address and
    leading strides keep every pack on its own boundary, on paths that do not peel."""
    x_shape = (2, 16, 64, 64)
    padding = fo.geometry(x_shape, None, (2, 1, 1, 64), 1, 0)
    assert [fo.operand_alignments(padding, None, 0, address)[1] for address in (None, 0, 256, 4, 1)] == \
        [0, 16, 16, 4, 1]
    assert fo.operand_alignments(fo.geometry((2, 16, 64, 40), None, (2, 1, 1, 40), 1, 0), None, 0, 0) == (0, 8)
    assert fo.operand_alignments(fo.geometry(x_shape, None, (2, 1, 64, 1), 1, 0), None, 0, 0) == (0, 0)
    bias = fo.geometry((2, 16, 64, 36), (1, 16, 64, 36), None, 1, 0)    # rows of 72 bytes in float16
    assert fo.operand_alignments(bias, 0, 2, None) == (8, 0) and fo.operand_alignments(bias, 0, 4, None) == (16, 0)
    path = sm.SoftmaxSpec("softmax", "block_regs", "f16", 8, block_size=128, packs_per_thread=1)
    for align, pack, peel, words in ((16, 8, False, True), (8, 8, False, True), (4, 8, False, False),
                                     (16, 8, True, False), (16, 2, False, False), (16, 4, False, True)):
        fusion = fs.Fusion(mask=True, mask_align=align)
        assert fs.aligned_packs(replace(path, pack_size=pack, peel=peel), fusion)["mask_words"] == words
    for bias_dtype, align, pack, vectors in (("f16", 16, 8, True), ("f16", 8, 8, False), ("f16", 8, 4, True),
                                             ("f32", 16, 8, True), ("f16", 16, 1, False)):
        fusion = fs.Fusion(bias_dtype, bias_align=align)
        assert fs.aligned_packs(replace(path, pack_size=pack), fusion) == {"bias_vectors": vectors,
                                                                           "mask_words": False}
    assert fs.aligned_packs(path, fs.Fusion(mask_align=16, bias_align=16)) == {"bias_vectors": False,
                                                                               "mask_words": False}
    target = TARGETS["sm_90"]
    names = [fs.plan("forward", 4096, 1024, "f16", "auto", target,
                     fs.Fusion("f16", mask=True, bias_align=align, mask_align=align)).spec.name for align in (16, 1)]
    assert "_scale_biasf16v_maskw" in names[0] and "_scale_biasf16_mask" in names[1]
    wide = fs.plan("forward", 4096, 1024, "f16", "auto", target, fs.Fusion(mask=True, wide_operands=True))
    assert wide.spec.wide and wide.spec.name.endswith("_wide")


def test_grouped_dropout_variants_take_whole_groups_of_eight():
    """A dropout kernel of 8-element packs that does not peel has a variant reading each pack
    as one Philox group (offsets that are multiples of 8 run it); it compiles for each arch."""
    for cols, dtype, grouped in ((1024, "f16", True), (4096, "bf16", True), (1000, "f16", True),
                                 (1001, "f16", False), (1024, "f32", False)):
        for stage in ("forward", "backward"):
            chosen = fs.plan(stage, 64, cols, dtype, "auto", TARGETS["sm_90"], fs.Fusion(dropout=True))
            variant = fs.grouped_variant(chosen.spec, TARGETS["sm_90"])
            assert (variant is not None) == grouped, (cols, dtype, chosen.spec.name)
            if variant is not None:
                assert variant.name.endswith("_drop8") and variant == replace(chosen.spec, grouped_dropout=True)
                for arch in TARGETS:
                    jit.compile_cubin(variant, arch)
    plain = fs.plan("forward", 64, 1024, "f16", "auto", TARGETS["sm_90"], fs.Fusion())
    assert fs.grouped_variant(plain.spec, TARGETS["sm_90"]) is None


def test_tuned_candidates_bound_register_blocks_that_lose_occupancy():
    """A dropout's register block at 2048 columns takes more registers than its softmax
    path: the tuner also times it bounded to more blocks an SM, without local memory."""
    from cupyops.ops import fused_softmax_tune

    target = Target.profile("h100")
    found = fused_softmax_tune.candidates("forward", "f16", 65536, 2048, target, fs.Fusion(dropout=True))
    by_label = {description["label"]: launch for description, launch in found}
    bounded = [label for label in by_label if label.startswith("regs b128 k2 mb")]
    assert len(bounded) == 1, sorted(by_label)
    bound = by_label[bounded[0]]
    free = replace(bound.spec, path=replace(bound.spec.path, min_blocks=0))   # the rules' plan here: "auto"
    free = next(launch for launch in by_label.values() if launch.spec == free)
    assert bound.spec.name != free.spec.name and bound.spec.path.min_blocks > 1
    blocks = [target.max_active_blocks(launch.spec, 128, 0, True) for launch in (free, bound)]
    assert blocks[1] == bound.spec.path.min_blocks > blocks[0]
    assert not fs.spills(bound.spec, target)


MASK_SHAPES = [(2, 3, 4, 5), (2, 1, 4, 5), (2, 1, 1, 5), (1, 1, 4, 5), (3, 4, 5), (4, 5), (5,), (1,),
               (2, 3, 1, 5), (2, 1, 4, 1), (1, 3, 1, 1), (2, 3, 4, 1)]


@pytest.mark.parametrize("bias_shape, mask_shape", list(zip(MASK_SHAPES, reversed(MASK_SHAPES))))
def test_geometry_reaches_every_broadcast_element(bias_shape, mask_shape):
    x_shape = (2, 3, 4, 5)
    padded = [(1,) * (4 - len(s)) + s for s in (bias_shape, mask_shape)]
    layout = fo.geometry(x_shape, *padded, 4, 0)
    got = offsets_by_geometry(x_shape, layout)
    for k, shape in enumerate(padded):
        numbers = numpy.broadcast_to(numpy.arange(numpy.prod(shape)).reshape(shape), x_shape)
        column_stride = layout[6] if k == 0 else layout[10]
        cols = numpy.arange(5) * column_stride
        numpy.testing.assert_array_equal(got[:, k:k + 1] + cols, numbers.reshape(-1, 5))


def test_geometry_needs_at_most_three_dims_after_merging():
    assert fo.geometry((2, 3, 4, 5, 6), (2, 1, 4, 1, 6), None, 1, 0) is None
    assert fo.geometry((2, 3, 4, 5, 6), (2, 3, 1, 1, 6), None, 1, 0)[:3] == (1, 6, 20)


# -- plans and compiles ----------------------------------------------------------

# the last reads its bias as vectors and its mask as words where the packs allow it (aligned_packs)
FUSIONS = [fs.Fusion(), fs.Fusion("f32", True, True, True),
           fs.Fusion("f16", True, False, True, bias_align=16, mask_align=16)]
SWEEP = [(1, "f16"), (7, "bf16"), (128, "f16"), (255, "f32"), (1000, "f16"), (1024, "bf16"), (4096, "f32"),
         (12345, "f16"), (16384, "bf16"), (65536, "f16"), (2 ** 20, "f32"), (300, "f64")]
# Spilled bytes a fused kernel may take: the register plans move to wider
# blocks past the profile's FUSED_MAX_LOCAL_BYTES; warp rows may keep a few bytes.
MAX_SPILL_BYTES = 32


def sweep_plans(arch):
    target = TARGETS[arch]
    plans = []
    for (cols, dtype), stage, fusion in itertools.product(SWEEP, fs.STAGES, FUSIONS):
        if fusion.bias_dtype == "f16" and dtype == "f64":
            continue
        for policy in ("auto", "oneflow") if fusion == FUSIONS[1] else ("auto",):
            plans.append(fs.plan(stage, 4096, cols, dtype, policy, target, fusion,
                                 align=16 if cols % 8 == 0 else 2, same_phase=True))
    return plans


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_planned_instantiations_avoid_raw_storage_and_compile(arch):
    """Every plan takes a path the functors serve, and its kernel (and its grouped dropout
    variant) compiles without spilling."""
    spills, words = {}, 0
    for chosen in sweep_plans(arch):
        spec = chosen.spec
        assert spec.name.startswith("fused_softmax") and spec.fusion in spec.name
        assert spec.impl in ("warp", "block_regs", "block_smem", "block_uncached"), spec.name
        assert not spec.path.storage_cache, spec.name
        if spec.impl == "block_smem":
            assert chosen.smem_bytes <= TARGETS[arch].facts.smem_per_block_optin
        words += spec.mask_words and spec.bias_vectors
        for kernel in (spec, fs.grouped_variant(spec, TARGETS[arch])):
            report = jit.compile_cubin(kernel, arch) if kernel is not None else None
            if report is not None and report.spill_bytes > MAX_SPILL_BYTES and spec.dtype != "f64":
                spills[kernel.name] = report.spill_bytes
    assert not spills, spills
    assert words, "no plan read its bias as vectors and its mask as words"


def test_spilling_rows_of_a_warp_each_widen_to_a_row_a_block(monkeypatch):
    """A register plan of two rows a 32-thread block (cols 261, float32) whose fused kernel
    would spill widens to blocks of one row, a shape the kernels take, and compiles."""
    target = TARGETS["sm_90"]
    chosen = fs.plan("forward", 4096, 261, "f32", "auto", target, fs.Fusion("f32", True, True, True),
                     align=4, same_phase=True)
    assert chosen.spec.path.impl == "block_regs" and chosen.spec.path.rows_per_block == 2
    measured = type(target).resources
    monkeypatch.setattr(type(target), "resources", lambda self, spec: {
        **measured(self, spec), "local_bytes": 4096 if spec == chosen.spec else 0})
    wider = fs._without_spills(chosen, "softmax", 4096, 261, target)
    assert wider.spec.path.rows_per_block == 1 and wider.spec.path.block_size > 32
    assert jit.compile_cubin(wider.spec, "sm_90").spill_bytes == 0


def test_oneflow_policy_keeps_softmax_paths():
    target = TARGETS["sm_90"]
    for cols in (128, 1000, 1024, 4096, 20000):
        softmax_plan = sm.plan("softmax", 4096, cols, "f16", "oneflow", target)
        fused = fs.plan("forward", 4096, cols, "f16", "oneflow", target, fs.Fusion("", True))
        assert fused.spec.path == softmax_plan.spec and fused.block == softmax_plan.block


def test_long_rows_are_served():
    target = TARGETS["sm_90"]
    for cols in (2 ** 17, 2 ** 20, 2 ** 22):
        for stage in ("forward", "backward"):
            chosen = fs.plan(stage, 64, cols, "f16", "auto", target, fs.Fusion())
            assert chosen.spec.impl in ("block_smem", "block_uncached", "block_regs")


def test_dropout_mask_kernel_compiles():
    for arch in TARGETS:
        jit.compile_cubin(fs.DropoutMaskSpec(), arch)


def test_explain_shows_the_path():
    chosen = fs.plan("forward", 4096, 1024, "f16", "auto", TARGETS["sm_90"], fs.Fusion("", True, True, True))
    info = chosen.explain()
    assert info["impl"] == chosen.spec.path.impl and info["fusion"] == "scale_mask_causal_drop"
    assert info["kernel"] == chosen.spec.name


# -- repeated calls (a GPU stand-in: tests/fake_device.py) -------------------------------------

def _counted(monkeypatch, counts, owner, name):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)


def _launched(device, arrays: dict) -> list:
    """The launches recorded: (kernel, grid, block, smem, args), arrays by name, fresh ones by
    shape, the Philox round keys as ("round_keys", the seed they start from)."""
    names = {}
    for name, a in arrays.items():
        names.setdefault(a.data.ptr, name)

    def argument(a):
        if isinstance(a, numpy.generic):
            return type(a).__name__, a.item()
        if isinstance(a, (bytes, numpy.ndarray)):   # the 20 words of a RoundKeys
            keys = numpy.frombuffer(a, numpy.uint32)
            return "round_keys", int(keys[0]) | int(keys[10]) << 32
        return names.get(a.data.ptr, ("fresh", a.shape))
    return [(k.name, k.grid, k.block, k.smem, tuple(argument(a) for a in k.args)) for k in device.launches]


def test_repeated_calls_replay_their_stages(monkeypatch):
    """A repeated forward (returning its log-sum-exp, or with mask, dropout and out=), backward or
    dropout_mask on arrays of one layout neither checks, lays out nor plans again: it launches
    what the first call launched, with the seed and offset of its own call."""
    device = pytest.importorskip("fake_device").FakeDevice(monkeypatch)
    counts = collections.Counter()
    for owner, name in ((fs, "prepare"), (fs, "plan"), (fs, "live_function"), (fs, "stage_launch")):
        _counted(monkeypatch, counts, owner, name)
    x, dy = device.array((2, 4, 64, 128), "float16"), device.array((2, 4, 64, 128), "float16")
    lse, out = device.array((2, 4, 64), "float32"), device.array((2, 4, 64, 128), "float16")
    mask, bias = device.array((64, 128), "bool"), device.array((4, 1, 128), "float32")
    options = dict(scale=0.125, causal=True, dropout=0.1)
    calls = {
        "forward": lambda seed: fs.fused_softmax(x, seed=seed, offset=seed, return_lse=True, **options),
        "forward into out": lambda seed: fs.fused_softmax(x, mask=mask, bias=bias, seed=seed, out=out),
        "backward": lambda seed: fs.fused_softmax_backward(dy, x, lse, seed=seed, offset=3, **options),
        "dropout_mask": lambda seed: fs.dropout_mask((64, 128), 0.1, seed),
    }
    for label, call in calls.items():
        seen = []
        for seed in (5, 2 ** 64 + 6):
            counts.clear()
            device.launches.clear()
            result = call(seed)
            results = result if isinstance(result, tuple) else (result,)
            seen.append(_launched(device, dict(x=x, dy=dy, lse=lse, out=out, mask=mask, bias=bias,
                                               **{f"result {k}": r for k, r in enumerate(results)})))
        assert not counts, f"{label}: the repeated call ran {counts}"
        assert all(launch.packed for launch in device.launches), f"{label}: a launch converted its arguments"
        first, second = seen
        assert [launch[:4] for launch in first] == [launch[:4] for launch in second], label
        for before, after in zip(first, second):
            # the same arguments but for the seed's round keys (and the offset where it follows
            # the seed), which a kernel without dropout does not take
            changed = [k for k, (a, b) in enumerate(zip(before[4], after[4])) if a != b]
            wanted = [] if "drop" not in before[0] else \
                [("round_keys", 6)] + ([("uint64", 6)] if label == "forward" else [])
            assert [after[4][k] for k in changed] == wanted, (label, before[0])
            assert (label == "forward into out") == ("out" in before[4]), label
            # the forward writes the lse it returns, in the same kernel; a null pointer where it returns none
            assert (label == "forward") == ("result 1" in before[4]), label
            if label == "forward into out":
                assert before[4][before[4].index("out") + 1] == ("uint64", 0), before[4]


def test_remembered_calls_replay_on_addresses(monkeypatch):
    """fused_softmax.remembered_call: nothing before a call, then the forward's (returning its
    lse) and the backward's ready calls, which replayed on addresses (run_at) launch what the
    memoised calls launch, with the seed and offset given."""
    device = pytest.importorskip("fake_device").FakeDevice(monkeypatch)
    x, dy = device.array((2, 4, 64, 128), "float16"), device.array((2, 4, 64, 128), "float16")
    bias = device.array((4, 1, 128), "float32")
    scalars = (0.125, True, 0, 0.1, -1)
    options = dict(scale=0.125, causal=True, dropout=0.1, bias=bias)
    assert fs.remembered_call(x, None, None, bias, None, *scalars, True) is None
    y, lse = fs.fused_softmax(x, seed=5, offset=8, return_lse=True, **options)
    ready = fs.remembered_call(x, None, None, bias, None, *scalars, True)
    named = dict(x=x, dy=dy, bias=bias)
    device.launches.clear()
    y, lse = fs.fused_softmax(x, seed=7, offset=16, return_lse=True, **options)
    expected = _launched(device, {**named, "y": y, "lse": lse})
    y, lse = device.array(ready.shape, ready.dtype), device.array(ready.shape[:-1], "float32")
    device.launches.clear()
    ready.run_at((x.data.ptr, 0, bias.data.ptr, 0), y.data.ptr, lse.data.ptr, 7, 16)
    assert _launched(device, {**named, "y": y, "lse": lse}) == expected and expected

    assert fs.remembered_call(x, dy, lse, bias, None, *scalars) is None
    fs.fused_softmax_backward(dy, x, lse, seed=5, offset=8, **options)
    ready = fs.remembered_call(x, dy, lse, bias, None, *scalars)
    device.launches.clear()
    dx = fs.fused_softmax_backward(dy, x, lse, seed=7, offset=16, **options)
    expected = _launched(device, {**named, "lse": lse, "dx": dx})
    dx = device.array(ready.shape, ready.dtype)
    device.launches.clear()
    ready.run_at((x.data.ptr, dy.data.ptr, bias.data.ptr, 0), dx.data.ptr, lse.data.ptr, 7, 16)
    assert _launched(device, {**named, "lse": lse, "dx": dx}) == expected and expected


def test_interleaved_calls_pass_their_row_order(monkeypatch):
    """A (16, 32, 512, 512) forward and backward with a (32, 512, 512) bias on the H100 profile
    take the interleaved kernels, given RowOrder's (outer, inner, magic) before the dropout's
    arguments; the same call without the bias takes its rows in order."""
    device = pytest.importorskip("fake_device").FakeDevice(monkeypatch)
    x, dy = device.array((16, 32, 512, 512), "float16"), device.array((16, 32, 512, 512), "float16")
    bias, lse = device.array((32, 512, 512), "float16"), device.array((16, 32, 512), "float32")
    rows = 16 * 32 * 512
    fs.fused_softmax(x, bias=bias)
    fs.fused_softmax_backward(dy, x, lse, bias=bias)
    fs.fused_softmax(x, scale=0.5)
    interleaved, in_order = device.launches[:2], device.launches[2]
    for launch in interleaved:
        assert launch.name.endswith("_interleaved"), launch.name
        assert [int(a) for a in launch.args[-6:-3]] == list(fo.row_order(rows, 16))
    assert "interleaved" not in in_order.name
    assert [int(a) for a in in_order.args[-6:-3]] == [1, rows, 0]


def test_memoised_calls_still_check_their_arguments(monkeypatch):
    device = pytest.importorskip("fake_device").FakeDevice(monkeypatch)
    x = device.array((64, 128), "float32")
    fs.fused_softmax(x, dropout=0.1, seed=1)
    launched = len(device.launches)
    for kwargs, error in [(dict(dropout=1.0), ValueError), (dict(scale=float("nan")), ValueError),
                          (dict(dropout=0.1, seed="one"), TypeError), (dict(policy="fast"), ValueError),
                          (dict(out=device.array((64, 128), "float16")), ValueError)]:
        with pytest.raises(error):
            fs.fused_softmax(x, **kwargs)
    assert len(device.launches) == launched
