// Row-wise softmax and log-softmax, forward and backward: the warp path (a row
// per group of lanes, cached in registers), the block paths (a row per block,
// cached in registers, in shared memory filled by cp.async, or in shared memory
// filled through registers) and the uncached path (a row per block, re-read
// from global memory). Each path is written once for a row operation (Op):
// SoftmaxForward or SoftmaxBackward.
//
// The forward pass reduces the row maximum with a NaN-propagating max and
// finishes through RowSoftmax, which reproduces scipy.special's results on
// rows holding NaN or +-inf.
#pragma once
#include "common.cuh"
#include "async_row.cuh"
#include "cluster.cuh"
#include "reduce.cuh"

namespace cupyops {

enum class Algorithm { kSoftmax, kLogSoftmax };

// exp(x - m) for a row maximum m, in the form that every term, rescale and
// output of one row must share. A form has shift(m), a value computed once a
// row; term(x, shift), exp(x - m) from it; between(shift_a, shift_b),
// exp(a - b) for the maxima a and b.
//   NaturalExp: shift(m) = m, term = __expf(x - m): FADD, FMUL, MUFU.EX2.
//   Base2Exp (float): shift(m) = m * log2(e) rounded once (__fmul_rn: never
//     contracted into a neighbouring FMA, so every term and rescale sees the
//     same bits), term = 2^(x * log2(e) - shift): FFMA, MUFU.EX2. Every term
//     then carries the same factor 2^(m * log2(e) - shift(m)), which the
//     division by the sum cancels: softmax only (log_softmax subtracts the
//     natural sum's log). shift overflows for |m| > 2.3e38: for float16 input.
//     NaN and +-inf give what the natural form gives.
//   FoldedNaturalExp (float): NaturalExp's terms and sums (a row's log-sum-exp
//     stays natural), with outputs that fold (RowSoftmax): for 16-bit outputs.
// A form that folds (foldable) also has fold(m, shift, s), the folded shift of
// a row whose sum is s, and folded_term(x, folded_shift) = exp(x - m) / s.
template <typename T>
struct NaturalExp {
  static constexpr bool natural = true;
  static constexpr bool foldable = false;
  static __device__ __forceinline__ T shift(T m) { return m; }
  static __device__ __forceinline__ T term(T x, T shift) { return exp_(x - shift); }
  static __device__ __forceinline__ T between(T shift_a, T shift_b) { return exp_(shift_a - shift_b); }
};

constexpr float kLog2e = 1.4426950408889634f;

struct Base2Exp {
  static constexpr bool natural = false;
  static constexpr bool foldable = true;
  static __device__ __forceinline__ float shift(float m) { return __fmul_rn(m, kLog2e); }
  static __device__ __forceinline__ float term(float x, float shift) { return exp2_(fmaf(x, kLog2e, -shift)); }
  static __device__ __forceinline__ float between(float shift_a, float shift_b) { return exp2_(shift_a - shift_b); }
  static __device__ __forceinline__ float fold(float, float shift, float sum) { return shift + __log2f(sum); }
  static __device__ __forceinline__ float folded_term(float x, float folded_shift) { return term(x, folded_shift); }
};

// y = 2^(x * log2(e) - folded_shift), folded_shift = m * log2(e) + log2(s)
// rounded once: an FFMA and an EX2 where the natural output is an FADD, two
// FMULs and an EX2.
struct FoldedNaturalExp : NaturalExp<float> {
  static constexpr bool foldable = true;
  static __device__ __forceinline__ float fold(float m, float, float sum) { return fmaf(m, kLog2e, __log2f(sum)); }
  static __device__ __forceinline__ float folded_term(float x, float folded_shift) {
    return exp2_(fmaf(x, kLog2e, -folded_shift));
  }
};

// Finishes one row from its maximum m and s = sum(exp(x - m)).
// softmax:     y = exp(x - m) / s   (NaN for the whole row when m is not finite)
// log-softmax: y = (x - m) - log(s), as SciPy computes it (x - m is exact where
//              m + log(s) would round away a small log(s)); when m is +inf SciPy
//              shifts by 0, so finite x give -inf and x = +inf gives NaN.
// Exp is the form of exp(x - m) (NaturalExp, or a form that folds for softmax).
//
// Softmax in a form that folds can fold 1 / s into the exponent (folded_out):
// y = 2^(x * log2(e) - folded_shift), folded_shift = Exp::fold(m, shift, s)
// rounded once, one multiply an element fewer (Base2Exp: shift + log2(s)). That
// rounding is not shared by the sum, so a row
// folds only while |folded_shift| < kFoldedShiftLimit: it then moves y by
// under 1e-5 of itself (2^-17 ln 2 from the rounding, 3e-6 from __log2f), 2 %
// of a float16 ulp; scale_outputs's factor, another rounding and __log2f, makes
// it under 2e-5 (4 %). folds() is false past the limit and for rows whose
// maximum is NaN or +-inf; those call unfold(), then from_input.
template <Algorithm algorithm, typename T, typename Exp = NaturalExp<T>>
struct RowSoftmax {
  static_assert(algorithm == Algorithm::kSoftmax || Exp::natural, "log-softmax needs the natural sum");
  static constexpr bool can_fold = algorithm == Algorithm::kSoftmax && Exp::foldable;
  static constexpr float kFoldedShiftLimit = 256.0f;
  T max, shift, scale;   // shift: Exp::shift(max); scale: softmax 1 / s (can_fold: once unfolded), log-softmax log(s)
  T sum, folded_shift;   // can_fold: s, and Exp::fold(m, shift, s) (both over scale_outputs's factor)
  RowSoftmax() = default;
  __device__ __forceinline__ void set_max(T row_max) {
    max = row_max;
    shift = Exp::shift(row_max);
  }
  __device__ __forceinline__ void set_sum(T row_sum) {
    if (algorithm == Algorithm::kSoftmax) {
      if constexpr (can_fold) {
        sum = row_sum;
        folded_shift = Exp::fold(max, shift, row_sum);
      } else {
        scale = T(1) / row_sum;
      }
    } else {
      scale = max == infinity<T>() ? T(0) : log(row_sum);
    }
  }
  // Every output of the row multiplied by factor > 0 (softmax, once set_sum has run).
  __device__ __forceinline__ void scale_outputs(T factor) {
    static_assert(algorithm == Algorithm::kSoftmax, "log-softmax outputs are logs");
    if constexpr (can_fold) {
      sum /= factor;
      folded_shift -= __log2f(factor);
    } else {
      scale *= factor;
    }
  }
  // can_fold: 1 / s, for from_input, only where a row is written unfolded (a
  // division a row that folded rows skip: H200, (64, 4096, 256) float16 over
  // axis 1, 80.3 % of copy against 78.3 % dividing every row).
  __device__ __forceinline__ void unfold() {
    if constexpr (can_fold) scale = T(1) / sum;
  }
  // Term added to the row sum for an element x.
  __device__ __forceinline__ T exp_term(T x) const { return Exp::term(x, shift); }
  // Output for an element whose cached value is x (or, when the cache holds
  // exp(x - m) for softmax, that value).
  __device__ __forceinline__ T from_input(T x) const {
    return algorithm == Algorithm::kSoftmax ? exp_term(x) * scale : (x - max) - scale;
  }
  __device__ __forceinline__ T from_cached_exp(T e) const { return e * scale; }
  __device__ __forceinline__ bool folds() const { return can_fold && fabsf(folded_shift) < kFoldedShiftLimit; }
  __device__ __forceinline__ T folded_out(T x) const { return Exp::folded_term(x, folded_shift); }
};

// Running (max, sum of exp(x - max)) of the online softmax, exp in the form Exp.
template <typename T, typename Exp = NaturalExp<T>>
struct OnlineSoftmaxState {
  T max, sum;
  // Combines another (max, sum) pair into this one.
  __device__ __forceinline__ void add(T other_max, T other_sum) {
    const T new_max = MaxOp<T>()(max, other_max);
    if (new_max == -infinity<T>()) return;  // nothing but -inf so far: the sum stays 0
    const T new_shift = Exp::shift(new_max);
    sum = sum * Exp::between(Exp::shift(max), new_shift) + other_sum * Exp::between(Exp::shift(other_max), new_shift);
    max = new_max;
  }
  // Adds a pack of values: its max, then its terms relative to that max.
  template <int pack_size>
  __device__ __forceinline__ void add_pack(const T (&values)[pack_size]) {
    T pack_max = values[0];
#pragma unroll
    for (int i = 1; i < pack_size; ++i) pack_max = MaxOp<T>()(pack_max, values[i]);
    T pack_sum = 0;
    if (pack_max != -infinity<T>()) {
      const T shift = Exp::shift(pack_max);
#pragma unroll
      for (int i = 0; i < pack_size; ++i) pack_sum += Exp::term(values[i], shift);
    }
    add(pack_max, pack_sum);
  }
  // a with b added (a fold's combine).
  static __device__ __forceinline__ OnlineSoftmaxState combined(OnlineSoftmaxState a, const OnlineSoftmaxState& b) {
    a.add(b.max, b.sum);
    return a;
  }
  // The sum relative to a maximum new_max >= max (0 while max is -inf: a sum
  // relative to -inf is 0, or NaN from exp(-inf - -inf) terms).
  __device__ __forceinline__ T rescaled_to(T new_max) const {
    return max == -infinity<T>() ? T(0) : sum * Exp::between(Exp::shift(max), Exp::shift(new_max));
  }
  // The state of the whole block (deterministic: the block reductions' order).
  template <int block_size>
  __device__ __forceinline__ OnlineSoftmaxState block_all_reduce() const {
    const T block_max = cupyops::block_all_reduce<MaxOp, T, block_size>(max);
    return {block_max, cupyops::block_all_reduce<SumOp, T, block_size>(rescaled_to(block_max))};
  }
};

// ---------------------------------------------------------------------------
// Row operations. Each reads num_inputs arrays of one layout and writes one:
//   sum_inputs   the leading inputs term() reads (the others only out())
//   needs_max    a max over input 0 comes before the sum (set_max)
//   pad()        the value of an element outside the row (adds nothing)
//   term<cache>  an element's term of the row sum (set_sum); with cache = true
//                it may replace the element's cached inputs by what out reuses
//   out<cache>   an element's output from its (possibly replaced) inputs
//   can_fold     a row that folds() is written by folded_out(v) (out<false>(v)
//                in fewer instructions); one that does not, by out<false>
//                after unfold()

// y = softmax(x) or log_softmax(x); inputs: x. Exp: the form of exp(x - m).
template <Algorithm algorithm, typename C, typename ExpForm = NaturalExp<C>>
struct SoftmaxForward {
  typedef ExpForm Exp;
  static constexpr int num_inputs = 1;
  static constexpr int sum_inputs = 1;
  static constexpr bool needs_max = true;
  static __device__ __forceinline__ C pad() { return -infinity<C>(); }
  RowSoftmax<algorithm, C, Exp> finish;
  __device__ __forceinline__ void set_max(C row_max) { finish.set_max(row_max); }
  template <bool cache>
  __device__ __forceinline__ C term(C (&v)[1]) const {
    const C e = finish.exp_term(v[0]);
    if (cache && algorithm == Algorithm::kSoftmax) v[0] = e;
    return e;
  }
  __device__ __forceinline__ void set_sum(C row_sum) { finish.set_sum(row_sum); }
  __device__ __forceinline__ void scale_outputs(C factor) { finish.scale_outputs(factor); }
  template <bool cache>
  __device__ __forceinline__ C out(const C (&v)[1]) const {
    return cache && algorithm == Algorithm::kSoftmax ? finish.from_cached_exp(v[0]) : finish.from_input(v[0]);
  }
  static constexpr bool can_fold = RowSoftmax<algorithm, C, Exp>::can_fold;
  __device__ __forceinline__ bool folds() const { return finish.folds(); }
  __device__ __forceinline__ C folded_out(const C (&v)[1]) const { return finish.folded_out(v[0]); }
  __device__ __forceinline__ void unfold() { finish.unfold(); }
};

// dx from dy and the forward output y; inputs: dy, y.
//   softmax:     dx = (dy - sum(dy * y)) * y
//   log-softmax: dx = dy - exp(y) * sum(dy)
template <Algorithm algorithm, typename C>
struct SoftmaxBackward {
  static constexpr int num_inputs = 2;
  static constexpr int sum_inputs = algorithm == Algorithm::kSoftmax ? 2 : 1;   // dy * y, or dy
  static constexpr bool needs_max = false;
  static constexpr bool can_fold = false;
  static __device__ __forceinline__ C pad() { return C(0); }
  C sum;
  __device__ __forceinline__ void set_max(C) {}
  template <bool cache>
  __device__ __forceinline__ C term(C (&v)[2]) const {
    return algorithm == Algorithm::kSoftmax ? v[0] * v[1] : v[0];
  }
  __device__ __forceinline__ void set_sum(C row_sum) { sum = row_sum; }
  template <bool cache>
  __device__ __forceinline__ C out(const C (&v)[2]) const {
    return algorithm == Algorithm::kSoftmax ? (v[0] - sum) * v[1] : v[0] - exp_(v[1]) * sum;
  }
};

// op.out<false>(v), or op.folded_out(v) where `folded` (Op::can_fold, op.folds()).
template <bool folded, typename Op, typename C, int N>
__device__ __forceinline__ C uncached_out(const Op& op, const C (&v)[N]) {
  if constexpr (folded) {
    return op.folded_out(v);
  } else {
    return op.template out<false>(v);
  }
}

// Whole packs of every input, values[j][i]: element i of input j's pack.
// Adds the row op's term of each element of the pack to sum, in element order.
template <typename Op, typename C, int N, int pack_size>
__device__ __forceinline__ void add_pack_terms(const Op& op, const C (&values)[N][pack_size], C& sum) {
#pragma unroll
  for (int i = 0; i < pack_size; ++i) {
    C v[N];
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = values[j][i];
    sum += op.template term<false>(v);
  }
}

// Writes the outputs of one pack at (row, col).
template <bool folded = false, typename Op, typename Store, typename C, int N, int pack_size>
__device__ __forceinline__ void store_pack_outputs(const Op& op, const Store& store,
                                                   const C (&values)[N][pack_size], int64 row, int64 col) {
  C result[pack_size];
#pragma unroll
  for (int i = 0; i < pack_size; ++i) {
    C v[N];
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = values[j][i];
    result[i] = uncached_out<folded>(op, v);
  }
  store.template store<pack_size>(result, row, col);
}

// A row's output pass, write(Constant<folded>()): folded where the row folds
// (Op::can_fold, op.folds()), else after op.unfold().
template <typename Op, typename Write>
__device__ __forceinline__ void write_row(Op& op, const Write& write) {
  if constexpr (Op::can_fold) {
    if (op.folds()) {
      write(Constant<true>());
      return;
    }
    op.unfold();
  }
  write(Constant<false>());
}

// A row's statistics, to a STORE that keeps them (a member finish_row(op, sum,
// row, leader): the fused forward's log-sum-exp, written by the thread
// `leader`, and its dropout's 1 / (1 - p) moved into op's outputs), once op
// holds the row's maximum and sum: every thread of the row calls it before the
// row's stores. Other STOREs have no such member and the call is empty. Every
// path makes it.
template <typename Store, typename Op, typename C>
__device__ __forceinline__ auto finish_row(const Store& store, Op& op, C sum, int64 row, bool leader, int)
    -> decltype(store.finish_row(op, sum, row, leader), void()) {
  store.finish_row(op, sum, row, leader);
}
template <typename Store, typename Op, typename C>
__device__ __forceinline__ void finish_row(const Store&, Op&, C, int64, bool, long) {}

// The columns of a row that may hold a kept value, [0, live_end): a LOAD whose
// static member kRowEnds is true has members live_end(row, cols) and
// past_value() (the fused softmax under the causal rule, where every column from
// there on is masked: its input reads as past_value()), and the block paths leave
// the rest out of the row's max and sum and do not read it (block_smem,
// block_uncached, block_async, which copies none of it; the register paths hold
// the row whole and keep their passes). Other LOADs keep every column, and their
// kernels are unchanged. Such a LOAD's STORE has a member store_past<N>(row, col,
// output) for the packs past the live end; output() gives the Op's output where
// every input is past_value() (the same at all of them), should the STORE need it.
template <typename Load, typename = void>
struct RowEnd {
  static constexpr bool bounded = false;
  // How many of a row's num_packs packs (from column head on) start before its live end: all.
  template <int pack_size>
  static __device__ __forceinline__ int64 packs_before(const Load&, int64, int64, int64, int64 num_packs) {
    return num_packs;
  }
};

template <typename Load>
struct RowEnd<Load, decltype(void(Load::kRowEnds))> {
  static constexpr bool bounded = Load::kRowEnds;
  // A function giving the row's output at every position past its live end, for store_past
  // (once op holds the row's sum; folded as uncached_out).
  template <typename C, bool folded = false, typename Op>
  static __device__ __forceinline__ auto past_output(const Op& op) {
    return [&op]() {
      C v[Op::num_inputs];
#pragma unroll
      for (int j = 0; j < Op::num_inputs; ++j) v[j] = Load::template past_value<C>();
      return uncached_out<folded>(op, v);
    };
  }
  template <int pack_size>
  static __device__ __forceinline__ int64 packs_before(const Load& load, int64 row, int64 cols, int64 head,
                                                       int64 num_packs) {
    if (!bounded) return num_packs;
    const int64 live = load.live_end(row, cols) - head;
    return live <= 0 ? int64(0) : min(num_packs, (live + pack_size - 1) / pack_size);
  }
};

// ---------------------------------------------------------------------------
// Warp path: a group of `width` lanes owns `rows_per_access` rows at a time;
// each lane holds cols_per_thread values of each input row in registers.
template <typename Op, typename Load, typename Store, typename C, int pack_size, int cols_per_thread,
          int width, int rows_per_access, bool padding>
__device__ __forceinline__ void softmax_warp(const Load (&loads)[Op::num_inputs], const Store& store,
                                             int64 rows, int64 cols) {
  static_assert(!Op::can_fold, "outputs written unfolded: a folding Op needs write_row");
  static_assert(cols_per_thread % pack_size == 0, "cols_per_thread must be a multiple of pack_size");
  static_assert(width <= 32 && 32 % width == 0, "width must divide the warp size");
  constexpr int N = Op::num_inputs;
  constexpr int num_packs = cols_per_thread / pack_size;
  C buf[rows_per_access][N][cols_per_thread];
  const int64 group = static_cast<int64>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64 num_groups = static_cast<int64>(gridDim.x) * blockDim.y;
  const int lane = threadIdx.x;
  for (int64 row = group * rows_per_access; row < rows; row += num_groups * rows_per_access) {
    C row_max[rows_per_access];
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      row_max[r] = -infinity<C>();
#pragma unroll
      for (int p = 0; p < num_packs; ++p) {
        const int64 col = (static_cast<int64>(p) * width + lane) * pack_size;
        const bool inside = row + r < rows && (!padding || col < cols);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          C* values = buf[r][j] + p * pack_size;
          if (inside) {
            loads[j].template load<pack_size>(values, row + r, col);
          } else {
#pragma unroll
            for (int i = 0; i < pack_size; ++i) values[i] = Op::pad();
          }
        }
        if (Op::needs_max) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) row_max[r] = MaxOp<C>()(row_max[r], buf[r][0][p * pack_size + i]);
        }
      }
    }
    Op ops[rows_per_access];
    C row_sum[rows_per_access];
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      if (Op::needs_max) ops[r].set_max(warp_all_reduce<MaxOp, C, width>(row_max[r]));
      row_sum[r] = 0;
#pragma unroll
      for (int i = 0; i < cols_per_thread; ++i) {
        C v[N];
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = buf[r][j][i];
        row_sum[r] += ops[r].template term<true>(v);
#pragma unroll
        for (int j = 0; j < N; ++j) buf[r][j][i] = v[j];
      }
    }
#pragma unroll
    for (int r = 0; r < rows_per_access; ++r) {
      const C sum = warp_all_reduce<SumOp, C, width>(row_sum[r]);
      ops[r].set_sum(sum);
      finish_row(store, ops[r], sum, row + r, lane == 0 && row + r < rows, 0);
#pragma unroll
      for (int i = 0; i < cols_per_thread; ++i) {
        C v[N];
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = buf[r][j][i];
        buf[r][0][i] = ops[r].template out<true>(v);
      }
#pragma unroll
      for (int p = 0; p < num_packs; ++p) {
        const int64 col = (static_cast<int64>(p) * width + lane) * pack_size;
        if (row + r < rows && (!padding || col < cols)) {
          store.template store<pack_size>(buf[r][0] + p * pack_size, row + r, col);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Block-register path: a block owns a row; thread t holds packs t,
// t + block_size, ... (packs_per_thread of them) of each input in registers.
// peel: rows need not start on a pack boundary (odd cols, offset views). Each
// row's first `head` elements (up to its first 16-byte boundary, the same for
// every operand) and its last partial pack are single elements held by
// threads 0, 1, ...; the packs in between are aligned. They are loaded after
// the packs, so the packs' loads are all in flight first.
// storage_cache: the packs are held as loaded (RegisterRow) and converted in
// each pass; softmax then takes exp(x - m) again for the outputs.
// rows_per_block > 1 (blocks of one warp a row only, no block barrier):
// warp threadIdx.y of a block owns its own rows (BlockRows).
template <typename Op, typename Load, typename Store, typename C, int pack_size, int packs_per_thread,
          int block_size, int rows_per_block, bool peel, bool storage_cache, typename RowHead>
__device__ __forceinline__ void softmax_block_regs(const Load (&loads)[Op::num_inputs], const Store& store,
                                                   int64 rows, int64 cols, const RowHead& row_head) {
  static_assert(!Op::can_fold, "outputs written unfolded: a folding Op needs write_row");
  constexpr int N = Op::num_inputs;
  // The storage cache keeps no exp(x - m) between passes: out<false> recomputes it.
  constexpr bool reuse = !storage_cache;
  RegisterRow<typename Load::Storage, C, N, packs_per_thread, pack_size, storage_cache> buf;
  const BlockRows<block_size, rows_per_block> block_rows;
  for (int64 row = block_rows.first(); row < rows; row += block_rows.step()) {
    const int head = peel ? row_head(row) : 0;
    const int64 num_packs = (cols - head) / pack_size;
    const auto pack_col = [&](int k) { return head + (static_cast<int64>(k) * block_size + threadIdx.x) * pack_size; };
    const auto in_row = [&](int k) { return static_cast<int64>(k) * block_size + threadIdx.x < num_packs; };
    // Every pack is loaded without a branch (one past the row loads the row's
    // first pack again, num_packs >= 1) and each pass skips those past the
    // row: a load under the same condition as its use was fused with it, and
    // the loads went out one pass of arithmetic apart.
#pragma unroll
    for (int k = 0; k < packs_per_thread; ++k) {
#pragma unroll
      for (int j = 0; j < N; ++j) buf.load(j, k, loads[j], row, in_row(k) ? pack_col(k) : head);
    }
    const int64 tail = head + num_packs * pack_size;
    const int num_edges = peel ? head + static_cast<int>(cols - tail) : 0;
    const int64 edge_col = threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;
    const bool has_edge = peel && threadIdx.x < num_edges;
    C edge[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      edge[j] = Op::pad();
      if (has_edge) loads[j].template load<1>(&edge[j], row, edge_col);
    }
    Op op;
    if (Op::needs_max) {
      C thread_max = edge[0];
#pragma unroll
      for (int i = 0; i < buf.size; ++i) {
        if (in_row(i / pack_size)) thread_max = MaxOp<C>()(thread_max, buf.get(0, i));
      }
      op.set_max(block_all_reduce<MaxOp, C, block_size>(thread_max));
    }
    C thread_sum = has_edge ? op.template term<true>(edge) : C(0);
#pragma unroll
    for (int i = 0; i < buf.size; ++i) {
      if (!in_row(i / pack_size)) continue;
      C v[N];
#pragma unroll
      for (int j = 0; j < N; ++j) v[j] = buf.get(j, i);
      thread_sum += op.template term<reuse>(v);
#pragma unroll
      for (int j = 0; j < N; ++j) buf.set(j, i, v[j]);
    }
    const C sum = block_all_reduce<SumOp, C, block_size>(thread_sum);
    op.set_sum(sum);
    finish_row(store, op, sum, row, threadIdx.x == 0, 0);
    if (has_edge) {
      const C value = op.template out<true>(edge);
      store.template store<1>(&value, row, edge_col);
    }
#pragma unroll
    for (int k = 0; k < packs_per_thread; ++k) {
      if (in_row(k)) {
        C values[pack_size];
#pragma unroll
        for (int i = 0; i < pack_size; ++i) {
          C v[N];
#pragma unroll
          for (int j = 0; j < N; ++j) v[j] = buf.get(j, k * pack_size + i);
          values[i] = op.template out<reuse>(v);
        }
        store.template store<pack_size>(values, row, pack_col(k));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Asynchronous shared-memory path: a block (or with cluster_size > 1 a
// thread-block cluster) owns a row, cached by cp.async (AsyncRowCache, in
// async_row.cuh: stages, the cluster's shares, the register tail; a LOAD may
// apply more than a cast to the cached packs, CachedLoad). online (forward):
// the maximum and the sum in one pass over the cache. A cluster's blocks
// combine their (max, sum) or sums through distributed shared memory
// (cluster_all_reduce), so a row longer than one block's shared memory is
// still read once. Forward needs online.
template <typename Op, typename T, typename Load, typename Store, typename C, int pack_size,
          int block_size, int stages, bool online, int cluster_size, int tail_packs>
__device__ __forceinline__ void softmax_block_async(const Load (&loads)[Op::num_inputs], const Store& store,
                                                    int64 rows, int64 cols) {
  static_assert(cluster_size == 1 || online || !Op::needs_max, "a cluster combines one (max, sum) pass");
  constexpr int N = Op::num_inputs;
  extern __shared__ __align__(16) unsigned char shared_buf[];
  const ClusterRows<cluster_size, int64> block_rows;
  const int rank = block_rows.rank;
  const int64 first_row = block_rows.first, row_step = block_rows.step;
  typedef AsyncRowCache<T, C, N, pack_size, block_size, stages, cluster_size, tail_packs> Cache;
  const Cache cache(shared_buf, cols, rank);
  typename Cache::Tail tail;
  // Under a LOAD with row ends (RowEnd) only the packs before a row's live end are copied and
  // read; the packs past it store the row's past_output.
  constexpr bool bounded = RowEnd<Load>::bounded;
  auto live_packs = [&](int64 row) {
    return static_cast<int>(RowEnd<Load>::template packs_before<pack_size>(loads[0], row, cols, 0, cols / pack_size));
  };
  int stage = 0;
  unsigned parity = 0;   // the cluster's published partials alternate by row
  if (first_row < rows) cache.template fetch<bounded>(loads, first_row, 0, tail, live_packs(first_row));
  for (int64 row = first_row; row < rows; row += row_step, parity ^= 1) {
    const int64 next = row + row_step;
    const int live = live_packs(row);
    if (stages == 2 && next < rows) {
      cache.template fetch<bounded>(loads, next, stage ^ 1, tail, live_packs(next));
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    Op op;
    if constexpr (Op::needs_max && online) {
      // One pass over the cache: a running (max, sum) per thread.
      OnlineSoftmaxState<C> state{-infinity<C>(), C(0)};
      cache.template for_each_pack<bounded>(
          loads, row, stage, tail, [&](int, const C (&v)[N][pack_size]) { state.add_pack(v[0]); }, live);
      OnlineSoftmaxState<C> row_state = state.template block_all_reduce<block_size>();
      if constexpr (cluster_size > 1) {
        row_state = cluster_all_reduce<cluster_size>(row_state, parity, OnlineSoftmaxState<C>::combined);
      }
      op.set_max(row_state.max);
      op.set_sum(row_state.sum);
      finish_row(store, op, row_state.sum, row, threadIdx.x == 0 && rank == 0, 0);
    } else {
      if (Op::needs_max) {
        C thread_max = -infinity<C>();
        cache.template for_each_pack<bounded>(loads, row, stage, tail, [&](int, const C (&v)[N][pack_size]) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) thread_max = MaxOp<C>()(thread_max, v[0][i]);
        }, live);
        op.set_max(block_all_reduce<MaxOp, C, block_size>(thread_max));
      }
      C thread_sum = 0;
      cache.template for_each_pack<bounded>(
          loads, row, stage, tail, [&](int, const C (&v)[N][pack_size]) { add_pack_terms(op, v, thread_sum); }, live);
      C row_sum = block_all_reduce<SumOp, C, block_size>(thread_sum);
      if constexpr (cluster_size > 1) row_sum = cluster_all_reduce<cluster_size>(row_sum, parity, SumOp<C>());
      op.set_sum(row_sum);
      finish_row(store, op, row_sum, row, threadIdx.x == 0 && rank == 0, 0);
    }
    write_row(op, [&](auto folded) {
      constexpr bool fold = decltype(folded)::get;
      cache.template for_each_pack<bounded>(loads, row, stage, tail, [&](int pack, const C (&v)[N][pack_size]) {
        store_pack_outputs<fold>(op, store, v, row, static_cast<int64>(pack) * pack_size);
      }, live);
      if constexpr (bounded) {
        const auto past = RowEnd<Load>::template past_output<C, fold>(op);
        cache.for_each_pack_from(live, [&](int pack) {
          store.template store_past<pack_size>(row, static_cast<int64>(pack) * pack_size, past);
        });
      }
    });
    if (stages == 2) {
      stage ^= 1;
    } else if (next < rows) {
      cache.template fetch<bounded>(loads, next, 0, tail, live_packs(next));
    }
  }
  // No block leaves while another of its cluster may still read its published partials.
  if constexpr (cluster_size > 1) cluster_sync_before_exit();
}

// ---------------------------------------------------------------------------
// Block-shared-memory path: a block owns a row, its first `cached` inputs in
// dynamic shared memory (input j at [j * cache_cols ...], cache_cols: the
// row's whole packs); inputs past them (those only the outputs read, at
// least Op::sum_inputs cached) are read from global memory by the output
// pass. Thread t fills and reads only the packs t, t + block_size, ..., so
// the cache needs no barriers of its own.
// packed_cache = false: OneFlow's layout, compute type, element i of pack p at
//   [i * num_packs + p]; softmax keeps exp(x - max) there after the sum pass.
// packed_cache = true: packs of type Cache (the input's storage type: half the
//   shared memory for 16-bit inputs) stored whole at [p]; outputs recomputed.
// peel: rows need not start on a pack boundary (odd cols of a contiguous
// array: each row at its own phase, every operand at the same one). The
// aligned packs between a row's edges are cached; the edges (PeeledRow) stay
// in their threads' registers, packs of one element.
template <typename Op, typename Load, typename Store, typename C, typename Cache, bool packed_cache,
          int pack_size, int block_size, int cached, bool peel, typename RowHead>
__device__ __forceinline__ void softmax_block_smem(const Load (&loads)[Op::num_inputs], const Store& store,
                                                   int64 rows, int64 cols, const RowHead& row_head) {
  static_assert(!Op::can_fold, "outputs written unfolded: a folding Op needs write_row");
  constexpr int N = Op::num_inputs;
  static_assert(Op::sum_inputs <= cached && cached <= N, "the sum reads cached inputs only");
  extern __shared__ __align__(16) unsigned char shared_buf[];
  typedef Pack<Cache, pack_size> P;
  const int64 cache_cols = peel ? cols / pack_size * pack_size : cols;   // 16-byte aligned regions
  Cache* const cache = reinterpret_cast<Cache*>(shared_buf);
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const PeeledRow<pack_size, peel> packs(cols, peel ? row_head(row) : 0);
    const int num_packs = static_cast<int>(packs.num_packs);
    // The packs before the row's live end (RowEnd): those the max and sum read.
    const int live_packs = static_cast<int>(
        RowEnd<Load>::template packs_before<pack_size>(loads[0], row, cols, packs.head, packs.num_packs));
    // Where element i of pack p of input j lives.
    auto slot = [&](int j, int p, int i) -> Cache& {
      return packed_cache ? cache[j * cache_cols + p * pack_size + i] : cache[j * cache_cols + i * num_packs + p];
    };
    C edge[N][1];
    packs.load_edges(loads, row, Op::pad(), edge);
    C thread_max = edge[0][0];
    for (int p = threadIdx.x; p < live_packs; p += block_size) {
#pragma unroll
      for (int j = 0; j < cached; ++j) {
        C values[pack_size];
        loads[j].template load<pack_size>(values, row, packs.pack_col(p));
        if (Op::needs_max && j == 0) {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) thread_max = MaxOp<C>()(thread_max, values[i]);
        }
        if constexpr (packed_cache) {
          P packed;
#pragma unroll
          for (int i = 0; i < pack_size; ++i) packed.elem[i] = cast<Cache>(values[i]);
          store_pack_shared(cache + j * cache_cols + p * pack_size, packed);
        } else {
#pragma unroll
          for (int i = 0; i < pack_size; ++i) slot(j, p, i) = values[i];
        }
      }
    }
    Op op;
    if (Op::needs_max) op.set_max(block_all_reduce<MaxOp, C, block_size>(thread_max));
    C thread_sum = 0;
    if (packs.has_edge()) add_pack_terms(op, edge, thread_sum);
    C v[N];
#pragma unroll
    for (int j = cached; j < N; ++j) v[j] = Op::pad();   // not read by term()
    for (int p = threadIdx.x; p < live_packs; p += block_size) {
#pragma unroll
      for (int i = 0; i < pack_size; ++i) {
#pragma unroll
        for (int j = 0; j < cached; ++j) v[j] = cast<C>(slot(j, p, i));
        thread_sum += op.template term<!packed_cache>(v);
        if constexpr (!packed_cache) {
#pragma unroll
          for (int j = 0; j < cached; ++j) slot(j, p, i) = v[j];
        }
      }
    }
    const C sum = block_all_reduce<SumOp, C, block_size>(thread_sum);
    op.set_sum(sum);
    finish_row(store, op, sum, row, threadIdx.x == 0, 0);
    if (packs.has_edge()) store_pack_outputs(op, store, edge, row, packs.edge_col);
    for (int p = threadIdx.x; p < num_packs; p += block_size) {
      if constexpr (RowEnd<Load>::bounded) {
        if (p >= live_packs) {
          store.template store_past<pack_size>(row, packs.pack_col(p),
                                               RowEnd<Load>::template past_output<C>(op));
          continue;
        }
      }
      C read[N][pack_size];   // the inputs past the cache
#pragma unroll
      for (int j = cached; j < N; ++j) loads[j].template load<pack_size>(read[j], row, packs.pack_col(p));
      C values[pack_size];
#pragma unroll
      for (int i = 0; i < pack_size; ++i) {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = j < cached ? cast<C>(slot(j, p, i)) : read[j][i];
        values[i] = op.template out<!packed_cache>(v);
      }
      store.template store<pack_size>(values, row, packs.pack_col(p));
    }
  }
}

// ---------------------------------------------------------------------------
// Uncached path: a block owns a row and reads it from global memory again for
// every pass. Forward: online = false is OneFlow's three passes (max, sum,
// output); online = true two, the first keeping a running (max, sum).
// Backward: two passes (sum, output). peel: as softmax_block_smem, the edges
// read once and held in registers.
template <typename Op, typename Load, typename Store, typename C, int pack_size, int block_size,
          bool online, bool peel, typename RowHead>
__device__ __forceinline__ void softmax_block_uncached(const Load (&loads)[Op::num_inputs],
                                                       const Store& store, int64 rows, int64 cols,
                                                       const RowHead& row_head) {
  static_assert(!Op::can_fold, "outputs written unfolded: a folding Op needs write_row");
  constexpr int N = Op::num_inputs;
  for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const PeeledRow<pack_size, peel> packs(cols, peel ? row_head(row) : 0);
    const int64 num_packs = packs.num_packs;
    // The packs before the row's live end (RowEnd): those the max and sum read.
    const int64 live_packs = RowEnd<Load>::template packs_before<pack_size>(loads[0], row, cols, packs.head,
                                                                             packs.num_packs);
    // Loads pack p of every input; element i of input j lands in values[j][i].
    auto load_packs = [&](int64 p, C (&values)[N][pack_size]) {
#pragma unroll
      for (int j = 0; j < N; ++j) loads[j].template load<pack_size>(values[j], row, packs.pack_col(p));
    };
    C edge[N][1];
    packs.load_edges(loads, row, Op::pad(), edge);
    Op op;
    C values[N][pack_size];
    if constexpr (Op::needs_max && online) {
      OnlineSoftmaxState<C> state{-infinity<C>(), C(0)};
      if (packs.has_edge()) state.add_pack(edge[0]);
      for (int64 p = threadIdx.x; p < live_packs; p += block_size) {
        load_packs(p, values);
        state.add_pack(values[0]);
      }
      const OnlineSoftmaxState<C> row_state = state.template block_all_reduce<block_size>();
      op.set_max(row_state.max);
      op.set_sum(row_state.sum);
      finish_row(store, op, row_state.sum, row, threadIdx.x == 0, 0);
    } else {
      if (Op::needs_max) {
        C thread_max = edge[0][0];
        for (int64 p = threadIdx.x; p < live_packs; p += block_size) {
          loads[0].template load<pack_size>(values[0], row, packs.pack_col(p));
#pragma unroll
          for (int i = 0; i < pack_size; ++i) thread_max = MaxOp<C>()(thread_max, values[0][i]);
        }
        op.set_max(block_all_reduce<MaxOp, C, block_size>(thread_max));
      }
      C thread_sum = 0;
      if (packs.has_edge()) add_pack_terms(op, edge, thread_sum);
      for (int64 p = threadIdx.x; p < live_packs; p += block_size) {
        load_packs(p, values);
        add_pack_terms(op, values, thread_sum);
      }
      const C sum = block_all_reduce<SumOp, C, block_size>(thread_sum);
      op.set_sum(sum);
      finish_row(store, op, sum, row, threadIdx.x == 0, 0);
    }
    if (packs.has_edge()) store_pack_outputs(op, store, edge, row, packs.edge_col);
    for (int64 p = threadIdx.x; p < num_packs; p += block_size) {
      if constexpr (RowEnd<Load>::bounded) {
        if (p >= live_packs) {
          store.template store_past<pack_size>(row, packs.pack_col(p),
                                               RowEnd<Load>::template past_output<C>(op));
          continue;
        }
      }
      load_packs(p, values);
      store_pack_outputs(op, store, values, row, packs.pack_col(p));
    }
  }
}

}  // namespace cupyops
