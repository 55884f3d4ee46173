// Fused attention softmax: z = x * scale + bias, masked positions (a bool
// mask, the causal rule) at -inf, softmax along the row, then dropout. The
// softmax paths of softmax.cuh run unchanged; the fusion goes in through
// their LOAD and STORE functors. x is row-major and contiguous, so element
// (row, col) has the linear index row * cols + col, the dropout counter.
// bias and mask are read in their own (broadcast) shape: their offsets along
// x's leading dims (at most 3 after merging) are worked out once a row.
#pragma once
#include "common.cuh"
#include "philox.cuh"
#include "softmax.cuh"

namespace cupyops {

// Offsets of the broadcast operands of one row: x's leading dims sizes[0..2]
// (outermost first; unused dims have size 1) and each operand's strides
// along them, in elements (0 where it is broadcast); its column stride is 0
// or 1. causal: row % causal_rows is the query index q, and col > q +
// diagonal is masked. A row's indices come from divmod by sizes[2], sizes[1]
// and causal_rows with the host's magic numbers (size_magic[0] unused); wide:
// rows or operand offsets from 2^31 on, which divide and take 64-bit offsets
// (else 32-bit ones). bias_vectors, mask_words: the host guarantees the
// operand's column stride is 1 and every pack of N columns at a multiple of N
// starts on its own boundary (up to 16 bytes): a pack of the bias is one
// vector load, one of the mask (N a multiple of 4) N / 4 words, each
// position tested in its word. Otherwise each pack checks its address.
template <typename B, bool has_bias, bool has_mask, bool causal, bool wide, bool bias_vectors, bool mask_words>
struct BroadcastRow {
  typedef typename Select<wide, int64, int>::type Offset;
  static constexpr bool kCausal = causal;
  const B* bias;
  const bool* mask;
  int64 sizes[3];
  int64 bias_strides[4];      // leading dims, then the column
  int64 mask_strides[4];
  int64 causal_rows;
  int64 diagonal;
  unsigned long long size_magic[3];
  unsigned long long causal_magic;
  // The row the offsets below belong to (-1: none yet).
  mutable int64 row = -1, last_col = 0;
  mutable Offset bias_base = 0, mask_base = 0;

  __device__ __forceinline__ void locate(int64 at) const {
    if (at == row) return;
    row = at;
    const DivMod inner = divmod<wide>(at, sizes[2], size_magic[2]);
    const DivMod outer = divmod<wide>(inner.quotient, sizes[1], size_magic[1]);
    const Offset index[3] = {static_cast<Offset>(outer.quotient), static_cast<Offset>(outer.remainder),
                             static_cast<Offset>(inner.remainder)};
    Offset bias_offset = 0, mask_offset = 0;
#pragma unroll
    for (int d = 0; d < 3; ++d) {
      if (has_bias) bias_offset += index[d] * static_cast<Offset>(bias_strides[d]);
      if (has_mask) mask_offset += index[d] * static_cast<Offset>(mask_strides[d]);
    }
    bias_base = bias_offset;
    mask_base = mask_offset;
    if (causal) last_col = divmod<wide>(at, causal_rows, causal_magic).remainder + diagonal;
  }
  // Whether the causal rule masks all of columns col.. of the located row: their x (and dy)
  // need not be read.
  __device__ __forceinline__ bool causal_from(int64 col) const { return causal && col > last_col; }
  // Whether the causal rule masks all of columns col..col + N of row `at` (then located):
  // dst then holds `value` there, and x (and dy) need not be read.
  template <int N, typename C>
  __device__ __forceinline__ bool fill_if_masked_whole(C* dst, int64 at, int64 col, C value) const {
    locate(at);
    if (!causal_from(col)) return false;
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = value;
    return true;
  }
  // The end of the located row's columns the causal rule keeps, within [0, cols].
  __device__ __forceinline__ int64 causal_end(int64 cols) const {
    return last_col < 0 ? int64(0) : last_col >= cols ? cols : last_col + 1;
  }
  __device__ __forceinline__ bool masked(int64 col) const {
    bool out = false;
    if (has_mask) out = !mask[mask_base + static_cast<Offset>(col) * static_cast<Offset>(mask_strides[3])];
    if (causal) out = out || col > last_col;
    return out;
  }
  // dropped[i] = masked(col + i) and bias[i] for N consecutive columns of the located row.
  template <typename C, int N>
  __device__ __forceinline__ void pack_at(int64 col, bool (&dropped)[N], C (&bias_values)[N]) const {
    bool kept[N];
    B added[N];
    if (has_mask) mask_pack(col, kept);
    if (has_bias) bias_pack(col, added);
    // the causal rule keeps columns col..col + kept_to: one 64-bit difference a pack, then
    // 32-bit compares (kept_to clamped to -1..N)
    const int64 room = causal ? last_col - col : int64(N);
    const int kept_to = room < 0 ? -1 : room > N ? N : static_cast<int>(room);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dropped[i] = (has_mask && !kept[i]) || (causal && i > kept_to);
      bias_values[i] = has_bias ? cast<C>(added[i]) : C(0);
    }
  }

 private:
  template <int N>
  __device__ __forceinline__ void bias_pack(int64 col, B (&added)[N]) const {
    if constexpr (bias_vectors && N > 1) {
      const Pack<B, N> pack = load_pack<B, N>(bias + bias_base + static_cast<Offset>(col));
#pragma unroll
      for (int i = 0; i < N; ++i) added[i] = pack.elem[i];
    } else {
      gather(bias + bias_base + static_cast<Offset>(col) * static_cast<Offset>(bias_strides[3]), bias_strides[3],
             added);
    }
  }
  template <int N>
  __device__ __forceinline__ void mask_pack(int64 col, bool (&kept)[N]) const {
    if constexpr (mask_words && N % 4 == 0) {
      const Pack<unsigned, N / 4> words = load_pack<unsigned, N / 4>(
          reinterpret_cast<const unsigned*>(mask + mask_base + static_cast<Offset>(col)));
#pragma unroll
      for (int i = 0; i < N; ++i) kept[i] = (words.elem[i / 4] & (0xffu << (8 * (i % 4)))) != 0u;
    } else {
      gather(mask + mask_base + static_cast<Offset>(col) * static_cast<Offset>(mask_strides[3]), mask_strides[3],
             kept);
    }
  }
  // N elements `stride` (0 or 1) apart: one vector load where they are
  // consecutive and the address allows it.
  template <typename V, int N>
  static __device__ __forceinline__ void gather(const V* first, int64 stride, V (&out)[N]) {
    if (N > 1 && stride == 1 && reinterpret_cast<unsigned long long>(first) % (sizeof(V) * N) == 0) {
      const Pack<V, N> pack = load_pack<V, N>(first);
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] = pack.elem[i];
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] = first[i * stride];
    }
  }
};

// The order the paths take rows in: the paths count rows i = 0, 1, ... and the
// functors below read and write data row order(i). interleaved: x's outermost
// leading dim (`outer` entries of `inner` rows, a bias broadcast along it) runs
// innermost, i -> (i % outer) * inner + i / outer, so the rows that read one
// bias row run together and it comes from memory once rather than once an entry.
// Dropout's counter and the lse follow the data row: the result does not depend
// on the order.
template <bool interleaved, bool wide>
struct RowOrder {
  int64 outer, inner;
  unsigned long long outer_magic;
  __device__ __forceinline__ int64 operator()(int64 i) const {
    if (!interleaved) return i;
    const DivMod entry = divmod<wide>(i, outer, outer_magic);
    return entry.remainder * inner + entry.quotient;
  }
};

// The RowHead (common.cuh) of data row order(i), for the paths that peel.
template <typename T, typename Order>
struct OrderedRowHead {
  RowHead<T> head;
  Order order;
  __device__ __forceinline__ int operator()(int64 i) const { return head(order(i)); }
};

// The scores z of a row, in the compute type C: the LOAD of the forward. Packs the causal
// rule masks whole are not read. The asynchronous path caches x's packs as they are and
// has them turned into scores here (from_pack; CachedLoad in async_row.cuh).
template <typename T, typename C, typename Broadcast, typename Order>
struct ScoresLoad {
  typedef T Storage;
  // Under the causal rule a row's passes stop at its last kept column (RowEnd, softmax.cuh).
  static constexpr bool kRowEnds = Broadcast::kCausal;
  static constexpr bool kFromPack = true;
  const T* x;
  int64 row_stride;
  C scale;
  Broadcast broadcast;
  Order order;
  __device__ __forceinline__ int64 live_end(int64 i, int64 cols) const {
    broadcast.locate(order(i));
    return broadcast.causal_end(cols);
  }
  // A score past the live end.
  template <typename V>
  static __device__ __forceinline__ V past_value() { return -infinity<V>(); }
  template <int N>
  __device__ __forceinline__ void load(C* dst, int64 i, int64 col) const { load_row<N>(dst, order(i), col); }
  // The same for data row `row`.
  template <int N>
  __device__ __forceinline__ void load_row(C* dst, int64 row, int64 col) const {
    if (!broadcast.template fill_if_masked_whole<N>(dst, row, col, -infinity<C>())) {
      scores<N>(dst, row, col, load_pack<T, N>(x + row * row_stride + col));
    }
  }
  // x's row i, and the scores of its pack at col from the pack itself.
  __device__ __forceinline__ const T* row_source(int64 i) const { return x + order(i) * row_stride; }
  template <int N>
  __device__ __forceinline__ void from_pack(C* dst, int64 i, int64 col, const Pack<T, N>& pack) const {
    const int64 row = order(i);
    if (!broadcast.template fill_if_masked_whole<N>(dst, row, col, -infinity<C>())) scores<N>(dst, row, col, pack);
  }

 private:
  // The scores of a pack of data row `row`, located by fill_if_masked_whole.
  template <int N>
  __device__ __forceinline__ void scores(C* dst, int64 row, int64 col, const Pack<T, N>& pack) const {
    bool dropped[N];
    C bias_values[N];
    broadcast.template pack_at<C, N>(col, dropped, bias_values);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const C z = cast<C>(pack.elem[i]) * scale + bias_values[i];
      dst[i] = dropped[i] ? -infinity<C>() : z;
    }
  }
};

// The forward's STORE: y = softmax * keep / (1 - p), the Op's outputs (which
// finish_row scales by 1 / (1 - p)) where kept. A masked position gives
// 0, also in a row with no kept position (whose softmax is NaN). Where lse is
// given, each row's float32 log-sum-exp of z goes there too (finish_row).
template <typename C, typename T, typename Broadcast, typename Order, typename Mask, bool dropout>
struct DropoutStore {
  T* y;
  int64 row_stride;
  Broadcast broadcast;
  Order order;
  Mask drop;                 // DropoutMask, or GroupedDropoutMask where each pack starts a group
  C keep_scale;              // 1 / (1 - p)
  float* lse;                // nullptr: not wanted
  // Whether the row being stored may give a NaN at a masked position: its max is -inf (no
  // kept position) or NaN, or its sum is NaN (an inf or NaN score). In any other row a masked
  // position's exp(-inf - max) / sum is 0, so only these rows look at their outputs.
  mutable bool unsettled = true;
  // Every thread, once its row's max and sum are known and before the row's stores; the
  // leader writes lse[row] = max + log(sum exp(z - max)), -inf for a row with no kept position.
  // With dropout, op's outputs take the 1 / (1 - p) of the kept ones.
  template <typename Op>
  __device__ __forceinline__ void finish_row(Op& op, C sum, int64 i, bool leader) const {
    static_assert(Op::Exp::natural, "sum is of exp(z - max)");
    const C max = op.finish.max;
    unsettled = !(max > -infinity<C>() && sum > C(0));
    if (leader && lse != nullptr) lse[order(i)] = static_cast<float>(max == -infinity<C>() ? max : max + log(sum));
    if (dropout) op.scale_outputs(keep_scale);
  }
  // Past a row's live end (RowEnd, softmax.cuh) every position is masked: zeros.
  template <int N, typename Output>
  __device__ __forceinline__ void store_past(int64 i, int64 col, const Output&) const {
    store_zeros<N>(i, col);
  }
  template <int N>
  __device__ __forceinline__ void store(const C* src, int64 i, int64 col) const {
    const int64 row = order(i);
    if constexpr (dropout && Broadcast::kCausal) {
      // a pack the causal rule masks whole is zeros: no dropout bits are drawn for it
      broadcast.locate(row);
      if (broadcast.causal_from(col)) {
        store_zeros<N>(i, col);
        return;
      }
    }
    bool kept[N];
    if (dropout) drop.template keep_pack<N>(static_cast<unsigned long long>(row * row_stride + col), kept);
    C values[N];
#pragma unroll
    for (int i = 0; i < N; ++i) values[i] = src[i];
    if (unsettled) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (values[i] != values[i]) zero_if_masked(values[i], row, col + i);
      }
    }
    Pack<T, N> pack;
#pragma unroll
    for (int i = 0; i < N; ++i) pack.elem[i] = cast<T>(dropout && !kept[i] ? C(0) : values[i]);
    store_pack(y + row * row_stride + col, pack);
  }

 private:
  // Zeros at columns col..col + N of row i, which the causal rule masks whole: no dropout
  // bits are drawn.
  template <int N>
  __device__ __forceinline__ void store_zeros(int64 i, int64 col) const {
    Pack<T, N> pack;
#pragma unroll
    for (int k = 0; k < N; ++k) pack.elem[k] = cast<T>(C(0));
    store_pack(y + order(i) * row_stride + col, pack);
  }
  // A NaN output: 0 where the position is masked (a row with no kept position gives
  // exp(-inf - -inf)); a NaN of the input elsewhere stays.
  __device__ __forceinline__ void zero_if_masked(C& value, int64 row, int64 col) const {
    broadcast.locate(row);
    if (broadcast.masked(col)) value = C(0);
  }
};

// The backward's two LOADs (one type: the paths take an array of one LOAD),
// as SoftmaxBackward's inputs:
//   dy (probability = false): dy * keep / (1 - p), the gradient of the softmax;
//   y  (probability = true):  the softmax exp(z - lse), recomputed from x and
//      the row's log-sum-exp (0 where z or lse is -inf: masked, or a row with
//      no kept position).
template <typename T, typename C, typename Scores, typename Mask, bool dropout>
struct FusedGradLoad {
  typedef T Storage;
  static constexpr bool kFromPack = true;   // the asynchronous path's packs (CachedLoad)
  // Under the causal rule the block paths stop reading a row at its last kept column (RowEnd,
  // softmax.cuh): y and dy read as 0 past it, as in a pack the rule masks whole.
  static constexpr bool kRowEnds = Scores::kRowEnds;
  bool probability;
  const T* src;              // dy or x
  int64 row_stride;
  Scores scores;
  const float* lse;
  Mask drop;
  C keep_scale;
  template <int N>
  __device__ __forceinline__ void load(C* dst, int64 i, int64 col) const {
    const int64 row = scores.order(i);
    if (probability) {
      scores.template load_row<N>(dst, row, col);
      probabilities<N>(dst, row);
    } else if (!scores.broadcast.template fill_if_masked_whole<N>(dst, row, col, C(0))) {   // y = 0 there
      gradient<N>(dst, row, col, load_pack<T, N>(src + row * row_stride + col));
    }
  }
  __device__ __forceinline__ int64 live_end(int64 i, int64 cols) const { return scores.live_end(i, cols); }
  template <typename V>
  static __device__ __forceinline__ V past_value() { return V(0); }
  // The row i of src, and the values of its pack at col from the pack itself.
  __device__ __forceinline__ const T* row_source(int64 i) const { return src + scores.order(i) * row_stride; }
  template <int N>
  __device__ __forceinline__ void from_pack(C* dst, int64 i, int64 col, const Pack<T, N>& pack) const {
    const int64 row = scores.order(i);
    if (probability) {
      scores.template from_pack<N>(dst, i, col, pack);
      probabilities<N>(dst, row);
    } else if (!scores.broadcast.template fill_if_masked_whole<N>(dst, row, col, C(0))) {
      gradient<N>(dst, row, col, pack);
    }
  }

 private:
  // The scores z in dst made exp(z - lse).
  template <int N>
  __device__ __forceinline__ void probabilities(C* dst, int64 row) const {
    const C row_lse = static_cast<C>(lse[row]);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dst[i] = dst[i] == -infinity<C>() || row_lse == -infinity<C>() ? C(0) : exp_(dst[i] - row_lse);
    }
  }
  template <int N>
  __device__ __forceinline__ void gradient(C* dst, int64 row, int64 col, const Pack<T, N>& pack) const {
    bool kept[N];
    if (dropout) drop.template keep_pack<N>(static_cast<unsigned long long>(row * row_stride + col), kept);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const C g = cast<C>(pack.elem[i]);
      dst[i] = dropout ? (kept[i] ? g * keep_scale : C(0)) : g;
    }
  }
};

// dx = scale * dz: the backward's STORE.
template <typename C, typename T, typename Order>
struct ScaledStore {
  T* dst;
  int64 row_stride;
  C scale;
  Order order;
  // Past a row's live end (RowEnd, softmax.cuh) dz is the one value output(): y = 0 there, so
  // 0 except in a row whose sum is not finite.
  template <int N, typename Output>
  __device__ __forceinline__ void store_past(int64 i, int64 col, const Output& output) const {
    const C value = output();
    C values[N];
#pragma unroll
    for (int k = 0; k < N; ++k) values[k] = value;
    store<N>(values, i, col);
  }
  template <int N>
  __device__ __forceinline__ void store(const C* src, int64 i, int64 col) const {
    Pack<T, N> pack;
#pragma unroll
    for (int k = 0; k < N; ++k) pack.elem[k] = cast<T>(src[k] * scale);
    store_pack(dst + order(i) * row_stride + col, pack);
  }
};

}  // namespace cupyops
