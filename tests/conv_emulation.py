"""A NumPy model of kernels/conv_int8.cuh, thread by thread: the loaders (tap
table, chunk walk, zero predicates), the swizzled shared tiles, ldmatrix and
mma.sync as the PTX ISA defines their fragments, wgmma reading the tiles
through its shared-memory descriptors (decoded as the PTX ISA's canonical
K-major 64B- or 128B-swizzle layouts) into its accumulator fragment, stages of
64- or 128-byte GEMM_K steps, split-K, the epilogue's shared-memory exchange and
the int8 epilogue by warpgroup, and the copy engine's im2col and tiled copies.
It runs the kernel's index arithmetic on the CPU (raw int32 outputs), so a wrong
address, descriptor or fragment shows up without a GPU."""
from __future__ import annotations

import numpy

from cupyops.ops import conv_layout
from cupyops.ops.conv_plan import STEP_BYTES, ConvInt8Spec

INTERLEAVE = 32


def tile_offset(row, vector, row_bytes=STEP_BYTES):
    """kernels/conv_int8.cuh's conv_tile_offset<row_bytes>."""
    return row * row_bytes + ((vector ^ ((row * row_bytes >> 7) & (row_bytes // 16 - 1))) << 4)


def exchange_swizzle(pixel):
    return ((pixel >> 1) & 3) * 8 + (pixel & 1) * 4


# kernels/mma.cuh's wgmma descriptor (tests check its constants against this)
SWIZZLE_MODES = {32: 3, 64: 2, 128: 1}   # row bytes -> descriptor swizzle mode (32B, 64B, 128B)
INTERLEAVED = 0               # descriptor mode without swizzle: 8 x 16-byte core matrices
SWIZZLE_ROWS = 8              # stride-dimension byte offset: 8 rows
LEADING_BYTE_OFFSET = 1       # unused for swizzled K-major layouts


def wgmma_descriptor(address: int, row_bytes: int = STEP_BYTES) -> int:
    """The 64-bit descriptor of a K-major operand of `row_bytes`-byte swizzled rows at shared `address`."""
    return (((address & 0x3FFFF) >> 4) | (LEADING_BYTE_OFFSET << 16) | ((SWIZZLE_ROWS * row_bytes >> 4) << 32)
            | (SWIZZLE_MODES[row_bytes] << 62))


def wgmma_descriptor_moved(descriptor: int, units: int) -> int:
    """kernels/mma.cuh's wgmma_descriptor_moved: a 32-bit add of `units` (16 bytes) to the low word."""
    return (descriptor & ~0xFFFFFFFF) | ((descriptor + units) & 0xFFFFFFFF)


def wgmma_operand(shared: numpy.ndarray, descriptor: int, rows: int) -> numpy.ndarray:
    """(rows, 32) int8 operand of one wgmma k32 as the hardware reads it (PTX ISA, K-major
    canonical layouts). With the R-byte swizzle of the descriptor's mode (R = 32, 64 or
    128): row r, byte k at start + (r // 8) * SBO + (r % 8) * R + k, then address bits 4..
    XOR bits 7.. (CUTLASS's Swizzle<1,4,3>, <2,4,3>, <3,4,3>). Without swizzle: 8 x 16-byte
    core matrices, row r, byte k at start + (r // 8) * SBO + (r % 8) * 16 + (k // 16) * LBO
    + k % 16."""
    start = (descriptor & 0x3FFF) << 4
    leading = ((descriptor >> 16) & 0x3FFF) << 4
    stride = ((descriptor >> 32) & 0x3FFF) << 4
    assert (descriptor >> 49) & 7 == 0, "base offset 0"
    r, k = numpy.meshgrid(numpy.arange(rows), numpy.arange(32), indexing="ij")
    if descriptor >> 62 == INTERLEAVED:
        return shared[start + (r // 8) * stride + (r % 8) * 16 + (k // 16) * leading + k % 16]
    row_bytes = {mode: row for row, mode in SWIZZLE_MODES.items()}[descriptor >> 62]
    address = start + (r // 8) * stride + (r % 8) * row_bytes + k
    return shared[address ^ (((address >> 7) & (row_bytes // 16 - 1)) << 4)]


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


def run(spec: ConvInt8Spec, geometry, x5, w5, splits=1, steps_per_split=None, epilogue="exchange"):
    """The int32 NCHW32 output (and how often each element was written) of `spec`; a wgmma
    spec's epilogue: "exchange" (conv_warp_epilogue) or "warpgroup" (its int8 path,
    conv_warpgroup_epilogue_s8, here moving the raw values)."""
    g = geometry
    m_total, n_total, _ = g.gemm
    steps_per_split = steps_per_split or g.k_steps
    x, w = x5.reshape(-1).astype(numpy.int64), w5.reshape(-1).astype(numpy.int64)
    out = numpy.zeros((splits, *g.output_shape), numpy.int64).reshape(splits, -1)
    writes = numpy.zeros_like(out)
    tm, tn = spec.tile_m, spec.tile_n
    compute = _wgmma_step if spec.wgmma else _mma_sync_step
    for bz in range(splits):
        step_begin = bz * steps_per_split
        steps = min(g.k_steps, step_begin + steps_per_split) - step_begin
        m_tiles = -(-m_total // tm)
        for block in range(m_tiles * -(-n_total // tn)):
            m0, n0 = block % m_tiles * tm, block // m_tiles * tn
            acc = None
            for step in range(step_begin, step_begin + steps, spec.steps_per_stage):
                acc = compute(spec, _load_stage(spec, g, x, w, m0, n0, step, step_begin + steps), acc)
            if acc is None:   # no steps: zeros
                acc = compute(spec, numpy.zeros((tm + tn) * spec.step_bytes, numpy.int64), None)
            origins = _warp_origins(spec)
            if epilogue == "warpgroup":
                for first in range(0, len(origins), 4):
                    channel0, pixel0 = origins[first]
                    warpgroup_epilogue(acc[first:first + 4], g, m0 + channel0, n0 + pixel0, out[bz], writes[bz],
                                       lambda j: divmod(j, g.oh * g.ow) if j < n_total else None)
                continue
            for warp, (channel0, pixel0) in enumerate(origins):
                _epilogue(acc[warp], g, m0 + channel0, n0 + pixel0, out[bz], writes[bz])
    return out.sum(0).astype(numpy.int32).reshape(g.output_shape), writes.reshape(splits, *g.output_shape)


def loader_vectors(spec) -> int:
    """16-byte vectors a thread copies per row and half (the wgmma kernel's VECTORS):
    a whole 32-byte chunk where the tiles' rows divide among half the threads."""
    half = spec.threads_per_block // 2
    return 2 if spec.wgmma and spec.tile_m % half == 0 and spec.tile_n % half == 0 else 1


def _load_stage(spec, g, x, w, m0, n0, step, step_end):
    """The shared stage of 64-byte GEMM_K steps step, .. (one, or two in 128-byte rows)
    as every thread's loads fill it: half h of row r in vectors 4 h .. 4 h + 3, loaded
    by the thread's k-th walk, k = h ^ ((r // vectors) & 1) for 128-byte rows; chunks of steps from
    step_end on (the next split's) or past GEMM_K read zeros."""
    m_total, n_total, _ = g.gemm
    tm, tn, row_bytes = spec.tile_m, spec.tile_n, spec.step_bytes
    offsets, tap_dh, tap_dw = conv_layout.tap_table(g)
    threads = spec.threads_per_block
    vectors = loader_vectors(spec)
    row_step = threads * vectors // 4
    c32, taps, ohw = g.c // INTERLEAVE, g.r * g.s, g.oh * g.ow
    gemm_k = g.c * taps
    chunk_end = min(c32 * taps, step_end * 2)
    group_bytes = g.h * g.w * 32
    shared = numpy.zeros((tm + tn) * row_bytes, numpy.int64)
    written = numpy.zeros_like(shared)
    for tid in range(threads):
        vector, row0 = (tid % (4 // vectors)) * vectors, tid // (4 // vectors)
        upper_first = (row0 // vectors) & 1 if spec.steps_per_stage == 2 else 0
        for k, e in numpy.ndindex(spec.steps_per_stage, vectors):
            half = k ^ upper_first
            chunk = (step + half) * 2 + (vector >> 1)
            group, tap = divmod(chunk, taps)
            slot = tile_offset(row0, vector + 4 * half, row_bytes) ^ (e << 4)
            assert slot == tile_offset(row0, vector + e + 4 * half, row_bytes)
            for i in range(tm // row_step):
                row = m0 + row0 + i * row_step
                dst = slot + i * row_step * row_bytes
                assert dst == tile_offset(row0 + i * row_step, vector + e + 4 * half, row_bytes)
                written[dst: dst + 16] += 1
                if chunk < chunk_end and row < m_total:
                    src = row * gemm_k + chunk * 32 + (vector & 1) * 16 + 16 * e
                    shared[dst: dst + 16] = w[src: src + 16]
            for i in range(tn // row_step):
                j = n0 + row0 + i * row_step
                dst = slot + (tm + i * row_step) * row_bytes
                written[dst: dst + 16] += 1
                if j >= n_total or chunk >= chunk_end:
                    continue
                image, rest = divmod(j, ohw)
                oh, ow = divmod(rest, g.ow)
                ih, iw = oh * g.stride[0] - g.padding[0], ow * g.stride[1] - g.padding[1]
                if not (0 <= ih + tap_dh[tap] < g.h and 0 <= iw + tap_dw[tap] < g.w):
                    continue
                base = image * c32 * group_bytes + (ih * g.w + iw) * 32 + (vector & 1) * 16
                src = base + group * group_bytes + offsets[tap] + 16 * e
                shared[dst: dst + 16] = x[src: src + 16]
    assert (written == 1).all(), "the stage's copies overlap or leave gaps"
    return shared


def _warp_origins(spec):
    """(channel, pixel) of each warp's accumulator block 0 within the tile."""
    warps = spec.threads_per_block // 32
    if spec.wgmma:   # warpgroup wg: rows wg_m .. wg_m + 63; warp w of it: 16 of them
        groups_m = spec.tile_m // 64
        return [((warp // 4) % groups_m * 64 + (warp % 4) * 16, (warp // 4) // groups_m * spec.warp_n)
                for warp in range(warps)]
    warps_m = spec.tile_m // spec.warp_m
    return [((warp % warps_m) * spec.warp_m, (warp // warps_m) * spec.warp_n) for warp in range(warps)]


def _mma_sync_step(spec, shared, acc):
    """One step of every warp's ldmatrix + mma.sync; acc (warps, WM/8, WN/8, lanes, 2)."""
    tm, wm, wn = spec.tile_m, spec.warp_m, spec.warp_n
    k32 = spec.instruction == "m16n8k32"
    kv = 2 if k32 else 1
    warps = spec.threads_per_block // 32
    if acc is None:
        acc = numpy.zeros((warps, wm // 8, wn // 8, 32, 2), numpy.int64)
    lanes = numpy.arange(32)
    for warp, (warp_m, warp_n) in enumerate(_warp_origins(spec)):
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
    return acc


def _wgmma_step(spec, shared, acc):
    """One stage of every warpgroup's wgmma k32 slices, operands decoded from the
    descriptors the kernel builds; acc (warps, 2, WN/8, lanes, 2) in the wgmma
    accumulator fragment: warp w of a warpgroup, lane (g, t): d[h][j][e] =
    D[16 w + g + 8 h][8 j + 2 t + e]."""
    tm, wn = spec.tile_m, spec.warp_n
    warps = spec.threads_per_block // 32
    if acc is None:
        acc = numpy.zeros((warps, 2, wn // 8, 32, 2), numpy.int64)
    lanes = numpy.arange(32)
    g, t = lanes >> 2, lanes & 3
    row_bytes = spec.step_bytes
    for first_warp in range(0, warps, 4):
        channel0, pixel0 = _warp_origins(spec)[first_warp]
        a_descriptor = wgmma_descriptor(channel0 * row_bytes, row_bytes)
        b_descriptor = wgmma_descriptor((tm + pixel0) * row_bytes, row_bytes)
        for k in range(row_bytes // 32):
            a = wgmma_operand(shared, wgmma_descriptor_moved(a_descriptor, k * 2), 64)
            b = wgmma_operand(shared, wgmma_descriptor_moved(b_descriptor, k * 2), wn)
            product = a @ b.T
            for w in range(4):
                for h in range(2):
                    for j in range(wn // 8):
                        for e in range(2):
                            acc[first_warp + w, h, j, :, e] += product[16 * w + g + 8 * h, 8 * j + 2 * t + e]
    return acc


def _epilogue(acc, g, channel0, pixel0, out, writes):
    """One warp's exchange through shared memory (conv_warp_epilogue: four 8-channel blocks
    of an 8-pixel block a round, or two of two where the warp holds 16 channels), then the
    8-channel stores of raw int32. acc (RB, NB, lanes, 2): channel channel0 + 8 rb + lane / 4,
    pixel pixel0 + 8 nb + 2 (lane & 3) + e."""
    m_total, n_total, _ = g.gemm
    ohw = g.oh * g.ow
    rb_count, nb_count = acc.shape[:2]
    row_blocks = min(4, rb_count)
    col_blocks = 4 // row_blocks
    lanes = numpy.arange(32)
    group_id, in_group = lanes >> 2, lanes & 3
    pixel, quarter = lanes >> 2, lanes & 3
    for slice_ in range(rb_count // row_blocks):
        for round_ in range(nb_count // col_blocks):
            exchange = numpy.full(256, -(1 << 40), numpy.int64)
            stored = numpy.zeros(256, numpy.int64)
            for block in range(4):
                rb = slice_ * row_blocks + block % row_blocks
                nb = round_ * col_blocks + block // row_blocks
                for e in range(2):
                    column, row = in_group * 2 + e, block * 8 + group_id
                    where = column * 32 + (row ^ exchange_swizzle(column))
                    exchange[where] = acc[rb, nb, :, e]
                    stored[where] += 1
            assert (stored == 1).all(), "the exchange's writes overlap"
            swz = exchange_swizzle(pixel)
            low = pixel * 32 + ((quarter * 8) ^ swz)
            high = pixel * 32 + ((quarter * 8 + 4) ^ swz)
            values = numpy.concatenate([exchange[low[:, None] + numpy.arange(4)],
                                        exchange[high[:, None] + numpy.arange(4)]], 1)
            for lane in range(32):
                oc = channel0 + (slice_ * row_blocks + quarter[lane] % row_blocks) * 8
                j = pixel0 + (round_ * col_blocks + quarter[lane] // row_blocks) * 8 + pixel[lane]
                if oc < m_total and j < n_total:
                    image, rest = divmod(j, ohw)
                    offset = ((image * (m_total // 32) + (oc >> 5)) * ohw + rest) * 32 + (oc & 31)
                    out[offset: offset + 8] = values[lane]
                    writes[offset: offset + 8] += 1


def wgmma_fragments(block: numpy.ndarray) -> numpy.ndarray:
    """A warpgroup's 64 x WN accumulators as its four warps hold them: (warp, h, j, lane, e),
    row 16 warp + lane / 4 + 8 h, column 8 j + 2 (lane & 3) + e."""
    lanes = numpy.arange(32)
    warps, h, j, e = numpy.meshgrid(numpy.arange(4), numpy.arange(2), numpy.arange(block.shape[1] // 8),
                                    numpy.arange(2), indexing="ij")
    rows = 16 * warps[..., None] + (lanes >> 2) + 8 * h[..., None]
    cols = 8 * j[..., None] + 2 * (lanes & 3) + e[..., None]
    return block[rows, cols].transpose(0, 1, 2, 4, 3)


def warpgroup_epilogue(accs, g, channel0, pixel0, out, writes, locate):
    """conv_warpgroup_epilogue_s8 on raw values: each thread's accumulators into the chunk's
    bytes at the kernel's offsets (each written once), then the 16-byte vectors copied to
    the NCHW32 output where locate(j) gives (image, rest). accs: the four warps' fragments
    (h, j, lane, e); channel0 a multiple of 64."""
    wn = accs[0].shape[1] * 8
    chunk = next(c for c in (64, 32, 16, 8) if wn % c == 0)
    k32, ohw = g.k // INTERLEAVE, g.oh * g.ow
    lanes = numpy.arange(32)
    for c in range(wn // chunk):
        buffer = numpy.full(64 * chunk, -(1 << 40), numpy.int64)
        stored = numpy.zeros(64 * chunk, numpy.int64)
        for warp in range(4):
            warp_row = 16 * warp
            base = (warp_row >> 5) * chunk * 32 + 2 * (lanes & 3) * 32 + (warp_row & 31) + (lanes >> 2)
            for h in range(2):
                for b in range(chunk // 8):
                    for e in range(2):
                        where = base + 8 * h + 256 * b + 32 * e
                        buffer[where] = accs[warp][h, c * chunk // 8 + b, :, e]
                        stored[where] += 1
        assert (stored == 1).all(), "the chunk's byte stores overlap or leave gaps"
        for v in range(4 * chunk):   # the warpgroup's 16-byte vectors, two a pixel
            group, pixel = v // (chunk * 2), (v >> 1) % chunk
            group_out, place = (channel0 >> 5) + group, locate(pixel0 + c * chunk + pixel)
            if group_out < k32 and place is not None:
                image, rest = place
                offset = ((image * k32 + group_out) * ohw + rest) * 32 + (v & 1) * 16
                out[offset:offset + 16] = buffer[16 * v:16 * v + 16]
                writes[offset:offset + 16] += 1


def tiled_copy(source: numpy.ndarray, layout, start: tuple, shared: numpy.ndarray, at: int) -> None:
    """The copy engine's tiled copy of the box at `start` (coordinates innermost first) of
    the uint8 map `layout` over `source` (the tensor's bytes, flat) into shared memory from
    `at` (a multiple of 1024) in the layout's swizzle: the box's byte a (box dims innermost
    first) at at + a with address bits 4.. XOR bits 7.. as wgmma_operand reads them; zeros
    for elements outside the tensor."""
    box, dims, strides = layout.box, layout.dims, (1, *layout.strides)
    index = numpy.indices(box[::-1]).reshape(len(box), -1)[::-1]   # innermost first, a-th column: byte a
    coords = index + numpy.array(start)[:, None]
    inside = ((coords >= 0) & (coords < numpy.array(dims)[:, None])).all(0)
    values = numpy.zeros(index.shape[1], source.dtype)
    values[inside] = source[(coords[:, inside] * numpy.array(strides)[:, None]).sum(0)]
    a = numpy.arange(index.shape[1])
    shared[at + (a ^ (((a >> 7) & (layout.swizzle // 16 - 1)) << 4))] = values


def im2col_copy(x5: numpy.ndarray, layout, start: tuple, offsets: tuple) -> numpy.ndarray:
    """(pixels, channels) rows of one im2col copy of a 5-D map `layout` (dims c, w, h, d, n)
    over the NCHW32 array x5 (N, C/32, H, W, 32), indexed [d, n, h, w, c]: from base
    position (w, h, d, n) = `start` the engine takes the element at the base plus the filter
    `offsets` (zeros outside the tensor), then steps w by its traversal stride through the
    box's positions lower .. lower + (size + upper - lower - 1) // stride * stride, wrapping
    into h, then d, then n (PTX ISA, im2col mode)."""
    dims, lower, upper, steps = layout.dims, layout.lower_corner, layout.upper_corner, layout.element_strides
    counts = [(dims[i + 1] + upper[i] - lower[i] - 1) // steps[i + 1] + 1 for i in range(3)]
    base = list(start)
    rows = numpy.zeros((layout.pixels, layout.channels), dtype=x5.dtype)
    for p in range(layout.pixels):
        w, h, d = (base[i] + offsets[i] for i in range(3))
        n = base[3]
        if 0 <= w < dims[1] and 0 <= h < dims[2] and 0 <= d < dims[3] and 0 <= n < dims[4]:
            rows[p] = x5[d, n, h, w, :layout.channels]
        for i in range(3):   # the next position: w, carrying into h, d, then n
            base[i] += steps[i + 1]
            if base[i] < lower[i] + counts[i] * steps[i + 1]:
                break
            base[i] = lower[i]
        else:
            base[3] += 1
    return rows


def halo_run(spec: ConvInt8Spec, g, x5: numpy.ndarray, w5: numpy.ndarray, splits: int = 1,
             units_per_split: int = 0, epilogue: str = "exchange") -> numpy.ndarray:
    """conv2d_int8_fprop_halo on the CPU, stage by stage: the copy engine's filter taps
    (32-byte swizzle), the producer's copies of the input rows into two planes of
    16-byte halves (its copy-to-slot map, zeros outside the image), each tap's wgmma
    reading them through the descriptors the kernel builds (the B start moved by the
    tap's shift), split-K partials summed, and the slots HaloPixels keeps (epilogue
    "warpgroup": through warpgroup_epilogue). Raw int32 accumulators, NCHW32."""
    tm, tn, wn, pitch = spec.tile_m, spec.tile_n, spec.warp_n, spec.halo_pitch
    rows_out, rb, s, dh, dw = tn // pitch, spec.halo_filter_rows, spec.filter_width, spec.dilation_h, spec.dilation_w
    taps = rb * s
    halo_slots = (rows_out + (rb - 1) * dh) * pitch
    slack = -(-(s - 1) * dw // 8) * 8
    a_bytes, plane_bytes = taps * tm * 32, (halo_slots + slack) * 16
    filter_rows = w5.reshape(g.k, -1)
    group_units = g.r // rb
    units = g.c // INTERLEAVE * group_units
    units_per_split = units_per_split or units
    out = numpy.zeros(g.output_shape, dtype=numpy.int64)
    a_descriptor = wgmma_descriptor(0, 32)
    for split in range(splits):
        for image in range(g.n):
            for oh0 in range(0, g.oh, rows_out):
                for m0 in range(0, g.k, tm):
                    acc = numpy.zeros((tm, tn), dtype=numpy.int64)
                    for unit in range(split * units_per_split, min(units, (split + 1) * units_per_split)):
                        shared = numpy.zeros(a_bytes + 2 * plane_bytes, dtype=numpy.int8)
                        group, r0 = divmod(unit, group_units)
                        for t in range(taps):   # the copy engine: box (32 bytes, tm rows), 32-byte swizzle
                            for row in range(min(tm, g.k - m0)):
                                chunk = filter_rows[m0 + row, (unit * taps + t) * 32:(unit * taps + t + 1) * 32]
                                for v in range(2):
                                    at = t * tm * 32 + tile_offset(row, v, 32)
                                    shared[at:at + 16] = chunk[16 * v:16 * v + 16]
                        ih0 = oh0 - g.padding[0] + r0 * rb * dh
                        for c in range(2 * -(-halo_slots // 8) * 8):   # the producer's copies, whole runs of 8
                            half, slot = (c >> 3) & 1, (c & 7) + ((c >> 4) << 3)
                            ih, iw = ih0 + slot // pitch, slot % pitch - g.padding[1]
                            if 0 <= ih < g.h and 0 <= iw < g.w:
                                at = a_bytes + half * plane_bytes + slot * 16
                                shared[at:at + 16] = x5[image, group, ih, iw, 16 * half:16 * half + 16]
                        for wg_m in range(0, tm, 64):
                            for wg_n in range(0, tn, wn):
                                b_descriptor = (((a_bytes + wg_n * 16) >> 4) | ((plane_bytes >> 4) << 16)
                                                | ((128 >> 4) << 32))
                                for t in range(taps):
                                    i, col = divmod(t, s)
                                    a = wgmma_operand(shared, wgmma_descriptor_moved(
                                        a_descriptor, (t * tm * 32 + wg_m * 32) >> 4), 64)
                                    b = wgmma_operand(shared, wgmma_descriptor_moved(
                                        b_descriptor, i * dh * pitch + col * dw), wn)
                                    acc[wg_m:wg_m + 64, wg_n:wg_n + wn] += a.astype(numpy.int64) @ b.T.astype(numpy.int64)
                    if epilogue == "warpgroup":
                        def locate(j, image=image, oh0=oh0):   # HaloPixels
                            oh, ow = oh0 + j // pitch, j % pitch
                            return (image, oh * g.ow + ow) if ow < g.ow and oh < g.oh else None
                        flat, writes = numpy.zeros(out.size, numpy.int64), numpy.zeros(out.size, numpy.int64)
                        for wg_m in range(0, tm, 64):
                            for wg_n in range(0, tn, wn):
                                warpgroup_epilogue(wgmma_fragments(acc[wg_m:wg_m + 64, wg_n:wg_n + wn]), g,
                                                   m0 + wg_m, wg_n, flat, writes, locate)
                        assert writes.max() <= 1, "an output written twice"
                        out += flat.reshape(out.shape)
                        continue
                    for j in range(tn):   # HaloPixels: the slots inside the output
                        oh, ow = oh0 + j // pitch, j % pitch
                        if ow < g.ow and oh < g.oh:
                            for m in range(m0, min(m0 + tm, g.k)):
                                out[image, m // 32, oh, ow, m % 32] += acc[m - m0, j]
    return out.astype(numpy.int32)
