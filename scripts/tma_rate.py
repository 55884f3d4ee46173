"""How fast the copy engine (TMA) brings boxes into shared memory, by the width of
the rows its boxes are made of: the bound under the int8 convolution's loads, whose
NCHW32 pixels are rows of 32 bytes.

One thread a block keeps STAGES boxes of 8 KB in flight over a 64 MB uint8 tensor
(kernels/tma.cuh's copies and barriers), nothing computed, every box waited for; the
L2 flushed before each run (cupyops.bench.Timer), GB/s of bytes read. Tiled 2-D maps
with rows of 32, 64 and 128 bytes (each in the swizzle of its row), and the
convolution's own 5-D im2col map (cupyops/ops/conv_tma.py) of 1x1 256->64@56, a
256-pixel copy a box. The device copy of the 64 MB is timed in the same run.

Usage on a GPU:  PYTHONPATH=. python scripts/tma_rate.py
Without a GPU:   PYTHONPATH=. python scripts/tma_rate.py --dry-run (compiles the kernel, NVRTC)
"""
from __future__ import annotations

import argparse

import numpy

from cupyops import jit

TENSOR_BYTES = 64 << 20
BOX_BYTES = 8192
ROW_WIDTHS = (32, 64, 128)
PIXELS = 256                  # an im2col box: a convolution tile's pixels
SETTINGS = ((1, 4), (1, 8), (1, 16), (2, 8), (4, 8))   # (blocks an SM, stages a block)
SOURCE = r"""
#include "tma.cuh"
using namespace cupyops;
// Box i of `boxes` (block b takes b, b + blocks, ...): rows i * box_rows of a tiled map
// (im2col == 0), else pixels (i / groups) * box_rows of channel group i % groups.
extern "C" __global__ void __launch_bounds__(32) tma_rate(const __grid_constant__ TensorMap map, int boxes,
                                                          int box_bytes, int stages, int im2col, int box_rows,
                                                          int width, int plane, int groups) {
  extern __shared__ __align__(1024) unsigned char boxes_in_flight[];
  __shared__ __align__(8) unsigned long long full[16];
  if (threadIdx.x != 0) return;
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(boxes_in_flight));
  const unsigned barriers = static_cast<unsigned>(__cvta_generic_to_shared(full));
  for (int s = 0; s < stages; ++s) mbarrier_init(barriers + 8 * s, 1);
  mbarrier_init_fence();
  int issued = 0;
  for (int i = blockIdx.x; i < boxes; i += gridDim.x, ++issued) {
    const int s = issued % stages;
    const unsigned barrier = barriers + 8 * s;
    if (issued >= stages) mbarrier_wait(barrier, ((issued / stages) - 1) & 1);   // its box before has landed
    mbarrier_arrive_expect_tx(barrier, box_bytes);
    if (!im2col) {
      tma_load_2d(base + s * box_bytes, map, 0, i * box_rows, barrier);
    } else {
      const int pixel = (i / groups) * box_rows, image = pixel / plane, rest = pixel % plane;
      tma_load_im2col_5d(base + s * box_bytes, map, 0, rest % width, rest / width, image, i % groups, 0, 0, 0,
                         barrier);
    }
  }
  for (int k = max(0, issued - stages); k < issued; ++k) mbarrier_wait(barriers + 8 * (k % stages), (k / stages) & 1);
}
"""


def compile_ptx() -> str:
    """The kernel's PTX for sm_90 (NVRTC, no GPU needed)."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(SOURCE, "tma_rate.cu", [], [])
    try:
        nvrtc.compileProgram(program, ["-std=c++17", f"-I{jit.resource_dir('kernels')}",
                                       "--gpu-architecture=compute_90"])
        return nvrtc.getPTX(program).decode()
    except nvrtc.NVRTCError as error:
        raise RuntimeError(nvrtc.getProgramLog(program)) from error
    finally:
        nvrtc.destroyProgram(program)


def cases(address: int) -> list:
    """(label, tensor map, boxes, im2col, box rows, width, plane, groups) of each map timed."""
    from cupyops import tensor_map
    from cupyops.ops import conv_tma
    from cupyops.ops.conv_layout import INTERLEAVE, ConvGeometry

    found = []
    for row in ROW_WIDTHS:
        rows, box_rows = TENSOR_BYTES // row, BOX_BYTES // row
        layout = tensor_map.TiledLayout(dims=(row, rows), strides=(row,), box=(row, box_rows), swizzle=row)
        found.append((f"tiled, rows of {row} B", tensor_map.encode_tiled(address, layout), rows // box_rows, 0,
                      box_rows, 1, 1, 1))
    g = ConvGeometry(64, 256, 56, 56, 64, 1, 1, (1, 1), (0, 0))
    assert PIXELS * INTERLEAVE == BOX_BYTES and g.n * g.c * g.h * g.w <= TENSOR_BYTES
    plane, groups = g.h * g.w, g.c // INTERLEAVE
    found.append(("im2col, pixels of 32 B (1x1 256->64@56)",
                  tensor_map.encode_im2col(address, conv_tma.input_layout(g, PIXELS)),
                  g.n * plane // PIXELS * groups, 1, PIXELS, g.w, plane, groups))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="compile the kernel (NVRTC), no GPU")
    if parser.parse_args().dry_run:
        print(f"tma_rate: {len(compile_ptx())} characters of PTX")
        return
    import cupy

    from cupyops import bench

    kernel = cupy.RawModule(code=SOURCE, options=("-std=c++17", f"-I{jit.resource_dir('kernels')}"),
                            backend="nvrtc").get_function("tma_rate")
    kernel.max_dynamic_shared_size_bytes = max(stages for _, stages in SETTINGS) * BOX_BYTES
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    tensor = cupy.random.default_rng(0).integers(0, 255, TENSOR_BYTES, dtype=numpy.uint8)
    timer = bench.Timer()
    copy_us = timer.time(bench.device_copy(TENSOR_BYTES)).median_us
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs; device copy of "
          f"{TENSOR_BYTES >> 20} MB: {copy_us:.1f} us, {TENSOR_BYTES / copy_us / 1e3:.0f} GB/s read", flush=True)
    for label, tensor_map_, boxes, im2col, box_rows, width, plane, groups in cases(tensor.data.ptr):
        arguments = [numpy.int32(v) for v in (boxes, BOX_BYTES, 0, im2col, box_rows, width, plane, groups)]
        for per_sm, stages in SETTINGS:
            arguments[2] = numpy.int32(stages)
            us = timer.time(lambda: kernel((sms * per_sm,), (32,), (tensor_map_, *arguments),
                                           shared_mem=stages * BOX_BYTES)).median_us
            print(f"{label:42s} {per_sm} block(s) an SM, {stages:2d} stages ({per_sm * stages * BOX_BYTES >> 10:3d} KB "
                  f"an SM in flight): {us:6.1f} us, {boxes * BOX_BYTES / us / 1e3:5.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
