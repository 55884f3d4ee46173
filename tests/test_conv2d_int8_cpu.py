"""CPU tests of the int8 convolution (SPEC §7, §10, §11): the NumPy reference,
the NCHW32 / filter layouts, the tap table and parameter block, a thread-level
NumPy model of the kernel (tests/conv_emulation.py) against the reference,
the planner, the tuner with a fake clock, and NVRTC compiles of every
configuration for sm_80 and sm_90."""
from __future__ import annotations

import json
import re

import numpy
import pytest

import cupyops
from cupyops import jit, tune
from cupyops.launch import Target
from cupyops.ops import conv2d_int8 as conv
from cupyops.ops import conv_layout
from cupyops.ops import conv_reference as ref
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


@pytest.mark.parametrize("taps", [1, 2, 3, 9, 49])
def test_chunk_walk_without_division_matches_divmod(taps):
    """The kernel's advance (tap += 2, carried into the channel group) against divmod."""
    for start in range(4):
        chunk = start
        group, tap = divmod(chunk, taps)
        for _ in range(60):
            assert (group, tap) == divmod(chunk, taps)
            chunk, tap = chunk + 2, tap + 2
            while tap >= taps:
                tap -= taps
                group += 1


def test_params_block_matches_the_c_struct():
    header = (jit.resource_dir("kernels") / "conv_int8.cuh").read_text()
    body = re.search(r"struct ConvParams \{(.*?)\};", header, re.S).group(1)
    names = re.findall(r"(\w+)(?:\[CONV_MAX_TAPS\])?[,;]", re.sub(r"//[^\n]*", "", body))
    assert names == list(conv_layout.PARAMS_DTYPE.names)
    assert int(re.search(r"CONV_MAX_TAPS = (\d+)", header).group(1)) == conv_layout.MAX_TAPS
    assert conv_layout.PARAMS_DTYPE.itemsize == 4 * (len(names) - 3 + 3 * conv_layout.MAX_TAPS)
    g = ConvGeometry(1, 64, 10, 10, 32, 3, 3, (1, 1), (1, 1), (2, 2))
    params = conv_layout.kernel_params(g, out_dtype="float16", bias_kind="int32", alpha=0.5)[0]
    assert (params["taps"], params["out_kind"], params["bias_kind"], params["k_steps"]) == (9, 1, 2, 9)
    assert params["alpha"] == 0.5 and params["tap_dw"][2] == 4 and params["tap_offset"][3] == 2 * 10 * 32


def _auto(tile_m, tile_n):
    return next(c for c in conv.AUTO_CONFIGS if (c.tile_m, c.tile_n) == (tile_m, tile_n))


def _megengine(tile_m, tile_n):
    return next(c for c in conv.MEGENGINE_LADDER if (c.tile_m, c.tile_n) == (tile_m, tile_n))


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


@pytest.mark.parametrize("policy", ["megengine", "auto"])
@pytest.mark.parametrize("geometry,config", EMULATED)
def test_kernel_model_matches_the_reference(rng, geometry, config, policy):
    g = geometry
    x, w = _random(rng, (g.n, g.c, g.h, g.w)), _random(rng, (g.k, g.c, g.r, g.s))
    spec = conv.spec_for(config, policy, "sm_90")
    y, writes = conv_emulation.run(spec, g, cupyops.to_nchw32(x), cupyops.pack_conv_filter(w))
    assert (writes == 1).all(), "outputs not written exactly once"
    expected = ref.accumulators(x, w, g.stride, g.padding, g.dilation)
    got = cupyops.from_nchw32(y)
    bad = numpy.argwhere(got != expected)
    assert not len(bad), f"{spec.name}: first mismatch at (n, k, oh, ow) {bad[0].tolist()}"


def test_kernel_model_split_k(rng):
    g = ConvGeometry(1, 64, 4, 4, 32, 3, 3, (1, 1), (1, 1))
    x, w = _random(rng, (g.n, g.c, g.h, g.w)), _random(rng, (g.k, g.c, g.r, g.s))
    splits, per_split = conv.split_k(g, 1, 132)
    assert splits > 1 and (splits - 1) * per_split < g.k_steps <= splits * per_split
    spec = conv.spec_for(_auto(32, 128), "auto", "sm_90")
    y, writes = conv_emulation.run(spec, g, cupyops.to_nchw32(x), cupyops.pack_conv_filter(w), splits, per_split)
    assert (writes == 1).all()
    numpy.testing.assert_array_equal(cupyops.from_nchw32(y), ref.accumulators(x, w, g.stride, g.padding))


def test_shared_tile_swizzle_is_conflict_free():
    """Eight rows of one vector (an ldmatrix phase) and four threads' rows of
    four vectors (a phase of 16-byte stores) each cover all 32 banks."""
    for base in range(0, 128, 8):
        for vector in range(4):
            banks = {conv_emulation.tile_offset(base + r, vector) % 128 // 16 for r in range(8)}
            assert len(banks) == 8
        for first in range(0, 8, 2):
            stores = {conv_emulation.tile_offset(base + first + r, v) % 128 // 16
                      for r in range(2) for v in range(4)}
            assert len(stores) == 8


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
    chosen = conv.plan(ConvGeometry(64, 256, 14, 14, 256, 3, 3, padding=(1, 1)), "megengine", H100)
    assert chosen.spec.name == ("conv2d_int8_fprop_sm75_m8n8k16_s8_tb128x128x64_w64x64x64_st2_ldg_align16"
                                "_nchw32_lincomb")
    assert chosen.splits == 1 and chosen.source == "megengine ladder"
    assert conv.plan(RESNET_3X3, "megengine", H100).spec.tile_m == 64
    assert conv.plan(ConvGeometry(1, 32, 8, 8, 32, 1, 1), "megengine", H100).spec.tile_m == 32


def test_auto_plan_default_rule_and_explain():
    chosen = conv.plan(RESNET_3X3, "auto", H100)
    info = chosen.explain()
    assert info["source"] == "default rule" and info["instruction"] == "mma.sync.m16n8k32.s8"
    assert chosen.spec.async_copy and 3 <= chosen.spec.stages <= 6 and chosen.spec.tile_m <= 64
    m, n, _ = RESNET_3X3.gemm
    assert info["grid"] == [-(-n // chosen.spec.tile_n) * -(-m // chosen.spec.tile_m), 1, 1]
    assert info["kernel"].startswith("conv2d_int8_fprop_sm80_m16n8k32_s8_tb")
    assert conv.plan(ConvGeometry(64, 256, 14, 14, 256, 3, 3), "auto", Target.profile("a100")).spec.instruction \
        == "m16n8k32"


def test_auto_plan_splits_k_where_the_grid_is_small():
    small = ConvGeometry(1, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1))
    chosen = conv.plan(small, "auto", H100)
    assert chosen.splits > 1 and chosen.grid[2] == chosen.splits
    assert (chosen.splits - 1) * chosen.steps_per_split < small.k_steps


def test_candidates_fit_shared_memory_and_tuned_plans_are_used():
    found = conv.candidates(RESNET_3X3, 132, 232448)
    assert found and all(c["tile_m"] <= 64 for c in found)
    assert all(c["stages"] * (c["tile_m"] + c["tile_n"]) * 64 <= 232448 for c in found)
    assert json.loads(json.dumps(found)) == found
    chosen = conv.plan(RESNET_3X3, "auto", H100, tuned=found[-1])
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


def test_tuning_table_sits_beside_cupys_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    assert tune.TuningTable().path == tmp_path / tune.TABLE_NAME
    monkeypatch.setenv(tune.AUTOTUNE_ENV, "0")
    assert not tune.autotune_enabled()


# -- compile -----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_configuration_compiles_without_spills(arch):
    specs = conv.all_specs(arch) + [conv.SplitReduceSpec()]
    assert {s.instruction for s in specs[:-1]} == {"m8n8k16", "m16n8k32"}
    failures = []
    for spec in specs:
        report = jit.compile_cubin(spec, arch)
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
    assert f"{len(conv.all_specs('sm_90')) + 1} kernels compiled for sm_90, 0 failed or spilled" in result.output


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
