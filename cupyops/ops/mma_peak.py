"""The device's int8 tensor-core peak, measured in the run that reports speeds
against it (SPEC §9): one kernel per instruction (kernels/mma_peak.cuh) runs long
chains of independent MMAs with no memory traffic, timed with CUDA events.

Instructions: mma.sync m8n8k16 (the megengine policy's: its physical bound),
mma.sync m16n8k32 (the auto policy's before sm_90) and, on sm_90, wgmma
m64n256k32 with A and B from shared memory (the auto policy's there).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

import numpy

from .. import jit
from ..launch import Target, live_function

PEAK_THREADS = 256            # two warpgroups, eight warps
MMA_SYNC_CHAINS = 8           # independent accumulators a warp keeps in flight
WGMMA_BATCH = 4               # wgmma a warpgroup commits as one group
WGMMA_N = 256
TARGET_SECONDS = 5e-3         # each timed run
TIMED_RUNS = 5
# instruction -> (minimum arch, int8 operations one issue computes: 2 * M * N * K)
INSTRUCTIONS = {
    "m8n8k16": (75, 2 * 8 * 8 * 16),
    "m16n8k32": (80, 2 * 16 * 8 * 32),
    f"wgmma_m64n{WGMMA_N}k32": (90, 2 * 64 * WGMMA_N * 32),
}


@dataclass(frozen=True)
class MmaPeakSpec(jit.KernelSpec):
    """The peak kernel of one tensor-core instruction (a key of INSTRUCTIONS)."""
    template: ClassVar[str] = "mma_peak.cu.j2"
    instruction: str

    @property
    def wgmma(self) -> bool:
        return self.instruction.startswith("wgmma")

    @property
    def arch_specific(self) -> bool:
        return self.wgmma

    @property
    def name(self) -> str:
        arch = "sm90a" if self.wgmma else f"sm{INSTRUCTIONS[self.instruction][0]}"
        return f"int8_peak_{arch}_{self.instruction}_s8_x{self.batch}"

    @property
    def threads_per_block(self) -> int:
        return PEAK_THREADS

    @property
    def batch(self) -> int:
        """Instructions an iteration of the loop issues per warp (mma.sync) or warpgroup (wgmma)."""
        return WGMMA_BATCH if self.wgmma else MMA_SYNC_CHAINS

    @property
    def ops_per_iteration(self) -> int:
        """int8 operations a block computes per iteration of its loop."""
        issuers = PEAK_THREADS // (128 if self.wgmma else 32)
        return issuers * self.batch * INSTRUCTIONS[self.instruction][1]

    def template_args(self) -> dict:
        return dict(k32=self.instruction == "m16n8k32", wgmma_n=WGMMA_N if self.wgmma else 0,
                    batch=self.batch)


def peak_specs(arch: str) -> list:
    """The peak kernels of `arch` ("sm_90": all three; wgmma only there)."""
    number = int(arch.removeprefix("sm_"))
    return [MmaPeakSpec(name) for name, (minimum, _) in INSTRUCTIONS.items()
            if number >= minimum and (minimum != 90 or number == 90)]


def measure_peak(spec: MmaPeakSpec, device_id: int) -> float:
    """TOPS of `spec` on GPU `device_id`: the median of TIMED_RUNS runs of about TARGET_SECONDS."""
    import cupy

    target = Target.live(device_id)
    function = live_function(spec, device_id)
    with cupy.cuda.Device(device_id):
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, PEAK_THREADS, 0)
        blocks = target.facts.sm_count * max(1, per_sm)
        out = cupy.empty(blocks * PEAK_THREADS, numpy.int32)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()

        def seconds(iterations: int) -> float:
            start.record()
            function((blocks,), (PEAK_THREADS,), (out, numpy.int32(iterations)))
            stop.record()
            stop.synchronize()
            return cupy.cuda.get_elapsed_time(start, stop) * 1e-3

        seconds(16)                                   # load and warm up
        iterations = 256
        while (elapsed := seconds(iterations)) < TARGET_SECONDS / 4 and iterations < 1 << 24:
            iterations *= 4
        iterations = max(1, int(iterations * TARGET_SECONDS / elapsed))
        median = statistics.median(seconds(iterations) for _ in range(TIMED_RUNS))
    return blocks * iterations * spec.ops_per_iteration / median / 1e12


def measure_peaks(device_id: int) -> dict:
    """{instruction: TOPS} of every peak kernel the device's arch runs."""
    arch = Target.live(device_id).facts.arch
    return {spec.instruction: measure_peak(spec, device_id) for spec in peak_specs(arch)}
