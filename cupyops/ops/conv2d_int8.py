"""int8 convolution on tensor cores by implicit GEMM, NCHW32 (SPEC §7):
spec -> candidate configurations -> plan (default rule or measured) -> launch -> public function.

Two policies share one loader and one epilogue (kernels/conv_int8.cuh):
- "megengine": MegEngine's kernel, mma.sync m8n8k16, two stages through
  registers, threadblock 128x128x64 and warp 64x64x64 (smaller tiles from
  MegEngine's list where K is small).
- "auto": on sm_90 (compute capability 9.0 exactly: sm_90a code runs nowhere
  else) wgmma m64nNk32 from the shared stages, warpgroups of 64 x N; elsewhere
  mma.sync m16n8k32 (sm_80 and newer). Both with a cp.async pipeline of 3-8
  stages (wgmma's of 64- or 128-byte GEMM_K steps); on sm_90 also warp-specialised
  wgmma whose producer warpgroup has the copy engine bring the filter and
  copies the pixels by cp.async, or has the engine bring both (im2col tensor
  maps, cupyops/ops/conv_tma.py), or holds whole input rows for a filter's
  taps (halo tiles, cupyops/ops/conv_halo.py); the tile tables are in
  cupyops/ops/conv_configs.py. The configuration comes from the measured
  tuner (cupyops.tune) or else the default rule, split-K (int32 partials summed
  by a second kernel that applies the epilogue) where the tiles of N * OH * OW
  leave SMs idle.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import ClassVar, Optional

import numpy

from .. import arrays, callcache, device, jit, tensor_map, tune
from ..callcache import CallCache, call_key, run_on, writable
from ..launch import LaunchCache, Target, live_function
from ..packed import POINTER, PackedLaunch
from ..profile import profile_for
from . import conv_halo, conv_layout, conv_tma
from .conv_configs import (AUTO_CONFIGS, MEGENGINE_LADDER, STEP_BYTES, TMA_CONFIGS, WGMMA_CONFIGS,  # noqa: F401
                           TileConfig)
from .conv_layout import INTERLEAVE, OUT_KINDS, ConvGeometry

OP = "conv2d_int8"
POLICIES = ("auto", "megengine")
WGMMA = "wgmma"              # ConvInt8Spec.instruction of the sm_90a kernels
WGMMA_ARCH = "sm_90"         # the one arch they run on
WGMMA_ALIGN_SLACK = 1024     # dynamic shared memory the kernel may skip to align its stages
EXCHANGE_BYTES = 1024        # a warp's epilogue exchange (kernels/conv_int8.cuh)
SM_REGISTERS = 65536
SM_MAX_THREADS = 2048
REDUCE_THREADS = 256
MAX_SPLITS = 16
MIN_STEPS_PER_SPLIT = 4
MAPS_CACHED = 64             # pairs of array addresses a ReadyConv keeps tensor maps for
MAP_BYTES = f"{tensor_map.MAP_DTYPE.itemsize}s"   # a tensor map argument, packed per pair of addresses
HALO_FIELDS = ("halo_pitch", "halo_filter_rows", "filter_width", "dilation_h", "dilation_w")


@dataclass(frozen=True)
class ConvInt8Spec(jit.KernelSpec):
    """One instantiation of the convolution kernel; its name carries the minimum
    arch, instruction, dtypes, threadblock, warp (or warpgroup), stages, copy path,
    alignment and layout. For wgmma warp_m x warp_n is a warpgroup's tile (64 x N)."""
    template: ClassVar[str] = "conv2d_int8.cu.j2"
    instruction: str         # "wgmma" (sm_90a), "m16n8k32" (sm_80+) or "m8n8k16" (sm_75+)
    tile_m: int
    tile_n: int
    warp_m: int
    warp_n: int
    stages: int
    async_copy: bool         # cp.async multistage, else registers (two stages)
    step_bytes: int = STEP_BYTES   # GEMM_K bytes a stage holds per row (wgmma: 64 or 128)
    # warp-specialised wgmma: the copy engine brings the "filter", or both ("im2col"),
    # or the filter while the producer copies whole input rows ("halo", conv_halo)
    tma: str = ""
    halo_pitch: int = 0      # halo: slots of a tile's row (tile_n / halo_pitch rows)
    halo_filter_rows: int = 0   # halo: filter rows a stage holds (1 or R)
    filter_width: int = 0    # halo: S (a stage's MMAs: halo_filter_rows x S)
    dilation_h: int = 0      # halo: the shift from one filter row to the next, in rows
    dilation_w: int = 0      # halo: the shift from one filter column to the next, in slots

    @property
    def wgmma(self) -> bool:
        return self.instruction == WGMMA

    @property
    def arch(self) -> str:
        return {"wgmma": "sm90a", "m16n8k32": "sm80"}.get(self.instruction, "sm75")

    @property
    def arch_specific(self) -> bool:
        return self.wgmma

    @property
    def mma_shape(self) -> str:
        """The tensor-core instruction's shape, e.g. m64n256k32."""
        return f"m64n{self.warp_n}k32" if self.wgmma else self.instruction

    @property
    def name(self) -> str:
        copy = "cpasync" if self.async_copy else "ldg"
        if self.wgmma:   # the descriptors' swizzle is the stage's row (a chunk's, for the copy engine)
            groups = f"wg{self.tile_m // self.warp_m}x{self.tile_n // self.warp_n}"
            copy = {"im2col": "ws_tma_im2col_sw32", "filter": f"ws_tma_cpasync_sw{self.step_bytes}",
                    "halo": f"ws_halo_p{self.halo_pitch}_r{self.halo_filter_rows}x{self.filter_width}"
                            f"_d{self.dilation_h}x{self.dilation_w}"}.get(
                self.tma, f"{copy}_sw{self.step_bytes}")
        else:
            groups = f"w{self.warp_m}x{self.warp_n}x{self.step_bytes}"
        return (f"conv2d_int8_fprop_{self.arch}_{self.instruction}{'_' + self.mma_shape if self.wgmma else ''}_s8_"
                f"tb{self.tile_m}x{self.tile_n}x{self.step_bytes}_{groups}_st{self.stages}_{copy}_align16_nchw32"
                "_lincomb")

    @property
    def threads_per_block(self) -> int:
        return self.consumer_warps * 32 + (128 if self.tma else 0)

    @property
    def consumer_warps(self) -> int:
        """Warps that issue MMAs (all but the producer warpgroup)."""
        return (self.tile_m // self.warp_m) * (self.tile_n // self.warp_n) * (4 if self.wgmma else 1)

    @property
    def smem_bytes(self) -> int:
        stages = self.stages * (self.tile_m + self.tile_n) * self.step_bytes
        if self.tma == "halo":
            stages = self.stages * conv_halo.stage_bytes(self.tile_m, self.tile_n, self.halo_pitch,
                                                         self.halo_filter_rows, self.filter_width,
                                                         (self.dilation_h, self.dilation_w))
        # warp-specialised kernels keep each consumer warp's epilogue exchange apart from the stages
        exchange = self.consumer_warps * EXCHANGE_BYTES if self.tma else 0
        return stages + exchange + (WGMMA_ALIGN_SLACK if self.wgmma else 0)

    @property
    def steps_per_stage(self) -> int:
        """64-byte GEMM_K steps a stage holds: split_k's granule."""
        return self.step_bytes // STEP_BYTES

    def template_args(self) -> dict:
        return dict(tile_m=self.tile_m, tile_n=self.tile_n, warp_m=self.warp_m, warp_n=self.warp_n,
                    k32=self.instruction == "m16n8k32", wgmma=self.wgmma, stages=self.stages,
                    async_copy=self.async_copy, step_bytes=self.step_bytes, tma=self.tma, halo_pitch=self.halo_pitch,
                    halo_filter_rows=self.halo_filter_rows, filter_width=self.filter_width,
                    dilation_h=self.dilation_h, dilation_w=self.dilation_w, split_reduce=False)


@dataclass(frozen=True)
class SplitReduceSpec(jit.KernelSpec):
    """Sums split-K's int32 partials and applies the epilogue."""
    template: ClassVar[str] = "conv2d_int8.cu.j2"

    @property
    def name(self) -> str:
        return "conv2d_int8_split_reduce_s32_nchw32_lincomb"

    @property
    def threads_per_block(self) -> int:
        return REDUCE_THREADS

    def template_args(self) -> dict:
        return dict(split_reduce=True, wgmma=False, tma="")


def spec_for(config: TileConfig, policy: str, arch: str) -> ConvInt8Spec:
    """The kernel of `config` under `policy` on `arch` ("sm_80", "sm_90", ...)."""
    if config.wgmma:
        if policy != "auto" or arch != WGMMA_ARCH:
            raise ValueError(f"wgmma configurations run on {WGMMA_ARCH} under policy='auto' only, not {arch}")
        return ConvInt8Spec(WGMMA, config.tile_m, config.tile_n, config.warp_m, config.warp_n, config.stages, True,
                            config.step_bytes, config.tma, *(getattr(config, name) for name in HALO_FIELDS))
    if policy == "megengine" or int(arch.removeprefix("sm_")) < 80:
        return ConvInt8Spec("m8n8k16", config.tile_m, config.tile_n, config.warp_m, config.warp_n, 2, False)
    return ConvInt8Spec("m16n8k32", config.tile_m, config.tile_n, config.warp_m, config.warp_n,
                        config.stages, True)


def auto_configs(arch: str) -> tuple:
    """The auto policy's configurations on `arch`: wgmma's first on sm_90 (fed by the
    copy engine, then by cp.async), then mma.sync's."""
    return (TMA_CONFIGS + WGMMA_CONFIGS if arch == WGMMA_ARCH else ()) + AUTO_CONFIGS


def halo_configs(geometry: ConvGeometry, smem_limit: int, sm_count: int = 0) -> tuple:
    """The halo tiles (conv_halo) worth timing for `geometry` on sm_90 (with `sm_count`,
    also the row counts whose tiles fill that many SMs best)."""
    return tuple(TileConfig(tm, tn, 64, wn, stages, True, 32, "halo", pitch, rows, geometry.s, *geometry.dilation)
                 for tm, tn, wn, stages, pitch, rows in conv_halo.configs(geometry, smem_limit, EXCHANGE_BYTES,
                                                                          sm_count))


def all_specs(arch: str, geometries: tuple = ()) -> list:
    """Every kernel the planner can choose on `arch`: both policies' configurations,
    and on sm_90 the halo tiles of `geometries` (those depend on the shape)."""
    specs = [spec_for(c, "megengine", arch) for c in MEGENGINE_LADDER]
    specs += [spec_for(c, "auto", arch) for c in auto_configs(arch)]
    if arch == WGMMA_ARCH:   # halo tiles as the sm_90 profile's GPU gets them
        facts = device.PROFILES[device.ARCH_PROFILES[WGMMA_ARCH]]
        specs += [spec_for(c, "auto", arch) for g in geometries
                  for c in halo_configs(g, facts.smem_per_block_optin, facts.sm_count)]
    return list(dict.fromkeys(specs))


def _grid_tiles(geometry: ConvGeometry, config) -> int:
    """Tiles of `config`'s (or a spec's) grid, a split's worth."""
    if config.tma == "halo":
        return conv_halo.tiles(geometry, config.tile_m, config.tile_n // config.halo_pitch)
    m, n, _ = geometry.gemm
    return -(-m // config.tile_m) * -(-n // config.tile_n)


def split_steps(geometry: ConvGeometry, config) -> int:
    """GEMM_K in the steps `config`'s (or a spec's) kernel splits it by: 64-byte
    steps, or a halo tile's units."""
    if config.tma == "halo":
        return conv_halo.units(geometry, config.halo_filter_rows)
    return geometry.k_steps


def split_k(geometry: ConvGeometry, tiles: int, sm_count: int, granule: int = 1, steps: int = 0) -> tuple:
    """(splits, steps per split): GEMM_K split across blocks where `tiles` blocks
    leave SMs idle, each split at least MIN_STEPS_PER_SPLIT steps, none empty, and
    a multiple of `granule` steps (a kernel's stage: one straddling two splits would
    load zeros for the part past its own). `steps`: GEMM_K's steps where they are
    not 64-byte ones (halo tiles count units)."""
    steps = steps or geometry.k_steps
    if tiles >= sm_count:
        return 1, steps
    wanted = min(MAX_SPLITS, -(-sm_count // tiles), max(1, steps // MIN_STEPS_PER_SPLIT))
    per_split = -(-steps // max(1, wanted) // granule) * granule
    return -(-steps // per_split), per_split


def candidates(geometry: ConvGeometry, sm_count: int, smem_limit: int, arch: str) -> list:
    """The auto configurations of `arch` that suit this shape (tile_m within K rounded
    up to the next tile, or the smallest tile of the instruction: 32, 64 for wgmma;
    shared memory within the limit), each with and without split-K."""
    found = []
    halo = halo_configs(geometry, smem_limit, sm_count) if arch == WGMMA_ARCH else ()
    for config in halo + auto_configs(arch):
        if config.tile_m > max(64 if config.wgmma else 32, 1 << (geometry.k - 1).bit_length()) or \
                spec_for(config, "auto", arch).smem_bytes > smem_limit or \
                (config.tma == "im2col" and not conv_tma.fits(geometry)):
            continue
        # warp-specialised rounds start anywhere; a cp.async stage must not straddle two splits
        granule = 1 if config.tma else config.step_bytes // STEP_BYTES
        steps = split_steps(geometry, config)
        splits, per_split = split_k(geometry, _grid_tiles(geometry, config), sm_count, granule, steps)
        found.append({**asdict(config), "splits": 1, "steps_per_split": steps})
        if splits > 1:
            found.append({**asdict(config), "splits": splits, "steps_per_split": per_split})
    return found


def default_candidate(geometry: ConvGeometry, sm_count: int, smem_limit: int, arch: str) -> dict:
    """The default rule: wgmma fed by cp.async where the arch has it (the warp-specialised
    kernels win some shapes and lose others: the tuner's to choose); the largest tile
    (then 64-byte steps; then the most stages) whose grid fills every SM; where none
    does, the smallest tile, split along GEMM_K."""
    found = [c for c in candidates(geometry, sm_count, smem_limit, arch) if not c["tma"]]
    found = [c for c in found if c["wgmma"]] or found
    full = [c for c in found if c["splits"] == 1 and
            _grid_tiles(geometry, _config(c)) >= sm_count]
    if full:
        return max(full, key=lambda c: (c["tile_m"] * c["tile_n"], -c["step_bytes"], c["stages"]))
    smallest = min(c["tile_m"] * c["tile_n"] for c in found)
    return max((c for c in found if c["tile_m"] * c["tile_n"] == smallest),
               key=lambda c: (c["splits"], c["stages"]))


def megengine_config(geometry: ConvGeometry) -> TileConfig:
    """MegEngine's choice: the first of its list whose tile_m K fills."""
    return next(c for c in MEGENGINE_LADDER if c.tile_m <= geometry.k)


def _config(candidate: dict) -> TileConfig:
    # tables written before wgmma (128-byte steps, the copy engine) hold no "wgmma" ("step_bytes", "tma") key
    return TileConfig(*(candidate[name] for name in ("tile_m", "tile_n", "warp_m", "warp_n", "stages")),
                      candidate.get("wgmma", False), candidate.get("step_bytes", STEP_BYTES),
                      candidate.get("tma", ""), *(candidate.get(name, 0) for name in HALO_FIELDS))


@dataclass(frozen=True)
class ConvPlan:
    """The launches of one convolution: the kernel, split-K, grid, shared memory, where it came from."""
    spec: ConvInt8Spec
    geometry: ConvGeometry
    splits: int
    steps_per_split: int
    source: str              # "tuned", "default rule" or "megengine ladder"
    policy: str

    @property
    def block(self) -> tuple:
        return (self.spec.threads_per_block, 1, 1)

    @property
    def grid(self) -> tuple:
        return (_grid_tiles(self.geometry, self.spec), 1, self.splits)

    def explain(self) -> dict:
        m, n, k = self.geometry.gemm
        spec = self.spec
        groups = {"warp": f"{spec.warp_m}x{spec.warp_n}x{spec.step_bytes}"}
        if spec.wgmma:   # a warp holds 16 rows of its warpgroup's 64
            groups = {"warpgroup": groups["warp"], "warp": f"16x{spec.warp_n}x{spec.step_bytes}"}
        return {"op": OP, "policy": self.policy, "gemm_mnk": [m, n, k],
                "instruction": f"wgmma.mma_async.{spec.mma_shape}.s8" if spec.wgmma
                else f"mma.sync.{spec.instruction}.s8",
                "tile": f"{self.spec.tile_m}x{self.spec.tile_n}x{self.spec.step_bytes}", **groups,
                "stages": self.spec.stages,
                "copy": {"im2col": "copy engine (filter, im2col)", "filter": "copy engine (filter), cp.async",
                         "halo": f"copy engine (filter), cp.async (rows of {spec.halo_pitch} slots, once for "
                                 f"{spec.halo_filter_rows} x {spec.filter_width} taps)"}.get(
                    spec.tma, "cp.async" if spec.async_copy else "registers"),
                "split_k": self.splits, "block": list(self.block), "grid": list(self.grid),
                # warp-specialised kernels launch the blocks the GPU holds at once, each walking tiles
                "persistent": bool(spec.tma),
                "smem_bytes": self.spec.smem_bytes, "kernel": self.spec.name, "source": self.source}


def plan_from(geometry: ConvGeometry, candidate: dict, arch: str, source: str) -> ConvPlan:
    return ConvPlan(spec_for(_config(candidate), "auto", arch), geometry, candidate["splits"],
                    candidate["steps_per_split"], source, "auto")


def plan(geometry: ConvGeometry, policy: str, target: Target, tuned: Optional[dict] = None) -> ConvPlan:
    """The plan for `geometry`: megengine's ladder, else `tuned` (a candidate from
    the tuning table) where given, else the default rule."""
    geometry.check()
    facts = target.facts
    if policy == "megengine":
        config = megengine_config(geometry)
        return ConvPlan(spec_for(config, policy, facts.arch), geometry, 1, geometry.k_steps,
                        "megengine ladder", policy)
    if tuned is not None:
        return plan_from(geometry, tuned, facts.arch, "tuned")
    return plan_from(geometry, default_candidate(geometry, facts.sm_count, facts.smem_per_block_optin, facts.arch),
                     facts.arch, "default rule")


# -- launch -------------------------------------------------------------------

@dataclass(frozen=True)
class Epilogue:
    """What the epilogue applies (kernel_params' keyword arguments, less the split)."""
    out_dtype: str = "int8"
    bias_kind: Optional[str] = None
    relu: bool = False
    has_z: bool = False
    alpha_per_channel: bool = False
    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 0.0


@functools.lru_cache(maxsize=1024)
def _params(geometry: ConvGeometry, splits: int, steps_per_split: int, epilogue: Epilogue) -> numpy.ndarray:
    """The kernel's parameter block, built once per shape and epilogue (read-only)."""
    params = conv_layout.kernel_params(geometry, splits=splits, steps_per_split=steps_per_split, **asdict(epilogue))
    params.flags.writeable = False
    return params


class ReadyConv:
    """A plan bound to one epilogue on one GPU: its compiled kernels with their grids and
    parameter blocks packed (packed.PackedLaunch: the parameter block is copied into the
    launch's arguments once) and (persistent kernels) tensor maps per pair of array
    addresses, so that calling it, ready(x, w, y, z, alpha_vec, bias), only launches."""
    __slots__ = ("main", "maps", "chosen", "reduce")

    def __init__(self, chosen: ConvPlan, epilogue: Epilogue, device_id: int):
        spec, g = chosen.spec, chosen.geometry
        self.chosen = chosen
        function = live_function(spec, device_id, spec.smem_bytes)
        grid = chosen.grid
        # persistent kernels: as many blocks as the GPU holds at once, each walking tiles and splits
        self.maps = {} if spec.tma else None
        if spec.tma:
            grid = (min(grid[0] * grid[2], _resident_blocks(spec, device_id)), 1, 1)
        params = _params(g, chosen.splits, 0, epilogue)   # the reduction's, where GEMM_K is split
        self.reduce = None
        main_params = params
        if chosen.splits > 1:   # int32 partials, then the reduction applies the epilogue
            facts = Target.live(device_id).facts
            tuned = profile_for(facts)
            groups = -(-g.n * g.k * g.oh * g.ow // 8)   # 8 output channels a thread
            blocks = min(-(-groups // REDUCE_THREADS), facts.sm_count * tuned.CONV_REDUCE_BLOCKS_PER_SM)
            main_params = _params(g, chosen.splits, chosen.steps_per_split, replace(epilogue, out_dtype="int32"))
            self.reduce = (PackedLaunch(live_function(SplitReduceSpec(), device_id), (blocks,), (REDUCE_THREADS,), 0,
                                        (POINTER,) * 5 + (params,)), (chosen.splits, *g.output_shape))
        # the tensor maps over x and w (persistent kernels), then x or w, y, z, alpha and bias
        operands = (MAP_BYTES,) * 2 + (POINTER,) if spec.tma else (POINTER,) * 2
        self.main = PackedLaunch(function, grid, chosen.block, spec.smem_bytes,
                                 operands + (POINTER,) * 4 + (main_params,))

    def operands(self, x, w) -> tuple:
        """The kernel's first arguments: the addresses of x and w, or the tensor maps over
        them and the address of x."""
        key = (x.data.ptr, w.data.ptr)
        if self.maps is None:
            return key
        found = self.maps.get(key)
        if found is None:
            if len(self.maps) >= MAPS_CACHED:
                self.maps.clear()
            maps = conv_tma.maps(self.chosen.geometry, self.chosen.spec, *key)
            found = self.maps[key] = (*(m.tobytes() for m in maps), key[0])
        return found

    def __call__(self, x, w, y, z, alpha_vec, bias) -> None:
        epilogue = (0 if z is None else z.data.ptr, 0 if alpha_vec is None else alpha_vec.data.ptr,
                    0 if bias is None else bias.data.ptr)
        if self.maps is None and self.reduce is None:
            self.main((x.data.ptr, w.data.ptr, y.data.ptr, *epilogue))
            return
        operands = self.operands(x, w)
        if self.reduce is None:
            self.main((*operands, y.data.ptr, *epilogue))
            return
        import cupy

        reduce, partials_shape = self.reduce
        partials = cupy.empty(partials_shape, dtype=numpy.int32)
        self.main((*operands, partials.data.ptr, 0, 0, 0))
        reduce((partials.data.ptr, y.data.ptr, *epilogue))


def launch(chosen: ConvPlan, x, w, y, z, alpha_vec, bias, epilogue: Epilogue) -> None:
    """Runs `chosen` on the current device and stream: y = conv(x, w) with the epilogue."""
    ReadyConv(chosen, epilogue, x.device.id)(x, w, y, z, alpha_vec, bias)


@functools.lru_cache(maxsize=256)
def _resident_blocks(spec: ConvInt8Spec, device_id: int) -> int:
    """Blocks of `spec` the GPU holds at once: its SMs times the blocks an SM fits by
    shared memory (each with the driver's reserve), registers (per warp, in 256s) and threads."""
    facts = Target.live(device_id).facts
    raw = jit.kernel(spec, device_id)
    smem_per_sm = facts.smem_per_block_optin + device.BLOCK_RESERVED_SMEM
    by_smem = smem_per_sm // (spec.smem_bytes + raw.shared_size_bytes + device.BLOCK_RESERVED_SMEM)
    warp_registers = -(-raw.num_regs * 32 // 256) * 256
    by_registers = SM_REGISTERS // (warp_registers * spec.threads_per_block // 32)
    return facts.sm_count * max(1, min(by_smem, by_registers, SM_MAX_THREADS // spec.threads_per_block))


_plans = LaunchCache()


def _time_candidate(geometry: ConvGeometry, arch: str, arrays_: tuple):
    """A timing callable for the tuner: the median microseconds of one candidate."""
    from ..bench import Timer

    timer = Timer(min_reps=5, max_reps=50, budget_s=0.05)
    x, w, y = arrays_

    def time_us(candidate: dict) -> float:
        ready = ReadyConv(plan_from(geometry, candidate, arch, "measuring"), Epilogue(), x.device.id)
        return timer.time(lambda: ready(x, w, y, None, None, None)).median_us
    return time_us


def tune_shape(geometry: ConvGeometry, device_id: int, table: Optional[tune.TuningTable] = None) -> tune.Result:
    """Times every candidate of `geometry` on GPU `device_id` and keeps the winner."""
    import cupy

    geometry.check()
    target = Target.live(device_id)
    facts = target.facts
    with cupy.cuda.Device(device_id):
        # random bytes, as real inputs: the tensor cores draw more power on them than on
        # constant ones, and the clock a kernel keeps depends on it
        rng = cupy.random.default_rng(0)
        x = rng.integers(-128, 128, (geometry.n, geometry.c // INTERLEAVE, geometry.h, geometry.w, INTERLEAVE),
                         dtype=numpy.int8)
        w = rng.integers(-128, 128, (geometry.k, geometry.c // INTERLEAVE, geometry.r, geometry.s, INTERLEAVE),
                         dtype=numpy.int8)
        y = cupy.empty(geometry.output_shape, numpy.int8)
        found = candidates(geometry, facts.sm_count, facts.smem_per_block_optin, facts.arch)
        jit.precompile([plan_from(geometry, c, facts.arch, "measuring").spec for c in found], facts.arch)
        return tune.tune(table or tune.default_table(), tune.DeviceKey.live(device_id), OP, geometry.key(),
                         found, _time_candidate(geometry, facts.arch, (x, w, y)))


def live_plan(geometry: ConvGeometry, policy: str, device_id: int) -> ConvPlan:
    """The plan on GPU `device_id`: from the tuning table, tuned now on first use
    (unless CUPYOPS_AUTOTUNE=0), or by the default rule; memoised per process."""
    def make():
        target = Target.live(device_id)
        if policy != "auto":
            return plan(geometry, policy, target)
        geometry.check()
        device = tune.DeviceKey.live(device_id)
        tuned = tune.default_table().lookup(device, OP, geometry.key())
        if tuned is None and tune.autotune_enabled():
            tuned = tune_shape(geometry, device_id).best
        return plan(geometry, policy, target, tuned)
    return _plans.get((geometry, policy, device_id), make)


# -- public function ----------------------------------------------------------

# Whole calls per layout of their arrays (callcache.call_key): a repeated call costs a
# key, a lookup, its output and its launches. Each entry: (ReadyConv, output shape, dtype).
_calls = CallCache()


def _writes_directly(out, x, w, bias, z, alpha_vec) -> bool:
    """Whether the kernel may write `out` itself: it overlaps none of x, w, bias and alpha_vec
    (other blocks still read them), and z only by holding z's very elements (each z element
    is read by the thread that then writes that element; callcache.writable)."""
    return writable(out, (x, w, bias, alpha_vec), in_place=False) and writable(out, (z,))


def _replay(ready: tuple, x, w, bias, z, alpha_vec, out):
    """The ready call's result: into out where the kernel may write it, else computed into a
    fresh array and copied into out."""
    launch, shape, dtype = ready
    direct = out is not None and _writes_directly(out, x, w, bias, z, alpha_vec)
    y = out if direct else callcache.empty(shape, dtype)
    launch(x, w, y, z, alpha_vec, bias)
    return callcache.delivered(y, out)


def conv2d_int8(x, w, bias=None, z=None, *, stride=1, padding=0, dilation=1, alpha=1.0, beta=1.0,
                gamma=0.0, relu=False, out_dtype="int8", out=None, policy="auto", stream=None):
    """int8 convolution on tensor cores: y = alpha * conv(x, w) + beta * bias + gamma * z, then ReLU.

    x: int8 NCHW32 (N, C/32, H, W, 32) (see :func:`to_nchw32`); w: the packed
    filter from :func:`pack_conv_filter`; bias: float32 or int32 (K,); z: int8
    NCHW32 like the output; alpha: a float or a float32 (K,) vector (per-channel
    scales). The output is NCHW32 (N, K/32, OH, OW, 32): "int8" rounds half to
    even and saturates, "float16" / "float32" keep the epilogue's value,
    "int32" returns the raw accumulators (no epilogue). On dequantised values
    this is ``torch.nn.functional.conv2d(x, w, stride=stride, padding=padding,
    dilation=dilation)`` scaled by alpha, plus bias and z, then ReLU. `out` may be z
    itself or a view of its very elements (the residual updated in place); an out
    overlapping x, w, bias or alpha gets the result through a fresh array.
    policy: "auto" (the tuned or default-rule plan: wgmma on sm_90, fed by cp.async
    or, where the tuner finds it faster, by a producer warpgroup and the copy engine,
    for stride 1 also from whole input rows held for a filter's taps; mma.sync
    m16n8k32 elsewhere) or "megengine" (MegEngine's kernel, for comparison). A
    repeated call with arrays of the same layout replays its launch."""
    vector = None if type(alpha) is float else alpha if hasattr(alpha, "__cuda_array_interface__") else None
    key = call_key((policy, out_dtype, stride, padding, dilation, relu, beta, gamma, alpha if vector is None else None),
                   (x, w, bias, z, out, vector))
    ready = _calls.find(key)
    if ready is not None:
        if stream is None and (out is None or _writes_directly(out, x, w, bias, z, vector)):
            launch, shape, dtype = ready
            y = callcache.empty(shape, dtype) if out is None else out
            launch(x, w, y, z, vector, bias)
            return y
        return run_on(stream, _replay, ready, x, w, bias, z, vector, out)
    given = (x, w, bias, z, alpha)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if out_dtype not in OUT_KINDS:
        raise ValueError(f"out_dtype must be one of {tuple(OUT_KINDS)}, got {out_dtype!r}")
    x = conv_layout.nchw32_operand(x, "x", "expected int8 NCHW32 (N, C/32, H, W, 32): convert with "
                                   "cupyops.to_nchw32")
    w = conv_layout.nchw32_operand(w, "w", "expected the packed (K, C/32, R, S, 32) filter: "
                                   "cupyops.pack_conv_filter")
    device_id = x.device.id
    if w.device.id != device_id:
        raise ValueError(f"w is on GPU {w.device.id}, x on GPU {device_id}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has {w.shape[1] * INTERLEAVE} input channels, x {x.shape[1] * INTERLEAVE}")
    n, c32, h, width, _ = x.shape
    k, _, r, s, _ = w.shape
    geometry = ConvGeometry(n, c32 * INTERLEAVE, h, width, k, r, s, conv_layout.pair(stride, "stride"),
                            conv_layout.pair(padding, "padding"), conv_layout.pair(dilation, "dilation"))
    geometry.check()
    alpha_per_channel = numpy.ndim(alpha) > 0 or hasattr(alpha, "__cuda_array_interface__")
    raw = out_dtype == "int32"
    if raw and (bias is not None or z is not None or relu or alpha_per_channel or alpha != 1.0):
        raise ValueError('out_dtype="int32" returns the raw accumulators: give no alpha, bias, z or relu')
    alpha_vec = None
    if alpha_per_channel:
        alpha_vec = conv_layout.channel_vector(alpha, "alpha", k, (numpy.float32,), device_id)
    if bias is not None:
        bias = conv_layout.channel_vector(bias, "bias", k, (numpy.float32, numpy.int32), device_id)
    if z is not None:
        z = conv_layout.nchw32_operand(z, "z", f"expected the output's shape {geometry.output_shape}")
        if z.shape != geometry.output_shape:
            raise ValueError(f"z has shape {z.shape}, expected the output's {geometry.output_shape}")
        if z.device.id != device_id:
            raise ValueError(f"z is on GPU {z.device.id}, x on GPU {device_id}")
    out = conv_layout.check_out(out, geometry.output_shape, numpy.dtype(out_dtype), device_id)
    epilogue = Epilogue(out_dtype, None if bias is None else bias.dtype.name, bool(relu), z is not None,
                        alpha_per_channel, 1.0 if alpha_per_channel else float(alpha), float(beta), float(gamma))
    with arrays.on_device(x, stream):
        ready = (ReadyConv(live_plan(geometry, policy, device_id), epilogue, device_id), geometry.output_shape,
                 numpy.dtype(out_dtype))
        y = _replay(ready, x, w, bias, z, alpha_vec, out)
    if all(a is b for a, b in zip((x, w, bias, z, alpha_vec if alpha_per_channel else alpha), given)):
        _calls.remember(key, ready)   # the arrays were used as given: a call of this layout may skip the checks
    return y
