"""Grid and block sizing the OneFlow way, for a live GPU or a device profile."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

from . import device, jit

BLOCK_SIZE_LADDER = (1024, 512, 256)   # tried after 128, largest first
WAVES = 32
MAX_GRID_X = 2**31 - 1                 # the most blocks a launch's grid.x takes


def get_num_blocks(facts: device.DeviceFacts, block_size: int, max_blocks: int,
                   waves: int = WAVES) -> int:
    """OneFlow's GetNumBlocks: enough blocks for `waves` full waves, at most `max_blocks`."""
    return max(1, min(max_blocks, facts.sm_count * facts.max_threads_per_sm // block_size * waves))


def fast_divisor(d: int) -> tuple:
    """(multiplier, shift) with which kernels/common.cuh's fast_quotient divides by `d`
    (2 <= d < 2**31): n // d == (n * multiplier >> 32) >> shift for every 0 <= n < 2**31."""
    if not 2 <= d < 2 ** 31:
        raise ValueError(f"a divisor of 2 .. 2**31 - 1, got {d}")
    log2 = (d - 1).bit_length()          # ceil(log2(d))
    return -(-(1 << (31 + log2)) // d), log2 - 1


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: the instantiation, its block and grid, its dynamic shared memory."""
    spec: jit.KernelSpec
    block: tuple
    grid: tuple
    smem_bytes: int

    # Spec fields `cupyops explain --json` shows before the launch's own.
    EXPLAINED_FIELDS = ("op", "impl", "pack_size", "cols_per_thread", "thread_group_width",
                        "rows_per_access", "padding")

    def explain(self) -> dict:
        fields = {name: getattr(self.spec, name) for name in self.EXPLAINED_FIELDS}
        return {**fields, **self.spec.explain_extra(), "block": list(self.block),
                "grid": list(self.grid), "smem_bytes": self.smem_bytes, "kernel": self.spec.name}


@dataclass(frozen=True)
class Target:
    """What plans are made for: a live GPU (device_id set) or a device profile.

    On a live GPU occupancy comes from the driver for the compiled kernel; for
    a profile, from the Python calculator fed by an NVRTC compile for its arch.
    """
    facts: device.DeviceFacts
    device_id: Optional[int] = None

    @classmethod
    def live(cls, device_id: int) -> "Target":
        return _live_target(device_id)

    @classmethod
    def profile(cls, name: str) -> "Target":
        return cls(device.profile(name))

    def max_active_blocks(self, spec: jit.KernelSpec, block_size: int, dynamic_smem: int,
                          opt_in: bool) -> int:
        """Blocks of `spec` per SM with `dynamic_smem` bytes each; 0 if it cannot launch.

        Without `opt_in` a block's static and dynamic shared memory together
        stay within 48 KB (OneFlow never raises the limit); with it, within
        the device's opt-in limit."""
        static_smem = self.resources(spec)["static_smem"]
        limit = self.facts.smem_per_block_optin if opt_in else device.STATIC_SMEM_LIMIT
        if static_smem + dynamic_smem > limit:
            return 0
        if self.device_id is None:
            report = jit.compile_cubin(spec, self.facts.arch)
            return device.max_active_blocks(self.facts, block_size, report.registers,
                                            static_smem + dynamic_smem, spec.threads_per_block)
        import cupy

        function = live_function(spec, self.device_id, dynamic_smem)
        with cupy.cuda.Device(self.device_id):
            return cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                function.ptr, block_size, dynamic_smem)

    def resources(self, spec: jit.KernelSpec) -> dict:
        """Registers, static shared memory and local (spill/stack) bytes of `spec`."""
        if self.device_id is None:
            report = jit.compile_cubin(spec, self.facts.arch)
            return {"registers": report.registers, "static_smem": report.smem_bytes,
                    "local_bytes": report.spill_bytes + report.stack_bytes}
        import cupy

        raw = jit.kernel(spec, self.device_id)
        with cupy.cuda.Device(self.device_id):
            return {"registers": raw.num_regs, "static_smem": raw.shared_size_bytes,
                    "local_bytes": raw.local_size_bytes}


def live_function(spec: jit.KernelSpec, device_id: int, dynamic_smem: int = 0):
    """The compiled function of `spec` on GPU `device_id`, opted in to
    `dynamic_smem` bytes of dynamic shared memory where that exceeds 48 KB."""
    import cupy

    raw = jit.kernel(spec, device_id)
    with cupy.cuda.Device(device_id):
        if dynamic_smem > device.STATIC_SMEM_LIMIT - raw.shared_size_bytes and \
                raw.max_dynamic_shared_size_bytes < dynamic_smem:
            raw.max_dynamic_shared_size_bytes = dynamic_smem
        return raw.kernel


class LaunchCache:
    """Launch configurations (or whole calls, callcache) memoised per key (op,
    shape, dtype, alignment, device), so a repeated call costs a dict lookup.
    Bounded: a process that meets many shapes starts over rather than growing
    without end."""

    def __init__(self, max_entries: int = 4096):
        self._entries: dict = {}
        self._max_entries = max_entries
        # peek(key): the entry for `key`, or None; the dict's own get (put empties the dict
        # in place, never replaces it), so a hit path's lookup is one C call
        self.peek = self._entries.get

    def get(self, key, make: Callable[[], object]):
        try:
            return self._entries[key]
        except KeyError:
            found = make()
            self.put(key, found)
            return found

    def find(self, key):
        """The entry for `key`, or None, also for a key None or unhashable (a call whose
        arguments the slow path must check or explain)."""
        try:
            return self._entries.get(key)
        except TypeError:
            return None

    def remember(self, key, value) -> None:
        """put(key, value) unless the key is None or unhashable."""
        if key is not None:
            try:
                self.put(key, value)
            except TypeError:
                pass

    def put(self, key, value) -> None:
        if len(self._entries) >= self._max_entries:
            self._entries.clear()
        self._entries[key] = value


@functools.lru_cache(maxsize=None)
def _live_target(device_id: int) -> Target:
    return Target(device.live_facts(device_id), device_id)


def choose_block_size(target: Target, spec_of: Callable[[int], jit.KernelSpec],
                      dynamic_smem: int, opt_in: bool, accept_any: bool = False) -> Optional[int]:
    """OneFlow's block-size rule for one-block-per-row kernels.

    Occupancy at 128 threads first: 0 means the path is impossible (None).
    Otherwise the first of 1024, 512, 256 that keeps the same number of active
    blocks per SM, else 128. With `accept_any` (OneFlow's LayerNorm when rows
    <= SM count) the first of them that can launch at all is taken."""
    at_128 = target.max_active_blocks(spec_of(128), 128, dynamic_smem, opt_in)
    if at_128 <= 0:
        return None
    for block_size in BLOCK_SIZE_LADDER:
        active = target.max_active_blocks(spec_of(block_size), block_size, dynamic_smem, opt_in)
        if active == at_128 or (accept_any and active > 0):
            return block_size
    return 128
