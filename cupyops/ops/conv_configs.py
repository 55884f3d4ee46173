"""The tile configurations the int8 convolution's planner chooses from
(cupyops/ops/conv2d_int8.py): MegEngine's ladder, and for policy="auto" the
mma.sync, wgmma and warp-specialised wgmma tiles; halo tiles depend on the
shape and come from cupyops/ops/conv_halo.py."""
from __future__ import annotations

from dataclasses import dataclass

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
# a thread), tiles as large as a step's loads and 2 x 128 accumulators allow; fewer
# stages where that lets two blocks share an SM (short GEMM_K: one block's prologue
# and epilogue overlap the other's main loop), or 3-4 share it (GEMM_M = 64: more
# bytes in flight per SM). 128-byte steps: four MMAs a barrier instead of two.
_WGMMA_64B = ((128, 256, 256, 6), (128, 256, 256, 4), (256, 128, 128, 4), (128, 128, 128, 6),
              (64, 256, 256, 6), (64, 256, 256, 4), (64, 256, 128, 4), (64, 128, 128, 6),
              (64, 256, 256, 3), (64, 128, 128, 8), (64, 128, 128, 4))
_WGMMA_128B = ((128, 256, 256, 4), (256, 128, 128, 4), (128, 128, 128, 5), (64, 256, 256, 4),
               (64, 256, 256, 3), (64, 256, 128, 4), (64, 128, 128, 5), (64, 128, 128, 3))
WGMMA_CONFIGS = tuple(TileConfig(tm, tn, 64, wn, stages, True, step)
                      for step, table in ((STEP_BYTES, _WGMMA_64B), (2 * STEP_BYTES, _WGMMA_128B))
                      for tm, tn, wn, stages in table)
# Warp-specialised wgmma (tile_m, tile_n, warp_n, stages, step bytes): the consumers
# issue MMAs alone, so the tiles are the largest the accumulators allow. With the
# pixels copied by the copy engine too, its 32-byte rows bound the loads: fewer tiles,
# and one 64 x 256 tile in four warpgroups of 64 x 64 (more warps to store the outputs
# where GEMM_K is short and the epilogue takes most of a tile's time).
_TMA_FILTER = ((128, 256, 256, 4, 128), (128, 256, 256, 7, 64), (256, 128, 128, 4, 128), (128, 128, 128, 6, 128),
               (128, 128, 128, 3, 128), (64, 256, 256, 5, 128), (64, 256, 256, 3, 128), (64, 256, 128, 5, 128),
               (64, 128, 128, 8, 128), (64, 128, 128, 4, 128))
_TMA_IM2COL = ((128, 256, 256, 7, 64), (256, 128, 128, 4, 128), (64, 256, 256, 5, 128), (64, 256, 64, 5, 128),
               (64, 128, 128, 4, 128))
TMA_CONFIGS = tuple(TileConfig(tm, tn, 64, wn, stages, True, step, tma)
                    for tma, table in (("filter", _TMA_FILTER), ("im2col", _TMA_IM2COL))
                    for tm, tn, wn, stages, step in table)
