// The int8 tensor-core peak of the device, per instruction: long chains of
// independent MMAs on operands already in registers (mma.sync) or shared memory
// (wgmma), no global memory traffic in the loop. Each thread ends by writing the
// sum of its accumulators, so no MMA is dead code.
#pragma once
#include "mma.cuh"

namespace cupyops {

// `iterations` x CHAINS mma.sync of m16n8k32 (k32) or m8n8k16 per warp, CHAINS
// independent accumulators in flight.
template <bool k32, int CHAINS>
__device__ __forceinline__ void mma_sync_peak(int* out, int iterations) {
  const unsigned seed = threadIdx.x * 0x9e3779b9u + blockIdx.x;
  const unsigned a[4] = {seed, seed ^ 0x01010101u, seed ^ 0x02020202u, seed ^ 0x03030303u};
  const unsigned b[2] = {seed * 3u, seed * 5u};
  int acc[CHAINS][4] = {};
  for (int it = 0; it < iterations; ++it) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      if constexpr (k32) {
        mma_m16n8k32_s8(acc[c], a, b);
      } else {
        mma_m8n8k16_s8(acc[c], a, b);
      }
    }
  }
  int sum = 0;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// `iterations` x BATCH wgmma m64nNk32 per warpgroup, A (64 x 32) and B (N x 32)
// from shared memory in the convolution's 64B-swizzled layout, BATCH committed
// as a group, one group in flight while the next is issued (as in the
// convolution's main loop).
template <int N, int BATCH>
__device__ __forceinline__ void wgmma_peak(int* out, int iterations) {
  constexpr int BYTES = (64 + N) * 64;   // 64-byte rows: a k32 half and the other one
  __shared__ __align__(1024) int operands[BYTES / 4];
  for (int i = threadIdx.x; i < BYTES / 4; i += blockDim.x) operands[i] = i * 0x01030507 + blockIdx.x;
  fence_proxy_async_shared();
  __syncthreads();
  const unsigned base = shared_address(operands);
  int acc[2][N / 8][2] = {};
  for (int it = 0; it < iterations; ++it) {
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const unsigned half = (u & 1) * 32;
      WgmmaS8<N>::mma(acc, wgmma_descriptor_sw64(base + half), wgmma_descriptor_sw64(base + 64 * 64 + half));
    }
    wgmma_commit();
    wgmma_fence_operands(acc);
    wgmma_wait<1>();
    wgmma_fence_operands(acc);
  }
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
  int sum = 0;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) sum += acc[0][j][0] + acc[0][j][1] + acc[1][j][0] + acc[1][j][1];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

}  // namespace cupyops
