"""CPU tests: NVRTC compiles of every softmax instantiation the sweeps need, and the
occupancy calculator against numbers worked by hand (SPEC §3.6, §4, §10)."""
from __future__ import annotations

import pytest
from cupy.cuda import nvrtc

from cupyops import device, jit
from cupyops.device import PROFILES, max_active_blocks
from cupyops.launch import Target
from cupyops.ops import norm, softmax_axis
from cupyops.ops.softmax_rows import OPS, SoftmaxSpec, plan

ROWS = 49152
SWEEP_COLS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
              1000, 1536, 3000, 12345, 65536, 131072, 262144)
# odd rows the sweep lacks: peeled register blocks of one and two warps a row,
# peeled rows in shared memory and read again
PEELED_COLS = (255, 1023, 1033, 20001, 116863)
ARCHS = {"sm_80": "a100", "sm_90": "h100"}
REGISTER_PATHS = ("warp", "block_regs")


def _sweep_specs(arch: str, dtype: str) -> set:
    """Every kernel the sweep launches on the arch's profile, with the
    shared-memory candidates OneFlow's block-size rule compiles."""
    target = Target.profile(ARCHS[arch])
    specs = set()
    for op in OPS:
        for policy in ("auto", "oneflow"):
            for cols in SWEEP_COLS + PEELED_COLS:
                spec = plan(op, ROWS, cols, dtype, policy, target).spec
                specs.add(spec)
                if spec.impl == "block_smem" and not spec.storage_cache:
                    specs.update(SoftmaxSpec(op, "block_smem", dtype, spec.pack_size, block_size=b)
                                 for b in (128, 256, 512, 1024))
    return specs


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sweep_compiles(arch, dtype):
    specs = _sweep_specs(arch, dtype)
    assert {spec.impl for spec in specs} >= {"warp", "block_regs", "block_uncached"}
    spills = []
    for spec in sorted(specs, key=lambda s: s.name):
        report = jit.compile_cubin(spec, arch)    # raises jit.CompileError on failure
        assert (report.name, report.arch) == (spec.name, arch)
        assert report.cubin_bytes > 0 and 0 < report.registers <= 255
        if spec.impl == "block_smem" or spec.impl == "block_async":
            assert report.smem_bytes > 0        # the block reduction's partials
        # f64 is exempt: libdevice's double exp / log are calls that spill around the call
        if dtype != "f64" and spec.impl in REGISTER_PATHS and report.spill_bytes:
            spills.append(f"{spec.name}: {report.spill_bytes} spill bytes, "
                          f"{report.registers} registers")
    assert not spills, "register-cached kernels spill:\n" + "\n".join(spills)


def test_compile_report_reads_ptxas():
    spec = SoftmaxSpec("softmax", "block_smem", "f32", 2, block_size=1024)
    report = jit.compile_cubin(spec, "sm_90")
    # partials of the max and the sum reductions: 2 x 32 warps x 4 bytes
    assert report.smem_bytes == 256
    assert report.spill_bytes == 0 and report.stack_bytes == 0
    assert jit.compile_cubin(spec, "sm_90") is report          # memoised


def test_compile_report_survives_a_cached_compile(monkeypatch):
    """A compile answered from NVRTC's cache has no ptxas report: the report
    comes from one more compile of a module no cache holds, same kernel."""
    spec = SoftmaxSpec("softmax", "block_smem", "f32", 2, block_size=128)
    compile_with_log = jit._compile_with_log
    sources = []

    def first_cached(spec_, arch, source, options):
        sources.append(source)
        log, cubin = compile_with_log(spec_, arch, source, options)
        return ("" if len(sources) == 1 else log), cubin

    monkeypatch.setattr(jit, "_compile_with_log", first_cached)
    report = jit.compile_cubin.__wrapped__(spec, "sm_90")
    assert len(sources) == 2 and sources[1].startswith(sources[0]) and sources[1] != sources[0]
    expected = jit.compile_cubin(spec, "sm_90")
    assert (report.registers, report.smem_bytes, report.spill_bytes) == \
        (expected.registers, expected.smem_bytes, expected.spill_bytes) and report.registers > 0


def test_compile_error_names_the_kernel():
    spec = SoftmaxSpec("softmax", "warp", "f32", 3, cols_per_thread=4, thread_group_width=32)
    with pytest.raises(jit.CompileError, match=spec.name):     # static_assert: 4 % 3 != 0
        jit.compile_cubin(spec, "sm_90")


# -- occupancy calculator -------------------------------------------------------------
# sm_80 / sm_90: 65536 registers per SM in 4 sub-partitions of 16384, allocated per
# warp in units of 256; shared memory per block rounded up to 128 bytes after adding
# the 1 KB the driver reserves; at most 32 blocks and 2048 threads (64 warps) per SM.
H100 = PROFILES["h100"]   # 233472 B shared memory per SM, 232448 B opt-in per block
A100 = PROFILES["a100"]   # 167936 B per SM, 166912 B opt-in

OCCUPANCY_CASES = [
    # facts, block, registers, smem, expected, arithmetic
    (H100, 1024, 64, 0, 1, "64*32=2048/warp; 16384/2048=8 warps/sub-partition -> 32/SM -> 32//32=1"),
    (H100, 256, 32, 0, 8, "1024/warp; 16 warps/sub -> 64/SM -> 64//8=8; warps 64//8=8"),
    (H100, 128, 32, 0, 16, "64 warps by registers // 4 = 16; warps 64//4 = 16"),
    (H100, 256, 255, 0, 1, "255*32=8160 -> 8192/warp; 8 warps x 8192 = 65536 fits; "
                           "16384//8192=2 warps/sub -> 8/SM -> 8//8=1"),
    (H100, 512, 255, 0, 0, "16 warps x 8192 = 131072 > 65536 registers per block"),
    (H100, 32, 255, 0, 8, "one warp: 2 warps/sub -> 8 warps -> 8 blocks"),
    (H100, 128, 40, 0, 12, "1280/warp; 16384//1280=12 -> 48 warps -> 48//4=12"),
    (H100, 128, 33, 0, 12, "33*32=1056 rounds up to 1280: as 40 registers"),
    (H100, 128, 72, 0, 7, "2304/warp; 16384//2304=7 -> 28 warps -> 28//4=7"),
    (H100, 128, 32, 48 * 1024, 4, "49152+1024=50176 (a multiple of 128); 233472//50176=4"),
    (H100, 128, 32, 48 * 1024 + 32, 4, "50208 -> 50304; 233472//50304=4"),
    (A100, 128, 32, 48 * 1024, 3, "167936//50176=3"),
    (H100, 256, 32, 100 * 1024, 2, "102400+1024=103424; 233472//103424=2"),
    (H100, 256, 32, 232448, 1, "the opt-in limit: 232448+1024=233472 -> 1 block"),
    (H100, 256, 32, 232449, 0, "one byte over the opt-in limit"),
    (A100, 256, 32, 166912, 1, "166912+1024=167936 -> 1"),
    (A100, 256, 32, 166913, 0, "over A100's opt-in limit"),
    (H100, 128, 16, 1, 16, "1+1024 -> 1152; 233472//1152=202 blocks; warps limit 16"),
    (H100, 32, 16, 0, 32, "512/warp -> 128 warps; 64 warps -> 64 blocks; 32 blocks per SM"),
    (H100, 64, 0, 0, 32, "no registers, no shared memory: 32 blocks per SM"),
    (H100, 1024, 16, 0, 2, "2048 threads per SM: 64 warps // 32"),
    (H100, 768, 16, 0, 2, "24 warps: 64//24=2"),
    (H100, 640, 16, 0, 3, "20 warps: 64//20=3"),
    (H100, 100, 16, 0, 16, "100 threads take 4 warps: 64//4=16"),
    (H100, 1025, 16, 0, 0, "more than 1024 threads per block"),
    (H100, 0, 16, 0, 0, "no threads"),
]


@pytest.mark.parametrize("facts, block_size, registers, smem, expected, arithmetic",
                         OCCUPANCY_CASES, ids=[c[-1][:40] for c in OCCUPANCY_CASES])
def test_max_active_blocks(facts, block_size, registers, smem, expected, arithmetic):
    assert max_active_blocks(facts, block_size, registers, smem) == expected, arithmetic


def test_max_active_blocks_respects_launch_bounds():
    # a kernel compiled with __launch_bounds__(128) cannot launch 256 threads
    assert max_active_blocks(H100, 256, 32, 0, max_threads_per_block=128) == 0
    assert max_active_blocks(H100, 128, 32, 0, max_threads_per_block=128) == 16


def test_profiles():
    for name, facts in PROFILES.items():
        assert facts.smem_per_block_optin + facts.smem_reserved_per_block == facts.smem_per_sm
        assert (facts.max_threads_per_sm, facts.max_blocks_per_sm, facts.regs_per_sm) == (2048, 32, 65536)
    assert (H100.sm_count, H100.arch, A100.sm_count, A100.arch) == (132, "sm_90", 108, "sm_80")
    assert PROFILES["h200"].arch == "sm_90"
    with pytest.raises(ValueError, match="h100"):
        device.profile("h300")


def test_profile_target_occupancy_uses_the_compiled_kernel():
    spec = SoftmaxSpec("softmax", "block_uncached", "f32", 2, block_size=1024)
    report = jit.compile_cubin(spec, "sm_90")
    target = Target.profile("h100")
    expected = max_active_blocks(H100, 1024, report.registers, report.smem_bytes + 4096, 1024)
    assert expected > 0
    assert target.max_active_blocks(spec, 1024, 4096, False) == expected
    assert target.resources(spec)["registers"] == report.registers


@pytest.mark.parametrize("family", ["rows", "axis", "norm_grad"])
def test_cluster_kernels_fence_shared_memory_in_the_loop_and_exit_relaxed(family):
    """A cluster's blocks combine their partials through a barrier whose
    release is a fence on shared memory only (a relaxed barrier alone lets a
    block read another's partials before they land; the barrier's own release
    waits for every global store), and leave through a relaxed barrier
    (kernels/cluster.cuh). NVRTC before 12.8 keeps the barrier's release."""
    target = Target.profile("h100")
    if family == "rows":
        spec = plan("softmax", ROWS, 262144, "f16", "auto", target).spec
    elif family == "norm_grad":
        spec = norm.plan("layer_norm_backward", ROWS, 32768, "f16", "auto", target).spec
    else:
        spec = softmax_axis.plan("softmax_backward", 64, 4096, 256, "f16", target).spec
    assert spec.cluster_size > 1, spec.name
    ptx = jit.compile_ptx(spec, "sm_90")
    arrives = ptx.count("barrier.cluster.arrive")
    assert arrives == ptx.count("barrier.cluster.wait") >= 2
    if nvrtc.getVersion() >= (12, 8):
        fences = ptx.count("fence.release.sync_restrict::shared::cta.cluster;")
        assert fences >= 1
        assert ptx.count("barrier.cluster.arrive.relaxed") == arrives
        assert "barrier.cluster.arrive.release" not in ptx and "fence.acq_rel" not in ptx
    else:
        assert "barrier.cluster.arrive.release" in ptx
        assert "barrier.cluster.arrive.relaxed" in ptx


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "softmax_backward"])
def test_axis_forward_tiles_fill_in_stages(op):
    """A cached forward tile is filled by cp.async in kAxisFillStages (2)
    groups, the first waited for while the second is in flight
    (kernels/softmax_axis.cuh); the backward waits for its whole tile."""
    spec = softmax_axis.plan(op, 64, 4096, 256, "f16", Target.profile("h100")).spec
    assert spec.cached and spec.loads_in_flight == 0, spec.name
    ptx = jit.compile_ptx(spec, "sm_90")
    if op.endswith("_backward"):
        assert "cp.async.commit_group" in ptx and "cp.async.wait_all" in ptx
        assert "cp.async.wait_group" not in ptx
    else:
        assert ptx.count("cp.async.commit_group") == 2
        assert "cp.async.wait_group 1;" in ptx and "cp.async.wait_group 0;" in ptx
        assert "cp.async.wait_all" not in ptx
