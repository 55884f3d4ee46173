// Halo tiles of the int8 convolution (sm_90a): whole output rows of one image a
// tile, so that the input rows a stage's filter taps read sit in shared memory
// once for all of them (cupyops/ops/conv_halo.py chooses the tiles).
#pragma once
#include "conv_int8.cuh"

namespace cupyops {

// A halo tile: TM output channels from m0 by ROWS output rows from oh0 of one image,
// each row PITCH slots (its OW pixels, then slots whose results are dropped); GEMM_K
// in units (a channel group and RB filter rows), `units` of them from unit_begin.
template <int TM, int ROWS, int CLUSTER = 1>
struct HaloTile {
  int m0, image, oh0, unit_begin, units, split;
  bool live;   // its image exists (the second block of the last pair may have none)
  // Tiles of a split: GEMM_M tiles by (row blocks x images) / CLUSTER, a cluster's
  // blocks taking CLUSTER row blocks side by side.
  __device__ __forceinline__ static int count(const ConvParams& p) {
    return (p.gemm_m + TM - 1) / TM * (((p.oh + ROWS - 1) / ROWS * p.n + CLUSTER - 1) / CLUSTER);
  }
  // Tile `job`: GEMM_M tiles fastest, then row blocks, then images, then splits
  // (p.steps_per_split counts units here); group_units units a channel group; `rank`:
  // the block's place in its cluster.
  __device__ __forceinline__ HaloTile(const ConvParams& p, int job, int group_units, int rank) {
    const int m_tiles = (p.gemm_m + TM - 1) / TM, row_blocks = (p.oh + ROWS - 1) / ROWS;
    const int tiles = count(p);
    split = job / tiles;
    const int index = job - split * tiles, n_group = index / m_tiles;
    const int n_tile = n_group * CLUSTER + rank;
    m0 = (index - n_group * m_tiles) * TM;
    image = n_tile / row_blocks;
    oh0 = (n_tile - image * row_blocks) * ROWS;
    live = image < p.n;
    unit_begin = split * p.steps_per_split;
    units = min(p.c32 * group_units, unit_begin + p.steps_per_split) - unit_begin;
  }
};

// Slot j of a halo tile's rows as an output pixel: false for the slots past OW and
// the rows past OH.
template <int PITCH>
struct HaloPixels {
  int image, oh0, oh, ow;
  __device__ __forceinline__ bool locate(int j, int& image_, int& rest) const {
    const int row = j / PITCH, col = j - row * PITCH;
    if (col >= ow || oh0 + row >= oh) return false;
    image_ = image;
    rest = (oh0 + row) * ow + col;
    return true;
  }
};

// Four ints saturated to int8 and packed, the first in the low byte: two conversions
// (cvt.pack.sat, each two ints into two bytes above the bits it is given).
__device__ __forceinline__ unsigned pack_sat_s8x4(int v0, int v1, int v2, int v3) {
  unsigned high, word;
  asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, 0;" : "=r"(high) : "r"(v3), "r"(v2));
  asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, %3;" : "=r"(word) : "r"(v1), "r"(v0), "r"(high));
  return word;
}

// The int8 epilogue of a halo tile's warpgroup (int8 out, no z, no split) without shared
// memory: each thread converts its accumulators where they lie (acc[h][b][e]: channel
// lane / 4 + 8 h of its warp's 16, slot 8 b + 2 (lane & 3) + e) into a word of four bytes a
// block of 8 slots, then two exchanges of that word between lanes leave each lane four
// consecutive channels of one slot, stored as one word. The first (shfl.xor 4, between lanes of
// neighbouring channels) splits each slot pair: a lane keeps one slot's two channels and takes
// its neighbour's; the second (shfl.xor 8) joins two such channel pairs. No barrier: each warp
// stores on its own, where the exchange through shared memory (conv_warpgroup_epilogue_s8)
// synchronises its warpgroup twice every chunk.
template <int WN, int PITCH>
__device__ __forceinline__ void conv_halo_epilogue_s8(const int (&acc)[2][WN / 8][2], int channel0, int slot0,
                                                      const ConvParams& p, signed char* y, const float* alpha_vec,
                                                      const void* bias, const HaloPixels<PITCH>& pixels) {
  const int lane = threadIdx.x & 31, row = lane >> 2, odd = row & 1, half = (row >> 1) & 1;
  const int warp_channel = channel0 + 16 * ((threadIdx.x >> 5) & 3);
  const bool relu = p.epilogue.relu;
  float alpha[2], shift[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {   // channels row and row + 8 of the warp's
    const int channel = warp_channel + row + 8 * h;
    alpha[h] = shift[h] = 0.f;   // channels past GEMM_M: never stored
    if (channel < p.gemm_m) {
      alpha[h] = conv_alpha(p.epilogue, alpha_vec, channel);
      shift[h] = p.epilogue.beta * conv_bias(p.epilogue, bias, channel);
    }
  }
  // After the exchanges: channels `channel` .. + 3 of slot `slot` of each block.
  const int channel = warp_channel + (row & 4) + 8 * half, slot = 2 * (lane & 3) + odd;
  signed char* out = channel < p.gemm_m ? y + (static_cast<int64>(pixels.image) * p.k32 + (channel >> 5)) * p.oh *
                                                  p.ow * 32 + (channel & 31)
                                        : nullptr;   // GEMM_M: whole channel groups
  // The bytes (__byte_perm) each lane keeps, q = lane & 3: even rows slot 2 q's and the next
  // row's, odd rows slot 2 q + 1's and the row before's; then the lower or the upper pairs.
  const unsigned keep = odd ? 0x3715u : 0x6240u, join = half ? 0x3276u : 0x5410u;
#pragma unroll
  for (int b = 0; b < WN / 8; ++b) {
    int rounded[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float value = fmaf(alpha[h], static_cast<float>(acc[h][b][e]), shift[h]);
        rounded[h][e] = __float2int_rn(relu ? fmaxf(value, 0.f) : value);   // NaN: 0
      }
    }
    // bytes (row, 2 q), (row, 2 q + 1), (row + 8, 2 q), (row + 8, 2 q + 1)
    const unsigned word = pack_sat_s8x4(rounded[0][0], rounded[0][1], rounded[1][0], rounded[1][1]);
    const unsigned pair = __byte_perm(word, __shfl_xor_sync(0xffffffffu, word, 4), keep);
    const unsigned quad = __byte_perm(pair, __shfl_xor_sync(0xffffffffu, pair, 8), join);
    const int j = slot0 + 8 * b + slot;   // the lane's slot (a block of 8 may span two rows)
    const int line = j / PITCH, column = j - line * PITCH;
    if (out != nullptr && column < pixels.ow && pixels.oh0 + line < pixels.oh) {
      *reinterpret_cast<unsigned*>(out + ((pixels.oh0 + line) * pixels.ow + column) * 32) = quad;
    }
  }
}

// One block's tiles by wgmma (sm_90a), warp-specialised, each input row read once
// for several filter taps (stride 1): a tile is TM output channels by ROWS output
// rows of one image (HaloTile), GEMM_N = ROWS x PITCH slots. A stage holds one unit
// of GEMM_K, channel group g and filter rows r0 .. r0 + RB - 1: their RB x S filter
// taps (TM x 32 bytes each, 32-byte swizzle, copied by the copy engine) and the
// ROWS + (RB - 1) DH input rows from oh0 - pad_h + r0 DH, slot j of a row holding
// input column j - pad_w (zeros outside the image), as two planes of 16-byte halves
// of the 32 channels, [half][slot], without swizzle (copied by the producer's 128
// threads, cp.async). Tap (r0 + i, s) reads B from slot j + i DH PITCH + s DW: the
// descriptor's start moves, the data stays. SLACK slots past the rows keep the
// moved tiles of the last row in the stage (what they read only reaches dropped
// slots). Pipeline and barriers as conv2d_int8_fprop_tma; persistent likewise.
template <int TM, int ROWS, int PITCH, int WN, int RB, int S, int DH, int DW, int stages, int CLUSTER>
__device__ __forceinline__ void conv2d_int8_fprop_halo(const TensorMap& filter_map, const signed char* x, void* y,
                                                       const signed char* z, const float* alpha_vec,
                                                       const void* bias, const ConvParams& p) {
  constexpr int TN = ROWS * PITCH;
  constexpr int CONSUMERS = (TM / 64) * (TN / WN), PRODUCERS = 128;
  constexpr int TAPS = RB * S;                               // MMAs of a stage
  constexpr int HALO_SLOTS = (ROWS + (RB - 1) * DH) * PITCH;
  constexpr int SLACK = ((S - 1) * DW + 7) / 8 * 8;
  constexpr int A_BYTES = TAPS * TM * 32;
  constexpr int PLANE_BYTES = (HALO_SLOTS + SLACK) * 16;     // one half of every slot's channels
  constexpr int STAGE_BYTES = (A_BYTES + 2 * PLANE_BYTES + 1023) / 1024 * 1024;
  // 16-byte copies of a stage's rows, in whole runs of 8 slots (those past the rows land in the slack)
  constexpr int COPIES = 2 * ((HALO_SLOTS + 7) / 8 * 8);
  static_assert(TM % 64 == 0 && TN % WN == 0 && WN % 16 == 0 && WN <= 256 && (HALO_SLOTS + 7) / 8 * 8 <=
                HALO_SLOTS + SLACK, "warpgroup tile");
  static_assert(CONSUMERS <= 4, "at most four consumer warpgroups");
  static_assert(CLUSTER == 1 || CLUSTER == 2, "blocks alone or in pairs");
  const auto [conv_shared, shared_base, skip, full, empty, warpgroup] = ws_block<stages>();
  const int group_units = p.taps / TAPS;                     // R / RB
  const int jobs = HaloTile<TM, ROWS, CLUSTER>::count(p) * p.splits;
  const int rank = CLUSTER > 1 ? static_cast<int>(cluster_rank()) : 0;
  ws_barriers_init<stages, CLUSTER>(full, 1 + PRODUCERS, CONSUMERS);
  typedef WsRegisters<CONSUMERS, 56> Registers;
  Registers::take(warpgroup == CONSUMERS);

  if (warpgroup == CONSUMERS) {   // the producer
    const int thread = threadIdx.x - CONSUMERS * 128;
    // Copy c of a stage: half (c >> 3) & 1 of slot (c & 7) + 8 (c >> 4): eight threads
    // write 128 contiguous bytes of a plane, a warp reads 16 whole pixels.
    unsigned round = 0;
    for (int job = blockIdx.x / CLUSTER; job < jobs; job += gridDim.x / CLUSTER) {
      const HaloTile<TM, ROWS, CLUSTER> tile(p, job, group_units, rank);
      for (int u = 0; u < tile.units; ++u, ++round) {
        const unsigned s = round % stages;
        if (round >= stages) mbarrier_wait(empty + 8 * s, ((round / stages) + 1) & 1);
        const unsigned stage = shared_base + s * STAGE_BYTES;
        const int unit = tile.unit_begin + u, group = unit / group_units;
        if (thread == 0) {   // the unit's taps are TAPS consecutive chunks of a filter row
          mbarrier_arrive_expect_tx(full + 8 * s, A_BYTES);   // in a pair: every tap, half from each block
#pragma unroll
          for (int t = 0; t < TAPS; ++t) {
            if constexpr (CLUSTER == 1) {
              tma_load_2d(stage + t * TM * 32, filter_map, (unit * TAPS + t) * 32, tile.m0, full + 8 * s);
            } else if (t % CLUSTER == rank) {
              tma_load_2d_multicast(stage + t * TM * 32, filter_map, (unit * TAPS + t) * 32, tile.m0, full + 8 * s,
                                    (1u << CLUSTER) - 1);
            }
          }
        }
        const int ih0 = tile.oh0 - p.pad_h + (unit - group * group_units) * RB * DH;
        const signed char* plane = x + static_cast<int64>(tile.image * p.c32 + group) * p.h * p.w * 32;
        for (int c = thread; c < COPIES; c += PRODUCERS) {
          const int half = (c >> 3) & 1, slot = (c & 7) + ((c >> 4) << 3);
          const int row = slot / PITCH, ih = ih0 + row, iw = slot - row * PITCH - p.pad_w;
          const bool inside = tile.live && ih >= 0 && ih < p.h && iw >= 0 && iw < p.w;
          cp_async_16(stage + A_BYTES + half * PLANE_BYTES + slot * 16,
                      inside ? plane + (ih * p.w + iw) * 32 + half * 16 : x, inside ? 16 : 0);
        }
        cp_async_mbarrier_arrive_noinc(full + 8 * s);
      }
    }
    if constexpr (CLUSTER > 1) cluster_sync_before_exit();   // no block leaves while copies or arrivals may reach it
    return;
  }

  const auto [wg_m, wg_n, exchange] =
      ws_consumer<TM, WN>(conv_shared, skip, stages * STAGE_BYTES, warpgroup);
  const unsigned long long a_descriptor = wgmma_descriptor<32>(shared_base + wg_m * 32);
  const unsigned long long b_descriptor =
      wgmma_descriptor_interleaved(shared_base + A_BYTES + wg_n * 16, PLANE_BYTES, 128);
  unsigned round = 0;
  for (int job = blockIdx.x / CLUSTER; job < jobs; job += gridDim.x / CLUSTER) {
    const HaloTile<TM, ROWS, CLUSTER> tile(p, job, group_units, rank);
    int acc[2][WN / 8][2];
    zero_accumulators(acc);
    for (int u = 0; u < tile.units; ++u, ++round) {
      const unsigned s = round % stages;
      mbarrier_wait(full + 8 * s, (round / stages) & 1);
      fence_proxy_async_shared();   // cp.async's writes, seen through the barrier, to wgmma
      wgmma_fence_operands(acc);
      wgmma_fence();
#pragma unroll 1
      for (int t = 0; t < TAPS; ++t) {
        const int i = t / S, c = t - i * S;
        WgmmaS8<WN>::mma(acc, wgmma_descriptor_moved(a_descriptor, (s * STAGE_BYTES + t * TM * 32) >> 4),
                         wgmma_descriptor_moved(b_descriptor, (s * STAGE_BYTES >> 4) + i * DH * PITCH + c * DW));
      }
      ws_round_issued<stages, CLUSTER>(acc, empty, round, u);
    }
    ws_tile_done<stages, CLUSTER>(acc, empty, round);
    const HaloPixels<PITCH> pixels{tile.image, tile.oh0, tile.live ? p.oh : 0, p.ow};   // no rows without an image
    // The exchange-free int8 epilogue where the registers a thread has at launch (what ptxas
    // compiles in) leave it 48 past the accumulators (ptxas: 64 x 256 warpgroups beside
    // another spilled with it); else conv_wgmma_epilogue's.
    if constexpr (warpgroup_epilogue_fits<WN, Registers::block()>()) {
      if (tile_epilogue_s8(p)) {
        conv_halo_epilogue_s8<WN>(acc, tile.m0 + wg_m, wg_n, p, static_cast<signed char*>(y), alpha_vec, bias, pixels);
      } else {
        conv_wgmma_exchange_epilogue<WN>(acc, exchange, tile.m0 + wg_m, wg_n, tile.split, p, y, z, alpha_vec, bias,
                                         pixels);
      }
    } else {
      conv_wgmma_epilogue<WN, Registers::consumer()>(acc, exchange, tile.m0 + wg_m, wg_n, tile.split, p, y, z,
                                                     alpha_vec, bias, pixels, warpgroup);
    }
  }
  if constexpr (CLUSTER > 1) cluster_sync_before_exit();
}

}  // namespace cupyops
