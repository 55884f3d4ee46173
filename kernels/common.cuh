// cupyops device code shared by every kernel family: scalar types, packs,
// Load/Store functors and the math used in compute type.
#pragma once

namespace cupyops {

typedef long long int64;

// 16-bit floating types as raw storage; arithmetic happens in float.
struct __align__(2) half_t { unsigned short bits; };
struct __align__(2) bfloat16_t { unsigned short bits; };

template <typename Dst, typename Src>
__device__ __forceinline__ Dst cast(Src v) { return static_cast<Dst>(v); }

template <>
__device__ __forceinline__ float cast<float, half_t>(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
// A bfloat16 is the high half of a float: one mov, kept opaque to the
// compiler. Written as a shift, ptxas held more values live and the bfloat16
// norm backward spilled 16-100 bytes a thread where float16 spilled none.
template <>
__device__ __forceinline__ float cast<float, bfloat16_t>(bfloat16_t v) {
  float f;
  asm("mov.b32 %0, {%1, %2};" : "=f"(f) : "h"(static_cast<unsigned short>(0)), "h"(v.bits));
  return f;
}
template <>
__device__ __forceinline__ half_t cast<half_t, float>(float f) {
  half_t v;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v.bits) : "f"(f));
  return v;
}
template <>
__device__ __forceinline__ bfloat16_t cast<bfloat16_t, float>(float f) {
  bfloat16_t v;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v.bits) : "f"(f));
  return v;
}
template <>
__device__ __forceinline__ half_t cast<half_t, half_t>(half_t v) { return v; }
template <>
__device__ __forceinline__ bfloat16_t cast<bfloat16_t, bfloat16_t>(bfloat16_t v) { return v; }

// IfTrue where `condition`, else IfFalse (std::conditional, without the header).
template <bool condition, typename IfTrue, typename IfFalse>
struct Select {
  typedef IfTrue type;
};
template <typename IfTrue, typename IfFalse>
struct Select<false, IfTrue, IfFalse> {
  typedef IfFalse type;
};

// N consecutive elements moved as one access (N * sizeof(T) <= 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T elem[N];
};

// The native type of `bytes` bytes that one load or store instruction moves.
template <int bytes> struct Vector;
template <> struct Vector<1> { typedef unsigned char type; };
template <> struct Vector<2> { typedef unsigned short type; };
template <> struct Vector<4> { typedef unsigned type; };
template <> struct Vector<8> { typedef uint2 type; };
template <> struct Vector<16> { typedef uint4 type; };

// A pack seen as the native vectors one access each moves: one per 16 bytes
// (a smaller pack: one vector of its size).
template <typename T, int N>
union PackVectors {
  enum : int { bytes = sizeof(T) * N, count = (bytes + 15) / 16 };   // enum: no device global
  typedef typename Vector<(bytes < 16 ? bytes : 16)>::type V;
  Pack<T, N> pack;
  V vectors[count];
};

// One access per vector of the pack. 16- and 8-byte global stores are written
// in PTX: given a column known only at run time (peeled rows), the compiler
// otherwise split a pack's store into element stores.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* address) {
  typedef PackVectors<T, N> Bits;
  Bits bits;
#pragma unroll
  for (int i = 0; i < Bits::count; ++i) bits.vectors[i] = reinterpret_cast<const typename Bits::V*>(address)[i];
  return bits.pack;
}

// A 16-byte pack at an address off the 16-byte grid (a per-column vector read
// at a peeled row's columns), `word_shift` = (address % 16) / 4 known at
// compile time: the aligned 16 bytes holding its first element, and the next
// 16 unless the address is aligned (both hold elements of the pack, so
// neither leaves the array's 16-byte extent), the words picked at compile
// time and, for elements under 4 bytes, funnel-shifted by the rest: two
// vector loads and four funnel shifts (none for wider elements) in place of
// N element loads.
template <typename T, int N, int word_shift>
__device__ __forceinline__ Pack<T, N> load_pack_realigned(const T* address) {
  static_assert(sizeof(T) * N == 16 && word_shift >= 0 && word_shift < 4, "16-byte packs, 4 words");
  const unsigned long long bits = reinterpret_cast<unsigned long long>(address);
  const uint4* const aligned = reinterpret_cast<const uint4*>(bits & ~15ull);
  const unsigned bit_shift = sizeof(T) < 4 ? static_cast<unsigned>(bits & 3u) * 8u : 0u;
  const uint4 low = aligned[0];
  const uint4 high = word_shift != 0 || bit_shift != 0 ? aligned[1] : low;
  const unsigned words[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
  unsigned picked[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    picked[i] = sizeof(T) < 4 ? __funnelshift_r(words[i + word_shift], words[i + word_shift + 1], bit_shift)
                              : words[i + word_shift];
  }
  PackVectors<T, N> out;
  out.vectors[0] = make_uint4(picked[0], picked[1], picked[2], picked[3]);
  return out.pack;
}

// Calls body(Constant<word_shift>()) for the word shift of `offset` (bytes
// past a 16-byte boundary): a branch, the same for a whole row, instead of
// selecting words at run time in every pack.
template <int value>
struct Constant {
  static constexpr int get = value;
};
// Calls body(Constant<i>()) for i = first .. last - 1, in order: indices a body
// can use as template arguments.
template <int first, int last, typename Body>
__device__ __forceinline__ void for_each_constant(const Body& body) {
  if constexpr (first < last) {
    body(Constant<first>());
    for_each_constant<first + 1, last>(body);
  }
}
template <typename Body>
__device__ __forceinline__ void with_word_shift(unsigned offset, const Body& body) {
  switch ((offset & 15u) / 4u) {
    case 0: body(Constant<0>()); break;
    case 1: body(Constant<1>()); break;
    case 2: body(Constant<2>()); break;
    default: body(Constant<3>()); break;
  }
}

__device__ __forceinline__ unsigned byte_offset(const void* address) {
  return static_cast<unsigned>(reinterpret_cast<unsigned long long>(address) & 15u);
}

// A 16-byte pack at any element offset, the offset known at run time alone:
// the 8-byte words around it (two loads, a third unless the address is on
// the 8-byte grid; each holds elements of the pack, so none leaves the
// array's 8-byte extent), picked by selects and, for elements under 4 bytes,
// funnel-shifted: no branch, one code path for every offset.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack_unaligned(const T* address) {
  static_assert(sizeof(T) * N == 16, "16-byte packs");
  const unsigned long long bits = reinterpret_cast<unsigned long long>(address);
  const uint2* const aligned = reinterpret_cast<const uint2*>(bits & ~7ull);
  const unsigned bit_shift = sizeof(T) < 4 ? static_cast<unsigned>(bits & 3u) * 8u : 0u;
  const bool odd_word = (bits & 4u) != 0;
  const uint2 first = aligned[0];
  const uint2 second = aligned[1];
  const uint2 third = (bits & 7u) != 0 ? aligned[2] : second;
  const unsigned words[6] = {first.x, first.y, second.x, second.y, third.x, third.y};
  unsigned picked[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) picked[i] = odd_word ? words[i + 1] : words[i];
  PackVectors<T, N> out;
  unsigned* const result = reinterpret_cast<unsigned*>(&out.vectors[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) result[i] = sizeof(T) < 4 ? __funnelshift_r(picked[i], picked[i + 1], bit_shift) : picked[i];
  return out.pack;
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* address, const Pack<T, N>& pack) {
  typedef PackVectors<T, N> Bits;
  typedef typename Bits::V V;
  Bits bits;
  bits.pack = pack;
#pragma unroll
  for (int i = 0; i < Bits::count; ++i) {
    V* const target = reinterpret_cast<V*>(address) + i;
    if constexpr (sizeof(V) == 16) {
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(target), "r"(bits.vectors[i].x),
                   "r"(bits.vectors[i].y), "r"(bits.vectors[i].z), "r"(bits.vectors[i].w) : "memory");
    } else if constexpr (sizeof(V) == 8) {
      asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(target), "r"(bits.vectors[i].x),
                   "r"(bits.vectors[i].y) : "memory");
    } else {
      *target = bits.vectors[i];
    }
  }
}

// A pack stored to shared memory as whole vectors (a struct copy of a pack
// of 16-bit elements may be split into element stores).
template <typename T, int N>
__device__ __forceinline__ void store_pack_shared(T* address, const Pack<T, N>& pack) {
  typedef PackVectors<T, N> Bits;
  Bits bits;
  bits.pack = pack;
#pragma unroll
  for (int i = 0; i < Bits::count; ++i) reinterpret_cast<typename Bits::V*>(address)[i] = bits.vectors[i];
}

// Reads row `row`, columns [col, col + N) of a row-major matrix whose rows are
// `row_stride` elements apart, converting to the compute type.
// fetch() is the load alone, in the storage type (see RegisterRow).
template <typename Src, typename Dst>
struct DirectLoad {
  typedef Src Storage;
  const Src* src;
  int64 row_stride;
  template <int N>
  __device__ __forceinline__ Pack<Src, N> fetch(int64 row, int64 col) const {
    return load_pack<Src, N>(src + row * row_stride + col);
  }
  template <int N>
  __device__ __forceinline__ void load(Dst* dst, int64 row, int64 col) const {
    const Pack<Src, N> pack = fetch<N>(row, col);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = cast<Dst>(pack.elem[i]);
  }
};

// The values of N row operands a thread holds in registers: num_packs packs
// of pack_size each. storage = false keeps them in the compute type C;
// storage = true keeps the loaded packs of T and converts at each use: half
// the registers for 16-bit inputs, and every pack's load is issued before the
// first is converted (converting as they arrive made the compiler wait on each
// load in turn). Only compute-type values can be replaced (set).
template <typename T, typename C, int N, int num_packs, int pack_size, bool storage>
struct RegisterRow {
  static constexpr int size = num_packs * pack_size;
  Pack<T, pack_size> packs[N][storage ? num_packs : 1];
  C values[N][storage ? 1 : size];

  template <typename Load>
  __device__ __forceinline__ void load(int j, int k, const Load& source, int64 row, int64 col) {
    if constexpr (storage) {
      packs[j][k] = source.template fetch<pack_size>(row, col);
    } else {
      source.template load<pack_size>(values[j] + k * pack_size, row, col);
    }
  }
  __device__ __forceinline__ C get(int j, int i) const {
    if constexpr (storage) {
      return cast<C>(packs[j][i / pack_size].elem[i % pack_size]);
    } else {
      return values[j][i];
    }
  }
  __device__ __forceinline__ void set(int j, int i, C value) {
    if constexpr (!storage) values[j][i] = value;
  }
  // Holds a pack fetched in the storage type (converted now unless storage).
  __device__ __forceinline__ void set_pack(int j, int k, const Pack<T, pack_size>& pack) {
    if constexpr (storage) {
      packs[j][k] = pack;
    } else {
#pragma unroll
      for (int i = 0; i < pack_size; ++i) values[j][k * pack_size + i] = cast<C>(pack.elem[i]);
    }
  }
};

template <typename Src, typename Dst>
struct DirectStore {
  Dst* dst;
  int64 row_stride;
  template <int N>
  __device__ __forceinline__ void store(const Src* src, int64 row, int64 col) const {
    Pack<Dst, N> pack;
#pragma unroll
    for (int i = 0; i < N; ++i) pack.elem[i] = cast<Dst>(src[i]);
    store_pack(dst + row * row_stride + col, pack);
  }
};

// Asynchronous copy of the 4-, 8- or 16-byte pack `global_offset` bytes past
// global_base to `shared_offset` bytes past shared_base (a shared-state-space
// address), global -> shared (sm_80+); 16-byte copies bypass L1. The offsets
// ride in the instruction, so copies from one base hold no register for each
// address. The "memory" clobbers keep the compiler from moving this thread's
// shared-memory accesses across the copy or the wait.
template <int bytes, int shared_offset, int global_offset>
__device__ __forceinline__ void cp_async_pack_at(unsigned shared_base, const void* global_base) {
  static_assert(bytes == 4 || bytes == 8 || bytes == 16, "cp.async moves 4, 8 or 16 bytes");
  if constexpr (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%3], 16;" ::"r"(shared_base), "l"(global_base),
                 "n"(shared_offset), "n"(global_offset) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0+%2], [%1+%3], %4;" ::"r"(shared_base), "l"(global_base),
                 "n"(shared_offset), "n"(global_offset), "n"(bytes) : "memory");
  }
}
// One pack, from a generic shared-memory pointer.
template <int bytes>
__device__ __forceinline__ void cp_async_pack(void* shared, const void* global) {
  cp_async_pack_at<bytes, 0, 0>(static_cast<unsigned>(__cvta_generic_to_shared(shared)), global);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most `pending` committed groups of this thread are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}
// cp_async_wait<pending> for a `pending` of 0 .. max_pending known once loops unroll.
template <int max_pending>
__device__ __forceinline__ void cp_async_wait_at_most(int pending) {
  if constexpr (max_pending == 0) {
    cp_async_wait<0>();
  } else if (pending >= max_pending) {
    cp_async_wait<max_pending>();
  } else {
    cp_async_wait_at_most<max_pending - 1>(pending);
  }
}
// Waits for every cp.async this thread has issued.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Elements from the start of each row to its first 16-byte boundary.
template <typename T>
struct RowHead {
  const T* base;
  int64 row_stride;
  __device__ __forceinline__ int operator()(int64 row) const {
    const unsigned misalignment = reinterpret_cast<unsigned long long>(base + row * row_stride) & 15u;
    return static_cast<int>(((16u - misalignment) & 15u) / sizeof(T));
  }
};

// A row of a row-per-block kernel as packs of pack_size elements from column
// `head`, the same for every operand. peel (rows off the 16-byte grid): head
// is the row's RowHead and the elements outside the packs, the head and the
// rest past the last whole pack (fewer than 2 * pack_size, so at most one a
// thread of a block of 32 or more), are single "edge" elements held by
// threads 0, 1, ...; without peel, head is 0 and the packs cover the row.
// (The register paths compute the edges after issuing their packs' loads
// instead: given first, ptxas issued some of those loads late.)
template <int pack_size, bool peel>
struct PeeledRow {
  int head;
  int64 num_packs;
  int num_edges;
  int64 edge_col;    // this thread's edge, where has_edge()

  __device__ __forceinline__ PeeledRow(int64 cols, int row_head) : head(peel ? row_head : 0) {
    num_packs = (cols - head) / pack_size;   // a row shorter than its head: 0, every element an edge
    const int64 tail = head + num_packs * pack_size;
    num_edges = peel ? static_cast<int>(cols - num_packs * pack_size) : 0;
    edge_col = threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;
  }
  __device__ __forceinline__ int64 pack_col(int64 pack) const { return head + pack * pack_size; }
  __device__ __forceinline__ bool has_edge() const { return peel && static_cast<int>(threadIdx.x) < num_edges; }
  // This thread's edge element of every input as a pack of one, edge[j][0]
  // (the packs' helpers take it), or pad where it holds none.
  template <typename Load, typename C, int N>
  __device__ __forceinline__ void load_edges(const Load (&loads)[N], int64 row, C pad, C (&edge)[N][1]) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      edge[j][0] = pad;
      if (has_edge()) loads[j].template load<1>(edge[j], row, edge_col);
    }
  }
};

// The rows a block of a row-per-block kernel owns: rows_per_block rows a
// block (one per threadIdx.y), first() and every step() after it.
template <int block_size, int rows_per_block>
struct BlockRows {
  static_assert(rows_per_block == 1 || block_size == 32,
                "rows share a block only as a warp each: their reductions take no block barrier");
  __device__ __forceinline__ int64 first() const {
    return static_cast<int64>(blockIdx.x) * rows_per_block + (rows_per_block > 1 ? threadIdx.y : 0);
  }
  __device__ __forceinline__ int64 step() const { return static_cast<int64>(gridDim.x) * rows_per_block; }
};

// floor(n / d) for 0 <= n < 2^31 and d >= 2 by a multiply-high and a shift: d's multiplier and
// shift made on the host (cupyops.launch.fast_divisor).
__device__ __forceinline__ unsigned fast_quotient(unsigned n, unsigned multiplier, unsigned shift) {
  return __umulhi(n, multiplier) >> shift;
}

// n / d and n % d for 0 <= n: by fast_quotient with `magic` = multiplier << 32 | shift from the
// host (n < 2^31; d = 1 is n itself), or (wide: n from 2^31 on) by dividing.
struct DivMod {
  int64 quotient, remainder;
};
template <bool wide>
__device__ __forceinline__ DivMod divmod(int64 n, int64 d, unsigned long long magic) {
  if constexpr (wide) {
    const int64 quotient = n / d;
    return {quotient, n - quotient * d};
  } else {   // 32-bit arithmetic: n, d and the quotient are below 2^31
    const unsigned low = static_cast<unsigned>(n), divisor = static_cast<unsigned>(d);
    const unsigned quotient = divisor == 1 ? low : fast_quotient(low, static_cast<unsigned>(magic >> 32),
                                                                 static_cast<unsigned>(magic & 63));
    return {quotient, low - quotient * divisor};
  }
}

template <typename T> __device__ __forceinline__ T infinity();
template <> __device__ __forceinline__ float infinity<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double infinity<double>() { return __longlong_as_double(0x7ff0000000000000LL); }

template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fffffff); }
template <> __device__ __forceinline__ double quiet_nan<double>() { return __longlong_as_double(0x7fffffffffffffffLL); }

__device__ __forceinline__ float exp_(float x) { return __expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }

// 2^t by the special-function unit (MUFU.EX2, as __expf uses it: ~2 ulp).
__device__ __forceinline__ float exp2_(float t) {
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(t));
  return result;
}

}  // namespace cupyops
