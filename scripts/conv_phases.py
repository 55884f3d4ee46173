"""Where a halo tile's time goes: the cycles a tile spends in each phase of its
consumer warpgroups -- waiting for a stage (the full barrier), issuing the MMAs,
draining them, the epilogue -- and the cycles the producers wait for a free stage,
from clock64 stamps in a copy of kernels/conv_halo.cuh (the package's own kernels
are not changed). With --no-epilogue the tiles skip their epilogue (nothing is
stored): what they would take if it cost nothing.

Each halo configuration of a bench layer (`--match` narrows them by a part of the
kernel's name) is launched five times after a first call, without split-K; µs a call
from CUDA events (L2 not flushed), cycles averaged over every tile of every consumer
warpgroup (thread 0 of each adds its stamps' differences to a global array).

Usage on a GPU:  PYTHONPATH=. python scripts/conv_phases.py --layers "3x3 64ch@56" [--match mc2] [--no-epilogue]
Without a GPU:   PYTHONPATH=. python scripts/conv_phases.py --dry-run (compiles the stamped kernels, NVRTC)
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import tempfile

import numpy

from cli.conv import load_layers
from cupyops import jit
from cupyops.device import ARCH_PROFILES, PROFILES
from cupyops.ops import conv2d_int8 as conv
from cupyops.ops import conv_plan

SYMBOL = "_ZN7cupyops17conv_phase_cyclesE"   # cupyops::conv_phase_cycles
SLOTS = ("full waits", "issue", "drain", "epilogue")
CALLS = 5

# (text of kernels/conv_halo.cuh, its stamped form): each must be found exactly once
STAMPS = (
    ("namespace cupyops {\n",
     "namespace cupyops {\n__device__ unsigned long long conv_phase_cycles[8];\n"),
    ("        if (round >= stages) mbarrier_wait(empty + 8 * s, ((round / stages) + 1) & 1);\n",
     "        const long long empty_began = clock64();\n"
     "        if (round >= stages) mbarrier_wait(empty + 8 * s, ((round / stages) + 1) & 1);\n"
     "        if (thread == 0) atomicAdd(&conv_phase_cycles[5], clock64() - empty_began);\n"),
    ("    int acc[2][WN / 8][2];\n    zero_accumulators(acc);\n    for (int u = 0; u < tile.units; ++u, ++round) {\n"
     "      const unsigned s = round % stages;\n      mbarrier_wait(full + 8 * s, (round / stages) & 1);\n",
     "    int acc[2][WN / 8][2];\n    zero_accumulators(acc);\n    const long long began = clock64();\n"
     "    long long waited = 0;\n    for (int u = 0; u < tile.units; ++u, ++round) {\n"
     "      const unsigned s = round % stages;\n      const long long wait_began = clock64();\n"
     "      mbarrier_wait(full + 8 * s, (round / stages) & 1);\n      waited += clock64() - wait_began;\n"),
    ("    ws_tile_done<stages, CLUSTER>(acc, empty, round);\n",
     "    const long long issued = clock64();\n    ws_tile_done<stages, CLUSTER>(acc, empty, round);\n"
     "    const long long drained = clock64();\n"
     "    if ((threadIdx.x & 127) == 0) {\n"
     "      atomicAdd(&conv_phase_cycles[0], waited);\n"
     "      atomicAdd(&conv_phase_cycles[1], issued - began - waited);\n"
     "      atomicAdd(&conv_phase_cycles[2], drained - issued);\n"
     "      atomicAdd(&conv_phase_cycles[4], 1ull);\n    }\n"),
    ("\n  }\n  if constexpr (CLUSTER > 1) cluster_sync_before_exit();\n}\n",   # the end of a consumer's tile
     "\n    if ((threadIdx.x & 127) == 0) atomicAdd(&conv_phase_cycles[3], clock64() - drained);\n"
     "  }\n  if constexpr (CLUSTER > 1) cluster_sync_before_exit();\n}\n"),
)
EPILOGUE = "    const long long drained = clock64();\n"
SKIPPED_EPILOGUE = EPILOGUE + "    if (acc[0][0][0] != 0x7fffffff) continue;   // the epilogue skipped, all but never\n"


def stamped_headers(no_epilogue: bool) -> pathlib.Path:
    """A copy of kernels/ whose halo kernel carries the stamps (and, with no_epilogue,
    an epilogue no tile takes): ValueError where the kernel's text has moved on."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="conv_phases_")) / "kernels"
    shutil.copytree(jit.resource_dir("kernels"), folder)
    path = folder / "conv_halo.cuh"
    text = path.read_text()
    for found, stamped in STAMPS + (((EPILOGUE, SKIPPED_EPILOGUE),) if no_epilogue else ()):
        if text.count(found) != 1:
            raise ValueError(f"kernels/conv_halo.cuh no longer holds once: {found.strip()[:60]!r}")
        text = text.replace(found, stamped)
    path.write_text(text)
    return folder


def use_headers(folder: pathlib.Path) -> None:
    """Render every kernel of this process against `folder` in place of kernels/."""
    original = jit.resource_dir
    jit.resource_dir = lambda name: folder if name == "kernels" else original(name)
    jit.headers_fingerprint.cache_clear()


def configs(layer: dict, match: str) -> list:
    """The layer's halo configurations (as the sm_90 profile's GPU gets them) whose kernel names hold `match`."""
    facts = PROFILES[ARCH_PROFILES[conv_plan.WGMMA_ARCH]]
    found = conv_plan.halo_configs(layer["geometry"], facts.smem_per_block_optin, facts.sm_count)
    return [c for c in found if match in conv_plan.spec_for(c, "auto", conv_plan.WGMMA_ARCH).name]


def measure(layer: dict, config) -> str:
    import cupy

    g = layer["geometry"]
    spec = conv_plan.spec_for(config, "auto", conv_plan.WGMMA_ARCH)
    chosen = conv_plan.ConvPlan(spec, g, 1, conv_plan.split_steps(g, spec), "conv_phases", "auto")
    rng = cupy.random.default_rng(0)
    x = rng.integers(-128, 128, (g.n, g.c // 32, g.h, g.w, 32), dtype=numpy.int8)
    w = rng.integers(-128, 128, (g.k, g.c // 32, g.r, g.s, 32), dtype=numpy.int8)
    y = cupy.empty(g.output_shape, numpy.int8)
    ready = conv.ReadyConv(chosen, conv.Epilogue(alpha=1.0 / 4096), cupy.cuda.runtime.getDevice())
    ready(x, w, y, None, None, None)
    module = jit.kernel(spec, cupy.cuda.runtime.getDevice())._module
    memory = cupy.cuda.UnownedMemory(module.get_global_var(SYMBOL), 64, module)
    cycles = cupy.ndarray((8,), numpy.uint64, cupy.cuda.MemoryPointer(memory, 0))
    cycles[:] = 0
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(CALLS):
        ready(x, w, y, None, None, None)
    end.record()
    end.synchronize()
    total = cycles.get().astype(float)
    tiles = max(total[4], 1.0)   # a tile counted once by each of its consumer warpgroups
    phases = ", ".join(f"{name} {total[i] / tiles:.0f}" for i, name in enumerate(SLOTS))
    warpgroups = spec.consumer_warps // 4
    return (f"{layer['label']}  {spec.name}  {cupy.cuda.get_elapsed_time(start, end) * 1000 / CALLS:.1f} us a call; "
            f"cycles a tile: {phases}; producer empty waits {total[5] / tiles * warpgroups:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="3x3 64ch@56", help="bench layer labels, comma-separated")
    parser.add_argument("--match", default="", help="a part of the kernel names to keep")
    parser.add_argument("--no-epilogue", action="store_true", help="tiles skip their epilogue")
    parser.add_argument("--dry-run", action="store_true", help="compile the stamped kernels (NVRTC), no GPU")
    args = parser.parse_args()
    use_headers(stamped_headers(args.no_epilogue))
    labels = args.layers.split(",")
    for layer in [layer for layer in load_layers("all") if layer["label"] in labels]:
        for config in configs(layer, args.match):
            if args.dry_run:
                spec = conv_plan.spec_for(config, "auto", conv_plan.WGMMA_ARCH)
                report = jit.compile_cubin(spec, conv_plan.WGMMA_ARCH)
                print(f"{spec.name}: {report.registers} registers, {report.spill_bytes} spill bytes")
            else:
                print(measure(layer, config), flush=True)


if __name__ == "__main__":
    main()
