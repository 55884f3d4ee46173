"""The int8 convolution's plans (cupyops/ops/conv2d_int8.py launches them): the tile
configurations (MegEngine's ladder; for policy="auto" the mma.sync, wgmma and
warp-specialised wgmma tiles; halo tiles depend on the shape and come from
cupyops/ops/conv_halo.py), the kernel each instantiates, the candidates that suit a
shape (each with and without split-K), the default rule among them, and the plan."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Optional

from .. import device, jit
from ..launch import Target
from . import conv_halo, conv_tma
from .conv_layout import ConvGeometry

OP = "conv2d_int8"
WGMMA = "wgmma"              # ConvInt8Spec.instruction of the sm_90a kernels
WGMMA_ARCH = "sm_90"         # the one arch they run on
WGMMA_ALIGN_SLACK = 1024     # dynamic shared memory the kernel may skip to align its stages
EXCHANGE_BYTES = 1024        # a warp's epilogue exchange (kernels/conv_int8.cuh)
REDUCE_THREADS = 256
MAX_SPLITS = 16
MIN_STEPS_PER_SPLIT = 4
HALO_FIELDS = ("halo_pitch", "halo_filter_rows", "filter_width", "dilation_h", "dilation_w")
PAIR = 2                     # blocks of a cluster sharing the filter's copies (multicast)

STEP_BYTES = 64              # a GEMM_K step; ConvParams.k_steps and split-K count them


@dataclass(frozen=True)
class TileConfig:
    """Threadblock, warp (for wgmma: warpgroup) tile and stages of one kernel configuration."""
    tile_m: int
    tile_n: int
    warp_m: int
    warp_n: int
    stages: int
    wgmma: bool = False
    step_bytes: int = STEP_BYTES
    tma: str = ""
    halo_pitch: int = 0
    halo_filter_rows: int = 0
    filter_width: int = 0
    dilation_h: int = 0
    dilation_w: int = 0
    cluster: int = 1
    k_blocks: int = 1

    @property
    def area(self) -> int:
        return self.tile_m * self.tile_n


# MegEngine's int8 NCHW32 IMMA list (algo.cpp), largest first, warps of at least 32 x 32.
MEGENGINE_LADDER = (TileConfig(128, 128, 64, 64, 2), TileConfig(128, 64, 64, 32, 2),
                    TileConfig(64, 128, 32, 64, 2), TileConfig(64, 64, 32, 32, 2),
                    TileConfig(32, 64, 32, 32, 2))
# The auto generator's configurations (each shape takes those its K allows).
AUTO_CONFIGS = (TileConfig(256, 128, 64, 64, 3), TileConfig(128, 256, 64, 64, 3),
                TileConfig(128, 128, 64, 64, 4), TileConfig(128, 128, 64, 64, 3),
                TileConfig(64, 256, 64, 64, 4),
                TileConfig(128, 64, 64, 32, 4), TileConfig(64, 128, 32, 64, 4),
                TileConfig(64, 64, 32, 32, 5), TileConfig(32, 128, 32, 32, 6))
# sm_90's wgmma configurations: warpgroups of 64 x N (N <= 256: N / 2 accumulators
# a thread), tiles as large as a step's loads allow; fewer stages where that lets two
# blocks share an SM (short GEMM_K: one block's prologue and epilogue overlap the
# other's main loop), or 3-4 share it (GEMM_M = 64: more bytes in flight per SM).
# 128-byte steps: four MMAs a barrier instead of two. Every table below keeps the
# configurations that came within 10 % of the fastest candidate on at least one of 45
# convolutions timed on an H200 (the bench's ten layers and seven more of ResNet-50's,
# each also at batches 1 and 8: docs/performance.md).
_WGMMA_64B = ((128, 256, 256, 6), (128, 256, 256, 4), (256, 128, 128, 4), (128, 128, 128, 6),
              (64, 256, 128, 4), (64, 128, 128, 6), (64, 128, 128, 8), (64, 128, 128, 4))
_WGMMA_128B = ((256, 128, 128, 4), (128, 128, 128, 5), (64, 256, 128, 4), (64, 128, 128, 5), (64, 128, 128, 3))
WGMMA_CONFIGS = tuple(TileConfig(tm, tn, 64, wn, stages, True, step)
                      for step, table in ((STEP_BYTES, _WGMMA_64B), (2 * STEP_BYTES, _WGMMA_128B))
                      for tm, tn, wn, stages in table)
# Warp-specialised wgmma (tile_m, tile_n, warp_n, stages, step bytes): the consumers
# issue MMAs alone. With the pixels copied by the copy engine too, its 32-byte rows
# bound the loads: fewer tiles, and one 64 x 256 tile in four warpgroups of 64 x 64
# (more warps to store the outputs where GEMM_K is short and the epilogue takes most of
# a tile's time). Tiles 96 pixels wide fill a wave where 128 leave part of it idle
# (64 images of 7 x 7 or 14 x 14 pixels).
_TMA_FILTER = ((256, 128, 128, 4, 128), (256, 96, 96, 4, 128), (128, 128, 128, 6, 128), (128, 128, 128, 3, 128),
               (64, 128, 128, 8, 128), (64, 128, 128, 4, 128))
_TMA_IM2COL = ((128, 256, 256, 7, 64), (256, 128, 128, 4, 128), (64, 256, 256, 5, 128), (64, 256, 64, 5, 128),
               (64, 128, 128, 4, 128))
# 1x1 filters at stride 1 without padding: the pixels as rows of four (conv_tma.rows_fit),
# tiles of 224 (a 56 x 56 image in 14), in warpgroups of 64 x 112.
_TMA_ROWS = ((64, 224, 112, 4, 128), (64, 224, 112, 5, 128), (128, 224, 112, 4, 128))
# Pairs of blocks (a cluster) on one GEMM_M tile and two GEMM_N tiles, each copying half
# the filter rows of a stage into both: a block then reads a third less from L2 a step
# (a quarter less for 128 x 128 tiles). 64-byte stages: more of them loading at once.
_TMA_FILTER_PAIRS = ((256, 128, 128, 4, 128), (128, 128, 128, 6, 128), (128, 128, 128, 12, 64))
# Pairs of blocks on one tile, each taking half its GEMM_K, summing their accumulators in
# distributed shared memory: twice the blocks where the tiles leave SMs idle, without
# split-K's int32 partials in global memory. One tile a pair: not persistent.
_TMA_FILTER_K_PAIRS = ((256, 96, 96, 4, 128), (128, 128, 128, 6, 128))
TMA_CONFIGS = tuple(TileConfig(tm, tn, 64, wn, stages, True, step, tma, cluster=cluster, k_blocks=k_blocks)
                    for tma, table, cluster, k_blocks in (("filter", _TMA_FILTER, 1, 1), ("im2col", _TMA_IM2COL, 1, 1),
                                                          ("rows", _TMA_ROWS, 1, 1),
                                                          ("filter", _TMA_FILTER_PAIRS, PAIR, 1),
                                                          ("filter", _TMA_FILTER_K_PAIRS, 1, PAIR))
                    for tm, tn, wn, stages, step in table)


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
    cluster: int = 1         # warp-specialised, filter by the copy engine: blocks sharing its copies
    k_blocks: int = 1        # warp-specialised: blocks of a cluster splitting a tile's GEMM_K

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
            pairs = f"_mc{self.cluster}" if self.cluster > 1 else ""   # filter copies multicast to a cluster
            pairs += f"_ks{self.k_blocks}" if self.k_blocks > 1 else ""   # GEMM_K split in a cluster
            copy = {"im2col": "ws_tma_im2col_sw32", "rows": "ws_tma_rows4_sw32",
                    "filter": f"ws_tma_cpasync_sw{self.step_bytes}{pairs}",
                    "halo": f"ws_halo_p{self.halo_pitch}_r{self.halo_filter_rows}x{self.filter_width}"
                            f"_d{self.dilation_h}x{self.dilation_w}{pairs}"}.get(
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
                    dilation_h=self.dilation_h, dilation_w=self.dilation_w, cluster=self.cluster,
                    k_blocks=self.k_blocks, split_reduce=False)


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
                            config.step_bytes, config.tma, *(getattr(config, name) for name in HALO_FIELDS),
                            config.cluster, config.k_blocks)
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
    also the row counts whose tiles fill that many SMs best), in pairs of blocks on
    neighbouring rows that share the filter taps' copies (multicast): at each of the 15
    layers timed (docs/performance.md) the best pair was as fast as the best tile alone
    or faster."""
    return tuple(TileConfig(tm, tn, 64, wn, stages, True, 32, "halo", pitch, rows, geometry.s, *geometry.dilation,
                            PAIR)
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


def grid_tiles(geometry: ConvGeometry, config) -> int:
    """Tiles of `config`'s (or a spec's) grid, a split's worth."""
    m, n, _ = geometry.gemm
    m_tiles, n_tiles = -(-m // config.tile_m), -(-n // config.tile_n)
    if config.tma == "halo":
        n_tiles = conv_halo.row_blocks(geometry, config.tile_n // config.halo_pitch)
    return m_tiles * -(-n_tiles // config.cluster) * config.cluster   # a cluster's blocks side by side along N


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
                not conv_tma.pixels_fit(geometry, config.tma, config.tile_n):
            continue
        # warp-specialised rounds start anywhere; a cp.async stage must not straddle two splits
        granule = 1 if config.tma else config.step_bytes // STEP_BYTES
        steps = split_steps(geometry, config)
        tiles = grid_tiles(geometry, config)
        # blocks splitting a tile's GEMM_K: only where the tiles leave SMs idle; split-K beside
        # them where the clusters still do, each block's share of a split MIN_STEPS_PER_SPLIT or more
        if config.k_blocks > 1:
            if tiles >= sm_count or steps < config.k_blocks * MIN_STEPS_PER_SPLIT:
                continue
            tiles, granule = tiles * config.k_blocks, config.k_blocks * MIN_STEPS_PER_SPLIT
        splits, per_split = split_k(geometry, tiles, sm_count, granule, steps)
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
            grid_tiles(geometry, config_of(c)) >= sm_count]
    if full:
        return max(full, key=lambda c: (c["tile_m"] * c["tile_n"], -c["step_bytes"], c["stages"]))
    smallest = min(c["tile_m"] * c["tile_n"] for c in found)
    return max((c for c in found if c["tile_m"] * c["tile_n"] == smallest),
               key=lambda c: (c["splits"], c["stages"]))


def megengine_config(geometry: ConvGeometry) -> TileConfig:
    """MegEngine's choice: the first of its list whose tile_m K fills."""
    return next(c for c in MEGENGINE_LADDER if c.tile_m <= geometry.k)


def config_of(candidate: dict) -> TileConfig:
    """The configuration of a candidate (or of a tuning table's entry)."""
    # tables written before wgmma (128-byte steps, the copy engine) hold no "wgmma" ("step_bytes", "tma") key
    return TileConfig(*(candidate[name] for name in ("tile_m", "tile_n", "warp_m", "warp_n", "stages")),
                      candidate.get("wgmma", False), candidate.get("step_bytes", STEP_BYTES),
                      candidate.get("tma", ""), *(candidate.get(name, 0) for name in HALO_FIELDS),
                      candidate.get("cluster", 1), candidate.get("k_blocks", 1))


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
        return (grid_tiles(self.geometry, self.spec) * self.spec.k_blocks, 1, self.splits)

    def explain(self) -> dict:
        m, n, k = self.geometry.gemm
        spec = self.spec
        groups = {"warp": f"{spec.warp_m}x{spec.warp_n}x{spec.step_bytes}"}
        if spec.wgmma:   # a warp holds 16 rows of its warpgroup's 64
            groups = {"warpgroup": groups["warp"], "warp": f"16x{spec.warp_n}x{spec.step_bytes}"}
        shared = f", shared by a cluster of {spec.cluster}" if spec.cluster > 1 else ""   # multicast copies
        return {"op": OP, "policy": self.policy, "gemm_mnk": [m, n, k],
                "instruction": f"wgmma.mma_async.{spec.mma_shape}.s8" if spec.wgmma
                else f"mma.sync.{spec.instruction}.s8",
                "tile": f"{self.spec.tile_m}x{self.spec.tile_n}x{self.spec.step_bytes}", **groups,
                "stages": self.spec.stages,
                "copy": {"im2col": "copy engine (filter, im2col)", "rows": "copy engine (filter, rows of four pixels)",
                         "filter": f"copy engine (filter{shared}), cp.async",
                         "halo": f"copy engine (filter{shared}), cp.async (rows of {spec.halo_pitch} slots, once for "
                                 f"{spec.halo_filter_rows} x {spec.filter_width} taps)"}.get(
                    spec.tma, "cp.async" if spec.async_copy else "registers"),
                "split_k": self.splits, "cluster_split_k": spec.k_blocks,
                "block": list(self.block), "grid": list(self.grid),
                # warp-specialised kernels launch the blocks the GPU holds at once, each walking tiles
                "persistent": bool(spec.tma) and spec.k_blocks == 1,
                "smem_bytes": self.spec.smem_bytes, "kernel": self.spec.name, "source": self.source}


def plan_from(geometry: ConvGeometry, candidate: dict, arch: str, source: str) -> ConvPlan:
    return ConvPlan(spec_for(config_of(candidate), "auto", arch), geometry, candidate["splits"],
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
