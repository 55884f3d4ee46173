"""Device facts (from the live GPU or a built-in profile) and an occupancy calculator.

The calculator follows the rules of CUDA's occupancy calculator
(cuda_occupancy.h) for sm_80 and newer: registers are allocated per warp in
units of 256 and split across four sub-partitions, shared memory per block
is rounded up to 128 bytes after adding the per-block reservation. On a GPU
the tests check it against cuOccupancyMaxActiveBlocksPerMultiprocessor.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

WARP_SIZE = 32
STATIC_SMEM_LIMIT = 48 * 1024   # shared memory a block gets without opting in
BLOCK_RESERVED_SMEM = 1024      # shared memory the driver keeps for each resident block (sm_80 and newer)
CLUSTER_MIN_ARCH = 90           # thread-block clusters from sm_90 on


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    arch: str                      # e.g. "sm_90"
    sm_count: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int
    regs_per_block: int
    smem_per_sm: int
    smem_per_block_optin: int
    smem_reserved_per_block: int
    l2_bytes: int

    # Allocation granularities of sm_80 / sm_90 (cuda_occupancy.h).
    reg_alloc_unit = 256
    smem_alloc_unit = 128
    sub_partitions = 4


PROFILES = {
    "h100": DeviceFacts("NVIDIA H100 80GB HBM3 (profile)", "sm_90", 132, 2048, 32, 65536, 65536,
                        233472, 232448, 1024, 50 * 1024 * 1024),
    "h200": DeviceFacts("NVIDIA H200 (profile)", "sm_90", 132, 2048, 32, 65536, 65536,
                        233472, 232448, 1024, 60 * 1024 * 1024),
    "a100": DeviceFacts("NVIDIA A100-SXM4-80GB (profile)", "sm_80", 108, 2048, 32, 65536, 65536,
                        167936, 166912, 1024, 40 * 1024 * 1024),
}
ARCH_PROFILES = {"sm_90": "h100", "sm_80": "a100"}


def has_clusters(arch: str) -> bool:
    """Whether `arch` (e.g. "sm_90") has thread-block clusters."""
    return int(arch.removeprefix("sm_")) >= CLUSTER_MIN_ARCH


def profile(name: str) -> DeviceFacts:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: {', '.join(PROFILES)}") from None


@functools.lru_cache(maxsize=None)
def live_facts(device_id: int) -> DeviceFacts:
    """Facts of GPU `device_id`, read from the CUDA runtime."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    return DeviceFacts(
        name=name.decode() if isinstance(name, bytes) else str(name),
        arch=f"sm_{props['major']}{props['minor']}",
        sm_count=props["multiProcessorCount"],
        max_threads_per_sm=props["maxThreadsPerMultiProcessor"],
        max_blocks_per_sm=props["maxBlocksPerMultiProcessor"],
        regs_per_sm=props["regsPerMultiprocessor"],
        regs_per_block=props["regsPerBlock"],
        smem_per_sm=props["sharedMemPerMultiprocessor"],
        smem_per_block_optin=props["sharedMemPerBlockOptin"],
        smem_reserved_per_block=props["reservedSharedMemPerBlock"],
        l2_bytes=props["l2CacheSize"],
    )


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def max_active_blocks(facts: DeviceFacts, block_size: int, registers_per_thread: int,
                      smem_per_block: int, max_threads_per_block: int = 1024) -> int:
    """Blocks of `block_size` threads that fit on one SM at once (0: cannot launch).

    `smem_per_block` is static plus dynamic shared memory in bytes.
    """
    if block_size <= 0 or block_size > max_threads_per_block:
        return 0
    warps_per_block = -(-block_size // WARP_SIZE)
    by_warps = facts.max_threads_per_sm // WARP_SIZE // warps_per_block

    regs_per_warp = _round_up(registers_per_thread * WARP_SIZE, facts.reg_alloc_unit)
    if regs_per_warp * warps_per_block > facts.regs_per_block:
        return 0
    if regs_per_warp:
        warps_per_sub_partition = (facts.regs_per_sm // facts.sub_partitions) // regs_per_warp
        by_registers = warps_per_sub_partition * facts.sub_partitions // warps_per_block
    else:
        by_registers = facts.max_blocks_per_sm

    smem = _round_up(smem_per_block + facts.smem_reserved_per_block, facts.smem_alloc_unit)
    if smem_per_block > facts.smem_per_block_optin:
        return 0
    by_smem = facts.smem_per_sm // smem if smem else facts.max_blocks_per_sm

    return max(0, min(facts.max_blocks_per_sm, by_warps, by_registers, by_smem))
