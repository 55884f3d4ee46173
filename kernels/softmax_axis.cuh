// Softmax and log-softmax, forward and backward, over the middle axis of a
// C-contiguous array seen as (outer, cols, inner), without a transpose copy.
//
// A slice is the `cols` elements x[o, :, i], `inner` elements apart. A block
// owns a tile: one `o` and block_x * pack_size consecutive `i` (threadIdx.x
// picks a pack along inner, so a warp reads whole sectors of consecutive
// rows), and splits the tile's rows among its block_y rows of threads
// (threadIdx.y takes rows y, y + block_y, ...). Each thread reduces its rows
// of each slice of its pack; the block combines them through shuffles and
// shared memory, then writes the outputs.
//
// The kernel is written once for a slice operation (Op, kernels/softmax.cuh):
// SoftmaxForward (input x) reduces a maximum, then a sum, and writes through
// RowSoftmax, so NaN and +-inf slices end as in scipy.special (and as the
// row-wise paths); SoftmaxBackward (inputs dy, y) reduces one sum.
//
// cached = true: the tile of every input is loaded into dynamic shared memory
//   ([input][rows][block_x] packs; with loads_in_flight = 0 by cp.async, in
//   kAxisFillStages stages forward, else through registers), then every pass
//   reads it from there: one read of the arrays, one exponential per element
//   per pass that needs it. Forward, each thread reduces its rows stage by
//   stage to a running (max, sum), then the block combines them.
// cached = false: forward, a running (max, sum) per slice over the array (one
//   exponential per element); backward, a sum pass; then the output pass reads
//   the arrays again (two reads, one write).
//
// cluster_size > 1 (sm_90 and newer, cached only): the blocks of a thread-block
//   cluster share a tile. Block `rank` caches and reduces rows [rank *
//   block_rows, (rank + 1) * block_rows) of it (block_rows = cols /
//   cluster_size rounded up), then the blocks combine their reductions through
//   distributed shared memory (cluster_slice_reduce) and each writes its rows.
//   Smaller shares let several blocks reside on an SM, so one block's loads
//   overlap another's writes.
#pragma once
#include "cluster.cuh"
#include "common.cuh"
#include "reduce.cuh"
#include "softmax.cuh"

namespace cupyops {

// Stages of a forward tile's cp.async fill: a thread reduces a stage's rows
// while the later stages' are in flight. H200, % of copy, a max pass then a
// sum pass over the whole tile -> two stages: (64, 1024, 1024) float32
// softmax 88.8 -> 91.3, (64, 4096, 256) float16 log_softmax 78.6 -> 81.0,
// softmax 79.1 -> 79.2, (128, 4096, 256) float16 softmax 85.6 -> 85.0; one,
// three or four stages no better.
constexpr int kAxisFillStages = 2;

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

// Sets values[i] to fold(e) for element e = threadIdx.x * pack_size + i of a
// tile row: the block's threads fold the row's elements (e, e + threads, ...)
// into shared memory, then every thread reads those of its pack. Every thread
// of the block must call it, past a barrier that makes fold's inputs visible.
template <typename V, int pack_size, int block_x, int block_y, typename Fold>
__device__ __forceinline__ void fold_tile_row(V (&values)[pack_size], const Fold& fold) {
  constexpr int tile_elems = block_x * pack_size;
  __shared__ V totals[tile_elems];
  for (int e = threadIdx.y * block_x + threadIdx.x; e < tile_elems; e += block_x * block_y) totals[e] = fold(e);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < pack_size; ++i) values[i] = totals[threadIdx.x * pack_size + i];
}

// All-reduces values[pack_size] over the threads of a block column (same
// threadIdx.x): shuffles within each warp, then the warps' partials are folded
// from shared memory in warp order (deterministic). Every thread of the block
// must call it; it is safe to call repeatedly (a call writes the totals the
// previous one read only past its own barrier).
template <template <typename> class Op, typename C, int pack_size, int block_x, int block_y>
__device__ __forceinline__ void column_all_reduce(C (&values)[pack_size]) {
  constexpr int num_threads = block_x * block_y;
  static_assert(num_threads % 32 == 0, "the block must be whole warps");
  static_assert((block_x & (block_x - 1)) == 0 && (block_y & (block_y - 1)) == 0,
                "block_x and block_y must be powers of two");
  // A warp holds 32 / block_x rows of the block (or part of one row).
  constexpr int rows_per_warp = block_x < 32 ? 32 / block_x : 1;
  constexpr int num_partials = block_y / rows_per_warp;
  __shared__ C partials[num_partials][block_x * pack_size];
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
  fold_tile_row<C, pack_size, block_x, block_y>(values, [](int e) {
    C total = partials[0][e];
#pragma unroll
    for (int w = 1; w < num_partials; ++w) total = Op<C>()(total, partials[w][e]);
    return total;
  });
}

// Reduces values[pack_size] -- this block's totals of its tile column, the
// same in every row of threads -- over the blocks of the cluster: each block
// publishes its totals in its shared memory, then folds every block's with
// combine in rank order (kernels/cluster.cuh), so all blocks end with the same
// bits. The published totals alternate between two buffers by `parity` (the
// tile's count, mod 2): a block publishing tile t + 2 has passed tile t + 1's
// cluster barrier, which every block reaches only after reading tile t's.
template <typename V, int pack_size, int block_x, int block_y, int cluster_size, typename Combine>
__device__ __forceinline__ void cluster_column_reduce(V (&values)[pack_size], unsigned parity,
                                                      const Combine& combine) {
  __shared__ V published[2][block_x * pack_size];
  if (threadIdx.y == 0) {
#pragma unroll
    for (int i = 0; i < pack_size; ++i) published[parity][threadIdx.x * pack_size + i] = values[i];
  }
  cluster_sync();
  fold_tile_row<V, pack_size, block_x, block_y>(
      values, [&](int e) { return fold_cluster<cluster_size>(published[parity][e], combine); });
}

// The slices' reductions of a tile from those of its cluster's blocks
// (cluster_column_reduce). Forward: each block's (maximum, sum of exp(x - its
// maximum)), combined as OnlineSoftmaxState combines pairs, so NaN and +-inf
// end as in one block's max and sum passes; a block that saw only -inf adds 0
// (its sum pass summed exp(-inf - -inf), NaN). Backward: the sums.
template <typename Op, typename C, int pack_size, int block_x, int block_y, int cluster_size>
__device__ __forceinline__ void cluster_slice_reduce(Op (&ops)[pack_size], const C (&block_max)[pack_size],
                                                     C (&slice_sum)[pack_size], unsigned parity) {
  if constexpr (Op::needs_max) {
    typedef OnlineSoftmaxState<C, typename Op::Exp> State;
    State state[pack_size];
#pragma unroll
    for (int i = 0; i < pack_size; ++i) {
      state[i] = {block_max[i], block_max[i] == -infinity<C>() ? C(0) : slice_sum[i]};
    }
    cluster_column_reduce<State, pack_size, block_x, block_y, cluster_size>(state, parity, State::combined);
#pragma unroll
    for (int i = 0; i < pack_size; ++i) {
      ops[i].set_max(state[i].max);
      slice_sum[i] = state[i].sum;
    }
  } else {
    cluster_column_reduce<C, pack_size, block_x, block_y, cluster_size>(slice_sum, parity, SumOp<C>());
  }
}

// The packs of every input at one row of a thread's tile column.
template <typename T, int pack_size, int num_inputs>
struct InputPacks {
  Pack<T, pack_size> input[num_inputs];
};

// For rows c = threadIdx.y, threadIdx.y + block_y, ... < cols: load(c) then
// use(c, packs), loading loads_in_flight rows before using the first of them.
template <typename Packs, int block_y, int loads_in_flight, typename Load, typename Use>
__device__ __forceinline__ void for_rows_batched(int64 cols, const Load& load, const Use& use) {
  for (int64 first = threadIdx.y; first < cols; first += static_cast<int64>(block_y) * loads_in_flight) {
    Packs packs[loads_in_flight];
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

// Op (kernels/softmax.cuh) over the slices of `inputs`, written to `out`.
template <typename Op, typename T, typename C, int pack_size, int block_x, int block_y, int loads_in_flight,
          bool cached, int cluster_size>
__device__ __forceinline__ void softmax_axis(const T* const (&inputs)[Op::num_inputs], T* out, int64 outer,
                                             int64 cols, int64 inner) {
  static_assert(cluster_size == 1 || cached, "a cluster's blocks cache their rows of the tile");
  constexpr int N = Op::num_inputs;
  typedef Pack<T, pack_size> P;
  typedef InputPacks<T, pack_size, N> Packs;
  // loads_in_flight = 0: the shared-memory tile is filled by cp.async (packs
  // of 4 bytes or more): all of it in flight at once, holding no registers.
  constexpr bool async_fill = cached && loads_in_flight == 0;
  extern __shared__ __align__(16) unsigned char shared_buf[];
  P* const tile_cache = reinterpret_cast<P*>(shared_buf);  // [input][block_rows][block_x] when cached
  const int64 inner_packs = inner / pack_size;
  const int64 tiles_per_outer = (inner_packs + block_x - 1) / block_x;
  const int64 num_tiles = outer * tiles_per_outer;
  // A cluster's blocks walk the same tiles, each caching its rank's rows of
  // them; a block alone caches all the rows. Used when cached: the rows fit in
  // shared memory, so ints.
  int64 first_tile = blockIdx.x, tile_step = gridDim.x;
  int rank = 0;
  if constexpr (cluster_size > 1) {
    first_tile = cluster_index_x();
    tile_step = num_clusters_x();
    rank = cluster_rank();
  }
  const int block_rows = static_cast<int>((cols + cluster_size - 1) / cluster_size);
  const int row_begin = rank * block_rows;
  const int row_end = static_cast<int>(min(cols, static_cast<int64>(row_begin) + block_rows));

  // A cached tile's rows in fill_stages stages of stage_rows consecutive rows
  // (whole rows of threads): for_stage_rows(stage, f) calls f(c) for this
  // thread's rows c of the stage.
  constexpr int fill_stages = async_fill && Op::needs_max ? kAxisFillStages : 1;
  const int stage_rows = ((row_end - row_begin + block_y - 1) / block_y + fill_stages - 1) / fill_stages * block_y;
  const auto for_stage_rows = [&](int stage, const auto& f) {
    const int end = min(row_end, row_begin + (stage + 1) * stage_rows);
    for (int c = row_begin + stage * stage_rows + threadIdx.y; c < end; c += block_y) f(c);
  };

  unsigned parity = 0;
  for (int64 tile = first_tile; tile < num_tiles; tile += tile_step, parity ^= 1) {
    const int64 o = tile / tiles_per_outer;
    const int64 pack_id = (tile - o * tiles_per_outer) * block_x + threadIdx.x;
    const bool active = pack_id < inner_packs;
    const int64 slice_offset = o * cols * inner + pack_id * pack_size;
    const auto load_global = [&](int64 c) {
      Packs packs;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        packs.input[j] = load_pack<T, pack_size>(inputs[j] + slice_offset + c * inner);
      }
      return packs;
    };
    const auto cached_pack = [&](int j, int c) -> P& {
      return tile_cache[(j * block_rows + c - row_begin) * block_x + threadIdx.x];
    };
    const auto cached_row = [&](int c) {
      Packs packs;
#pragma unroll
      for (int j = 0; j < N; ++j) packs.input[j] = load_pack<T, pack_size>(cached_pack(j, c).elem);
      return packs;
    };
    // use(c, packs) for each of this thread's rows of the tile, read from the
    // shared-memory tile when cached, else from the arrays.
    const auto for_each_row = [&](const auto& use) {
      if constexpr (cached) {
        for (int c = row_begin + threadIdx.y; c < row_end; c += block_y) use(c, cached_row(c));
      } else {
        for_rows_batched<Packs, block_y, loads_in_flight>(cols, load_global, use);
      }
    };
    // Element i of every input, in the compute type.
    const auto element = [](const Packs& packs, int i, C (&v)[N]) {
#pragma unroll
      for (int j = 0; j < N; ++j) v[j] = cast<C>(packs.input[j].elem[i]);
    };

    if constexpr (async_fill) {
      // One cp.async group a stage; the forward reduces each stage's rows
      // while the later stages' are still in flight.
#pragma unroll
      for (int stage = 0; stage < fill_stages; ++stage) {
        if (active) {
          for_stage_rows(stage, [&](int c) {
#pragma unroll
            for (int j = 0; j < N; ++j) {
              cp_async_pack<sizeof(P)>(&cached_pack(j, c), inputs[j] + slice_offset + c * inner);
            }
          });
        }
        cp_async_commit();
      }
      if constexpr (!Op::needs_max) cp_async_wait_all();
    } else if constexpr (cached) {
      if (active) {
#pragma unroll loads_in_flight
        for (int c = row_begin + threadIdx.y; c < row_end; c += block_y) {
          const Packs packs = load_global(c);
#pragma unroll
          for (int j = 0; j < N; ++j) store_pack_shared(cached_pack(j, c).elem, packs.input[j]);
        }
      }
    }

    // The slices' sums (and first, forward, their maxima), each thread's rows
    // combined through column_all_reduce. Forward: each thread keeps a
    // running (max, sum) per slice -- online, one exponential per element;
    // cached, a max then a sum over each fill stage's rows, the sum so far
    // rescaled where the stage raises the max -- then the block's sum is
    // every thread's sum rescaled to the block's maximum (0 where the thread
    // saw only -inf). Backward: a pass summing Op's terms.
    Op ops[pack_size];
    C slice_max[pack_size];   // forward: the block's maxima
    C slice_sum[pack_size];
    if constexpr (Op::needs_max) {
      OnlineSoftmaxState<C, typename Op::Exp> state[pack_size];   // this thread's rows
      if constexpr (!cached) {
        static_assert(Op::Exp::natural, "the running sums are natural exponentials");
        RunningSoftmax<C> running[pack_size];
        if (active) {
          for_each_row([&](int64, const Packs& packs) {
#pragma unroll
            for (int i = 0; i < pack_size; ++i) running[i].add(cast<C>(packs.input[0].elem[i]));
          });
        }
#pragma unroll
        for (int i = 0; i < pack_size; ++i) state[i] = {running[i].max, running[i].sum};
      } else {
#pragma unroll
        for (int i = 0; i < pack_size; ++i) state[i] = {-infinity<C>(), C(0)};
#pragma unroll
        for (int stage = 0; stage < fill_stages; ++stage) {
          if constexpr (async_fill) cp_async_wait_at_most<fill_stages - 1>(fill_stages - 1 - stage);
          if (!active) continue;
          P running;   // the stage's maxima in the storage type (pack_max)
#pragma unroll
          for (int i = 0; i < pack_size; ++i) running.elem[i] = cast<T>(-infinity<C>());
          for_stage_rows(stage, [&](int c) { running = pack_max<C>(running, cached_row(c).input[0]); });
#pragma unroll
          for (int i = 0; i < pack_size; ++i) {
            const C new_max = MaxOp<C>()(state[i].max, cast<C>(running.elem[i]));
            if (stage > 0) state[i].sum = state[i].rescaled_to(new_max);   // (the first starts at 0)
            state[i].max = new_max;
            ops[i].set_max(new_max);
          }
          for_stage_rows(stage, [&](int c) {
            const Packs packs = cached_row(c);
#pragma unroll
            for (int i = 0; i < pack_size; ++i) {
              C v[N];
              element(packs, i, v);
              state[i].sum += ops[i].template term<false>(v);
            }
          });
        }
      }
#pragma unroll
      for (int i = 0; i < pack_size; ++i) slice_max[i] = state[i].max;
      if (block_y > 1) column_all_reduce<MaxOp, C, pack_size, block_x, block_y>(slice_max);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) {
        ops[i].set_max(slice_max[i]);
        slice_sum[i] = block_y == 1 ? state[i].sum : state[i].rescaled_to(slice_max[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < pack_size; ++i) slice_sum[i] = C(0);
      if (active) {
        for_each_row([&](int64, const Packs& packs) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) {
            C v[N];
            element(packs, i, v);
            slice_sum[i] += ops[i].template term<false>(v);
          }
        });
      }
    }
    if (block_y > 1) column_all_reduce<SumOp, C, pack_size, block_x, block_y>(slice_sum);
    if constexpr (cluster_size > 1) {
      cluster_slice_reduce<Op, C, pack_size, block_x, block_y, cluster_size>(ops, slice_max, slice_sum, parity);
    }
#pragma unroll
    for (int i = 0; i < pack_size; ++i) ops[i].set_sum(slice_sum[i]);

    // Outputs, from the shared-memory tile or from the arrays again. A thread
    // reads only the elements it writes (and the cache slots it filled), so
    // out may be an input and the cache needs no further barrier. Where every
    // slice of the thread folds (Op::can_fold), through folded_out: H200,
    // (64, 4096, 256) float16 softmax, 78.7 -> 80.3 % of copy.
    const auto write_outputs = [&](auto folded) {
      for_each_row([&](int64 c, const Packs& packs) {
        P result;
#pragma unroll
        for (int i = 0; i < pack_size; ++i) {
          C v[N];
          element(packs, i, v);
          result.elem[i] = cast<T>(uncached_out<decltype(folded)::get>(ops[i], v));
        }
        store_pack(out + slice_offset + c * inner, result);   // one vector store (a struct copy may split)
      });
    };
    if (active) {
      if constexpr (Op::can_fold) {
        bool folds = true;
#pragma unroll
        for (int i = 0; i < pack_size; ++i) folds = folds && ops[i].folds();
        if (folds) {
          write_outputs(Constant<true>());
        } else {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) ops[i].unfold();
          write_outputs(Constant<false>());
        }
      } else {
        write_outputs(Constant<false>());
      }
    }
  }
  // No block leaves while another of its cluster may still read its published totals.
  if constexpr (cluster_size > 1) cluster_sync_before_exit();
}

}  // namespace cupyops
