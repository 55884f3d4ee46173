// A row cached by cp.async: the caching shared by the asynchronous row
// kernels (softmax_block_async, norm_block_async).
//
// A block (or a thread-block cluster) owns a row of N inputs in 16-byte
// packs. Each thread copies its packs (t, t + block_size, ...) of every input
// straight into dynamic shared memory with cp.async, so the row is in flight
// without holding registers, and only ever reads back the packs it copied
// itself: the data needs no barrier between copy and use. With stages = 2 a
// second buffer takes the block's next row while this one is computed.
//
// cluster_size > 1 (sm_90 and newer): block `rank` of a cluster caches the
// packs [rank * share, (rank + 1) * share) of the row (share =
// ceil(packs / cluster_size)); the kernel combines the blocks' partials.
//
// tail_packs > 0 (one stage): the row's last cluster_size * tail_packs *
// block_size packs of every input are held in registers, block `rank` of the
// cluster (0 without one) holding the rank-th tail_packs * block_size of them
// (from its first tail pack f, thread t holding f + t + k * block_size,
// k < tail_packs), loaded with the row's cp.async; the packs before them are
// shared out in shared memory as above. A row longer than the blocks' shared
// memory is then still read once by them, or a row that fits leaves room for
// more blocks an SM (the planners keep the tails within the row).
//
// bounded (softmax_block_async under a LOAD that declares RowEnd, softmax.cuh):
// only the packs before pack `live` of the row are copied, held and visited;
// for_each_pack_from(live, ...) names the rest.
//
// What the cache reads of a LOAD (CachedLoad): a DirectLoad's rows at src +
// row * row_stride, cast to C; a LOAD with a static member kFromPack (the
// fused forward's scores) names its row's address, row_source(row), and turns
// a cached pack into its values, from_pack<N>(dst, row, col, pack), applying
// what it fuses after the pack left shared memory.
#pragma once
#include "common.cuh"

namespace cupyops {

template <typename Load, typename = void>
struct CachedLoad {
  template <typename T>
  static __device__ __forceinline__ const T* source(const Load& load, int64 row) {
    return load.src + row * load.row_stride;
  }
  template <typename C, typename T, int N>
  static __device__ __forceinline__ void convert(const Load&, C (&dst)[N], int64, int64, const Pack<T, N>& pack) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = cast<C>(pack.elem[i]);
  }
};

template <typename Load>
struct CachedLoad<Load, decltype(void(Load::kFromPack))> {
  template <typename T>
  static __device__ __forceinline__ const T* source(const Load& load, int64 row) { return load.row_source(row); }
  template <typename C, typename T, int N>
  static __device__ __forceinline__ void convert(const Load& load, C (&dst)[N], int64 row, int64 col,
                                                 const Pack<T, N>& pack) {
    load.template from_pack<N>(dst, row, col, pack);
  }
};

template <typename T, typename C, int N, int pack_size, int block_size, int stages, int cluster_size,
          int tail_packs>
struct AsyncRowCache {
  static_assert(pack_size * sizeof(T) == 16, "cp.async moves 16-byte packs");
  static_assert(tail_packs == 0 || stages == 1, "a register tail holds one row");
  typedef Pack<T, pack_size> P;

  P* buffers;             // [stage][input][pack of the share]
  int share_packs;        // packs of every block's share in shared memory
  int first_pack;         // this block's first pack in shared memory
  int num_packs;          // this block's packs in shared memory
  int first_tail_pack;    // this thread's first tail pack
  // The register tail, packs [k][j]: an array of the kernel's, passed to
  // fetch and for_each_pack (as a member of this struct, ptxas spilled the
  // float32 softmax backward at 1024 threads x 4 packs: 64 bytes).
  typedef P Tail[tail_packs > 0 ? tail_packs : 1][N];

  __device__ __forceinline__ AsyncRowCache(void* shared, int64 cols, int rank) {
    constexpr int tail_span = tail_packs * block_size;   // packs of a block's tail
    const int cached_packs = static_cast<int>(cols / pack_size) - cluster_size * tail_span;
    buffers = reinterpret_cast<P*>(shared);
    share_packs = (cached_packs + cluster_size - 1) / cluster_size;
    first_pack = rank * share_packs;
    num_packs = max(0, min(share_packs, cached_packs - first_pack));
    first_tail_pack = cached_packs + rank * tail_span + static_cast<int>(threadIdx.x);
  }

  __device__ __forceinline__ int tail_pack(int k) const { return first_tail_pack + k * block_size; }

  // This block's packs in shared memory that start before pack `live` of the row (bounded), or all.
  template <bool bounded>
  __device__ __forceinline__ int shared_packs(int live) const {
    return bounded ? max(0, min(num_packs, live - first_pack)) : num_packs;
  }

  // Starts the copy of `row` into `stage` (committed as one cp.async group)
  // and loads the register tail. loads[j]: input j (src, row_stride).
  template <bool bounded = false, typename Load>
  __device__ __forceinline__ void fetch(const Load (&loads)[N], int64 row, int stage, Tail& tail,
                                        int live = 0) const {
    const int packs = shared_packs<bounded>(live);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const T* row_start = CachedLoad<Load>::template source<T>(loads[j], row);
      const P* source = reinterpret_cast<const P*>(row_start) + first_pack;
      P* buffer = buffers + (stage * N + j) * share_packs;
      for (int p = threadIdx.x; p < packs; p += block_size) cp_async_pack<16>(buffer + p, source + p);
    }
    cp_async_commit();
#pragma unroll
    for (int k = 0; k < tail_packs; ++k) {
      if (bounded && tail_pack(k) >= live) continue;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        tail[k][j] = load_pack<T, pack_size>(CachedLoad<Load>::template source<T>(loads[j], row) +
                                              static_cast<int64>(tail_pack(k)) * pack_size);
      }
    }
  }

  // Calls use(pack, v) for each pack of `row` this thread caches (shared
  // memory, then the register tail); v[j][i]: element i of input j, in C, as
  // loads[j] reads it (CachedLoad).
  template <bool bounded = false, typename Load, typename Use>
  __device__ __forceinline__ void for_each_pack(const Load (&loads)[N], int64 row, int stage, const Tail& tail,
                                                const Use& use, int live = 0) const {
    const int packs = shared_packs<bounded>(live);
    for (int p = threadIdx.x; p < packs; p += block_size) {
      C v[N][pack_size];
      const int64 col = static_cast<int64>(first_pack + p) * pack_size;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const P pack = buffers[(stage * N + j) * share_packs + p];
        CachedLoad<Load>::convert(loads[j], v[j], row, col, pack);
      }
      use(first_pack + p, v);
    }
#pragma unroll
    for (int k = 0; k < tail_packs; ++k) {
      if (bounded && tail_pack(k) >= live) continue;
      C v[N][pack_size];
      const int64 col = static_cast<int64>(tail_pack(k)) * pack_size;
#pragma unroll
      for (int j = 0; j < N; ++j) CachedLoad<Load>::convert(loads[j], v[j], row, col, tail[k][j]);
      use(tail_pack(k), v);
    }
  }

  // Calls past(pack) for each pack of this thread's (shared memory, then the
  // register tail) from pack `live` of the row on: those a bounded fetch left out.
  template <typename Past>
  __device__ __forceinline__ void for_each_pack_from(int live, const Past& past) const {
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      if (first_pack + p >= live) past(first_pack + p);
    }
#pragma unroll
    for (int k = 0; k < tail_packs; ++k) {
      if (tail_pack(k) >= live) past(tail_pack(k));
    }
  }
};

}  // namespace cupyops
