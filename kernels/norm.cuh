// LayerNorm and RMSNorm, forward and backward, row by row.
//
// Forward paths (OneFlow's three, plus a register block path and an async one):
//   norm_warp            a row per group of `width` lanes, in registers; two
//                        rows per access for narrow rows (guarded: never reads
//                        past the last row, unlike OneFlow's RMSNorm)
//   norm_block_regs      a row per block, in registers
//   norm_block_async     a row per block of 16-byte packs, cached by cp.async
//   norm_block_smem      a row per block, cached in dynamic shared memory
//   norm_block_uncached  a row per block, read twice from global memory
// `Stats` is WelfordState (LayerNorm) or SquareSumState (RMSNorm). Rows held
// in registers (warp, block_regs) or cached by cp.async (block_async) take
// two exact row-wide passes (Stats::of_row), the sum for the mean, then the
// squared deviations from it (LayerNorm warp rows every lane fills: each
// lane's two passes, joined by one reduction, norm_warp); the streaming
// paths (block_smem, uncached) take each thread's state without a division
// per value (of_packs) and join the threads by Chan's combine. LayerNorm's
// statistics are taken of x - K, K the row's first value (row_shift): every
// thread of the row loads the same K, so a float32 mean never has to
// resolve a small variance under a large mean. Inputs come through NormInput
// (optionally h = x + residual, stored), outputs leave through NormOutput
// (weight and bias applied in the compute type).
//
// Backward: the same four shapes compute
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * weight
// (RMSNorm: without mean(g)); the warp and register paths can also fold
// dy * xhat and dy into per-block float partial column sums (dweight, dbias),
// written to a workspace row per block and summed by norm_param_grad_finish
// in a fixed order: deterministic, no atomics.
#pragma once
#include "async_row.cuh"
#include "cluster.cuh"
#include "common.cuh"
#include "welford.cuh"

namespace cupyops {

// x (+ residual) in compute type. With a residual, h = x + residual is rounded
// to the storage type (as torch computes it), stored, and normalised.
template <typename T, typename C, bool has_residual>
struct NormInput {
  typedef T Storage;
  typedef C Compute;
  const T* x;
  const T* residual;
  T* h;
  int64 x_stride, residual_stride, h_stride;

  static constexpr bool has_residual_input = has_residual;
  static constexpr int num_sources = has_residual ? 2 : 1;   // x (and the residual)

  // h, as torch rounds it.
  static __device__ __forceinline__ T h_of(C x_value, C residual_value) {
    return cast<T>(x_value + residual_value);
  }
  // The pack in the storage type: x, or h (stored here).
  template <int N>
  __device__ __forceinline__ Pack<T, N> fetch(int64 row, int64 col) const {
    const Pack<T, N> a = load_pack<T, N>(x + row * x_stride + col);
    if constexpr (has_residual) {
      const Pack<T, N> b = load_pack<T, N>(residual + row * residual_stride + col);
      Pack<T, N> sum;
#pragma unroll
      for (int i = 0; i < N; ++i) sum.elem[i] = h_of(cast<C>(a.elem[i]), cast<C>(b.elem[i]));
      store_pack(h + row * h_stride + col, sum);
      return sum;
    } else {
      return a;
    }
  }

  // The row operands as read, in order (x, residual): cp.async's sources.
  __device__ __forceinline__ void sources(DirectLoad<T, C> (&loads)[num_sources]) const {
    loads[0] = {x, x_stride};
    if constexpr (has_residual) loads[1] = {residual, residual_stride};
  }
  // Element i of a pack read from the sources (v[j]: source j): x, or h.
  template <int N>
  static __device__ __forceinline__ C value(const C (&v)[num_sources][N], int i) {
    if constexpr (has_residual) {
      return cast<C>(h_of(v[0][i], v[1][i]));
    } else {
      return v[0][i];
    }
  }
  // Stores h's pack at (row, col) from a pack read from the sources.
  template <int N>
  __device__ __forceinline__ void store_h(const C (&v)[num_sources][N], int64 row, int64 col) const {
    if constexpr (has_residual) {
      Pack<T, N> sum;
#pragma unroll
      for (int i = 0; i < N; ++i) sum.elem[i] = h_of(v[0][i], v[1][i]);
      store_pack(h + row * h_stride + col, sum);
    }
  }
  template <int N>
  __device__ __forceinline__ void load(C* dst, int64 row, int64 col) const {
    const Pack<T, N> pack = fetch<N>(row, col);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = cast<C>(pack.elem[i]);
  }

  // The row's first value exactly as load() computes it (h rounded to T).
  // Reads x / residual, never h, so no thread races the one that stores h.
  __device__ __forceinline__ C first(int64 row) const {
    const C a = cast<C>(x[row * x_stride]);
    if constexpr (has_residual) {
      return cast<C>(h_of(a, cast<C>(residual[row * residual_stride])));
    } else {
      return a;
    }
  }

  // A second read of a pack this thread loaded before (h when it was stored).
  template <int N>
  __device__ __forceinline__ void reload(C* dst, int64 row, int64 col) const {
    const T* src = has_residual ? h + row * h_stride : x + row * x_stride;
    const Pack<T, N> a = load_pack<T, N>(src + col);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = cast<C>(a.elem[i]);
  }
};

// How Affine reads a pack: on the vectors' 16-byte grid (ALIGNED), off it by
// a word shift known at compile time (0 .. 3, load_pack_realigned), or at
// run time (ANY_WORD_SHIFT, load_pack_unaligned).
constexpr int ALIGNED = -1;
constexpr int ANY_WORD_SHIFT = 4;

// Per-column weight / bias vectors, read in compute type (1 / 0 when absent).
template <typename T, typename C, bool has_weight, bool has_bias, int word_shift = ALIGNED>
struct Affine {
  const T* weight;
  const T* bias;

  // The pack of a vector's columns [col, col + N), as stored.
  template <int N>
  static __device__ __forceinline__ Pack<T, N> read_pack(const T* vector, int64 col) {
    if constexpr (word_shift == ALIGNED || N == 1) {
      return load_pack<T, N>(vector + col);
    } else if constexpr (word_shift == ANY_WORD_SHIFT) {
      return load_pack_unaligned<T, N>(vector + col);
    } else {
      return load_pack_realigned<T, N, word_shift>(vector + col);
    }
  }
  // Weight and bias of columns [col, col + N) as stored (an absent one is
  // not read), read ahead of their use (convert).
  template <int N>
  struct Packs {
    Pack<T, N> weight, bias;
  };
  template <int N>
  __device__ __forceinline__ Packs<N> read(int64 col) const {
    Packs<N> packs;
    if constexpr (has_weight) packs.weight = read_pack<N>(weight, col);
    if constexpr (has_bias) packs.bias = read_pack<N>(bias, col);
    return packs;
  }
  // A vector's pack in compute type, or `absent` in every value.
  template <bool present, int N>
  static __device__ __forceinline__ void to_compute(const Pack<T, N>& pack, C* dst, C absent) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = present ? cast<C>(pack.elem[i]) : absent;
  }
  template <int N>
  static __device__ __forceinline__ void convert(const Packs<N>& packs, C* w, C* b) {
    to_compute<has_weight>(packs.weight, w, C(1));
    to_compute<has_bias>(packs.bias, b, C(0));
  }

  // Weight and bias of columns [col, col + N) in compute type (1 / 0 when
  // absent), each converted as it is read: convert(read(col)), both packs
  // read first, had ptxas spill 36 bytes in the float32 cp.async block of 512
  // x 8 packs.
  template <int N>
  __device__ __forceinline__ void load(C* w, C* b, int64 col) const {
    if constexpr (has_weight) {
      to_compute<true>(read_pack<N>(weight, col), w, C(1));
    } else {
      to_compute<false>(Pack<T, N>{}, w, C(1));
    }
    if constexpr (has_bias) {
      to_compute<true>(read_pack<N>(bias, col), b, C(0));
    } else {
      to_compute<false>(Pack<T, N>{}, b, C(0));
    }
  }

  // Calls body(affine) with the reader of a peeled row's packs (columns
  // head + N * j, off the vectors' 16-byte grid): weight and bias by
  // load_pack_realigned at their word shift, the same for every pack of the
  // row (one branch a row), or by load_pack_unaligned where weight and bias
  // sit at different offsets. ncu, LayerNorm f16 12345 cols, 256 x 7 packs:
  // words selected by a branch in every pack cost 89 instructions a pack.
  template <typename Body>
  __device__ __forceinline__ void realigned(int64 head, const Body& body) const {
    if constexpr (!has_weight && !has_bias) {
      body(*this);
    } else {
      const unsigned weight_offset = has_weight ? byte_offset(weight + head) : 0u;
      const unsigned bias_offset = has_bias ? byte_offset(bias + head) : weight_offset;
      if (has_weight && has_bias && weight_offset != bias_offset) {
        body(Affine<T, C, has_weight, has_bias, ANY_WORD_SHIFT>{weight, bias});
        return;
      }
      with_word_shift(has_weight ? weight_offset : bias_offset, [&](auto shift) {
        body(Affine<T, C, has_weight, has_bias, decltype(shift)::get>{weight, bias});
      });
    }
  }
};

// y = normalized * weight + bias, computed in C, stored as T.
template <typename T, typename C, bool has_weight, bool has_bias, int word_shift = ALIGNED>
struct NormOutput {
  T* y;
  int64 y_stride;
  typedef Affine<T, C, has_weight, has_bias, word_shift> AffineReader;
  AffineReader affine;

  template <int N>
  __device__ __forceinline__ void store(const C* normalized, int64 row, int64 col) const {
    C w[N], b[N];
    affine.template load<N>(w, b, col);
    store_affine<N>(normalized, w, b, row, col);
  }
  // The same with the columns' weight and bias already read (held across rows).
  template <int N>
  __device__ __forceinline__ void store_with(const C* normalized, const typename AffineReader::template Packs<N>& packs,
                                             int64 row, int64 col) const {
    C w[N], b[N];
    AffineReader::template convert<N>(packs, w, b);
    store_affine<N>(normalized, w, b, row, col);
  }
  template <int N>
  __device__ __forceinline__ void store_affine(const C* normalized, const C* w, const C* b, int64 row,
                                               int64 col) const {
    C out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = normalized[i] * w[i] + b[i];
    DirectStore<C, T>{y, y_stride}.template store<N>(out, row, col);
  }
  // The same output with weight and bias read through `source` (a realigned
  // reader, Affine::realigned).
  template <int source_shift>
  __device__ __forceinline__ NormOutput<T, C, has_weight, has_bias, source_shift> with_affine(
      const Affine<T, C, has_weight, has_bias, source_shift>& source) const {
    return {y, y_stride, source};
  }
};

// Optional per-row mean / rstd outputs (null pointers: not stored). m.mean is
// the mean of the shifted values; the row's mean is shift + m.mean.
template <typename C>
struct MomentsOutput {
  C* mean;
  C* rstd;
  __device__ __forceinline__ void store(int64 row, const RowMoments<C>& m, C shift) const {
    if (mean != nullptr) mean[row] = shift + m.mean;
    if (rstd != nullptr) rstd[row] = m.rstd;
  }
};

// The shift K of a row's statistics (see WelfordState): the row's first value
// for LayerNorm, loaded by every thread of the row (one cached load); 0 for
// RMSNorm, whose statistic is about 0 by definition (x - 0 folds away).
template <typename Stats, typename Input, typename C>
__device__ __forceinline__ C row_shift(const Input& in, int64 row) {
  if constexpr (Stats::centered) {
    return in.first(row);
  } else {
    return C(0);
  }
}

// Rows handled by the groups of one warp move together, so every lane of a
// warp runs the same number of iterations (the shuffles use the full mask).
struct WarpRows {
  int64 first, step;
  int group_lane;
  template <int width, int rows_per_access>
  static __device__ __forceinline__ WarpRows make() {
    constexpr int groups_per_warp = 32 / width;
    const int64 group = static_cast<int64>(blockIdx.x) * blockDim.y + threadIdx.y;
    const int64 warp_first_group = group - threadIdx.y % groups_per_warp;
    return {warp_first_group * rows_per_access, static_cast<int64>(gridDim.x) * blockDim.y * rows_per_access,
            static_cast<int>(threadIdx.x)};
  }
  // Offset of this group's first row from the warp's first row.
  template <int width, int rows_per_access>
  static __device__ __forceinline__ int64 group_offset() {
    return static_cast<int64>(threadIdx.y % (32 / width)) * rows_per_access;
  }
};

// Whether pack p of a lane lies inside the row: packs below min_packs always do.
template <bool padding, int min_packs>
__device__ __forceinline__ bool pack_in_row(int p, int64 col, int64 cols) {
  return !padding || p < min_packs || col < cols;
}

// Row operand 0 of a RegisterRow minus `shift`, as of_packs reads values.
template <typename Row, typename C>
struct ShiftedValues {
  const Row& row;
  C shift;
  __device__ __forceinline__ C operator[](int i) const { return row.get(0, i) - shift; }
};

// Loads the packs p < num_packs a thread holds of one row into row operand j
// of buf (a RegisterRow), col_of(p) their columns, inside(p) whether each
// lies in the rows. Without a residual every pack is fetched first and
// without a branch (a pack outside fetches the one at (fallback_row,
// fallback_col), which exists, and is left out by the caller), then held:
// converting each pack under the condition of its load had the loads go out
// one at a time (bfloat16 rows at 57-66 % of copy). With a residual each pack
// inside is fetched (h stored) and held in turn: the raw x and residual
// packs would not fit the registers beside the row; a pack outside holds 0.
template <typename Input, int num_packs, int pack_size, typename Row, typename ColOf, typename Inside>
__device__ __forceinline__ void load_row_packs(const Input& in, Row& buf, int j, int64 row, ColOf col_of,
                                               Inside inside, int64 fallback_row, int64 fallback_col) {
  typedef typename Input::Storage T;
  if constexpr (Input::has_residual_input) {
    Pack<T, pack_size> zero;
#pragma unroll
    for (int i = 0; i < pack_size; ++i) zero.elem[i] = cast<T>(typename Input::Compute(0));
#pragma unroll
    for (int p = 0; p < num_packs; ++p) buf.set_pack(j, p, inside(p) ? in.template fetch<pack_size>(row, col_of(p)) : zero);
  } else {
    Pack<T, pack_size> fetched[num_packs];
#pragma unroll
    for (int p = 0; p < num_packs; ++p) {
      fetched[p] = in.template fetch<pack_size>(inside(p) ? row : fallback_row, inside(p) ? col_of(p) : fallback_col);
    }
#pragma unroll
    for (int p = 0; p < num_packs; ++p) buf.set_pack(j, p, fetched[p]);
  }
}

// ---------------------------------------------------------------------------
// Forward, warp path: a group of `width` lanes owns rows_per_access rows at a
// time, each lane holding max_cols_per_thread values of each in registers.
// LayerNorm rows every lane fills (no padding): each lane's mean and m2 in
// two exact passes over its values, joined in one reduction of equal counts
// (EqualCountWelford) instead of two row-wide sums, one after the other
// (H200, rows 49152, % of copy, five interleaved rounds: f16 / bf16 64, 128,
// 512 cols +1.2 .. +2.0, 1024 cols 92.3 / 92.5 against 91.7 / 91.5; float32
// and 256 cols within -0.6 .. +1.1).
// hold_affine: each lane reads its columns' weight and bias once, as stored,
// before its rows, and applies them to every row it visits: their loads go
// out with x's instead of after the row's reduction (a group visits one row,
// or two, on auto's grid; a grid of resident blocks walking the rows lost,
// 86-88 % of copy against 91-92 % at LayerNorm / RMSNorm 16-bit 1024 cols).
template <typename Stats, typename Input, typename Output, typename C, int pack_size,
          int max_cols_per_thread, int min_cols_per_thread, int width, int rows_per_access, bool padding,
          bool hold_affine>
__device__ __forceinline__ void norm_warp(const Input& in, const Output& out, const MomentsOutput<C>& moments_out,
                                          int64 rows, int64 cols, C eps) {
  static_assert(max_cols_per_thread % pack_size == 0 && min_cols_per_thread % pack_size == 0, "");
  static_assert(width <= 32 && 32 % width == 0, "width must divide the warp size");
  constexpr int max_packs = max_cols_per_thread / pack_size;
  constexpr int min_packs = min_cols_per_thread / pack_size;
  RegisterRow<typename Input::Storage, C, rows_per_access, max_packs, pack_size, false> row_values;
  auto& buf = row_values.values;
  const WarpRows warp_rows = WarpRows::make<width, rows_per_access>();
  const int lane = warp_rows.group_lane;
  const auto pack_col = [&](int p) { return (static_cast<int64>(p) * width + lane) * pack_size; };
  typename Output::AffineReader::template Packs<pack_size> held[hold_affine ? max_packs : 1];
  if constexpr (hold_affine) {
#pragma unroll
    for (int p = 0; p < max_packs; ++p) {
      // a pack past the row reads the row's first (unused): no branch
      const bool in_row = pack_in_row<padding, min_packs>(p, pack_col(p), cols);
      held[p] = out.affine.template read<pack_size>(in_row ? pack_col(p) : 0);
    }
  }
  for (int64 base = warp_rows.first; base < rows; base += warp_rows.step) {
    const int64 row = base + WarpRows::group_offset<width, rows_per_access>();
    const auto inside = [&](int r, int p) { return row + r < rows && pack_in_row<padding, min_packs>(p, pack_col(p), cols); };
    C shift[rows_per_access];
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      shift[r] = row + r < rows ? row_shift<Stats, Input, C>(in, row + r) : C(0);
      load_row_packs<Input, max_packs, pack_size>(in, row_values, r, row + r, pack_col,
                                                  [&](int p) { return inside(r, p); }, rows - 1, 0);
#pragma unroll
      for (int i = 0; i < max_cols_per_thread; ++i) buf[r][i] -= shift[r];   // buf holds x - K from here on
    }
    const auto group_sum = [](C value) { return warp_all_reduce_state<width>(SumState<C>{value}).sum; };
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      RowMoments<C> m;
      if constexpr (Stats::centered && !padding) {
        const auto every_pack = [](int) { return true; };
        const auto lane_state = WelfordState<C>::template of_packs<max_packs, pack_size>(buf[r], every_pack);
        m = warp_all_reduce_state<width>(EqualCountWelford<C>{lane_state.mean, lane_state.m2, lane_state.count})
                .moments(cols, eps);
      } else {
        m = held_row_moments<Stats, max_packs, pack_size>(
            buf[r], [&](int p) { return inside(r, p); }, NoExtraValue(), cols, eps, group_sum);
      }
      if (row + r >= rows) continue;
      if (lane == 0) moments_out.store(row + r, m, shift[r]);
      const C offset = m.offset();
#pragma unroll
      for (int i = 0; i < max_cols_per_thread; ++i) buf[r][i] = m.normalize(buf[r][i], offset);
#pragma unroll
      for (int p = 0; p < max_packs; ++p) {
        if (!inside(r, p)) continue;
        if constexpr (hold_affine) {
          out.template store_with<pack_size>(buf[r] + p * pack_size, held[p], row + r, pack_col(p));
        } else {
          out.template store<pack_size>(buf[r] + p * pack_size, row + r, pack_col(p));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Forward, block-register path: a block owns a row; thread t holds packs t,
// t + block_size, ... (packs_per_thread of them) in registers: in the compute
// type, or with `packed` as loaded (RegisterRow; 16-bit rows in half the
// registers, converted at each use).
// peel: rows need not start on a 16-byte boundary (odd cols, offset views;
// every row operand at the same phase). Each row's first `head` elements (up
// to its first 16-byte boundary, RowHead) and the elements past its packs
// (at most block_size of them, as BlockRowColumns in the backward) are
// single elements ("edges") held by threads 0, 1, ...; the packs in between
// are aligned. The edges are loaded after the packs, so the packs' loads are
// all in flight first (computing the edges' columns first, in a struct
// shared with the backward, had ptxas issue some of the loads late: 74 % of
// copy against 87 %). Weight and bias, at their own phase, are read as
// realigned 16-byte packs (Affine::realigned: one branch a row picks the
// word shift). full_packs: every row has block_size x full_packs packs (the
// planner checks it from cols), so a thread's first full_packs packs are not
// checked against the row. rows_per_block: as softmax_block_regs (BlockRows).
template <typename Stats, typename Input, typename Output, typename C, int pack_size, int packs_per_thread,
          int block_size, int rows_per_block, bool peel, bool packed, int full_packs, typename RowHead>
__device__ __forceinline__ void norm_block_regs(const Input& in, const Output& out,
                                                const MomentsOutput<C>& moments_out, int64 rows, int64 cols,
                                                C eps, const RowHead& row_head) {
  typedef typename Input::Storage T;
  RegisterRow<T, C, 1, packs_per_thread, pack_size, packed> buf;
  // One barrier a sum: consecutive sums alternate halves of the partials.
  int parity = 0;
  const auto block_sum = [&](C value) {
    parity ^= 1;
    return block_all_reduce_state<block_size>(SumState<C>{value}, parity).sum;
  };
  const BlockRows<block_size, rows_per_block> block_rows;
  for (int64 row = block_rows.first(); row < rows; row += block_rows.step()) {
    const int head = peel ? row_head(row) : 0;
    int64 num_packs = (cols - head) / pack_size;   // peeled: at most the packs held (BlockRowColumns)
    if (peel && num_packs > static_cast<int64>(block_size) * packs_per_thread) {
      num_packs = static_cast<int64>(block_size) * packs_per_thread;
    }
    const C shift = row_shift<Stats, Input, C>(in, row);
    const auto pack_col = [&](int k) { return head + (static_cast<int64>(k) * block_size + threadIdx.x) * pack_size; };
    const auto in_row = [&](int k) {
      return k < full_packs || static_cast<int64>(k) * block_size + threadIdx.x < num_packs;
    };
    // A pack past the row loads the row's first pack (num_packs >= 1).
    load_row_packs<Input, packs_per_thread, pack_size>(in, buf, 0, row, pack_col, in_row, row, head);
    const int64 tail = head + num_packs * pack_size;
    const bool has_edge = peel && threadIdx.x < head + (cols - tail);
    const int64 edge_col = threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;
    C edge = C(0);
    if (has_edge) {
      in.template load<1>(&edge, row, edge_col);
      edge -= shift;
    }
    // x - K: compute-type rows shifted in place, packed rows at each use
#pragma unroll
    for (int i = 0; i < packs_per_thread * pack_size; ++i) buf.set(0, i, buf.get(0, i) - shift);
    const ShiftedValues<decltype(buf), C> shifted{buf, packed ? shift : C(0)};
    const RowMoments<C> m = held_row_moments<Stats, packs_per_thread, pack_size>(
        shifted, in_row, ExtraValue<C>{edge, has_edge}, cols, eps, block_sum);
    if (threadIdx.x == 0) moments_out.store(row, m, shift);
    const C offset = m.offset();
    if (has_edge) {
      edge = m.normalize(edge, offset);
      out.template store<1>(&edge, row, edge_col);
    }
    const auto store_packs = [&](const auto& row_out) {
#pragma unroll
      for (int k = 0; k < packs_per_thread; ++k) {
        C values[pack_size];
#pragma unroll
        for (int i = 0; i < pack_size; ++i) values[i] = m.normalize(shifted[k * pack_size + i], offset);
        if (in_row(k)) row_out.template store<pack_size>(values, row, pack_col(k));
      }
    };
    if constexpr (peel) {
      out.affine.realigned(head, [&](const auto& affine) { store_packs(out.with_affine(affine)); });
    } else {
      store_packs(out);
    }
  }
}

// ---------------------------------------------------------------------------
// Forward, asynchronous path: a block owns a row of 16-byte packs, whose
// sources (x, and the residual) are cached by cp.async (AsyncRowCache: in
// shared memory, the last tail_packs packs a thread in registers); a block
// fetches its next row once this one is written (the planner launches a
// block a row: the next block starts as one leaves). Statistics as the register
// paths (Stats::of_row): the sum, then the squared deviations, each pass
// reading the cache back; h = x + residual is stored with y.
template <typename Stats, typename Input, typename Output, typename C, int pack_size, int block_size,
          int tail_packs>
__device__ __forceinline__ void norm_block_async(const Input& in, const Output& out,
                                                 const MomentsOutput<C>& moments_out, int64 rows, int64 cols,
                                                 C eps) {
  typedef typename Input::Storage T;
  constexpr int N = Input::num_sources;
  extern __shared__ __align__(16) unsigned char shared_buf[];
  typedef AsyncRowCache<T, C, N, pack_size, block_size, 1, 1, tail_packs> Cache;
  const Cache cache(shared_buf, cols, 0);
  typename Cache::Tail tail;
  DirectLoad<T, C> loads[N];
  in.sources(loads);
  int parity = 0;   // one barrier a sum, as norm_block_regs
  const auto block_sum = [&](C value) {
    parity ^= 1;
    return block_all_reduce_state<block_size>(SumState<C>{value}, parity).sum;
  };
  if (blockIdx.x < rows) cache.fetch(loads, blockIdx.x, 0, tail);
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C shift = row_shift<Stats, Input, C>(in, row);
    cp_async_wait<0>();
    const auto thread_sum = [&](auto term) {
      C sum = C(0);
      cache.for_each_pack(loads, row, 0, tail, [&](int, const C (&v)[N][pack_size]) {
#pragma unroll
        for (int i = 0; i < pack_size; ++i) sum += term(Input::value(v, i) - shift);
      });
      return sum;
    };
    const RowMoments<C> m = Stats::of_row(thread_sum, cols, eps, block_sum);
    if (threadIdx.x == 0) moments_out.store(row, m, shift);
    const C offset = m.offset();
    cache.for_each_pack(loads, row, 0, tail, [&](int pack, const C (&v)[N][pack_size]) {
      const int64 col = static_cast<int64>(pack) * pack_size;
      C values[pack_size];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[i] = m.normalize(Input::value(v, i) - shift, offset);
      out.template store<pack_size>(values, row, col);
      in.store_h(v, row, col);
    });
    if (row + gridDim.x < rows) cache.fetch(loads, row + gridDim.x, 0, tail);
  }
}

// ---------------------------------------------------------------------------
// Forward, block-shared-memory path: a block owns a row; pack p of the row is
// cached at [p] as Cache (the compute type as OneFlow, or the storage type:
// lossless and half the bytes for 16-bit inputs). A thread reads back only the
// packs it wrote, so rows need no barrier between them.
template <typename Stats, typename Input, typename Output, typename C, typename Cache, int pack_size,
          int block_size>
__device__ __forceinline__ void norm_block_smem(const Input& in, const Output& out,
                                                const MomentsOutput<C>& moments_out, int64 rows, int64 cols,
                                                C eps) {
  extern __shared__ __align__(16) unsigned char shared_buf[];
  Pack<Cache, pack_size>* cache = reinterpret_cast<Pack<Cache, pack_size>*>(shared_buf);
  const int num_packs = static_cast<int>(cols / pack_size);
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    Stats stats = Stats::empty();
    const C shift = row_shift<Stats, Input, C>(in, row);
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      C values[pack_size];
      in.template load<pack_size>(values, row, static_cast<int64>(p) * pack_size);
      Pack<Cache, pack_size> packed;
      C shifted[pack_size];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) {
        shifted[i] = values[i] - shift;
        packed.elem[i] = cast<Cache>(values[i]);   // x itself: x - K may not fit a 16-bit cache
      }
      stats.combine(Stats::template of_packs<1, pack_size>(shifted, [](int) { return true; }));
      cache[p] = packed;
    }
    const RowMoments<C> m = block_all_reduce_state<block_size>(stats).moments(cols, eps);
    if (threadIdx.x == 0) moments_out.store(row, m, shift);
    const C offset = m.offset();
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      const Pack<Cache, pack_size> packed = cache[p];
      C values[pack_size];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[i] = m.normalize(cast<C>(packed.elem[i]) - shift, offset);
      out.template store<pack_size>(values, row, static_cast<int64>(p) * pack_size);
    }
  }
}

// ---------------------------------------------------------------------------
// Forward, uncached path: a block owns a row; statistics in one pass, output
// in a second pass that re-reads the row (h instead of x + residual when h was
// stored). The smem and uncached paths take each pack's state (two passes over
// the pack) and combine it into the thread's: a division per pack.
template <typename Stats, typename Input, typename Output, typename C, int pack_size, int block_size>
__device__ __forceinline__ void norm_block_uncached(const Input& in, const Output& out,
                                                    const MomentsOutput<C>& moments_out, int64 rows,
                                                    int64 cols, C eps) {
  const int64 num_packs = cols / pack_size;
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    Stats stats = Stats::empty();
    const C shift = row_shift<Stats, Input, C>(in, row);
    for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
      C values[pack_size];
      in.template load<pack_size>(values, row, p * pack_size);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[i] -= shift;
      stats.combine(Stats::template of_packs<1, pack_size>(values, [](int) { return true; }));
    }
    const RowMoments<C> m = block_all_reduce_state<block_size>(stats).moments(cols, eps);
    if (threadIdx.x == 0) moments_out.store(row, m, shift);
    const C offset = m.offset();
    for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
      C values[pack_size];
      in.template reload<pack_size>(values, row, p * pack_size);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[i] = m.normalize(values[i] - shift, offset);
      out.template store<pack_size>(values, row, p * pack_size);
    }
  }
}

// ===========================================================================
// Backward.

// Where a peeled backward register block reads the weight (norm.py:
// NormSpec.weight_source): from a copy in the block's shared memory at its
// rows' phase (NormGradIO::with_weight_copied), or from pack_size phase
// copies in global memory written before the dx kernel (norm_weight_phases):
// copy h is shifted so that the columns of a row with head h fall on whole
// packs. Rows on the 16-byte grid read the weight itself (WEIGHT_DIRECT).
constexpr int WEIGHT_DIRECT = 0;
constexpr int WEIGHT_SHARED_COPY = 1;
constexpr int WEIGHT_PHASE_COPIES = 2;

// Where a copy of the weight starts, from a 16-byte boundary, so that column
// `head` of it falls on a whole N-element pack (the shared copy and each
// phase copy; norm.py: shifted_copy_elements).
template <int N>
__device__ __forceinline__ int shifted_copy_start(int head) {
  return (N - head) % N;
}
// Where phase copy `head` starts among the N copies (stride: a multiple of N).
template <int N>
__device__ __forceinline__ int64 weight_phase_offset(int head, int64 stride) {
  return head * stride + shifted_copy_start<N>(head);
}

// Writes the N phase copies of `weight` (cols elements), `stride` elements
// apart (norm.py: shifted_copy_elements); grid.y picks the copy.
template <typename T, int N>
__device__ __forceinline__ void norm_weight_phases(const T* weight, int64 cols, T* copies, int64 stride) {
  T* const copy = copies + weight_phase_offset<N>(blockIdx.y, stride);
  const int64 step = static_cast<int64>(gridDim.x) * blockDim.x;
  for (int64 c = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += step) copy[c] = weight[c];
}

// What the backward kernels read and write. mean is null for RMSNorm; each
// partial pointer is null unless its gradient is wanted (and, for the dx
// kernels, the partials are fused): every write through one is guarded.
template <typename T, typename C, bool is_centered, bool with_weight>
struct NormGradIO {
  typedef T Storage;
  typedef Affine<T, C, with_weight, false> Weight;
  static constexpr bool centered = is_centered;
  static constexpr bool has_weight = with_weight;
  const T* dy;
  const T* x;
  const T* weight;
  const C* mean;
  const C* rstd;
  T* dx;
  C* weight_partials;   // [gridDim.x, cols]
  C* bias_partials;     // [gridDim.x, cols]
  int64 dy_stride, x_stride, dx_stride;

  __device__ __forceinline__ RowMoments<C> moments(int64 row) const {
    return {centered ? mean[row] : C(0), rstd[row]};
  }
  // The weight of a pack's columns (1 without a weight).
  template <int N>
  __device__ __forceinline__ void weights(C* w, int64 col) const {
    C unused[N];
    Weight{weight, nullptr}.template load<N>(w, unused, col);
  }
  // The weight of a pack's columns as stored (unread without a weight), and
  // in the compute type (1 without a weight).
  template <int N>
  __device__ __forceinline__ Pack<T, N> weight_pack(int64 col) const {
    Pack<T, N> w{};
    if constexpr (has_weight) w = Weight::template read_pack<N>(weight, col);
    return w;
  }
  // This IO reading a copy of the weight in the block's shared memory
  // `cache`, shifted so that a peeled row's columns, head + N * j, fall on
  // whole N-element packs there (norm.py: _weight_copy_bytes).
  template <int N>
  __device__ __forceinline__ NormGradIO with_weight_copied(T* cache, int64 cols, int head) const {
    T* const copy = cache + shifted_copy_start<N>(head);
    for (int64 c = threadIdx.x; c < cols; c += blockDim.x) copy[c] = weight[c];
    __syncthreads();
    return reading_weight(copy);
  }
  // This IO reading the weight from `vector` instead (the same columns).
  __device__ __forceinline__ NormGradIO reading_weight(const T* vector) const {
    NormGradIO moved = *this;
    moved.weight = vector;
    return moved;
  }
  template <int N>
  __device__ __forceinline__ void weights_of(const Pack<T, N>& stored, C* w) const {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = has_weight ? cast<C>(stored.elem[i]) : C(1);
  }
  // dy and x of a pack as stored.
  template <int N>
  struct Fetched {
    Pack<T, N> dy, x;
  };
  template <int N>
  __device__ __forceinline__ Fetched<N> fetch(int64 row, int64 col) const {
    return {load_pack<T, N>(dy + row * dy_stride + col), load_pack<T, N>(x + row * x_stride + col)};
  }
  // dy and xhat of a fetched pack; g = dy * weight is added to sums.first
  // (centered) and g * xhat to sums.second.
  template <int N>
  __device__ __forceinline__ void convert(const Fetched<N>& fetched, const C* w, C* dy_out, C* xhat_out,
                                          SumPairState<C>& sums, const RowMoments<C>& m) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dy_out[i] = cast<C>(fetched.dy.elem[i]);
      xhat_out[i] = (cast<C>(fetched.x.elem[i]) - m.mean) * m.rstd;
      const C g = dy_out[i] * w[i];
      if (centered) sums.first += g;
      sums.second += g * xhat_out[i];
    }
  }
  template <int N>
  __device__ __forceinline__ void load(C* dy_out, C* xhat_out, SumPairState<C>& sums, const RowMoments<C>& m,
                                       int64 row, int64 col) const {
    C w[N];
    weights<N>(w, col);
    convert<N>(fetch<N>(row, col), w, dy_out, xhat_out, sums, m);
  }
  // dx of a pack from dy and xhat and the row sums (already divided by cols).
  template <int N>
  __device__ __forceinline__ void store_with(const C* w, const C* dy_in, const C* xhat, C mean_g, C mean_gx,
                                             C rstd, int64 row, int64 col) const {
    C out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = rstd * (dy_in[i] * w[i] - mean_g - xhat[i] * mean_gx);
    DirectStore<C, T>{dx, dx_stride}.template store<N>(out, row, col);
  }
  template <int N>
  __device__ __forceinline__ void store(const C* dy_in, const C* xhat, C mean_g, C mean_gx, C rstd, int64 row,
                                        int64 col) const {
    C w[N];
    weights<N>(w, col);
    store_with<N>(w, dy_in, xhat, mean_g, mean_gx, rstd, row, col);
  }
};

template <typename C>
struct RowGradSums {
  C mean_g, mean_gx;
  __device__ __forceinline__ RowGradSums(const SumPairState<C>& s, int64 cols)
      : mean_g(s.first / static_cast<C>(cols)), mean_gx(s.second / static_cast<C>(cols)) {}
};

// Backward, warp path: dy and xhat of the row in registers; with
// fuse_param_grad each lane also sums dy * xhat and dy for its columns over
// all its rows, then the groups of the block add theirs in group order through
// shared memory (2 * blockDim.y * cols compute values) into the block's
// workspace row.
template <typename IO, typename C, int pack_size, int max_cols_per_thread, int min_cols_per_thread, int width,
          int rows_per_access, bool padding, bool fuse_param_grad>
__device__ __forceinline__ void norm_grad_warp(const IO& io, int64 rows, int64 cols) {
  constexpr int max_packs = max_cols_per_thread / pack_size;
  constexpr int min_packs = min_cols_per_thread / pack_size;
  C dy_buf[rows_per_access][max_cols_per_thread];
  C xhat_buf[rows_per_access][max_cols_per_thread];
  C weight_part[fuse_param_grad ? max_cols_per_thread : 1];
  C bias_part[fuse_param_grad ? max_cols_per_thread : 1];
  if constexpr (fuse_param_grad) {
#pragma unroll
    for (int i = 0; i < max_cols_per_thread; ++i) weight_part[i] = bias_part[i] = C(0);
  }
  const WarpRows warp_rows = WarpRows::make<width, rows_per_access>();
  const int lane = warp_rows.group_lane;
  for (int64 base = warp_rows.first; base < rows; base += warp_rows.step) {
    const int64 row = base + WarpRows::group_offset<width, rows_per_access>();
    SumPairState<C> sums[rows_per_access];
    RowMoments<C> moments[rows_per_access];
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      sums[r] = SumPairState<C>::empty();
      moments[r] = row + r < rows ? io.moments(row + r) : RowMoments<C>{C(0), C(0)};
#pragma unroll
      for (int p = 0; p < max_packs; ++p) {
        const int64 col = (static_cast<int64>(p) * width + lane) * pack_size;
        const int offset = p * pack_size;
        if (row + r < rows && pack_in_row<padding, min_packs>(p, col, cols)) {
          io.template load<pack_size>(dy_buf[r] + offset, xhat_buf[r] + offset, sums[r], moments[r], row + r, col);
        } else {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) dy_buf[r][offset + i] = xhat_buf[r][offset + i] = C(0);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      const RowGradSums<C> row_sums(warp_all_reduce_state<width>(sums[r]), cols);
      if (row + r >= rows) continue;
#pragma unroll
      for (int p = 0; p < max_packs; ++p) {
        const int64 col = (static_cast<int64>(p) * width + lane) * pack_size;
        const int offset = p * pack_size;
        if (pack_in_row<padding, min_packs>(p, col, cols)) {
          io.template store<pack_size>(dy_buf[r] + offset, xhat_buf[r] + offset, row_sums.mean_g,
                                       row_sums.mean_gx, moments[r].rstd, row + r, col);
        }
      }
      if constexpr (fuse_param_grad) {
#pragma unroll
        for (int i = 0; i < max_cols_per_thread; ++i) {
          weight_part[i] += dy_buf[r][i] * xhat_buf[r][i];
          bias_part[i] += dy_buf[r][i];
        }
      }
    }
  }
  if constexpr (fuse_param_grad) {
    extern __shared__ __align__(16) unsigned char shared_buf[];
    C* weight_smem = reinterpret_cast<C*>(shared_buf);
    C* bias_smem = weight_smem + blockDim.y * cols;
#pragma unroll
    for (int p = 0; p < max_packs; ++p) {
      const int64 col = (static_cast<int64>(p) * width + lane) * pack_size;
      if (pack_in_row<padding, min_packs>(p, col, cols)) {
#pragma unroll
        for (int i = 0; i < pack_size; ++i) {
          weight_smem[threadIdx.y * cols + col + i] = weight_part[p * pack_size + i];
          bias_smem[threadIdx.y * cols + col + i] = bias_part[p * pack_size + i];
        }
      }
    }
    __syncthreads();
    const int tid = threadIdx.y * width + threadIdx.x;
    for (int64 col = tid; col < cols; col += width * blockDim.y) {
      C weight_sum = C(0), bias_sum = C(0);
      for (int y = 0; y < blockDim.y; ++y) {
        weight_sum += weight_smem[y * cols + col];
        bias_sum += bias_smem[y * cols + col];
      }
      const int64 offset = static_cast<int64>(blockIdx.x) * cols + col;
      if (io.weight_partials != nullptr) io.weight_partials[offset] = weight_sum;
      if (io.bias_partials != nullptr) io.bias_partials[offset] = bias_sum;
    }
  }
}

// dweight / dbias partial sums (dy * xhat; dy when centered) of the packs
// k < num_packs a thread owns, over all of its block's rows. In registers, or
// in_smem in the block's dynamic shared memory (the registers then hold rows
// in flight): a thread's slots are its own, so no barrier, laid out in planes
// of 16-byte vectors, [grad][plane][num_packs * block_size], so that the
// threads of a warp touch consecutive vectors.
template <typename C, int pack_size, int num_packs, int block_size, bool centered, bool in_smem>
struct ParamGradPartials {
  static constexpr int grads = centered ? 2 : 1;
  static constexpr int vector_size = pack_size * sizeof(C) < 16 ? pack_size : 16 / sizeof(C);
  static constexpr int planes = pack_size / vector_size;
  static constexpr int slots = num_packs * block_size;
  static constexpr int smem_bytes = in_smem ? grads * slots * pack_size * static_cast<int>(sizeof(C)) : 0;
  typedef Pack<C, vector_size> Vector;
  C regs[grads][in_smem ? 1 : num_packs][pack_size];
  Vector* smem;

  // The vector_size sums of plane `plane` of pack k for gradient `grad`.
  __device__ __forceinline__ C* sums(int grad, int k, int plane) {
    if constexpr (in_smem) {
      return smem[(grad * planes + plane) * slots + k * block_size + threadIdx.x].elem;
    } else {
      return regs[grad][k] + plane * vector_size;
    }
  }
  __device__ __forceinline__ explicit ParamGradPartials(void* shared) : smem(static_cast<Vector*>(shared)) {
#pragma unroll
    for (int g = 0; g < grads; ++g) {
#pragma unroll
      for (int k = 0; k < num_packs; ++k) {
#pragma unroll
        for (int v = 0; v < planes; ++v) {
          C* const sum = sums(g, k, v);
#pragma unroll
          for (int i = 0; i < vector_size; ++i) sum[i] = C(0);
        }
      }
    }
  }
  // Adds a pack's dy * xhat (and dy) to the sums of pack k.
  __device__ __forceinline__ void add(int k, const C* dy, const C* xhat) {
#pragma unroll
    for (int g = 0; g < grads; ++g) {
#pragma unroll
      for (int v = 0; v < planes; ++v) {
        C* const sum = sums(g, k, v);
#pragma unroll
        for (int i = 0; i < vector_size; ++i) {
          const int e = v * vector_size + i;
          sum[i] += g == 0 ? dy[e] * xhat[e] : dy[e];
        }
      }
    }
  }
  // Writes the sums of pack k for gradient `grad` (0: dweight, 1: dbias) to
  // partials[part][col, col + pack_size); aligned = false: col is off the
  // vector grid (a peeled row's packs), element by element.
  template <bool aligned>
  __device__ __forceinline__ void store(C* partials, int64 part, int grad, int k, int64 cols, int64 col) {
    C values[pack_size];
#pragma unroll
    for (int v = 0; v < planes; ++v) {
      const C* const sum = sums(grad, k, v);
#pragma unroll
      for (int i = 0; i < vector_size; ++i) values[v * vector_size + i] = sum[i];
    }
    if constexpr (aligned) {
      DirectStore<C, C>{partials, cols}.template store<pack_size>(values, part, col);
    } else {
#pragma unroll
      for (int i = 0; i < pack_size; ++i) partials[part * cols + col + i] = values[i];
    }
  }
};

// The columns thread threadIdx.x of a backward register block owns in a row
// of `cols`: packs k * block_size + t (k < packs_per_thread) of pack_size
// elements from column `head`. peel (rows off the 16-byte grid): head is
// the row's RowHead, the packs stop at block_size * packs_per_thread, and
// the elements outside them, the head and the rest past the last pack, are
// single "edge" elements held by threads 0, 1, ..., at most one a thread:
// the planner keeps cols <= block_size * (packs_per_thread * pack_size + 1)
// (norm.py: block_packs_per_thread). cluster_size > 1 (rows on the 16-byte
// grid): block `rank` of a thread-block cluster owns the rank-th span of
// block_size * packs_per_thread packs of the row, from column `head` (the
// planner leaves the last block at least one pack).
template <int pack_size, int packs_per_thread, int block_size, bool peel, int cluster_size = 1>
struct BlockRowColumns {
  static_assert(!peel || cluster_size == 1, "a cluster's rows are on the 16-byte grid");
  static constexpr int span_packs = block_size * packs_per_thread;
  int head;
  int64 num_packs;   // packs of the row this block owns (>= 1)
  bool has_edge;
  int64 edge_col;    // 0 without an edge

  __device__ __forceinline__ BlockRowColumns(int64 cols, int row_head, int rank = 0)
      : head(peel ? row_head : rank * span_packs * pack_size) {
    num_packs = (cols - head) / pack_size;
    if ((peel || cluster_size > 1) && num_packs > span_packs) {
      num_packs = span_packs;
    }
    const int64 tail = head + num_packs * pack_size;
    has_edge = peel && threadIdx.x < head + (cols - tail);
    edge_col = !has_edge ? 0 : threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;
  }
  __device__ __forceinline__ bool in_row(int k) const {
    return static_cast<int64>(k) * block_size + threadIdx.x < num_packs;
  }
  // The column of pack k; a pack past the row gives the row's first pack
  // (loaded without a branch, and left out).
  __device__ __forceinline__ int64 pack_col(int k) const {
    return head + (in_row(k) ? (static_cast<int64>(k) * block_size + threadIdx.x) * pack_size : int64(0));
  }
};

// Backward, block-register path: thread t owns packs t, t + block_size, ...;
// a thread's columns are the same in every row. held = true keeps the row's
// dy and x as loaded (the storage type) in registers between the two passes,
// converted at each use; held = false re-reads them (from L1 / L2) for the
// second pass. With fuse_param_grad the owned columns' partial sums
// (ParamGradPartials, in registers or shared memory) are written to the
// block's workspace row at the end. The weight of the owned columns is held
// in registers beside held rows with partials in registers, else read at
// each use (L1 hits). Held rows are loaded rows_per_access at a time, their
// sums reduced together: more loads in flight, one barrier.
// peel: rows off the 16-byte grid, dy, x and dx at the same phase. Every row
// of a block must start at the same phase (one row per block, or a grid that
// is a multiple of the rows' phase period), so the block's first row gives
// the columns each thread owns in every row (BlockRowColumns: 16-byte packs
// between single-element edges). The weight is read at those columns from
// a copy in shared memory at the rows' phase or from its phase copies in
// global memory, weight_phase_stride elements apart (weight_source).
// cluster_size > 1 (sm_90 and newer, rows on the 16-byte grid): the blocks
// of a thread-block cluster share each row, block `rank` owning the rank-th
// span of its columns (BlockRowColumns); their row sums meet through
// distributed shared memory (cluster_all_reduce), and a cluster's blocks
// write the columns of one workspace row (the cluster's index).
template <typename IO, typename C, int pack_size, int packs_per_thread, int block_size, int cluster_size,
          int rows_per_access, bool held, bool fuse_param_grad, bool smem_partials, bool peel, int weight_source,
          typename RowHead>
__device__ __forceinline__ void norm_grad_block_regs(const IO& global_io, int64 rows, int64 cols,
                                                     const RowHead& row_head, int64 weight_phase_stride) {
  typedef typename IO::Storage T;
  typedef typename IO::template Fetched<pack_size> Fetched;
  typedef ParamGradPartials<C, pack_size, fuse_param_grad ? packs_per_thread : 1, block_size, IO::centered,
                            smem_partials> Partials;
  static_assert(held || rows_per_access == 1, "rows in flight together are held");
  static_assert(!peel || !IO::has_weight || weight_source != WEIGHT_DIRECT, "peeled rows read a weight copy");
  // The block's rows are first_row, + row_step, ...; with a cluster, its
  // blocks' rows, indexed and stepped in 32-bit ints (with the grid's
  // unsigned indices stepped in 64 bits, ptxas spilled the float32 LayerNorm
  // block of 1024 x 4 packs).
  typedef typename Select<(cluster_size > 1), int, unsigned>::type RowIndex;
  typedef typename Select<(cluster_size > 1), int, int64>::type RowStep;
  const ClusterRows<cluster_size, RowIndex> block_rows;
  const int rank = block_rows.rank;
  const RowIndex first_row = block_rows.first, row_step = block_rows.step;
  const BlockRowColumns<pack_size, packs_per_thread, block_size, peel, cluster_size> columns(
      cols, peel && blockIdx.x < rows ? row_head(blockIdx.x) : 0, rank);
  const auto in_row = [&](int k) { return columns.in_row(k); };
  const auto pack_col = [&](int k) { return columns.pack_col(k); };
  const bool has_edge = columns.has_edge;
  const int64 edge_col = columns.edge_col;

  extern __shared__ __align__(16) unsigned char shared_buf[];
  Partials partials(shared_buf);
  ParamGradPartials<C, 1, 1, 1, IO::centered, false> edge_partials(nullptr);
  IO io = global_io;
  if constexpr (peel && IO::has_weight && weight_source == WEIGHT_SHARED_COPY) {
    io = io.template with_weight_copied<pack_size>(reinterpret_cast<T*>(shared_buf + Partials::smem_bytes), cols,
                                                   columns.head);
  } else if constexpr (peel && IO::has_weight && weight_source == WEIGHT_PHASE_COPIES) {
    io = io.reading_weight(io.weight + weight_phase_offset<pack_size>(columns.head, weight_phase_stride));
  }
  constexpr bool hoist_weight = held && !smem_partials;
  // A pass over a thread's packs goes through chunks of packs_unrolled,
  // each unrolled: one chunk of all of them, but chunks of 2 for rows read
  // twice with their partials in shared memory (nothing indexed by pack in
  // registers), whose loads ptxas otherwise hoists all at once and spills
  // (RMSNorm float32, 1024 threads x 14 packs: 48 bytes). H200, rows 49152,
  // % of copy, chunks of 2 against 4 / 1: LayerNorm f32 49152 cols 71.2
  // against 68.0 / 68.2, f64 16384 77.0 against 76.7 / 67.2; RMSNorm f16
  // 98304 70.0 against 66.1 / 66.5 (float32 65536: chunks of 4 spill).
  constexpr int packs_unrolled = held || !smem_partials ? packs_per_thread : 2;
  Pack<T, pack_size> weight[hoist_weight ? packs_per_thread : 1];
  if constexpr (hoist_weight) {
#pragma unroll
    for (int k = 0; k < packs_per_thread; ++k) weight[k] = io.template weight_pack<pack_size>(pack_col(k));
  }
  // dy, xhat and the weights of pack k (in the row or not) of the block's
  // row r in flight, `row`, from the held packs or loaded again; g = dy *
  // weight and g * xhat added to sums.
  Fetched packs[rows_per_access][held ? packs_per_thread : 1];
  const auto owned_weight = [&](int k) {
    if constexpr (hoist_weight) {
      return weight[k];
    } else {
      return io.template weight_pack<pack_size>(pack_col(k));
    }
  };
  const auto row_pack = [&](int r, int k, int64 row) {
    if constexpr (held) {
      return packs[r][k];
    } else {
      return io.template fetch<pack_size>(row, pack_col(k));
    }
  };
  const auto pack_values = [&](int r, int k, int64 row, const RowMoments<C>& m, C* dy, C* xhat, C* w,
                               SumPairState<C>& sums) {
    io.template weights_of<pack_size>(owned_weight(k), w);
    io.template convert<pack_size>(row_pack(r, k, row), w, dy, xhat, sums, m);
  };
  // rows_per_access of the block's rows are loaded before their sums share
  // one block reduction.
  int parity = 0;
  for (int64 first = first_row; first < rows; first += static_cast<RowStep>(row_step) * rows_per_access,
             parity ^= 1) {
    const auto row_of = [&](int r) { return first + static_cast<RowStep>(r) * row_step; };
    RowMoments<C> m[rows_per_access];
    typename IO::template Fetched<1> edge[rows_per_access]{};
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      const int64 row = row_of(r);
      if (row >= rows) continue;
      if constexpr (held) {
#pragma unroll
        for (int k = 0; k < packs_per_thread; ++k) packs[r][k] = io.template fetch<pack_size>(row, pack_col(k));
      }
      if constexpr (peel) edge[r] = io.template fetch<1>(row, edge_col);
      m[r] = io.moments(row);
    }
    StateArray<SumPairState<C>, rows_per_access> sums = StateArray<SumPairState<C>, rows_per_access>::empty();
    C edge_dy[rows_per_access], edge_xhat[rows_per_access], edge_w[rows_per_access];
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      const int64 row = row_of(r);
      if (row >= rows) continue;
#pragma unroll 1
      for (int first_pack = 0; first_pack < packs_per_thread; first_pack += packs_unrolled) {
#pragma unroll
        for (int k = first_pack; k < first_pack + packs_unrolled && k < packs_per_thread; ++k) {
          C dy[pack_size], xhat[pack_size], w[pack_size];
          SumPairState<C> pack_sums = SumPairState<C>::empty();
          pack_values(r, k, row, m[r], dy, xhat, w, pack_sums);
          if (in_row(k)) sums.part[r].combine(pack_sums);
        }
      }
      if constexpr (peel) {
        SumPairState<C> edge_sums = SumPairState<C>::empty();
        io.template weights_of<1>(io.template weight_pack<1>(edge_col), &edge_w[r]);
        io.template convert<1>(edge[r], &edge_w[r], &edge_dy[r], &edge_xhat[r], edge_sums, m[r]);
        if (has_edge) sums.part[r].combine(edge_sums);
      }
    }
    auto totals = block_all_reduce_state<block_size>(sums, parity);
    if constexpr (cluster_size > 1) {
      totals = cluster_all_reduce<cluster_size>(totals, parity, [](auto total, const auto& next) {
        total.combine(next);
        return total;
      });
    }
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      const int64 row = row_of(r);
      if (row >= rows) continue;
      const RowGradSums<C> row_sums(totals.part[r], cols);
#pragma unroll 1
      for (int first_pack = 0; first_pack < packs_per_thread; first_pack += packs_unrolled) {
#pragma unroll
        for (int k = first_pack; k < first_pack + packs_unrolled && k < packs_per_thread; ++k) {
          if (!in_row(k)) continue;
          C dy[pack_size], xhat[pack_size], w[pack_size];
          SumPairState<C> unused = SumPairState<C>::empty();
          pack_values(r, k, row, m[r], dy, xhat, w, unused);
          io.template store_with<pack_size>(w, dy, xhat, row_sums.mean_g, row_sums.mean_gx, m[r].rstd, row,
                                            pack_col(k));
          if constexpr (fuse_param_grad) partials.add(k, dy, xhat);
        }
      }
      if (has_edge) {
        io.template store_with<1>(&edge_w[r], &edge_dy[r], &edge_xhat[r], row_sums.mean_g, row_sums.mean_gx,
                                  m[r].rstd, row, edge_col);
        if constexpr (fuse_param_grad) edge_partials.add(0, &edge_dy[r], &edge_xhat[r]);
      }
    }
  }
  if constexpr (fuse_param_grad) {
    C* const workspaces[2] = {io.weight_partials, io.bias_partials};
#pragma unroll
    for (int g = 0; g < (IO::centered ? 2 : 1); ++g) {
      if (workspaces[g] == nullptr) continue;
#pragma unroll
      for (int k = 0; k < packs_per_thread; ++k) {
        if (in_row(k)) partials.template store<!peel>(workspaces[g], first_row, g, k, cols, pack_col(k));
      }
      if (has_edge) edge_partials.template store<false>(workspaces[g], first_row, g, 0, cols, edge_col);
    }
  }
  // No block leaves while another of its cluster may still read its published sums.
  if constexpr (cluster_size > 1) cluster_sync_before_exit();
}

// Backward, block-shared-memory path (dx only): dy and xhat of the row cached
// in dynamic shared memory as compute-type packs, 2 * cols values.
template <typename IO, typename C, int pack_size, int block_size>
__device__ __forceinline__ void norm_grad_block_smem(const IO& io, int64 rows, int64 cols) {
  extern __shared__ __align__(16) unsigned char shared_buf[];
  const int num_packs = static_cast<int>(cols / pack_size);
  Pack<C, pack_size>* dy_cache = reinterpret_cast<Pack<C, pack_size>*>(shared_buf);
  Pack<C, pack_size>* xhat_cache = dy_cache + num_packs;
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const RowMoments<C> m = io.moments(row);
    SumPairState<C> sums = SumPairState<C>::empty();
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      io.template load<pack_size>(dy_cache[p].elem, xhat_cache[p].elem, sums, m, row,
                                  static_cast<int64>(p) * pack_size);
    }
    const RowGradSums<C> row_sums(block_all_reduce_state<block_size>(sums), cols);
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      io.template store<pack_size>(dy_cache[p].elem, xhat_cache[p].elem, row_sums.mean_g, row_sums.mean_gx,
                                   m.rstd, row, static_cast<int64>(p) * pack_size);
    }
  }
}

// Backward, uncached path (dx only): the row is read twice.
template <typename IO, typename C, int pack_size, int block_size>
__device__ __forceinline__ void norm_grad_block_uncached(const IO& io, int64 rows, int64 cols) {
  const int64 num_packs = cols / pack_size;
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const RowMoments<C> m = io.moments(row);
    SumPairState<C> sums = SumPairState<C>::empty();
    for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
      C dy_pack[pack_size], xhat[pack_size];
      io.template load<pack_size>(dy_pack, xhat, sums, m, row, p * pack_size);
    }
    const RowGradSums<C> row_sums(block_all_reduce_state<block_size>(sums), cols);
    for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
      C dy_pack[pack_size], xhat[pack_size];
      SumPairState<C> unused = SumPairState<C>::empty();
      io.template load<pack_size>(dy_pack, xhat, unused, m, row, p * pack_size);
      io.template store<pack_size>(dy_pack, xhat, row_sums.mean_g, row_sums.mean_gx, m.rstd, row, p * pack_size);
    }
  }
}

// ---------------------------------------------------------------------------
// dweight / dbias without a fused dx kernel: block (32, kParamGradRows)
// sums dy * xhat and dy over one chunk of rows for 32 columns, combines the
// row lanes in order through shared memory and writes workspace row
// blockIdx.y. The chunks are [blockIdx.y * rows_per_chunk, ...).
constexpr int kParamGradRows = 32;

template <typename IO, typename C>
__device__ __forceinline__ void norm_param_grad_partials(const IO& io, int64 rows, int64 cols,
                                                         int64 rows_per_chunk) {
  __shared__ C weight_smem[kParamGradRows][33];
  __shared__ C bias_smem[kParamGradRows][33];
  const int64 col = static_cast<int64>(blockIdx.x) * 32 + threadIdx.x;
  const int64 first = static_cast<int64>(blockIdx.y) * rows_per_chunk;
  const int64 last = min(rows, first + rows_per_chunk);
  C weight_sum = C(0), bias_sum = C(0);
  if (col < cols) {
    for (int64 row = first + threadIdx.y; row < last; row += kParamGradRows) {
      C dy_value, xhat;
      SumPairState<C> unused = SumPairState<C>::empty();
      io.template load<1>(&dy_value, &xhat, unused, io.moments(row), row, col);
      weight_sum += dy_value * xhat;
      bias_sum += dy_value;
    }
  }
  weight_smem[threadIdx.y][threadIdx.x] = weight_sum;
  bias_smem[threadIdx.y][threadIdx.x] = bias_sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int y = 1; y < kParamGradRows; ++y) {
      weight_sum += weight_smem[y][threadIdx.x];
      bias_sum += bias_smem[y][threadIdx.x];
    }
    const int64 offset = static_cast<int64>(blockIdx.y) * cols + col;
    if (io.weight_partials != nullptr) io.weight_partials[offset] = weight_sum;
    if (io.bias_partials != nullptr) io.bias_partials[offset] = bias_sum;
  }
}

// Sums the [num_parts, cols] partials column by column in a fixed order:
// row lane y adds parts y, y + 32, ..., then the lanes are added in order.
template <typename T, typename C>
__device__ __forceinline__ void norm_param_grad_finish(const C* partials, int64 num_parts, int64 cols, T* grad) {
  __shared__ C smem[kParamGradRows][33];
  const int64 col = static_cast<int64>(blockIdx.x) * 32 + threadIdx.x;
  C sum = C(0);
  if (col < cols) {
    for (int64 part = threadIdx.y; part < num_parts; part += kParamGradRows) sum += partials[part * cols + col];
  }
  smem[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int y = 1; y < kParamGradRows; ++y) sum += smem[y][threadIdx.x];
    grad[col] = cast<T>(sum);
  }
}

}  // namespace cupyops
