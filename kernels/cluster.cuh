// Thread-block clusters (sm_90 and newer) in inline PTX: a block's place in
// its cluster, the cluster barrier, and the shared memory of another block of
// the cluster (distributed shared memory): its addresses, loads from it.
// Written as PTX so that no cooperative_groups header is needed.
//
// A block's shared memory may be read by the other blocks of its cluster only
// while it runs: a kernel that reads another block's shared memory ends with
// cluster_sync_before_exit(), so that no block exits while another may still
// read it.
#pragma once

namespace cupyops {

// This block's rank in its cluster, 0 .. cluster size - 1.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned rank;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// The cluster's index along x in the grid of clusters, and that grid's size.
__device__ __forceinline__ unsigned cluster_index_x() {
  unsigned index;
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(index));
  return index;
}
__device__ __forceinline__ unsigned num_clusters_x() {
  unsigned count;
  asm("mov.u32 %0, %%nclusterid.x;" : "=r"(count));
  return count;
}

// Every thread of every block of the cluster arrives, then waits for all the
// others: what a thread wrote to its block's shared memory before the arrive
// is seen by every thread of the cluster after its wait (distributed shared
// memory reads); global memory is not ordered by it. Every thread must call it
// (aligned: all threads of a warp execute the same barrier). The release is a
// fence restricted to shared::cta (PTX ISA 8.6; a CTA-level MEMBAR in SASS)
// before a relaxed arrive: the barrier's own release is a GPU-wide MEMBAR that
// waits for all the thread's earlier global loads and stores (H200, (64, 4096,
// 256) float16 softmax over axis 1: 72 % of copy with it, 77 % with the
// restricted fence). A relaxed arrive without the fence lets a block read
// another's partials before they land (wrong sums). NVRTC before 12.8 (no PTX
// ISA 8.6) gets the barrier's own release.
__device__ __forceinline__ void cluster_sync() {
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 8)
  asm volatile("fence.release.sync_restrict::shared::cta.cluster;" ::: "memory");
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A kernel's last cluster barrier: no block exits (releasing its shared
// memory) while another may still read it. Relaxed, no MEMBAR: what it
// orders are the other blocks' reads of this block's shared memory, whose
// values each thread has used before it arrives; a release here would hold
// every block until its last stores have reached memory (H200, (64, 4096,
// 256) float16 softmax over axis 1: 67 % of copy with it, 72 % without).
__device__ __forceinline__ void cluster_sync_before_exit() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// The rows a block walks, first, first + step, ...: its own (blockIdx.x,
// gridDim.x apart), or with cluster_size > 1 its cluster's, and its rank in
// the cluster (0 without one). Index: the type first and step are kept in.
template <int cluster_size, typename Index>
struct ClusterRows {
  int rank = 0;
  Index first = blockIdx.x, step = gridDim.x;
  __device__ __forceinline__ ClusterRows() {
    if constexpr (cluster_size > 1) {
      rank = static_cast<int>(cluster_rank());
      first = cluster_index_x();
      step = num_clusters_x();
    }
  }
};

// The shared-memory address `local` of this block mapped into block `rank` of the
// cluster (the same offset in that block's shared memory).
__device__ __forceinline__ unsigned shared_address_in_rank(unsigned local, unsigned rank) {
  unsigned remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

// `value`, a variable in this block's shared memory, as block `rank` of the
// cluster holds it: the address mapped into that block's shared memory, read
// one 32-bit word at a time (the values exchanged are a few words).
template <typename V>
__device__ __forceinline__ V load_from_rank(const V& value, unsigned rank) {
  static_assert(sizeof(V) % 4 == 0, "a value of whole 32-bit words");
  constexpr int num_words = sizeof(V) / 4;
  const unsigned remote = shared_address_in_rank(static_cast<unsigned>(__cvta_generic_to_shared(&value)), rank);
  union {
    V value;
    unsigned words[num_words];
  } bits;
#pragma unroll
  for (int w = 0; w < num_words; ++w) {
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(bits.words[w]) : "r"(remote + 4 * w) : "memory");
  }
  return bits.value;
}

// The 16 bytes at shared address `local` of block `rank` of the cluster.
__device__ __forceinline__ int4 load_int4_from_rank(unsigned local, unsigned rank) {
  int4 v;
  asm volatile("ld.shared::cluster.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(shared_address_in_rank(local, rank)) : "memory");
  return v;
}

// `value` (a shared variable) of every block of the cluster, folded with
// combine(total, next) in rank order: the same order, so the same bits, in
// every block.
template <int cluster_size, typename V, typename Combine>
__device__ __forceinline__ V fold_cluster(const V& value, const Combine& combine) {
  V total = load_from_rank(value, 0);
#pragma unroll
  for (int rank = 1; rank < cluster_size; ++rank) total = combine(total, load_from_rank(value, rank));
  return total;
}

// `value` (the same in every thread of the block) combined over the blocks of
// the cluster in rank order (fold_cluster): each block publishes its value in
// its shared memory, all arrive at the cluster barrier, then every thread
// folds. Published values alternate between two slots by `parity` (a count of
// the calls, mod 2): a block publishing call n + 2 has passed call n + 1's
// barrier, which every block reaches only after reading call n's (and using
// the values read). Every thread of every block must call it.
template <int cluster_size, typename V, typename Combine>
__device__ __forceinline__ V cluster_all_reduce(const V& value, unsigned parity, const Combine& combine) {
  __shared__ V published[2];
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) published[parity] = value;
  cluster_sync();
  return fold_cluster<cluster_size>(published[parity], combine);
}

}  // namespace cupyops
