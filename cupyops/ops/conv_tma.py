"""The copy engine's view of a convolution (sm_90): the tensor maps the
warp-specialised wgmma kernel (kernels/conv_int8.cuh, conv2d_int8_fprop_tma)
loads its tiles through, and the shapes those maps can describe.

- The packed filter is a 2-D tiled map: GEMM_K bytes by K rows, boxes of a
  stage's GEMM_K bytes (or, beside im2col copies, of one 32-channel chunk) by a
  tile's rows.
- The NCHW32 input (N, C/32, H, W, 32) is a 5-D im2col map with dims (c, w, h,
  image, channel group): the image taken as the third spatial dim (filter extent
  1, no padding), the channel group as the outermost. A copy of `tile_n` pixels
  then walks (ow, oh, image) -- GEMM_N's order -- within one channel group, and
  the engine adds the tap's offsets, applies the stride and fills the padding.
- Where a 1x1 filter reads every pixel in place (stride 1, no padding), each image's
  channel group is HW pixels of 32 bytes in a row: a 4-D tiled map of rows of four
  pixels (128 bytes, dims: row bytes, rows, channel group, image) copies a tile's
  pixels in requests four times as large, provided a tile never spans two images."""
from __future__ import annotations

import numpy

from .. import tensor_map
from .conv_layout import INTERLEAVE, ConvGeometry

SWIZZLE = 32                  # bytes: one chunk (32 channels) a row
PIXELS_A_ROW = 4              # rows of pixels: 128 bytes, the widest swizzle
ROWS_TILE_MULTIPLE = 32       # rows of pixels: tiles of whole 1024-byte swizzle patterns
# Bounds of a 5-D im2col map: box corners in [-16, 15], tap offsets in [0, 31]
# (three spatial dims share 16 bits), traversal strides up to 8.
CORNER_RANGE = (-16, 15)
MAX_OFFSET = 31
MAX_STRIDE = 8


def fits(geometry: ConvGeometry) -> bool:
    """Whether the im2col map can describe this convolution."""
    g = geometry
    for pad, taps, dilation, stride in ((g.padding[0], g.r, g.dilation[0], g.stride[0]),
                                        (g.padding[1], g.s, g.dilation[1], g.stride[1])):
        reach = (taps - 1) * dilation
        if not (CORNER_RANGE[0] <= -pad <= CORNER_RANGE[1] and CORNER_RANGE[0] <= pad - reach <= CORNER_RANGE[1]):
            return False
        if reach > MAX_OFFSET or stride > MAX_STRIDE:
            return False
    return True


def input_layout(geometry: ConvGeometry, tile_n: int) -> tensor_map.Im2colLayout:
    """The input's im2col map for copies of `tile_n` pixels."""
    g = geometry
    groups = g.c // INTERLEAVE
    plane = g.h * g.w * INTERLEAVE
    reach_h, reach_w = (g.r - 1) * g.dilation[0], (g.s - 1) * g.dilation[1]
    return tensor_map.Im2colLayout(
        dims=(INTERLEAVE, g.w, g.h, g.n, groups),
        strides=(INTERLEAVE, g.w * INTERLEAVE, groups * plane, plane),
        lower_corner=(-g.padding[1], -g.padding[0], 0),
        upper_corner=(g.padding[1] - reach_w, g.padding[0] - reach_h, 0),
        channels=INTERLEAVE, pixels=tile_n, element_strides=(1, g.stride[1], g.stride[0], 1, 1), swizzle=SWIZZLE)


def rows_fit(geometry: ConvGeometry, tile_n: int) -> bool:
    """Whether tiles of `tile_n` pixels can come as rows of four pixels: a 1x1 filter at
    stride 1 without padding, each image a whole number of tiles, and (the pixels' order
    in a tile, kernels/conv_int8.cuh's RowsPixels) tiles of a multiple of 32 pixels."""
    g = geometry
    return ((g.r, g.s, g.stride, g.padding) == (1, 1, (1, 1), (0, 0)) and tile_n % ROWS_TILE_MULTIPLE == 0 and
            (g.h * g.w) % tile_n == 0)


def pixels_fit(geometry: ConvGeometry, tma: str, tile_n: int) -> bool:
    """Whether a kernel whose copy engine brings the pixels (`tma`: "im2col", "rows";
    any other kind copies them otherwise) can take this convolution's."""
    if tma == "im2col":
        return fits(geometry)
    return rows_fit(geometry, tile_n) if tma == "rows" else True


def rows_layout(geometry: ConvGeometry, tile_n: int) -> tensor_map.TiledLayout:
    """The input as rows of four pixels, for copies of `tile_n` pixels (rows_fit)."""
    g = geometry
    plane = g.h * g.w * INTERLEAVE
    row = PIXELS_A_ROW * INTERLEAVE
    return tensor_map.TiledLayout(dims=(row, g.h * g.w // PIXELS_A_ROW, g.c // INTERLEAVE, g.n),
                                  strides=(row, plane, g.c // INTERLEAVE * plane),
                                  box=(row, tile_n // PIXELS_A_ROW, 1, 1), swizzle=row)


def filter_layout(geometry: ConvGeometry, tile_m: int, row_bytes: int) -> tensor_map.TiledLayout:
    """The packed filter's tiled map for boxes of `row_bytes` of GEMM_K by `tile_m`
    rows, in the swizzle of that many bytes."""
    gemm_k = geometry.gemm[2]
    return tensor_map.TiledLayout(dims=(gemm_k, geometry.k), strides=(gemm_k,), box=(row_bytes, tile_m),
                                  swizzle=row_bytes)


def maps(geometry: ConvGeometry, spec, x_address: int, w_address: int) -> tuple:
    """(filter map, input map) of kernel `spec` (a ConvInt8Spec) on the arrays at
    these device addresses; the input map is left empty where the kernel copies the
    pixels itself. Beside the engine's pixel copies and halo rows the filter comes a
    chunk (a tap) at a time; in a cluster, each block copies its share of a tile's rows."""
    if spec.tma == "im2col":
        return (tensor_map.encode_tiled(w_address, filter_layout(geometry, spec.tile_m, SWIZZLE)),
                tensor_map.encode_im2col(x_address, input_layout(geometry, spec.tile_n)))
    if spec.tma == "rows":
        if not rows_fit(geometry, spec.tile_n):
            raise ValueError(f"{spec.name} takes the pixels as rows of four: a 1x1 filter at stride 1 without "
                             f"padding, each image whole tiles of {spec.tile_n} pixels, not {geometry}")
        return (tensor_map.encode_tiled(w_address, filter_layout(geometry, spec.tile_m, SWIZZLE)),
                tensor_map.encode_tiled(x_address, rows_layout(geometry, spec.tile_n)))
    if spec.tma == "halo":
        return (tensor_map.encode_tiled(w_address, filter_layout(geometry, spec.tile_m, SWIZZLE)),
                numpy.zeros(1, dtype=tensor_map.MAP_DTYPE))
    # a cluster's blocks copy a share of the tile's rows each, into all of them
    return (tensor_map.encode_tiled(w_address, filter_layout(geometry, spec.tile_m // spec.cluster, spec.step_bytes)),
            numpy.zeros(1, dtype=tensor_map.MAP_DTYPE))
