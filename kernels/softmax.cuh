// Row-wise softmax and log-softmax: the warp path (a row per group of lanes,
// cached in registers), the block paths (a row per block, cached in registers,
// in shared memory filled by cp.async, or in shared memory filled through
// registers) and the uncached path (a row per block, re-read from global memory).
//
// Every path reduces the row maximum with a NaN-propagating max and then
// finishes through RowSoftmax, which reproduces scipy.special's results on
// rows holding NaN or +-inf.
#pragma once
#include "common.cuh"
#include "reduce.cuh"

namespace cupyops {

enum class Algorithm { kSoftmax, kLogSoftmax };

// Finishes one row from its maximum m and s = sum(exp(x - m)).
// softmax:     y = exp(x - m) / s   (NaN for the whole row when m is not finite)
// log-softmax: y = x - lse, lse = m + log(s), or +inf when m is +inf (SciPy
//              shifts by 0 there, so finite x give -inf and x = +inf gives NaN).
template <Algorithm algorithm, typename T>
struct RowSoftmax {
  T max, scale;
  __device__ __forceinline__ RowSoftmax(T row_max, T row_sum) : max(row_max) {
    if (algorithm == Algorithm::kSoftmax) {
      scale = T(1) / row_sum;
    } else {
      scale = row_max == infinity<T>() ? row_max : row_max + log_(row_sum);
    }
  }
  // Term added to the row sum for an element x.
  static __device__ __forceinline__ T exp_term(T x, T row_max) { return exp_(x - row_max); }
  // Output for an element whose cached value is x (or, when the cache holds
  // exp(x - m) for softmax, that value).
  __device__ __forceinline__ T from_input(T x) const {
    return algorithm == Algorithm::kSoftmax ? exp_(x - max) * scale : x - scale;
  }
  __device__ __forceinline__ T from_cached_exp(T e) const { return e * scale; }
};

// Combines (max, sum) pairs of the online softmax.
template <typename T>
struct OnlineSoftmaxState {
  T max, sum;
  __device__ __forceinline__ void add(T other_max, T other_sum) {
    const T new_max = MaxOp<T>()(max, other_max);
    if (new_max == -infinity<T>()) return;  // nothing but -inf so far: the sum stays 0
    sum = sum * exp_(max - new_max) + other_sum * exp_(other_max - new_max);
    max = new_max;
  }
};

// ---------------------------------------------------------------------------
// Warp path: a group of `width` lanes owns `rows_per_access` rows at a time;
// each lane holds cols_per_thread values of each row in registers.
template <typename Load, typename Store, typename C, int pack_size, int cols_per_thread,
          int width, int rows_per_access, bool padding, Algorithm algorithm>
__device__ __forceinline__ void softmax_warp(const Load& load, const Store& store, int64 rows,
                                             int64 cols) {
  static_assert(cols_per_thread % pack_size == 0, "cols_per_thread must be a multiple of pack_size");
  static_assert(width <= 32 && 32 % width == 0, "width must divide the warp size");
  constexpr int num_packs = cols_per_thread / pack_size;
  C buf[rows_per_access][cols_per_thread];
  const int64 group = static_cast<int64>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64 num_groups = static_cast<int64>(gridDim.x) * blockDim.y;
  const int lane = threadIdx.x;
  for (int64 row = group * rows_per_access; row < rows; row += num_groups * rows_per_access) {
    C row_max[rows_per_access];
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      row_max[r] = -infinity<C>();
#pragma unroll
      for (int p = 0; p < num_packs; ++p) {
        const int64 col = (static_cast<int64>(p) * width + lane) * pack_size;
        C* values = buf[r] + p * pack_size;
        if (row + r < rows && (!padding || col < cols)) {
          load.template load<pack_size>(values, row + r, col);
#pragma unroll
          for (int i = 0; i < pack_size; ++i) row_max[r] = MaxOp<C>()(row_max[r], values[i]);
        } else {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) values[i] = -infinity<C>();
        }
      }
    }
    C row_sum[rows_per_access];
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      row_max[r] = warp_all_reduce<MaxOp, C, width>(row_max[r]);
      row_sum[r] = 0;
#pragma unroll
      for (int i = 0; i < cols_per_thread; ++i) {
        const C e = RowSoftmax<algorithm, C>::exp_term(buf[r][i], row_max[r]);
        if (algorithm == Algorithm::kSoftmax) buf[r][i] = e;
        row_sum[r] += e;
      }
    }
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      const RowSoftmax<algorithm, C> finish(row_max[r], warp_all_reduce<SumOp, C, width>(row_sum[r]));
#pragma unroll
      for (int i = 0; i < cols_per_thread; ++i) {
        buf[r][i] = algorithm == Algorithm::kSoftmax ? finish.from_cached_exp(buf[r][i])
                                                     : finish.from_input(buf[r][i]);
      }
#pragma unroll
      for (int p = 0; p < num_packs; ++p) {
        const int64 col = (static_cast<int64>(p) * width + lane) * pack_size;
        if (row + r < rows && (!padding || col < cols)) {
          store.template store<pack_size>(buf[r] + p * pack_size, row + r, col);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Block-register path: a block owns a row; thread t holds packs t,
// t + block_size, ... (packs_per_thread of them) in registers (for softmax,
// exp(x - max) once the maximum is known).
// peel: rows need not start on a pack boundary (odd cols, offset views). Each
// row's first `head` elements (up to its first 16-byte boundary, the same for
// input and output) and its last partial pack are single elements held by
// threads 0, 1, ...; the packs in between are aligned.
template <typename Load, typename Store, typename C, int pack_size, int packs_per_thread,
          int block_size, bool peel, Algorithm algorithm, typename RowHead>
__device__ __forceinline__ void softmax_block_regs(const Load& load, const Store& store, int64 rows,
                                                   int64 cols, const RowHead& row_head) {
  C buf[packs_per_thread * pack_size];
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const int head = peel ? row_head(row) : 0;
    const int64 num_packs = (cols - head) / pack_size;
    const int64 tail = head + num_packs * pack_size;
    const int num_edges = peel ? head + static_cast<int>(cols - tail) : 0;
    const int64 edge_col = threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;
    const bool has_edge = peel && threadIdx.x < num_edges;
    C edge = -infinity<C>();
    if (has_edge) load.template load<1>(&edge, row, edge_col);
    C thread_max = edge;
#pragma unroll
    for (int k = 0; k < packs_per_thread; ++k) {
      const int64 pack_id = static_cast<int64>(k) * block_size + threadIdx.x;
      C* values = buf + k * pack_size;
      if (pack_id < num_packs) {
        load.template load<pack_size>(values, row, head + pack_id * pack_size);
#pragma unroll
        for (int i = 0; i < pack_size; ++i) thread_max = MaxOp<C>()(thread_max, values[i]);
      } else {
#pragma unroll
        for (int i = 0; i < pack_size; ++i) values[i] = -infinity<C>();
      }
    }
    const C row_max = block_all_reduce<MaxOp, C, block_size>(thread_max);
    C thread_sum = 0;
    if (has_edge) {
      const C e = RowSoftmax<algorithm, C>::exp_term(edge, row_max);
      if (algorithm == Algorithm::kSoftmax) edge = e;
      thread_sum = e;
    }
#pragma unroll
    for (int i = 0; i < packs_per_thread * pack_size; ++i) {
      const C e = RowSoftmax<algorithm, C>::exp_term(buf[i], row_max);
      if (algorithm == Algorithm::kSoftmax) buf[i] = e;
      thread_sum += e;
    }
    const RowSoftmax<algorithm, C> finish(row_max, block_all_reduce<SumOp, C, block_size>(thread_sum));
    if (has_edge) {
      edge = algorithm == Algorithm::kSoftmax ? finish.from_cached_exp(edge) : finish.from_input(edge);
      store.template store<1>(&edge, row, edge_col);
    }
#pragma unroll
    for (int k = 0; k < packs_per_thread; ++k) {
      const int64 pack_id = static_cast<int64>(k) * block_size + threadIdx.x;
      C* values = buf + k * pack_size;
      if (pack_id < num_packs) {
#pragma unroll
        for (int i = 0; i < pack_size; ++i) {
          values[i] = algorithm == Algorithm::kSoftmax ? finish.from_cached_exp(values[i])
                                                       : finish.from_input(values[i]);
        }
        store.template store<pack_size>(values, row, head + pack_id * pack_size);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Asynchronous shared-memory path: a block owns a row; each thread copies its
// 16-byte packs (t, t + block_size, ...) straight into shared memory with
// cp.async, so the whole row is in flight without holding registers. With
// stages = 2 the block's next row is fetched while this one is computed. A
// thread only ever reads the packs it copied itself, so the data needs no
// barrier between copy and use.
template <typename Store, typename C, typename T, int pack_size, int block_size, int stages,
          Algorithm algorithm>
__device__ __forceinline__ void softmax_block_async(const T* x, int64 x_row_stride, const Store& store,
                                                    int64 rows, int64 cols) {
  static_assert(pack_size * sizeof(T) == 16, "cp.async moves 16-byte packs");
  extern __shared__ __align__(16) unsigned char shared_buf[];
  typedef Pack<T, pack_size> P;
  const int num_packs = static_cast<int>(cols / pack_size);
  P* const buffers = reinterpret_cast<P*>(shared_buf);
  auto fetch = [&](int64 row, P* buffer) {
    const P* source = reinterpret_cast<const P*>(x + row * x_row_stride);
    for (int p = threadIdx.x; p < num_packs; p += block_size) cp_async_16(buffer + p, source + p);
    cp_async_commit();
  };
  int stage = 0;
  if (blockIdx.x < rows) fetch(blockIdx.x, buffers);
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const P* buffer = buffers + stage * num_packs;
    const int64 next = row + gridDim.x;
    if (stages == 2 && next < rows) {
      fetch(next, buffers + (stage ^ 1) * num_packs);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    C thread_max = -infinity<C>();
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      const P packed = buffer[p];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) thread_max = MaxOp<C>()(thread_max, cast<C>(packed.elem[i]));
    }
    const C row_max = block_all_reduce<MaxOp, C, block_size>(thread_max);
    C thread_sum = 0;
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      const P packed = buffer[p];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) {
        thread_sum += RowSoftmax<algorithm, C>::exp_term(cast<C>(packed.elem[i]), row_max);
      }
    }
    const RowSoftmax<algorithm, C> finish(row_max, block_all_reduce<SumOp, C, block_size>(thread_sum));
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      const P packed = buffer[p];
      C values[pack_size];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[i] = finish.from_input(cast<C>(packed.elem[i]));
      store.template store<pack_size>(values, row, static_cast<int64>(p) * pack_size);
    }
    if (stages == 2) {
      stage ^= 1;
    } else if (next < rows) {
      fetch(next, buffers);
    }
  }
}

// ---------------------------------------------------------------------------
// Block-shared-memory path: a block owns a row, cached in dynamic shared memory.
// packed_cache = false: OneFlow's layout, compute type, element i of pack p at
//   [i * num_packs + p], holding exp(x - max) for softmax after the second pass.
// packed_cache = true: packs of type Cache (the input's storage type: half the
//   shared memory for 16-bit inputs) stored whole at [p], output recomputed from x.
template <typename Load, typename Store, typename C, typename Cache, bool packed_cache,
          int pack_size, int block_size, Algorithm algorithm>
__device__ __forceinline__ void softmax_block_smem(const Load& load, const Store& store, int64 rows,
                                                   int64 cols) {
  extern __shared__ __align__(16) unsigned char shared_buf[];
  const int num_packs = static_cast<int>(cols / pack_size);
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    C thread_max = -infinity<C>();
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      C values[pack_size];
      load.template load<pack_size>(values, row, static_cast<int64>(p) * pack_size);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) thread_max = MaxOp<C>()(thread_max, values[i]);
      if constexpr (!packed_cache) {
        C* cache = reinterpret_cast<C*>(shared_buf);
#pragma unroll
        for (int i = 0; i < pack_size; ++i) cache[i * num_packs + p] = values[i];
      } else {
        Pack<Cache, pack_size> packed;
#pragma unroll
        for (int i = 0; i < pack_size; ++i) packed.elem[i] = cast<Cache>(values[i]);
        reinterpret_cast<Pack<Cache, pack_size>*>(shared_buf)[p] = packed;
      }
    }
    const C row_max = block_all_reduce<MaxOp, C, block_size>(thread_max);
    C thread_sum = 0;
    if constexpr (!packed_cache) {
      C* cache = reinterpret_cast<C*>(shared_buf);
      for (int i = threadIdx.x; i < cols; i += block_size) {
        const C e = RowSoftmax<algorithm, C>::exp_term(cache[i], row_max);
        if (algorithm == Algorithm::kSoftmax) cache[i] = e;
        thread_sum += e;
      }
    } else {
      const Cache* cache = reinterpret_cast<const Cache*>(shared_buf);
      for (int i = threadIdx.x; i < cols; i += block_size) {
        thread_sum += RowSoftmax<algorithm, C>::exp_term(cast<C>(cache[i]), row_max);
      }
    }
    const RowSoftmax<algorithm, C> finish(row_max, block_all_reduce<SumOp, C, block_size>(thread_sum));
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      C values[pack_size];
      if constexpr (!packed_cache) {
        const C* cache = reinterpret_cast<const C*>(shared_buf);
#pragma unroll
        for (int i = 0; i < pack_size; ++i) {
          const C v = cache[i * num_packs + p];
          values[i] = algorithm == Algorithm::kSoftmax ? finish.from_cached_exp(v) : finish.from_input(v);
        }
      } else {
        const Pack<Cache, pack_size> packed = reinterpret_cast<const Pack<Cache, pack_size>*>(shared_buf)[p];
#pragma unroll
        for (int i = 0; i < pack_size; ++i) values[i] = finish.from_input(cast<C>(packed.elem[i]));
      }
      store.template store<pack_size>(values, row, static_cast<int64>(p) * pack_size);
    }
    __syncthreads();  // the next row overwrites the cache
  }
}

// ---------------------------------------------------------------------------
// Uncached path: a block owns a row and reads it from global memory again for
// every pass. online = false: OneFlow's three passes (max, sum, output);
// online = true: two passes, the first keeping a running (max, sum).
template <typename Load, typename Store, typename C, int pack_size, int block_size, bool online,
          Algorithm algorithm>
__device__ __forceinline__ void softmax_block_uncached(const Load& load, const Store& store,
                                                       int64 rows, int64 cols) {
  const int64 num_packs = cols / pack_size;
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    OnlineSoftmaxState<C> state{-infinity<C>(), C(0)};
    for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
      C values[pack_size];
      load.template load<pack_size>(values, row, p * pack_size);
      if (online) {
        C pack_max = values[0];
#pragma unroll
        for (int i = 1; i < pack_size; ++i) pack_max = MaxOp<C>()(pack_max, values[i]);
        C pack_sum = 0;
        if (pack_max != -infinity<C>()) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) pack_sum += exp_(values[i] - pack_max);
        }
        state.add(pack_max, pack_sum);
      } else {
#pragma unroll
        for (int i = 0; i < pack_size; ++i) state.max = MaxOp<C>()(state.max, values[i]);
      }
    }
    C row_max, row_sum;
    if (online) {
      row_max = block_all_reduce<MaxOp, C, block_size>(state.max);
      state.sum = state.max == -infinity<C>() ? C(0) : state.sum * exp_(state.max - row_max);
      row_sum = block_all_reduce<SumOp, C, block_size>(state.sum);
    } else {
      row_max = block_all_reduce<MaxOp, C, block_size>(state.max);
      C thread_sum = 0;
      for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
        C values[pack_size];
        load.template load<pack_size>(values, row, p * pack_size);
#pragma unroll
        for (int i = 0; i < pack_size; ++i) thread_sum += RowSoftmax<algorithm, C>::exp_term(values[i], row_max);
      }
      row_sum = block_all_reduce<SumOp, C, block_size>(thread_sum);
    }
    const RowSoftmax<algorithm, C> finish(row_max, row_sum);
    for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
      C values[pack_size];
      load.template load<pack_size>(values, row, p * pack_size);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[i] = finish.from_input(values[i]);
      store.template store<pack_size>(values, row, p * pack_size);
    }
  }
}

}  // namespace cupyops
