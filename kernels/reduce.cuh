// Warp and block all-reductions (every thread receives the result).
#pragma once
#include "common.cuh"

namespace cupyops {

template <typename T>
struct SumOp {
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

// NaN-propagating maximum: a NaN anywhere makes the reduction NaN (NumPy's max).
template <typename T>
struct MaxOp {
  __device__ __forceinline__ T operator()(T a, T b) const { return (a != a || a > b) ? a : b; }
};
// float: one instruction (max.NaN, sm_80 and later) instead of compare and select.
template <>
struct MaxOp<float> {
  __device__ __forceinline__ float operator()(float a, float b) const {
    float result;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
    return result;
  }
};

// NaN-propagating maximum of two pairs of 16-bit values, one instruction each
// (sm_80+); the storage type picks the overload.
__device__ __forceinline__ unsigned pair_max(half_t, unsigned a, unsigned b) {
  unsigned result;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(result) : "r"(a), "r"(b));
  return result;
}
__device__ __forceinline__ unsigned pair_max(bfloat16_t, unsigned a, unsigned b) {
  unsigned result;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(result) : "r"(a), "r"(b));
  return result;
}

// Elementwise NaN-propagating maximum of two packs, kept in the storage type
// T (exact: the maximum is one of the values): 16-bit pairs (half_t,
// bfloat16_t) through pair_max, two elements an instruction and no
// conversion; else through MaxOp<C>.
template <typename C, typename T, int N>
__device__ __forceinline__ Pack<T, N> pack_max(const Pack<T, N>& a, const Pack<T, N>& b) {
  Pack<T, N> result;
  if constexpr (sizeof(T) == 2 && N % 2 == 0) {
    const unsigned* const a_pairs = reinterpret_cast<const unsigned*>(a.elem);
    const unsigned* const b_pairs = reinterpret_cast<const unsigned*>(b.elem);
    unsigned* const pairs = reinterpret_cast<unsigned*>(result.elem);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) pairs[i] = pair_max(T(), a_pairs[i], b_pairs[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) result.elem[i] = cast<T>(MaxOp<C>()(cast<C>(a.elem[i]), cast<C>(b.elem[i])));
  }
  return result;
}

// Reduces over groups of `width` consecutive lanes (width a power of two <= 32).
template <template <typename> class Op, typename T, int width = 32>
__device__ __forceinline__ T warp_all_reduce(T value) {
#pragma unroll
  for (int mask = width / 2; mask > 0; mask /= 2) {
    value = Op<T>()(value, __shfl_xor_sync(0xffffffffu, value, mask));
  }
  return value;
}

// Reduces over a one-dimensional block of `block_size` threads. The partial
// results of the warps are combined in warp order, so the result is
// deterministic. Safe to call repeatedly (the trailing barrier protects reuse).
template <template <typename> class Op, typename T, int block_size>
__device__ __forceinline__ T block_all_reduce(T value) {
  static_assert(block_size % 32 == 0, "block_size must be a multiple of the warp size");
  constexpr int num_warps = block_size / 32;
  __shared__ T partials[num_warps];
  value = warp_all_reduce<Op, T>(value);
  if (num_warps == 1) return value;
  if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = value;
  __syncthreads();
  T result = partials[0];
#pragma unroll
  for (int w = 1; w < num_warps; ++w) result = Op<T>()(result, partials[w]);
  __syncthreads();
  return result;
}

}  // namespace cupyops
