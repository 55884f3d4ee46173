// Softmax and log-softmax, forward and backward, for rows too long for one
// block when too few rows exist to fill the GPU: each row is cut into `splits`
// chunks of chunk_cols columns (the last may be shorter), a block per chunk,
// in two launches over the same grid of rows * splits blocks.
//
// 1. softmax_split_partials: the block of chunk (row, split) reduces it to one
//    partial at [row * splits + split] of a workspace in compute type:
//    forward the online pair (max, sum(exp(x - max))) (two values), combined
//    as the uncached path's online pass combines them (OnlineSoftmaxState),
//    so NaN and +-inf reach RowSoftmax as they would there; backward the sum
//    of the row op's term (dy * y for softmax, dy for log-softmax).
// 2. softmax_split_finish: the block of chunk (row, split) combines the row's
//    partials into the row's (max, sum) -- in the same fixed order in every
//    block of the row, so they agree bit for bit -- then re-reads its chunk
//    and writes the outputs through the row op's out.
//
// Block b works on chunk b in row-major order (the chunks of a row adjacent).
// The finish launch walks the chunks in reverse, so it first re-reads what the
// partials launch read last: the chunks most likely still in L2.
//
// Each thread writes only the packs it has just read itself, and the output
// of an element depends only on the inputs at that element and the row's
// partials, so the output may be one of the inputs (in place).
#pragma once
#include "common.cuh"
#include "reduce.cuh"
#include "softmax.cuh"

namespace cupyops {

// Workspace values per partial: (max, sum) forward, the sum backward.
template <typename Op>
__host__ __device__ constexpr int split_partial_size() { return Op::needs_max ? 2 : 1; }

// The columns [begin, end) of the chunk `chunk` (row-major over rows x splits).
struct SplitChunk {
  int64 row, begin, end;
  __device__ __forceinline__ SplitChunk(int64 chunk, int64 cols, int64 splits, int64 chunk_cols) {
    row = chunk / splits;
    begin = (chunk - row * splits) * chunk_cols;
    end = begin + chunk_cols < cols ? begin + chunk_cols : cols;
  }
};

// Calls use(col, values) for each of this thread's packs (threadIdx.x,
// + block_size, ...) of columns [begin, end) of `row`: col is the pack's first
// column, values[j][i] element i of the pack of input j in compute type.
// loads_in_flight packs of every input are loaded (kept in their storage
// type) before the first of them is used.
template <typename T, typename C, int num_inputs, int pack_size, int block_size, int loads_in_flight,
          typename Load, typename Use>
__device__ __forceinline__ void for_chunk_packs(const Load (&loads)[num_inputs], int64 row, int64 begin,
                                                int64 end, const Use& use) {
  typedef Pack<T, pack_size> P;
  const int64 begin_pack = begin / pack_size;
  const int64 end_pack = end / pack_size;
  for (int64 first = begin_pack + threadIdx.x; first < end_pack;
       first += static_cast<int64>(block_size) * loads_in_flight) {
    P packs[loads_in_flight][num_inputs];
#pragma unroll
    for (int u = 0; u < loads_in_flight; ++u) {
      const int64 col = (first + u * block_size) * pack_size;
      if (col < end) {
#pragma unroll
        for (int j = 0; j < num_inputs; ++j) {
          packs[u][j] = *reinterpret_cast<const P*>(loads[j].src + row * loads[j].row_stride + col);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < loads_in_flight; ++u) {
      const int64 col = (first + u * block_size) * pack_size;
      if (col < end) {
        C values[num_inputs][pack_size];
#pragma unroll
        for (int j = 0; j < num_inputs; ++j) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) values[j][i] = cast<C>(packs[u][j].elem[i]);
        }
        use(col, values);
      }
    }
  }
}

template <typename Op, typename T, typename Load, typename C, int pack_size, int block_size,
          int loads_in_flight>
__device__ __forceinline__ void softmax_split_partials(const Load (&loads)[Op::num_inputs], C* partials,
                                                       int64 cols, int64 splits, int64 chunk_cols) {
  constexpr int N = Op::num_inputs;
  const int64 chunk_id = blockIdx.x;
  const SplitChunk chunk(chunk_id, cols, splits, chunk_cols);
  C* const partial = partials + chunk_id * split_partial_size<Op>();
  if constexpr (Op::needs_max) {
    // Forward: a running (max, sum) per thread, one pack at a time as the
    // uncached path's online pass keeps it.
    OnlineSoftmaxState<C> state{-infinity<C>(), C(0)};
    for_chunk_packs<T, C, N, pack_size, block_size, loads_in_flight>(
        loads, chunk.row, chunk.begin, chunk.end,
        [&](int64, const C (&values)[N][pack_size]) { state.add_pack(values[0]); });
    const OnlineSoftmaxState<C> block = state.template block_all_reduce<block_size>();
    if (threadIdx.x == 0) {
      partial[0] = block.max;
      partial[1] = block.sum;
    }
  } else {
    const Op op{};
    C thread_sum = 0;
    for_chunk_packs<T, C, N, pack_size, block_size, loads_in_flight>(
        loads, chunk.row, chunk.begin, chunk.end, [&](int64, const C (&values)[N][pack_size]) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) {
            C v[N];
#pragma unroll
            for (int j = 0; j < N; ++j) v[j] = values[j][i];
            thread_sum += op.template term<false>(v);
          }
        });
    const C block_sum = block_all_reduce<SumOp, C, block_size>(thread_sum);
    if (threadIdx.x == 0) partial[0] = block_sum;
  }
}

template <typename Op, typename T, typename Load, typename Store, typename C, int pack_size,
          int block_size, int loads_in_flight>
__device__ __forceinline__ void softmax_split_finish(const Load (&loads)[Op::num_inputs], const Store& store,
                                                     const C* partials, int64 cols, int64 splits,
                                                     int64 chunk_cols) {
  constexpr int N = Op::num_inputs;
  constexpr int size = split_partial_size<Op>();
  const int64 chunk_id = static_cast<int64>(gridDim.x) - 1 - blockIdx.x;   // reverse order: see above
  const SplitChunk chunk(chunk_id, cols, splits, chunk_cols);
  const C* const row_partials = partials + chunk.row * splits * size;
  // The row's partials: thread t takes t, t + block_size, ..., then the block
  // combines the threads in warp order (the same order in every block).
  Op op;
  if constexpr (Op::needs_max) {
    OnlineSoftmaxState<C> state{-infinity<C>(), C(0)};
    for (int64 s = threadIdx.x; s < splits; s += block_size) {
      state.add(row_partials[s * size], row_partials[s * size + 1]);
    }
    const OnlineSoftmaxState<C> row = state.template block_all_reduce<block_size>();
    op.set_max(row.max);
    op.set_sum(row.sum);
  } else {
    C thread_sum = 0;
    for (int64 s = threadIdx.x; s < splits; s += block_size) thread_sum += row_partials[s];
    op.set_sum(block_all_reduce<SumOp, C, block_size>(thread_sum));
  }
  for_chunk_packs<T, C, N, pack_size, block_size, loads_in_flight>(
      loads, chunk.row, chunk.begin, chunk.end, [&](int64 col, const C (&values)[N][pack_size]) {
        C result[pack_size];
#pragma unroll
        for (int i = 0; i < pack_size; ++i) {
          C v[N];
#pragma unroll
          for (int j = 0; j < N; ++j) v[j] = values[j][i];
          result[i] = op.template out<false>(v);
        }
        store.template store<pack_size>(result, chunk.row, col);
      });
}

}  // namespace cupyops
