"""A NumPy model of kernels/conv_int8.cuh, thread by thread: the loaders (tap
table, chunk walk, zero predicates), the swizzled shared tiles, ldmatrix and
mma.sync as the PTX ISA defines their fragments, split-K, and the epilogue's
shared-memory exchange. It runs the kernel's index arithmetic on the CPU
(raw int32 outputs), so a wrong address or fragment shows up without a GPU."""
from __future__ import annotations

import numpy

from cupyops.ops import conv_layout
from cupyops.ops.conv2d_int8 import STEP_BYTES, ConvInt8Spec

INTERLEAVE = 32


def tile_offset(row, vector):
    return row * STEP_BYTES + ((vector ^ ((row >> 1) & 3)) << 4)


def exchange_swizzle(pixel):
    return ((pixel >> 1) & 3) * 8 + (pixel & 1) * 4


def ldmatrix_x4(shared: numpy.ndarray, addresses: numpy.ndarray) -> numpy.ndarray:
    """(4, 32 lanes, 4 bytes): lane L gives the row address of row L % 8 of matrix
    L // 8; register q of lane L holds bytes 4 (L % 4) .. of row L // 4 of matrix q."""
    rows = numpy.stack([shared[a: a + 16] for a in addresses]).reshape(4, 8, 16)
    lanes = numpy.arange(32)
    return rows[:, lanes >> 2].reshape(4, 32, 4, 4)[:, lanes, lanes & 3]


def mma(d, a_regs, b_regs, k32: bool):
    """d (lanes, regs) += A * B with A, B rebuilt from the lanes' registers by the
    PTX ISA's fragment layouts of m16n8k32 / m8n8k16 .s8."""
    lanes = numpy.arange(32)
    g, t = lanes >> 2, lanes & 3
    rows_a = 16 if k32 else 8
    depth = 32 if k32 else 16
    a = numpy.zeros((rows_a, depth), numpy.int64)
    b = numpy.zeros((depth, 8), numpy.int64)
    for i in range(4):
        a[g, 4 * t + i] = a_regs[0][:, i]
        b[4 * t + i, g] = b_regs[0][:, i]
        if k32:
            a[g + 8, 4 * t + i] = a_regs[1][:, i]
            a[g, 16 + 4 * t + i] = a_regs[2][:, i]
            a[g + 8, 16 + 4 * t + i] = a_regs[3][:, i]
            b[16 + 4 * t + i, g] = b_regs[1][:, i]
    product = a @ b
    d[:, 0] += product[g, 2 * t]
    d[:, 1] += product[g, 2 * t + 1]
    if k32:
        d[:, 2] += product[g + 8, 2 * t]
        d[:, 3] += product[g + 8, 2 * t + 1]


def run(spec: ConvInt8Spec, geometry, x5, w5, splits=1, steps_per_split=None):
    """The int32 NCHW32 output (and how often each element was written) of `spec`."""
    g = geometry
    m_total, n_total, _ = g.gemm
    steps_per_split = steps_per_split or g.k_steps
    x, w = x5.reshape(-1).astype(numpy.int64), w5.reshape(-1).astype(numpy.int64)
    out = numpy.zeros((splits, *g.output_shape), numpy.int64).reshape(splits, -1)
    writes = numpy.zeros_like(out)
    offsets, tap_dh, tap_dw = conv_layout.tap_table(g)
    tm, tn, wm, wn = spec.tile_m, spec.tile_n, spec.warp_m, spec.warp_n
    k32 = spec.instruction == "m16n8k32"
    kv = 2 if k32 else 1
    warps_m = tm // wm
    threads = spec.threads_per_block
    row_step = threads // 4
    c32, taps, ohw = g.c // INTERLEAVE, g.r * g.s, g.oh * g.ow
    gemm_k = g.c * taps
    group_bytes = g.h * g.w * 32
    for bz in range(splits):
        step_begin = bz * steps_per_split
        steps = min(g.k_steps, step_begin + steps_per_split) - step_begin
        m_tiles = -(-m_total // tm)
        for block in range(m_tiles * -(-n_total // tn)):
            m0, n0 = block % m_tiles * tm, block // m_tiles * tn
            acc = numpy.zeros((threads // 32, wm // 8, wn // 8, 32, 2), numpy.int64)
            for step in range(step_begin, step_begin + steps):
                shared = numpy.zeros((tm + tn) * STEP_BYTES, numpy.int64)
                for tid in range(threads):
                    vector, row0 = tid & 3, tid >> 2
                    chunk = step * 2 + (vector >> 1)
                    group, tap = divmod(chunk, taps)
                    for i in range(tm // row_step):
                        row = m0 + row0 + i * row_step
                        if group < c32 and row < m_total:
                            src = row * gemm_k + chunk * 32 + (vector & 1) * 16
                            dst = tile_offset(row0 + i * row_step, vector)
                            shared[dst: dst + 16] = w[src: src + 16]
                    for i in range(tn // row_step):
                        j = n0 + row0 + i * row_step
                        if j >= n_total or group >= c32:
                            continue
                        image, rest = divmod(j, ohw)
                        oh, ow = divmod(rest, g.ow)
                        ih, iw = oh * g.stride[0] - g.padding[0], ow * g.stride[1] - g.padding[1]
                        if not (0 <= ih + tap_dh[tap] < g.h and 0 <= iw + tap_dw[tap] < g.w):
                            continue
                        base = image * c32 * group_bytes + (ih * g.w + iw) * 32 + (vector & 1) * 16
                        src = base + group * group_bytes + offsets[tap]
                        dst = tm * STEP_BYTES + tile_offset(row0 + i * row_step, vector)
                        shared[dst: dst + 16] = x[src: src + 16]
                lanes = numpy.arange(32)
                for warp in range(threads // 32):
                    warp_m, warp_n = (warp % warps_m) * wm, (warp // warps_m) * wn
                    for ks in range(STEP_BYTES // (16 * kv)):
                        a = numpy.zeros((wm // 8 * kv, 32, 4), numpy.int64)
                        b = numpy.zeros((wn // 8 * kv, 32, 4), numpy.int64)
                        for frags, base_row, tile_base in ((a, warp_m, 0), (b, warp_n, tm * STEP_BYTES)):
                            for c in range(len(frags) // 4):
                                index = c * 4 + (lanes >> 3)
                                rows = base_row + index // kv * 8 + (lanes & 7)
                                addresses = tile_base + tile_offset(rows, ks * kv + index % kv)
                                frags[c * 4: c * 4 + 4] = ldmatrix_x4(shared, addresses)
                        for mi in range(wm // (8 * kv)):
                            for ni in range(wn // 8):
                                if k32:
                                    d = numpy.concatenate([acc[warp, 2 * mi, ni], acc[warp, 2 * mi + 1, ni]], 1)
                                    mma(d, [a[4 * mi], a[4 * mi + 2], a[4 * mi + 1], a[4 * mi + 3]],
                                        [b[2 * ni], b[2 * ni + 1]], True)
                                    acc[warp, 2 * mi, ni], acc[warp, 2 * mi + 1, ni] = d[:, :2], d[:, 2:]
                                else:
                                    mma(acc[warp, mi, ni], [a[mi]], [b[ni]], False)
            _epilogue(acc, spec, g, m0, n0, out[bz], writes[bz])
    return out.sum(0).astype(numpy.int32).reshape(g.output_shape), writes.reshape(splits, *g.output_shape)


def _epilogue(acc, spec, g, m0, n0, out, writes):
    """The exchange through shared memory, then the 8-channel stores of raw int32."""
    m_total, n_total, _ = g.gemm
    wm, wn, warps_m = spec.warp_m, spec.warp_n, spec.tile_m // spec.warp_m
    ohw = g.oh * g.ow
    lanes = numpy.arange(32)
    group_id, in_group = lanes >> 2, lanes & 3
    pixel, quarter = lanes >> 2, lanes & 3
    for warp in range(acc.shape[0]):
        warp_m, warp_n = (warp % warps_m) * wm, (warp // warps_m) * wn
        for slice_ in range(wm // 32):
            for nb in range(wn // 8):
                exchange = numpy.full(256, -(1 << 40), numpy.int64)
                stored = numpy.zeros(256, numpy.int64)
                for block in range(4):
                    for e in range(2):
                        column, row = in_group * 2 + e, block * 8 + group_id
                        where = column * 32 + (row ^ exchange_swizzle(column))
                        exchange[where] = acc[warp, slice_ * 4 + block, nb, :, e]
                        stored[where] += 1
                assert (stored == 1).all(), "the exchange's writes overlap"
                swz = exchange_swizzle(pixel)
                low = pixel * 32 + ((quarter * 8) ^ swz)
                high = pixel * 32 + ((quarter * 8 + 4) ^ swz)
                values = numpy.concatenate([exchange[low[:, None] + numpy.arange(4)],
                                            exchange[high[:, None] + numpy.arange(4)]], 1)
                for lane in range(32):
                    oc = m0 + warp_m + slice_ * 32 + quarter[lane] * 8
                    j = n0 + warp_n + nb * 8 + pixel[lane]
                    if oc < m_total and j < n_total:
                        image, rest = divmod(j, ohw)
                        offset = ((image * (m_total // 32) + (oc >> 5)) * ohw + rest) * 32 + (oc & 31)
                        out[offset: offset + 8] = values[lane]
                        writes[offset: offset + 8] += 1
