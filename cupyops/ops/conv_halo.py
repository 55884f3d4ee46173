"""Halo tiles of the int8 convolution (sm_90, kernels/conv_int8.cuh,
conv2d_int8_fprop_halo): a block's GEMM_N is `rows` whole output rows of one
image, each `pitch` slots wide (its OW pixels, then slots whose results are
dropped), so that the input rows a stage's filter rows read sit in shared
memory once for all their taps: tap (i, s) reads them shifted by i rows and
s columns (times the dilation). A stage holds one filter row, or all R where
they fit. Stride 1 only (a shift must be whole slots); filters one column wide
have little to share. This module says which convolutions fit, the tiles worth
timing and what a tile costs in shared memory."""
from __future__ import annotations

from .conv_layout import ConvGeometry

SLOT_BYTES = 16               # one half of a pixel's 32 channels: the planes' row
MAX_TILE_N = 512              # slots of a tile: two warpgroups of 256
MAX_WARP_N = 256
MAX_CONSUMERS = 2             # consumer warpgroups: their accumulators share an SM's registers
STAGE_ALIGN = 1024
MAX_STAGES = 8
PITCH_MULTIPLES = (4, 8, 16)   # a row's slots: the fewest it needs, rounded up to one of these


def fits(geometry: ConvGeometry) -> bool:
    """Whether halo tiles can compute this convolution."""
    g = geometry
    return g.stride == (1, 1) and g.s > 1 and least_pitch(g) <= MAX_WARP_N


def least_pitch(geometry: ConvGeometry) -> int:
    """Slots a row needs: OW pixels and the shift of the last filter column."""
    return geometry.ow + (geometry.s - 1) * geometry.dilation[1]


def stage_bytes(tile_m: int, tile_n: int, pitch: int, filter_rows: int, filter_width: int, dilation: tuple) -> int:
    """Shared memory of one stage: its filter_rows x filter_width taps, then both
    planes of its input rows with their slack (the shift of the last row's tiles),
    1 KB aligned."""
    slack = -(-(filter_width - 1) * dilation[1] // 8) * 8
    slots = tile_n + (filter_rows - 1) * dilation[0] * pitch + slack
    raw = filter_rows * filter_width * tile_m * 32 + 2 * slots * SLOT_BYTES
    return -(-raw // STAGE_ALIGN) * STAGE_ALIGN


def row_blocks(geometry: ConvGeometry, rows: int) -> int:
    """Tiles along GEMM_N: the blocks of `rows` output rows of every image."""
    return -(-geometry.oh // rows) * geometry.n


def tiles(geometry: ConvGeometry, tile_m: int, rows: int) -> int:
    """Tiles of a grid: GEMM_M tiles x row blocks x images."""
    return -(-geometry.k // tile_m) * row_blocks(geometry, rows)


def units(geometry: ConvGeometry, filter_rows: int) -> int:
    """GEMM_K in units of one channel group and `filter_rows` filter rows (a stage each)."""
    return geometry.c // 32 * geometry.r // filter_rows


def _row_counts(geometry: ConvGeometry, pitch: int, groups_n: int) -> list:
    """Rows a tile may take (most first): their slots split into groups_n warpgroups
    of a multiple of 16 slots, at most 256 each, no more rows than OH."""
    most = min(geometry.oh, MAX_WARP_N * groups_n // pitch)
    return [rows for rows in range(most, 0, -1) if (rows * pitch) % (16 * groups_n) == 0]


def _balance(geometry: ConvGeometry, tile_m: int, rows: int, sm_count: int) -> float:
    """The share of the grid's slots of SM time doing output rows: whole waves of tiles
    over `sm_count` SMs, times the share of the row blocks' rows inside OH."""
    count = tiles(geometry, tile_m, rows)
    return count / (-(-count // sm_count) * sm_count) * geometry.oh / (-(-geometry.oh // rows) * rows)


def configs(geometry: ConvGeometry, smem_limit: int, exchange_bytes: int, sm_count: int = 0) -> list:
    """(tile_m, tile_n, warp_n, stages, pitch, filter_rows) worth timing: pitches of
    the fewest slots rounded to 4, 8 and 16 (rounded less, a row drops fewer slots but
    fewer row counts make whole 16-slot groups); one or two warpgroups along N, with the
    most rows they hold and, given `sm_count`, the rows (down to half as many) whose
    tiles fill the SMs' waves and OH best (_balance); 64 or 128 channels (no more than
    K needs); stages of all R filter rows where shared memory holds three, else of one
    filter row (one row a stage came no closer than 4 % to the fastest candidate at any
    3x3 or 5x5 layer timed: docs/performance.md), as many (up to MAX_STAGES) as it holds."""
    if not fits(geometry):
        return []
    least = least_pitch(geometry)
    found = []
    for pitch in sorted({-(-least // multiple) * multiple for multiple in PITCH_MULTIPLES}):
        for groups_n in (1, 2):
            counts = _row_counts(geometry, pitch, groups_n)
            for tile_m in (64, 128):
                if not counts or tile_m > max(64, geometry.k) or (tile_m // 64) * groups_n > MAX_CONSUMERS:
                    continue
                choices = [counts[0]]
                if sm_count:
                    choices.append(max((rows for rows in counts if 2 * rows >= counts[0]),
                                       key=lambda rows: _balance(geometry, tile_m, rows, sm_count)))
                for rows in dict.fromkeys(choices):
                    tile_n = rows * pitch
                    consumer_warps = 4 * (tile_m // 64) * groups_n
                    room = smem_limit - STAGE_ALIGN - consumer_warps * exchange_bytes
                    # all R filter rows a stage where three such stages fit, else one
                    for filter_rows in sorted({1, geometry.r}, reverse=True):
                        per_stage = stage_bytes(tile_m, tile_n, pitch, filter_rows, geometry.s, geometry.dilation)
                        stages = min(MAX_STAGES, room // per_stage)
                        if stages >= 3:
                            found.append((tile_m, tile_n, tile_n // groups_n, stages, pitch, filter_rows))
                            break
    return list(dict.fromkeys(found))
