"""CPU tests of the int8 convolution (SPEC §7, §10, §11): the NumPy reference,
the NCHW32 / filter layouts, the tap table and parameter block, a thread-level
NumPy model of the kernel (tests/conv_emulation.py) against the reference,
wgmma's descriptors, the planner, the tuner with a fake clock, NVRTC compiles of
every configuration for sm_80 and sm_90 (sm_90a for wgmma) and of the int8 peak
kernels, and the sm_90a cubin cache."""
from __future__ import annotations

import ctypes
import json
import re
from dataclasses import asdict, replace

import numpy
import pytest

import cupyops
from cupyops import jit, tensor_map, tune
from cupyops.launch import Target
from cupyops.ops import conv_halo, conv_layout, conv_plan, conv_tma
from cupyops.ops import conv_reference as ref
from cupyops.ops import mma_peak
from cupyops.ops.conv_layout import ConvGeometry

import conv_emulation


def _random(rng, shape):
    return rng.integers(-128, 128, shape, dtype=numpy.int8)


def _direct(x, w, stride, padding, dilation):
    """The convolution's definition, one output at a time (tiny shapes only)."""
    n, c, h, width = x.shape
    k, _, r, s = w.shape
    g = ConvGeometry(n, c, h, width, k, r, s, stride, padding, dilation)
    y = numpy.zeros((n, k, g.oh, g.ow), numpy.int64)
    for oh in range(g.oh):
        for ow in range(g.ow):
            for fh in range(r):
                for fw in range(s):
                    ih = oh * stride[0] - padding[0] + fh * dilation[0]
                    iw = ow * stride[1] - padding[1] + fw * dilation[1]
                    if 0 <= ih < h and 0 <= iw < width:
                        y[:, :, oh, ow] += x[:, :, ih, iw].astype(numpy.int64) @ w[:, :, fh, fw].T.astype(numpy.int64)
    return y


@pytest.mark.parametrize("stride,padding,dilation", [((1, 1), (0, 0), (1, 1)), ((2, 1), (1, 2), (1, 1)),
                                                     ((1, 2), (2, 1), (2, 2))])
def test_reference_matches_the_definition(rng, stride, padding, dilation):
    x, w = _random(rng, (2, 5, 7, 6)), _random(rng, (3, 5, 3, 2))
    numpy.testing.assert_array_equal(ref.accumulators(x, w, stride, padding, dilation),
                                     _direct(x, w, stride, padding, dilation))


def test_reference_epilogue_rounds_half_to_even_and_saturates():
    value = numpy.array([0.5, 1.5, 2.5, -0.5, -1.5, 127.4, 127.5, 300.0, -128.5, -1000.0])
    numpy.testing.assert_array_equal(ref.quantize(value), [0, 2, 2, 0, -2, 127, 127, 127, -128, -128])
    acc = numpy.array([[[[10]], [[-20]]]])
    value = ref.epilogue(acc, alpha=numpy.array([0.5, 2.0]), beta=2.0, gamma=0.25,
                         bias=numpy.array([1, 1], numpy.int32), z=numpy.full(acc.shape, 4), relu=True)
    numpy.testing.assert_array_equal(value.reshape(-1), [8.0, 0.0])


def test_int8_mismatches_allow_one_only_at_a_rounding_boundary():
    value = numpy.array([2.50001, 2.6, 3.0, 126.9])
    assert len(ref.int8_mismatches(numpy.array([3, 3, 3, 127], numpy.int8), value)) == 0
    assert ref.int8_mismatches(numpy.array([2, 2, 3, 127], numpy.int8), value).tolist() == [[1]]
    assert ref.int8_mismatches(numpy.array([2, 3, 4, 127], numpy.int8), value).tolist() == [[2]]


def test_nchw32_round_trip_pads_channels_with_zeros(rng):
    x = _random(rng, (2, 40, 3, 5))
    packed = cupyops.to_nchw32(x)
    assert packed.shape == (2, 2, 3, 5, 32) and packed.flags.c_contiguous
    assert packed[1, 0, 2, 4, 7] == x[1, 7, 2, 4] and packed[0, 1, 1, 3, 3] == x[0, 35, 1, 3]
    assert not packed[:, 1, :, :, 8:].any()
    numpy.testing.assert_array_equal(cupyops.from_nchw32(packed, 40), x)
    assert cupyops.from_nchw32(packed).shape == (2, 64, 3, 5)
    with pytest.raises(ValueError, match="channels"):
        cupyops.from_nchw32(packed, 65)
    with pytest.raises(ValueError, match="N, C, H, W"):
        cupyops.to_nchw32(x[0])


def test_packed_filter_rows_are_gemm_k_in_chunk_order(rng):
    w = _random(rng, (64, 40, 3, 2))
    packed = cupyops.pack_conv_filter(w)
    assert packed.shape == (64, 2, 3, 2, 32)
    rows = packed.reshape(64, -1)              # GEMM_K = C * R * S contiguous per output channel
    k = (((1 * 3) + 2) * 2 + 1) * 32 + 5       # channel group 1, fh 2, fw 1, channel 5 of the group
    assert rows[7, k] == w[7, 37, 2, 1]
    assert not packed[:, 1, :, :, 8:].any()
    with pytest.raises(ValueError, match="multiple of 32"):
        cupyops.pack_conv_filter(w[:48 - 1])
    with pytest.raises(TypeError, match="int8"):
        cupyops.pack_conv_filter(w.astype(numpy.int16))


def test_tap_table_and_gemm_by_chunks_match_the_reference(rng):
    """The GEMM of the packed filter and an input gathered with the tap table the
    way the kernel walks chunks (group, tap) is the convolution."""
    g = ConvGeometry(2, 64, 9, 8, 32, 3, 3, (2, 1), (3, 2), (2, 3))
    x, w = _random(rng, (g.n, g.c, g.h, g.w)), _random(rng, (g.k, g.c, g.r, g.s))
    x5 = cupyops.to_nchw32(x).reshape(-1).astype(numpy.int64)
    offsets, dh, dw = conv_layout.tap_table(g)
    assert offsets[4] == (2 * g.w + 3) * 32 and (dh[4], dw[4]) == (2, 3)
    m, n, k = g.gemm
    b = numpy.zeros((k, n), numpy.int64)
    for j in range(n):
        image, rest = divmod(j, g.oh * g.ow)
        oh, ow = divmod(rest, g.ow)
        ih, iw = oh * g.stride[0] - g.padding[0], ow * g.stride[1] - g.padding[1]
        base = image * g.c * g.h * g.w + (ih * g.w + iw) * 32
        for chunk in range(k // 32):
            group, tap = divmod(chunk, g.r * g.s)
            if 0 <= ih + dh[tap] < g.h and 0 <= iw + dw[tap] < g.w:
                start = base + group * g.h * g.w * 32 + offsets[tap]
                b[chunk * 32: chunk * 32 + 32, j] = x5[start: start + 32]
    a = cupyops.pack_conv_filter(w).reshape(m, k).astype(numpy.int64)
    y = (a @ b).reshape(m, g.n, g.oh, g.ow).transpose(1, 0, 2, 3)
    numpy.testing.assert_array_equal(y, ref.accumulators(x, w, g.stride, g.padding, g.dilation))


@pytest.mark.parametrize("stride", [2, 4])
@pytest.mark.parametrize("taps", [1, 2, 3, 4, 5, 9, 49])
def test_chunk_walk_without_division_matches_divmod(taps, stride):
    """The kernel's advance (2 chunks a 64-byte row, 4 a 128-byte one: group_step groups
    and tap_step taps, then at most one carry into the group) against divmod."""
    group_step, tap_step = divmod(stride, taps)
    for start in range(8):
        chunk = start
        group, tap = divmod(chunk, taps)
        for _ in range(60):
            assert (group, tap) == divmod(chunk, taps)
            chunk, tap, group = chunk + stride, tap + tap_step, group + group_step
            carry = tap >= taps
            tap, group = tap - (taps if carry else 0), group + carry


def test_params_block_matches_the_c_struct():
    header = (jit.resource_dir("kernels") / "conv_int8.cuh").read_text()

    def fields(struct):
        body = re.search(rf"struct {struct} \{{(.*?)\}};", header, re.S).group(1)
        return re.findall(r"(\w+)(?:\[CONV_MAX_TAPS\])?[,;]", re.sub(r"//[^\n]*", "", body))

    names = [name for field in fields("ConvParams")   # the ConvEpilogue member's fields in place
             for name in (fields("ConvEpilogue") if field == "epilogue" else [field])]
    assert names == list(conv_layout.PARAMS_DTYPE.names)
    assert int(re.search(r"CONV_MAX_TAPS = (\d+)", header).group(1)) == conv_layout.MAX_TAPS
    assert conv_layout.PARAMS_DTYPE.itemsize == 4 * (len(names) - 3 + 3 * conv_layout.MAX_TAPS)
    g = ConvGeometry(1, 64, 10, 10, 32, 3, 3, (1, 1), (1, 1), (2, 2))
    params = conv_layout.kernel_params(g, out_dtype="float16", bias_kind="int32", alpha=0.5)[0]
    assert (params["taps"], params["out_kind"], params["bias_kind"], params["k_steps"]) == (9, 1, 2, 9)
    assert params["alpha"] == 0.5 and params["tap_dw"][2] == 4 and params["tap_offset"][3] == 2 * 10 * 32


@pytest.mark.parametrize("geometry", [ConvGeometry(64, 256, 56, 56, 64, 1, 1), ConvGeometry(3, 32, 7, 7, 32, 3, 3),
                                      ConvGeometry(5, 32, 1, 1, 32, 1, 1), ConvGeometry(2, 32, 9, 13, 32, 3, 3,
                                                                                         (2, 2), (1, 1))])
def test_params_carry_the_epilogue_pixel_divisor(geometry):
    """The epilogue finds a GEMM_N column's image as (j * multiplier >> 32) >> shift
    (GemmPixels), or j itself where an image has one output pixel (multiplier 0)."""
    params = conv_layout.kernel_params(geometry)[0]
    multiplier, shift = int(params["ohw_multiplier"]), int(params["ohw_shift"])
    ohw, gemm_n = geometry.oh * geometry.ow, geometry.gemm[1]
    columns = numpy.unique(numpy.r_[numpy.arange(min(gemm_n, 5000)), numpy.arange(max(0, gemm_n - 5000), gemm_n),
                                    numpy.random.default_rng(0).integers(0, gemm_n, 5000)])
    images = columns if multiplier == 0 else ((columns * multiplier) >> 32) >> shift
    assert (multiplier == 0) == (ohw == 1)
    numpy.testing.assert_array_equal(images, columns // ohw)


def _auto(tile_m, tile_n):
    return next(c for c in conv_plan.AUTO_CONFIGS if (c.tile_m, c.tile_n) == (tile_m, tile_n))


def _megengine(tile_m, tile_n):
    return next(c for c in conv_plan.MEGENGINE_LADDER if (c.tile_m, c.tile_n) == (tile_m, tile_n))


EMULATED = [  # (geometry, tile config): every filter shape, tails in N * OH * OW and GEMM_K
    (ConvGeometry(2, 64, 7, 5, 32, 1, 1), _megengine(32, 64)),
    (ConvGeometry(1, 32, 6, 6, 32, 1, 1), _auto(32, 128)),                       # one half step
    (ConvGeometry(1, 64, 5, 6, 64, 3, 3, (1, 1), (1, 1)), _megengine(64, 64)),
    (ConvGeometry(2, 32, 9, 7, 64, 5, 5, (2, 2), (2, 2)), _auto(64, 64)),
    (ConvGeometry(1, 32, 8, 9, 32, 7, 7, (2, 2), (3, 3)), _auto(32, 128)),
    (ConvGeometry(1, 32, 6, 9, 32, 1, 7, (1, 1), (0, 3)), _megengine(32, 64)),
    (ConvGeometry(1, 64, 9, 9, 32, 3, 3, (1, 1), (2, 2), (2, 2)), _auto(32, 128)),
    (ConvGeometry(1, 96, 5, 5, 128, 3, 3, (1, 1), (0, 0)), _auto(128, 128)),
    (ConvGeometry(2, 64, 12, 12, 64, 3, 3, (1, 1), (1, 1)), _auto(64, 256)),
]


def _wgmma(tile_m, tile_n, warp_n, step_bytes=64):
    return next(c for c in conv_plan.WGMMA_CONFIGS
                if (c.tile_m, c.tile_n, c.warp_n, c.step_bytes) == (tile_m, tile_n, warp_n, step_bytes))


def test_every_wgmma_layout_is_emulated():
    layout = lambda c: (c.tile_m, c.tile_n, c.warp_n, c.step_bytes)  # noqa: E731
    assert {layout(c) for c in conv_plan.WGMMA_CONFIGS} == {layout(c) for _, c in EMULATED_WGMMA}


EMULATED_WGMMA = [  # every warpgroup layout and step; tails in GEMM_M, GEMM_N and GEMM_K
    (ConvGeometry(2, 64, 7, 5, 64, 3, 3, (1, 1), (1, 1)), _wgmma(64, 128, 128)),
    (ConvGeometry(1, 96, 9, 9, 96, 3, 3, (2, 2), (1, 1)), _wgmma(128, 128, 128)),   # half step, M tail
    (ConvGeometry(2, 32, 11, 13, 160, 1, 1), _wgmma(256, 128, 128)),                 # four warpgroups
    (ConvGeometry(1, 64, 12, 12, 128, 3, 3, (1, 1), (1, 1)), _wgmma(128, 256, 256)),
    (ConvGeometry(1, 32, 8, 9, 64, 5, 5, (1, 1), (2, 2)), _wgmma(64, 256, 128)),     # split along N
    (ConvGeometry(1, 32, 8, 8, 32, 3, 3, (1, 1), (1, 1)), _wgmma(64, 128, 128)),     # C = K = 32
    (ConvGeometry(3, 64, 1, 1, 64, 1, 1), _wgmma(64, 128, 128)),                     # one pixel an image
    # 128-byte steps: 9, 3, 27 and 1 chunks (GEMM_K tails of 1 and 3 chunks, a step within one tap)
    (ConvGeometry(2, 32, 7, 5, 64, 3, 3, (1, 1), (1, 1)), _wgmma(64, 128, 128, 128)),  # C = 32, K tail
    (ConvGeometry(1, 96, 9, 9, 96, 1, 1, (2, 2)), _wgmma(128, 128, 128, 128)),         # M tail, 3 chunks
    (ConvGeometry(2, 32, 11, 13, 160, 1, 1), _wgmma(256, 128, 128, 128)),              # one chunk
    (ConvGeometry(1, 96, 12, 12, 128, 3, 3, (1, 1), (1, 1)), _wgmma(128, 128, 128, 128)),
    (ConvGeometry(1, 32, 8, 9, 64, 5, 5, (1, 1), (2, 2)), _wgmma(64, 256, 128, 128)),   # split along N
    (ConvGeometry(1, 32, 8, 8, 32, 3, 3, (1, 1), (1, 1)), _wgmma(64, 128, 128, 128)),   # C = K = 32
]


def _check_model(rng, g, spec, splits=1, per_split=None, epilogue="exchange"):
    x, w = _random(rng, (g.n, g.c, g.h, g.w)), _random(rng, (g.k, g.c, g.r, g.s))
    y, writes = conv_emulation.run(spec, g, cupyops.to_nchw32(x), cupyops.pack_conv_filter(w), splits, per_split,
                                   epilogue)
    assert (writes == 1).all(), f"{spec.name}: outputs not written exactly once"
    expected = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    bad = numpy.argwhere(cupyops.from_nchw32(y) != expected)
    assert not len(bad), f"{spec.name}: first mismatch at (n, k, oh, ow) {bad[0].tolist()}"


@pytest.mark.parametrize("policy", ["megengine", "auto"])
@pytest.mark.parametrize("geometry,config", EMULATED)
def test_kernel_model_matches_the_reference(rng, geometry, config, policy):
    _check_model(rng, geometry, conv_plan.spec_for(config, policy, "sm_80"))


@pytest.mark.parametrize("epilogue", ["exchange", "warpgroup"])
@pytest.mark.parametrize("geometry,config", EMULATED_WGMMA)
def test_wgmma_kernel_model_matches_the_reference(rng, geometry, config, epilogue):
    _check_model(rng, geometry, conv_plan.spec_for(config, "auto", "sm_90"), epilogue=epilogue)


@pytest.mark.parametrize("config", [_auto(32, 128), _wgmma(64, 128, 128), _wgmma(64, 128, 128, 128)])
def test_kernel_model_split_k(rng, config):
    g = ConvGeometry(1, 96, 4, 4, 32, 3, 3, (1, 1), (1, 1))   # 27 chunks, 14 steps
    spec = conv_plan.spec_for(config, "auto", "sm_90")
    splits, per_split = conv_plan.split_k(g, 1, 132, spec.steps_per_stage)
    assert splits > 1 and (splits - 1) * per_split < g.k_steps <= splits * per_split
    assert per_split % spec.steps_per_stage == 0
    _check_model(rng, g, spec, splits, per_split)
    _check_model(rng, g, spec, 3, 5)   # odd splits (the GPU tests' and sanitizer's): stages straddle them


def test_wgmma_descriptor_matches_the_header_and_the_tile_layout():
    """kernels/mma.cuh's descriptor fields equal the model's, and the model's
    decoding of a descriptor reads the tile exactly as conv_tile_offset lays it out."""
    header = (jit.resource_dir("kernels") / "mma.cuh").read_text()
    constant = lambda name: eval(re.search(rf"constexpr int {name} = ([^;]+);", header).group(1))  # noqa: E731
    assert constant("WGMMA_SWIZZLE_64B") == conv_emulation.SWIZZLE_MODES[64] == 2
    assert constant("WGMMA_SWIZZLE_128B") == conv_emulation.SWIZZLE_MODES[128] == 1
    assert constant("WGMMA_SWIZZLE_ROWS") == conv_emulation.SWIZZLE_ROWS == 8
    assert constant("WGMMA_LEADING_BYTE_OFFSET_UNUSED") == conv_emulation.LEADING_BYTE_OFFSET
    for row_bytes, mode in ((64, 2), (128, 1)):
        descriptor = conv_emulation.wgmma_descriptor(0x2400 + 32, row_bytes)
        assert descriptor & 0x3FFF == (0x2400 + 32) >> 4 and (descriptor >> 16) & 0x3FFF == 1
        assert (descriptor >> 32) & 0x3FFF == row_bytes // 2 and (descriptor >> 49) & 7 == 0
        assert descriptor >> 62 == mode
        rows = 24
        tile = numpy.zeros(0x2400 + rows * row_bytes, numpy.int64)
        for row in range(rows):
            for vector in range(row_bytes // 16):
                offset = 0x2400 + conv_emulation.tile_offset(row, vector, row_bytes)
                tile[offset: offset + 16] = row * row_bytes + vector * 16 + numpy.arange(16)
        for k in range(row_bytes // 32):
            operand = conv_emulation.wgmma_operand(
                tile, conv_emulation.wgmma_descriptor(0x2400 + 32 * k, row_bytes), rows)
            numpy.testing.assert_array_equal(operand, numpy.arange(rows)[:, None] * row_bytes + 32 * k
                                             + numpy.arange(32))


def test_shared_tile_swizzle_is_conflict_free():
    """Eight rows of one vector (an ldmatrix phase) and four threads' rows of
    four vectors (a phase of 16-byte stores) each cover all 32 banks; in
    128-byte rows the threads of odd rows store the other half (vectors + 4)."""
    for base in range(0, 128, 8):
        for vector in range(4):
            banks = {conv_emulation.tile_offset(base + r, vector) % 128 // 16 for r in range(8)}
            assert len(banks) == 8
        for first in range(0, 8, 2):
            stores = {conv_emulation.tile_offset(base + first + r, v) % 128 // 16
                      for r in range(2) for v in range(4)}
            assert len(stores) == 8
            for half in range(2):
                stores = {conv_emulation.tile_offset(base + first + r, v + 4 * (half ^ r), 128) % 128 // 16
                          for r in range(2) for v in range(4)}
                assert len(stores) == 8
    # threads copying whole chunks (VECTORS = 2): 4 rows a phase, halves alternating every 2 rows
    for row_bytes in (64, 128):
        for base in range(0, 128, 4):
            for k, e in numpy.ndindex(row_bytes // 64, 2):
                stores = {conv_emulation.tile_offset(base + r, 2 * c + e + 4 * (k ^ (r // 2 & 1)), row_bytes)
                          % 128 // 16 for r in range(4) for c in range(2)}
                assert len(stores) == 8, (row_bytes, base, k, e)


def test_exchange_is_conflict_free():
    lanes = numpy.arange(32)
    swizzle = numpy.vectorize(conv_emulation.exchange_swizzle)
    for block in range(4):
        for e in range(2):                 # writers: one int each, 32 distinct banks
            column, row = (lanes & 3) * 2 + e, block * 8 + (lanes >> 2)
            assert len(set((column * 32 + (row ^ swizzle(column))) % 32)) == 32
    pixel, quarter = lanes >> 2, lanes & 3
    for half in (0, 4):                    # readers: 16 bytes each, a phase of 8 lanes on 32 banks
        start = pixel * 32 + ((quarter * 8 + half) ^ swizzle(pixel))
        for phase in range(4):
            banks = {(s + i) % 32 for s in start[phase * 8: phase * 8 + 8] for i in range(4)}
            assert len(banks) == 32


# -- planner -----------------------------------------------------------------

H100 = Target.profile("h100")
RESNET_3X3 = ConvGeometry(64, 64, 56, 56, 64, 3, 3, (1, 1), (1, 1))


def test_megengine_plan_is_the_articles_kernel():
    chosen = conv_plan.plan(ConvGeometry(64, 256, 14, 14, 256, 3, 3, padding=(1, 1)), "megengine", H100)
    assert chosen.spec.name == ("conv2d_int8_fprop_sm75_m8n8k16_s8_tb128x128x64_w64x64x64_st2_ldg_align16"
                                "_nchw32_lincomb")
    assert chosen.splits == 1 and chosen.source == "megengine ladder"
    assert conv_plan.plan(RESNET_3X3, "megengine", H100).spec.tile_m == 64
    assert conv_plan.plan(ConvGeometry(1, 32, 8, 8, 32, 1, 1), "megengine", H100).spec.tile_m == 32


def test_auto_plan_default_rule_and_explain():
    chosen = conv_plan.plan(RESNET_3X3, "auto", H100)
    info = chosen.explain()
    assert info["source"] == "default rule" and info["instruction"].startswith("wgmma.mma_async.m64n")
    assert chosen.spec.async_copy and 3 <= chosen.spec.stages <= 6 and chosen.spec.tile_m <= 64
    assert info["warpgroup"] == f"64x{chosen.spec.warp_n}x64" and info["warp"] == f"16x{chosen.spec.warp_n}x64"
    m, n, _ = RESNET_3X3.gemm
    assert info["grid"] == [-(-n // chosen.spec.tile_n) * -(-m // chosen.spec.tile_m), 1, 1]
    assert info["kernel"].startswith(f"conv2d_int8_fprop_sm90a_wgmma_m64n{chosen.spec.warp_n}k32_s8_tb")
    a100 = conv_plan.plan(ConvGeometry(64, 256, 14, 14, 256, 3, 3), "auto", Target.profile("a100"))
    assert a100.spec.instruction == "m16n8k32" and a100.explain()["instruction"] == "mma.sync.m16n8k32.s8"
    vgg = conv_plan.plan(ConvGeometry(32, 256, 56, 56, 256, 3, 3, padding=(1, 1)), "auto", H100).spec
    assert (vgg.instruction, vgg.tile_m, vgg.tile_n) == ("wgmma", 128, 256)
    assert vgg.name == ("conv2d_int8_fprop_sm90a_wgmma_m64n256k32_s8_tb128x256x64_wg2x1_st6_cpasync_sw64_align16_"
                        "nchw32_lincomb")


GEOMETRIES = [RESNET_3X3, ConvGeometry(1, 32, 8, 8, 32, 3, 3), ConvGeometry(64, 512, 7, 7, 512, 3, 3),
              ConvGeometry(32, 256, 56, 56, 256, 3, 3), ConvGeometry(2, 96, 19, 17, 160, 3, 3)]


@pytest.mark.parametrize("profile", ["h100", "a100"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_candidates_are_structurally_valid(profile, geometry):
    """wgmma on sm_90 only; every candidate launchable: threads, shared memory, whole
    rows per loading thread, wgmma's N, warps covering the tile, split-K covering GEMM_K."""
    facts = Target.profile(profile).facts
    found = conv_plan.candidates(geometry, facts.sm_count, facts.smem_per_block_optin, facts.arch)
    assert found and any(c["wgmma"] for c in found) == (facts.arch == "sm_90")
    for candidate in found:
        chosen = conv_plan.plan_from(geometry, candidate, facts.arch, "test")
        spec = chosen.spec
        threads = spec.threads_per_block
        assert threads <= 1024 and spec.smem_bytes <= facts.smem_per_block_optin
        if spec.tma == "halo":
            _check_halo(geometry, chosen)
            continue
        if spec.tma:   # consumer warpgroups, then the producer's, whose 128 threads copy whole B rows
            assert threads == (spec.tile_m // 64) * (spec.tile_n // spec.warp_n) * 128 + 128, spec.name
            assert spec.tile_n % 32 == 0 and spec.tile_n <= 256, spec.name   # 32-byte chunks, else 16-byte vectors
        else:
            assert spec.tile_m % (threads // 4) == 0 and spec.tile_n % (threads // 4) == 0, spec.name
        if spec.wgmma:
            assert threads % 128 == 0 and spec.tile_m % 64 == 0 and spec.warp_m == 64
            assert spec.tile_n % spec.warp_n == 0 and spec.warp_n % 16 == 0 and spec.warp_n <= 256
            assert spec.stages >= 3 and (spec.tile_m + spec.tile_n) * spec.step_bytes % 1024 == 0
            exchange = spec.consumer_warps * 1024 if spec.tma else 0   # warp-specialised: apart from the stages
            assert spec.smem_bytes == spec.stages * (spec.tile_m + spec.tile_n) * spec.step_bytes + exchange + 1024
            assert candidate["steps_per_split"] % spec.steps_per_stage == 0 or chosen.splits == 1 or spec.tma
        assert (chosen.splits - 1) * chosen.steps_per_split < geometry.k_steps <= chosen.splits * chosen.steps_per_split
    assert any(c["tma"] for c in found) == (facts.arch == "sm_90")
    rule = conv_plan.default_candidate(geometry, facts.sm_count, facts.smem_per_block_optin, facts.arch)
    assert rule in found and rule["wgmma"] == (facts.arch == "sm_90") and not rule["tma"]


def _check_halo(g, chosen):
    """A halo tile: stride 1, rows of at least OW plus the filter's reach, one or two
    warpgroups of whole 8-slot groups along N, a stage per filter row or per filter,
    shared memory as the kernel lays it out, split-K covering GEMM_K's units."""
    spec = chosen.spec
    pitch, rows = spec.halo_pitch, spec.tile_n // spec.halo_pitch
    assert g.stride == (1, 1) and pitch >= g.ow + (g.s - 1) * g.dilation[1] and pitch % 4 == 0
    assert spec.tile_n == rows * pitch <= 512 and rows <= g.oh and spec.warp_n % 16 == 0 and spec.warp_n <= 256
    assert spec.threads_per_block == (spec.tile_m // 64) * (spec.tile_n // spec.warp_n) * 128 + 128 <= 384
    assert spec.halo_filter_rows in (1, g.r) and spec.filter_width == g.s
    assert (spec.dilation_h, spec.dilation_w) == g.dilation and spec.stages >= 3
    slots = spec.tile_n + (spec.halo_filter_rows - 1) * g.dilation[0] * pitch + -(-(g.s - 1) * g.dilation[1] // 8) * 8
    stage = -(-(spec.halo_filter_rows * g.s * spec.tile_m * 32 + 2 * slots * 16) // 1024) * 1024
    assert spec.smem_bytes == spec.stages * stage + spec.consumer_warps * 1024 + 1024
    units = g.c // 32 * g.r // spec.halo_filter_rows
    assert conv_plan.split_steps(g, spec) == units
    assert (chosen.splits - 1) * chosen.steps_per_split < units <= chosen.splits * chosen.steps_per_split


HALO_GEOMETRIES = [ConvGeometry(1, 64, 6, 7, 64, 3, 3, (1, 1), (1, 1)),
                   ConvGeometry(2, 32, 9, 10, 96, 3, 3, (1, 1), (2, 1), (2, 1)),   # dilated rows, M tail
                   ConvGeometry(1, 32, 5, 12, 32, 1, 5, (1, 1), (0, 2)),          # one filter row
                   ConvGeometry(1, 32, 5, 10, 32, 2, 3, (1, 1), (0, 1))]          # stages of 60 slots


@pytest.mark.parametrize("geometry", HALO_GEOMETRIES)
def test_halo_model_matches_the_reference(rng, geometry):
    """Every halo tile of the geometry (all R filter rows a stage where three such stages
    fit), and the first with one filter row a stage, whole and split in three, through the
    NumPy model of its copies, descriptors and pixels (tests/conv_emulation.py, halo_run),
    and whole through the int8 epilogue by warpgroup."""
    g = geometry
    x, w = _random(rng, (g.n, g.c, g.h, g.w)), _random(rng, (g.k, g.c, g.r, g.s))
    x5, w5 = cupyops.to_nchw32(x), cupyops.pack_conv_filter(w)
    expected = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    configs = conv_plan.halo_configs(g, Target.profile("h100").facts.smem_per_block_optin)
    assert {c.halo_filter_rows for c in configs} == {g.r}   # small tiles: R rows fit
    for config in dict.fromkeys(configs + (replace(configs[0], halo_filter_rows=1),)):   # one row: R = 1 already
        spec = conv_plan.spec_for(config, "auto", "sm_90")
        units = conv_plan.split_steps(g, spec)
        for splits, epilogue in ((1, "exchange"), (3, "exchange"), (1, "warpgroup")):   # int8's: no split
            per_split = -(-units // splits)
            got = cupyops.from_nchw32(conv_emulation.halo_run(spec, g, x5, w5, -(-units // per_split), per_split,
                                                              epilogue))
            bad = numpy.argwhere(got != expected)
            assert not len(bad), f"{spec.name} splits {splits} {epilogue}: first mismatch at {bad[0].tolist()}"


def test_halo_tiles_only_where_rows_are_shared():
    """Stride 1 and filters wider than a column, rows of at most 256 slots; elsewhere no
    halo candidate, and the default rule never takes one."""
    facts = Target.profile("h100").facts
    assert conv_halo.fits(RESNET_3X3) and conv_halo.fits(ConvGeometry(1, 32, 8, 8, 32, 1, 7, padding=(0, 3)))
    for g in (ConvGeometry(64, 128, 56, 56, 128, 3, 3, (2, 2), (1, 1)), ConvGeometry(64, 256, 56, 56, 64, 1, 1),
              ConvGeometry(1, 32, 8, 8, 32, 7, 1, padding=(3, 0)), ConvGeometry(1, 32, 8, 300, 32, 3, 3)):
        assert not conv_halo.fits(g) and not conv_plan.halo_configs(g, facts.smem_per_block_optin)
        found = conv_plan.candidates(g, facts.sm_count, facts.smem_per_block_optin, facts.arch)
        assert found and not any(c["tma"] == "halo" for c in found)
    found = conv_plan.candidates(RESNET_3X3, facts.sm_count, facts.smem_per_block_optin, facts.arch)
    assert any(c["tma"] == "halo" for c in found)
    assert not conv_plan.candidates(RESNET_3X3, 108, 166912, "sm_80") or not any(
        c["tma"] for c in conv_plan.candidates(RESNET_3X3, 108, 166912, "sm_80"))
    assert conv_plan.default_candidate(RESNET_3X3, facts.sm_count, facts.smem_per_block_optin, facts.arch)["tma"] == ""
    halo = next(c for c in found if c["tma"] == "halo")
    explained = conv_plan.plan_from(RESNET_3X3, halo, "sm_90", "tuned").explain()
    assert explained["persistent"] and "once for" in explained["copy"]
    assert f"_ws_halo_p{halo['halo_pitch']}_r" in explained["kernel"]
    assert explained["grid"][0] == conv_halo.tiles(RESNET_3X3, halo["tile_m"], halo["tile_n"] // halo["halo_pitch"])


def test_halo_row_counts_fill_the_sms():
    """Given the SM count, each halo tile also comes in the row count (down to half the
    most) whose tiles fill whole waves and OH best: at 3x3 64ch@56 on 132 SMs, 7 rows of
    64 slots (512 tiles, 3.9 waves) beside 8 (448 tiles, 3.4 waves)."""
    smem = Target.profile("h100").facts.smem_per_block_optin
    most = {(c.tile_m, c.tile_n, c.warp_n) for c in conv_plan.halo_configs(RESNET_3X3, smem) if c.halo_pitch == 64}
    balanced = {(c.tile_m, c.tile_n, c.warp_n) for c in conv_plan.halo_configs(RESNET_3X3, smem, 132)
                if c.halo_pitch == 64}
    assert (64, 512, 256) in most and most < balanced and (64, 448, 224) in balanced
    assert conv_halo.tiles(RESNET_3X3, 64, 7) == 512 and conv_halo.tiles(RESNET_3X3, 64, 8) == 448
    assert conv_halo._balance(RESNET_3X3, 64, 7, 132) > conv_halo._balance(RESNET_3X3, 64, 8, 132)
    for tile_m, tile_n, warp_n in balanced:
        rows = tile_n // 64
        assert 2 * rows >= 8 and tile_n % (16 * (tile_n // warp_n)) == 0


def test_wgmma_runs_on_sm_90_alone():
    assert not any(spec.wgmma for spec in conv_plan.all_specs("sm_80"))
    assert {spec.name for spec in conv_plan.all_specs("sm_90") if spec.wgmma} == \
        {conv_plan.spec_for(c, "auto", "sm_90").name for c in conv_plan.WGMMA_CONFIGS + conv_plan.TMA_CONFIGS}
    with pytest.raises(ValueError, match="sm_90"):
        conv_plan.spec_for(conv_plan.WGMMA_CONFIGS[0], "auto", "sm_80")
    with pytest.raises(ValueError, match="auto"):
        conv_plan.spec_for(conv_plan.WGMMA_CONFIGS[0], "megengine", "sm_90")
    legacy = {k: v for k, v in conv_plan.candidates(RESNET_3X3, 132, 232448, "sm_80")[0].items() if k != "wgmma"}
    assert not conv_plan.plan(RESNET_3X3, "auto", H100, tuned=legacy).spec.wgmma   # tables from before wgmma


def test_auto_plan_splits_k_where_the_grid_is_small():
    small = ConvGeometry(1, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1))
    chosen = conv_plan.plan(small, "auto", H100)
    assert chosen.splits > 1 and chosen.grid[2] == chosen.splits
    assert (chosen.splits - 1) * chosen.steps_per_split < small.k_steps


def test_candidates_fit_shared_memory_and_tuned_plans_are_used():
    found = conv_plan.candidates(RESNET_3X3, 132, 232448, "sm_90")
    assert found and all(c["tile_m"] <= 64 for c in found)
    assert all(c["stages"] * (c["tile_m"] + c["tile_n"]) * c["step_bytes"] <= 232448 for c in found)
    assert json.loads(json.dumps(found)) == found
    chosen = conv_plan.plan(RESNET_3X3, "auto", H100, tuned=found[-1])
    assert chosen.source == "tuned" and chosen.spec.tile_n == found[-1]["tile_n"]


def test_bad_geometry_names_the_problem():
    with pytest.raises(ValueError, match="to_nchw32"):
        ConvGeometry(1, 48, 8, 8, 32, 3, 3).check()
    with pytest.raises(ValueError, match="does not fit"):
        ConvGeometry(1, 32, 4, 4, 32, 7, 7).check()
    with pytest.raises(ValueError, match="taps"):
        ConvGeometry(1, 32, 40, 40, 32, 13, 13).check()
    with pytest.raises(ValueError, match="2\\*\\*31"):
        ConvGeometry(1, 2**26, 8, 8, 32, 1, 1).check()
    with pytest.raises(TypeError, match="stride"):
        conv_layout.pair(1.5, "stride")


def test_host_arrays_are_refused():
    x = numpy.zeros((1, 1, 4, 4, 32), numpy.int8)
    with pytest.raises(TypeError, match="host"):
        cupyops.conv2d_int8(x, x)
    with pytest.raises(ValueError, match="policy"):
        cupyops.conv2d_int8(x, x, policy="fast")


# -- tuner -------------------------------------------------------------------

def test_tuner_keeps_the_fastest_and_persists_it(tmp_path):
    table = tune.TuningTable(tmp_path / "t.json")
    device = tune.DeviceKey("NVIDIA H100 80GB HBM3", 12080)
    clock = {"a": 30.0, "b": 10.0, "c": 10.0}

    def fake_time(candidate):
        if candidate["id"] == "broken":
            raise RuntimeError("cannot launch")
        return clock[candidate["id"]]

    result = tune.tune(table, device, "op", "shape1", [{"id": i} for i in ("a", "broken", "b", "c")], fake_time)
    assert result.best == {"id": "b"} and result.best_us == 10.0
    assert [us for _, us in result.timings] == [30.0, None, 10.0, 10.0]
    fresh = tune.TuningTable(tmp_path / "t.json")
    assert fresh.lookup(device, "op", "shape1") == {"id": "b"}
    assert fresh.lookup(device, "op", "shape2") is None
    assert fresh.lookup(tune.DeviceKey("NVIDIA H200", 12080), "op", "shape1") is None
    tune.tune(fresh, device, "op", "shape2", [{"id": "a"}], fake_time)
    assert set(json.loads((tmp_path / "t.json").read_text())) == {
        "NVIDIA H100 80GB HBM3|cuda12080|op|shape1", "NVIDIA H100 80GB HBM3|cuda12080|op|shape2"}
    with pytest.raises(RuntimeError, match="failed"):
        tune.measure([{"id": "broken"}], fake_time)


def test_screening_times_again_only_the_candidates_near_the_fastest():
    screened = {**{f"c{i}": 100.0 + i for i in range(10)}, "near": 95.0, "far": 300.0, "broken": None}
    full = {"c0": 101.0, "c1": 99.0, "c2": 120.0, "c3": 102.0, "c4": 103.0, "near": 98.0, "far": 90.0}
    timed = []

    def screen(candidate):
        if screened[candidate["id"]] is None:
            raise RuntimeError("cannot launch")
        return screened[candidate["id"]]

    def time_us(candidate):
        timed.append(candidate["id"])
        return full[candidate["id"]]

    ids = ["far", "broken", *(f"c{i}" for i in range(10)), "near"]
    result = tune.measure([{"id": i} for i in ids], time_us, screen)
    # within 10 % of the fastest screened (95 us): near and c0 to c4, more than SCREEN_KEEP;
    # near (98 us) and c1 (99), within 3 % of each other, timed twice more
    assert sorted(timed) == ["c0", "c1", "c1", "c1", "c2", "c3", "c4", "near", "near", "near"]
    assert result.best == {"id": "near"} and result.best_us == 98.0
    times = {c["id"]: us for c, us in result.timings}
    assert times["far"] == 300.0 and times["broken"] is None and times["c1"] == 99.0 and times["c9"] == 109.0
    timed.clear()
    # fewer candidates than SCREEN_KEEP: each timed in full, a slow screen no bar
    assert tune.measure([{"id": "far"}, {"id": "c0"}], time_us, screen).best == {"id": "far"}
    assert sorted(timed) == ["c0", "far"]


def test_near_equals_are_timed_again_and_keep_their_median():
    """One slow timing of the faster of two plans 2 % apart does not hand the other the win:
    both are timed twice more (in reverse order, then in order) and keep their medians; a
    plan past TIE_WITHIN of the fastest is not timed again, nor more than TIE_MOST plans."""
    series = {"fast": [10.25, 10.0, 10.0], "close": [10.2, 10.2, 10.2], "away": [10.6]}
    order = []

    def time_us(candidate):
        order.append(candidate["id"])
        return series[candidate["id"]][order.count(candidate["id"]) - 1]

    result = tune.measure([{"id": "fast"}, {"id": "close"}, {"id": "away"}], time_us)
    assert result.best == {"id": "fast"} and result.best_us == 10.0
    assert order == ["fast", "close", "away", "close", "fast", "fast", "close"]
    assert [us for _, us in result.timings] == [10.0, 10.2, 10.6]
    order.clear()
    series["fast"] = [10.25, 10.3, 10.3]   # slower after all: the close one wins
    assert tune.measure([{"id": "fast"}, {"id": "close"}, {"id": "away"}], time_us).best == {"id": "close"}
    order.clear()
    ties = {f"t{i}": 10.0 + i / 100 for i in range(8)}   # eight within 3 %: the four fastest timed again
    timed = []
    tune.measure([{"id": i} for i in ties], lambda c: timed.append(c["id"]) or ties[c["id"]])
    assert sorted(set(i for i in timed if timed.count(i) == 3)) == ["t0", "t1", "t2", "t3"] and len(timed) == 16


def test_a_winner_tuned_among_other_candidates_is_tuned_again(monkeypatch, tmp_path):
    """Each stored winner keeps a digest of the candidates it was tuned among: live_plan
    takes it only where the generator offers the same candidates now, and tunes again on first
    use where a winner came from another list (an older cupyops's table); lookups without a
    digest (the row families') take any."""
    from cupyops.ops import conv2d_int8 as conv

    table = tune.TuningTable(tmp_path / "tuning.json")
    monkeypatch.setattr(tune, "_default_table", table)
    monkeypatch.setenv(tune.AUTOTUNE_ENV, "1")
    target, device = Target.profile("h200"), tune.DeviceKey("NVIDIA H200", 13000)
    monkeypatch.setattr(conv.Target, "live", lambda device_id: target)
    monkeypatch.setattr(tune.DeviceKey, "live", lambda device_id: device)
    g = ConvGeometry(64, 256, 56, 56, 64, 1, 1, (1, 1), (0, 0))
    facts = target.facts
    offered = conv_plan.candidates(g, facts.sm_count, facts.smem_per_block_optin, facts.arch)
    tuned = []

    def tune_shape(geometry, device_id, table_=None):   # the winner: the last candidate offered
        tuned.append(geometry)
        return tune.tune(tune.default_table(), device, conv.OP, geometry.key(), offered,
                         lambda candidate: 20.0 - offered.index(candidate) / 10)

    monkeypatch.setattr(conv, "tune_shape", tune_shape)
    older = tune.Result(offered[0], 9.0, [(c, 9.0) for c in offered[:-1]])
    table.store(device, conv.OP, g.key(), older)
    assert table.lookup(device, conv.OP, g.key()) == offered[0]
    assert table.lookup(device, conv.OP, g.key(), tune.space_of(offered)) is None
    chosen = conv.live_plan(g, "auto", 0)
    assert tuned == [g] and chosen.source == "tuned"
    assert chosen.spec == conv_plan.spec_for(conv_plan.config_of(offered[-1]), "auto", facts.arch)
    assert table.lookup(device, conv.OP, g.key(), tune.space_of(offered)) == offered[-1]
    monkeypatch.setattr(conv, "_plans", conv.LaunchCache())   # a new process: the table's winner, not tuned again
    assert conv.live_plan(g, "auto", 0).spec == chosen.spec and tuned == [g]


def test_tuning_table_sits_beside_cupys_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    assert tune.TuningTable().path == tmp_path / tune.TABLE_NAME
    monkeypatch.setenv(tune.AUTOTUNE_ENV, "0")
    assert not tune.autotune_enabled()


# -- compile -----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_configuration_compiles_without_spills(arch):
    from cli.conv import compiled_specs

    specs = compiled_specs(arch)   # on sm_90 with the halo tiles of the bench's layers
    assert any(s.tma == "halo" for s in specs if isinstance(s, conv_plan.ConvInt8Spec)) == (arch == "sm_90")
    assert {s.instruction for s in specs if isinstance(s, conv_plan.ConvInt8Spec)} == \
        {"m8n8k16", "m16n8k32"} | ({"wgmma"} if arch == "sm_90" else set())
    failures = []
    for spec in specs:
        report = jit.compile_cubin(spec, arch)
        assert report.arch == (f"{arch}a" if spec.arch_specific else arch)
        assert 0 < report.registers <= 255, (spec.name, report.registers)
        if report.spill_bytes or report.stack_bytes:
            failures.append(f"{spec.name}: {report.spill_bytes} spill bytes, {report.stack_bytes} stack, "
                            f"{report.registers} registers")
    assert not failures, "\n".join(failures)


# -- command line ------------------------------------------------------------

def _cli(*args):
    from click.testing import CliRunner

    from cli.main import main

    return CliRunner().invoke(main, list(args))


def test_cli_explain_and_compile():
    from cli import conv as conv_cli

    result = _cli("explain", "conv2d_int8", "--input", "64,256,14,14", "--filter", "256,256,3,3",
                  "--padding", "1", "--device", "h100", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["output"] == [64, 8, 14, 14, 32] and info["source"] == "default rule"
    assert {"tile", "warp", "stages", "instruction", "grid", "smem_bytes", "kernel"} <= set(info)
    result = _cli("explain", "conv2d_int8", "--input", "1,64,8,8", "--filter", "32,64,3,3", "--policy",
                  "megengine", "--device", "a100")
    assert result.exit_code == 0 and "m8n8k16" in result.output and "megengine ladder" in result.output
    result = _cli("explain", "conv2d_int8", "--input", "1,48,8,8", "--filter", "32,48,3,3", "--device", "h100")
    assert result.exit_code != 0 and "to_nchw32" in result.output
    result = _cli("compile", "conv2d_int8", "--arch", "sm_90")
    assert result.exit_code == 0, result.output
    assert f"{len(conv_cli.compiled_specs('sm_90'))} kernels compiled for sm_90, 0 failed or spilled" in result.output


def test_cli_layers_tables_and_files(tmp_path):
    from cli import conv as conv_cli

    layers = conv_cli.load_layers("resnet50")
    assert len(layers) == 7 and layers[4]["geometry"].stride == (2, 2)
    assert all(layer["geometry"].check() is None for layer in conv_cli.load_layers("all"))
    path = tmp_path / "layers.json"
    path.write_text(json.dumps([{"n": 8, "c": 64, "h": 14, "w": 14, "k": 64, "r": 3, "s": 3, "padding": 1,
                                 "dilation": "2x1", "name": "mine"}]))
    (layer,) = conv_cli.load_layers(str(path))
    assert layer["label"] == "mine" and layer["geometry"].dilation == (2, 1)
    csv_path = tmp_path / "layers.csv"
    csv_path.write_text("n,c,h,w,k,r,s,stride\n1,32,8,8,32,1,1,2\n")
    assert conv_cli.load_layers(str(csv_path))[0]["geometry"].stride == (2, 2)


# -- sm_90a ------------------------------------------------------------------

@pytest.mark.parametrize("step_bytes", [64, 128])
def test_wgmma_kernel_fences_its_pipeline(step_bytes):
    """The PTX of a wgmma kernel: the proxy fence, wgmma.fence, commit, wait 1 in the
    loop and wait 0 after it, and a k32 MMA per 32 bytes of the stage's rows."""
    spec = conv_plan.spec_for(_wgmma(256, 128, 128, step_bytes), "auto", "sm_90")
    ptx = jit.compile_ptx(spec, "sm_90")
    assert ".target sm_90a" in ptx
    for text in ("fence.proxy.async.shared::cta", "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned",
                 "wgmma.wait_group.sync.aligned 1", "wgmma.wait_group.sync.aligned 0",
                 "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8"):
        assert text in ptx, text
    assert ptx.count("wgmma.mma_async") == step_bytes // 32


@pytest.mark.parametrize("tma", ["filter", "im2col", "rows"])
def test_warp_specialised_kernel_synchronises_by_barriers(tma):
    """The PTX of a warp-specialised kernel: stage barriers waited on and armed, the
    copy engine's copies (the filter tiled; the pixels by im2col or by cp.async
    arriving on the barrier), the persistent walk over tiles (the grid's size read),
    and k32 MMAs for the chunks of a stage (a full stage's four, and the tail's)."""
    config = next(c for c in conv_plan.TMA_CONFIGS if c.tma == tma and c.step_bytes == 128)
    spec = conv_plan.spec_for(config, "auto", "sm_90")
    copy = {"im2col": "im2col_sw32", "rows": "rows4_sw32"}.get(tma, "cpasync_sw128")
    assert f"_ws_tma_{copy}_" in spec.name
    ptx = jit.compile_ptx(spec, "sm_90")
    for text in ("mbarrier.try_wait.parity.shared::cta.b64", "mbarrier.arrive.expect_tx.shared::cta.b64",
                 "cp.async.bulk.tensor.2d.shared::cluster.global.tile", "%nctaid.x",
                 "wgmma.wait_group.sync.aligned 1", ".param .align 64 .b8"):
        assert text in ptx, text
    if tma == "im2col":
        assert "cp.async.bulk.tensor.5d.shared::cluster.global.im2col" in ptx and "cp.async.cg" not in ptx
    elif tma == "rows":
        assert "cp.async.bulk.tensor.4d.shared::cluster.global.tile" in ptx and "cp.async.cg" not in ptx
        assert "im2col" not in ptx
    else:
        assert "cp.async.mbarrier.arrive.noinc" in ptx and "cp.async.cg.shared.global" in ptx
        assert "fence.proxy.async.shared::cta" in ptx
    assert ptx.count("wgmma.mma_async") >= 4
    candidate = {**asdict(config), "splits": 1, "steps_per_split": RESNET_3X3.k_steps}
    info = conv_plan.plan_from(RESNET_3X3, candidate, "sm_90", "tuned").explain()
    assert info["persistent"] and info["kernel"] == spec.name and info["copy"].startswith("copy engine (filter")
    assert not conv_plan.plan(RESNET_3X3, "auto", H100).explain()["persistent"]


def test_warp_specialised_kernels_move_registers_to_their_consumers():
    """setmaxnreg: where a warp-specialised block has two or four consumer warpgroups, its
    producer gives up registers (down to 40 or 32; a halo producer, which forms more
    addresses, to 56) and the consumers take them (232, 112, 224): a block's 65536 in
    all. One consumer keeps the 255 it has. The 64 x 512 halo tile's consumers then hold
    the warpgroup epilogue (its named barriers) beside their 128 accumulators."""
    def moves(config):
        ptx = jit.compile_ptx(conv_plan.spec_for(config, "auto", "sm_90"), "sm_90")
        return ([int(n) for n in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", ptx)],
                [int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", ptx)], ptx)

    def tma(tile_m, tile_n, warp_n):
        return next(c for c in conv_plan.TMA_CONFIGS if (c.tile_m, c.tile_n, c.warp_n, c.tma, c.cluster) ==
                    (tile_m, tile_n, warp_n, "filter", 1))

    for config, producer, consumer, threads in ((tma(128, 128, 128), 40, 232, 384),
                                                (tma(256, 128, 128), 32, 112, 640)):
        dec, inc, _ = moves(config)
        assert (dec, inc) == ([producer], [consumer])
        assert producer * 128 + consumer * (threads - 128) == 65536 // threads // 8 * 8 * threads
    assert moves(tma(64, 128, 128))[:2] == ([], [])
    vgg = ConvGeometry(32, 256, 56, 56, 256, 3, 3, (1, 1), (1, 1))
    halo = next(c for c in conv_plan.halo_configs(vgg, 232448) if (c.tile_m, c.tile_n) == (64, 512))
    dec, inc, ptx = moves(halo)
    assert (dec, inc) == ([56], [224]) and 56 * 128 + 224 * 256 <= 168 * 384
    assert re.search(r"bar\.sync\s+%r\d+, %r\d+;", ptx)   # the warpgroup epilogue's named barriers


def test_filter_pairs_multicast_their_copies(monkeypatch):
    """Pairs of blocks (a cluster of two) on one GEMM_M tile: the kernel is declared a
    cluster, copies its share of the filter rows into both blocks (multicast) through a
    map whose boxes are half a tile's rows, releases a stage in both blocks and waits
    for the pair before exiting; the grid counts whole pairs, the odd GEMM_N tile's
    partner included."""
    pairs = [c for c in conv_plan.TMA_CONFIGS if c.cluster > 1]
    assert pairs and all(c.tma == "filter" and c.cluster == conv_plan.PAIR for c in pairs)
    spec = conv_plan.spec_for(pairs[0], "auto", "sm_90")
    assert "_ws_tma_cpasync_sw128_mc2_" in spec.name
    assert "__cluster_dims__(2, 1, 1)" in jit.render(spec)
    ptx = jit.compile_ptx(spec, "sm_90")
    for text in (".multicast::cluster", "mapa.shared::cluster", "mbarrier.arrive.shared::cluster.b64",
                 "barrier.cluster.wait", "%cluster_ctarank"):
        assert text in ptx, text
    single = conv_plan.spec_for(replace(pairs[0], cluster=1), "auto", "sm_90")
    assert ".multicast::cluster" not in jit.compile_ptx(single, "sm_90")
    late = ConvGeometry(64, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1))   # 25 GEMM_N tiles of 128
    assert conv_plan.grid_tiles(late, spec) == 2 * 13 * 2 and conv_plan.grid_tiles(late, single) == 2 * 25
    boxes = []
    monkeypatch.setattr(conv_tma.tensor_map, "encode_tiled", lambda address, layout: boxes.append(layout.box))
    conv_tma.maps(late, spec, 0, 0)
    conv_tma.maps(late, single, 0, 0)
    assert boxes == [(128, spec.tile_m // 2), (128, spec.tile_m)]
    candidate = {**asdict(pairs[0]), "splits": 1, "steps_per_split": late.k_steps}
    assert "shared by a cluster of 2" in conv_plan.plan_from(late, candidate, "sm_90", "tuned").explain()["copy"]


def test_halo_int8_epilogue_exchanges_between_lanes_where_registers_allow():
    """A halo warpgroup's int8 epilogue without z needs no shared memory where the registers a
    thread has at launch leave 48 past its accumulators: two butterfly shuffles and packing
    conversions. A 64 x 256 warpgroup beside another (168 registers) keeps the exchange
    through shared memory."""
    g = ConvGeometry(64, 64, 56, 56, 64, 3, 3, (1, 1), (1, 1))
    configs = {(c.tile_n, c.warp_n): c for c in conv_plan.halo_configs(g, 232448, 132)}
    lanes = jit.compile_ptx(conv_plan.spec_for(configs[(448, 224)], "auto", "sm_90"), "sm_90")
    assert "shfl.sync.bfly.b32" in lanes and "cvt.pack.sat.s8.s32.b32" in lanes
    shared = jit.compile_ptx(conv_plan.spec_for(configs[(512, 256)], "auto", "sm_90"), "sm_90")
    assert "shfl.sync.bfly" not in shared and "cvt.pack.sat" not in shared


def test_pairs_splitting_gemm_k_sum_in_distributed_shared_memory():
    """Pairs of blocks on one tile, each taking half its GEMM_K (a cluster of two): offered
    only where the tiles leave SMs idle and each block gets MIN_STEPS_PER_SPLIT steps of
    every split or more; the grid holds every pair (not persistent); the kernel is declared
    a cluster, reads its pair's accumulators from distributed shared memory and waits for
    its pair before exiting."""
    k_pairs = [c for c in conv_plan.TMA_CONFIGS if c.k_blocks > 1]
    assert k_pairs and all(c.tma == "filter" and c.cluster == 1 and c.k_blocks == conv_plan.PAIR for c in k_pairs)
    late = ConvGeometry(64, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1))
    found = [c for c in conv_plan.candidates(late, 132, 232448, "sm_90") if c["k_blocks"] > 1]
    assert {(c["tile_m"], c["tile_n"]) for c in found} == {(c.tile_m, c.tile_n) for c in k_pairs}
    few = ConvGeometry(16, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1))   # 18 pairs of 256 x 96 tiles: split-K as well
    assert any(c["splits"] > 1 for c in conv_plan.candidates(few, 132, 232448, "sm_90") if c["k_blocks"] > 1)
    for candidate in found:
        chosen = conv_plan.plan_from(late, candidate, "sm_90", "tuned")
        info = chosen.explain()
        assert info["cluster_split_k"] == 2 and not info["persistent"] and "_ks2_" in info["kernel"]
        assert chosen.grid[0] == 2 * conv_plan.grid_tiles(late, chosen.spec)
        assert chosen.steps_per_split // 2 >= conv_plan.MIN_STEPS_PER_SPLIT
    assert not any(c["k_blocks"] > 1 for c in conv_plan.candidates(RESNET_3X3, 132, 232448, "sm_90"))   # SMs full
    short = ConvGeometry(64, 32, 7, 7, 512, 3, 3, (1, 1), (1, 1))   # 5 GEMM_K steps
    assert not any(c["k_blocks"] > 1 for c in conv_plan.candidates(short, 132, 232448, "sm_90"))
    spec = conv_plan.spec_for(k_pairs[0], "auto", "sm_90")
    assert "__cluster_dims__(2, 1, 1)" in jit.render(spec)
    ptx = jit.compile_ptx(spec, "sm_90")
    for text in ("ld.shared::cluster.v4.s32", "mapa.shared::cluster", "barrier.cluster.wait", "%cluster_ctarank"):
        assert text in ptx, text
    assert ".multicast::cluster" not in ptx


def test_halo_pairs_multicast_the_taps():
    """Halo tiles in pairs: every halo tile comes as a cluster of two whose blocks bring
    every other tap into both (multicast); the grid counts whole pairs, the last one's
    second block without an image where the tiles are odd (3 images of one row block of
    16-slot rows)."""
    g = ConvGeometry(3, 64, 7, 7, 64, 3, 3, (1, 1), (1, 1))
    pairs = conv_plan.halo_configs(g, 232448)
    assert pairs and all(c.cluster == conv_plan.PAIR for c in pairs)
    spec = conv_plan.spec_for(next(c for c in pairs if c.halo_pitch == 16), "auto", "sm_90")
    assert "_ws_halo_" in spec.name and spec.name.endswith("_mc2_align16_nchw32_lincomb")
    assert "__cluster_dims__(2, 1, 1)" in jit.render(spec)
    ptx = jit.compile_ptx(spec, "sm_90")
    for text in (".multicast::cluster", "mbarrier.arrive.shared::cluster.b64", "barrier.cluster.wait"):
        assert text in ptx, text
    alone = conv_halo.tiles(g, spec.tile_m, spec.tile_n // spec.halo_pitch)
    assert alone == 3 and conv_plan.grid_tiles(g, spec) == 4


def test_copy_engine_maps_describe_the_convolution():
    """The im2col map's box corners give back the output size along each dim (the
    engine walks (W + upper - lower - 1) / stride + 1 positions), the image sits between
    the spatial dims and the channel group, the strides are the NCHW32 array's; the
    filter map's boxes are a stage's bytes by a tile's rows."""
    g = ConvGeometry(2, 64, 23, 17, 96, 3, 5, (2, 1), (1, 2), (1, 2))
    layout = conv_tma.input_layout(g, 128)
    assert layout.dims == (32, 17, 23, 2, 2) and layout.channels == 32 and layout.pixels == 128
    assert layout.strides == (32, 17 * 32, 2 * 23 * 17 * 32, 23 * 17 * 32)
    assert layout.tensor_bytes == g.n * g.c * g.h * g.w
    for dim, (size, out, stride) in enumerate(((g.w, g.ow, g.stride[1]), (g.h, g.oh, g.stride[0]), (g.n, g.n, 1))):
        span = size + layout.upper_corner[dim] - layout.lower_corner[dim] - 1
        assert span // stride + 1 == out and layout.element_strides[dim + 1] == stride
    assert layout.lower_corner == (-2, -1, 0) and layout.upper_corner == (2 - 8, 1 - 2, 0)
    filters = conv_tma.filter_layout(g, 128, 128)
    assert filters.dims == (g.gemm[2], 96) and filters.strides == (g.gemm[2],) and filters.box == (128, 128)
    assert filters.tensor_bytes == g.k * g.gemm[2] and filters.swizzle == 128


@pytest.mark.parametrize("geometry", [ConvGeometry(2, 64, 9, 11, 32, 3, 3, (1, 1), (1, 1)),
                                      ConvGeometry(3, 32, 15, 14, 32, 3, 5, (2, 1), (1, 2), (1, 2)),
                                      ConvGeometry(2, 32, 23, 23, 32, 7, 7, (2, 2), (3, 3)),
                                      ConvGeometry(1, 96, 5, 5, 32, 3, 3, (1, 1), (3, 3))])
def test_im2col_copies_walk_gemm_n_within_a_channel_group(rng, geometry):
    """The kernel's im2col copies (start at the tile's first pixel, ow * stride - pad,
    oh * stride - pad, its image and the chunk's channel group; the tap's offsets) over
    the map of conv_tma.input_layout give the implicit GEMM's B rows of that chunk, tile
    after tile, across rows and images, padding read as zeros."""
    g = geometry
    x = rng.integers(-128, 128, (g.n, g.c, g.h, g.w), dtype=numpy.int8)
    x5 = cupyops.to_nchw32(x)
    tile_n = 32
    layout = conv_tma.input_layout(g, tile_n)
    _, rows, cols = conv_layout.tap_table(g)
    ohw = g.oh * g.ow
    for n0 in range(0, g.gemm[1], tile_n):
        image, rest = divmod(n0, ohw)
        oh, ow = divmod(rest, g.ow)
        start = (ow * g.stride[1] - g.padding[1], oh * g.stride[0] - g.padding[0], image)
        for chunk in range(g.c // 32 * g.r * g.s):
            group, tap = divmod(chunk, g.r * g.s)
            got = conv_emulation.im2col_copy(x5, layout, (*start, group), (cols[tap], rows[tap], 0))
            for j in range(n0, min(n0 + tile_n, g.gemm[1])):
                b, rest = divmod(j, ohw)
                ih = rest // g.ow * g.stride[0] - g.padding[0] + rows[tap]
                iw = rest % g.ow * g.stride[1] - g.padding[1] + cols[tap]
                inside = 0 <= ih < g.h and 0 <= iw < g.w
                expected = x5[b, group, ih, iw] if inside else numpy.zeros(32, numpy.int8)
                assert numpy.array_equal(got[j - n0], expected), (n0, chunk, j)


@pytest.mark.parametrize("geometry, tile_n", [(ConvGeometry(2, 96, 8, 28, 32, 1, 1, (1, 1), (0, 0)), 224),
                                               (ConvGeometry(3, 32, 4, 16, 64, 1, 1, (1, 1), (0, 0)), 64)])
def test_rows_of_four_pixels_reach_wgmma_as_the_tiles_pixels_reordered(rng, geometry, tile_n):
    """The kernel's tiled copies of rows of four pixels (conv_tma.rows_layout: start at the
    tile's first pixel over four, its channel group and image; 128-byte swizzle) into a
    1024-aligned B slice, read by wgmma through the 32-byte-swizzle descriptor the im2col
    copies use: slot j of every tile holds pixel j ^ (j / 8 % 4) of GEMM_N, all 32 of its
    channels in order (kernels/conv_int8.cuh's RowsPixels)."""
    g = geometry
    assert conv_tma.rows_fit(g, tile_n)
    x5 = cupyops.to_nchw32(rng.integers(-128, 128, (g.n, g.c, g.h, g.w), dtype=numpy.int8))
    pixels = x5.transpose(1, 0, 2, 3, 4).reshape(g.c // 32, g.gemm[1], 32)   # [group][GEMM_N column]
    layout = conv_tma.rows_layout(g, tile_n)
    plane = g.h * g.w
    base = 3 * 1024   # a B slice after the filter's
    for n0 in range(0, g.gemm[1], tile_n):
        image, rest = divmod(n0, plane)
        for group in range(g.c // 32):
            shared = numpy.zeros(base + tile_n * 32, numpy.int8)
            conv_emulation.tiled_copy(x5.reshape(-1), layout, (0, rest // 4, group, image), shared, base)
            got = conv_emulation.wgmma_operand(shared, conv_emulation.wgmma_descriptor(base, 32), tile_n)
            slots = numpy.arange(n0, n0 + tile_n)
            assert numpy.array_equal(got, pixels[group, slots ^ ((slots >> 3) & 3)]), (n0, group)
    assert not conv_tma.rows_fit(g, 96) and not conv_tma.rows_fit(replace(g, padding=(1, 1)), tile_n)
    assert not conv_tma.rows_fit(replace(g, r=3, s=3), tile_n) and not conv_tma.rows_fit(replace(g, stride=(2, 2)), 32)
    spec = conv_plan.spec_for(next(c for c in conv_plan.TMA_CONFIGS if c.tma == "rows"), "auto", "sm_90")
    with pytest.raises(ValueError, match="rows of four"):   # a 3x3 filter: no map, rather than a wrong result
        conv_tma.maps(replace(g, r=3, s=3, padding=(1, 1)), spec, 0, 0)


def test_copy_engine_refuses_what_its_maps_cannot_describe():
    assert all(conv_tma.fits(ConvGeometry(32, 64, 56, 56, 64, r, r, (1, 1), (r // 2, r // 2))) for r in (1, 3, 5, 7))
    assert not conv_tma.fits(ConvGeometry(1, 32, 64, 64, 32, 3, 3, (1, 1), (17, 17)))      # a corner past -16
    assert not conv_tma.fits(ConvGeometry(1, 32, 80, 80, 32, 3, 3, (1, 1), (1, 1), (16, 16)))  # offsets past 31
    assert not conv_tma.fits(ConvGeometry(1, 32, 64, 64, 32, 1, 1, (9, 9), (0, 0)))         # stride past 8
    big_pad = ConvGeometry(1, 32, 64, 64, 32, 3, 3, (1, 1), (17, 17))
    assert not any(c["tma"] == "im2col" for c in conv_plan.candidates(big_pad, 132, 232448, "sm_90"))
    assert any(c["tma"] == "filter" for c in conv_plan.candidates(big_pad, 132, 232448, "sm_90"))


@pytest.mark.parametrize("version, tensor_bytes, cleared", [(13000, 4096, True), (13010, (1 << 17) - 1, True),
                                                            (13020, 4096, False), (13000, 1 << 17, False)])
def test_small_tensor_maps_drop_the_drivers_flag(version, tensor_bytes, cleared):
    raw = (ctypes.c_uint8 * 128)(*([0xFF] * 128))
    record = tensor_map._finish(raw, 0, "encode", tensor_bytes, version)
    words = record["opaque"][0]
    assert record.dtype.itemsize == 128 and words[0] == 2**64 - 1
    assert bool(words[1] & tensor_map.SMALL_TENSOR_FLAG) != cleared and words[1] | tensor_map.SMALL_TENSOR_FLAG == 2**64 - 1
    with pytest.raises(RuntimeError, match="error 1"):
        tensor_map._finish(raw, 1, "encode", tensor_bytes, version)


def test_arch_specific_cubins_are_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    spec = mma_peak.MmaPeakSpec("wgmma_m64n256k32")
    assert spec.arch_specific and jit.target_arch(spec, "sm_90") == "sm_90a"
    assert jit.target_arch(mma_peak.MmaPeakSpec("m16n8k32"), "sm_90") == "sm_90"
    cubin = jit.cached_cubin(spec, "sm_90a")
    (path,) = (tmp_path / jit.CubinKernel.CACHE_FOLDER).glob(f"{spec.name}_*.cubin")
    assert path.read_bytes() == cubin and cubin[:4] == b"\x7fELF"
    assert jit._whole_elf(cubin) == cubin and jit._whole_elf(cubin[:-1]) == cubin   # CuPy drops the last byte

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(jit, "_nvrtc", no_compile)
    assert jit.cached_cubin(spec, "sm_90a") == cubin


def test_precompile_fills_the_cubin_cache_for_arch_specific_kernels(monkeypatch, tmp_path):
    """The tuner's precompile leaves one cubin per arch-specific kernel (repeats compiled
    once, the others left to their first launch), which later loads read without NVRTC."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    specific = [conv_plan.spec_for(c, "auto", "sm_90") for c in conv_plan.WGMMA_CONFIGS[:2]]
    generic = mma_peak.MmaPeakSpec("m16n8k32")
    jit.precompile([*specific, generic, specific[0]], "sm_90")
    folder = tmp_path / jit.CubinKernel.CACHE_FOLDER
    assert sorted(p.name.rsplit("_", 1)[0] for p in folder.glob("*.cubin")) == sorted(s.name for s in specific)

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(jit, "_nvrtc", no_compile)
    for spec in specific:
        (path,) = folder.glob(f"{spec.name}_*.cubin")
        assert jit.cached_cubin(spec, "sm_90a") == path.read_bytes()


def test_peak_kernels_per_arch():
    assert [s.instruction for s in mma_peak.peak_specs("sm_80")] == ["m8n8k16", "m16n8k32"]
    assert [s.instruction for s in mma_peak.peak_specs("sm_90")] == ["m8n8k16", "m16n8k32", "wgmma_m64n256k32"]
    assert [s.instruction for s in mma_peak.peak_specs("sm_100")] == ["m8n8k16", "m16n8k32"]
    wgmma = mma_peak.MmaPeakSpec("wgmma_m64n256k32")
    assert wgmma.ops_per_iteration == 2 * mma_peak.WGMMA_BATCH * 2 * 64 * 256 * 32
    assert mma_peak.MmaPeakSpec("m8n8k16").ops_per_iteration == 8 * mma_peak.MMA_SYNC_CHAINS * 2 * 8 * 8 * 16


def test_copy_engine_rate_script_compiles_both_copies():
    """scripts/tma_rate.py times the copy engine's tiled and im2col copies through
    kernels/tma.cuh: its kernel still compiles (NVRTC) and issues both."""
    import importlib.util

    path = jit.resource_dir("kernels").parent / "scripts" / "tma_rate.py"
    spec_ = importlib.util.spec_from_file_location("tma_rate", path)
    rate = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(rate)
    ptx = rate.compile_ptx()
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile" in ptx
    assert "cp.async.bulk.tensor.5d.shared::cluster.global.im2col" in ptx


def test_phase_stamps_still_fit_the_halo_kernel(monkeypatch):
    """scripts/conv_phases.py stamps a copy of the halo kernel: every stamp still finds its
    text once (with the epilogue skipped too), and a halo kernel compiled against the copy
    holds the stamps' counters; kernels/ itself is untouched."""
    import importlib.util

    path = jit.resource_dir("kernels").parent / "scripts" / "conv_phases.py"
    spec_ = importlib.util.spec_from_file_location("conv_phases", path)
    phases = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(phases)
    folder = phases.stamped_headers(no_epilogue=True)
    text = (folder / "conv_halo.cuh").read_text()
    assert text.count("atomicAdd(&conv_phase_cycles") == 6 and phases.SKIPPED_EPILOGUE in text
    assert "conv_phase_cycles" not in (jit.resource_dir("kernels") / "conv_halo.cuh").read_text()
    layer = next(layer for layer in phases.load_layers("all") if layer["label"] == "3x3 64ch@56")
    config = phases.configs(layer, "mc2")[0]
    monkeypatch.setattr(jit, "resource_dir", jit.resource_dir)   # put back at the end
    try:
        phases.use_headers(folder)
        ptx = jit.compile_ptx(conv_plan.spec_for(config, "auto", "sm_90"), "sm_90")
    finally:
        monkeypatch.undo()
        jit.headers_fingerprint.cache_clear()
    assert "conv_phase_cycles" in ptx and jit.resource_dir("kernels") != folder
