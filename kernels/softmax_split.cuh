// Softmax and log-softmax, forward and backward, for rows too long for one
// block when too few rows exist to fill the GPU: each row is cut into `splits`
// chunks of chunk_cols columns (the last may be shorter), a block per chunk,
// in two launches over the same grid of rows * splits blocks.
//
// 1. softmax_split_partials: the block of chunk (row, split) reduces it to one
//    partial (ChunkPartial) at [row * splits + split] of a workspace in
//    compute type: forward the online pair (max, sum(exp(x - max))), backward
//    the sum of the row op's term (dy * y for softmax, dy for log-softmax).
// 2. softmax_split_finish: the block of chunk (row, split) combines the row's
//    partials into the row's (max, sum) -- in the same fixed order in every
//    block of the row, so they agree bit for bit -- then re-reads its chunk
//    and writes the outputs through the row op's out.
//
// 3. softmax_split_coop, one cooperative launch instead of the two: see the
//    kernel's comment. Each chunk is read once, into registers.
//
// Two launches: block b works on chunk b in row-major order (the chunks of a
// row adjacent). The finish launch walks the chunks in reverse, so it first re-reads what the
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

// The chunk `chunk` (row-major over rows x splits) of a row laid out as
// PeeledRow: the columns [begin, end) of its packs, counted from the row's
// head (0 unless peeled), `packed` columns of whole packs in all; with peel,
// the row's first chunk also takes its edges.
template <int pack_size, bool peel>
struct SplitChunk {
  int64 row, begin, end;
  PeeledRow<pack_size, peel> packs;
  template <typename RowHead>
  __device__ __forceinline__ SplitChunk(int64 chunk, int64 cols, int64 splits, int64 chunk_cols,
                                        const RowHead& row_head)
      : row(chunk / splits), packs(cols, peel ? row_head(row) : 0) {   // row is initialised first
    const int64 packed = packs.num_packs * pack_size;
    begin = (chunk - row * splits) * chunk_cols;
    end = begin + chunk_cols < packed ? begin + chunk_cols : packed;
  }
  // Whether this thread holds an edge of the row for this chunk.
  __device__ __forceinline__ bool has_edge() const { return peel && begin == 0 && packs.has_edge(); }
};

// Calls use(col, values) for each of this thread's packs (threadIdx.x,
// + block_size, ...) of columns [begin, end) past column `head` of `row`: col
// is the pack's first column in the row, values[j][i] element i of the pack
// of input j in compute type. loads_in_flight packs of every input are
// loaded (kept in their storage type) before the first of them is used.
template <typename T, typename C, int num_inputs, int pack_size, int block_size, int loads_in_flight,
          typename Load, typename Use>
__device__ __forceinline__ void for_chunk_packs(const Load (&loads)[num_inputs], int64 row, int64 head,
                                                int64 begin, int64 end, const Use& use) {
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
          packs[u][j] = load_pack<T, pack_size>(loads[j].src + row * loads[j].row_stride + head + col);
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
        use(head + col, values);
      }
    }
  }
}

// Combines the `splits` partials of one row (row_partials[s * size ...]) into
// the row op: thread t takes t, t + block_size, ..., then the block combines
// the threads in warp order, the same order in every block of the row, so they
// agree bit for bit. Loads bypass L1 (__ldcg): other blocks wrote the partials.
template <typename Op, typename C, int block_size>
__device__ __forceinline__ void combine_row_partials(const C* row_partials, int64 splits, Op& op) {
  constexpr int size = split_partial_size<Op>();
  if constexpr (Op::needs_max) {
    OnlineSoftmaxState<C> state{-infinity<C>(), C(0)};
    for (int64 s = threadIdx.x; s < splits; s += block_size) {
      state.add(__ldcg(row_partials + s * size), __ldcg(row_partials + s * size + 1));
    }
    const OnlineSoftmaxState<C> row = state.template block_all_reduce<block_size>();
    op.set_max(row.max);
    op.set_sum(row.sum);
  } else {
    C thread_sum = 0;
    for (int64 s = threadIdx.x; s < splits; s += block_size) thread_sum += __ldcg(row_partials + s);
    op.set_sum(block_all_reduce<SumOp, C, block_size>(thread_sum));
  }
}

// One thread's share of a chunk's partial, fed packs of every input in
// compute type: forward the online (max, sum) pair, kept as the uncached
// path's online pass keeps it (OnlineSoftmaxState), so NaN and +-inf reach
// RowSoftmax as they would there; backward the sum of the row op's term.
template <typename Op, typename C>
struct ChunkPartial {
  OnlineSoftmaxState<C> state{-infinity<C>(), C(0)};   // forward
  C sum = C(0);                                        // backward

  template <int num_inputs, int pack_size>
  __device__ __forceinline__ void add(const C (&values)[num_inputs][pack_size]) {
    if constexpr (Op::needs_max) {
      state.add_pack(values[0]);
    } else {
      add_pack_terms(Op{}, values, sum);
    }
  }

  // Reduces the block's threads (every thread must call it); thread 0 writes
  // the block's partial to partial[0, split_partial_size).
  template <int block_size>
  __device__ __forceinline__ void block_write(C* partial) const {
    if constexpr (Op::needs_max) {
      const OnlineSoftmaxState<C> block = state.template block_all_reduce<block_size>();
      if (threadIdx.x == 0) {
        partial[0] = block.max;
        partial[1] = block.sum;
      }
    } else {
      const C block_sum = block_all_reduce<SumOp, C, block_size>(sum);
      if (threadIdx.x == 0) partial[0] = block_sum;
    }
  }
};

// peel (both launches): rows off the 16-byte grid, every operand at each
// row's phase, in 16-byte packs between single-element edges (PeeledRow),
// which the block of the row's first chunk adds to its partial and writes.
template <typename Op, typename T, typename Load, typename C, int pack_size, int block_size,
          int loads_in_flight, bool peel, typename RowHead>
__device__ __forceinline__ void softmax_split_partials(const Load (&loads)[Op::num_inputs], C* partials,
                                                       int64 cols, int64 splits, int64 chunk_cols,
                                                       const RowHead& row_head) {
  constexpr int N = Op::num_inputs;
  const int64 chunk_id = blockIdx.x;
  const SplitChunk<pack_size, peel> chunk(chunk_id, cols, splits, chunk_cols, row_head);
  ChunkPartial<Op, C> partial;
  if (chunk.has_edge()) {
    C edge[N][1];
    chunk.packs.load_edges(loads, chunk.row, Op::pad(), edge);
    partial.add(edge);
  }
  for_chunk_packs<T, C, N, pack_size, block_size, loads_in_flight>(
      loads, chunk.row, chunk.packs.head, chunk.begin, chunk.end,
      [&](int64, const C (&values)[N][pack_size]) { partial.add(values); });
  partial.template block_write<block_size>(partials + chunk_id * split_partial_size<Op>());
}

template <typename Op, typename T, typename Load, typename Store, typename C, int pack_size,
          int block_size, int loads_in_flight, bool peel, typename RowHead>
__device__ __forceinline__ void softmax_split_finish(const Load (&loads)[Op::num_inputs], const Store& store,
                                                     const C* partials, int64 cols, int64 splits,
                                                     int64 chunk_cols, const RowHead& row_head) {
  static_assert(!Op::can_fold, "outputs written unfolded: a folding Op needs write_row");
  constexpr int N = Op::num_inputs;
  constexpr int size = split_partial_size<Op>();
  const int64 chunk_id = static_cast<int64>(gridDim.x) - 1 - blockIdx.x;   // reverse order: see above
  const SplitChunk<pack_size, peel> chunk(chunk_id, cols, splits, chunk_cols, row_head);
  Op op;
  combine_row_partials<Op, C, block_size>(partials + chunk.row * splits * size, splits, op);
  if (chunk.has_edge()) {
    C edge[N][1];
    chunk.packs.load_edges(loads, chunk.row, Op::pad(), edge);
    store_pack_outputs(op, store, edge, chunk.row, chunk.packs.edge_col);
  }
  for_chunk_packs<T, C, N, pack_size, block_size, loads_in_flight>(
      loads, chunk.row, chunk.packs.head, chunk.begin, chunk.end, [&](int64 col, const C (&values)[N][pack_size]) {
        store_pack_outputs(op, store, values, chunk.row, col);
      });
}

// Acquire load of a counter other blocks increment (gpu scope).
__device__ __forceinline__ unsigned load_acquire(const unsigned* address) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// One launch, cooperative (every block resident at once): gridDim.x = slots *
// splits blocks; block (slot, split) owns chunk `split` of rows slot,
// slot + slots, ... For each row it loads its chunk on chip: packs_per_thread
// packs of every input into registers (storage type, all in flight) and,
// with shared_packs > 0, the thread's next shared_packs packs into dynamic
// shared memory by cp.async ([k][input][thread]: the thread's own slots, read
// back only by it, after its own wait: no barrier); then it writes the
// chunk's partial, announces it on the slot's arrival counter, waits until
// the slot's `splits` blocks have all announced this row, combines the row's
// partials (combine_row_partials) and writes the outputs from registers and
// shared memory: each element is read once and written once. Shared packs
// make a thread's chunk longer than its registers hold, so a row takes fewer
// blocks and more rows are resident at once.
//
// prefetch (no shared packs): once a block has written a row's partial it
// starts copying its chunk of the slot's next row into the same shared slots
// by cp.async, so the next row's reads overlap this row's wait, combine and
// writes; the next row is then loaded from there. A thread refills its slots
// only after using what it read from them.
//
// Workspace: partials [slots][2][splits][size], by round parity (a block that
// runs ahead writes the other half, never partials its slot still reads: it
// cannot pass the next row's wait before every block of the slot has
// published that row, after reading this one), and counters [2][slots]
// (arrivals, departures), zero at launch and left zero: the last block of a
// slot to leave resets both, once every block of the slot has passed its last
// wait.
template <typename Op, typename T, typename Load, typename Store, typename C, int pack_size,
          int packs_per_thread, int shared_packs, int block_size, bool prefetch>
__device__ __forceinline__ void softmax_split_coop(const Load (&loads)[Op::num_inputs], const Store& store,
                                                   C* partials, unsigned* counters, int64 rows, int64 cols,
                                                   int64 splits, int64 chunk_cols) {
  static_assert(!(prefetch && shared_packs > 0), "prefetching blocks keep their chunk in registers");
  constexpr int N = Op::num_inputs;
  constexpr int size = split_partial_size<Op>();
  constexpr int own_packs = packs_per_thread + shared_packs;   // of each input, in the thread's chunk
  typedef Pack<T, pack_size> P;
  const int64 slots = gridDim.x / splits;
  const int64 slot = blockIdx.x / splits;
  const int64 split = blockIdx.x - slot * splits;
  const int64 chunk_packs = chunk_cols / pack_size;
  const int64 end_pack = min((split + 1) * chunk_packs, cols / pack_size);
  const int64 first_pack = split * chunk_packs + threadIdx.x;
  unsigned* const arrivals = counters + slot;
  unsigned* const departures = counters + slots + slot;
  extern __shared__ __align__(16) unsigned char shared_buf[];
  P* const shared_slots = reinterpret_cast<P*>(shared_buf);   // [shared_packs or packs_per_thread][N][block_size]
  const auto own_slot = [&](int k, int j) -> P& { return shared_slots[(k * N + j) * block_size + threadIdx.x]; };
  // Calls f(Constant<k>) for each pack k in [begin, end) of this thread's
  // chunk inside the row: pack first_pack + k * block_size.
  const auto for_own_packs = [&](auto begin, auto end, const auto& f) {
    for_each_constant<decltype(begin)::get, decltype(end)::get>([&](auto pack) {
      if (first_pack + pack.get * block_size < end_pack) f(pack);
    });
  };
  // Packs [zero, in_registers) of a thread's chunk are held in registers,
  // [in_registers, all) in shared memory.
  const Constant<0> zero;
  const Constant<packs_per_thread> in_registers;
  const Constant<own_packs> all;
  // Calls f(Constant<k>, Constant<j>, first) for pack k of input j of this
  // thread's chunk of `row`, first its first pack of input j: pack k lies
  // k * block_size packs past it (a constant offset, no register for each).
  const auto for_chunk = [&](int64 row, auto begin, auto end, const auto& f) {
    for_each_constant<0, N>([&](auto input) {
      const T* const first = loads[input.get].src + row * loads[input.get].row_stride + first_pack * pack_size;
      for_own_packs(begin, end, [&](auto pack) { f(pack, input, first); });
    });
  };
  // Starts the copy of packs [begin, end) of `row` into shared slots 0, 1, ...
  const auto copy_to_shared = [&](int64 row, auto begin, auto end) {
    const unsigned shared_base = static_cast<unsigned>(__cvta_generic_to_shared(&own_slot(0, 0)));
    for_chunk(row, begin, end, [&](auto pack, auto input, const T* first) {
      constexpr int k = decltype(pack)::get, j = decltype(input)::get;
      constexpr int slot_k = k - decltype(begin)::get;
      cp_async_pack_at<sizeof(P), (slot_k * N + j) * block_size * sizeof(P), k * block_size * sizeof(P)>(
          shared_base, first);
    });
    cp_async_commit();
  };
  P cache[packs_per_thread][N];
  // values[j][i]: element i of pack k of input j in compute type (k is a
  // constant once the callers' loops unroll: the branch folds away).
  const auto values_of = [&](int k, C (&values)[N][pack_size]) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const P loaded = k < packs_per_thread ? cache[k < packs_per_thread ? k : 0][j]
                                            : load_pack<T, pack_size>(own_slot(k - packs_per_thread, j).elem);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[j][i] = cast<C>(loaded.elem[i]);
    }
  };
  unsigned round = 0;
  bool prefetched = false;
  for (int64 row = slot; row < rows; row += slots, ++round) {
    if constexpr (shared_packs > 0) copy_to_shared(row, in_registers, all);
    if (prefetch && prefetched) cp_async_wait_all();   // this thread's copies of the row have landed
    for_chunk(row, zero, in_registers, [&](auto pack, auto input, const T* first) {
      constexpr int k = decltype(pack)::get, j = decltype(input)::get;
      if (prefetch && prefetched) {
        cache[k][j] = load_pack<T, pack_size>(own_slot(k, j).elem);
      } else {
        cache[k][j] = load_pack<T, pack_size>(first + k * block_size * pack_size);
      }
    });
    ChunkPartial<Op, C> partial;
    const auto add = [&](auto pack) {
      C values[N][pack_size];
      values_of(pack.get, values);
      partial.add(values);
    };
    for_own_packs(zero, in_registers, add);
    if constexpr (shared_packs > 0) {
      cp_async_wait_all();
      for_own_packs(in_registers, all, add);
    }
    C* const round_partials = partials + (slot * 2 + (round & 1)) * splits * size;
    partial.template block_write<block_size>(round_partials + split * size);
    if constexpr (prefetch) {
      prefetched = row + slots < rows;
      if (prefetched) copy_to_shared(row + slots, zero, in_registers);
    }
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(arrivals, 1u);
      const unsigned everyone = (round + 1) * static_cast<unsigned>(splits);
      while (load_acquire(arrivals) < everyone) {
      }
    }
    __syncthreads();
    Op op;
    combine_row_partials<Op, C, block_size>(round_partials, splits, op);
    for_own_packs(zero, all, [&](auto pack) {
      C values[N][pack_size];
      values_of(pack.get, values);
      store_pack_outputs(op, store, values, row, (first_pack + pack.get * block_size) * pack_size);
    });
  }
  if (threadIdx.x == 0 && atomicAdd(departures, 1u) == static_cast<unsigned>(splits) - 1) {
    *arrivals = 0;
    *departures = 0;
  }
}

}  // namespace cupyops
