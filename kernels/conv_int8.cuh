// int8 convolution by implicit GEMM on tensor cores, NCHW32 in and out.
//
// GEMM_M = output channels, GEMM_N = N * OH * OW, GEMM_K = IC * FH * FW taken
// in 32-channel chunks ordered (channel group, fh, fw): chunk c reads input
// channel group c / taps at tap c % taps. A is the packed filter, row-major
// (K, C/32, FH, FW, 32): each row is GEMM_K contiguous bytes. B is the
// input: 32 contiguous channels of a pixel per chunk. A block computes a
// TM x TN tile of C over 64-byte steps of GEMM_K (two chunks): by mma.sync
// (warps of WM x WN, ldmatrix from shared memory) or, on sm_90a, by wgmma
// (warpgroups of 64 x WN reading the same shared tiles through descriptors),
// whose stages may also hold 128-byte steps (four chunks, two 64-byte steps).
//
// Global -> shared: thread t loads 16-byte vector (t & 3) of rows t / 4,
// t / 4 + THREADS / 4, ... of both tiles: 16-byte loads, each 32-byte chunk
// one sector, a pixel's chunk at an address from the host's tap table (the
// kernel parameter's tap_offset / tap_dh / tap_dw: no division in the loop).
// Shared tiles hold 64-byte rows, vector v of row r at r * 64 + 16 * (v ^
// ((r >> 1) & 3)): the eight rows an ldmatrix phase reads, and the eight
// vectors a phase of stores writes, fall in distinct banks without padding.
// This is also the 64-byte swizzle wgmma descriptors describe (kernels/mma.cuh).
// 128-byte rows (wgmma only) hold vector v of row r at r * 128 + 16 * (v ^ (r & 7)),
// the 128-byte swizzle: thread t loads vectors (t & 3) + 4 h, h = 0, 1, of the
// same rows, one 64-byte half each, odd rows' threads the upper half first so
// that the two rows of a phase of stores still cover all banks.
//
// Epilogue: each warp passes its accumulators through 1 KB of shared memory,
// 32 channels x 8 pixels at a time (16 x 16 for wgmma, whose warps own 16
// rows), so that a lane ends with 8 consecutive channels of one pixel:
// y = alpha * acc + beta * bias + gamma * z, ReLU, stored as 8 contiguous
// outputs (a warp writes 8 whole NCHW32 pixels, or 16 halves). Int (i, pixel c)
// sits at c * 32 + (i ^ swizzle(c)), conflict-free both ways. The wgmma kernels
// write an int8 output with no z and no split by warpgroup instead: each byte
// converted where its accumulator lies, into 4 KB laid out as the output's rows,
// copied out in 16-byte vectors (conv_warpgroup_epilogue_s8).
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "cluster.cuh"
#include "tma.cuh"

namespace cupyops {

constexpr int CONV_MAX_TAPS = 128;
constexpr int CONV_STEP_BYTES = 64;     // GEMM_K bytes of a step (p.k_steps counts them)

enum ConvOut { CONV_OUT_S8 = 0, CONV_OUT_F16 = 1, CONV_OUT_F32 = 2, CONV_OUT_S32 = 3 };
enum ConvBias { CONV_BIAS_NONE = 0, CONV_BIAS_F32 = 1, CONV_BIAS_S32 = 2 };
// How a warp-specialised kernel's pixels come: the producer's cp.async, or the copy
// engine's im2col copies, or its tiled copies of rows of four pixels.
enum ConvPixels { CONV_PIXELS_CPASYNC = 0, CONV_PIXELS_IM2COL = 1, CONV_PIXELS_ROWS = 2 };

// A call's epilogue: y = alpha * acc + beta * bias + gamma * z, ReLU, out_kind.
struct ConvEpilogue {
  int out_kind, bias_kind, relu, has_z, alpha_per_channel;
  float alpha, beta, gamma;
};

// Passed by value; cupyops/ops/conv_layout.py builds the same struct.
struct ConvParams {
  int n, c32, h, w, k32, oh, ow;
  int stride_h, stride_w, pad_h, pad_w;
  int gemm_m, gemm_n, taps, k_steps, steps_per_split, splits;
  unsigned ohw_multiplier;         // OH * OW's divisor for fast_quotient (common.cuh); 0 where it is 1
  int ohw_shift;
  ConvEpilogue epilogue;
  int tap_offset[CONV_MAX_TAPS];   // (fh * dilation_h * W + fw * dilation_w) * 32
  int tap_dh[CONV_MAX_TAPS];       // fh * dilation_h
  int tap_dw[CONV_MAX_TAPS];       // fw * dilation_w
};

// Vector `vector` of row `row` in a shared tile of ROW_BYTES-byte rows: the XOR
// takes address bits 7.. of the row (the swizzle's phase), as wgmma's hardware does.
template <int ROW_BYTES = CONV_STEP_BYTES>
__device__ __forceinline__ int conv_tile_offset(int row, int vector) {
  static_assert(ROW_BYTES == 64 || ROW_BYTES == 128, "64B or 128B swizzle");
  return row * ROW_BYTES + ((vector ^ ((row * ROW_BYTES >> 7) & (ROW_BYTES / 16 - 1))) << 4);
}

__device__ __forceinline__ int conv_exchange_swizzle(int pixel) {
  return ((pixel >> 1) & 3) * 8 + (pixel & 1) * 4;
}

__device__ __forceinline__ unsigned pack_s8x4(const int* values) {   // the low bytes of 4 ints
  return __byte_perm(__byte_perm(values[0], values[1], 0x0040), __byte_perm(values[2], values[3], 0x0040), 0x5410);
}

// Output channel oc's alpha (per channel or the call's) and bias (0 without one).
__device__ __forceinline__ float conv_alpha(const ConvEpilogue& p, const float* alpha_vec, int oc) {
  return p.alpha_per_channel ? alpha_vec[oc] : p.alpha;
}
__device__ __forceinline__ float conv_bias(const ConvEpilogue& p, const void* bias, int oc) {
  float value = 0.f;
  if (p.bias_kind == CONV_BIAS_F32) value = static_cast<const float*>(bias)[oc];
  if (p.bias_kind == CONV_BIAS_S32) value = static_cast<float>(static_cast<const int*>(bias)[oc]);
  return value;
}

// The epilogue of 8 consecutive output channels oc .. oc + 7 of one pixel at
// element `offset` of y (and z), accumulators low and high: raw for CONV_OUT_S32,
// else y = alpha * acc + beta * bias + gamma * z, ReLU, converted. The call's flags
// branch once per 8 outputs (warp-uniform): a scale alone costs a multiply an
// output, with no per-element selects of per-channel terms (a vector form of
// those takes more registers than the widest tiles have); int8's ReLU and
// saturation are one integer clamp.
__device__ __forceinline__ void conv_epilogue_store(int4 low, int4 high, int oc, int64 offset, const ConvEpilogue& p,
                                                    void* y, const signed char* z, const float* alpha_vec,
                                                    const void* bias) {
  const int acc[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
  if (p.out_kind == CONV_OUT_S32) {
    int4* dst = reinterpret_cast<int4*>(static_cast<int*>(y) + offset);
    dst[0] = make_int4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_int4(acc[4], acc[5], acc[6], acc[7]);
    return;
  }
  float value[8];
  if (!p.alpha_per_channel && p.bias_kind == CONV_BIAS_NONE && !p.has_z) {   // a scale alone
#pragma unroll
    for (int i = 0; i < 8; ++i) value[i] = p.alpha * static_cast<float>(acc[i]);
  } else {
    int2 z_bytes = make_int2(0, 0);
    if (p.has_z) z_bytes = *reinterpret_cast<const int2*>(z + offset);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned word = static_cast<unsigned>(i < 4 ? z_bytes.x : z_bytes.y);
      const float z_i = static_cast<float>(static_cast<signed char>(word >> (8 * (i & 3))));
      value[i] = fmaf(conv_alpha(p, alpha_vec, oc + i), static_cast<float>(acc[i]),
                      fmaf(p.beta, conv_bias(p, bias, oc + i), p.gamma * z_i));
    }
  }
  if (p.out_kind == CONV_OUT_S8) {   // ReLU's floor and the saturation in one clamp (NaN: 0)
    const int low = p.relu ? 0 : -128;
    int q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = min(127, max(low, __float2int_rn(value[i])));
    *reinterpret_cast<int2*>(static_cast<signed char*>(y) + offset) =
        make_int2(static_cast<int>(pack_s8x4(q)), static_cast<int>(pack_s8x4(q + 4)));
    return;
  }
  if (p.relu) {
#pragma unroll
    for (int i = 0; i < 8; ++i) value[i] = fmaxf(value[i], 0.f);
  }
  if (p.out_kind == CONV_OUT_F16) {
    unsigned halves[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      halves[i] = static_cast<unsigned>(cast<half_t>(value[2 * i]).bits) |
                  (static_cast<unsigned>(cast<half_t>(value[2 * i + 1]).bits) << 16);
    }
    *reinterpret_cast<uint4*>(static_cast<half_t*>(y) + offset) =
        make_uint4(halves[0], halves[1], halves[2], halves[3]);
  } else {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(y) + offset);
    dst[0] = make_float4(value[0], value[1], value[2], value[3]);
    dst[1] = make_float4(value[4], value[5], value[6], value[7]);
  }
}

// conv_epilogue_store as a call, for a tile's epilogue: compiled once, where inlined
// every out kind's branch was repeated at each of a tile's rounds (most of the widest
// tiles' code and compile time); a call costs a few instructions per 8 outputs. The
// split-K sum keeps the store inlined (around a call its loop spilled registers).
__device__ __noinline__ void conv_epilogue_store_call(int4 low, int4 high, int oc, int64 offset,
                                                      const ConvEpilogue p, void* y, const signed char* z,
                                                      const float* alpha_vec, const void* bias) {
  conv_epilogue_store(low, high, oc, offset, p, y, z, alpha_vec, bias);
}

// A block's tile: tiles are numbered GEMM_M tiles fastest (the blocks sharing an
// input tile run together, so it is read from DRAM once), then GEMM_N tiles, then
// the split of GEMM_K, `steps` 64-byte steps from step_begin.
struct ConvTile {
  int m0, n0, step_begin, steps, split;
  // The 32-channel chunks of GEMM_K the tile's split covers (two a step, the last step maybe one).
  __device__ __forceinline__ int chunks(const ConvParams& p) const {
    return min(2 * steps, p.c32 * p.taps - 2 * step_begin);
  }
};

// Tile `index` of a split: GEMM_M tiles fastest. A cluster of CLUSTER blocks (one
// GEMM_M tile, CLUSTER GEMM_N tiles side by side) counts as one tile; `rank` picks the
// block's (its GEMM_N tile may lie past GEMM_N: nothing of it is stored).
template <int TM, int TN, int CLUSTER = 1>
__device__ __forceinline__ ConvTile conv_tile_of(const ConvParams& p, int index, int split, int rank = 0) {
  const int m_tiles = (p.gemm_m + TM - 1) / TM;
  const int n_group = index / m_tiles;
  const int step_begin = split * p.steps_per_split;
  return ConvTile{(index - n_group * m_tiles) * TM, (n_group * CLUSTER + rank) * TN, step_begin,
                  min(p.k_steps, step_begin + p.steps_per_split) - step_begin, split};
}
// The tile of this block: blockIdx.x its tile, blockIdx.z its split.
template <int TM, int TN>
__device__ __forceinline__ ConvTile conv_tile(const ConvParams& p) {
  return conv_tile_of<TM, TN>(p, blockIdx.x, blockIdx.z);
}

// Global -> shared loads of a block's A (TM filter rows) and B (TN pixels) tiles,
// one stage of ROW_BYTES-byte rows at a time (HALVES 64-byte GEMM_K steps): thread
// t loads 16-byte vector (t & 3) of each half of rows t / 4, t / 4 + THREADS / 4,
// ... of both (see the top of this file). Each half walks its own chunks. With
// VECTORS = 2 thread t loads vectors 2 (t & 1) and 2 (t & 1) + 1 -- a whole 32-byte
// chunk, one bounds check and source for two copies -- of rows t / 2, t / 2 +
// THREADS / 2, ...; in 128-byte rows the halves then alternate every two rows.
// WITH_A = false loads the B tile alone (the copy engine brings A), thread t being
// the t-th of the THREADS loading ones.
template <int TM, int TN, int THREADS, int ROW_BYTES = CONV_STEP_BYTES, int VECTORS = 1, bool WITH_A = true>
struct ConvTileLoader {
  static constexpr int HALVES = ROW_BYTES / CONV_STEP_BYTES;
  static constexpr int ROW_STEP = THREADS * VECTORS / 4;
  static constexpr int A_ITERS = WITH_A ? TM / ROW_STEP : 0, B_ITERS = TN / ROW_STEP;
  static constexpr int A_HELD = A_ITERS > 0 ? A_ITERS : 1;   // arrays of A_ITERS (none without A)
  static_assert(HALVES == 1 || HALVES == 2, "64- or 128-byte rows");
  static_assert(VECTORS == 1 || VECTORS == 2, "a vector or a chunk a row");
  static_assert((!WITH_A || TM % ROW_STEP == 0) && TN % ROW_STEP == 0, "every thread loads whole rows");
  static_assert(ROW_STEP % 8 == 0, "a thread's rows share their swizzle phase");

  // The current chunk of a half, read from the tap table once a stage.
  struct Chunk {
    bool valid;           // within GEMM_K and the block's split
    int dh, dw;           // the tap's offset in rows and columns
    int a_offset, b_offset;
  };

  const signed char* x;
  const signed char* w;
  const ConvParams& p;
  // Parameters the loop reads, held in registers (the cp.async statements'
  // memory clobber would otherwise reload them from the parameter block).
  // Offsets within an image and along a filter row fit 32 bits (the host checks).
  int h, width, c32, taps, group_bytes;
  // This thread's loads: vector `vector` of rows row0 + i * ROW_STEP; per loaded
  // half k, chunk (group, tap) of GEMM_K, 2 * HALVES chunks further each stage, at
  // a_offset in a filter row; chunks_left of the split's (and GEMM_K's) chunks from
  // it on: those past them read zeros (a loop-carried count, no bound recomputed).
  int vector, row0, group[HALVES], tap[HALVES], a_offset[HALVES], chunks_left[HALVES];
  int tap_step, group_step;   // 2 * HALVES chunks = group_step groups + tap_step taps (< taps)
  int slot[HALVES];           // shared offset of half h's vector of row row0
  const signed char* a_row[A_HELD];   // this thread's filter rows (past GEMM_M: never read)
  int a_rows;                 // its rows i * ROW_STEP below this are within GEMM_M
  const signed char* b_pixel[B_ITERS];   // where this thread's pixels' (ih0, iw0) would be
  int b_ih[B_ITERS], b_iw[B_ITERS];

  __device__ __forceinline__ ConvTileLoader(const signed char* x_, const signed char* w_, const ConvParams& p_,
                                            const ConvTile& tile, int tid)
      : x(x_), w(w_), p(p_), h(p_.h), width(p_.w), c32(p_.c32), taps(p_.taps) {
    const int gemm_k = c32 * 32 * taps;
    group_bytes = h * width * 32;
    const int ohw = p.oh * p.ow;
    vector = (tid & (4 / VECTORS - 1)) * VECTORS;
    row0 = tid / (4 / VECTORS);
    const int chunk_end = min(c32 * taps, (tile.step_begin + tile.steps) * 2);
    group_step = 2 * HALVES / taps;
    tap_step = 2 * HALVES - group_step * taps;
    // The rows a phase of 8 stores covers (2 VECTORS) alternate halves: all 32 banks.
    const int upper_first = HALVES == 2 ? (row0 / VECTORS) & 1 : 0;
#pragma unroll
    for (int k = 0; k < HALVES; ++k) {
      const int half = k ^ upper_first;
      const int chunk = (tile.step_begin + half) * 2 + (vector >> 1);
      slot[k] = conv_tile_offset<ROW_BYTES>(row0, vector + 4 * half);
      group[k] = chunk / taps;
      tap[k] = chunk - group[k] * taps;
      a_offset[k] = chunk * 32 + (vector & 1) * 16;
      chunks_left[k] = chunk_end - chunk;
    }
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      a_row[i] = w + static_cast<int64>(tile.m0 + row0 + i * ROW_STEP) * gemm_k;
      // Opaque from here: the compiler keeps the pointer instead of rebuilding it from
      // the parameters at every copy (it did, 8 instructions each).
      asm("" : "+l"(a_row[i]));
    }
    a_rows = p.gemm_m - tile.m0 - row0;
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int j = tile.n0 + row0 + i * ROW_STEP;
      b_ih[i] = -(1 << 30);   // fails every bounds check: a pixel past GEMM_N
      b_iw[i] = 0;
      b_pixel[i] = x;
      if (j < p.gemm_n) {
        const int image = j / ohw, rest = j - image * ohw;
        const int oh = rest / p.ow, ow = rest - oh * p.ow;
        b_ih[i] = oh * p.stride_h - p.pad_h;
        b_iw[i] = ow * p.stride_w - p.pad_w;
        b_pixel[i] = x + (static_cast<int64>(image) * c32 * group_bytes +
                          (static_cast<int64>(b_ih[i]) * width + b_iw[i]) * 32 + (vector & 1) * 16);
      }
    }
  }

  __device__ __forceinline__ Chunk current_chunk(int k) const {
    return Chunk{chunks_left[k] > 0, p.tap_dh[tap[k]], p.tap_dw[tap[k]], a_offset[k],
                 group[k] * group_bytes + p.tap_offset[tap[k]]};
  }
  // Whether the chunk's A row i / B row i lies inside the operands (else it reads zeros), and its source.
  __device__ __forceinline__ bool a_inside(const Chunk& c, int i) const { return c.valid && i * ROW_STEP < a_rows; }
  __device__ __forceinline__ const signed char* a_source(const Chunk& c, int i) const {
    return a_row[i] + c.a_offset;
  }
  __device__ __forceinline__ bool b_inside(const Chunk& c, int i) const {
    return c.valid && static_cast<unsigned>(b_ih[i] + c.dh) < static_cast<unsigned>(h) &&
           static_cast<unsigned>(b_iw[i] + c.dw) < static_cast<unsigned>(width);
  }
  __device__ __forceinline__ const signed char* b_source(const Chunk& c, int i) const {
    return b_pixel[i] + c.b_offset;
  }
  __device__ __forceinline__ void advance() {
#pragma unroll
    for (int k = 0; k < HALVES; ++k) {
      a_offset[k] += 64 * HALVES;
      chunks_left[k] -= 2 * HALVES;
      // tap + tap_step < 2 taps: at most one carry into the group, without a branch
      tap[k] += tap_step;
      group[k] += group_step;
      const bool carry = tap[k] >= taps;
      tap[k] -= carry ? taps : 0;
      group[k] += carry;
    }
  }
  // Shared offsets of vector `vector` + e of half k's A row i and B row i within a stage
  // (rows i * ROW_STEP apart, a multiple of the swizzle's 8 rows: the same vector slot in
  // each; `vector` is even where e = 1, so the XOR of its swizzle flips bit 4 alone).
  __device__ __forceinline__ int a_slot(int k, int i, int e = 0) const {
    return (slot[k] ^ (e << 4)) + i * ROW_STEP * ROW_BYTES;
  }
  __device__ __forceinline__ int b_slot(int k, int i, int e = 0) const {
    return (slot[k] ^ (e << 4)) + (TM + i * ROW_STEP) * ROW_BYTES;
  }

  // cp.async of the current stage into the stage at shared address `stage`, then the next.
  // Rows outside the operands are filled with zeros (source size 0, from a valid address).
  __device__ __forceinline__ void issue_async(unsigned stage) {
#pragma unroll
    for (int k = 0; k < HALVES; ++k) {
      const Chunk c = current_chunk(k);
#pragma unroll
      for (int i = 0; i < A_ITERS; ++i) {
        const bool inside = a_inside(c, i);
        const signed char* source = inside ? a_source(c, i) : w;
#pragma unroll
        for (int e = 0; e < VECTORS; ++e) cp_async_16(stage + a_slot(k, i, e), source + 16 * e, inside ? 16 : 0);
      }
#pragma unroll
      for (int i = 0; i < B_ITERS; ++i) {
        const bool inside = b_inside(c, i);
        const signed char* source = inside ? b_source(c, i) : x;
#pragma unroll
        for (int e = 0; e < VECTORS; ++e) cp_async_16(stage + b_slot(k, i, e), source + 16 * e, inside ? 16 : 0);
      }
    }
    advance();
  }

  // The register path (64-byte rows): the current step into registers (then the next step), and to a stage.
  __device__ __forceinline__ void fetch(int4 (&a_held)[A_HELD], int4 (&b_held)[B_ITERS]) {
    static_assert(HALVES == 1 && VECTORS == 1, "the register path holds one vector of a 64-byte step");
    const Chunk c = current_chunk(0);
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i)
      a_held[i] = a_inside(c, i) ? __ldg(reinterpret_cast<const int4*>(a_source(c, i))) : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i)
      b_held[i] = b_inside(c, i) ? __ldg(reinterpret_cast<const int4*>(b_source(c, i))) : make_int4(0, 0, 0, 0);
    advance();
  }
  __device__ __forceinline__ void store(char* stage, const int4 (&a_held)[A_HELD],
                                        const int4 (&b_held)[B_ITERS]) const {
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) *reinterpret_cast<int4*>(stage + a_slot(0, i)) = a_held[i];
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) *reinterpret_cast<int4*>(stage + b_slot(0, i)) = b_held[i];
  }
};

// Column j of GEMM_N as an output pixel: image, and rest = oh * OW + ow within it;
// false past GEMM_N.
struct GemmPixels {
  const ConvParams& p;
  __device__ __forceinline__ bool locate(int j, int& image, int& rest) const {
    if (j >= p.gemm_n) return false;
    image = p.ohw_multiplier ? static_cast<int>(fast_quotient(static_cast<unsigned>(j), p.ohw_multiplier, p.ohw_shift))
                             : j;
    rest = j - image * p.oh * p.ow;
    return true;
  }
};

// Column j of GEMM_N where B's rows came as rows of four pixels (conv2d_int8_fprop_tma,
// ROWS): pixel j ^ (j / 8 % 4) of GEMM_N (tiles start at multiples of 32 pixels).
struct RowsPixels {
  const ConvParams& p;
  __device__ __forceinline__ bool locate(int j, int& image, int& rest) const {
    return GemmPixels{p}.locate(j ^ ((j >> 3) & 3), image, rest);
  }
};

// The GEMM_N columns' pixels of a kernel: RowsPixels where B's rows came as rows of four.
template <bool ROWS>
struct PixelsOf {
  typedef GemmPixels type;
};
template <>
struct PixelsOf<true> {
  typedef RowsPixels type;
};

// The epilogue of one warp's accumulators through its 256 ints of shared memory
// `exchange`. acc[rb][nb][e] holds output channel channel0 + 8 rb + lane / 4,
// pixel pixel0 + 8 nb + 2 (lane & 3) + e: the C fragment of mma.sync m16n8 and of
// wgmma alike. A round moves 32 x 8 ints -- four 8-channel blocks of one 8-pixel
// block where the warp holds 32 channels or more (RB >= 4), two 8-channel blocks
// of two 8-pixel blocks where it holds 16 (wgmma: a warp owns 16 rows of 64) --
// so that each lane ends with 8 consecutive channels of one pixel. Int (row i,
// column c) sits at c * 32 + (i ^ swizzle(c)), conflict-free both ways.
// Pixels: which output pixel GEMM_N column j of the tile is (GemmPixels, HaloPixels).
template <int RB, int NB, typename Pixels>
__device__ __forceinline__ void conv_warp_epilogue(const int (&acc)[RB][NB][2], int* exchange, int channel0,
                                                   int pixel0, int split, const ConvParams& p, void* y,
                                                   const signed char* z, const float* alpha_vec, const void* bias,
                                                   const Pixels& pixels) {
  constexpr int ROW_BLOCKS = RB >= 4 ? 4 : RB;   // 8-channel blocks of a round
  constexpr int COL_BLOCKS = 4 / ROW_BLOCKS;      // 8-pixel blocks of a round
  static_assert(RB % ROW_BLOCKS == 0 && NB % COL_BLOCKS == 0 && (RB == 2 || RB % 4 == 0), "warp tile");
  const int lane = threadIdx.x & 31;
  const int group_id = lane >> 2, in_group = lane & 3;   // writer: accumulator coordinates
  const int pixel = lane >> 2, quarter = lane & 3;        // reader: pixel, channels 8 * quarter ..
  const int pixel_swizzle = conv_exchange_swizzle(pixel);
  const int ohw = p.oh * p.ow;
  const int64 split_offset = p.splits > 1 ? static_cast<int64>(split) * p.gemm_m * p.gemm_n : 0;
#pragma unroll
  for (int slice = 0; slice < RB / ROW_BLOCKS; ++slice) {
#pragma unroll
    for (int round = 0; round < NB / COL_BLOCKS; ++round) {
#pragma unroll
      for (int block = 0; block < 4; ++block) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int column = in_group * 2 + e, row = block * 8 + group_id;
          exchange[column * 32 + (row ^ conv_exchange_swizzle(column))] =
              acc[slice * ROW_BLOCKS + block % ROW_BLOCKS][round * COL_BLOCKS + block / ROW_BLOCKS][e];
        }
      }
      __syncwarp();
      const int4 low = *reinterpret_cast<const int4*>(exchange + pixel * 32 + ((quarter * 8) ^ pixel_swizzle));
      const int4 high = *reinterpret_cast<const int4*>(exchange + pixel * 32 + ((quarter * 8 + 4) ^ pixel_swizzle));
      __syncwarp();
      const int oc = channel0 + (slice * ROW_BLOCKS + quarter % ROW_BLOCKS) * 8;
      const int j = pixel0 + (round * COL_BLOCKS + quarter / ROW_BLOCKS) * 8 + pixel;
      int image, rest;
      if (oc < p.gemm_m && pixels.locate(j, image, rest)) {
        const int64 offset = (static_cast<int64>(image * p.k32 + (oc >> 5)) * ohw + rest) * 32 + (oc & 31);
        conv_epilogue_store_call(low, high, oc, offset + split_offset, p.epilogue, y, z, alpha_vec, bias);
      }
    }
  }
}

// One block's TM x TN tile of the convolution by mma.sync, warps of WM x WN.
// k32: m16n8k32 (else m8n8k16); async: a cp.async pipeline of `stages` (else two
// stages through registers). p.splits > 1 writes raw int32 partials, split z at
// z * GEMM_M * GEMM_N of y.
template <int TM, int TN, int WM, int WN, bool k32, int stages, bool async>
__device__ __forceinline__ void conv2d_int8_fprop(const signed char* __restrict__ x,
                                                  const signed char* __restrict__ w, void* y,
                                                  const signed char* z, const float* alpha_vec,
                                                  const void* bias, const ConvParams& p) {
  constexpr int WARPS_M = TM / WM;
  constexpr int THREADS = WARPS_M * (TN / WN) * 32;
  constexpr int KV = k32 ? 2 : 1;               // 16-byte k vectors an mma takes
  constexpr int MMA_STEPS = CONV_STEP_BYTES / (16 * KV);
  constexpr int A_FRAGS = WM / 8 * KV, B_FRAGS = WN / 8 * KV;
  constexpr int STAGE_BYTES = (TM + TN) * CONV_STEP_BYTES;
  static_assert(WM % 32 == 0 && WN % 8 == 0 && A_FRAGS % 4 == 0 && B_FRAGS % 4 == 0, "warp tile");
  static_assert(async || stages == 2, "the register pipeline has two stages");
  typedef ConvTileLoader<TM, TN, THREADS> Loader;
  extern __shared__ int4 conv_shared[];
  char* shared = reinterpret_cast<char*>(conv_shared);
  const unsigned shared_base = shared_address(shared);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = (warp % WARPS_M) * WM, warp_n = (warp / WARPS_M) * WN;
  const ConvTile tile = conv_tile<TM, TN>(p);
  const int steps = tile.steps;
  Loader loader(x, w, p, tile, threadIdx.x);

  int acc[WM / 8][WN / 8][2];
#pragma unroll
  for (int i = 0; i < WM / 8; ++i)
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) acc[i][j][0] = acc[i][j][1] = 0;

  auto compute = [&](int stage) {
    const unsigned a_tile = shared_base + stage * STAGE_BYTES;
    const unsigned b_tile = a_tile + TM * CONV_STEP_BYTES;
#pragma unroll
    for (int ks = 0; ks < MMA_STEPS; ++ks) {
      unsigned a[A_FRAGS], b[B_FRAGS];   // [8-row block][k vector]
#pragma unroll
      for (int c = 0; c < A_FRAGS / 4; ++c) {
        const int index = c * 4 + (lane >> 3);
        ldmatrix_x4(a + c * 4, a_tile + conv_tile_offset<>(warp_m + index / KV * 8 + (lane & 7),
                                                         ks * KV + index % KV));
      }
#pragma unroll
      for (int c = 0; c < B_FRAGS / 4; ++c) {
        const int index = c * 4 + (lane >> 3);
        ldmatrix_x4(b + c * 4, b_tile + conv_tile_offset<>(warp_n + index / KV * 8 + (lane & 7),
                                                         ks * KV + index % KV));
      }
#pragma unroll
      for (int mi = 0; mi < WM / (8 * KV); ++mi) {
#pragma unroll
        for (int ni = 0; ni < WN / 8; ++ni) {
          if constexpr (k32) {
            const unsigned a_frag[4] = {a[4 * mi], a[4 * mi + 2], a[4 * mi + 1], a[4 * mi + 3]};
            int d[4] = {acc[2 * mi][ni][0], acc[2 * mi][ni][1], acc[2 * mi + 1][ni][0], acc[2 * mi + 1][ni][1]};
            mma_m16n8k32_s8(d, a_frag, b + 2 * ni);
            acc[2 * mi][ni][0] = d[0];
            acc[2 * mi][ni][1] = d[1];
            acc[2 * mi + 1][ni][0] = d[2];
            acc[2 * mi + 1][ni][1] = d[3];
          } else {
            mma_m8n8k16_s8(acc[mi][ni], a + mi, b + ni);
          }
        }
      }
    }
  };

  if constexpr (async) {
#pragma unroll
    for (int s = 0; s < stages - 1; ++s) {
      if (s < steps) loader.issue_async(shared_base + s * STAGE_BYTES);
      cp_async_commit();
    }
    for (int t = 0; t < steps; ++t) {
      cp_async_wait<stages - 2>();
      __syncthreads();
      if (t + stages - 1 < steps) loader.issue_async(shared_base + (t + stages - 1) % stages * STAGE_BYTES);
      cp_async_commit();
      compute(t % stages);
    }
    cp_async_wait<0>();
  } else {
    int4 a_held[Loader::A_ITERS], b_held[Loader::B_ITERS];
    loader.fetch(a_held, b_held);
    loader.store(shared, a_held, b_held);
    __syncthreads();
    for (int t = 0; t < steps; ++t) {
      if (t + 1 < steps) loader.fetch(a_held, b_held);
      compute(t & 1);
      if (t + 1 < steps) loader.store(shared + ((t + 1) & 1) * STAGE_BYTES, a_held, b_held);
      __syncthreads();
    }
  }
  __syncthreads();   // every warp is done with the pipeline's shared memory
  conv_warp_epilogue(acc, reinterpret_cast<int*>(shared) + warp * 256, tile.m0 + warp_m, tile.n0 + warp_n, tile.split,
                     p, y, z, alpha_vec, bias, GemmPixels{p});
}

// Whether a call's epilogue may take conv_warpgroup_epilogue_s8: int8 out, no z, no split.
__device__ __forceinline__ bool tile_epilogue_s8(const ConvParams& p) {
  return p.epilogue.out_kind == CONV_OUT_S8 && !p.epilogue.has_z && p.splits == 1;
}

// Whether a warpgroup whose threads hold WN / 2 accumulators and may use REGISTERS
// registers has room for an int8 epilogue beside conv_warp_epilogue (conv_warpgroup_epilogue_s8,
// kernels/conv_halo.cuh's conv_halo_epilogue_s8): about 48 past the accumulators (ptxas,
// before warp-specialised kernels moved registers to their consumers: 64 x 512 halo tiles,
// 40 to spare, spilled with both; 64 x 448 ones, 56 to spare, did not). The other kernels
// keep the exchange alone.
template <int WN, int REGISTERS>
__device__ __forceinline__ constexpr bool warpgroup_epilogue_fits() {
  return WN / 2 + 48 <= REGISTERS;
}

// Registers a thread of a block of THREADS threads holds at launch (ptxas: 65536 /
// THREADS in steps of 8, at most 255).
template <int THREADS>
__device__ __forceinline__ constexpr int block_registers() {
  return 65536 / THREADS / 8 * 8 < 255 ? 65536 / THREADS / 8 * 8 : 255;
}

// A warp-specialised kernel's registers: its CONSUMERS consumer warpgroups (accumulators
// and epilogue) take all but KEEP of the block's registers a thread of each warpgroup, in
// steps of 8, at most 240 each; the producer warpgroup (copies and their addresses) keeps
// the rest, KEEP or a few more (ptxas: the cp.async producers spill below 32 or 40, the
// halo tiles' below 56).
template <int CONSUMERS, int KEEP>
struct WsRegisters {   // functions, not constants: NVRTC would emit static members as globals
  static __device__ __forceinline__ constexpr int block() { return block_registers<(CONSUMERS + 1) * 128>(); }
  static __device__ __forceinline__ constexpr int pool() { return block() * (CONSUMERS + 1); }
  static __device__ __forceinline__ constexpr int share() { return (pool() - KEEP) / CONSUMERS / 8 * 8; }
  static __device__ __forceinline__ constexpr int consumer() { return share() < 240 ? share() : 240; }
  static __device__ __forceinline__ constexpr int producer() { return pool() - CONSUMERS * consumer(); }

  // The move (setmaxnreg, sm_90a), where it gives the consumers more: every thread of a
  // warpgroup runs the one of its role (a consumer's waits for the producer's).
  static __device__ __forceinline__ void take(bool is_producer) {
    if constexpr (consumer() > block()) {
      if (is_producer) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(producer()));
      } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(consumer()));
      }
    }
  }
};

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The int8 epilogue of a wgmma warpgroup's 64 x WN accumulators, CHUNK pixels at a time
// through its (at most) 4 KB of shared memory `buffer`, laid out as the output's NCHW32 rows
// ([channel group][pixel][32 channels]): each thread converts its accumulators where they
// lie (its two channels' alpha and beta * bias read once) and stores each byte at its
// place; then the warpgroup's 128 threads copy the chunk out in 16-byte vectors,
// consecutive threads consecutive vectors of a pixel run. A byte costs the conversion
// and one shared store, against the exchange's int store, read and per-pixel addressing
// (conv_warp_epilogue). Channels from channel0 (a multiple of 64), GEMM_N columns from
// pixel0 (Pixels: GemmPixels, HaloPixels); `barrier`: the warpgroup's named barrier.
template <int WN, typename Pixels>
__device__ __forceinline__ void conv_warpgroup_epilogue_s8(const int (&acc)[2][WN / 8][2], signed char* buffer,
                                                           int channel0, int pixel0, const ConvParams& p,
                                                           signed char* y, const float* alpha_vec, const void* bias,
                                                           const Pixels& pixels, int barrier) {
  // 64 rows x CHUNK pixels (at most 4 KB): the most of 64, 32, 16, 8 that divides WN
  constexpr int CHUNK = WN % 64 == 0 ? 64 : WN % 32 == 0 ? 32 : WN % 16 == 0 ? 16 : 8;
  static_assert(WN % CHUNK == 0, "whole chunks");
  const int thread = threadIdx.x & 127, lane = threadIdx.x & 31, warp_row = 16 * ((threadIdx.x >> 5) & 3);
  const int low = p.epilogue.relu ? 0 : -128;
  float alpha[2], shift[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {   // rows lane / 4 and lane / 4 + 8 of the warp's 16
    const int channel = channel0 + warp_row + (lane >> 2) + 8 * h;
    alpha[h] = shift[h] = 0.f;   // rows past GEMM_M: stored, never copied out
    if (channel < p.gemm_m) {
      alpha[h] = conv_alpha(p.epilogue, alpha_vec, channel);
      shift[h] = p.epilogue.beta * conv_bias(p.epilogue, bias, channel);
    }
  }
  signed char* base = buffer + (warp_row >> 5) * CHUNK * 32 + 2 * (lane & 3) * 32 + (warp_row & 31) + (lane >> 2);
  const int ohw = p.oh * p.ow;
#pragma unroll
  for (int chunk = 0; chunk < WN / CHUNK; ++chunk) {
    named_barrier_sync(barrier, 128);   // the chunk before is copied out (or the tile before's)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int b = 0; b < CHUNK / 8; ++b) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {   // pixel 8 b + 2 (lane & 3) + e of the chunk
          const float value = fmaf(alpha[h], static_cast<float>(acc[h][chunk * CHUNK / 8 + b][e]), shift[h]);
          base[8 * h + 256 * b + 32 * e] = static_cast<signed char>(min(127, max(low, __float2int_rn(value))));
        }
      }
    }
    named_barrier_sync(barrier, 128);
    const int4* source = reinterpret_cast<const int4*>(buffer);
#pragma unroll
    for (int v = thread; v < 2 * CHUNK * 2; v += 128) {   // 16-byte vectors, two a pixel
      const int group = v / (CHUNK * 2), pixel = (v >> 1) % CHUNK;
      const int group_out = (channel0 >> 5) + group;
      int image, rest;
      if (group_out < p.k32 && pixels.locate(pixel0 + chunk * CHUNK + pixel, image, rest)) {
        const int64 offset = (static_cast<int64>(image * p.k32 + group_out) * ohw + rest) * 32 + (v & 1) * 16;
        *reinterpret_cast<int4*>(y + offset) = source[v];
      }
    }
  }
}

// A wgmma warpgroup's epilogue through each warp's 1 KB exchange (conv_warp_epilogue; the
// warp's 16 rows of the warpgroup's 64): buffer, the warpgroup's 4 KB.
template <int WN, typename Pixels>
__device__ __forceinline__ void conv_wgmma_exchange_epilogue(const int (&acc)[2][WN / 8][2], signed char* buffer,
                                                             int channel0, int pixel0, int split, const ConvParams& p,
                                                             void* y, const signed char* z, const float* alpha_vec,
                                                             const void* bias, const Pixels& pixels) {
  const int warp = (threadIdx.x >> 5) & 3;
  conv_warp_epilogue(acc, reinterpret_cast<int*>(buffer) + warp * 256, channel0 + warp * 16, pixel0, split, p, y, z,
                     alpha_vec, bias, pixels);
}

// A wgmma warpgroup's epilogue: by warpgroup (conv_warpgroup_epilogue_s8) where the call
// and the warpgroup's registers (REGISTERS a thread) allow it, else through each warp's 1 KB
// exchange (conv_warp_epilogue). buffer: the warpgroup's 4 KB, its four warps' exchanges.
template <int WN, int REGISTERS, typename Pixels>
__device__ __forceinline__ void conv_wgmma_epilogue(const int (&acc)[2][WN / 8][2], signed char* buffer,
                                                    int channel0, int pixel0, int split, const ConvParams& p,
                                                    void* y, const signed char* z, const float* alpha_vec,
                                                    const void* bias, const Pixels& pixels, int warpgroup) {
  if (warpgroup_epilogue_fits<WN, REGISTERS>() && tile_epilogue_s8(p)) {
    conv_warpgroup_epilogue_s8<WN>(acc, buffer, channel0, pixel0, p, static_cast<signed char*>(y), alpha_vec, bias,
                                   pixels, 1 + warpgroup);
  } else {
    conv_wgmma_exchange_epilogue<WN>(acc, buffer, channel0, pixel0, split, p, y, z, alpha_vec, bias, pixels);
  }
}

// One block's TM x TN tile by wgmma (sm_90a): warpgroups of 64 x WN (TM / 64 of
// them along GEMM_M, TN / WN along GEMM_N), each issuing m64nWNk32 with A and B
// from the shared stages, which every thread fills by cp.async (the loader above).
// A stage holds ROW_BYTES of GEMM_K per row (64: 64B swizzle, two k32 MMAs; 128:
// 128B swizzle, four, half the barriers and waits per MMA). Pipeline of `stages`,
// loads DEPTH = stages - 2 stages ahead, one wgmma group (a stage) in flight per
// warpgroup.
//
// Invariant. Iteration t: (1) cp.async.wait: this thread's copies of stage t have
// landed; (2) fence.proxy.async: they are visible to the async proxy that wgmma
// reads through; (3) barrier: so are every thread's, and every warpgroup has
// passed its wgmma.wait_group 1 of iteration t - 1, i.e. its wgmma of steps
// <= t - 2 are complete; (4) wgmma of stage t % stages, committed as one group;
// (5) cp.async of step t + DEPTH into stage (t + DEPTH) % stages = (t - 2) % stages,
// last read by step t - 2's wgmma, complete in every warpgroup by (3); stage
// (t - 1) % stages, which step t - 1's wgmma may still read, is not written;
// (6) wgmma.wait_group 1: step t - 1's group is complete. Stages in use at once:
// t - 1, t and the DEPTH loading ahead = stages.
template <int TM, int TN, int WN, int stages, int ROW_BYTES>
__device__ __forceinline__ void conv2d_int8_fprop_wgmma(const signed char* __restrict__ x,
                                                        const signed char* __restrict__ w, void* y,
                                                        const signed char* z, const float* alpha_vec,
                                                        const void* bias, const ConvParams& p) {
  constexpr int WARPGROUPS_M = TM / 64;
  constexpr int THREADS = WARPGROUPS_M * (TN / WN) * 128;
  constexpr int STAGE_BYTES = (TM + TN) * ROW_BYTES;
  constexpr int DEPTH = stages - 2;
  // A thread copies whole 32-byte chunks where the tiles' rows divide among half the threads.
  constexpr int VECTORS = TM % (THREADS / 2) == 0 && TN % (THREADS / 2) == 0 ? 2 : 1;
  typedef ConvTileLoader<TM, TN, THREADS, ROW_BYTES, VECTORS> Loader;
  static_assert(TM % 64 == 0 && TN % WN == 0 && WN % 16 == 0 && WN <= 256, "warpgroup tile");
  static_assert(stages >= 3, "one stage read by wgmma in flight, one being read, one loading");
  static_assert(STAGE_BYTES % 1024 == 0, "stages keep the 1024-byte alignment of the first");
  extern __shared__ int4 conv_shared[];
  // Descriptors address the swizzle pattern by shared address bits: the stages
  // start on a 1024-byte boundary (the host adds 1024 bytes of slack).
  const unsigned raw_base = shared_address(conv_shared);
  const unsigned shared_base = (raw_base + 1023u) & ~1023u;
  signed char* exchange_base = reinterpret_cast<signed char*>(conv_shared) + (shared_base - raw_base);

  // The warpgroup from lane 0: the compiler then knows it (and the descriptors) warp-uniform
  // and builds the descriptors in uniform registers, which wgmma reads.
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0);
  const int wg_m = (warpgroup % WARPGROUPS_M) * 64, wg_n = (warpgroup / WARPGROUPS_M) * WN;
  const ConvTile tile = conv_tile<TM, TN>(p);
  const int steps = (tile.steps + Loader::HALVES - 1) / Loader::HALVES;   // stages of this split
  Loader loader(x, w, p, tile, threadIdx.x);

  int acc[2][WN / 8][2];
  zero_accumulators(acc);

#pragma unroll
  for (int s = 0; s < DEPTH; ++s) {
    if (s < steps) loader.issue_async(shared_base + s * STAGE_BYTES);
    cp_async_commit();
  }
  // This warpgroup's operands in stage 0; those of stage s and of k32 slice k
  // are the same descriptors moved by s * STAGE_BYTES + 32 k bytes.
  const unsigned long long a_descriptor = wgmma_descriptor<ROW_BYTES>(shared_base + wg_m * ROW_BYTES);
  const unsigned long long b_descriptor = wgmma_descriptor<ROW_BYTES>(shared_base + (TM + wg_n) * ROW_BYTES);
  constexpr unsigned LAST_STAGE = (stages - 1) * STAGE_BYTES;
  unsigned stage = 0, load_stage = DEPTH * STAGE_BYTES;   // offsets of stages t % stages, (t + DEPTH) % stages
  for (int t = 0; t < steps; ++t) {
    cp_async_wait<DEPTH - 1>();
    fence_proxy_async_shared();
    __syncthreads();
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < ROW_BYTES / 32; ++k) {
      const unsigned units = (stage >> 4) + k * 2;   // 32 k bytes further: no shift per MMA
      WgmmaS8<WN>::mma(acc, wgmma_descriptor_moved(a_descriptor, units), wgmma_descriptor_moved(b_descriptor, units));
    }
    wgmma_commit();
    wgmma_fence_operands(acc);
    if (t + DEPTH < steps) loader.issue_async(shared_base + load_stage);
    cp_async_commit();
    stage = stage == LAST_STAGE ? 0 : stage + STAGE_BYTES;
    load_stage = load_stage == LAST_STAGE ? 0 : load_stage + STAGE_BYTES;
    wgmma_wait<1>();
    wgmma_fence_operands(acc);
  }
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
  cp_async_wait<0>();
  __syncthreads();   // every warpgroup is done with the pipeline's shared memory
  static_assert(THREADS * 32 <= stages * STAGE_BYTES, "4 KB a warpgroup in the stages");
  conv_wgmma_epilogue<WN, block_registers<THREADS>()>(acc, exchange_base + warpgroup * 4096, tile.m0 + wg_m,
                                                      tile.n0 + wg_n, tile.split, p, y, z, alpha_vec, bias,
                                                      GemmPixels{p}, warpgroup);
}

// A consumer warpgroup of a warp-specialised kernel: its origin in the block's tile
// (warpgroups TM / 64 along GEMM_M, then along GEMM_N) and its 4 KB for the epilogue
// (its warps' exchanges), `offset` bytes past the stages' start, `skip` bytes into the
// dynamic shared memory.
struct WsConsumer {
  int wg_m, wg_n;
  signed char* exchange;
};
template <int TM, int WN>
__device__ __forceinline__ WsConsumer ws_consumer(int4* dynamic, unsigned skip, int offset, int warpgroup) {
  return WsConsumer{(warpgroup % (TM / 64)) * 64, (warpgroup / (TM / 64)) * WN,
                    reinterpret_cast<signed char*>(dynamic) + skip + offset + warpgroup * 4096};
}

// A warp-specialised kernel's barriers: full[s] (full_arrivals a phase) then empty[s]
// (one arrival a consumer warpgroup), initialised by thread 0 before the block syncs.
// In a cluster of CLUSTER blocks sharing the stages' filter rows (multicast), empty[s]
// counts the consumer warpgroups of every block, and every block of the cluster has
// initialised its barriers before any block's copies or arrivals reach them.
template <int stages, int CLUSTER = 1>
__device__ __forceinline__ void ws_barriers_init(unsigned full, unsigned full_arrivals, unsigned consumers) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(full + 8 * s, full_arrivals);
      mbarrier_init(full + 8 * (stages + s), consumers * CLUSTER);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if constexpr (CLUSTER > 1) cluster_sync();
}

// A consumer warpgroup's release of a stage, by its threads 0 .. CLUSTER - 1 at once:
// thread r's arrival on the stage's empty barrier in block r of the cluster (each
// block's producer may refill it, its copies multicast).
template <int CLUSTER>
__device__ __forceinline__ void ws_release(unsigned empty_stage) {
  const int thread = threadIdx.x & 127;
  if constexpr (CLUSTER == 1) {
    if (thread == 0) mbarrier_arrive(empty_stage);
  } else {
    if (thread < CLUSTER) mbarrier_arrive_cluster(empty_stage, thread);
  }
}

// What a warp-specialised kernel sets up first: the dynamic shared memory, its stages'
// start (the first 1024-byte boundary, `skip` bytes in), the full and empty barriers of
// ws_barriers_init and the thread's warpgroup (from lane 0: the compiler then knows it,
// and the descriptors, warp-uniform).
struct WsBlock {
  int4* dynamic;
  unsigned shared_base, skip, full, empty;
  int warpgroup;
};
template <int stages>
__device__ __forceinline__ WsBlock ws_block() {
  extern __shared__ int4 conv_shared[];
  __shared__ unsigned long long barriers[2 * stages];   // full[s], then empty[s]
  const unsigned raw_base = shared_address(conv_shared);
  const unsigned shared_base = (raw_base + 1023u) & ~1023u;
  const unsigned full = shared_address(barriers);
  return WsBlock{conv_shared, shared_base, shared_base - raw_base, full, full + 8 * stages,
                 __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0)};
}

// A consumer warpgroup's end of round `round` (the `index`-th of its tile): its wgmma
// group committed, the group before complete, whose stage is then released.
template <int stages, int CLUSTER = 1, int ROWS, int COLS>
__device__ __forceinline__ void ws_round_issued(int (&acc)[ROWS][COLS][2], unsigned empty, unsigned round,
                                                int index) {
  wgmma_commit();
  wgmma_fence_operands(acc);
  wgmma_wait<1>();
  wgmma_fence_operands(acc);
  // The group of the round before is complete in this warpgroup: its stage may be loaded again.
  if (index > 0) ws_release<CLUSTER>(empty + 8 * ((round - 1) % stages));
}

// A consumer warpgroup's end of a tile: every group complete, the last stage released.
template <int stages, int CLUSTER = 1, int ROWS, int COLS>
__device__ __forceinline__ void ws_tile_done(int (&acc)[ROWS][COLS][2], unsigned empty, unsigned round) {
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
  ws_release<CLUSTER>(empty + 8 * ((round - 1) % stages));
}

// Job `job` of a warp-specialised kernel (tile job % tiles of split job / tiles) as
// this block takes it: in a cluster of CLUSTER blocks side by side along GEMM_N, rank's
// GEMM_N tile; in a cluster of KSPLIT blocks on one tile, rank's share of the split's
// GEMM_K steps (ceil(steps / KSPLIT) each, the last ones maybe fewer or none).
template <int TM, int TN, int CLUSTER, int KSPLIT>
__device__ __forceinline__ ConvTile ws_tile(const ConvParams& p, int job, int tiles, int rank) {
  ConvTile tile = conv_tile_of<TM, TN, CLUSTER>(p, job % tiles, job / tiles, CLUSTER > 1 ? rank : 0);
  if constexpr (KSPLIT > 1) {
    const int share = (tile.steps + KSPLIT - 1) / KSPLIT;
    const int begin = min(tile.steps, rank * share);
    tile.step_begin += begin;
    tile.steps = min(tile.steps - begin, share);
  }
  return tile;
}

// The KSPLIT blocks of a cluster that split a tile's GEMM_K sum their accumulators in
// distributed shared memory: warpgroup w's tile part belongs to block w * KSPLIT /
// CONSUMERS, which adds the other blocks' and runs the epilogue (returns true there).
// Once every consumer of the block is done with the stages (named barrier), each
// warpgroup writes the accumulators it does not own into the stages, a thread's 16-byte
// vectors 2 KB apart (consecutive threads, consecutive vectors: no bank conflict); after
// the cluster barrier the owners read them from the other blocks, at the same offsets.
// Every thread of every block takes part in the barrier (the producer's in the kernel).
template <int CONSUMERS, int KSPLIT, int WN>
__device__ __forceinline__ bool ws_cluster_sum(int (&acc)[2][WN / 8][2], int4* stages, int warpgroup, int rank) {
  static_assert(WN % 16 == 0, "whole 16-byte vectors of accumulators");
  constexpr int VECTORS = WN / 8;   // a thread's WN / 2 accumulators
  const int owner = warpgroup * KSPLIT / CONSUMERS;
  int4* slots = stages + warpgroup * VECTORS * 128 + (threadIdx.x & 127);
  named_barrier_sync(CONSUMERS + 1, CONSUMERS * 128);
  if (owner != rank) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int b = 0; b < WN / 8; b += 2) {
        slots[(h * VECTORS / 2 + b / 2) * 128] =
            make_int4(acc[h][b][0], acc[h][b][1], acc[h][b + 1][0], acc[h][b + 1][1]);
      }
    }
  }
  cluster_sync();
  if (owner != rank) return false;
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(slots));
#pragma unroll
  for (int other = 0; other < KSPLIT; ++other) {
    if (other == rank) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int b = 0; b < WN / 8; b += 2) {
        const int4 v = load_int4_from_rank(local + (h * VECTORS / 2 + b / 2) * 128 * 16, other);
        acc[h][b][0] += v.x;
        acc[h][b][1] += v.y;
        acc[h][b + 1][0] += v.z;
        acc[h][b + 1][1] += v.w;
      }
    }
  }
  return true;
}

// One block's TM x TN tile by wgmma (sm_90a), warp-specialised: TM / 64 x TN / WN
// consumer warpgroups issue the MMAs, one producer warpgroup fills the stages. The
// copy engine brings A, a 2-D tiled copy of the packed filter. B comes either
// (CONV_PIXELS_IM2COL) from the copy engine too, an im2col copy per 32-channel chunk --
// the engine walks TN pixels from the tile's first, adds the chunk's tap offsets, and
// fills padding and rows past GEMM_N with zeros; the input map is 5-D (c, w, h,
// image, channel group) so that the walk goes from one image to the next within a
// group (cupyops/ops/conv_tma.py) -- or from the producer's 128 threads by
// cp.async (the loader above, B rows alone), or (ROWS: 1x1 filters, stride 1, no
// padding, each image a whole number of tiles) from the copy engine in rows of four
// pixels: a tiled copy of TN / 4 rows of 128 bytes of one image's channel group
// (conv_tma.py), four times the bytes a request of the im2col's 32-byte pixels. Its
// 128-byte swizzle leaves each pixel where the 32-byte swizzle wgmma reads would, but
// pixel q of each row of four in slot q ^ (row / 2 % 4): B's rows are the tile's pixels
// in that order, which the epilogue undoes (RowsPixels).
// A stage holds ROW_BYTES of GEMM_K for the TM + TN rows: with the engine's pixels, as
// ROW_BYTES / 32 chunks each [A (TM x 32 bytes) | B (TN x 32 bytes)] in the 32-byte swizzle;
// else as A (TM x ROW_BYTES) then B (TN x ROW_BYTES) in the ROW_BYTES swizzle.
// KSPLIT > 1: a cluster of KSPLIT blocks on each tile, one tile a cluster (the grid holds
// them all: the blocks sum their accumulators in the stages), each block a share of
// GEMM_K (ws_tile, ws_cluster_sum).
// Barriers: full[s] is armed by the producer's first thread with the copy engine's
// bytes and completed by its copies (and, for cp.async, by each producer thread's
// copies: cp.async.mbarrier.arrive.noinc); empty[s] completes when every consumer
// warpgroup has finished its wgmma on the stage. A consumer keeps one stage's wgmma
// group in flight and releases the stage before it.
template <int TM, int TN, int WN, int stages, int ROW_BYTES, int PIXELS, int CLUSTER, int KSPLIT>
__device__ __forceinline__ void conv2d_int8_fprop_tma(const TensorMap& filter_map, const TensorMap& input_map,
                                                      const signed char* x, void* y, const signed char* z,
                                                      const float* alpha_vec, const void* bias, const ConvParams& p) {
  constexpr int CONSUMERS = (TM / 64) * (TN / WN), PRODUCERS = 128;
  // the copy engine brings the pixels (im2col copies or rows of four), else the producer's threads
  constexpr bool ENGINE_PIXELS = PIXELS != CONV_PIXELS_CPASYNC, ROWS = PIXELS == CONV_PIXELS_ROWS;
  constexpr int A_SHARE_ROWS = TM / CLUSTER;   // filter rows a block of the cluster copies for all of them
  constexpr int CHUNKS = ROW_BYTES / 32;
  constexpr int DESCRIPTOR_ROW = ENGINE_PIXELS ? 32 : ROW_BYTES;          // bytes a row of a descriptor's tile
  constexpr int SLICE_STRIDE = ENGINE_PIXELS ? (TM + TN) * 32 : 32;       // from one k32 slice to the next
  constexpr int STAGE_BYTES = (TM + TN) * ROW_BYTES;
  constexpr int A_COPY_BYTES = ENGINE_PIXELS ? TM * 32 : TM * ROW_BYTES;  // one copy of the filter
  // The producers copy 32-byte chunks where a tile's rows divide among half of them, else 16 bytes.
  typedef ConvTileLoader<TM, TN, PRODUCERS, ROW_BYTES, TN % (PRODUCERS / 2) == 0 ? 2 : 1, false> Loader;
  static_assert(TM % 64 == 0 && TN % WN == 0 && WN % 8 == 0 && WN <= 256 && TN <= 256, "warpgroup tile");
  static_assert(ROW_BYTES == 64 || ROW_BYTES == 128, "stages of 64 or 128 GEMM_K bytes");
  static_assert(TN % 8 == 0 && STAGE_BYTES % 1024 == 0, "stages keep the 1024-byte alignment of the first");
  static_assert(!ROWS || (A_COPY_BYTES % 1024 == 0 && SLICE_STRIDE % 1024 == 0),
                "rows of pixels land in whole 128-byte swizzle patterns");
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && !ENGINE_PIXELS && A_SHARE_ROWS * ROW_BYTES % 1024 == 0),
                "pairs share the filter's copies (copied by the engine alone), in whole swizzle patterns");
  static_assert(KSPLIT == 1 || (CLUSTER == 1 && !ENGINE_PIXELS && CONSUMERS * 128 * WN * 2 <= stages * STAGE_BYTES),
                "a cluster splits GEMM_K alone, its producers' threads all in its barriers, its sums in the stages");
  constexpr int BLOCKS = CLUSTER * KSPLIT;   // a cluster's, on one job
  const auto [conv_shared, shared_base, skip, full, empty, warpgroup] = ws_block<stages>();
  // tiles of a split: a cluster's CLUSTER GEMM_N tiles side by side count as one
  const int tiles = (p.gemm_m + TM - 1) / TM * ((p.gemm_n + TN * CLUSTER - 1) / (TN * CLUSTER));
  const int rank = BLOCKS > 1 ? static_cast<int>(cluster_rank()) : 0;
  ws_barriers_init<stages, CLUSTER>(full, ENGINE_PIXELS ? 1 : 1 + PRODUCERS, CONSUMERS);
  typedef WsRegisters<CONSUMERS, 32> Registers;
  Registers::take(warpgroup == CONSUMERS);

  // Persistent: block (cluster) b takes tiles b, b + gridDim.x, ... of every split, and
  // the rounds (stages' uses) run on across them, so the producer fills the next tile's
  // stages while the consumers store the last one's. A cluster's blocks walk the same
  // tiles' GEMM_K in step: each copies its share of the filter rows into every block's
  // stage (multicast), which each block's empty barrier lets it refill only once the
  // consumers of every block have released it.
  if (warpgroup == CONSUMERS) {   // the producer
    const int thread = threadIdx.x - CONSUMERS * 128;
    if (ENGINE_PIXELS && thread != 0) return;
    unsigned round = 0;
    for (int job = blockIdx.x / BLOCKS; job < tiles * p.splits; job += gridDim.x / BLOCKS) {
      const ConvTile tile = ws_tile<TM, TN, CLUSTER, KSPLIT>(p, job, tiles, rank);
      const int chunk_begin = 2 * tile.step_begin, chunks = tile.chunks(p);
      const int ohw = p.oh * p.ow;
      const int image = tile.n0 / ohw, rest = tile.n0 - image * ohw;
      const int oh = rest / p.ow, ow = rest - oh * p.ow;
      const int w0 = ow * p.stride_w - p.pad_w, h0 = oh * p.stride_h - p.pad_h;
      int group = chunk_begin / p.taps, tap = chunk_begin - group * p.taps, chunk = chunk_begin;
      Loader loader(x, nullptr, p, tile, thread);
      for (int t = 0; t * CHUNKS < chunks; ++t, ++round) {
        const unsigned s = round % stages;
        if (round >= stages) mbarrier_wait(empty + 8 * s, ((round / stages) + 1) & 1);
        const unsigned stage = shared_base + s * STAGE_BYTES;
        if (ENGINE_PIXELS) {
          const int valid = min(CHUNKS, chunks - t * CHUNKS);
          mbarrier_arrive_expect_tx(full + 8 * s, valid * (TM + TN) * 32);
#pragma unroll
          for (int k = 0; k < CHUNKS; ++k) {
            if (k < valid) {
              tma_load_2d(stage + k * SLICE_STRIDE, filter_map, chunk * 32, tile.m0, full + 8 * s);
              if constexpr (ROWS) {
                tma_load_4d(stage + k * SLICE_STRIDE + A_COPY_BYTES, input_map, 0, rest / 4, group, image,
                            full + 8 * s);
              } else {
                tma_load_im2col_5d(stage + k * SLICE_STRIDE + A_COPY_BYTES, input_map, 0, w0, h0, image, group,
                                   static_cast<unsigned short>(p.tap_dw[tap]),
                                   static_cast<unsigned short>(p.tap_dh[tap]), 0, full + 8 * s);
              }
              ++chunk;
              if (++tap == p.taps) {
                tap = 0;
                ++group;
              }
            }
          }
        } else {
          // Filter bytes past GEMM_K (or GEMM_M) are zeros; past the split, B's rows are.
          if (thread == 0) {   // the whole filter tile lands in every block of the cluster
            mbarrier_arrive_expect_tx(full + 8 * s, A_COPY_BYTES);
            if constexpr (CLUSTER == 1) {
              tma_load_2d(stage, filter_map, (chunk_begin + t * CHUNKS) * 32, tile.m0, full + 8 * s);
            } else {
              tma_load_2d_multicast(stage + rank * A_SHARE_ROWS * ROW_BYTES, filter_map,
                                    (chunk_begin + t * CHUNKS) * 32, tile.m0 + rank * A_SHARE_ROWS, full + 8 * s,
                                    (1u << CLUSTER) - 1);
            }
          }
          loader.issue_async(stage);
          cp_async_mbarrier_arrive_noinc(full + 8 * s);
        }
      }
    }
    if constexpr (KSPLIT > 1) cluster_sync();   // the consumers' ws_cluster_sum
    if constexpr (BLOCKS > 1) cluster_sync_before_exit();   // no block leaves while copies, arrivals, reads reach it
    return;
  }

  const auto [wg_m, wg_n, exchange] =
      ws_consumer<TM, WN>(conv_shared, skip, stages * STAGE_BYTES, warpgroup);
  const unsigned long long a_descriptor = wgmma_descriptor<DESCRIPTOR_ROW>(shared_base + wg_m * DESCRIPTOR_ROW);
  const unsigned long long b_descriptor =
      wgmma_descriptor<DESCRIPTOR_ROW>(shared_base + (TM + wg_n) * DESCRIPTOR_ROW);
  unsigned round = 0;
  for (int job = blockIdx.x / BLOCKS; job < tiles * p.splits; job += gridDim.x / BLOCKS) {
    const ConvTile tile = ws_tile<TM, TN, CLUSTER, KSPLIT>(p, job, tiles, rank);
    const int chunks = tile.chunks(p);
    int acc[2][WN / 8][2];
    zero_accumulators(acc);
    for (int t = 0; t * CHUNKS < chunks; ++t, ++round) {
      const unsigned s = round % stages;
      mbarrier_wait(full + 8 * s, (round / stages) & 1);
      if (!ENGINE_PIXELS) fence_proxy_async_shared();   // cp.async's writes, seen through the barrier, to wgmma
      const int valid = min(CHUNKS, chunks - t * CHUNKS);
      wgmma_fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        if (k < valid) {
          const unsigned units = (s * STAGE_BYTES + k * SLICE_STRIDE) >> 4;
          WgmmaS8<WN>::mma(acc, wgmma_descriptor_moved(a_descriptor, units),
                           wgmma_descriptor_moved(b_descriptor, units));
        }
      }
      ws_round_issued<stages, CLUSTER>(acc, empty, round, t);
    }
    if (KSPLIT == 1 || chunks > 0) ws_tile_done<stages, CLUSTER>(acc, empty, round);   // a share may be empty
    if constexpr (KSPLIT > 1) {
      int4* stages_start = reinterpret_cast<int4*>(reinterpret_cast<char*>(conv_shared) + skip);
      if (!ws_cluster_sum<CONSUMERS, KSPLIT, WN>(acc, stages_start, warpgroup, rank)) continue;
    }
    conv_wgmma_epilogue<WN, Registers::consumer()>(acc, exchange, tile.m0 + wg_m, tile.n0 + wg_n, tile.split, p, y, z,
                                                   alpha_vec, bias, typename PixelsOf<ROWS>::type{p}, warpgroup);
  }
  if constexpr (BLOCKS > 1) cluster_sync_before_exit();
}

// Sums the p.splits int32 partials of split-K and applies the epilogue: each
// thread takes 8 consecutive elements (channels) of the NCHW32 output.
__device__ __forceinline__ void conv2d_int8_split_reduce(const int* __restrict__ partials, void* y,
                                                         const signed char* z, const float* alpha_vec,
                                                         const void* bias, const ConvParams& p) {
  const int64 elements = static_cast<int64>(p.gemm_m) * p.gemm_n;
  const int64 ohw = static_cast<int64>(p.oh) * p.ow;
  for (int64 e = (static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; e < elements;
       e += static_cast<int64>(gridDim.x) * blockDim.x * 8) {
    int4 sum_low = make_int4(0, 0, 0, 0), sum_high = make_int4(0, 0, 0, 0);
    for (int s = 0; s < p.splits; ++s) {
      const int4* src = reinterpret_cast<const int4*>(partials + s * elements + e);
      const int4 low = src[0], high = src[1];
      sum_low.x += low.x; sum_low.y += low.y; sum_low.z += low.z; sum_low.w += low.w;
      sum_high.x += high.x; sum_high.y += high.y; sum_high.z += high.z; sum_high.w += high.w;
    }
    const int oc = static_cast<int>((e >> 5) / ohw % p.k32) * 32 + static_cast<int>(e & 31);
    conv_epilogue_store(sum_low, sum_high, oc, e, p.epilogue, y, z, alpha_vec, bias);
  }
}

}  // namespace cupyops
