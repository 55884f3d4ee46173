// Row statistics that are accumulated per thread and combined across the
// lanes of a group and the warps of a block: Welford's (mean, m2, count) with
// Chan's combine, plain sums, and the reductions of such state structs.
//
// A state struct S provides
//   static S empty();                     the identity of combine
//   void combine(const S& other);         merges another partial state
//   S shfl_down(int delta) const;         __shfl_down_sync of every field (width-wide groups)
//   S shfl(int src_lane) const;           __shfl_sync of every field (width-wide groups)
#pragma once
#include "common.cuh"

namespace cupyops {

__device__ __forceinline__ float div_(float a, float b) { return __fdividef(a, b); }
__device__ __forceinline__ double div_(double a, double b) { return a / b; }
__device__ __forceinline__ float rsqrt_(float x) { return rsqrtf(x); }
__device__ __forceinline__ double rsqrt_(double x) { return rsqrt(x); }

template <int width, typename T>
__device__ __forceinline__ T shfl_down_(T v, int delta) { return __shfl_down_sync(0xffffffffu, v, delta, width); }
template <int width, typename T>
__device__ __forceinline__ T shfl_(T v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane, width); }

// Mean and biased variance of one row, and rstd = rsqrt(var + eps).
template <typename T>
struct RowMoments {
  T mean, rstd;
};

// Welford's running mean and m2 (sum of squared deviations from the mean).
//
// The norm kernels feed it shifted values x - K, K the same value for every
// thread of a row (its first element), and add K back to the mean: in float32
// a mean of 1e4 is only resolved to ~1e-3, so `mean += delta / count` on the
// raw values loses a variance of 1e-4 entirely. x - K is exact for values near
// K (Sterbenz) and, K being one of the row's values, the shifted problem's
// condition number is at most sqrt(1 + cols) (Chan, Golub and LeVeque 1983).
template <typename T>
struct WelfordState {
  static constexpr bool centered = true;   // statistics of x - K: mean = K + mean, m2 unchanged
  T mean, m2, count;

  static __device__ __forceinline__ WelfordState empty() { return {T(0), T(0), T(0)}; }

  __device__ __forceinline__ void add(T x) {
    count += T(1);
    const T delta = x - mean;
    mean += div_(delta, count);
    m2 += delta * (x - mean);
  }

  // Chan, Golub and LeVeque's pairwise update.
  __device__ __forceinline__ void combine(const WelfordState& b) {
    if (b.count == T(0)) return;
    const T count_ab = count + b.count;
    const T b_share = div_(b.count, count_ab);
    const T delta = b.mean - mean;
    mean += delta * b_share;
    m2 += b.m2 + delta * delta * count * b_share;
    count = count_ab;
  }

  template <int width>
  __device__ __forceinline__ WelfordState shfl_down(int delta) const {
    return {shfl_down_<width>(mean, delta), shfl_down_<width>(m2, delta), shfl_down_<width>(count, delta)};
  }
  template <int width>
  __device__ __forceinline__ WelfordState shfl(int src_lane) const {
    return {shfl_<width>(mean, src_lane), shfl_<width>(m2, src_lane), shfl_<width>(count, src_lane)};
  }

  // Biased variance over the `cols` values of the row (m2 / cols, never negative);
  // the mean is that of the values added (the shifted mean when they were shifted).
  __device__ __forceinline__ RowMoments<T> moments(long long cols, T eps) const {
    const T variance = max(m2 / static_cast<T>(cols), T(0));
    return {mean, rsqrt_(variance + eps)};
  }
};

// Sum of squares: RMSNorm's statistic (mean 0, rstd = rsqrt(mean(x^2) + eps)).
template <typename T>
struct SquareSumState {
  static constexpr bool centered = false;  // raw values, no shift
  T sum;

  static __device__ __forceinline__ SquareSumState empty() { return {T(0)}; }
  __device__ __forceinline__ void add(T x) { sum += x * x; }
  __device__ __forceinline__ void combine(const SquareSumState& b) { sum += b.sum; }
  template <int width>
  __device__ __forceinline__ SquareSumState shfl_down(int delta) const { return {shfl_down_<width>(sum, delta)}; }
  template <int width>
  __device__ __forceinline__ SquareSumState shfl(int src_lane) const { return {shfl_<width>(sum, src_lane)}; }
  __device__ __forceinline__ RowMoments<T> moments(long long cols, T eps) const {
    return {T(0), rsqrt_(sum / static_cast<T>(cols) + eps)};
  }
};

// Two sums at once (the row sums of the normalisation backward pass).
template <typename T>
struct SumPairState {
  T first, second;

  static __device__ __forceinline__ SumPairState empty() { return {T(0), T(0)}; }
  __device__ __forceinline__ void combine(const SumPairState& b) {
    first += b.first;
    second += b.second;
  }
  template <int width>
  __device__ __forceinline__ SumPairState shfl_down(int delta) const {
    return {shfl_down_<width>(first, delta), shfl_down_<width>(second, delta)};
  }
  template <int width>
  __device__ __forceinline__ SumPairState shfl(int src_lane) const {
    return {shfl_<width>(first, src_lane), shfl_<width>(second, src_lane)};
  }
};

// Combines the states of groups of `width` consecutive lanes. Lane 0 of each
// group combines in a fixed tree (as OneFlow's WelfordWarpReduce) and
// broadcasts, so every lane of a group holds the same bits.
template <int width, typename State>
__device__ __forceinline__ State warp_all_reduce_state(State state) {
#pragma unroll
  for (int delta = width / 2; delta > 0; delta /= 2) {
    state.combine(state.template shfl_down<width>(delta));
  }
  return state.template shfl<width>(0);
}

// Combines the states of a one-dimensional block of `block_size` threads:
// warps first, then the per-warp results in warp order. Every warp repeats the
// second step on the same inputs, so all threads get identical bits without a
// broadcast; deterministic. Safe to call repeatedly (trailing barrier).
template <int block_size, typename State>
__device__ __forceinline__ State block_all_reduce_state(State state) {
  static_assert(block_size % 32 == 0 && block_size <= 1024, "block_size: a multiple of 32, at most 1024");
  constexpr int num_warps = block_size / 32;
  state = warp_all_reduce_state<32>(state);
  if (num_warps == 1) return state;
  __shared__ State partials[num_warps];
  const int lane = threadIdx.x % 32;
  if (lane == 0) partials[threadIdx.x / 32] = state;
  __syncthreads();
  state = warp_all_reduce_state<32>(lane < num_warps ? partials[lane] : State::empty());
  __syncthreads();
  return state;
}

}  // namespace cupyops
