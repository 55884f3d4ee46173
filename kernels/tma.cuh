// The bulk tensor copy engine (TMA, sm_90) and the shared-memory barriers
// (mbarrier) its copies complete on, as inline PTX.
//
// A tensor map is the 128-byte opaque descriptor the host encodes
// (cupyops/tensor_map.py, cuTensorMapEncodeTiled / cuTensorMapEncodeIm2col) and
// passes by value as a `const __grid_constant__` kernel parameter; its address
// in the parameter space is what the copy instructions name.
//
// A full/empty pair of barriers per pipeline stage: the producer thread arms
// `full` with the bytes the stage's copies will deliver (expect_tx) and issues
// them; the copies complete the phase. Consumers wait on `full`, read the stage,
// then arrive on `empty`, whose phase completes when every consumer has; the
// producer waits on it before it loads the stage again. Phases alternate in
// parity: the n-th use of a barrier completes phase n, parity n & 1.
#pragma once
#include "cluster.cuh"
#include "common.cuh"

namespace cupyops {

struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

__device__ __forceinline__ void mbarrier_init(unsigned barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}
// Makes initialised barriers visible to the other threads and to the copy engine
// (the initialising thread runs it, then the block synchronises).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// One arrival that also expects `bytes` more from the copies of this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned barrier, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

// An arrival on `barrier` once this thread's cp.async copies issued so far have
// landed, counted among the barrier's expected arrivals (noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(unsigned barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}

// Box (c0, c1) of a 2-D tiled tensor map into shared memory at `dst`, completing on `barrier`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap& map, int c0, int c1, unsigned barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(barrier), "r"(c0), "r"(c1)
      : "memory");
}

// Box (c0, c1, c2, c3) of a 4-D tiled tensor map into shared memory at `dst`, completing on `barrier`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap& map, int c0, int c1, int c2, int c3,
                                            unsigned barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}],"
      " [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(barrier), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// tma_load_2d into every block of the cluster in `mask` (bit r: rank r), at `dst`'s
// offset in each, completing on the barrier at `barrier`'s offset in each.
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const TensorMap& map, int c0, int c1,
                                                      unsigned barrier, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%3, %4}], [%2], %5;\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(barrier), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

// One arrival on the barrier at `barrier`'s offset in block `rank` of the cluster.
__device__ __forceinline__ void mbarrier_arrive_cluster(unsigned barrier, unsigned rank) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(shared_address_in_rank(barrier, rank))
               : "memory");
}

// The im2col copy of a 5-D im2col tensor map (dims C, W, H, D, N): the map's
// pixels-per-column pixels from (w, h, d, n), each at the filter offsets
// (ow, oh, od), channels c .. c + channels-per-pixel, into `dst`.
__device__ __forceinline__ void tma_load_im2col_5d(unsigned dst, const TensorMap& map, int c, int w, int h, int d,
                                                   int n, unsigned short ow, unsigned short oh, unsigned short od,
                                                   unsigned barrier) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5, %6, %7}], [%2], {%8, %9, %10};\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(barrier), "r"(c), "r"(w), "r"(h), "r"(d),
      "r"(n), "h"(ow), "h"(oh), "h"(od)
      : "memory");
}

}  // namespace cupyops
