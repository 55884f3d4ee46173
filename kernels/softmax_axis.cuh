// Softmax and log-softmax over the middle axis of a C-contiguous array seen
// as (outer, cols, inner), without a transpose copy.
//
// A slice is the `cols` elements x[o, :, i], `inner` elements apart. A block
// owns a tile: one `o` and block_x * pack_size consecutive `i` (threadIdx.x
// picks a pack along inner, so a warp reads whole sectors of consecutive
// rows), and splits the tile's rows among its block_y rows of threads
// (threadIdx.y takes rows y, y + block_y, ...). Each thread reduces its rows
// of each slice of its pack; the block combines them through shuffles and
// shared memory, then writes the outputs through RowSoftmax, so NaN and
// +-inf slices end as in scipy.special (and as the row-wise paths).
//
// cached = true: the tile is loaded into dynamic shared memory ([cols][block_x]
//   packs; with loads_in_flight = 0 by cp.async, else through registers), then
//   a max pass, a sum pass and the output pass read it from there: one read
//   of the array, one exponential per element per pass that needs it.
// cached = false: a running (max, sum) per slice over the array (one
//   exponential per element), then the output pass reads the array again
//   (two reads, one write).
#pragma once
#include "common.cuh"
#include "reduce.cuh"
#include "softmax.cuh"

namespace cupyops {

// Running maximum m and s = sum(exp(x - m)) of one slice, fed one element at
// a time with one exponential each. Ends where a max pass and a sum pass
// would: m is NaN when any element is NaN, s is NaN when m is +inf (the term
// exp(inf - inf)), s is 0 while every element is -inf.
template <typename C>
struct RunningSoftmax {
  C max = -infinity<C>();
  C sum = C(0);
  __device__ __forceinline__ void add(C x) {
    const C new_max = MaxOp<C>()(max, x);
    if (new_max == -infinity<C>()) return;  // nothing but -inf so far: the sum stays 0
    const bool grows = x > max;             // false when x or max is NaN
    const C e = exp_(grows ? max - x : x - new_max);
    // x's own term when it becomes the maximum is exp(x - x): 1, or NaN for x = +inf.
    sum = grows ? sum * e + (x - x + C(1)) : sum + e;
    max = new_max;
  }
};

// All-reduces values[pack_size] over the threads of a block column (same
// threadIdx.x): shuffles within each warp, then the warps' partials are folded
// from shared memory in warp order (deterministic). Every thread of the block
// must call it; it ends with a barrier, so it is safe to call repeatedly.
template <template <typename> class Op, typename C, int pack_size, int block_x, int block_y>
__device__ __forceinline__ void column_all_reduce(C (&values)[pack_size]) {
  constexpr int num_threads = block_x * block_y;
  static_assert(num_threads % 32 == 0, "the block must be whole warps");
  static_assert((block_x & (block_x - 1)) == 0 && (block_y & (block_y - 1)) == 0,
                "block_x and block_y must be powers of two");
  constexpr int tile_elems = block_x * pack_size;
  // A warp holds 32 / block_x rows of the block (or part of one row).
  constexpr int rows_per_warp = block_x < 32 ? 32 / block_x : 1;
  constexpr int num_partials = block_y / rows_per_warp;
  __shared__ C partials[num_partials][tile_elems];
  __shared__ C totals[tile_elems];
#pragma unroll
  for (int mask = block_x; mask < 32; mask *= 2) {  // lanes of the same column, other rows
#pragma unroll
    for (int i = 0; i < pack_size; ++i) {
      values[i] = Op<C>()(values[i], __shfl_xor_sync(0xffffffffu, values[i], mask));
    }
  }
  if (threadIdx.y % rows_per_warp == 0) {
#pragma unroll
    for (int i = 0; i < pack_size; ++i) {
      partials[threadIdx.y / rows_per_warp][threadIdx.x * pack_size + i] = values[i];
    }
  }
  __syncthreads();
  for (int e = threadIdx.y * block_x + threadIdx.x; e < tile_elems; e += num_threads) {
    C total = partials[0][e];
#pragma unroll
    for (int w = 1; w < num_partials; ++w) total = Op<C>()(total, partials[w][e]);
    totals[e] = total;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < pack_size; ++i) values[i] = totals[threadIdx.x * pack_size + i];
}

// For rows c = threadIdx.y, threadIdx.y + block_y, ... < cols: load(c) then
// use(c, pack), loading loads_in_flight packs before using the first of them.
template <typename P, int block_y, int loads_in_flight, typename Load, typename Use>
__device__ __forceinline__ void for_rows_batched(int64 cols, const Load& load, const Use& use) {
  for (int64 first = threadIdx.y; first < cols; first += static_cast<int64>(block_y) * loads_in_flight) {
    P packs[loads_in_flight];
#pragma unroll
    for (int u = 0; u < loads_in_flight; ++u) {
      const int64 c = first + u * block_y;
      if (c < cols) packs[u] = load(c);
    }
#pragma unroll
    for (int u = 0; u < loads_in_flight; ++u) {
      const int64 c = first + u * block_y;
      if (c < cols) use(c, packs[u]);
    }
  }
}

template <typename T, typename C, int pack_size, int block_x, int block_y, int loads_in_flight,
          bool cached, Algorithm algorithm>
__device__ __forceinline__ void softmax_axis(const T* x, T* y, int64 outer, int64 cols, int64 inner) {
  typedef Pack<T, pack_size> P;
  // loads_in_flight = 0: the shared-memory tile is filled by cp.async (packs
  // of 4 bytes or more): all of it in flight at once, holding no registers.
  constexpr bool async_fill = cached && loads_in_flight == 0;
  extern __shared__ __align__(16) unsigned char shared_buf[];
  P* const tile_cache = reinterpret_cast<P*>(shared_buf);  // [cols][block_x] when cached
  const int64 inner_packs = inner / pack_size;
  const int64 tiles_per_outer = (inner_packs + block_x - 1) / block_x;
  const int64 num_tiles = outer * tiles_per_outer;

  for (int64 tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64 o = tile / tiles_per_outer;
    const int64 pack_id = (tile - o * tiles_per_outer) * block_x + threadIdx.x;
    const bool active = pack_id < inner_packs;
    const int64 slice_offset = o * cols * inner + pack_id * pack_size;
    const T* const src = x + slice_offset;
    T* const dst = y + slice_offset;
    const auto load_global = [&](int64 c) { return load_pack<T, pack_size>(src + c * inner); };
    const auto cached_pack = [&](int64 c) -> P& { return tile_cache[c * block_x + threadIdx.x]; };

    // The slices' (max, sum): cached, a max pass then a sum pass over the
    // tile in shared memory; otherwise one pass over the array keeping a
    // running (max, sum) per thread. The block's rows are combined through
    // column_all_reduce: the maximum first, then every thread's sum rescaled
    // to it (0 where the thread saw only -inf).
    C slice_max[pack_size], slice_sum[pack_size];
    if constexpr (cached) {
      if (active) {
        if constexpr (async_fill) {
          for (int64 c = threadIdx.y; c < cols; c += block_y) {
            cp_async_pack<sizeof(P)>(&cached_pack(c), src + c * inner);
          }
          cp_async_wait_all();
        } else {
          // cached: the tile's cols fit in shared memory, so an int index
#pragma unroll loads_in_flight
          for (int c = threadIdx.y; c < cols; c += block_y) store_pack_shared(cached_pack(c).elem, load_global(c));
        }
      }
#pragma unroll
      for (int i = 0; i < pack_size; ++i) slice_max[i] = -infinity<C>();
      if (active) {
        for (int64 c = threadIdx.y; c < cols; c += block_y) {
          const P pack = load_pack<T, pack_size>(cached_pack(c).elem);
#pragma unroll
          for (int i = 0; i < pack_size; ++i) slice_max[i] = MaxOp<C>()(slice_max[i], cast<C>(pack.elem[i]));
        }
      }
      if (block_y > 1) column_all_reduce<MaxOp, C, pack_size, block_x, block_y>(slice_max);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) slice_sum[i] = C(0);
      if (active) {
        for (int64 c = threadIdx.y; c < cols; c += block_y) {
          const P pack = load_pack<T, pack_size>(cached_pack(c).elem);
#pragma unroll
          for (int i = 0; i < pack_size; ++i) {
            slice_sum[i] += RowSoftmax<algorithm, C>::exp_term(cast<C>(pack.elem[i]), slice_max[i]);
          }
        }
      }
    } else {
      RunningSoftmax<C> state[pack_size];
      if (active) {
        for_rows_batched<P, block_y, loads_in_flight>(cols, load_global, [&](int64, const P& pack) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) state[i].add(cast<C>(pack.elem[i]));
        });
      }
#pragma unroll
      for (int i = 0; i < pack_size; ++i) slice_max[i] = state[i].max;
      if (block_y > 1) column_all_reduce<MaxOp, C, pack_size, block_x, block_y>(slice_max);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) {
        slice_sum[i] = block_y == 1 ? state[i].sum
                       : state[i].max == -infinity<C>() ? C(0)
                       : state[i].sum * exp_(state[i].max - slice_max[i]);
      }
    }
    if (block_y > 1) column_all_reduce<SumOp, C, pack_size, block_x, block_y>(slice_sum);

    // Pass 2: outputs, from the shared-memory tile or from the array again. A
    // thread reads only the elements it writes (and the cache slots it
    // filled), so out = x and the cache need no further barrier.
    if (active) {
      RowSoftmax<algorithm, C> finish[pack_size];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) finish[i] = RowSoftmax<algorithm, C>(slice_max[i], slice_sum[i]);
      const auto store_output = [&](int64 c, const P& pack) {
        P result;
#pragma unroll
        for (int i = 0; i < pack_size; ++i) {
          result.elem[i] = cast<T>(finish[i].from_input(cast<C>(pack.elem[i])));
        }
        store_pack(dst + c * inner, result);   // one vector store (a struct copy may split)
      };
      if constexpr (cached) {
        for (int64 c = threadIdx.y; c < cols; c += block_y) {
          store_output(c, load_pack<T, pack_size>(cached_pack(c).elem));
        }
      } else {
        for_rows_batched<P, block_y, loads_in_flight>(cols, load_global, store_output);
      }
    }
  }
}

}  // namespace cupyops
