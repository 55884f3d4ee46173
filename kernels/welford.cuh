// Row statistics that are accumulated per thread and combined across the
// lanes of a group and the warps of a block: Welford's (mean, m2, count) with
// Chan's combine (EqualCountWelford: lanes holding as many values, without a
// division), plain sums, and the reductions of such state structs.
//
// A state struct S provides
//   static S empty();                     the identity of combine
//   void combine(const S& other);         merges another partial state
//   S shfl_down(int delta) const;         __shfl_down_sync of every field (width-wide groups)
//   S shfl(int src_lane) const;           __shfl_sync of every field (width-wide groups)
// and the row statistics (WelfordState, SquareSumState) also
//   static S of_packs<num_packs, pack_size>(values, in_row)
//                                         the state of the values one thread holds
//                                         (values[j]: an array, or any type with
//                                         operator[], e.g. a row held as stored)
//   static RowMoments<T> of_row(thread_sum, cols, eps, row_sum)
//                                         the moments of a row whose threads all
//                                         hold their values (registers, or a
//                                         cache they read back): thread_sum(term)
//                                         sums term(x) over a thread's values
//                                         (held_row_moments), row_sum sums one
//                                         value over the row's threads
#pragma once
#include "common.cuh"

namespace cupyops {

__device__ __forceinline__ float div_(float a, float b) { return __fdividef(a, b); }
__device__ __forceinline__ double div_(double a, double b) { return a / b; }
__device__ __forceinline__ float rsqrt_(float x) { return rsqrtf(x); }
__device__ __forceinline__ double rsqrt_(double x) { return rsqrt(x); }

// Pairwise sum of n values.
template <int n, typename T>
__device__ __forceinline__ T tree_sum(const T* values) {
  if constexpr (n == 1) {
    return values[0];
  } else {
    return tree_sum<n / 2>(values) + tree_sum<n - n / 2>(values + n / 2);
  }
}

// Sum of term(j) over the elements j of the packs p < num_packs with
// in_row(p), through min(n, 4) interleaved partial sums (2 for double) added
// pairwise at the end: chains of n / 4 adds that overlap instead of one chain
// of n, with at most 4 extra live registers (8 spilled threads holding 32
// values at 1024 threads on sm_80; so did selecting 0 for packs outside the
// row instead of branching around them).
template <int num_packs, int pack_size, typename T, typename InRow, typename Term>
__device__ __forceinline__ T sum_in_row(InRow in_row, Term term) {
  constexpr int n = num_packs * pack_size;
  constexpr int max_lanes = 16 / sizeof(T);
  constexpr int lanes = n < max_lanes ? n : max_lanes;
  T partial[lanes];
#pragma unroll
  for (int j = 0; j < lanes; ++j) partial[j] = T(0);
#pragma unroll
  for (int p = 0; p < num_packs; ++p) {
    if (in_row(p)) {
#pragma unroll
      for (int i = 0; i < pack_size; ++i) partial[(p * pack_size + i) % lanes] += term(p * pack_size + i);
    }
  }
  return tree_sum<lanes>(partial);
}

template <int width, typename T>
__device__ __forceinline__ T shfl_down_(T v, int delta) { return __shfl_down_sync(0xffffffffu, v, delta, width); }
template <int width, typename T>
__device__ __forceinline__ T shfl_(T v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane, width); }

// Mean and biased variance of one row, and rstd = rsqrt(var + eps).
template <typename T>
struct RowMoments {
  T mean, rstd;
  // (x - mean) * rstd as one multiply-add a value, given offset() once a row:
  // for the forward pass's shifted values (x - K, K one of the row's values,
  // so |mean| * rstd <= sqrt(cols)), not for raw values under a large mean.
  __device__ __forceinline__ T offset() const { return -mean * rstd; }
  __device__ __forceinline__ T normalize(T shifted_x, T offset) const { return shifted_x * rstd + offset; }
};

// A row's (count, mean, m2 = sum of squared deviations from the mean): one
// thread's part from the values it holds (of_packs, two passes over
// registers), Chan's combine across threads. Rows held whole (registers,
// or a cache each thread reads back) take two row-wide passes instead (of_row).
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

  // The state of the values of the packs p < num_packs with in_row(p):
  // mean = sum / count, then m2 = sum of (x - mean)^2 (sum_in_row). One
  // division per thread instead of Welford's one per value, whose chain
  // (each mean depends on the previous one through a division) left a thread
  // holding 16 .. 32 values latency-bound. The two-pass m2 is at least as
  // accurate as Welford's; the row shift K still keeps the values small.
  template <int num_packs, int pack_size, typename Values, typename InRow>
  static __device__ __forceinline__ WelfordState of_packs(const Values& values, InRow in_row) {
    int packs_in_row = 0;
#pragma unroll
    for (int p = 0; p < num_packs; ++p) packs_in_row += in_row(p) ? 1 : 0;
    const T count = static_cast<T>(packs_in_row * pack_size);
    const T sum = sum_in_row<num_packs, pack_size, T>(in_row, [&](int j) { return values[j]; });
    const T mean = packs_in_row > 0 ? div_(sum, count) : T(0);
    const T m2 = sum_in_row<num_packs, pack_size, T>(in_row, [&](int j) {
      const T deviation = values[j] - mean;
      return deviation * deviation;
    });
    return {mean, m2, count};
  }

  // Two exact passes over the held values, each summed over the row's
  // threads: the mean, then the squared deviations from it. Two one-value
  // sums cost fewer instructions than one reduction of this state (three
  // values and a division a step): ncu, LayerNorm f16 12288 cols, 512 x 3
  // packs, 470 M instructions against 356 M with these sums (and
  // RowMoments::normalize).
  template <typename ThreadSum, typename RowSum>
  static __device__ __forceinline__ RowMoments<T> of_row(ThreadSum thread_sum, long long cols, T eps,
                                                         RowSum row_sum) {
    const T mean = row_sum(thread_sum([](T x) { return x; })) / static_cast<T>(cols);
    const T m2 = row_sum(thread_sum([&](T x) { return (x - mean) * (x - mean); }));
    return WelfordState{mean, m2, T(0)}.moments(cols, eps);
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

// Welford states of equal counts (each lane of a warp group holding as many
// of the row's values): Chan's combine without a division, the squared
// difference of the means weighted by count / 2; counts stay in each lane.
template <typename T>
struct EqualCountWelford {
  T mean, m2, count;

  static __device__ __forceinline__ EqualCountWelford empty() { return {T(0), T(0), T(0)}; }
  __device__ __forceinline__ void combine(const EqualCountWelford& b) {
    const T delta = b.mean - mean;
    mean = (mean + b.mean) * T(0.5);
    m2 += b.m2 + delta * delta * (count * T(0.5));
    count += count;
  }
  template <int width>
  __device__ __forceinline__ EqualCountWelford shfl_down(int delta) const {
    return {shfl_down_<width>(mean, delta), shfl_down_<width>(m2, delta), count};
  }
  template <int width>
  __device__ __forceinline__ EqualCountWelford shfl(int src_lane) const {
    return {shfl_<width>(mean, src_lane), shfl_<width>(m2, src_lane), count};
  }
  __device__ __forceinline__ RowMoments<T> moments(long long cols, T eps) const {
    return WelfordState<T>{mean, m2, count}.moments(cols, eps);
  }
};

// Sum of squares: RMSNorm's statistic (mean 0, rstd = rsqrt(mean(x^2) + eps)).
template <typename T>
struct SquareSumState {
  static constexpr bool centered = false;  // raw values, no shift
  T sum;

  static __device__ __forceinline__ SquareSumState empty() { return {T(0)}; }
  template <int num_packs, int pack_size, typename Values, typename InRow>
  static __device__ __forceinline__ SquareSumState of_packs(const Values& values, InRow in_row) {
    return {sum_in_row<num_packs, pack_size, T>(in_row, [&](int j) { return values[j] * values[j]; })};
  }
  template <typename ThreadSum, typename RowSum>
  static __device__ __forceinline__ RowMoments<T> of_row(ThreadSum thread_sum, long long cols, T eps,
                                                         RowSum row_sum) {
    return SquareSumState{row_sum(thread_sum([](T x) { return x * x; }))}.moments(cols, eps);
  }
  __device__ __forceinline__ void combine(const SquareSumState& b) { sum += b.sum; }
  template <int width>
  __device__ __forceinline__ SquareSumState shfl_down(int delta) const { return {shfl_down_<width>(sum, delta)}; }
  template <int width>
  __device__ __forceinline__ SquareSumState shfl(int src_lane) const { return {shfl_<width>(sum, src_lane)}; }
  __device__ __forceinline__ RowMoments<T> moments(long long cols, T eps) const {
    return {T(0), rsqrt_(sum / static_cast<T>(cols) + eps)};
  }
};

// One sum (a row's sums in of_row).
template <typename T>
struct SumState {
  T sum;

  static __device__ __forceinline__ SumState empty() { return {T(0)}; }
  __device__ __forceinline__ void combine(const SumState& b) { sum += b.sum; }
  template <int width>
  __device__ __forceinline__ SumState shfl_down(int delta) const { return {shfl_down_<width>(sum, delta)}; }
  template <int width>
  __device__ __forceinline__ SumState shfl(int src_lane) const { return {shfl_<width>(sum, src_lane)}; }
};

// A value a thread holds outside its packs, added to its sums where `held`
// (held_row_moments' extra: a peeled row's edge).
template <typename T>
struct ExtraValue {
  T value;
  bool held;
  template <typename Term>
  __device__ __forceinline__ T add(T sum, Term term) const { return held ? sum + term(value) : sum; }
};
// No value outside the packs.
struct NoExtraValue {
  template <typename T, typename Term>
  __device__ __forceinline__ T add(T sum, Term) const { return sum; }
};

// The moments (Stats::of_row) of a row whose threads hold their values:
// those of the packs p < num_packs with in_row(p) (values[j], summed by
// sum_in_row) and `extra` (ExtraValue or NoExtraValue).
template <typename Stats, int num_packs, int pack_size, typename T, typename Values, typename InRow,
          typename Extra, typename RowSum>
__device__ __forceinline__ RowMoments<T> held_row_moments(const Values& values, InRow in_row, Extra extra,
                                                          long long cols, T eps, RowSum row_sum) {
  const auto thread_sum = [&](auto term) {
    return extra.add(sum_in_row<num_packs, pack_size, T>(in_row, [&](int j) { return term(values[j]); }), term);
  };
  return Stats::of_row(thread_sum, cols, eps, row_sum);
}

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

// `count` states reduced together: the sums of several rows share one block
// reduction (one barrier).
template <typename State, int count>
struct StateArray {
  State part[count];

  static __device__ __forceinline__ StateArray empty() {
    StateArray a;
#pragma unroll
    for (int i = 0; i < count; ++i) a.part[i] = State::empty();
    return a;
  }
  __device__ __forceinline__ void combine(const StateArray& b) {
#pragma unroll
    for (int i = 0; i < count; ++i) part[i].combine(b.part[i]);
  }
  template <int width>
  __device__ __forceinline__ StateArray shfl_down(int delta) const {
    return map([&](const State& s) { return s.template shfl_down<width>(delta); });
  }
  template <int width>
  __device__ __forceinline__ StateArray shfl(int src_lane) const {
    return map([&](const State& s) { return s.template shfl<width>(src_lane); });
  }

 private:
  template <typename F>
  __device__ __forceinline__ StateArray map(const F& f) const {
    StateArray a;
#pragma unroll
    for (int i = 0; i < count; ++i) a.part[i] = f(part[i]);
    return a;
  }
};

// Combines the states of lanes [0, span) of each group of `width` consecutive
// lanes into the group's lane 0, in a fixed tree (as OneFlow's
// WelfordWarpReduce); the other lanes hold partial states.
template <int width, int span, typename State>
__device__ __forceinline__ State warp_reduce_state(State state) {
  static_assert(span <= width && (span & (span - 1)) == 0, "span: a power of two, at most width");
#pragma unroll
  for (int delta = span / 2; delta > 0; delta /= 2) {
    state.combine(state.template shfl_down<width>(delta));
  }
  return state;
}

// Combines the states of groups of `width` consecutive lanes; lane 0 of each
// group broadcasts, so every lane of a group holds the same bits.
template <int width, typename State>
__device__ __forceinline__ State warp_all_reduce_state(State state) {
  return warp_reduce_state<width, width>(state).template shfl<width>(0);
}

// Smallest power of two >= n.
constexpr int ceil_pow2(int n) { return n <= 1 ? 1 : 2 * ceil_pow2((n + 1) / 2); }

// Combines the states of a one-dimensional block of `block_size` threads:
// warps first, then the per-warp results in warp order over the first
// ceil_pow2(num_warps) lanes. Every warp repeats the second step on the same
// inputs and broadcasts its lane 0, so all threads get identical bits;
// deterministic. Safe to call repeatedly: with a trailing barrier, or, given
// a parity that alternates between consecutive calls, with one barrier a call
// (a call writes the half of the partials the call before the last read, and
// every thread has passed that call's barrier by then).
template <int block_size, typename State>
__device__ __forceinline__ State block_all_reduce_state(State state, int parity = -1) {
  static_assert(block_size % 32 == 0 && block_size <= 1024, "block_size: a multiple of 32, at most 1024");
  constexpr int num_warps = block_size / 32;
  if (num_warps == 1) return warp_all_reduce_state<32>(state);
  state = warp_reduce_state<32, 32>(state);
  __shared__ State partials[2][num_warps];
  State* const half = partials[parity > 0 ? 1 : 0];
  const int lane = threadIdx.x % 32;
  if (lane == 0) half[threadIdx.x / 32] = state;
  __syncthreads();
  state = lane < num_warps ? half[lane] : State::empty();
  state = warp_reduce_state<32, ceil_pow2(num_warps)>(state).template shfl<32>(0);
  if (parity < 0) __syncthreads();
  return state;
}

}  // namespace cupyops
